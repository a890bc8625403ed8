// Package plan is the contract between the leader and its workers: the list of
// copies a worker executes for one engine step. The leader builds a Step, the
// engine ships its encoding to every worker (vLLM pickles it inside the
// connector metadata), and each worker executes it on its own shard.
//
// Execution order inside one step (workers rely on it, the leader plans for it):
//
//  0. Drops, when the step is bound: a dropped block may be reused by this
//     same step's saves, so forgetting it afterwards would lose their data.
//  1. Loads (G2/G3 → G1) at start_load_kv, before the forward pass reads G1.
//  2. Moves (G2 → G3) at wait_for_save, before any save can overwrite their source.
//  3. Saves (G1 → G2, or G1 → G3 in disk-only mode) at wait_for_save, after the
//     forward pass wrote the step's KV.
//
// A worker executes steps strictly in order, so a block saved in step N can be
// loaded in step N+1 or later.
package plan

import (
	"fmt"

	"github.com/vmihailenco/msgpack/v5"
)

// Tier names where a block lives.
type Tier uint8

const (
	G1 Tier = 1 // the engine's own KV cache (device memory, or host memory on CPU engines)
	G2 Tier = 2 // kvbm host memory
	G3 Tier = 3 // kvbm local disk
)

func (t Tier) String() string {
	switch t {
	case G1:
		return "G1"
	case G2:
		return "G2"
	case G3:
		return "G3"
	}
	return fmt.Sprintf("Tier(%d)", uint8(t))
}

// Copy moves one whole block (all layers, K and V) between tiers.
type Copy struct {
	Src      Tier  `msgpack:"s"`
	SrcBlock int64 `msgpack:"sb"`
	Dst      Tier  `msgpack:"d"`
	DstBlock int64 `msgpack:"db"`
}

// Load is the set of copies that onboard one request's matched prefix into
// its G1 blocks. The worker reports ReqID as finished loading once all its
// copies are done (successfully or not; failures are reported per G1 block).
type Load struct {
	ReqID  string `msgpack:"r"`
	Copies []Copy `msgpack:"c"`
}

// Step is everything a worker must do for one engine step.
type Step struct {
	Seq   uint64 `msgpack:"q"`
	Loads []Load `msgpack:"l,omitempty"`
	Moves []Copy `msgpack:"m,omitempty"`
	Saves []Copy `msgpack:"v,omitempty"`
	// Drops lists G2/G3 blocks whose contents are no longer valid (evicted
	// or failed verification); workers forget their checksums.
	Drops []Copy `msgpack:"x,omitempty"`
}

// Empty reports whether the step carries no work.
func (s *Step) Empty() bool {
	return len(s.Loads) == 0 && len(s.Moves) == 0 && len(s.Saves) == 0 && len(s.Drops) == 0
}

// Encode serialises the step.
func (s *Step) Encode() ([]byte, error) { return msgpack.Marshal(s) }

// Decode parses an encoded step.
func Decode(b []byte) (*Step, error) {
	var s Step
	if err := msgpack.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("decode step plan (%d bytes): %w", len(b), err)
	}
	return &s, nil
}
