// Command consolidator benchmarks the KV event consolidator and prints a
// table: tracker throughput, the decode-only rate of the engine input (the
// baseline: no consolidator can go faster than it reads), end-to-end ZMQ
// in → ZMQ out throughput over loopback TCP, and the latency the
// consolidator adds at a paced 10k events/s, compared with a direct
// PUB → SUB path measured in the same run; and an end-to-end run that leaves
// the tracker holding -live blocks (≥ 1M by default): events/s while it
// fills, and the heap it takes per tracked block next to a Go
// map[uint64]uint64 of the same hashes (the smallest index that maps an
// event's hash to a block), measured in the same run.
//
//	go run ./bench/consolidator [-seconds 2] [-rate 10000] [-live 1048576] [-quick]
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"runtime"
	"slices"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvbm/kvbm/bench/internal/rows"
	"github.com/kvbm/kvbm/goext/consolidator"
	"github.com/kvbm/kvbm/goext/events"
)

const blockSize = 16

func main() {
	seconds := flag.Float64("seconds", 2, "duration of each measurement")
	rate := flag.Int("rate", 10_000, "paced rate (events/s) for the latency measurement")
	live := flag.Int("live", 1<<20, "blocks the tracker holds at the end of the live-blocks run")
	quick := flag.Bool("quick", false, "0.5 s per measurement (the live-blocks run keeps its size)")
	flag.Parse()
	if *quick {
		*seconds = 0.5
	}
	dur := time.Duration(*seconds * float64(time.Second))

	tracker := benchTracker(dur)
	input := engineMessages(16, 64)
	decode := benchDecode(input, dur)
	e2e, err := benchEndToEnd(input, dur)
	check(err)
	direct, err := pacedLatency(false, *rate, dur)
	check(err)
	via, err := pacedLatency(true, *rate, dur)
	check(err)
	lv, err := liveBlocks(*live)
	check(err)

	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintf(w, "KV event consolidator (GOMAXPROCS=%d, %s per measurement)\n", runtime.GOMAXPROCS(0), dur)
	fmt.Fprintln(w, "measurement\tresult\ttarget")
	fmt.Fprintf(w, "tracker, one goroutine (block events/s)\t%s\t>= 1M\n", si(tracker))
	fmt.Fprintf(w, "decode only, same input (events/s) [baseline]\t%s\t\n", si(decode))
	fmt.Fprintf(w, "end-to-end ZMQ in -> out, loopback TCP (events/s)\t%s (%.0f%% of decode)\t>= 200k\n", si(e2e), 100*e2e/decode)
	fmt.Fprintf(w, "latency @%d ev/s, direct PUB->SUB [baseline] p50/p99\t%s / %s\t\n", *rate, ms(direct.p50), ms(direct.p99))
	fmt.Fprintf(w, "latency @%d ev/s, via consolidator p50/p99\t%s / %s\t\n", *rate, ms(via.p50), ms(via.p99))
	fmt.Fprintf(w, "added latency p50/p99\t%s / %s\tp99 <= 10 ms\n", ms(via.p50-direct.p50), ms(via.p99-direct.p99))
	fmt.Fprintf(w, "end-to-end, tracker filled to %s live blocks (events/s)\t%s\t>= 200k\n", si(float64(lv.tracked)), si(lv.rate))
	fmt.Fprintf(w, "heap per tracked block (bytes)\t%.0f\t\n", lv.perBlock)
	fmt.Fprintf(w, "heap per entry, map[uint64]uint64 of the same hashes [baseline]\t%.0f\t\n", lv.mapPerEntry)
	check(w.Flush())

	rows.Emit(rows.Row{Bench: "consolidator", Figure: "tracker, one goroutine (block events/s)", Kvbm: si(tracker),
		Baseline: fmt.Sprintf("(for scale) decode only, engine input: %s", si(decode)), Ratio: fmt.Sprintf("%.0f%% of decode", 100*tracker/decode),
		Target: ">= 1M", OK: rows.Bool(tracker >= 1e6)})
	rows.Emit(rows.Row{Bench: "consolidator", Figure: "end-to-end ZMQ in -> out, loopback (events/s)", Kvbm: si(e2e),
		Baseline: fmt.Sprintf("decode only: %s", si(decode)), Ratio: fmt.Sprintf("%.0f%% of decode", 100*e2e/decode),
		Target: ">= 200k", OK: rows.Bool(e2e >= 200e3)})
	rows.Emit(rows.Row{Bench: "consolidator", Figure: fmt.Sprintf("added latency p99 @%d ev/s", *rate),
		Kvbm: ms(via.p99), Baseline: fmt.Sprintf("direct PUB->SUB p99 %s", ms(direct.p99)),
		Ratio: "+" + ms(via.p99-direct.p99), Target: "<= +10 ms", OK: rows.Bool(via.p99-direct.p99 <= 10*time.Millisecond)})
	rows.Emit(rows.Row{Bench: "consolidator", Figure: fmt.Sprintf("end-to-end filling the tracker to %s live blocks (events/s)", si(float64(lv.tracked))),
		Kvbm: si(lv.rate), Baseline: fmt.Sprintf("decode only: %s", si(decode)), Ratio: fmt.Sprintf("%.0f%% of decode", 100*lv.rate/decode),
		Target: ">= 200k", OK: rows.Bool(lv.rate >= 200e3)})
	rows.Emit(rows.Row{Bench: "consolidator", Figure: fmt.Sprintf("heap per tracked block at %s live blocks (bytes)", si(float64(lv.tracked))),
		Kvbm: fmt.Sprintf("%.0f", lv.perBlock), Baseline: fmt.Sprintf("map[uint64]uint64, same hashes: %.0f", lv.mapPerEntry),
		Ratio: fmt.Sprintf("%.1f×", lv.perBlock/lv.mapPerEntry)})
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}

