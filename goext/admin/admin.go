// Package admin is the leader's operator endpoint (design §12): a Unix
// socket in a directory private to this user, through which `python -m kvbm
// purge` / `stats` (and kvbm.admin from Python) reach a running engine's
// kvbm.
//
// Authentication is two checks, both required: the connecting process runs
// as this user (the socket's directory is 0700 and the socket 0600, and
// the kernel's SO_PEERCRED says the peer's uid), and the request carries
// the endpoint's token, 32 random bytes written beside the socket in a
// 0600 file (so a process of this user that may not read the user's files,
// e.g. in a sandbox, is refused as well). Anything else gets an error
// naming what was missing, and nothing runs.
//
// Protocol: one JSON request per connection, one JSON reply, each a single
// line. Request: {"token": "<hex>", "op": "purge" | "stats", ...} with, for
// a purge, exactly one of "salt" (a cache salt, with "lora" optionally: the
// adapter it was used with; "loras": several), "prefix_tokens" (with
// "salt"/"lora" of the requests that sent them), or "all": true. Reply:
// {"ok": true, "result": {...}} or {"ok": false, "error": "..."}.
package admin

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kvbm/kvbm/goext/hashing"
	"github.com/kvbm/kvbm/goext/integrity"
	"github.com/kvbm/kvbm/goext/leader"
)

// Target is what the endpoint operates on (a *leader.Leader).
type Target interface {
	Purge(ctx context.Context, req leader.PurgeRequest) (leader.PurgeResult, error)
	Stats() leader.Stats
}

// Limits of one request.
const (
	MaxRequestBytes = 64 << 20 // a prefix of millions of tokens fits
	RequestTimeout  = 5 * time.Minute
	readTimeout     = 30 * time.Second
	maxConns        = 4
)

// Dir is the endpoint directory: dir when set (config resolves
// DYN_KVBM_ADMIN_DIR, else $XDG_RUNTIME_DIR/kvbm), else /tmp/kvbm-<uid>.
func Dir(dir string) string {
	if dir != "" {
		return dir
	}
	return filepath.Join(os.TempDir(), "kvbm-"+strconv.Itoa(os.Geteuid()))
}

// SocketName and TokenName are the files of endpoint n (1, 2, ... in the
// order a process starts them: a process may hold several leaders) of
// process pid.
func SocketName(pid, n int) string { return fmt.Sprintf("kvbm-%d-%d.sock", pid, n) }
func TokenName(pid, n int) string  { return fmt.Sprintf("kvbm-%d-%d.token", pid, n) }

// started numbers the endpoints of this process.
var started atomic.Int64

// Server is a running endpoint.
type Server struct {
	ln     *net.UnixListener
	sock   string
	tokenF string
	token  []byte // hex, as sent
	t      Target
	log    *slog.Logger
	sem    chan struct{}
	wg     sync.WaitGroup
	ctx    context.Context
	cancel context.CancelFunc
}

// Start creates dir (0700, checked like kvbm's other private directories),
// the token file and the socket of this process, and serves t.
func Start(dir string, t Target, log *slog.Logger) (*Server, error) {
	if log == nil {
		log = slog.Default()
	}
	dir = Dir(dir)
	if err := integrity.PrivateDir(dir); err != nil {
		return nil, fmt.Errorf("admin: endpoint directory: %w", err)
	}
	pid, n := os.Getpid(), int(started.Add(1))
	s := &Server{sock: filepath.Join(dir, SocketName(pid, n)), tokenF: filepath.Join(dir, TokenName(pid, n)), t: t, log: log,
		sem: make(chan struct{}, maxConns)}
	raw := make([]byte, 32)
	if _, err := rand.Read(raw); err != nil {
		return nil, fmt.Errorf("admin: token: %w", err)
	}
	s.token = []byte(hex.EncodeToString(raw))
	_ = os.Remove(s.tokenF) // a stale one of a dead process that had this pid
	f, err := os.OpenFile(s.tokenF, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, fmt.Errorf("admin: token file: %w", err)
	}
	_, err = f.Write(append(s.token, '\n'))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = os.Remove(s.tokenF)
		return nil, fmt.Errorf("admin: token file: %w", err)
	}
	_ = os.Remove(s.sock)
	old := syscall.Umask(0o177) // the socket is created 0600
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: s.sock, Net: "unix"})
	syscall.Umask(old)
	if err != nil {
		_ = os.Remove(s.tokenF)
		return nil, fmt.Errorf("admin: listen on %s: %w", s.sock, err)
	}
	if err := os.Chmod(s.sock, 0o600); err != nil {
		_ = ln.Close()
		_ = os.Remove(s.tokenF)
		return nil, fmt.Errorf("admin: %s: %w", s.sock, err)
	}
	s.ln = ln
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.wg.Add(1)
	go s.serve()
	log.Info("kvbm operator endpoint (python -m kvbm purge|stats)", "socket", s.sock)
	return s, nil
}

