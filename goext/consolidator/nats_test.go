package consolidator

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sort"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/events"
	"github.com/kvbm/kvbm/goext/hashing"
	"github.com/kvbm/kvbm/goext/metrics"
)

// runNATS starts an in-process nats-server on 127.0.0.1:port (-1: any).
func runNATS(t testing.TB, port int) *server.Server {
	t.Helper()
	s, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: port, NoLog: true, NoSigs: true})
	require.NoError(t, err)
	go s.Start()
	require.True(t, s.ReadyForConnections(10*time.Second), "nats-server did not start")
	t.Cleanup(s.Shutdown)
	return s
}

func natsPort(s *server.Server) int { return s.Addr().(*net.TCPAddr).Port }

// gate is a nats.CustomDialer the test opens and closes, so that the
// consolidator reconnects only once the test's subscriber is back: NATS
// core delivers only to subscribers present at publish time, and without
// the gate which client reconnects first would be a race.
type gate struct{ open atomic.Bool }

func (g *gate) Dial(network, address string) (net.Conn, error) {
	if !g.open.Load() {
		return nil, errors.New("test gate closed")
	}
	return net.DialTimeout(network, address, time.Second)
}

// routerSub subscribes the test to subject and returns its raw messages.
func routerSub(t testing.TB, url, subject string) (*nats.Conn, <-chan *nats.Msg) {
	t.Helper()
	nc, err := nats.Connect(url, nats.ReconnectWait(10*time.Millisecond), nats.MaxReconnects(-1))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	ch := make(chan *nats.Msg, 1024)
	_, err = nc.ChanSubscribe(subject, ch)
	require.NoError(t, err)
	require.NoError(t, nc.Flush())
	return nc, ch
}

func nextMsg(t testing.TB, ch <-chan *nats.Msg) map[string]any {
	t.Helper()
	select {
	case m := <-ch:
		dec := json.NewDecoder(bytes.NewReader(m.Data))
		dec.UseNumber() // u64 values compared exactly
		var v map[string]any
		require.NoError(t, dec.Decode(&v), string(m.Data))
		return v
	case <-time.After(10 * time.Second):
		t.Fatal("no RouterEvent from the consolidator")
	}
	return nil
}

func keys(m map[string]any) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func num(u uint64) json.Number { return json.Number(strconv.FormatUint(u, 10)) }

// checkStored checks a RouterEvent field by field: exact field names, a
// stored block with the router local hash of its tokens.
func checkStored(t testing.TB, ev map[string]any, workerID, eventID, hash uint64, parent *uint64, tokens []uint32, lora string) {
	t.Helper()
	require.Equal(t, []string{"event", "storage_tier", "worker_id"}, keys(ev))
	require.Equal(t, num(workerID), ev["worker_id"])
	require.Equal(t, "device", ev["storage_tier"])
	inner := ev["event"].(map[string]any)
	require.Equal(t, []string{"data", "dp_rank", "event_id"}, keys(inner))
	require.Equal(t, num(eventID), inner["event_id"])
	require.Equal(t, json.Number("0"), inner["dp_rank"])
	data := inner["data"].(map[string]any)
	require.Equal(t, []string{"stored"}, keys(data))
	stored := data["stored"].(map[string]any)
	require.Equal(t, []string{"blocks", "parent_hash"}, keys(stored))
	if parent == nil {
		require.Nil(t, stored["parent_hash"])
	} else {
		require.Equal(t, num(*parent), stored["parent_hash"])
	}
	blocks := stored["blocks"].([]any)
	require.Len(t, blocks, 1)
	blk := blocks[0].(map[string]any)
	require.Equal(t, []string{"block_hash", "tokens_hash"}, keys(blk))
	require.Equal(t, num(hash), blk["block_hash"])
	require.Equal(t, num(hashing.RouterLocalHash(tokens, lora)), blk["tokens_hash"])
}

func eventID(t testing.TB, ev map[string]any) uint64 {
	t.Helper()
	id, err := strconv.ParseUint(string(ev["event"].(map[string]any)["event_id"].(json.Number)), 10, 64)
	require.NoError(t, err)
	return id
}

func u64p(v uint64) *uint64 { return &v }

