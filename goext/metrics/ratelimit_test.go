package metrics

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/config"
)

// clientFrom is an HTTP client whose connections come from the loopback
// address ip (all of 127.0.0.0/8 is this host on Linux).
func clientFrom(ip string) *http.Client {
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}, Timeout: 2 * time.Second}
	return &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{DialContext: d.DialContext}}
}

func status(t *testing.T, c *http.Client, addr string) int {
	t.Helper()
	resp, err := c.Get("http://" + addr + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	_, err = io.Copy(io.Discard, resp.Body)
	require.NoError(t, err)
	return resp.StatusCode
}

// A client over its scrape rate gets 429 (and is served nothing), while
// another client is still served. The rate here refills one scrape per
// thousand seconds, so only the burst counts.
func TestScrapeRateLimitedPerClient(t *testing.T) {
	const burst = 3
	s, err := New().ServeWith("127.0.0.1:0", ServerOptions{ScrapesPerSecond: 0.001, ScrapeBurst: burst})
	require.NoError(t, err)
	defer s.Close()
	flood, other := clientFrom("127.0.0.2"), clientFrom("127.0.0.3")
	for i := range burst {
		require.Equal(t, http.StatusOK, status(t, flood, s.Addr), "scrape %d of the burst", i)
	}
	for range 5 {
		require.Equal(t, http.StatusTooManyRequests, status(t, flood, s.Addr))
	}
	require.Equal(t, http.StatusOK, status(t, other, s.Addr))
}

// Buckets are per IPv4 address and per IPv6 /64.
func TestClientKey(t *testing.T) {
	for remote, want := range map[string]string{
		"10.0.0.7:5000":               "10.0.0.7",
		"[::ffff:10.0.0.7]:5000":      "10.0.0.7",
		"[2001:db8:1:2:aaaa::1]:5000": "2001:db8:1:2::",
		"[2001:db8:1:2:bbbb::9]:6000": "2001:db8:1:2::",
		"[2001:db8:1:3::1]:6000":      "2001:db8:1:3::",
		"not-an-address":              "invalid IP",
	} {
		require.Equal(t, want, clientKey(remote).String(), remote)
	}
}

// The remembered clients are bounded: when the table is full, clients whose
// buckets have refilled are forgotten to make room; while none has, a new
// client is refused.
func TestClientTableBounded(t *testing.T) {
	l := newClientLimiter(1, 1)
	t0 := time.Unix(1000, 0)
	for i := range maxClients {
		require.True(t, l.allow(fmt.Sprintf("10.%d.%d.1:1", i/256, i%256), t0))
	}
	require.False(t, l.allow("192.168.0.1:1", t0), "a new client while every bucket is in use")
	require.Len(t, l.mu.clients, maxClients)
	require.True(t, l.allow("192.168.0.1:1", t0.Add(2*time.Second)), "buckets refilled after a second")
	require.Len(t, l.mu.clients, 1)
}

// The endpoint binds loopback unless DYN_KVBM_METRICS_HOST widens it.
func TestEndpointHost(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
	require.NoError(t, ln.Close())
	for host, want := range map[string]string{
		"":        "127.0.0.1",
		"0.0.0.0": "0.0.0.0",
	} {
		env := map[string]string{config.EnvMetricsPort: port}
		if host != "" {
			env[config.EnvMetricsHost] = host
		}
		cfg, err := config.FromLookup(func(k string) (string, bool) { v, ok := env[k]; return v, ok })
		require.NoError(t, err)
		require.Equal(t, net.JoinHostPort(want, port), cfg.MetricsAddr())
		s, err := New().ServeWith(cfg.MetricsAddr(), ServerOptionsFrom(cfg))
		require.NoError(t, err)
		bound, err := net.ResolveTCPAddr("tcp", s.Addr)
		require.NoError(t, err)
		if want == "127.0.0.1" {
			require.True(t, bound.IP.IsLoopback(), "bound to %s", s.Addr)
		} else {
			require.True(t, bound.IP.IsUnspecified(), "bound to %s", s.Addr)
		}
		require.NoError(t, scrape(s.Addr))
		require.NoError(t, s.Close())
	}

	env := map[string]string{config.EnvMetricsHost: "::1"}
	cfg, err := config.FromLookup(func(k string) (string, bool) { v, ok := env[k]; return v, ok })
	require.NoError(t, err)
	require.Equal(t, "[::1]:6880", cfg.MetricsAddr())

	env = map[string]string{config.EnvMetricsHost: "http://0.0.0.0"}
	_, err = config.FromLookup(func(k string) (string, bool) { v, ok := env[k]; return v, ok })
	require.ErrorContains(t, err, config.EnvMetricsHost)
}
