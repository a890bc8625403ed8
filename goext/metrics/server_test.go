package metrics

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/config"
)

// openFDs counts this process's open file descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	entries, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(entries)
}

// scrape fetches /metrics once.
func scrape(addr string) error {
	client := &http.Client{Timeout: 2 * time.Second}
	resp, err := client.Get("http://" + addr + "/metrics")
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "kvbm_offload_blocks_d2h") {
		return fmt.Errorf("scrape: status %d, %d bytes", resp.StatusCode, len(body))
	}
	return nil
}

// checkFor polls fn every interval until it returns nil or timeout passes.
func checkFor(t *testing.T, timeout, interval time.Duration, fn func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		err := fn()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %s: %v", timeout, err)
		}
		time.Sleep(interval)
	}
}

// TestServerBoundsIdleConnections: a flood of idle connections (far more
// than the limit) holds at most MaxConns of the server's descriptors, the
// held ones are closed when the header timeout expires, and a scrape then
// succeeds.
func TestServerBoundsIdleConnections(t *testing.T) {
	const (
		maxConns = 8
		flood    = maxConns + 100
		timeout  = time.Second
	)
	s, err := New().ServeWith("127.0.0.1:0", ServerOptions{
		MaxConns: maxConns, ReadHeaderTimeout: timeout, ReadTimeout: timeout, IdleTimeout: timeout,
	})
	require.NoError(t, err)
	defer s.Close()
	require.NoError(t, scrape(s.Addr))

	base := openFDs(t)
	conns := make([]net.Conn, 0, flood)
	defer func() {
		for _, c := range conns {
			_ = c.Close()
		}
	}()
	for range flood {
		c, err := net.Dial("tcp", s.Addr)
		require.NoError(t, err)
		conns = append(conns, c)
	}
	// The client ends are ours too: what is beyond them is the server's.
	// Sampled for most of the timeout, while every idle connection is
	// still within it.
	peak := 0
	for end := time.Now().Add(timeout / 2); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		peak = max(peak, openFDs(t)-base-flood)
	}
	const slack = 4 // connections being closed right now, the runtime's own
	require.LessOrEqual(t, peak, maxConns+slack, "server descriptors held by %d idle connections", flood)

	// Every idle connection is closed by the server: the ones beyond the
	// limit at once, the held ones when the header timeout expires.
	for i, c := range conns {
		require.NoError(t, c.SetReadDeadline(time.Now().Add(3*timeout)))
		_, err := c.Read(make([]byte, 1))
		require.Error(t, err)
		var ne net.Error
		require.False(t, errors.As(err, &ne) && ne.Timeout(), "idle connection %d still open after %s", i, 3*timeout)
	}
	checkFor(t, 3*timeout, 20*time.Millisecond, func() error { return scrape(s.Addr) })
}

// TestServerDefaults: zero ServerOptions take the defaults, so that Serve
// is never without limits.
func TestServerDefaults(t *testing.T) {
	var o ServerOptions
	o.fill()
	require.Equal(t, ServerOptions{
		MaxConns: DefaultMaxConns, ReadHeaderTimeout: DefaultReadHeaderTimeout, ReadTimeout: DefaultReadTimeout,
		WriteTimeout: DefaultWriteTimeout, IdleTimeout: DefaultIdleTimeout,
		ScrapesPerSecond: DefaultScrapesPerSecond, ScrapeBurst: DefaultScrapeBurst,
	}, o)
}

