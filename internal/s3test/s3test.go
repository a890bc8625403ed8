// Package s3test starts S3-compatible servers for tests and benchmarks: a
// real one, versitygw serving a directory (installed by .ci/s3-server.sh),
// and Fake, an in-memory one that can play hostile or flaky (fake.go).
package s3test

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// Credentials the server is started with.
const (
	AccessKey = "kvbmtest"
	SecretKey = "kvbmtestsecret"
)

// Server is a versitygw process (or, stopped, the address and directory it
// comes back on).
type Server struct {
	bin  string
	dir  string
	Addr string // 127.0.0.1:port
	cmd  *exec.Cmd
	log  *os.File
}

// Binary finds versitygw: $KVBM_VERSITYGW, then PATH, then $(go env GOPATH)/bin.
func Binary() (string, error) {
	if p := os.Getenv("KVBM_VERSITYGW"); p != "" { // envread: the test server binary, no kvbm setting
		return p, nil
	}
	if p, err := exec.LookPath("versitygw"); err == nil {
		return p, nil
	}
	gopath := os.Getenv("GOPATH") // envread: where go install put the test server
	if gopath == "" {
		if out, err := exec.Command("go", "env", "GOPATH").Output(); err == nil {
			gopath = strings.TrimSpace(string(out))
		}
	}
	for _, d := range filepath.SplitList(gopath) {
		p := filepath.Join(d, "bin", "versitygw")
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", errors.New("s3test: versitygw not found: run .ci/s3-server.sh")
}

// Launch starts a server on a free port, serving dir.
func Launch(dir string) (*Server, error) {
	bin, err := Binary()
	if err != nil {
		return nil, err
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &Server{bin: bin, dir: dir, Addr: l.Addr().String()}
	_ = l.Close()
	return s, s.Start()
}

// Start starts a test's server on a free port; it is stopped when the test
// ends. Without the binary the test fails, saying how to install it
// (.ci/s3-server.sh, which .ci/run runs first), unless it was deselected:
// under go test -short such tests are skipped, and say so.
func Start(t testing.TB) *Server {
	t.Helper()
	if _, err := Binary(); err != nil {
		if testing.Short() {
			t.Skipf("needs an S3 server (-short deselects it): %v", err)
		}
		t.Fatalf("%v (this test needs the versitygw S3 server: install it with .ci/s3-server.sh, "+
			"or deselect the tests that need it with go test -short)", err)
	}
	s, err := Launch(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	return s
}

// Endpoint is the server's http:// URL.
func (s *Server) Endpoint() string { return "http://" + s.Addr }

// Stop kills the server (an outage: nothing is flushed); data stays on disk.
func (s *Server) Stop() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
	s.cmd = nil
	if s.log != nil {
		_ = s.log.Close()
	}
}

// Restart is Start for tests: a failure ends the test.
func (s *Server) Restart(t testing.TB) {
	t.Helper()
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
}

// Start (re)starts the server on its address and directory and waits until
// it accepts connections.
func (s *Server) Start() error {
	s.Stop()
	log, err := os.CreateTemp(s.dir, "versitygw-*.log")
	if err != nil {
		return err
	}
	data := filepath.Join(s.dir, "data")
	if err := os.MkdirAll(data, 0o755); err != nil {
		return err
	}
	cmd := exec.Command(s.bin, "--port", s.Addr, "--quiet", "posix", data)
	cmd.Env = append(os.Environ(), // envread: passed on to the test server
		"ROOT_ACCESS_KEY="+AccessKey, "ROOT_SECRET_KEY="+SecretKey)
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		return err
	}
	s.cmd, s.log = cmd, log
	deadline := time.Now().Add(30 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", s.Addr, time.Second)
		if err == nil {
			_ = c.Close()
			return nil
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(log.Name())
			s.Stop()
			return fmt.Errorf("s3test: versitygw did not listen on %s within 30 s: %v\n%s", s.Addr, err, b)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