// Socket is the socket's path.
func (s *Server) Socket() string { return s.sock }

// TokenFile is the token file's path.
func (s *Server) TokenFile() string { return s.tokenF }

// Close stops serving, waits for requests in progress, and removes the
// socket and the token.
func (s *Server) Close() {
	s.cancel()
	_ = s.ln.Close()
	s.wg.Wait()
	_ = os.Remove(s.sock)
	_ = os.Remove(s.tokenF)
}

func (s *Server) serve() {
	defer s.wg.Done()
	for {
		c, err := s.ln.AcceptUnix()
		if err != nil {
			if s.ctx.Err() != nil {
				return
			}
			s.log.Debug("kvbm operator endpoint: accept", "err", err)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		select {
		case s.sem <- struct{}{}:
		default:
			reply(c, nil, errors.New("admin: busy: too many requests in progress"))
			_ = c.Close()
			continue
		}
		s.wg.Add(1)
		go func() {
			defer func() { <-s.sem; s.wg.Done() }()
			defer c.Close()
			defer func() {
				if r := recover(); r != nil {
					s.log.Error("kvbm operator endpoint: request failed", "panic", fmt.Sprint(r))
					reply(c, nil, fmt.Errorf("admin: internal error: %v", r))
				}
			}()
			s.handle(c)
		}()
	}
}

// Request is one operator request.
type Request struct {
	Token        string   `json:"token"`
	Op           string   `json:"op"`
	Salt         *string  `json:"salt,omitempty"`
	Lora         *string  `json:"lora,omitempty"`
	Loras        []string `json:"loras,omitempty"`
	PrefixTokens []uint32 `json:"prefix_tokens,omitempty"`
	All          bool     `json:"all,omitempty"`
}

func (s *Server) handle(c *net.UnixConn) {
	if err := peerIsUs(c); err != nil {
		reply(c, nil, err)
		return
	}
	_ = c.SetReadDeadline(time.Now().Add(readTimeout))
	r := bufio.NewReaderSize(c, 64<<10)
	line, err := readLine(r)
	if err != nil {
		reply(c, nil, err)
		return
	}
	var req Request
	if err := json.Unmarshal(line, &req); err != nil {
		reply(c, nil, fmt.Errorf("admin: request is not JSON: %w", err))
		return
	}
	if subtle.ConstantTimeCompare([]byte(req.Token), s.token) != 1 {
		s.log.Warn("kvbm operator endpoint: request without the right token refused")
		reply(c, nil, fmt.Errorf("admin: unauthenticated: the request does not carry this engine's token (read it from %s)", s.tokenF))
		return
	}
	_ = c.SetDeadline(time.Now().Add(RequestTimeout))
	switch req.Op {
	case "stats":
		reply(c, s.t.Stats(), nil)
	case "purge":
		pr, err := purgeRequest(&req)
		if err != nil {
			reply(c, nil, err)
			return
		}
		ctx, cancel := context.WithTimeout(s.ctx, RequestTimeout)
		defer cancel()
		res, err := s.t.Purge(ctx, pr)
		s.log.Info("kvbm purge", "salted", req.Salt != nil, "prefix_tokens", len(req.PrefixTokens), "all", req.All,
			"host_blocks", res.HostBlocks, "disk_blocks", res.DiskBlocks, "g4_deleted", res.G4Deleted, "err", err)
		reply(c, res, err)
	default:
		reply(c, nil, fmt.Errorf("admin: unknown op %q (purge, stats)", req.Op))
	}
}

// purgeRequest turns the operator's salt, LoRA names and tokens into the
// leader's request (salt hashes, design §3).
func purgeRequest(req *Request) (leader.PurgeRequest, error) {
	var loras []*string
	if req.Lora != nil {
		loras = append(loras, req.Lora)
	}
	for i := range req.Loras {
		loras = append(loras, &req.Loras[i])
	}
	hashOf := func(lora *string) uint64 {
		salt, l := "", ""
		if req.Salt != nil {
			salt = *req.Salt
		}
		if lora != nil {
			l = *lora
		}
		return hashing.SaltHash(salt, req.Salt != nil, l, lora != nil)
	}
	switch {
	case req.All:
		if req.Salt != nil || len(loras) > 0 || len(req.PrefixTokens) > 0 {
			return leader.PurgeRequest{}, errors.New("admin: purge: all excludes salt, lora and prefix_tokens")
		}
		return leader.PurgeRequest{All: true}, nil
	case len(req.PrefixTokens) > 0:
		if len(loras) > 1 {
			return leader.PurgeRequest{}, errors.New("admin: purge: a prefix is hashed under one salt and at most one lora")
		}
		var lora *string
		if len(loras) == 1 {
			lora = loras[0]
		}
		return leader.PurgeRequest{Prefix: req.PrefixTokens, PrefixSalt: hashOf(lora)}, nil
	case req.Salt != nil || len(loras) > 0:
		var salts []uint64
		if len(loras) == 0 {
			salts = append(salts, hashOf(nil))
		}
		for _, l := range loras {
			salts = append(salts, hashOf(l))
		}
		return leader.PurgeRequest{Salts: salts}, nil
	}
	return leader.PurgeRequest{}, errors.New("admin: purge: give salt (and lora), prefix_tokens, or all")
}

func readLine(r *bufio.Reader) ([]byte, error) {
	var line []byte
	for {
		chunk, more, err := r.ReadLine()
		if err != nil {
			return nil, fmt.Errorf("admin: read request: %w", err)
		}
		line = append(line, chunk...)
		if len(line) > MaxRequestBytes {
			return nil, fmt.Errorf("admin: request larger than %d bytes", MaxRequestBytes)
		}
		if !more {
			return line, nil
		}
	}
}

// peerIsUs checks the connecting process's uid (SO_PEERCRED).
func peerIsUs(c *net.UnixConn) error {
	raw, err := c.SyscallConn()
	if err != nil {
		return fmt.Errorf("admin: peer credentials: %w", err)
	}
	var cred *syscall.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = syscall.GetsockoptUcred(int(fd), syscall.SOL_SOCKET, syscall.SO_PEERCRED)
	}); err != nil {
		return fmt.Errorf("admin: peer credentials: %w", err)
	}
	if cerr != nil {
		return fmt.Errorf("admin: peer credentials: %w", cerr)
	}
	if int(cred.Uid) != os.Geteuid() {
		return fmt.Errorf("admin: unauthenticated: peer uid %d is not this engine's user (uid %d)", cred.Uid, os.Geteuid())
	}
	return nil
}

func reply(c net.Conn, result any, err error) {
	out := map[string]any{"ok": err == nil}
	if err != nil {
		out["error"] = err.Error()
	}
	if result != nil {
		out["result"] = result
	}
	b, _ := json.Marshal(out)
	_, _ = c.Write(append(b, '\n'))
}
