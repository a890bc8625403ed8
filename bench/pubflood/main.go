// Command pubflood measures what a subscription flood costs a kvbm
// publisher: a PUB bound as the consolidator's output is (kvbm's
// zmqguard.Pub, or with -pub zmq4 zmq4's PUB, as it was; same high-water
// mark, through the same transport) takes -topics distinct
// subscriptions of -topic-bytes each from one hostile peer, which reconnects
// whenever it is dropped until it has sent them all. It prints the Go heap
// in use and the process's RSS before and after, the topics the PUB holds,
// and the round trip of a broadcast to an honest subscriber (publish, then
// receive) before and during the flood.
//
// -network kvbm+tcp is kvbm's guarded transport (goext/zmqguard); -network
// tcp is zmq4's own, which handles subscriptions as the guard did before it
// capped them (with -pub zmq4 only: kvbm's Pub listens only through the
// guard).
//
//	go run ./bench/pubflood [-pub kvbm|zmq4] [-network kvbm+tcp|tcp] [-topics 200000] [-topic-bytes 1024]
package main

import (
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvbm/kvbm/goext/zmqguard"
)

func main() {
	network := flag.String("network", zmqguard.Network, "zmq4 transport of the PUB: kvbm+tcp (guarded) or tcp")
	topics := flag.Int("topics", 200_000, "distinct subscriptions the hostile peer sends")
	topicBytes := flag.Int("topic-bytes", 1024, "bytes per topic")
	kind := flag.String("pub", "kvbm", "publisher: kvbm (zmqguard.Pub) or zmq4 (zmq4.NewPub)")
	flag.Parse()

	var pub zmq4.Socket
	switch *kind {
	case "kvbm":
		pub = zmqguard.NewPub()
	case "zmq4":
		pub = zmq4.NewPub(context.Background())
	default:
		log.Fatalf("-pub %q: want kvbm or zmq4", *kind)
	}
	defer pub.Close()
	check(pub.SetOption(zmq4.OptionHWM, 1<<16)) // the consolidator's output
	check(pub.Listen(*network + "://127.0.0.1:0"))
	addr := pub.Addr().String()

	sub := zmq4.NewSub(context.Background())
	defer sub.Close()
	check(sub.SetOption(zmq4.OptionSubscribe, ""))
	check(sub.Dial(*network + "://" + addr))
	waitTopics(pub, func(n int) bool { return n == 1 })

	heap0, rss0 := memory()
	lat0 := broadcast(pub, sub, 200)

	start := time.Now()
	conns, dropped := flood(addr, *topics, *topicBytes)
	held := waitTopics(pub, func(int) bool { return false }) // until it stops changing
	floodTime := time.Since(start)
	heap1, rss1 := memory()
	lat1 := broadcast(pub, sub, 50)
	for _, c := range conns {
		_ = c.Close()
	}

	fmt.Printf("%s PUB, network %s: %d subscriptions of %d bytes in %.1fs over %d connections (%d dropped by the PUB side)\n",
		*kind, *network, *topics, *topicBytes, floodTime.Seconds(), len(conns), dropped)
	fmt.Printf("topics held by the PUB after the flood: %d\n", held)
	fmt.Printf("Go heap in use: %.1f MB -> %.1f MB (+%.1f MB)\n", mb(heap0), mb(heap1), mb(heap1)-mb(heap0))
	fmt.Printf("RSS:            %.1f MB -> %.1f MB (+%.1f MB)\n", mb(rss0), mb(rss1), mb(rss1)-mb(rss0))
	fmt.Printf("broadcast round trip p50/p99: before %s/%s, during %s/%s\n", lat0[0], lat0[1], lat1[0], lat1[1])
}

// flood sends n distinct subscriptions of size bytes, reconnecting when the
// PUB side drops the connection; it returns the connections (the last one
// still open) and how many were dropped.
func flood(addr string, n, size int) (conns []net.Conn, dropped int) {
	topic := make([]byte, size)
	next := 0
	for next < n {
		c := handshake(addr)
		conns = append(conns, c)
		var batch []byte
		for next < n {
			batch = batch[:0]
			for k := 0; k < 256 && next+k < n; k++ {
				binary.BigEndian.PutUint64(topic, uint64(next+k))
				batch = appendFrame(batch, append([]byte{1}, topic...))
			}
			if _, err := c.Write(batch); err != nil {
				dropped++
				_ = c.Close()
				break
			}
			next += 256
		}
	}
	return conns, dropped
}

func appendFrame(b, body []byte) []byte {
	if len(body) > 255 {
		b = append(b, 0x02)
		b = binary.BigEndian.AppendUint64(b, uint64(len(body)))
	} else {
		b = append(b, 0, byte(len(body)))
	}
	return append(b, body...)
}

// handshake connects as a SUB by hand (ZMTP 3.0, NULL).
func handshake(addr string) net.Conn {
	c, err := net.Dial("tcp", addr)
	check(err)
	g := make([]byte, 64)
	g[0], g[9], g[10] = 0xFF, 0x7F, 3
	copy(g[12:], "NULL")
	ready := append([]byte{5}, "READY"...)
	ready = append(ready, 11)
	ready = append(ready, "Socket-Type"...)
	ready = binary.BigEndian.AppendUint32(ready, 3)
	ready = append(ready, "SUB"...)
	_, err = c.Write(append(g, append([]byte{0x04, byte(len(ready))}, ready...)...))
	check(err)
	peer := make([]byte, 64+2)
	_, err = io.ReadFull(c, peer)
	check(err)
	_, err = io.CopyN(io.Discard, c, int64(peer[65]))
	check(err)
	return c
}

// waitTopics polls the PUB's topic count until done says so or it stays the
// same for a second, and returns it.
func waitTopics(pub zmq4.Socket, done func(int) bool) int {
	last, since := -1, time.Now()
	for {
		n := len(pub.(zmq4.Topics).Topics())
		if done(n) {
			return n
		}
		if n != last {
			last, since = n, time.Now()
		} else if time.Since(since) > time.Second {
			return n
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// broadcast publishes n messages one at a time and returns the p50 and p99
// of publish-to-receive.
func broadcast(pub, sub zmq4.Socket, n int) [2]time.Duration {
	var lat []time.Duration
	payload := []byte(strings.Repeat("x", 512))
	for range n {
		t := time.Now()
		check(pub.Send(zmq4.NewMsgFrom([]byte{}, payload)))
		_, err := sub.Recv()
		check(err)
		lat = append(lat, time.Since(t))
	}
	slices.Sort(lat)
	return [2]time.Duration{lat[len(lat)/2].Round(time.Microsecond), lat[len(lat)*99/100].Round(time.Microsecond)}
}

// memory returns the Go heap in use after a collection and the RSS.
func memory() (heap, rss uint64) {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	status, err := os.ReadFile("/proc/self/status")
	check(err)
	for _, line := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			var kb uint64
			_, err := fmt.Sscanf(strings.TrimSpace(v), "%d kB", &kb)
			check(err)
			rss = kb << 10
		}
	}
	if rss == 0 {
		check(errors.New("no VmRSS in /proc/self/status"))
	}
	return ms.HeapInuse, rss
}

func mb(b uint64) float64 { return float64(b) / 1e6 }

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