func si(v float64) string {
	switch {
	case v >= 1e6:
		return fmt.Sprintf("%.2fM", v/1e6)
	case v >= 1e3:
		return fmt.Sprintf("%.0fk", v/1e3)
	}
	return fmt.Sprintf("%.0f", v)
}

func ms(d time.Duration) string { return fmt.Sprintf("%.3f ms", float64(d)/1e6) }

// benchTracker runs the BenchmarkTrackerLifecycle mix (engine, host, disk
// store each block; all three remove it 4096 blocks later) for dur.
func benchTracker(dur time.Duration) float64 {
	const window, chain = 4096, 8
	tr := consolidator.NewTracker(consolidator.EngineVllm, nil)
	toks := make([]uint32, blockSize)
	var drained []events.ConsolidatedEvent
	eh := func(i int) uint64 { return uint64(i)*2 + 1 }
	kh := func(i int) uint64 { return uint64(i) * 2 }
	start := time.Now()
	n := 0
	for i := 0; ; i++ {
		if i%1024 == 0 && time.Since(start) > dur {
			break
		}
		for j := range toks {
			toks[j] = uint32(i*blockSize + j)
		}
		hp := i%chain != 0
		tr.Store(eh(i), events.HolderEngine, toks, eh(i-1), hp, blockSize, "")
		tr.Store(kh(i), events.HolderKvbmHost, toks, kh(i-1), hp, blockSize, "")
		tr.Store(kh(i), events.HolderKvbmDisk, toks, kh(i-1), hp, blockSize, "")
		n += 3
		if old := i - window; old >= 0 {
			tr.Remove(eh(old), events.HolderEngine)
			tr.Remove(kh(old), events.HolderKvbmHost)
			tr.Remove(kh(old), events.HolderKvbmDisk)
			n += 3
		}
		if tr.Queued() >= 256 {
			drained = tr.Drain(drained[:0])
		}
	}
	return float64(n) / time.Since(start).Seconds()
}

// engineMessages returns sets of vLLM messages, each a batch of perMsg
// one-block BlockStored events followed by a batch removing them again, so
// that cycling through them keeps the tracker's state bounded while every
// input event yields one output event.
func engineMessages(sets, perMsg int) [][][]byte {
	var msgs [][][]byte
	for s := range sets {
		var stores, removes []any
		for k := range perMsg {
			h := uint64(s*perMsg+k+1) | 1<<63
			stores = append(stores, storedEvent(h, uint32(s*perMsg+k)))
			removes = append(removes, []any{"BlockRemoved", []any{h}, "GPU"})
		}
		msgs = append(msgs, [][]byte{{}, make([]byte, 8), pack([]any{1.0, stores, 0})})
		msgs = append(msgs, [][]byte{{}, make([]byte, 8), pack([]any{1.0, removes, 0})})
	}
	return msgs
}

// storedEvent is a vLLM (array-encoded) one-block BlockStored.
func storedEvent(h uint64, seed uint32) []any {
	toks := make([]any, blockSize)
	for j := range toks {
		toks[j] = seed*blockSize + uint32(j)
	}
	return []any{"BlockStored", []any{h}, nil, toks, blockSize, nil, "GPU", nil}
}

func pack(v any) []byte {
	b, err := msgpack.Marshal(v)
	check(err)
	return b
}

func eventsIn(msgs [][][]byte) int {
	b, err := events.DecodeMessage(msgs[0])
	check(err)
	return len(b.Events)
}

