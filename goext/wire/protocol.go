package wire

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvbm/kvbm/goext/internal/mpbound"
)

// Function names carried in frame 1 (see the package comment).
const (
	fnWorkerMetadata = "worker_metadata"
	fnLeaderMetadata = "leader_metadata"
	fnAllocating     = "allocating"
	fnPing           = "ping"
	fnStep           = "step"
	fnAck            = "ack"
	fnShutdown       = "shutdown"
	// fnBye: a worker closing on purpose (engine shutdown), so the leader
	// does not report it as a failure.
	fnBye = "bye"
)

// WorkerMetadata is what every rank reports in the handshake.
type WorkerMetadata struct {
	Rank            int   `msgpack:"rank"`
	WorldSize       int   `msgpack:"world_size"`
	NumDeviceBlocks int   `msgpack:"num_device_blocks"`
	BytesPerBlock   int64 `msgpack:"bytes_per_block"`
	// Pid and Instance tell two processes that claim the same rank apart
	// (two engines sharing one pair of ports, or a restarted worker).
	Pid      int    `msgpack:"pid"`
	Instance uint64 `msgpack:"instance"`
	// PidNS names the worker's PID namespace: the leader trusts Pid to tell
	// whether the process exited only when it shares that namespace.
	PidNS string `msgpack:"pid_ns,omitempty"`
}

// LeaderMetadata is the leader's answer: how many host and disk blocks every
// rank allocates (each of its own bytes_per_block).
type LeaderMetadata struct {
	NumHostBlocks int `msgpack:"num_host_blocks"`
	NumDiskBlocks int `msgpack:"num_disk_blocks"`
	WorldSize     int `msgpack:"world_size"`
}

// leaderMsg is a decoded leader → worker message.
type leaderMsg struct {
	id      uint64
	fn      string
	payload []byte
}

// workerMsg is a decoded worker → leader message.
type workerMsg struct {
	id      uint64
	fn      string
	rank    int
	payload []byte
}

var errFrame = errors.New("wire: malformed side-channel message")

func idFrame(id uint64) []byte {
	b := make([]byte, 8)
	binary.BigEndian.PutUint64(b, id)
	return b
}

// encodeLeader builds [id, fn, payload?].
func encodeLeader(id uint64, fn string, payload []byte) [][]byte {
	frames := [][]byte{idFrame(id), []byte(fn)}
	if payload != nil {
		frames = append(frames, payload)
	}
	return frames
}

// encodeWorker builds [id, fn, rank, payload?].
func encodeWorker(id uint64, fn string, rank int, payload []byte) [][]byte {
	r := make([]byte, 4)
	binary.BigEndian.PutUint32(r, uint32(rank))
	frames := [][]byte{idFrame(id), []byte(fn), r}
	if payload != nil {
		frames = append(frames, payload)
	}
	return frames
}

func decodeLeader(frames [][]byte) (leaderMsg, error) {
	if len(frames) < 2 || len(frames) > 3 || len(frames[0]) != 8 {
		return leaderMsg{}, fmt.Errorf("%w: leader message with %d frames", errFrame, len(frames))
	}
	m := leaderMsg{id: binary.BigEndian.Uint64(frames[0]), fn: string(frames[1])}
	if len(frames) == 3 {
		m.payload = frames[2]
	}
	return m, nil
}

func decodeWorker(frames [][]byte) (workerMsg, error) {
	if len(frames) < 3 || len(frames) > 4 || len(frames[0]) != 8 || len(frames[2]) != 4 {
		return workerMsg{}, fmt.Errorf("%w: worker message with %d frames", errFrame, len(frames))
	}
	m := workerMsg{
		id:   binary.BigEndian.Uint64(frames[0]),
		fn:   string(frames[1]),
		rank: int(binary.BigEndian.Uint32(frames[2])),
	}
	if len(frames) == 4 {
		m.payload = frames[3]
	}
	return m, nil
}

func marshal(v any) []byte {
	b, err := msgpack.Marshal(v)
	if err != nil {
		// Only plain structs of ints are marshalled here.
		panic(fmt.Sprintf("wire: marshal %T: %v", v, err))
	}
	return b
}

// unmarshal decodes a payload from the side channel, whose declared lengths
// are checked against its size first: msgpack reserves memory for a declared
// length before reading it (a bin's whole size, a string's in 1 MiB steps).
func unmarshal(b []byte, v any) error {
	if err := mpbound.Check(b); err != nil {
		return fmt.Errorf("%w: %T payload (%d bytes): %v", errFrame, v, len(b), err)
	}
	if err := msgpack.Unmarshal(b, v); err != nil {
		return fmt.Errorf("%w: %T payload (%d bytes): %v", errFrame, v, len(b), err)
	}
	return nil
}
