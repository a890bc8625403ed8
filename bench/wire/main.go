// Command wire prints the leader→all-workers operation round trip of kvbm's
// side channel (goext/wire) for 2 and 4 workers, next to a bare zmq4
// PUB/PULL echo of the same message measured in the same run.
//
//	go run ./bench/wire [-iters 5000]
package main

import (
	"flag"
	"fmt"
	"os"
	"text/tabwriter"
	"time"

	"github.com/kvbm/kvbm/bench/internal/rows"
	"github.com/kvbm/kvbm/goext/wire"
	"github.com/kvbm/kvbm/internal/wirebench"
)

func us(d time.Duration) string { return fmt.Sprintf("%.1f", float64(d)/float64(time.Microsecond)) }

func main() {
	iters := flag.Int("iters", 5000, "operations per configuration")
	quick := flag.Bool("quick", false, "500 operations per configuration (CI)")
	flag.Parse()
	if *quick {
		*iters = 500
	}
	fmt.Println("kvbm side channel: leader → all workers → acks, workers as goroutines over TCP loopback")
	fmt.Println("(in-process transport for reference); baseline = bare zmq4 PUB → SUB, PUSH → PULL echo, same payload")
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "workers\tpayload B\tpath\tp50 µs\tp99 µs\tmean µs\tp50 vs echo\t")
	for _, copies := range []int{16, 512} {
		payload := wirebench.Payload(copies)
		for _, n := range []int{2, 4} {
			base, err := wirebench.ZMQEcho(n, payload, *iters)
			if err != nil {
				fmt.Fprintln(os.Stderr, "baseline:", err)
				os.Exit(1)
			}
			res := []wirebench.Result{base}
			for _, tr := range []wire.Transport{wire.TransportTCP, wire.TransportInProc} {
				r, err := wirebench.Wire(n, payload, *iters, tr)
				if err != nil {
					fmt.Fprintln(os.Stderr, tr, err)
					os.Exit(1)
				}
				res = append(res, r)
			}
			for _, r := range res {
				fmt.Fprintf(tw, "%d\t%d\t%s\t%s\t%s\t%s\t%.2fx\t\n", r.Workers, r.Bytes, r.Name, us(r.P50), us(r.P99), us(r.Mean),
					float64(r.P50)/float64(base.P50))
			}
			if n == 4 {
				tcp := res[1]
				rows.Emit(rows.Row{Bench: "wire", Figure: fmt.Sprintf("side channel round trip p50, %d workers, %d B (TCP)", n, tcp.Bytes),
					Kvbm: us(tcp.P50) + " µs", Baseline: fmt.Sprintf("bare zmq4 PUB/PULL echo: %s µs", us(base.P50)),
					Ratio: fmt.Sprintf("%.2f× the echo", float64(tcp.P50)/float64(base.P50))})
			}
		}
	}
	_ = tw.Flush()
}
