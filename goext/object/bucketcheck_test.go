package object_test

import (
	"bytes"
	"context"
	"log/slog"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/object"
	"github.com/kvbm/kvbm/internal/s3test"
)

// Generous bounds for liveness checks: only a call that waits on the
// network (a request timeout and more) or hangs exceeds them.
const (
	joinTimeout = 5 * time.Second
	waitFor     = 30 * time.Second
)

// syncBuffer is a log sink the store's goroutines write to.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// g4Metric reads one of the process's G4 metrics.
func g4Metric(t *testing.T, name string) float64 {
	t.Helper()
	r := prometheus.NewRegistry()
	require.NoError(t, object.RegisterMetrics(r))
	fams, err := r.Gather()
	require.NoError(t, err)
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		m := f.GetMetric()[0]
		if m.GetGauge() != nil {
			return m.GetGauge().GetValue()
		}
		return m.GetCounter().GetValue()
	}
	t.Fatalf("no metric %s", name)
	return 0
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitFor)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("still not %s after %s", what, waitFor)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// openChecked opens a store on host with a background bucket check, in a
// goroutine joined with a generous timeout: opening must not wait on the
// network.
func openChecked(t *testing.T, host string, attempt time.Duration, log *syncBuffer) *object.Store {
	t.Helper()
	c, err := object.NewClient(object.ClientOptions{Host: host, Bucket: "kv-check", Region: "us-east-1",
		AccessKey: s3test.AccessKey, SecretKey: s3test.SecretKey})
	require.NoError(t, err)
	type result struct {
		s   *object.Store
		err error
	}
	ch := make(chan result, 1)
	go func() {
		s, err := object.NewStore(object.StoreOptions{Client: c, Fingerprint: fp("m"), BlockBytes: blockBytes,
			Logger: slog.New(slog.NewTextHandler(log, &slog.HandlerOptions{Level: slog.LevelDebug})),
			BucketCheck: &object.BucketCheck{Region: "us-east-1", Timeout: attempt,
				Retry: 10 * time.Millisecond, RetryMax: 40 * time.Millisecond}})
		ch <- result{s, err}
	}()
	select {
	case r := <-ch:
		require.NoError(t, r.err)
		t.Cleanup(r.s.Close)
		return r.s
	case <-time.After(joinTimeout):
		t.Fatalf("opening a store waited on the network (%s and more)", joinTimeout)
		return nil
	}
}

// TestBucketCheckBlackholed: a store on an endpoint that accepts and never
// answers opens at once. Once its first check timed out it is Unavailable
// (counted in kvbm_g4_unavailable, logged once) and retries in the
// background; it becomes Ready when the endpoint answers.
func TestBucketCheckBlackholed(t *testing.T) {
	bh := s3test.NewBlackhole(t)
	unavailable := g4Metric(t, "kvbm_g4_unavailable")
	failures := g4Metric(t, "kvbm_g4_bucket_check_failures")
	var log syncBuffer
	s := openChecked(t, bh.Addr, 100*time.Millisecond, &log)
	require.False(t, s.Ready())

	eventually(t, "unavailable", s.Unavailable)
	require.Equal(t, unavailable+1, g4Metric(t, "kvbm_g4_unavailable"))
	eventually(t, "retried", func() bool { return g4Metric(t, "kvbm_g4_bucket_check_failures") >= failures+3 })
	require.False(t, s.Ready())
	require.True(t, s.Unavailable())
	require.Positive(t, bh.Held(), "the checks reached the endpoint")
	require.Equal(t, 1, strings.Count(log.String(), "bucket not reachable"), "logged once")

	bh.Heal()
	eventually(t, "ready", s.Ready)
	require.False(t, s.Unavailable())
	require.Equal(t, unavailable, g4Metric(t, "kvbm_g4_unavailable"))
	require.Contains(t, log.String(), "G4 on")
}

// TestBucketCheckCloseWhileBlackholed: closing a store whose check waits on
// a silent endpoint returns without waiting the attempt out; a store closed
// while Unavailable is no longer counted.
func TestBucketCheckCloseWhileBlackholed(t *testing.T) {
	bh := s3test.NewBlackhole(t)
	unavailable := g4Metric(t, "kvbm_g4_unavailable")
	var log syncBuffer
	hung := openChecked(t, bh.Addr, time.Hour, &log)
	down := openChecked(t, bh.Addr, 50*time.Millisecond, &log)
	eventually(t, "connected", func() bool { return bh.Held() > 0 })
	eventually(t, "unavailable", down.Unavailable)
	require.False(t, hung.Unavailable(), "first attempt still running")
	require.Equal(t, unavailable+1, g4Metric(t, "kvbm_g4_unavailable"))
	for _, s := range []*object.Store{hung, down} {
		done := make(chan struct{})
		go func() { s.Close(); close(done) }()
		select {
		case <-done:
		case <-time.After(joinTimeout):
			t.Fatal("Close waited on the silent endpoint")
		}
		require.False(t, s.Ready())
	}
	require.Equal(t, unavailable, g4Metric(t, "kvbm_g4_unavailable"))
}

// TestBucketCheckCreatesBucket: against a real S3 server the check creates
// the missing bucket and the store becomes Ready; a store without a check
// is Ready at once.
func TestBucketCheckCreatesBucket(t *testing.T) {
	srv := s3test.Start(t)
	var log syncBuffer
	s := openChecked(t, srv.Addr, 10*time.Second, &log)
	eventually(t, "ready", s.Ready)

	c, err := object.NewClient(object.ClientOptions{Host: srv.Addr, Bucket: "kv-check", Region: "us-east-1",
		AccessKey: s3test.AccessKey, SecretKey: s3test.SecretKey})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	created, err := c.PutIfAbsent(ctx, "probe", []byte("x"))
	require.NoError(t, err, "the bucket exists")
	require.True(t, created)

	require.False(t, s.Unavailable())
	plain, err := object.NewStore(object.StoreOptions{Client: c, Fingerprint: fp("m"), BlockBytes: blockBytes})
	require.NoError(t, err)
	defer plain.Close()
	require.True(t, plain.Ready())
}

// TestUploadWaitsForBucketCheck: an upload queued the moment the store
// opens, before its check created the bucket, waits for the check (on its
// uploader goroutine) instead of failing against a bucket that does not
// exist yet. The check's requests are held back by a proxy, so the upload
// would otherwise reach the server first.
func TestUploadWaitsForBucketCheck(t *testing.T) {
	srv := s3test.Start(t)
	target, err := url.Parse(srv.Endpoint())
	require.NoError(t, err)
	proxy := httptest.NewServer(&httputil.ReverseProxy{Rewrite: func(r *httputil.ProxyRequest) {
		r.SetURL(target)
		r.Out.Host = r.In.Host // the request was signed for the proxy's address
		if strings.Count(strings.Trim(r.In.URL.Path, "/"), "/") == 0 {
			time.Sleep(200 * time.Millisecond) // a bucket request: the check
		}
	}})
	defer proxy.Close()

	var log syncBuffer
	s := openChecked(t, strings.TrimPrefix(proxy.URL, "http://"), 10*time.Second, &log)
	before := object.Local()
	require.True(t, s.Enqueue(7, 0, block(7)))
	flush(t, s)
	after := object.Local()
	require.Equal(t, before.Uploaded+1, after.Uploaded, "uploaded: %s", log.String())
	require.Equal(t, before.Errors, after.Errors)
	require.True(t, s.Ready())
}
