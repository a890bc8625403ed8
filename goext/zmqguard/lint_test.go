package zmqguard_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// House rule: every zmq4 socket kvbm binds or dials goes through the guard.
// A file outside this package that calls Listen or Dial on a zmq4 socket must
// pass the endpoint through zmqguard.Endpoint. Only wirebench's bare zmq4
// baseline is exempt.
func TestEveryZMQEndpointIsGuarded(t *testing.T) {
	call := regexp.MustCompile(`\.(Listen|Dial)\(([^)]*)\)`)
	exempt := map[string]bool{filepath.Join("goext", "wire", "wirebench", "wirebench.go"): true}
	checked := 0
	for _, root := range []string{"../../goext", "../../capi"} {
		err := filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
				return err
			}
			rel, _ := filepath.Rel("../..", path)
			if strings.HasPrefix(rel, filepath.Join("goext", "zmqguard")) || exempt[rel] {
				return nil
			}
			src, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			if !strings.Contains(string(src), `"github.com/go-zeromq/zmq4"`) {
				return nil
			}
			for _, m := range call.FindAllStringSubmatch(string(src), -1) {
				require.Contains(t, m[2], "zmqguard.Endpoint(", "%s: %s", rel, m[0])
				checked++
			}
			return nil
		})
		require.NoError(t, err)
	}
	require.Positive(t, checked)
}

// House rule: kvbm publishes through zmqguard.Pub, never zmq4.NewPub, whose
// sockets each leave a goroutine behind when closed
// (TestZMQ4PubLeaksAGoroutinePerSocket). wirebench's bare zmq4 baseline is
// exempt.
func TestNoZMQ4PubOutsideTheGuard(t *testing.T) {
	exempt := map[string]bool{filepath.Join("goext", "wire", "wirebench", "wirebench.go"): true}
	for _, root := range []string{"../../goext", "../../capi"} {
		err := filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
				return err
			}
			rel, _ := filepath.Rel("../..", path)
			if strings.HasPrefix(rel, filepath.Join("goext", "zmqguard")) || exempt[rel] {
				return nil
			}
			src, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			require.NotContains(t, string(src), "zmq4.NewPub(", "%s: publish through zmqguard.NewPub", rel)
			require.NotContains(t, string(src), "zmq4.NewXPub(", "%s: publish through zmqguard.NewPub", rel)
			return nil
		})
		require.NoError(t, err)
	}
}
