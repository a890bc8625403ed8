// Package testports hands tests TCP ports to name before something binds
// them (a side channel's workers start before their leader).
package testports

import (
	"net"
	"testing"
)

// Free returns n distinct ports that were free a moment ago: every probe
// listener stays open until all n are chosen, so no port repeats. Another
// process may still take one before the caller binds it.
func Free(t testing.TB, n int) []int {
	t.Helper()
	ls := make([]net.Listener, 0, n)
	ports := make([]int, 0, n)
	defer func() {
		for _, l := range ls {
			_ = l.Close()
		}
	}()
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatalf("testports: listen: %v", err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports
}
