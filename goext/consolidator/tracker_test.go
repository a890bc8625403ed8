package consolidator

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/events"
	"github.com/kvbm/kvbm/goext/hashing"
	"github.com/kvbm/kvbm/goext/metrics"
)

// logRecorder is a slog.Handler that keeps every record, so tests can grep
// the log lines operators grep.
type logRecorder struct {
	mu    sync.Mutex
	lines []string // "LEVEL message"
}

func (r *logRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (r *logRecorder) Handle(_ context.Context, rec slog.Record) error {
	var b strings.Builder
	b.WriteString(rec.Level.String() + " " + rec.Message)
	rec.Attrs(func(a slog.Attr) bool {
		fmt.Fprintf(&b, " %s=%v", a.Key, a.Value)
		return true
	})
	r.mu.Lock()
	r.lines = append(r.lines, b.String())
	r.mu.Unlock()
	return nil
}
func (r *logRecorder) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *logRecorder) WithGroup(string) slog.Handler      { return r }

func (r *logRecorder) all() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.lines...)
}

// grep returns the lines containing s.
func (r *logRecorder) grep(s string) []string {
	var out []string
	for _, l := range r.all() {
		if strings.Contains(l, s) {
			out = append(out, l)
		}
	}
	return out
}

var (
	tokA = []uint32{1, 2, 3, 4}
	tokB = []uint32{5, 6, 7, 8}
	tokC = []uint32{9, 10, 11, 12}
)

const (
	eng  = events.HolderEngine
	host = events.HolderKvbmHost
	disk = events.HolderKvbmDisk
)

// op is one tracker call.
type op struct {
	kind      events.Kind
	ext       uint64
	h         events.Holder
	tokens    []uint32
	parent    uint64
	hasParent bool
	lora      string
	hasHolder bool // a clear by holder h (ClearHolder), not ClearAll
}

func st(ext uint64, h events.Holder, tokens []uint32) op {
	return op{kind: events.KindStored, ext: ext, h: h, tokens: tokens}
}

func stp(ext uint64, h events.Holder, tokens []uint32, parent uint64) op {
	o := st(ext, h, tokens)
	o.parent, o.hasParent = parent, true
	return o
}

func rm(ext uint64, h events.Holder) op { return op{kind: events.KindRemoved, ext: ext, h: h} }

var clr = op{kind: events.KindCleared}

// clrBy is holder h clearing all its blocks (the engine's AllBlocksCleared).
func clrBy(h events.Holder) op { return op{kind: events.KindCleared, h: h, hasHolder: true} }

func (o op) apply(t *Tracker) {
	switch o.kind {
	case events.KindStored:
		t.Store(o.ext, o.h, o.tokens, o.parent, o.hasParent, len(o.tokens), o.lora)
	case events.KindRemoved:
		t.Remove(o.ext, o.h)
	default:
		if o.hasHolder {
			t.ClearHolder(o.h)
		} else {
			t.ClearAll()
		}
	}
}

// out is an expected consolidated event.
type out struct {
	kind      events.Kind
	hash      uint64
	parent    uint64
	hasParent bool
	tokens    []uint32
}

func S(hash uint64, tokens []uint32) out {
	return out{kind: events.KindStored, hash: hash, tokens: tokens}
}
func SP(hash uint64, tokens []uint32, parent uint64) out {
	return out{kind: events.KindStored, hash: hash, tokens: tokens, parent: parent, hasParent: true}
}
func R(hash uint64) out { return out{kind: events.KindRemoved, hash: hash} }

var C = out{kind: events.KindCleared}

// keyOf is the dedup key of a block with the given ancestry (oldest first).
func keyOf(chain ...[]uint32) uint64 {
	var key uint64
	for i, toks := range chain {
		local := hashing.RouterLocalHash(toks, "")
		if i == 0 {
			key = local
		} else {
			key = hashing.RouterSequenceHash(key, local)
		}
	}
	return key
}

