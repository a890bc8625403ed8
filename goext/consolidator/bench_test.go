package consolidator

import (
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvbm/kvbm/goext/events"
)

// BenchmarkTrackerLifecycle is the tracker's throughput on a realistic mix:
// every block is stored by the engine, then by kvbm's host and disk tiers
// (two deduplications), and later removed by all three (two silent
// removes, one REMOVE), with a window of 4096 live blocks in chains of 8
// so that parent lookups and sequence hashing are exercised. Six block
// events per iteration; the metric is block events/s on one goroutine.
func BenchmarkTrackerLifecycle(b *testing.B) {
	const window, chain, bs = 4096, 8, 16
	tr := NewTracker(EngineVllm, nil)
	toks := make([]uint32, bs)
	var drained []events.ConsolidatedEvent
	engineHash := func(i int) uint64 { return uint64(i)*2 + 1 } // distinct hash spaces
	kvbmHash := func(i int) uint64 { return uint64(i) * 2 }
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		for j := range toks {
			toks[j] = uint32(i*bs + j)
		}
		hasParent := i%chain != 0
		tr.Store(engineHash(i), eng, toks, engineHash(i-1), hasParent, bs, "")
		tr.Store(kvbmHash(i), host, toks, kvbmHash(i-1), hasParent, bs, "")
		tr.Store(kvbmHash(i), disk, toks, kvbmHash(i-1), hasParent, bs, "")
		if old := i - window; old >= 0 {
			tr.Remove(engineHash(old), eng)
			tr.Remove(kvbmHash(old), host)
			tr.Remove(kvbmHash(old), disk)
		}
		if tr.Queued() >= 256 {
			drained = tr.Drain(drained[:0])
		}
		i++
	}
	b.ReportMetric(float64(6*b.N)/b.Elapsed().Seconds(), "events/s")
}

// BenchmarkTrackerFirstStore: only first stores (each publishes), the
// tracker's most expensive path.
func BenchmarkTrackerFirstStore(b *testing.B) {
	const bs = 16
	tr := NewTracker(EngineVllm, nil)
	toks := make([]uint32, bs)
	var drained []events.ConsolidatedEvent
	i := 0
	for b.Loop() {
		for j := range toks {
			toks[j] = uint32(i*bs + j)
		}
		tr.Store(uint64(i), eng, toks, uint64(i-1), i%8 != 0, bs, "")
		if i%4096 == 4095 {
			drained = tr.Drain(drained[:0])
			tr.ClearAll() // bound the maps; one CLEAR per 4096 stores
		}
		i++
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "events/s")
}

// BenchmarkEndToEndZMQ: engine messages over loopback TCP → consolidator →
// consolidated messages over loopback TCP, decoded by the receiver. Each
// input message carries 64 one-block BlockStored events, then a
// BlockRemoved of the same 64; every input block event yields one output
// event. The metric is block events/s through the whole path (sender,
// consolidator and receiver share the machine's cores).
func BenchmarkEndToEndZMQ(b *testing.B) {
	const perMsg, sets, bs = 64, 16, 16
	pub, ep := enginePub(b, "tcp://127.0.0.1:0")
	c, err := New(Config{EngineEndpoints: []string{ep}, ZMQBind: "tcp://127.0.0.1:0"})
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	out := startSub(b, c.ZMQEndpoint())
	waitSubscribed(b, pub)
	waitSubscribed(b, c.pub)

	// Pre-encoded input: sets of (store 64, remove 64), cycled.
	var msgs [][][]byte
	for s := range sets {
		var stores, removes []any
		for k := range perMsg {
			h := uint64(s*perMsg + k + 1)
			toks := make([]any, bs)
			for j := range toks {
				toks[j] = uint32(int(h)*bs + j)
			}
			stores = append(stores, []any{"BlockStored", []any{h}, nil, toks, bs, nil, "GPU", nil})
			removes = append(removes, []any{"BlockRemoved", []any{h}, "GPU"})
		}
		msgs = append(msgs, [][]byte{{}, make([]byte, 8), mustPack(b, []any{1.0, stores, 0})})
		msgs = append(msgs, [][]byte{{}, make([]byte, 8), mustPack(b, []any{1.0, removes, 0})})
	}
	nMsgs := (b.N + perMsg - 1) / perMsg
	want := nMsgs * perMsg

	b.ResetTimer()
	go func() {
		for i := range nMsgs {
			if err := pub.Send(zmq4.NewMsgFrom(msgs[i%len(msgs)]...)); err != nil {
				return
			}
		}
	}()
	dec := events.NewDecoder()
	got := 0
	for got < want {
		select {
		case m := <-out:
			batch, err := dec.DecodeMessage(m.Frames)
			if err != nil {
				b.Fatal(err)
			}
			got += len(batch.Events)
		case <-time.After(10 * time.Second):
			b.Fatalf("stalled: %d of %d events out; stats %+v", got, want, c.Stats())
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(want)/b.Elapsed().Seconds(), "events/s")
}
