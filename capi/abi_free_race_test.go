package main

import (
	"fmt"
	"maps"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestFreeRacingCalls: an engine may free a handle while another of its
// threads is still calling it (shutdown racing a step). Every call then
// either completes or fails with an error saying the handle was freed;
// nothing panics, nothing is poisoned, and a handle freed twice at once is
// freed once. Run it under -race: it also proves that free and the calls
// do not touch the handle's fields unordered.
func TestFreeRacingCalls(t *testing.T) {
	protos := parseHeader(t)
	rounds := 30
	if testing.Short() {
		rounds = 5
	}
	kinds := []struct {
		kind  string
		opts  func() string
		calls []string
	}{
		{"leader", func() string { return leaderOpts }, []string{"kvbm_leader_info", "kvbm_leader_match",
			"kvbm_leader_load_sources", "kvbm_leader_request_finished", "kvbm_leader_wait_ready"}},
		{"worker", func() string { return workerOpts(t) }, []string{"kvbm_worker_info", "kvbm_worker_finished",
			"kvbm_worker_recovered", "kvbm_worker_g4_report", "kvbm_worker_wait_loads"}},
		{"consolidator", func() string { return consolidatorOpts }, []string{"kvbm_consolidator_stats",
			"kvbm_consolidator_stats"}},
		{"pagestore", func() string { return pagestoreOpts }, []string{"kvbm_pagestore_info", "kvbm_pagestore_put",
			"kvbm_pagestore_get", "kvbm_pagestore_exists"}},
	}
	for _, k := range kinds {
		t.Run(k.kind, func(t *testing.T) {
			var completed, refused atomic.Int64
			for round := range rounds {
				h := newTestHandle(t, protos, "kvbm_"+k.kind+"_new", k.opts())
				var started, done sync.WaitGroup
				bad := make(chan string, len(k.calls))
				for _, name := range k.calls {
					args := maps.Clone(abiValid[name])
					args["hd"] = h
					// Once here first: the call succeeds on a live handle, and the
					// harness's own checks cannot fail in a goroutine below.
					r := invoke(t, protos[name], abiExports[name], args)
					require.Equal(t, statusOK, r.rc, "%s on a live handle: %s", name, r)
					started.Add(1)
					done.Add(1)
					go func() {
						defer done.Done()
						first := true
						for {
							r := invoke(t, protos[name], abiExports[name], args)
							if first {
								started.Done()
								first = false
							}
							switch {
							case r.rc == statusOK:
								completed.Add(1)
							case r.rc == statusState && strings.Contains(r.msg, "freed"):
								refused.Add(1)
								return
							default:
								bad <- fmt.Sprintf("round %d: %s: %s", round, name, strings.SplitN(r.msg, "\n", 2)[0])
								return
							}
						}
					}()
				}
				started.Wait() // every caller is in its loop
				var frees sync.WaitGroup
				for range 2 { // freed twice at once: once is freed, the other does nothing
					frees.Add(1)
					go func() { defer frees.Done(); freeTestHandle(k.kind, h) }()
				}
				frees.Wait()
				done.Wait()
				close(bad)
				for msg := range bad {
					t.Error(msg)
				}
				if p := poison.Load(); p != nil {
					poison.Store(nil)
					t.Fatalf("round %d: poisoned: %s", round, strings.SplitN(*p, "\n", 2)[0])
				}
				r := invoke(t, protos[k.calls[0]], abiExports[k.calls[0]], cCall{"hd": h})
				require.Equal(t, statusState, r.rc, "a call after free: %s", r)
				require.Contains(t, r.msg, "freed")
			}
			t.Logf("%d rounds: %d calls completed, %d refused as freed", rounds, completed.Load(), refused.Load())
			require.Equal(t, int64(rounds*len(k.calls)), refused.Load(), "every caller ended on the freed error")
		})
	}
}
