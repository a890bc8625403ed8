package zmqguard

import (
	"context"
	"runtime"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"
)

// TestZMQ4PubLeaksAGoroutinePerSocket is the minimal reproduction of a defect
// in go-zeromq/zmq4 v0.17 that no peer can reach: every closed PUB socket
// leaves its writer goroutine (pubMWriter.run) and queue behind (the
// socket's Close never stops it, and nothing public can). kvbm therefore
// publishes through its own Pub (TestPubGoroutinesEndAtClose), and
// TestNoZMQ4PubOutsideTheGuard keeps it so. Should this test fail, zmq4
// fixed the leak.
func TestZMQ4PubLeaksAGoroutinePerSocket(t *testing.T) {
	const cycles = 40
	settle := func() int {
		var n int
		for range 20 { // let exiting goroutines finish
			runtime.GC()
			n = runtime.NumGoroutine()
			time.Sleep(10 * time.Millisecond)
		}
		return n
	}
	before := settle()
	for range cycles {
		ctx, cancel := context.WithCancel(context.Background())
		pub := zmq4.NewPub(ctx)
		require.NoError(t, pub.Listen("tcp://127.0.0.1:0"))
		require.NoError(t, pub.Close())
		cancel()
	}
	leaked := settle() - before
	require.GreaterOrEqual(t, leaked, cycles*9/10,
		"zmq4 no longer leaks a goroutine per closed PUB socket (leaked %d over %d sockets)", leaked, cycles)
}
