package consolidator

import (
	"context"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
)

// checkFor polls fn every interval until it returns nil or timeout passes
// (nats-server's test helper): tests wait for a state, never for a time.
func checkFor(t testing.TB, timeout, interval time.Duration, fn func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var err error
	for time.Now().Before(deadline) {
		if err = fn(); err == nil {
			return
		}
		time.Sleep(interval)
	}
	t.Fatalf("condition not met after %s: %v", timeout, err)
}

type errString string

func (e errString) Error() string { return string(e) }

// waitSubscribed waits until a PUB socket has a subscriber for all topics:
// messages published before that are lost (ZMQ's slow joiner).
func waitSubscribed(t testing.TB, pub zmq4.Socket) {
	t.Helper()
	checkFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		for _, tp := range pub.(zmq4.Topics).Topics() {
			if tp == "" {
				return nil
			}
		}
		return errString("no subscriber yet")
	})
}

// recvWithTimeout receives one message from a SUB socket, failing the test
// if none comes.
func recvWithTimeout(t testing.TB, msgs <-chan zmq4.Msg) zmq4.Msg {
	t.Helper()
	select {
	case m := <-msgs:
		return m
	case <-time.After(10 * time.Second):
		t.Fatal("no message from the consolidator")
	}
	return zmq4.Msg{}
}

// startSub connects a SUB socket to ep and forwards its messages to a
// channel until the test ends.
func startSub(t testing.TB, ep string) <-chan zmq4.Msg {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	sub := zmq4.NewSub(ctx)
	require.NoError(t, sub.SetOption(zmq4.OptionSubscribe, ""))
	require.NoError(t, sub.Dial(ep))
	ch := make(chan zmq4.Msg, 1024)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			m, err := sub.Recv()
			if err != nil {
				return
			}
			ch <- m
		}
	}()
	t.Cleanup(func() {
		cancel()
		_ = sub.Close()
		<-done
	})
	return ch
}

func mustPack(t testing.TB, v any) []byte {
	t.Helper()
	b, err := msgpack.Marshal(v)
	require.NoError(t, err)
	return b
}

func u64s(xs ...uint64) []any {
	out := make([]any, len(xs))
	for i, x := range xs {
		out[i] = x
	}
	return out
}

func anyTokens(chunks ...[]uint32) []any {
	var out []any
	for _, c := range chunks {
		for _, t := range c {
			out = append(out, t)
		}
	}
	return out
}

// dumpOnFail prints a consolidator's stats and log lines if the test fails.
func dumpOnFail(t *testing.T, c *Consolidator, rec *logRecorder) {
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		t.Logf("stats %+v", c.Stats())
		for _, l := range rec.all() {
			t.Log(l)
		}
	})
}
