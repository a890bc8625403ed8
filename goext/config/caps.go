package config

import (
	"fmt"
)

// Hard caps on the count settings that size an allocation (or bound one).
// A value that parses is not enough: DYN_KVBM_CACHE_STATS_MAX_REQUESTS=
// 2147483647 would make the leader allocate a 51 GB hit-rate window at
// start-up and the process abort. Each cap is far above any useful value
// and keeps the worst allocation it allows small against a host that runs
// an engine.
const (
	// CapCacheStatsMaxRequests: the hit-rate window keeps 24 bytes per
	// request (24 MB at the cap).
	CapCacheStatsMaxRequests = 1_000_000
	// CapMaxConcurrentTransfers: the transfer limiters hold a slot per
	// batch in flight and the disk tier a bounce buffer of one block per
	// disk slot (two per transfer); disk reads saturate at 8 (bench/transfer).
	CapMaxConcurrentTransfers = 64
	// CapMaxTransferBatchSize: blocks in one transfer batch (a batch's
	// block lists are allocated at this size); a step moves far fewer.
	CapMaxTransferBatchSize = 1 << 16
	// CapConsolidatorMaxBlocks: each tracked block is held in memory (about
	// 150 bytes); the default is 4194304.
	CapConsolidatorMaxBlocks = 1 << 24
	// CapObjectNumBlocks: the G4 registry keeps every hash it knows in
	// memory (about 100 bytes each).
	CapObjectNumBlocks = 10_000_000
	// CapZMQMaxMessageMB: a ZeroMQ peer can make kvbm allocate a message up
	// to this size before its contents are checked; a plan takes 18 bytes a
	// block copy, so 1 GiB is tens of millions of copies.
	CapZMQMaxMessageMB = 1024
)

// countCap is the cap of one count variable and why it exists.
type countCap struct {
	max int
	why string
}

// countCaps are the caps that capped applies, by variable. The block
// overrides are capped at MaxBlocks (pools index blocks with int32), and
// their bytes are checked against memory and disk space (CheckBlocks).
var countCaps = map[string]countCap{
	EnvCPUCacheOverrideBlocks:  {MaxBlocks, "a tier holds at most that many blocks"},
	EnvDiskCacheOverrideBlocks: {MaxBlocks, "a tier holds at most that many blocks"},
	EnvCacheStatsMaxRequests:   {CapCacheStatsMaxRequests, "the hit-rate window keeps an entry per request"},
	EnvMaxConcurrentTransfers: {CapMaxConcurrentTransfers,
		"each transfer in flight holds a transfer slot and, with a disk tier, bounce buffers of a block"},
	EnvMaxTransferBatchSize:  {CapMaxTransferBatchSize, "blocks in one transfer batch"},
	EnvConsolidatorMaxBlocks: {CapConsolidatorMaxBlocks, "every tracked block is kept in memory"},
	EnvObjectNumBlocks:       {CapObjectNumBlocks, "the G4 registry keeps every hash in memory"},
	EnvZMQMaxMessageMB:       {CapZMQMaxMessageMB, "a ZeroMQ peer may make kvbm allocate a message this large"},
}

// capped is count for a variable of countCaps: above its cap is an error
// that gives the cap and why.
func (p *parser) capped(name string, def, min int) int {
	c, ok := countCaps[name]
	if !ok { // TestEveryCountIsClassified keeps this unreachable
		return p.count(name, def, min)
	}
	if _, set := p.get(name); !set {
		return def
	}
	n, ok := p.integer(name, int64(min))
	if !ok {
		return def
	}
	if n > int64(c.max) {
		raw, _ := p.get(name)
		p.fail(name, raw, fmt.Sprintf("must be at most %d (%s)", c.max, c.why))
		return def
	}
	return int(n)
}