func TestTrackerRules(t *testing.T) {
	kA := keyOf(tokA)
	kAB := keyOf(tokA, tokB)
	for _, tc := range []struct {
		name   string
		engine Engine
		ops    []op
		want   []out
		logs   []string // substrings that must each appear in some line
		noLogs []string // substrings that must not appear
		blocks int      // tracked blocks at the end
		cap    int      // WithMaxBlocks; 0: the default
	}{
		{
			name:   "beyond the cap the oldest block is forgotten with a REMOVE",
			cap:    2,
			ops:    []op{st(100, eng, tokA), st(200, eng, tokB), st(300, eng, tokC)},
			want:   []out{S(100, tokA), S(200, tokB), S(300, tokC), R(100)},
			logs:   []string{"WARN KV event consolidator tracks 2 blocks, its cap: forgetting the oldest (block 100)"},
			blocks: 2,
		},
		{
			name: "a block stored again by another holder is the newest",
			cap:  2,
			ops:  []op{st(100, eng, tokA), st(200, eng, tokB), st(900, host, tokA), st(300, eng, tokC)},
			want: []out{S(100, tokA), S(200, tokB), S(300, tokC), R(200)},
			// 100 and 900 still name the one block.
			blocks: 2,
		},
		{
			name: "an evicted block's hashes are forgotten: its removes are unknown, its store is new",
			cap:  1,
			ops: []op{
				st(100, eng, tokA), st(900, host, tokA), // one block, two hashes
				st(200, eng, tokB), // evicts it
				rm(100, eng), rm(900, host),
				st(100, eng, tokA), // evicts 200
			},
			want: []out{S(100, tokA), S(200, tokB), R(100), S(100, tokA), R(200)},
			logs: []string{
				"WARN Attempted to remove unknown block 100 from source Vllm",
				"WARN Attempted to remove unknown block 900 from source KvbmHost",
			},
			blocks: 1,
		},
		{
			name: "a child whose parent was evicted is published as a first block",
			cap:  1,
			ops:  []op{st(100, eng, tokA), st(200, eng, tokC), stp(101, eng, tokB, 100)},
			want: []out{S(100, tokA), S(200, tokC), R(100), S(101, tokB), R(200)},
			// keyed as a first block: the parent's mapping went with it
			blocks: 1,
		},
		{
			name:   "removed blocks leave the age list: no eviction below the cap",
			cap:    2,
			ops:    []op{st(100, eng, tokA), st(200, eng, tokB), rm(100, eng), st(300, eng, tokC)},
			want:   []out{S(100, tokA), S(200, tokB), R(100), S(300, tokC)},
			noLogs: []string{"cap"},
			blocks: 2,
		},
		{
			name:   "first store publishes",
			ops:    []op{st(100, eng, tokA)},
			want:   []out{S(100, tokA)},
			logs:   []string{fmt.Sprintf("DEBUG Block 100 (seq_hash=%d) stored in first source Vllm, will publish STORE event", kA)},
			blocks: 1,
		},
		{
			name:   "engine named Trtllm",
			engine: EngineTrtllm,
			ops:    []op{st(100, eng, tokA), st(900, host, tokA)},
			want:   []out{S(100, tokA)},
			logs: []string{
				fmt.Sprintf("Block 100 (seq_hash=%d) stored in first source Trtllm, will publish STORE event", kA),
				fmt.Sprintf("DEBUG DEDUP: Block 100 (seq_hash=%d) added to source KvbmHost", kA),
			},
			blocks: 1,
		},
		{
			name:   "same-source duplicate is silent",
			ops:    []op{st(100, eng, tokA), st(100, eng, tokA)},
			want:   []out{S(100, tokA)},
			noLogs: []string{"DEDUP"},
			blocks: 1,
		},
		{
			name:   "cross-source store is deduplicated",
			ops:    []op{st(100, eng, tokA), st(900, host, tokA)},
			want:   []out{S(100, tokA)},
			logs:   []string{fmt.Sprintf("DEDUP: Block 100 (seq_hash=%d) added to source KvbmHost", kA)},
			blocks: 1,
		},
		{
			name:   "remove from one of several holders is silent",
			ops:    []op{st(100, eng, tokA), st(900, host, tokA), rm(100, eng)},
			want:   []out{S(100, tokA)},
			logs:   []string{fmt.Sprintf("DEBUG Block 100 (seq_hash=%d) removed from source Vllm, still in 1 source(s)", kA)},
			blocks: 1,
		},
		{
			name: "remove from the last holder publishes with the first hash",
			ops:  []op{st(100, eng, tokA), st(900, host, tokA), rm(100, eng), rm(900, host)},
			want: []out{S(100, tokA), R(100)},
			logs: []string{fmt.Sprintf("DEBUG Block 100 (seq_hash=%d) removed from last source KvbmHost, will publish REMOVE event", kA)},
		},
		{
			name: "single holder remove publishes",
			ops:  []op{st(100, eng, tokA), rm(100, eng)},
			want: []out{S(100, tokA), R(100)},
		},
		{
			name: "parent re-mapping: STORE names the parent by its first hash",
			ops: []op{
				st(900, host, tokA), stp(901, host, tokB, 900), // kvbm first
				st(100, eng, tokA), stp(101, eng, tokB, 100), // engine: both deduplicated
				stp(102, eng, tokC, 101), // new: parent is engine's 101, router knows it as 901
			},
			want:   []out{S(900, tokA), SP(901, tokB, 900), SP(102, tokC, 901)},
			logs:   []string{fmt.Sprintf("DEDUP: Block 901 (seq_hash=%d) added to source Vllm", kAB)},
			blocks: 3,
		},
		{
			name:   "same tokens at another position are distinct blocks",
			ops:    []op{st(100, eng, tokA), stp(101, eng, tokA, 100)},
			want:   []out{S(100, tokA), SP(101, tokA, 100)},
			blocks: 2,
		},
		{
			name:   "different parents give different blocks",
			ops:    []op{st(100, eng, tokA), st(200, eng, tokC), stp(101, eng, tokB, 100), stp(201, eng, tokB, 200)},
			want:   []out{S(100, tokA), S(200, tokC), SP(101, tokB, 100), SP(201, tokB, 200)},
			blocks: 4,
		},
		{
			name: "clear-all forgets everything",
			ops: []op{
				st(100, eng, tokA), st(900, host, tokB), clr,
				rm(100, eng),       // unknown now: warned, no event
				st(100, eng, tokA), // published again
			},
			want:   []out{S(100, tokA), S(900, tokB), C, S(100, tokA)},
			logs:   []string{"WARN Attempted to remove unknown block 100 from source Vllm"},
			blocks: 1,
		},
		{
			name: "engine clear keeps what kvbm holds",
			ops: []op{
				st(100, eng, tokA), stp(101, eng, tokB, 100), // the engine holds A and A+B
				st(900, host, tokA), st(950, disk, tokC), // kvbm's host tier holds A, its disk C
				clrBy(eng),
				rm(101, eng),             // forgotten with the clear: warned, no event
				st(100, eng, tokA),       // the engine computes A again: kvbm still has it
				stp(101, eng, tokB, 100), // and A+B: published again
				rm(900, host),            // A stays: the engine holds it again
			},
			// A+B was engine-only: REMOVE; A (host) and C (disk) stay; no CLEAR.
			want:   []out{S(100, tokA), SP(101, tokB, 100), S(950, tokC), R(101), SP(101, tokB, 100)},
			logs:   []string{"WARN Attempted to remove unknown block 101 from source Vllm (not in hash_mapping)"},
			blocks: 3,
		},
		{
			name:   "engine clear with nothing else held is one CLEAR",
			ops:    []op{st(100, eng, tokA), stp(101, eng, tokB, 100), clrBy(eng)},
			want:   []out{S(100, tokA), SP(101, tokB, 100), C},
			blocks: 0,
		},
		{
			name:   "kvbm tier reset removes only its own blocks",
			ops:    []op{st(100, eng, tokA), st(900, host, tokA), st(950, host, tokC), clrBy(host)},
			want:   []out{S(100, tokA), S(950, tokC), R(950)},
			blocks: 1,
		},
		{
			name: "unknown removes warn",
			ops:  []op{rm(5, eng), st(100, eng, tokA), rm(100, host), rm(100, disk)},
			want: []out{S(100, tokA)},
			logs: []string{
				"WARN Attempted to remove unknown block 5 from source Vllm (not in hash_mapping)",
				"WARN Attempted to remove source KvbmHost from block 100 but it wasn't present",
				"WARN Attempted to remove source KvbmDisk from block 100 but it wasn't present",
			},
			blocks: 1,
		},
		{
			name:   "double remove from the same holder warns once removed",
			ops:    []op{st(100, eng, tokA), st(900, host, tokA), rm(900, host), rm(900, host)},
			want:   []out{S(100, tokA)},
			logs:   []string{"WARN Attempted to remove unknown block 900 from source KvbmHost"},
			blocks: 1,
		},
		{
			name: "kvbm host and disk are separate holders",
			ops: []op{
				st(900, host, tokA), st(900, disk, tokA), // G2 then G3: one STORE
				rm(900, host), // G2 eviction: G3 still has it
				rm(900, disk), // now gone
			},
			want: []out{S(900, tokA), R(900)},
			logs: []string{
				fmt.Sprintf("DEDUP: Block 900 (seq_hash=%d) added to source KvbmDisk", kA),
				fmt.Sprintf("Block 900 (seq_hash=%d) removed from source KvbmHost, still in 1 source(s)", kA),
				fmt.Sprintf("Block 900 (seq_hash=%d) removed from last source KvbmDisk, will publish REMOVE event", kA),
			},
		},
		{
			name: "engine, host and disk: REMOVE only after all three",
			ops:  []op{st(100, eng, tokA), st(900, host, tokA), st(900, disk, tokA), rm(900, disk), rm(100, eng), rm(900, host)},
			want: []out{S(100, tokA), R(100)},
			logs: []string{fmt.Sprintf("Block 100 (seq_hash=%d) removed from source KvbmDisk, still in 2 source(s)", kA)},
		},
		{
			name: "one holder under two external hashes is reference-counted",
			// Two cache salts: vLLM hashes differ, the router key does not.
			ops:    []op{st(100, eng, tokA), st(200, eng, tokA), rm(100, eng)},
			want:   []out{S(100, tokA)},
			blocks: 1,
		},
		{
			name: "second external hash removed last publishes the first hash",
			ops:  []op{st(100, eng, tokA), st(200, eng, tokA), rm(100, eng), rm(200, eng)},
			want: []out{S(100, tokA), R(100)},
		},
		{
			name:   "unknown parent keys the block as a first block",
			ops:    []op{stp(300, eng, tokA, 999), st(900, host, tokA)},
			want:   []out{S(300, tokA)},
			blocks: 1,
		},
		{
			name: "a known hash keeps its block after its parent is evicted",
			ops: []op{
				st(900, host, tokA), stp(901, host, tokB, 900),
				rm(900, host),             // parent gone from every holder
				stp(901, disk, tokB, 900), // G2→G3 copy of the child: same block
				rm(901, host), rm(901, disk),
			},
			want: []out{S(900, tokA), SP(901, tokB, 900), R(900), R(901)},
		},
		{
			name:   "store from an unknown holder is ignored",
			ops:    []op{st(100, events.Holder(0), tokA), st(100, events.Holder(9), tokA)},
			logs:   []string{"WARN Ignoring store of block 100 from unknown holder 0"},
			blocks: 0,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := &logRecorder{}
			tr := NewTracker(tc.engine, slog.New(rec), WithMaxBlocks(tc.cap))
			for _, o := range tc.ops {
				o.apply(tr)
				checkTrackerInvariants(t, tr)
			}
			got := tr.Drain(nil)
			require.Len(t, got, len(tc.want), "events: %+v", got)
			for i, w := range tc.want {
				g := got[i]
				require.Equal(t, w.kind, g.Kind, "event %d", i)
				require.Equal(t, w.hash, g.BlockHash, "event %d", i)
				require.Equal(t, w.hasParent, g.HasParent, "event %d", i)
				require.Equal(t, w.parent, g.ParentHash, "event %d", i)
				if w.kind == events.KindStored {
					require.Equal(t, w.tokens, g.TokenIDs, "event %d", i)
					require.Equal(t, len(w.tokens), g.BlockSize, "event %d", i)
					require.Equal(t, hashing.RouterLocalHash(w.tokens, ""), g.TokensHash, "event %d", i)
				}
			}
			for _, s := range tc.logs {
				require.NotEmpty(t, rec.grep(s), "log line %q missing; have:\n%s", s, strings.Join(rec.all(), "\n"))
			}
			for _, s := range tc.noLogs {
				require.Empty(t, rec.grep(s))
			}
			require.Equal(t, tc.blocks, tr.Len())
			require.Zero(t, tr.Queued())
		})
	}
}

