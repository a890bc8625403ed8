package admin

import (
	"bufio"
	"context"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/hashing"
	"github.com/kvbm/kvbm/goext/leader"
)

type fakeTarget struct {
	mu   sync.Mutex
	reqs []leader.PurgeRequest
}

func (f *fakeTarget) Purge(_ context.Context, r leader.PurgeRequest) (leader.PurgeResult, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reqs = append(f.reqs, r)
	return leader.PurgeResult{HostBlocks: 2}, nil
}

func (f *fakeTarget) Stats() leader.Stats { return leader.Stats{BlockSize: 16} }

func call(t *testing.T, sock string, req any) map[string]any {
	t.Helper()
	c, err := net.Dial("unix", sock)
	require.NoError(t, err)
	defer c.Close()
	b, err := json.Marshal(req)
	require.NoError(t, err)
	_, err = c.Write(append(b, '\n'))
	require.NoError(t, err)
	line, err := bufio.NewReader(c).ReadBytes('\n')
	require.NoError(t, err)
	var out map[string]any
	require.NoError(t, json.Unmarshal(line, &out))
	return out
}

func strp(s string) *string { return &s }

// TestEndpoint: the socket and token are private to the user; a caller
// without the token (or with a wrong one) is refused and nothing runs; with
// it, stats and purges reach the target with the salt hashes of design §3.
func TestEndpoint(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "admin")
	f := &fakeTarget{}
	s, err := Start(dir, f, nil)
	require.NoError(t, err)
	for _, p := range []string{s.Socket(), s.TokenFile()} {
		fi, err := os.Stat(p)
		require.NoError(t, err)
		require.Equal(t, os.FileMode(0o600), fi.Mode().Perm(), p)
	}
	fi, err := os.Stat(dir)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), fi.Mode().Perm())
	tok, err := os.ReadFile(s.TokenFile())
	require.NoError(t, err)
	token := strings.TrimSpace(string(tok))

	for _, bad := range []map[string]any{
		{"op": "purge", "all": true},
		{"op": "purge", "all": true, "token": strings.Repeat("0", len(token))},
		{"op": "stats", "token": token[:10]},
	} {
		out := call(t, s.Socket(), bad)
		require.Equal(t, false, out["ok"])
		require.Contains(t, out["error"], "admin: unauthenticated")
	}
	require.Empty(t, f.reqs, "nothing ran for an unauthenticated caller")

	out := call(t, s.Socket(), Request{Token: token, Op: "stats"})
	require.Equal(t, true, out["ok"], out)
	require.Equal(t, float64(16), out["result"].(map[string]any)["block_size"])

	out = call(t, s.Socket(), Request{Token: token, Op: "purge", Salt: strp("tenant"), Loras: []string{"x", "y"}})
	require.Equal(t, true, out["ok"], out)
	out = call(t, s.Socket(), Request{Token: token, Op: "purge", Salt: strp("tenant")})
	require.Equal(t, true, out["ok"], out)
	out = call(t, s.Socket(), Request{Token: token, Op: "purge", PrefixTokens: []uint32{1, 2, 3}, Lora: strp("x")})
	require.Equal(t, true, out["ok"], out)
	out = call(t, s.Socket(), Request{Token: token, Op: "purge", All: true})
	require.Equal(t, true, out["ok"], out)
	require.Equal(t, []leader.PurgeRequest{
		{Salts: []uint64{hashing.SaltHash("tenant", true, "x", true), hashing.SaltHash("tenant", true, "y", true)}},
		{Salts: []uint64{hashing.SaltHash("tenant", true, "", false)}},
		{Prefix: []uint32{1, 2, 3}, PrefixSalt: hashing.SaltHash("", false, "x", true)},
		{All: true},
	}, f.reqs)

	for _, bad := range []Request{
		{Token: token, Op: "purge"},
		{Token: token, Op: "purge", All: true, Salt: strp("t")},
		{Token: token, Op: "reboot"},
	} {
		out := call(t, s.Socket(), bad)
		require.Equal(t, false, out["ok"])
		require.Contains(t, out["error"], "admin: ")
	}

	s.Close()
	for _, p := range []string{s.Socket(), s.TokenFile()} {
		_, err := os.Stat(p)
		require.ErrorIs(t, err, os.ErrNotExist, p)
	}
}

// TestEndpointRefusesSharedDir: a directory others can enter is refused.
func TestEndpointRefusesSharedDir(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "shared")
	require.NoError(t, os.Mkdir(dir, 0o755))
	require.NoError(t, os.Chmod(dir, 0o755))
	_, err := Start(dir, &fakeTarget{}, nil)
	require.ErrorContains(t, err, "admin: endpoint directory")
}
