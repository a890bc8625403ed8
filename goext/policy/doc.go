// Package policy holds kvbm's cache decisions that depend on measurements
// rather than on the cache's contents (design §4.1, §4.2):
//
//   - Load or recompute (Model, Decide): online estimates of what loading a
//     block from each tier costs (a fixed latency plus seconds per MB,
//     fitted to kvbm's own timed transfers and G4 requests, exponentially
//     decayed, starting from priors) and of what one prompt token costs the
//     engine to compute (fitted to the engine's step timings, or
//     configured). For each request the leader loads the matched prefix
//     that is expected to save the most time; the rest is recomputed.
//   - Admission (Admission, Sketch): which blocks are written to the slower
//     tiers (G3, G4): a TinyLFU-style count-min sketch over sequence hashes
//     admits a block seen at least twice, and per-tier token-bucket budgets
//     (MB/s to G3, PUTs/s to G4) drop the least valuable writes first.
//
// The package is a leaf: the leader calls it under its own lock; the
// transfer observations come from the workers' goroutines (Transfers), so
// Model has a lock of its own.
package policy
