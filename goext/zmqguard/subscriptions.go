package zmqguard

import (
	"bytes"
	"encoding/binary"
	"fmt"
)

// Subscriptions a subscriber may hold on one connection to a publisher.
//
// zmq4's PUB keeps every distinct topic a peer subscribes to, for as long as
// the connection lives, and compares every published message against each
// of them under the lock that serialises publishing: 200k distinct 1 KB
// topics from one peer cost a publisher 258 MB and slowed each broadcast
// from 1 to 51 ms. kvbm publishes under the empty topic and its subscribers
// (kvbm's workers, Dynamo's router, engines' tools) ask for everything or
// for a handful of prefixes, so these caps leave ample room for any honest
// subscriber while bounding what one connection can make a publisher keep.
const (
	// MaxSubscriptions caps the distinct topics one connection holds.
	MaxSubscriptions = 64
	// MaxSubscriptionBytes caps the sum of the lengths of those topics.
	MaxSubscriptionBytes = 64 << 10

	// maxSubscriberFrame bounds a frame from a subscriber: the longest
	// subscription is a SUBSCRIBE command (name length, name) or a message
	// (one byte) with a topic of MaxSubscriptionBytes.
	maxSubscriberFrame = 1 + len(cmdSubscribe) + MaxSubscriptionBytes
)

const (
	cmdSubscribe = "SUBSCRIBE"
	cmdCancel    = "CANCEL"
)

// subscriberFilter is the incoming side of a connection whose peer said it
// is a subscriber (SUB or XSUB in its READY command), so kvbm's side is a
// publisher. A subscriber sends only subscriptions: in ZMTP 3.0 a message of
// one frame whose first byte is 1 (subscribe) or 0 (cancel) followed by the
// topic, in ZMTP 3.1 a SUBSCRIBE or CANCEL command. The filter reads whole
// frames (at most maxSubscriberFrame bytes, so zmq4 never allocates more),
// keeps the peer's topic set to enforce MaxSubscriptions and
// MaxSubscriptionBytes, and hands zmq4 only the subscriptions, as ZMTP 3.0
// messages. Everything else is swallowed, as libzmq's PUB ignores it:
// zmq4's PUB queues any other message (a ZMTP 3.1 command included) in a
// queue that nothing reads, and once ten are queued every connection's
// reader that gets one blocks forever.
type subscriberFilter struct {
	max      uint64 // largest frame: maxSubscriberFrame or MaxMessageSize if less
	in       []byte // bytes read and not yet parsed: at most one frame
	out      []byte // subscriptions for zmq4
	outOff   int    // out[outOff:] not yet handed over
	topics   map[string]struct{}
	bytes    int  // sum of len(topic) over topics
	skipping bool // inside a multipart message being swallowed
}

// subscriberError is a subscriber the guard drops.
type subscriberError struct {
	oversized bool // a frame over max, counted as Stats.OversizedMessages
	msg       string
}

func (e *subscriberError) Error() string { return e.msg }

// read hands zmq4 filtered bytes, reading from c until there are some.
func (f *subscriberFilter) read(c *Conn, p []byte) (int, error) {
	for f.outOff == len(f.out) {
		f.out, f.outOff = f.out[:0], 0
		if err := f.parse(); err != nil {
			if err.oversized {
				c.t.oversized.Add(1)
				return 0, c.drop(err.msg)
			}
			return 0, c.dropSubscriber(err.msg)
		}
		if len(f.out) > 0 {
			break
		}
		if cap(f.in)-len(f.in) < 512 {
			f.in = append(make([]byte, 0, max(4096, 2*cap(f.in))), f.in...)
		}
		n, err := c.Conn.Read(f.in[len(f.in):cap(f.in)])
		f.in = f.in[:len(f.in)+n]
		if n == 0 && err != nil {
			return 0, err
		}
	}
	n := copy(p, f.out[f.outOff:])
	f.outOff += n
	return n, nil
}