func TestTrackerLoraIsPartOfTheKey(t *testing.T) {
	tr := NewTracker(EngineVllm, nil)
	require.True(t, tr.Store(100, eng, tokA, 0, false, 4, "adapter-x"))
	require.True(t, tr.Store(200, eng, tokA, 0, false, 4, ""), "same tokens without the adapter are another block")
	got := tr.Drain(nil)
	require.Len(t, got, 2)
	require.Equal(t, "adapter-x", got[0].LoraName)
	require.Equal(t, hashing.RouterLocalHash(tokA, "adapter-x"), got[0].TokensHash)
	require.Equal(t, "", got[1].LoraName)
}

func TestTrackerCopiesTokens(t *testing.T) {
	tr := NewTracker(EngineVllm, nil)
	toks := []uint32{1, 2, 3, 4}
	tr.Store(1, eng, toks, 0, false, 4, "")
	toks[0] = 99 // the caller reuses its buffer
	require.Equal(t, []uint32{1, 2, 3, 4}, tr.Drain(nil)[0].TokenIDs)
}

func TestTrackerApply(t *testing.T) {
	tr := NewTracker(EngineVllm, nil)
	// One engine event with two blocks: block 1's parent is block 0.
	tr.ApplyEngine(&events.EngineEvent{Kind: events.KindStored, BlockHashes: []uint64{10, 11},
		ParentHash: 0, HasParent: false, TokenIDs: append(append([]uint32{}, tokA...), tokB...), BlockSize: 4})
	// kvbm registers the same two blocks in G2 under its own hashes.
	tr.ApplyKvbm(&events.BlockEvent{Holder: host, SeqHash: 90, Tokens: tokA, BlockSize: 4})
	tr.ApplyKvbm(&events.BlockEvent{Holder: host, SeqHash: 91, Parent: 90, HasParent: true, Tokens: tokB, BlockSize: 4})
	require.Equal(t, []events.Holder{eng, host}, tr.Holders(91))
	require.Equal(t, []events.Holder{eng, host}, tr.Holders(11))
	tr.ApplyEngine(&events.EngineEvent{Kind: events.KindRemoved, BlockHashes: []uint64{10, 11}})
	tr.ApplyKvbm(&events.BlockEvent{Removed: true, Holder: host, SeqHash: 91})
	got := tr.Drain(nil)
	require.Len(t, got, 3)
	require.Equal(t, events.KindStored, got[0].Kind)
	require.Equal(t, uint64(10), got[0].BlockHash)
	require.Equal(t, uint64(11), got[1].BlockHash)
	require.Equal(t, uint64(10), got[1].ParentHash)
	require.Equal(t, events.ConsolidatedEvent{Kind: events.KindRemoved, BlockHash: 11}, got[2])
	require.Equal(t, []events.Holder{host}, tr.Holders(90))
	require.Nil(t, tr.Holders(10))

	// The engine's clear leaves kvbm's block (host, seq hash 90): no CLEAR.
	tr.ApplyEngine(&events.EngineEvent{Kind: events.KindCleared})
	require.Equal(t, 1, tr.Len())
	require.Empty(t, tr.Drain(nil))
	require.Equal(t, []events.Holder{host}, tr.Holders(90))
	tr.ClearHolder(host) // then kvbm's host tier is reset: nothing is held, one CLEAR
	require.Equal(t, 0, tr.Len())
	require.Equal(t, []events.ConsolidatedEvent{{Kind: events.KindCleared}}, tr.Drain(nil))
}