// TestServerClosesTricklingClients: a client that sends its request headers
// a byte at a time (slowloris) is cut off when ReadHeaderTimeout expires,
// however steadily it trickles.
func TestServerClosesTricklingClients(t *testing.T) {
	const timeout = 300 * time.Millisecond
	s, err := New().ServeWith("127.0.0.1:0", ServerOptions{ReadHeaderTimeout: timeout})
	require.NoError(t, err)
	defer s.Close()
	c, err := net.Dial("tcp", s.Addr)
	require.NoError(t, err)
	defer c.Close()
	start := time.Now()
	header := []byte("GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + strings.Repeat("a", 1000))
	for _, b := range header {
		if _, err := c.Write([]byte{b}); err != nil {
			break // closed by the server
		}
		if time.Since(start) > 10*timeout {
			t.Fatalf("still accepting header bytes after %s", time.Since(start))
		}
		time.Sleep(20 * time.Millisecond)
	}
	require.Less(t, time.Since(start), 10*timeout)
	require.NoError(t, scrape(s.Addr))
}

// TestEndpointServesAnotherSetsFamilies: a leader's endpoint also serves the
// transfer families of a worker's set (Also = Families(...)), once each,
// without the families both sets have.
func TestEndpointServesAnotherSetsFamilies(t *testing.T) {
	leader, worker := New(), New()
	worker.BytesMoved.WithLabelValues("g1_to_g2").Add(4096)
	worker.OffloadD2H.Add(7) // not selected: the leader's own counter is served
	leader.OffloadD2H.Add(3)
	leader.Also = worker.Families("kvbm_transfer_bytes")
	srv, err := leader.Serve("127.0.0.1:0")
	require.NoError(t, err)
	defer srv.Close()
	resp, err := http.Get("http://" + srv.Addr + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	text := string(body)
	require.Equal(t, http.StatusOK, resp.StatusCode, text)
	require.Contains(t, text, `kvbm_transfer_bytes{direction="g1_to_g2"} 4096`)
	require.Contains(t, text, "kvbm_offload_blocks_d2h 3")
	require.Equal(t, 1, strings.Count(text, "\nkvbm_offload_blocks_d2h "))
}

// TestServerOptionsFromEnvironment: the DYN_KVBM_METRICS_* variables set the
// endpoint's bounds: with DYN_KVBM_METRICS_MAX_CONNECTIONS=2 a third idle
// connection is closed at once, and the two held ones when the header
// timeout (DYN_KVBM_METRICS_READ_HEADER_TIMEOUT_SECS=1) expires.
func TestServerOptionsFromEnvironment(t *testing.T) {
	env := map[string]string{
		config.EnvMetricsMaxConnections:        "2",
		config.EnvMetricsReadHeaderTimeoutSecs: "1",
		config.EnvMetricsReadTimeoutSecs:       "2",
		config.EnvMetricsWriteTimeoutSecs:      "3",
		config.EnvMetricsIdleTimeoutSecs:       "4",
	}
	cfg, err := config.FromLookup(func(k string) (string, bool) { v, ok := env[k]; return v, ok })
	require.NoError(t, err)
	o := ServerOptionsFrom(cfg)
	require.Equal(t, ServerOptions{MaxConns: 2, ReadHeaderTimeout: time.Second, ReadTimeout: 2 * time.Second,
		WriteTimeout: 3 * time.Second, IdleTimeout: 4 * time.Second}, o)

	s, err := New().ServeWith("127.0.0.1:0", o)
	require.NoError(t, err)
	defer s.Close()
	var held []net.Conn
	defer func() {
		for _, c := range held {
			_ = c.Close()
		}
	}()
	for range 2 {
		c, err := net.Dial("tcp", s.Addr)
		require.NoError(t, err)
		held = append(held, c)
	}
	// The third is refused once the two above are accepted; a connection
	// accepted while the server is still taking the first two may be held
	// for a moment, so retry until one is closed at once.
	checkFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		c, err := net.Dial("tcp", s.Addr)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
		if _, err := c.Read(make([]byte, 1)); err == nil || isTimeout(err) {
			return fmt.Errorf("a connection beyond DYN_KVBM_METRICS_MAX_CONNECTIONS stayed open")
		}
		return nil
	})
	for i, c := range held {
		require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
		_, err := c.Read(make([]byte, 1))
		require.Error(t, err)
		require.False(t, isTimeout(err), "idle connection %d not closed by the header timeout", i)
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