// parse consumes every complete frame of in.
func (f *subscriberFilter) parse() *subscriberError {
	in := f.in
	for len(in) >= 2 {
		flags := in[0]
		if flags&^flagsKnown != 0 || flags&(flagCommand|flagMore) == flagCommand|flagMore {
			return &subscriberError{msg: fmt.Sprintf("frame flags %#x", flags)}
		}
		hdr, size := 2, uint64(in[1])
		if flags&flagLong != 0 {
			if len(in) < 9 {
				break
			}
			hdr, size = 9, binary.BigEndian.Uint64(in[1:9])
		}
		if size > f.max {
			return &subscriberError{oversized: true,
				msg: fmt.Sprintf("subscriber sent a frame of %d bytes (limit %d)", size, f.max)}
		}
		end := hdr + int(size)
		if len(in) < end {
			if cap(f.in) < end {
				// The frame is bounded above: make room for all of it.
				grown := make([]byte, len(in), end+512)
				copy(grown, in)
				f.in = grown
				return nil
			}
			break
		}
		if err := f.frame(flags, in[hdr:end], in[:end]); err != nil {
			return err
		}
		in = in[end:]
	}
	f.in = f.in[:copy(f.in, in)]
	return nil
}

// frame handles one complete frame (raw: with its header).
func (f *subscriberFilter) frame(flags byte, body, raw []byte) *subscriberError {
	if f.skipping {
		f.skipping = flags&flagMore != 0
		return nil
	}
	if flags&flagCommand != 0 {
		if len(body) == 0 || 1+int(body[0]) > len(body) {
			return nil
		}
		name, topic := body[1:1+int(body[0])], body[1+int(body[0]):]
		var sub byte
		switch string(name) {
		case cmdSubscribe:
			sub = 1
		case cmdCancel:
			sub = 0
		default:
			return nil
		}
		if err := f.apply(sub == 1, topic); err != nil {
			return err
		}
		// As the ZMTP 3.0 message zmq4 understands.
		n := uint64(1 + len(topic))
		if n > 255 {
			f.out = append(f.out, flagLong)
			f.out = binary.BigEndian.AppendUint64(f.out, n)
		} else {
			f.out = append(f.out, 0, byte(n))
		}
		f.out = append(f.out, sub)
		f.out = append(f.out, topic...)
		return nil
	}
	if flags&flagMore != 0 {
		f.skipping = true
		return nil
	}
	if len(body) == 0 || body[0] > 1 {
		return nil
	}
	if err := f.apply(body[0] == 1, body[1:]); err != nil {
		return err
	}
	f.out = append(f.out, raw...)
	return nil
}

// apply records a subscription (sub) or its cancellation.
func (f *subscriberFilter) apply(sub bool, topic []byte) *subscriberError {
	_, have := f.topics[string(topic)]
	switch {
	case !sub:
		if have {
			delete(f.topics, string(topic))
			f.bytes -= len(topic)
		}
	case have:
	case len(f.topics) >= MaxSubscriptions:
		return &subscriberError{msg: fmt.Sprintf("subscriber went over %d topics", MaxSubscriptions)}
	case f.bytes+len(topic) > MaxSubscriptionBytes:
		return &subscriberError{msg: fmt.Sprintf("subscriber went over %d bytes of topics", MaxSubscriptionBytes)}
	default:
		if f.topics == nil {
			f.topics = make(map[string]struct{})
		}
		f.topics[string(topic)] = struct{}{}
		f.bytes += len(topic)
	}
	return nil
}

// peerIsSubscriber reports whether a READY command's body (name included)
// names a SUB or XSUB socket in any Socket-Type property (names compared
// without case, as ZMTP says). zmq4 takes the last property whose name it
// title-cases to Socket-Type; any READY that zmq4 reads as a subscriber's
// is one here too.
func peerIsSubscriber(ready []byte) bool {
	if len(ready) == 0 || 1+int(ready[0]) > len(ready) {
		return false
	}
	p := ready[1+int(ready[0]):]
	for len(p) > 0 {
		kl := int(p[0])
		if 1+kl+4 > len(p) {
			return false
		}
		k := p[1 : 1+kl]
		vl := binary.BigEndian.Uint32(p[1+kl : 1+kl+4])
		p = p[1+kl+4:]
		if uint64(vl) > uint64(len(p)) {
			return false
		}
		v := p[:vl]
		p = p[vl:]
		if bytes.EqualFold(k, []byte("Socket-Type")) && (string(v) == "SUB" || string(v) == "XSUB") {
			return true
		}
	}
	return false
}