func TestNATSRouterEvents(t *testing.T) {
	s := runNATS(t, -1)
	subject := "namespace.dynamo.component.backend.kv-events"
	_, msgs := routerSub(t, s.ClientURL(), subject)
	c, err := New(Config{NATSURL: s.ClientURL(), Namespace: "dynamo", Component: "backend", WorkerID: 7})
	require.NoError(t, err)
	defer c.Close()

	c.Publish(events.BlockEvent{Holder: host, SeqHash: 900, Tokens: tokA, BlockSize: 4})
	c.Publish(events.BlockEvent{Holder: host, SeqHash: 901, Parent: 900, HasParent: true, Tokens: tokB, BlockSize: 4})
	c.Publish(events.BlockEvent{Holder: disk, SeqHash: 901, Parent: 900, HasParent: true, Tokens: tokB, BlockSize: 4}) // dedup
	c.Publish(events.BlockEvent{Holder: host, SeqHash: 902, Parent: 901, HasParent: true, Tokens: tokC, BlockSize: 4})
	c.Publish(events.BlockEvent{Holder: host, SeqHash: 903, Tokens: tokA, BlockSize: 4, LoraName: "adapter"})
	c.Publish(events.BlockEvent{Removed: true, Holder: host, SeqHash: 901}) // disk still holds it
	c.Publish(events.BlockEvent{Removed: true, Holder: host, SeqHash: 902})

	checkStored(t, nextMsg(t, msgs), 7, 0, 900, nil, tokA, "")
	checkStored(t, nextMsg(t, msgs), 7, 1, 901, u64p(900), tokB, "")
	checkStored(t, nextMsg(t, msgs), 7, 2, 902, u64p(901), tokC, "")
	checkStored(t, nextMsg(t, msgs), 7, 3, 903, nil, tokA, "adapter")

	rm := nextMsg(t, msgs)
	require.Equal(t, []string{"event", "storage_tier", "worker_id"}, keys(rm))
	inner := rm["event"].(map[string]any)
	require.Equal(t, num(4), inner["event_id"])
	require.Equal(t, map[string]any{"removed": map[string]any{"block_hashes": []any{num(902)}}}, inner["data"])

	checkFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if st := c.Stats(); st.NATSEvents != 5 {
			return fmt.Errorf("confirmed %d", st.NATSEvents)
		}
		return nil
	})
	select {
	case m := <-msgs:
		t.Fatalf("unexpected extra event %s", m.Data)
	default:
	}
}

// TestNATSRestart: the server restarts mid-stream. Events within the
// buffer are delivered after the reconnect, in order, without duplicates;
// events beyond it are dropped, counted and logged, and show as an
// event_id gap.
func TestNATSRestart(t *testing.T) {
	s1 := runNATS(t, -1)
	port := natsPort(s1)
	url := s1.ClientURL()
	subject := events.Subject("dynamo", "backend")
	subConn, msgs := routerSub(t, url, subject)

	g := &gate{}
	g.open.Store(true)
	rec := &logRecorder{}
	m := metrics.New()
	c, err := New(Config{NATSURL: url, Namespace: "dynamo", Component: "backend", BufferLimit: 5,
		ReconnectMin: 10 * time.Millisecond, ReconnectMax: 50 * time.Millisecond,
		NATSOptions: []nats.Option{nats.SetCustomDialer(g)}, Logger: slog.New(rec), Metrics: m})
	require.NoError(t, err)
	defer c.Close()
	dumpOnFail(t, c, rec)

	store := func(i int) {
		c.Publish(events.BlockEvent{Holder: host, SeqHash: uint64(1000 + i), Tokens: []uint32{uint32(i), 0, 0, 0}, BlockSize: 4})
	}
	store(0)
	require.Equal(t, uint64(0), eventID(t, nextMsg(t, msgs)))
	// Event 0 stays buffered until the server confirms it, which can be
	// after the subscriber has it: a shutdown before that keeps it
	// buffered (to resend), and the buffer would hold one event less below.
	checkFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if st := c.Stats(); st.NATSBuffered != 0 || st.NATSEvents != 1 {
			return fmt.Errorf("buffered %d confirmed %d", st.NATSBuffered, st.NATSEvents)
		}
		return nil
	})

	// The server goes down; the consolidator may not come back until the
	// test's subscriber has.
	g.open.Store(false)
	s1.Shutdown()
	checkFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if c.nats.nc.IsConnected() {
			return errString("consolidator still connected")
		}
		return nil
	})
	for i := 1; i <= 8; i++ { // event ids 1..8; the buffer holds 5
		store(i)
	}
	checkFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if st := c.Stats(); st.NATSBuffered != 5 || st.NATSDropped != 3 {
			return fmt.Errorf("buffered %d dropped %d", st.NATSBuffered, st.NATSDropped)
		}
		return nil
	})
	require.Equal(t, 3.0, testutil.ToFloat64(m.EventsDropped))
	require.NotEmpty(t, rec.grep("NATS buffer full (5 events); dropping events from event_id 6"))

	runNATS(t, port)
	checkFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if !subConn.IsConnected() {
			return errString("test subscriber not reconnected")
		}
		return nil
	})
	require.NoError(t, subConn.Flush()) // its subscription is on the new server
	g.open.Store(true)

	for want := uint64(1); want <= 5; want++ {
		require.Equal(t, want, eventID(t, nextMsg(t, msgs)), "buffered events arrive in order, once")
	}
	// Events stay buffered until the server confirms them, which can be
	// just after the subscriber has them.
	checkFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if c.Stats().NATSBuffered != 0 {
			return errString("delivery not confirmed yet")
		}
		return nil
	})
	store(9) // event id 9: ids 6..8 were dropped
	require.Equal(t, uint64(9), eventID(t, nextMsg(t, msgs)))
	checkFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if len(rec.grep("3 event(s) were dropped while it was unavailable")) == 0 {
			return errString("no drop summary logged")
		}
		return nil
	})
	checkFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if st := c.Stats(); st.NATSEvents != 7 || st.NATSBuffered != 0 || st.NATSDropped != 3 {
			return fmt.Errorf("stats %+v", st)
		}
		return nil
	})
}