// checkTrackerInvariants checks the indexes against each other: every
// external hash is listed by the block it names, every block is in the age
// list once, and the cap holds. (Plain comparisons: it runs after every
// step of the property tests.)
func checkTrackerInvariants(t *testing.T, tr *Tracker) {
	t.Helper()
	if len(tr.blocks) > tr.maxBlocks {
		t.Fatalf("%d blocks tracked, cap %d", len(tr.blocks), tr.maxBlocks)
	}
	exts := 0
	for key, b := range tr.blocks {
		if b.key != key || tr.firsts[b.first] != key {
			t.Fatalf("block %d: key %d, first %d maps to %d", key, b.key, b.first, tr.firsts[b.first])
		}
		x := b.extHead
		for range b.exts {
			e, ok := tr.ext[x]
			if !ok || e.key != key {
				t.Fatalf("external hash %d of block %d maps to %+v (%v)", x, key, e, ok)
			}
			x = e.next
		}
		exts += int(b.exts)
	}
	if exts != len(tr.ext) {
		t.Fatalf("%d external hashes, %d listed by their blocks", len(tr.ext), exts)
	}
	n := 0
	for b := tr.oldest; b != nil && n <= len(tr.blocks); b = b.newer {
		if tr.blocks[b.key] != b {
			t.Fatalf("age list holds block %d, not tracked", b.key)
		}
		n++
	}
	if n != len(tr.blocks) {
		t.Fatalf("age list has %d blocks (or more), %d tracked", n, len(tr.blocks))
	}
}

