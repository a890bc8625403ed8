// Package wirebench measures the leader→all-workers operation round trip of
// the side channel next to a bare zmq4 PUB/PULL echo of the same message
// size, in one run (Go benchmarks in goext/wire and the bench/wire table).
//
// Workers are goroutines of the calling process talking over real TCP
// loopback sockets, so the numbers include ZeroMQ framing and the kernel's
// loopback path but no process scheduling across address spaces.
package wirebench

import (
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/wire"
)

// Result is one measured configuration.
type Result struct {
	Name    string
	Workers int
	Bytes   int // payload bytes per operation
	Iters   int
	P50     time.Duration
	P99     time.Duration
	Mean    time.Duration
}

func summarize(name string, workers, size int, lat []time.Duration) Result {
	slices.Sort(lat)
	var sum time.Duration
	for _, d := range lat {
		sum += d
	}
	pick := func(q float64) time.Duration { return lat[min(len(lat)-1, int(q*float64(len(lat))))] }
	return Result{Name: name, Workers: workers, Bytes: size, Iters: len(lat), P50: pick(0.50), P99: pick(0.99),
		Mean: sum / time.Duration(len(lat))}
}

// Payload is an encoded plan.Step with n G1→G2 saves: the shape of a real
// background operation.
func Payload(n int) []byte {
	st := plan.Step{Seq: 1}
	for i := range n {
		st.Saves = append(st.Saves, plan.Copy{Src: plan.G1, SrcBlock: int64(1000 + i), Dst: plan.G2, DstBlock: int64(50000 + i)})
	}
	b, err := st.Encode()
	if err != nil {
		panic(err)
	}
	return b
}

var quiet = slog.New(slog.DiscardHandler)

// Wire measures Leader.Broadcast with workers no-op ranks over transport tr.
func Wire(workers int, payload []byte, iters int, tr wire.Transport) (Result, error) {
	ep := wire.Endpoint{Host: "127.0.0.1"}
	if tr == wire.TransportInProc {
		ep = wire.Endpoint{Host: fmt.Sprintf("wirebench-%d-%d", workers, time.Now().UnixNano())}
	}
	l, err := wire.Listen(wire.CoordinatorOptions{NumWorkers: workers, Endpoint: ep, Transport: tr, Logger: quiet,
		Size: func(int64, int) (int, int, error) { return 1, 0, nil }, InitTimeout: 30 * time.Second,
		RetryInterval: 10 * time.Millisecond, PingInterval: time.Second, SuspectAfter: time.Minute})
	if err != nil {
		return Result{}, err
	}
	defer l.Close()
	ep = l.Endpoint()
	var ws []*wire.Member
	defer func() {
		for _, w := range ws {
			_ = w.Close()
		}
	}()
	for r := range workers {
		w, err := wire.Connect(wire.MemberOptions{Rank: r, WorldSize: workers, NumDeviceBlocks: 1, BytesPerBlock: 1,
			Endpoint: ep, Transport: tr, Logger: quiet, RetryInterval: 10 * time.Millisecond,
			Allocate: func(wire.LeaderMetadata) error { return nil },
			Execute:  func(context.Context, []byte) error { return nil }})
		if err != nil {
			return Result{}, err
		}
		ws = append(ws, w)
	}
	ctx := context.Background()
	if _, err := l.Handshake(ctx); err != nil {
		return Result{}, err
	}
	for range min(iters/10+1, 100) { // warm up
		if err := l.Broadcast(ctx, payload); err != nil {
			return Result{}, err
		}
	}
	lat := make([]time.Duration, iters)
	for i := range lat {
		t0 := time.Now()
		if err := l.Broadcast(ctx, payload); err != nil {
			return Result{}, err
		}
		lat[i] = time.Since(t0)
	}
	return summarize("kvbm wire "+tr.String(), workers, len(payload), lat), nil
}

// ZMQEcho is the baseline: PUB → workers × SUB, each PUSHes [id] back to
// one PULL; an iteration ends when every worker echoed.
func ZMQEcho(workers int, payload []byte, iters int) (Result, error) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	lg := zmq4.WithLogger(slog.NewLogLogger(quiet.Handler(), slog.LevelDebug))
	pub := zmq4.NewPub(ctx, lg)
	defer pub.Close()
	pull := zmq4.NewPull(ctx, lg)
	defer pull.Close()
	if err := pub.Listen("tcp://127.0.0.1:0"); err != nil {
		return Result{}, err
	}
	if err := pull.Listen("tcp://127.0.0.1:0"); err != nil {
		return Result{}, err
	}
	pubURL := fmt.Sprintf("tcp://127.0.0.1:%d", pub.Addr().(*net.TCPAddr).Port)
	pullURL := fmt.Sprintf("tcp://127.0.0.1:%d", pull.Addr().(*net.TCPAddr).Port)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	for range workers {
		sub := zmq4.NewSub(ctx, lg)
		push := zmq4.NewPush(ctx, lg)
		if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
			return Result{}, err
		}
		if err := sub.Dial(pubURL); err != nil {
			return Result{}, err
		}
		if err := push.Dial(pullURL); err != nil {
			return Result{}, err
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer sub.Close()
			defer push.Close()
			for {
				m, err := sub.Recv()
				if err != nil || ctx.Err() != nil || len(m.Frames) == 0 {
					return
				}
				if push.Send(zmq4.NewMsg(m.Frames[0])) != nil {
					return
				}
			}
		}()
	}
	// One goroutine owns the PULL socket and hands ids over (the same
	// shape as the wire leader's receive loop waking a waiting Broadcast).
	acks := make(chan uint64, 4*workers)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			m, err := pull.Recv()
			if err != nil || ctx.Err() != nil || len(m.Frames) == 0 || len(m.Frames[0]) != 8 {
				return
			}
			select {
			case acks <- binary.BigEndian.Uint64(m.Frames[0]):
			case <-ctx.Done():
				return
			}
		}
	}()
	id := uint64(0)
	roundTrip := func(wait time.Duration) (bool, error) {
		id++
		idb := binary.BigEndian.AppendUint64(nil, id)
		if err := pub.SendMulti(zmq4.NewMsgFrom(idb, payload)); err != nil {
			return false, err
		}
		timer := time.NewTimer(wait)
		defer timer.Stop()
		for got := 0; got < workers; {
			select {
			case a := <-acks:
				if a == id {
					got++
				}
			case <-timer.C:
				return false, nil // slow joiners dropped it (warm-up only)
			}
		}
		return true, nil
	}
	// Warm up until every subscriber is joined (PUB drops before that).
	for ok := false; !ok; {
		var err error
		if ok, err = roundTrip(100 * time.Millisecond); err != nil {
			return Result{}, err
		}
	}
	for range min(iters/10+1, 100) {
		if _, err := roundTrip(time.Minute); err != nil {
			return Result{}, err
		}
	}
	lat := make([]time.Duration, iters)
	for i := range lat {
		t0 := time.Now()
		ok, err := roundTrip(time.Minute)
		if err != nil || !ok {
			return Result{}, fmt.Errorf("wirebench: echo round trip %d: ok=%v err=%v", i, ok, err)
		}
		lat[i] = time.Since(t0)
	}
	return summarize("bare zmq4 PUB/PULL echo", workers, len(payload), lat), nil
}