func benchDecode(msgs [][][]byte, dur time.Duration) float64 {
	dec := events.NewDecoder()
	start := time.Now()
	n := 0
	for i := 0; time.Since(start) < dur; i++ {
		b, err := dec.DecodeMessage(msgs[i%len(msgs)])
		check(err)
		n += len(b.Events)
	}
	return float64(n) / time.Since(start).Seconds()
}

// pipe is an engine PUB → (consolidator →) SUB path over loopback TCP.
type pipe struct {
	pub  zmq4.Socket
	sub  zmq4.Socket
	c    *consolidator.Consolidator
	msgs chan zmq4.Msg
	stop func()
}

func newPipe(viaConsolidator bool) (*pipe, error) {
	ctx, cancel := context.WithCancel(context.Background())
	p := &pipe{pub: zmq4.NewPub(ctx), msgs: make(chan zmq4.Msg, 4096)}
	if err := p.pub.Listen("tcp://127.0.0.1:0"); err != nil {
		cancel()
		return nil, err
	}
	in := "tcp://" + p.pub.Addr().String()
	outEP := in
	if viaConsolidator {
		c, err := consolidator.New(consolidator.Config{EngineEndpoints: []string{in}, ZMQBind: "tcp://127.0.0.1:0"})
		if err != nil {
			cancel()
			return nil, err
		}
		p.c = c
		outEP = c.ZMQEndpoint()
	}
	p.sub = zmq4.NewSub(ctx)
	if err := p.sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		cancel()
		return nil, err
	}
	if err := p.sub.Dial(outEP); err != nil {
		cancel()
		return nil, err
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			m, err := p.sub.Recv()
			if err != nil {
				return
			}
			p.msgs <- m
		}
	}()
	p.stop = func() {
		if p.c != nil {
			_ = p.c.Close()
		}
		cancel()
		_ = p.sub.Close()
		_ = p.pub.Close()
		<-done
	}
	return p, p.warmUp()
}

// warmUp waits until both hops have their subscriber (ZMQ drops what a PUB
// sends before the subscription arrives): it sends probes, a store then a
// remove of one block, until something comes out, then drains.
func (p *pipe) warmUp() error {
	probe := [][]byte{{}, make([]byte, 8), pack([]any{0.0, []any{storedEvent(1<<62, 1<<20)}, 0})}
	unprobe := [][]byte{{}, make([]byte, 8), pack([]any{0.0, []any{[]any{"BlockRemoved", []any{uint64(1 << 62)}}}, 0})}
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if err := p.pub.Send(zmq4.NewMsgFrom(probe...)); err != nil {
			return err
		}
		if err := p.pub.Send(zmq4.NewMsgFrom(unprobe...)); err != nil {
			return err
		}
		select {
		case <-p.msgs:
			time.Sleep(50 * time.Millisecond)
			for len(p.msgs) > 0 {
				<-p.msgs
			}
			return nil
		case <-time.After(20 * time.Millisecond):
		}
	}
	return fmt.Errorf("no path through the pipe after 10 s")
}

func benchEndToEnd(msgs [][][]byte, dur time.Duration) (float64, error) {
	p, err := newPipe(true)
	if err != nil {
		return 0, err
	}
	defer p.stop()
	perMsg := eventsIn(msgs)
	// Size the run from the decode rate so that it lasts about dur.
	nMsgs := max(int(dur.Seconds()*400_000)/perMsg, 1)
	want := nMsgs * perMsg
	start := time.Now()
	go func() {
		for i := range nMsgs {
			if p.pub.Send(zmq4.NewMsgFrom(msgs[i%len(msgs)]...)) != nil {
				return
			}
		}
	}()
	dec := events.NewDecoder()
	for got := 0; got < want; {
		select {
		case m := <-p.msgs:
			b, err := dec.DecodeMessage(m.Frames)
			if err != nil {
				return 0, err
			}
			got += len(b.Events)
		case <-time.After(10 * time.Second):
			return 0, fmt.Errorf("end-to-end stalled at %d of %d events (stats %+v)", got, want, p.c.Stats())
		}
	}
	return float64(want) / time.Since(start).Seconds(), nil
}

type latency struct{ p50, p99 time.Duration }