// TestTrackerCapBoundsMemory: a stream of stores whose REMOVEs never come
// (lost, or an engine that never sends them) keeps the tracker at its cap,
// publishing a REMOVE for every block it forgets.
func TestTrackerCapBoundsMemory(t *testing.T) {
	const maxBlocks, n = 100, 10_000
	tr := NewTracker(EngineVllm, nil, WithMaxBlocks(maxBlocks))
	r := newRouterModel()
	for i := range uint64(n) {
		tr.Store(i+1, eng, []uint32{uint32(i), 1, 2, 3}, i, i > 0, 4, "")
		if i%1000 == 0 {
			checkRouter(t, tr, r)
		}
	}
	checkRouter(t, tr, r)
	checkTrackerInvariants(t, tr)
	require.Equal(t, maxBlocks, tr.Len())
	require.Len(t, tr.ext, maxBlocks)
	require.Len(t, tr.firsts, maxBlocks)
	require.Equal(t, uint64(n-maxBlocks), tr.Evicted())
	for i := range uint64(n - maxBlocks) {
		require.Nil(t, tr.Holders(i+1), "block %d not evicted", i+1)
	}
	require.Equal(t, []events.Holder{eng}, tr.Holders(n))
}

// TestTrackerDefaultCap: without the option, the tracker is still bounded.
func TestTrackerDefaultCap(t *testing.T) {
	require.Equal(t, DefaultMaxTrackedBlocks, NewTracker(EngineVllm, nil).maxBlocks)
	require.Equal(t, DefaultMaxTrackedBlocks, NewTracker(EngineVllm, nil, WithMaxBlocks(0)).maxBlocks)
}

