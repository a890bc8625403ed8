package zmqguard_test

import (
	"context"
	"testing"

	"github.com/go-zeromq/zmq4"

	"github.com/kvbm/kvbm/goext/zmqguard"
)

// pingPong measures a multipart message's round trip over two PUSH → PULL
// pairs (the side channel's ack path), through network: the guard's cost is
// Guarded against Plain, measured in the same run.
func pingPong(b *testing.B, network string) {
	ctx := context.Background()
	pull := zmq4.NewPull(ctx)
	defer pull.Close()
	if err := pull.Listen(network + "://127.0.0.1:0"); err != nil {
		b.Fatal(err)
	}
	push := zmq4.NewPush(ctx)
	defer push.Close()
	if err := push.Dial(network + "://" + pull.Addr().String()); err != nil {
		b.Fatal(err)
	}
	pull2 := zmq4.NewPull(ctx)
	defer pull2.Close()
	if err := pull2.Listen(network + "://127.0.0.1:0"); err != nil {
		b.Fatal(err)
	}
	push2 := zmq4.NewPush(ctx)
	defer push2.Close()
	if err := push2.Dial(network + "://" + pull2.Addr().String()); err != nil {
		b.Fatal(err)
	}
	go func() {
		for {
			m, err := pull.Recv()
			if err != nil {
				return
			}
			if push2.Send(m) != nil {
				return
			}
		}
	}()
	payload := make([]byte, 300)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := push.SendMulti(zmq4.NewMsgFrom([]byte("12345678"), []byte("step"), payload)); err != nil {
			b.Fatal(err)
		}
		if _, err := pull2.Recv(); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkPingPongPlain(b *testing.B)   { pingPong(b, "tcp") }
func BenchmarkPingPongGuarded(b *testing.B) { pingPong(b, zmqguard.Network) }