// pacedLatency sends one-block stores at rate events/s (one per message,
// each a distinct block) and measures send → receive per block hash.
func pacedLatency(viaConsolidator bool, rate int, dur time.Duration) (latency, error) {
	p, err := newPipe(viaConsolidator)
	if err != nil {
		return latency{}, err
	}
	defer p.stop()
	n := max(int(dur.Seconds()*float64(rate)), 100)
	period := time.Second / time.Duration(rate)
	msgs := make([][][]byte, n)
	for i := range msgs {
		msgs[i] = [][]byte{{}, make([]byte, 8), pack([]any{1.0, []any{storedEvent(uint64(i), uint32(i))}, 0})}
	}
	// Written by the sender, read by the receiver: the message crosses TCP,
	// which gives the Go memory model no ordering, so atomics.
	sent := make([]atomic.Int64, n)
	errc := make(chan error, 1)
	start := time.Now()
	go func() {
		for i := range n {
			// Deadline pacing: a late wake-up is caught up, not accumulated.
			if d := time.Until(start.Add(time.Duration(i) * period)); d > 0 {
				time.Sleep(d)
			}
			sent[i].Store(time.Now().UnixNano())
			if err := p.pub.Send(zmq4.NewMsgFrom(msgs[i]...)); err != nil {
				errc <- err
				return
			}
		}
		errc <- nil
	}()
	lat := make([]time.Duration, 0, n)
	dec := events.NewDecoder()
	for len(lat) < n {
		select {
		case m := <-p.msgs:
			now := time.Now()
			b, err := dec.DecodeMessage(m.Frames)
			if err != nil {
				return latency{}, err
			}
			for _, ev := range b.Events {
				if h := ev.BlockHashes[0]; h < uint64(n) {
					lat = append(lat, time.Duration(now.UnixNano()-sent[h].Load()))
				}
			}
		case <-time.After(10 * time.Second):
			return latency{}, fmt.Errorf("latency run stalled at %d of %d events", len(lat), n)
		}
	}
	if err := <-errc; err != nil {
		return latency{}, err
	}
	slices.Sort(lat)
	return latency{p50: lat[len(lat)/2], p99: lat[len(lat)*99/100]}, nil
}

type liveResult struct {
	tracked     int
	rate        float64 // block events/s from the first send to the last consolidated event out
	perBlock    float64 // heap bytes per tracked block (after GC, the whole process)
	mapPerEntry float64 // heap bytes per entry of a map[uint64]uint64 of as many hashes
}

// heap is the live heap after a full collection.
func heap() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// liveBlocks sends n one-block-each stores (vLLM BlockStored events of 64
// chained blocks per message, as an engine publishes a request's blocks) and
// never removes them, so the tracker ends holding n live blocks.
func liveBlocks(n int) (liveResult, error) {
	const perMsg = 64
	n = (n + perMsg - 1) / perMsg * perMsg
	p, err := newPipe(true)
	if err != nil {
		return liveResult{}, err
	}
	defer p.stop()
	// The input is packed before the clock starts (and kept alive until
	// both heap readings are taken), so neither figure counts the sender.
	msgs := make([][]byte, n/perMsg)
	toks := make([]any, perMsg*blockSize)
	hashes := make([]any, perMsg)
	for m := range msgs {
		for k := range hashes {
			hashes[k] = uint64(m*perMsg+k+1) | 1<<62
		}
		for j := range toks {
			toks[j] = uint32(m*perMsg*blockSize + j)
		}
		msgs[m] = pack([]any{1.0, []any{[]any{"BlockStored", hashes, nil, toks, blockSize, nil, "GPU", nil}}, 0})
	}
	h0 := heap()
	done := make(chan struct{})
	go func() { // the consolidated output, drained (the count is in the stats)
		for {
			select {
			case <-p.msgs:
			case <-done:
				return
			}
		}
	}()
	defer close(done)
	sendErr := make(chan error, 1)
	start := time.Now()
	go func() {
		for _, m := range msgs {
			if err := p.pub.Send(zmq4.NewMsgFrom([]byte{}, make([]byte, 8), m)); err != nil {
				sendErr <- err
				return
			}
		}
		sendErr <- nil
	}()
	if err := <-sendErr; err != nil {
		return liveResult{}, err
	}
	deadline := time.Now().Add(120 * time.Second)
	for {
		st := p.c.Stats()
		if st.Tracked >= n && st.ZMQEvents >= uint64(n) {
			break
		}
		if time.Now().After(deadline) {
			return liveResult{}, fmt.Errorf("live-blocks run stalled: %+v", st)
		}
		time.Sleep(time.Millisecond)
	}
	r := liveResult{rate: float64(n) / time.Since(start).Seconds(), tracked: p.c.Stats().Tracked}
	r.perBlock = float64(int64(heap())-int64(h0)) / float64(r.tracked)
	runtime.KeepAlive(p)
	runtime.KeepAlive(msgs)

	m0 := heap()
	idx := make(map[uint64]uint64)
	for i := range r.tracked {
		idx[uint64(i+1)|1<<62] = uint64(i)
	}
	r.mapPerEntry = float64(int64(heap())-int64(m0)) / float64(len(idx))
	runtime.KeepAlive(idx)
	return r, nil
}
