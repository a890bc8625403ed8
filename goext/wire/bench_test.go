package wire_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvbm/kvbm/goext/wire"
	"github.com/kvbm/kvbm/internal/wirebench"
)

// BenchmarkRoundTrip: leader → every worker → ack, for 2 and 4 workers over
// TCP loopback, next to a bare zmq4 PUB/PULL echo of the same payload (an
// encoded plan with 64 copies) in the same run. p50-µs / p99-µs are per
// operation; ns/op also carries the setup (sockets, handshake, warm-up)
// amortised over b.N.
func BenchmarkRoundTrip(b *testing.B) {
	payload := wirebench.Payload(64)
	for _, n := range []int{2, 4} {
		for _, tc := range []struct {
			name string
			run  func(iters int) (wirebench.Result, error)
		}{
			{"wire_tcp", func(iters int) (wirebench.Result, error) {
				return wirebench.Wire(n, payload, iters, wire.TransportTCP)
			}},
			{"wire_inproc", func(iters int) (wirebench.Result, error) {
				return wirebench.Wire(n, payload, iters, wire.TransportInProc)
			}},
			{"zmq4_echo", func(iters int) (wirebench.Result, error) { return wirebench.ZMQEcho(n, payload, iters) }},
		} {
			b.Run(fmt.Sprintf("workers=%d/%s", n, tc.name), func(b *testing.B) {
				b.ReportAllocs()
				b.SetBytes(int64(len(payload)))
				// One measured run of b.N operations; setup (sockets,
				// handshake, warm-up) is outside the timer.
				b.StopTimer()
				var res wirebench.Result
				var err error
				b.StartTimer()
				res, err = tc.run(max(b.N, 20))
				b.StopTimer()
				if err != nil {
					b.Fatal(err)
				}
				b.ReportMetric(float64(res.P50)/float64(time.Microsecond), "p50-µs")
				b.ReportMetric(float64(res.P99)/float64(time.Microsecond), "p99-µs")
			})
		}
	}
}
