package metrics

import (
	"net/http"
	"net/netip"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// Scrape rate per client. Gathering and encoding every family is what a
// scrape costs (13k scrapes/s from one client took 0.9 of a core); a
// Prometheus scrapes every few seconds, and tools that poll for a condition
// (kvbm's test harness polls every 50 ms) stay under 20/s. A client over
// the rate gets 429, which costs the server only the request's parsing.
const (
	DefaultScrapesPerSecond = 25
	DefaultScrapeBurst      = 50
	// maxClients bounds the clients whose buckets are remembered. When
	// full, the buckets that have refilled (clients idle long enough to be
	// treated as new) are forgotten; if none has, a new client waits for
	// one, answered 429.
	maxClients = 4096
)

// clientLimiter is a token bucket per client: per IPv4 address, per /64
// for IPv6 (one host commonly holds a whole /64).
type clientLimiter struct {
	limit rate.Limit
	burst int

	// mu's mutex guards clients.
	mu struct {
		sync.Mutex
		clients map[netip.Addr]*rate.Limiter
	}
}

func newClientLimiter(perSecond float64, burst int) *clientLimiter {
	l := &clientLimiter{limit: rate.Limit(perSecond), burst: burst}
	l.mu.clients = make(map[netip.Addr]*rate.Limiter)
	return l
}

// clientKey is the bucket's key of a request's remote address.
func clientKey(remote string) netip.Addr {
	ap, err := netip.ParseAddrPort(remote)
	if err != nil {
		return netip.Addr{} // not an IP (a test's pipe): one shared bucket
	}
	a := ap.Addr().Unmap()
	if a.Is6() {
		p, _ := a.Prefix(64)
		a = p.Addr()
	}
	return a
}

// allow takes a token from the bucket of the client at remote.
func (l *clientLimiter) allow(remote string, now time.Time) bool {
	key := clientKey(remote)
	l.mu.Lock()
	defer l.mu.Unlock()
	b := l.mu.clients[key]
	if b == nil {
		if len(l.mu.clients) >= maxClients {
			l.forgetIdle(now)
			if len(l.mu.clients) >= maxClients {
				return false
			}
		}
		b = rate.NewLimiter(l.limit, l.burst)
		l.mu.clients[key] = b
	}
	return b.AllowN(now, 1)
}

// forgetIdle drops the buckets that are full again, with mu held: a new
// bucket for the same client would be the same.
func (l *clientLimiter) forgetIdle(now time.Time) {
	for k, b := range l.mu.clients {
		if b.TokensAt(now) >= float64(l.burst) {
			delete(l.mu.clients, k)
		}
	}
}

// wrap answers 429 to a client over its rate, else passes to next.
func (l *clientLimiter) wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !l.allow(r.RemoteAddr, time.Now()) {
			w.Header().Set("Retry-After", "1")
			http.Error(w, "too many scrapes from this client", http.StatusTooManyRequests)
			return
		}
		next.ServeHTTP(w, r)
	})
}
