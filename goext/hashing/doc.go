// Package hashing computes the two 64-bit hash families kvbm needs (design §3):
//
//   - KVBM keys, which index the host (G2) and disk (G3) registries: a salt
//     hash derived from the request's cache salt and LoRA name, a per-block
//     content hash seeded with that salt, and a chained sequence hash that
//     identifies a block together with its whole prefix.
//   - Router keys, which the KV event consolidator publishes as
//     RouterEvent.tokens_hash: the same construction with the fixed seed 1337
//     (LoRA only perturbs the per-block local hash).
//
// Both families are XXH3-64 (github.com/zeebo/xxh3, verified bit-identical
// to C xxHash) over little-endian u32 token bytes. Only full blocks are
// hashed; a partial trailing block has no hash.
//
// The functions are on the hot path of every scheduler step (a 32K-token
// prompt is re-hashed when it arrives), so the bulk entry points allocate
// nothing when the caller supplies a destination slice with capacity.
package hashing

// SchemeVersion numbers the hash construction above. Anything that keeps
// blocks beyond one process (a persistent disk tier, object storage) records
// it, so a change to the construction never matches blocks hashed the old way.
const SchemeVersion = 1
