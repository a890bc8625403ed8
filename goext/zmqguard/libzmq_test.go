package zmqguard_test

import (
	"bufio"
	"bytes"
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/zmqguard"
)

// libzmqPeer is a pyzmq (libzmq) process: a SUB and a PUSH that dial the Go
// side, and a PUB the Go side dials. It relays the first message its SUB gets
// back over its PUSH, then publishes until killed.
const libzmqPeer = `
import sys, time, zmq
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect("tcp://" + sys.argv[1])
push = ctx.socket(zmq.PUSH)
push.connect("tcp://" + sys.argv[2])
pub = ctx.socket(zmq.PUB)
print(pub.bind_to_random_port("tcp://127.0.0.1"), flush=True)
sub.RCVTIMEO = 20000
push.send_multipart([b"relayed"] + sub.recv_multipart())
while True:
    pub.send_multipart([b"py", b"x" * 300])
    time.sleep(0.02)
`

// pythonWithZMQ finds a Python that imports zmq: the repository's .venv
// first, then python3 on PATH.
func pythonWithZMQ(t *testing.T) string {
	for _, py := range []string{"../../.venv/bin/python", "python3"} {
		if exec.Command(py, "-c", "import zmq").Run() == nil {
			return py
		}
	}
	t.Skip("no Python with pyzmq")
	return ""
}

// The guard speaks ZMTP as libzmq does, in both directions, with short and
// long frames.
// Both publishers are checked: zmq4's through the guarded transport, and
// kvbm's own Pub.
func TestLibzmqPeers(t *testing.T) {
	py := pythonWithZMQ(t)
	for name, pub := range map[string]func() zmq4.Socket{
		"zmq4 PUB": func() zmq4.Socket { return zmq4.NewPub(context.Background()) },
		"kvbm Pub": func() zmq4.Socket { return zmqguard.NewPub() },
	} {
		t.Run(name, func(t *testing.T) { libzmqPeers(t, py, pub()) })
	}
}

func libzmqPeers(t *testing.T, py string, pub zmq4.Socket) {
	defer pub.Close()
	require.NoError(t, pub.Listen(zmqguard.Endpoint("tcp://127.0.0.1:0")))
	pull := zmq4.NewPull(context.Background())
	defer pull.Close()
	require.NoError(t, pull.Listen(zmqguard.Endpoint("tcp://127.0.0.1:0")))

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, py, "-c", libzmqPeer, pub.Addr().String(), pull.Addr().String())
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	port, err := bufio.NewReader(out).ReadString('\n')
	require.NoError(t, err)

	long := bytes.Repeat([]byte{'L'}, 1000)
	got := make(chan [][]byte, 1)
	go func() {
		msg, err := pull.Recv()
		if err == nil {
			got <- msg.Frames
		}
	}()
	var relayed [][]byte
	for relayed == nil {
		require.NoError(t, pub.Send(zmq4.NewMsgFrom([]byte("go"), long)))
		select {
		case relayed = <-got:
		case <-time.After(100 * time.Millisecond):
		case <-ctx.Done():
			t.Fatal("pyzmq SUB never relayed the Go PUB's message")
		}
	}
	require.Equal(t, [][]byte{[]byte("relayed"), []byte("go"), long}, relayed)

	sub := zmq4.NewSub(context.Background())
	defer sub.Close()
	require.NoError(t, sub.SetOption(zmq4.OptionSubscribe, ""))
	require.NoError(t, sub.Dial(zmqguard.Endpoint("tcp://127.0.0.1:"+strings.TrimSpace(port))))
	msg, err := sub.Recv()
	require.NoError(t, err)
	require.Equal(t, [][]byte{[]byte("py"), bytes.Repeat([]byte{'x'}, 300)}, msg.Frames)
}
