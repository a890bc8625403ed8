package s3test

import (
	"errors"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
)

// Blackhole is an object store endpoint on 127.0.0.1 that accepts
// connections and never answers, as a blackholed or hung server does, until
// Heal. From then on new connections are served by a minimal S3 that
// answers what a bucket check needs: every bucket exists, no object does.
// Connections held before Heal stay silent (their requests time out).
type Blackhole struct {
	Addr string

	ln      net.Listener
	healthy atomic.Bool
	serve   chan net.Conn
	srv     *http.Server
	mu      sync.Mutex // guards held, closed
	held    []net.Conn
	closed  bool
	done    chan struct{}
}

// NewBlackhole starts one; it is closed when the test ends.
func NewBlackhole(t testing.TB) *Blackhole {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	b := &Blackhole{Addr: ln.Addr().String(), ln: ln, serve: make(chan net.Conn), done: make(chan struct{})}
	b.srv = &http.Server{Handler: http.HandlerFunc(bucketOnly)}
	go b.accept()
	go func() { _ = b.srv.Serve(chanListener{b}) }()
	t.Cleanup(b.Close)
	return b
}

// Heal makes the endpoint answer from now on.
func (b *Blackhole) Heal() { b.healthy.Store(true) }

// Held is how many connections the endpoint accepted without answering.
func (b *Blackhole) Held() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.held)
}

// Close stops the endpoint and drops every connection.
func (b *Blackhole) Close() {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return
	}
	b.closed = true
	for _, c := range b.held {
		_ = c.Close()
	}
	b.held = nil
	b.mu.Unlock()
	_ = b.ln.Close()
	close(b.done)
	_ = b.srv.Close()
}

func (b *Blackhole) accept() {
	for {
		c, err := b.ln.Accept()
		if err != nil {
			return
		}
		if b.healthy.Load() {
			select {
			case b.serve <- c:
			case <-b.done:
				_ = c.Close()
				return
			}
			continue
		}
		b.mu.Lock()
		if b.closed {
			_ = c.Close()
		} else {
			b.held = append(b.held, c)
		}
		b.mu.Unlock()
	}
}

// bucketOnly answers a bucket check: HEAD/GET/PUT of a bucket succeed,
// anything about an object is "no such key".
func bucketOnly(w http.ResponseWriter, r *http.Request) {
	if strings.Trim(r.URL.Path, "/") != "" && !strings.Contains(strings.Trim(r.URL.Path, "/"), "/") {
		w.WriteHeader(http.StatusOK)
		return
	}
	w.Header().Set("Content-Type", "application/xml")
	w.WriteHeader(http.StatusNotFound)
	if r.Method != http.MethodHead {
		_, _ = w.Write([]byte(`<?xml version="1.0" encoding="UTF-8"?><Error><Code>NoSuchKey</Code>` +
			`<Message>The specified key does not exist.</Message></Error>`))
	}
}

// chanListener hands the healed connections to the HTTP server.
type chanListener struct{ b *Blackhole }

func (l chanListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.b.serve:
		return c, nil
	case <-l.b.done:
		return nil, errors.New("s3test: blackhole closed")
	}
}
func (l chanListener) Close() error   { return nil }
func (l chanListener) Addr() net.Addr { return l.b.ln.Addr() }