// TestNATSDownAtStart: no server when the consolidator starts; it keeps
// running, buffers, and delivers once NATS appears.
func TestNATSDownAtStart(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := l.Addr().(*net.TCPAddr).Port
	require.NoError(t, l.Close())
	url := fmt.Sprintf("nats://127.0.0.1:%d", port)

	g := &gate{}
	g.open.Store(true)
	rec := &logRecorder{}
	c, err := New(Config{NATSURL: url, Namespace: "ns", Component: "tensorrt_llm", LegacySubject: true,
		ReconnectMin: 10 * time.Millisecond, ReconnectMax: 50 * time.Millisecond,
		NATSOptions: []nats.Option{nats.SetCustomDialer(g)}, Logger: slog.New(rec)})
	require.NoError(t, err, "NATS down at start is not an error")
	defer c.Close()
	require.NotEmpty(t, rec.grep("is not reachable yet"))

	c.Publish(events.BlockEvent{Holder: host, SeqHash: 1, Tokens: tokA, BlockSize: 4})
	c.Publish(events.BlockEvent{Holder: disk, SeqHash: 2, Parent: 1, HasParent: true, Tokens: tokB, BlockSize: 4})
	checkFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if c.Stats().NATSBuffered != 2 {
			return errString("not buffered yet")
		}
		return nil
	})

	g.open.Store(false)
	s := runNATS(t, port)
	_, msgs := routerSub(t, s.ClientURL(), "namespace.ns.component.tensorrt_llm.kv_events")
	g.open.Store(true)
	checkStored(t, nextMsg(t, msgs), 0, 0, 1, nil, tokA, "")
	checkStored(t, nextMsg(t, msgs), 0, 1, 2, u64p(1), tokB, "")
}

// Empty namespace and component take Dynamo's defaults for the engine; the
// consolidator is their one definition (the adapters pass only what the user set).
func TestNATSSubjectDefaults(t *testing.T) {
	for _, tc := range []struct {
		engine  Engine
		ns      string
		subject string
	}{
		{EngineVllm, "", "namespace.dynamo.component.backend.kv-events"},
		{EngineTrtllm, "", "namespace.dynamo.component.tensorrt_llm.kv-events"},
		{EngineTrtllm, "prod", "namespace.prod.component.tensorrt_llm.kv-events"},
	} {
		// An address nothing listens on: NATS being down is not an error.
		c, err := New(Config{Engine: tc.engine, NATSURL: "nats://127.0.0.1:1", Namespace: tc.ns,
			ReconnectMin: time.Millisecond, ReconnectMax: 10 * time.Millisecond})
		require.NoError(t, err)
		require.Equal(t, tc.subject, c.NATSSubject())
		require.NoError(t, c.Close())
	}
}
