package s3test

import (
	"encoding/xml"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// Fake is an in-memory S3 server on 127.0.0.1 that speaks just what
// object.Client uses (bucket HEAD/PUT; object PUT with If-None-Match, GET,
// HEAD, DELETE; no authentication), with hooks that let a test play a
// hostile or flaky server: answer a GET or HEAD its own way, and see every
// request that reached it.
type Fake struct {
	Addr string // 127.0.0.1:port

	mu      sync.Mutex // guards the fields below
	buckets map[string]map[string][]byte
	gets    map[string]int // GETs per "bucket/key"
	log     []string       // "METHOD bucket/key" of every request
	onGet   func(key string, stored []byte, nth int) Reply
	onHead  func(key string, stored bool) bool
}

// Reply is a hostile or flaky answer to a GET.
type Reply struct {
	// Status: 0 or 200 serves Body; 404 answers NoSuchKey; any other an S3
	// error of that status.
	Status int
	Body   []byte
	// Cut > 0 declares len(Body) bytes but sends only the first Cut and
	// closes the connection (a body cut short).
	Cut int
}

// StartFake starts a Fake, stopped when the test ends.
func StartFake(t testing.TB) *Fake {
	t.Helper()
	f := &Fake{buckets: make(map[string]map[string][]byte), gets: make(map[string]int)}
	srv := httptest.NewServer(http.HandlerFunc(f.serve))
	t.Cleanup(srv.Close)
	f.Addr = strings.TrimPrefix(srv.URL, "http://")
	return f
}

// OnGet makes fn answer every object GET: key is the object key, stored the
// bytes stored under it (nil when none), nth counts this key's GETs from 1.
// A nil fn serves what is stored.
func (f *Fake) OnGet(fn func(key string, stored []byte, nth int) Reply) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.onGet = fn
}

// OnHead makes fn answer every object HEAD (true: found). Nil: what is stored.
func (f *Fake) OnHead(fn func(key string, stored bool) bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.onHead = fn
}

// Object returns a copy of what is stored under bucket/key.
func (f *Fake) Object(bucket, key string) ([]byte, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	b, ok := f.buckets[bucket][key]
	return append([]byte(nil), b...), ok
}

// Keys returns the object keys stored in bucket.
func (f *Fake) Keys(bucket string) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var ks []string
	for k := range f.buckets[bucket] {
		ks = append(ks, k)
	}
	return ks
}

// Mutate changes what is stored under bucket/key in place (a damaged disk).
func (f *Fake) Mutate(bucket, key string, fn func([]byte)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if b, ok := f.buckets[bucket][key]; ok {
		fn(b)
	}
}

// Requests returns "METHOD bucket/key" for every request received whose
// method is one of methods (all requests when none is given).
func (f *Fake) Requests(methods ...string) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for _, r := range f.log {
		m, _, _ := strings.Cut(r, " ")
		if len(methods) == 0 || contains(methods, m) {
			out = append(out, r)
		}
	}
	return out
}

func contains(ss []string, s string) bool {
	for _, x := range ss {
		if x == s {
			return true
		}
	}
	return false
}

var lastModified = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).Format(http.TimeFormat)

func (f *Fake) serve(w http.ResponseWriter, r *http.Request) {
	bucket, key, _ := strings.Cut(strings.TrimPrefix(r.URL.Path, "/"), "/")
	f.mu.Lock()
	f.log = append(f.log, r.Method+" "+bucket+"/"+key)
	objs, haveBucket := f.buckets[bucket]
	f.mu.Unlock()
	if key == "" { // the bucket itself
		switch r.Method {
		case http.MethodHead:
			if !haveBucket {
				w.WriteHeader(http.StatusNotFound)
			}
		case http.MethodPut:
			f.mu.Lock()
			if f.buckets[bucket] == nil {
				f.buckets[bucket] = make(map[string][]byte)
			}
			f.mu.Unlock()
		default:
			s3Error(w, http.StatusNotImplemented, "NotImplemented", bucket, key)
		}
		return
	}
	if !haveBucket {
		s3Error(w, http.StatusNotFound, "NoSuchBucket", bucket, key)
		return
	}
	switch r.Method {
	case http.MethodPut:
		body := make([]byte, 0, max(r.ContentLength, 0))
		buf := make([]byte, 64<<10)
		for {
			n, err := r.Body.Read(buf)
			body = append(body, buf[:n]...)
			if err != nil {
				break
			}
		}
		f.mu.Lock()
		_, exists := objs[key]
		if !exists || r.Header.Get("If-None-Match") != "*" {
			objs[key] = body
		}
		f.mu.Unlock()
		if exists && r.Header.Get("If-None-Match") == "*" {
			s3Error(w, http.StatusPreconditionFailed, "PreconditionFailed", bucket, key)
			return
		}
		w.Header().Set("ETag", etag(body))
	case http.MethodHead:
		f.mu.Lock()
		b, ok := objs[key]
		hook := f.onHead
		f.mu.Unlock()
		if hook != nil {
			ok = hook(key, ok)
		}
		if !ok {
			w.WriteHeader(http.StatusNotFound)
			return
		}
		w.Header().Set("ETag", etag(b))
		w.Header().Set("Last-Modified", lastModified)
		w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	case http.MethodGet:
		f.mu.Lock()
		b, ok := objs[key]
		if ok {
			b = append([]byte(nil), b...)
		}
		f.gets[bucket+"/"+key]++
		nth := f.gets[bucket+"/"+key]
		hook := f.onGet
		f.mu.Unlock()
		rep := Reply{Body: b}
		if !ok {
			rep.Status = http.StatusNotFound
		}
		if hook != nil {
			rep = hook(key, b, nth)
		}
		switch rep.Status {
		case 0, http.StatusOK:
		case http.StatusNotFound:
			s3Error(w, http.StatusNotFound, "NoSuchKey", bucket, key)
			return
		default:
			s3Error(w, rep.Status, "InternalError", bucket, key)
			return
		}
		w.Header().Set("ETag", etag(rep.Body))
		w.Header().Set("Last-Modified", lastModified)
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("Content-Length", strconv.Itoa(len(rep.Body)))
		if rep.Cut > 0 && rep.Cut < len(rep.Body) {
			_, _ = w.Write(rep.Body[:rep.Cut])
			if fl, ok := w.(http.Flusher); ok {
				fl.Flush()
			}
			if hj, ok := w.(http.Hijacker); ok {
				if c, _, err := hj.Hijack(); err == nil {
					_ = c.Close()
				}
			}
			return
		}
		_, _ = w.Write(rep.Body)
	case http.MethodDelete:
		f.mu.Lock()
		delete(objs, key)
		f.mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	default:
		s3Error(w, http.StatusNotImplemented, "NotImplemented", bucket, key)
	}
}

func etag(b []byte) string { return fmt.Sprintf("\"%08x-%d\"", len(b)*2654435761, len(b)) }

func s3Error(w http.ResponseWriter, status int, code, bucket, key string) {
	type s3err struct {
		XMLName    xml.Name `xml:"Error"`
		Code       string   `xml:"Code"`
		Message    string   `xml:"Message"`
		BucketName string   `xml:"BucketName"`
		Key        string   `xml:"Key"`
		RequestID  string   `xml:"RequestId"`
	}
	w.Header().Set("Content-Type", "application/xml")
	w.WriteHeader(status)
	_ = xml.NewEncoder(w).Encode(s3err{Code: code, Message: code, BucketName: bucket, Key: key, RequestID: "fake"})
}
