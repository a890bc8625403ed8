package consolidator

import (
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/events"
)

// routerModel is what a KV router's index does with the consolidated
// stream (the Go twin of tests/router_index.py): a STORE must name a new
// hash and a known parent, a REMOVE a known hash.
type routerModel struct{ blocks map[uint64]bool }

func newRouterModel() *routerModel { return &routerModel{blocks: map[uint64]bool{}} }

func (r *routerModel) apply(evs []events.ConsolidatedEvent) error {
	for _, ev := range evs {
		switch ev.Kind {
		case events.KindStored:
			if r.blocks[ev.BlockHash] {
				return fmt.Errorf("duplicate STORE of %d", ev.BlockHash)
			}
			if ev.HasParent && (ev.ParentHash == ev.BlockHash || !r.blocks[ev.ParentHash]) {
				return fmt.Errorf("STORE of %d with unknown parent %d", ev.BlockHash, ev.ParentHash)
			}
			r.blocks[ev.BlockHash] = true
		case events.KindRemoved:
			if !r.blocks[ev.BlockHash] {
				return fmt.Errorf("REMOVE of unknown %d", ev.BlockHash)
			}
			delete(r.blocks, ev.BlockHash)
		default:
			clear(r.blocks)
		}
	}
	return nil
}

// checkRouter drains the tracker into the model and checks that the router
// would accept every event and ends up indexing exactly the tracked blocks.
func checkRouter(t *testing.T, tr *Tracker, r *routerModel) {
	t.Helper()
	require.NoError(t, r.apply(tr.Drain(nil)))
	require.Equal(t, tr.Len(), len(r.blocks), "router index and tracker disagree on the number of blocks")
	checkTrackerInvariants(t, tr)
}

// TestTrackerRandomHolders drives the tracker with random stores and
// removes from the engine and both kvbm tiers over a small prefix tree
// (so that blocks share prefixes, parents are evicted before children,
// and the engine holds some blocks under two hashes, as with two cache
// salts), then checks after every step that a router would accept the
// output, and at the end that removing everything leaves nothing behind.
// With a small cap, evictions interleave with all of it.
func TestTrackerRandomHolders(t *testing.T) {
	for i := range 40 {
		seed, maxBlocks := uint64(i/2), []int{0, 7}[i%2]
		t.Run(fmt.Sprintf("seed=%d,cap=%d", seed, maxBlocks), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 7))
			tr := NewTracker(EngineVllm, nil, WithMaxBlocks(maxBlocks))
			r := newRouterModel()
			hash := func(space string, salt int, prefix []int) uint64 {
				f := fnv.New64a()
				fmt.Fprint(f, space, salt, prefix)
				return f.Sum64()
			}
			type copyKey struct {
				h      events.Holder
				salt   int
				prefix string
			}
			held := map[copyKey][]int{}
			holders := []events.Holder{eng, host, disk}
			for range 3000 {
				h := holders[rng.IntN(3)]
				depth := 1 + rng.IntN(4)
				prefix := make([]int, depth)
				for i := range prefix {
					prefix[i] = rng.IntN(3)
				}
				salt := 0
				space := "kvbm"
				if h == eng {
					space = "engine"
					salt = rng.IntN(2) // two salts: two engine hashes for one router key
				}
				k := copyKey{h, salt, fmt.Sprint(prefix)}
				ext := hash(space, salt, prefix)
				if _, ok := held[k]; ok && rng.IntN(2) == 0 {
					tr.Remove(ext, h)
					delete(held, k)
				} else {
					toks := []uint32{uint32(prefix[depth-1]), uint32(depth), 0, 0}
					tr.Store(ext, h, toks, hash(space, salt, prefix[:depth-1]), depth > 1, 4, "")
					held[k] = prefix
				}
				checkRouter(t, tr, r)
			}
			for k, prefix := range held {
				space := "kvbm"
				if k.h == eng {
					space = "engine"
				}
				tr.Remove(hash(space, k.salt, prefix), k.h)
				checkRouter(t, tr, r)
			}
			require.Zero(t, tr.Len(), "blocks left after every holder removed everything")
			require.Empty(t, r.blocks)
			require.Empty(t, tr.ext)
			require.Empty(t, tr.firsts)
		})
	}
}

// FuzzTrackerEngineInput feeds arbitrary engine messages (seeded with real
// shapes) through the decoder into the tracker, interleaved with kvbm
// events for the same hashes: nothing may panic, and whatever the input,
// the output must be acceptable to a router.
func FuzzTrackerEngineInput(f *testing.F) {
	f.Add(mustPack(f, []any{1.0, []any{
		[]any{"BlockStored", u64s(10, 11), nil, anyTokens(tokA, tokB), 4, nil, "GPU", nil},
		[]any{"BlockRemoved", u64s(10), "GPU"},
	}, 0}), uint64(10), false)
	f.Add(mustPack(f, []any{1.0, []any{
		map[string]any{"type": "BlockStored", "block_hashes": []any{int64(-5), 5}, "parent_block_hash": 5,
			"token_ids": anyTokens(tokA, tokA), "block_size": 4},
		[]any{"AllBlocksCleared"},
		[]any{"BlockStored", u64s(7, 7, 7), 7, anyTokens(tokC, tokC, tokC), 4},
	}, 0}), uint64(7), true)
	f.Fuzz(func(t *testing.T, payload []byte, kvbmHash uint64, kvbmRemove bool) {
		b, err := events.NewDecoder().DecodePayload(payload)
		if err != nil {
			return
		}
		tr := NewTracker(EngineTrtllm, nil)
		r := newRouterModel()
		for i := range b.Events {
			tr.ApplyEngine(&b.Events[i])
			checkRouter(t, tr, r)
			// kvbm stores (or evicts) a block whose hash the fuzzer picks,
			// possibly one of the engine's.
			tr.ApplyKvbm(&events.BlockEvent{Removed: kvbmRemove && i%2 == 1, Holder: host, SeqHash: kvbmHash + uint64(i%2),
				Parent: kvbmHash, HasParent: i%3 == 0, Tokens: tokB, BlockSize: 4})
			checkRouter(t, tr, r)
		}
	})
}
