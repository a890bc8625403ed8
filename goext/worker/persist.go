package worker

import (
	"sync/atomic"
	"time"

	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/storage"
)

// Persistent disk tier (Options.DiskPersist, docs/persistent-g3.md).
//
// The leader tags every G3 write of a step with the block it stores
// (plan.Step.Tags). Binding or running a step stages, for each G3
// destination of its Moves and Saves, that step's tag — or none, so that a
// tag never outlives the step it came with — and the write records it in
// the block's header on disk. At start the worker adopts the blocks whose
// headers verified: they are valid, with the checksum from their header, so
// a load verifies the payload as for any block written by this process, and
// at its first load also against the payload MAC the header records
// (storage.DiskRegion.VerifyRecovered): one that does not verify
// is a failed load (the leader frees the block), counted in
// kvbm_g3_load_unauthenticated_blocks.
//
// G2→G3 moves sent over the side channel (the leader's background mode)
// carry no tags: the side channel must not carry request contents. The
// engine step that saves a G2 block carries its tag instead (Step.HostTags);
// the worker keeps it with the block until the block is written again or
// dropped, and a move's TagRef hands it to the G3 copy when the ids match.

// persistDisk is the disk tier's header API; tests substitute the disk.
type persistDisk interface {
	WriteBlockHeader(i int, buf []byte, h *storage.BlockHeader) error
	InvalidateHeader(i int) error
}

// ErrUnauthenticated: a recovered G3 block's payload does not verify
// against the MAC its header records.
var ErrUnauthenticated = storage.ErrUnauthenticated

// recoveredDisk checks a recovered block's payload against its MAC.
type recoveredDisk interface {
	VerifyRecovered(i int, payload []byte) error
}

// adoptRecovered marks the recovered blocks valid. Called by RegisterG1
// once the disk tier is open.
func (w *Worker) adoptRecovered() {
	if w.diskFile == nil || !w.diskFile.Persistent() {
		return
	}
	w.tags = make([]atomic.Pointer[plan.BlockTag], w.opts.DiskBlocks)
	w.hostTags = make([]atomic.Pointer[plan.HostTag], w.opts.HostBlocks)
	w.m.G3LoadUnauthenticated() // exported from the start, at 0
	rec := w.diskFile.Recovery()
	for _, b := range rec.Blocks {
		w.diskSum[b.Index].Store(b.PayloadSum)
		w.diskValid[b.Index].Store(true)
	}
}

// Recovered returns the blocks this worker's persistent disk tier recovered
// at start (in block order) and what it discarded; empty without one.
func (w *Worker) Recovered() storage.Recovery {
	if w.diskFile == nil {
		return storage.Recovery{}
	}
	return w.diskFile.Recovery()
}

// DiskPersistent reports whether the disk tier file outlives the process.
func (w *Worker) DiskPersistent() bool { return w.diskFile != nil && w.diskFile.Persistent() }

// stageTags records s's tags for its G3 writes (see the comment above).
func (w *Worker) stageTags(s *plan.Step) {
	if w.tags == nil {
		return
	}
	stage := func(cs []plan.Copy) {
		for _, c := range cs {
			if c.Dst == plan.G3 && c.DstBlock >= 0 && c.DstBlock < int64(len(w.tags)) {
				w.tags[c.DstBlock].Store(nil)
			}
		}
	}
	stage(s.Moves)
	stage(s.Saves)
	for i := range s.Tags {
		t := &s.Tags[i]
		if t.Block >= 0 && t.Block < int64(len(w.tags)) && w.writesG3(s, t.Block) {
			w.tags[t.Block].Store(t)
		}
	}
	for _, r := range s.TagRefs {
		if t := w.refTag(s, r); t != nil {
			w.tags[r.Block].Store(t)
		}
	}
	w.stageHostTags(s)
}

// refTag resolves r: the tag of the G2 block that s moves to G3 block
// r.Block, if its id is r.ID; nil otherwise (the copy stays untagged).
func (w *Worker) refTag(s *plan.Step, r plan.TagRef) *plan.BlockTag {
	if r.Block < 0 || r.Block >= int64(len(w.tags)) {
		return nil
	}
	for _, c := range s.Moves {
		if c.Src != plan.G2 || c.Dst != plan.G3 || c.DstBlock != r.Block || c.SrcBlock < 0 || c.SrcBlock >= int64(len(w.hostTags)) {
			continue
		}
		ht := w.hostTags[c.SrcBlock].Load()
		if ht == nil || ht.ID != r.ID {
			return nil
		}
		t := ht.BlockTag
		t.Block = r.Block
		return &t
	}
	return nil
}

// stageHostTags records the tags of s's G2 writes: every G2 destination
// loses its old tag, and takes s's HostTag for it, if any.
func (w *Worker) stageHostTags(s *plan.Step) {
	if len(w.hostTags) == 0 {
		return
	}
	clearTag := func(cs []plan.Copy) {
		for _, c := range cs {
			if c.Dst == plan.G2 && c.DstBlock >= 0 && c.DstBlock < int64(len(w.hostTags)) {
				w.hostTags[c.DstBlock].Store(nil)
			}
		}
	}
	for _, ld := range s.Loads {
		clearTag(ld.Copies)
	}
	clearTag(s.Moves)
	clearTag(s.Saves)
	for i := range s.HostTags {
		t := &s.HostTags[i]
		if t.Block < 0 || t.Block >= int64(len(w.hostTags)) {
			continue
		}
		for _, c := range s.Saves {
			if c.Dst == plan.G2 && c.DstBlock == t.Block {
				w.hostTags[t.Block].Store(t)
				break
			}
		}
	}
}

// forgetHostTag drops G2 block b's tag (the leader dropped the block).
func (w *Worker) forgetHostTag(b int64) {
	if b >= 0 && b < int64(len(w.hostTags)) {
		w.hostTags[b].Store(nil)
	}
}

// writesG3 reports whether s writes G3 block b (a tag for any other block is ignored).
func (w *Worker) writesG3(s *plan.Step, b int64) bool {
	for _, cs := range [][]plan.Copy{s.Moves, s.Saves} {
		for _, c := range cs {
			if c.Dst == plan.G3 && c.DstBlock == b {
				return true
			}
		}
	}
	return false
}

// writeDiskBlock writes G3 block dst with the header of its staged tag
// when the tier is persistent, else plainly.
func (w *Worker) writeDiskBlock(dst int, buf []byte, sum uint64) error {
	pd, ok := w.disk.(persistDisk)
	if !ok || w.tags == nil {
		return w.disk.WriteBlock(dst, buf)
	}
	var h *storage.BlockHeader
	if t := w.tags[dst].Swap(nil); t != nil {
		h = &storage.BlockHeader{
			SeqHash: t.SeqHash, Parent: t.Parent, HasParent: t.HasParent, Priority: t.Priority,
			Tokens: t.Tokens, PayloadSum: sum, WrittenAt: time.Now().UnixNano(),
		}
	}
	return pd.WriteBlockHeader(dst, buf, h)
}

// forgetOnDisk makes G3 block b unrecoverable: the leader dropped it, or
// its bytes failed verification. A failure is logged; the block is already
// invalid in memory, and a header left behind still has its payload
// checksum checked on every load.
func (w *Worker) forgetOnDisk(b int) {
	pd, ok := w.disk.(persistDisk)
	if !ok || w.tags == nil {
		return
	}
	if err := pd.InvalidateHeader(b); err != nil {
		w.log.Warn("kvbm disk tier: could not invalidate a block header", "block", b, "err", err)
	}
}