// TestTrackerWarningsRateLimited: removes of untracked blocks (what follows
// an eviction, or a flood of bogus input) log the first few in full, then
// one summary per period.
func TestTrackerWarningsRateLimited(t *testing.T) {
	rec := &logRecorder{}
	tr := NewTracker(EngineVllm, slog.New(rec))
	clock := time.Unix(1000, 0)
	tr.warn.now = func() time.Time { return clock }
	for i := range uint64(50_000) {
		tr.Remove(i, eng)
	}
	require.Equal(t, uint64(50_000), tr.unknownRemoves, "every unknown remove counted")
	require.Len(t, rec.grep("WARN"), defaultWarnBurst)
	clock = clock.Add(defaultWarnPeriod)
	tr.Remove(1, eng)
	summary := rec.grep("Suppressed")
	require.Len(t, summary, 1)
	require.Contains(t, summary[0], "Suppressed 49990 untracked-block warning(s) in the last 1m0s")
	require.Len(t, rec.grep("WARN Attempted to remove unknown block"), defaultWarnBurst+1, "a new period logs in full again")
	tr.FlushWarnings()
	require.Len(t, rec.grep("Suppressed"), 1, "nothing suppressed since the summary")
}

// TestConsolidatorCountsEvictions: the Consolidator passes its cap to the
// tracker and counts evictions in Stats and in the metrics.
func TestConsolidatorCountsEvictions(t *testing.T) {
	m := metrics.New()
	c, err := New(Config{ZMQBind: "tcp://127.0.0.1:0", MaxTrackedBlocks: 2, Metrics: m})
	require.NoError(t, err)
	defer c.Close()
	for i := range uint64(5) {
		c.Publish(events.BlockEvent{Holder: host, SeqHash: i + 1, Tokens: []uint32{uint32(i), 0, 0, 0}, BlockSize: 4})
	}
	s := c.Stats()
	require.Equal(t, 2, s.Tracked)
	require.Equal(t, uint64(3), s.Evicted)
	require.Equal(t, 3.0, testutil.ToFloat64(m.BlocksEvicted))
	_, err = New(Config{ZMQBind: "tcp://127.0.0.1:0", MaxTrackedBlocks: -1})
	require.ErrorContains(t, err, "max tracked blocks")
}

// vLLM's hybrid KV cache manager: the same positions stored by a full and a
// sliding-window group; the sliding group frees its block first, and the
// block stays announced until the full-attention group removes it.
func TestTrackerFollowsFullAttentionGroups(t *testing.T) {
	tr := NewTracker(EngineVllm, nil)
	stored := func(group int, kind string) *events.EngineEvent {
		return &events.EngineEvent{Kind: events.KindStored, BlockHashes: []uint64{10}, TokenIDs: tokA, BlockSize: 4,
			HasGroup: true, Group: group, GroupKind: kind}
	}
	removed := func(group int) *events.EngineEvent {
		return &events.EngineEvent{Kind: events.KindRemoved, BlockHashes: []uint64{10}, HasGroup: true, Group: group}
	}
	tr.ApplyEngine(stored(0, "full_attention"))
	tr.ApplyEngine(stored(1, "sliding_window"))
	require.Len(t, tr.Drain(nil), 1) // one STORE
	tr.ApplyEngine(removed(1))
	require.Empty(t, tr.Drain(nil), "the sliding-window group's REMOVE withdrew a block the full group holds")
	require.Equal(t, []events.Holder{eng}, tr.Holders(10))
	tr.ApplyEngine(removed(0))
	require.Equal(t, []events.ConsolidatedEvent{{Kind: events.KindRemoved, BlockHash: 10}}, tr.Drain(nil))

	// A sliding-window group's own store is not announced either.
	tr.ApplyEngine(stored(1, "sliding_window"))
	require.Empty(t, tr.Drain(nil))
	require.Nil(t, tr.Holders(10))
}
