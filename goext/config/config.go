// Package config reads every kvbm environment variable (design §8) once, into
// one typed Config.
//
// Rules, in the order users hit them:
//   - An unset or empty (whitespace-only) variable takes its default.
//   - A set value that does not parse or is out of range is an error that
//     names the variable and the value; we never fall back to the default for
//     something the user wrote (the reference silently did, which hid typos
//     such as DYN_KVBM_CPU_CACHE_GB=4GB behind a disabled tier).
//   - All errors are reported together (errors.Join), so one start-up shows
//     every bad variable.
//
// Tier presence is checked separately (Config.Validate): tools that only
// hash or inspect do not need a cache configured.
package config

import (
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"
	"time"
)

// Variable names, exported so error messages, docs and tests agree.
const (
	EnvCPUCacheGB                   = "DYN_KVBM_CPU_CACHE_GB"
	EnvCPUCacheOverrideBlocks       = "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS"
	EnvDiskCacheGB                  = "DYN_KVBM_DISK_CACHE_GB"
	EnvDiskCacheOverrideBlocks      = "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS"
	EnvDiskCacheDir                 = "DYN_KVBM_DISK_CACHE_DIR"
	EnvDiskDisableODirect           = "DYN_KVBM_DISK_DISABLE_O_DIRECT"
	EnvDiskZerofillFallback         = "DYN_KVBM_DISK_ZEROFILL_FALLBACK"
	EnvDiskAllocatorType            = "DYN_KVBM_DISK_ALLOCATOR_TYPE"
	EnvEnableNUMA                   = "DYN_KVBM_ENABLE_NUMA"
	EnvDiskPersist                  = "DYN_KVBM_DISK_PERSIST"
	EnvDisableDiskOffloadFilter     = "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER"
	EnvHostOffloadPrefixMinPriority = "DYN_KVBM_HOST_OFFLOAD_PREFIX_MIN_PRIORITY"
	EnvLeaderWorkerInitTimeoutSecs  = "DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS"
	EnvLeaderWorkerLivenessSecs     = "DYN_KVBM_LEADER_WORKER_LIVENESS_TIMEOUT_SECS"
	EnvLeaderWorkerSecret           = "DYN_KVBM_LEADER_WORKER_SECRET"
	EnvLeaderZMQHost                = "DYN_KVBM_LEADER_ZMQ_HOST"
	EnvLeaderZMQPubPort             = "DYN_KVBM_LEADER_ZMQ_PUB_PORT"
	EnvLeaderZMQAckPort             = "DYN_KVBM_LEADER_ZMQ_ACK_PORT"
	EnvMaxConcurrentTransfers       = "DYN_KVBM_MAX_CONCURRENT_TRANSFERS"
	EnvMaxTransferBatchSize         = "DYN_KVBM_MAX_TRANSFER_BATCH_SIZE"
	EnvMetrics                      = "DYN_KVBM_METRICS"
	EnvMetricsPort                  = "DYN_KVBM_METRICS_PORT"
	EnvMetricsHost                  = "DYN_KVBM_METRICS_HOST"
	EnvMetricsMaxConnections        = "DYN_KVBM_METRICS_MAX_CONNECTIONS"
	EnvMetricsReadHeaderTimeoutSecs = "DYN_KVBM_METRICS_READ_HEADER_TIMEOUT_SECS"
	EnvMetricsReadTimeoutSecs       = "DYN_KVBM_METRICS_READ_TIMEOUT_SECS"
	EnvMetricsWriteTimeoutSecs      = "DYN_KVBM_METRICS_WRITE_TIMEOUT_SECS"
	EnvMetricsIdleTimeoutSecs       = "DYN_KVBM_METRICS_IDLE_TIMEOUT_SECS"
	EnvCacheStatsMaxRequests        = "DYN_KVBM_CACHE_STATS_MAX_REQUESTS"
	EnvCacheStatsLogIntervalSecs    = "DYN_KVBM_CACHE_STATS_LOG_INTERVAL_SECS"
	EnvEnableConsolidator           = "DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR"
	EnvConsolidatorMaxBlocks        = "DYN_KVBM_KV_EVENTS_MAX_TRACKED_BLOCKS"
	EnvConsolidatorMode             = "DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE"
	EnvTrtllmZMQPort                = "DYN_KVBM_TRTLLM_ZMQ_PORT"
	EnvZMQMaxMessageMB              = "DYN_KVBM_ZMQ_MAX_MESSAGE_MB"
	EnvNatsServer                   = "NATS_SERVER"

	// Dynamo variables kvbm accepts without acting on them: each set one
	// is a start-up warning saying what kvbm does instead (Config.Warnings).
	EnvNcclMLAMode       = "DYN_KVBM_NCCL_MLA_MODE"
	EnvNcclMaxCTAs       = "DYN_KVBM_NCCL_MAX_CTAS"
	EnvTransferBatchSize = "DYN_KVBM_TRANSFER_BATCH_SIZE"
	EnvNixlBackendPrefix = "DYN_KVBM_NIXL_BACKEND_" // + <NAME>
)

// DYN_KVBM_DISK_ALLOCATOR_TYPE values: how the disk tier file gets O_DIRECT.
const (
	// DiskAllocatorDefault opens the file, then sets O_DIRECT with fcntl.
	DiskAllocatorDefault = "default"
	// DiskAllocatorOpenDirect passes O_DIRECT to open itself, for
	// filesystems that ignore it set later (IBM Storage Scale).
	DiskAllocatorOpenDirect = "open-direct"
)

// Defaults (design §8).
const (
	DefaultDiskCacheDir            = "/tmp/"
	DefaultLeaderWorkerInitTimeout = 1800 * time.Second
	// DefaultLeaderWorkerLiveness: how long a tensor-parallel rank may be
	// silent before the leader suspects it (and plans nothing for it until
	// it answers again). Ten seconds outlasts what a busy host does to a
	// healthy process (GC and scheduler pauses, a slow disk, a saturated
	// scheduler thread: seconds at worst) and is still short against the
	// engine's own collective timeouts.
	DefaultLeaderWorkerLiveness   = 10 * time.Second
	DefaultLeaderZMQHost          = "127.0.0.1"
	DefaultLeaderZMQPubPort       = 56001
	DefaultLeaderZMQAckPort       = 56002
	DefaultMaxConcurrentTransfers = 4
	DefaultMaxTransferBatchSize   = 16
	DefaultMetricsPort            = 6880
	// DefaultMetricsHost keeps the endpoint on this host: a scraper
	// elsewhere needs DYN_KVBM_METRICS_HOST set to an address it can reach.
	DefaultMetricsHost = "127.0.0.1"
	// The metrics endpoint's bounds (goext/metrics.ServerOptions): a scrape
	// is one small request every few seconds, so a handful of scrapers need
	// far fewer connections than this, and an idle or trickling connection
	// is closed long before descriptors run short.
	DefaultMetricsMaxConnections    = 64
	DefaultMetricsReadHeaderTimeout = 5 * time.Second
	DefaultMetricsReadTimeout       = 10 * time.Second
	DefaultMetricsWriteTimeout      = 30 * time.Second
	DefaultMetricsIdleTimeout       = 30 * time.Second
	// MaxMetricsConnections bounds DYN_KVBM_METRICS_MAX_CONNECTIONS: every
	// connection holds a file descriptor of the engine's process.
	MaxMetricsConnections        = 4096
	DefaultCacheStatsMaxRequests = 1000
	DefaultCacheStatsLogInterval = 5 * time.Second
	DefaultNatsServer            = "nats://localhost:4222"
	// DefaultZMQMaxMessageMB: a ZeroMQ peer that declares a bigger message
	// is disconnected (goext/zmqguard). Well above the largest legitimate
	// one: a plan takes 18 bytes per block copy, an event batch one step.
	DefaultZMQMaxMessageMB = 64
)

// Config is the parsed, validated process configuration. Zero values of the
// optional sizes mean "unset".
type Config struct {
	CPUCacheGB             float64 // G2 size, decimal GB, total across workers; 0 = unset
	CPUCacheOverrideBlocks int     // exact G2 block count, wins over CPUCacheGB; 0 = unset
	// EnableNUMA places each rank's G2 pages on the NUMA node of the CPU
	// that registers its KV caches.
	EnableNUMA bool

	DiskCacheGB             float64 // G3 size, decimal GB; 0 = unset
	DiskCacheOverrideBlocks int     // exact G3 block count; 0 = unset
	DiskCacheDir            string  // directory of the disk tier file
	DiskDisableODirect      bool    // open the disk tier file without O_DIRECT
	// DiskZerofillFallback: where fallocate is unsupported, reserve the
	// tier's space by writing zeros instead of leaving a sparse file.
	DiskZerofillFallback bool
	// DiskAllocatorType is DiskAllocatorDefault or DiskAllocatorOpenDirect.
	DiskAllocatorType string
	// DiskPersist keeps the disk tier file across restarts (docs/persistent-g3.md).
	DiskPersist bool

	DisableDiskOffloadFilter     bool // offload every G2 block to G3, not only repeated ones
	HostOffloadPrefixMinPriority int  // G1→G2 offload only at or above this priority

	LeaderWorkerInitTimeout time.Duration
	LeaderWorkerLiveness    time.Duration // silence before a rank is suspected
	LeaderWorkerSecret      string        // authenticates the side channel (engines pass their own)
	LeaderZMQHost           string
	LeaderZMQPubPort        int
	LeaderZMQAckPort        int
	// LeaderRequestIdle: a request the leader heard nothing about for this
	// long is forgotten (0, only in a Config built in code: never).
	LeaderRequestIdle time.Duration

	MaxConcurrentTransfers int // parallel transfer batches
	MaxTransferBatchSize   int // blocks per transfer batch

	Metrics     bool // serve Prometheus on MetricsHost:MetricsPort/metrics
	MetricsPort int
	MetricsHost string // an IP address or host name of this host
	// Bounds of the metrics endpoint: connections held at once, and the time
	// a connection may take to send its headers, its whole request, to take
	// the response, and idle between requests.
	MetricsMaxConnections    int
	MetricsReadHeaderTimeout time.Duration
	MetricsReadTimeout       time.Duration
	MetricsWriteTimeout      time.Duration
	MetricsIdleTimeout       time.Duration

	CacheStatsMaxRequests int           // hit-rate window, in requests
	CacheStatsLogInterval time.Duration // hit-rate log period

	EnableConsolidator bool // run the KV event consolidator
	// ConsolidatorMode is "dedup" or "passthrough" (goext/consolidator.Mode).
	ConsolidatorMode string
	// ConsolidatorMaxBlocks caps the blocks the consolidator tracks (0: its
	// default); beyond it the oldest is forgotten with a REMOVE.
	ConsolidatorMaxBlocks int
	TrtllmZMQPort         int // TensorRT-LLM engine event port; 0 = unset
	NatsServer            string

	ZMQMaxMessageMB int // MiB; larger ZeroMQ messages disconnect their sender

	Object Object // G4 (object.go)
	// Lifecycle: TTLs and the operator endpoint (lifecycle.go).
	Lifecycle Lifecycle

	CUDA CUDA     // the CUDA build's copier (cuda.go)
	Log  LogLevel // DYN_LOG (cuda.go)

	// LoadPolicy and Admission: load-or-recompute and what is written to
	// G3/G4 (policy.go).
	LoadPolicy LoadPolicy
	Admission  Admission

	// StorageSecret, when set, keys the MACs of stored KV for G3 and G4
	// instead of their defaults (secret.go). Never logged.
	StorageSecret []byte
	// StorageSecretDir holds the per-user secret the persistent G3 tier's
	// MACs derive from when StorageSecret is unset (secret.go); empty
	// otherwise.
	StorageSecretDir string

	// Warnings name the Dynamo variables that are set but that kvbm does
	// not act on, each with what kvbm does instead (logged at start-up).
	Warnings []string
}

// Load reads the configuration from the process environment.
func Load() (*Config, error) {
	env := map[string]string{}
	for _, kv := range os.Environ() {
		if k, v, ok := strings.Cut(kv, "="); ok {
			env[k] = v
		}
	}
	return FromEnv(env)
}

// FromEnv reads the configuration from env; unlike FromLookup it also sees
// the variables named by a prefix (DYN_KVBM_NIXL_BACKEND_<NAME>).
func FromEnv(env map[string]string) (*Config, error) {
	c, err := FromLookup(func(k string) (string, bool) {
		v, ok := env[k]
		return v, ok
	})
	if err != nil {
		return nil, err
	}
	var nixl []string
	for k, v := range env {
		if strings.HasPrefix(k, EnvNixlBackendPrefix) && strings.TrimSpace(v) != "" {
			nixl = append(nixl, k)
		}
	}
	sort.Strings(nixl)
	for _, k := range nixl {
		c.Warnings = append(c.Warnings, k+" is ignored: kvbm moves blocks without NIXL "+
			"(memory copies, CUDA copies and file I/O on the disk tier), so it has no NIXL backend to choose")
	}
	return c, nil
}

// FromLookup reads the configuration through lookup (os.LookupEnv in
// production, a map in tests). On error the returned Config is nil and the
// error joins one *VarError per bad variable.
func FromLookup(lookup func(string) (string, bool)) (*Config, error) {
	p := parser{lookup: lookup}
	c := &Config{
		CPUCacheGB:             p.gigabytes(EnvCPUCacheGB),
		CPUCacheOverrideBlocks: p.capped(EnvCPUCacheOverrideBlocks, 0, 0),
		EnableNUMA:             p.boolean(EnvEnableNUMA, false),

		DiskCacheGB:             p.gigabytes(EnvDiskCacheGB),
		DiskCacheOverrideBlocks: p.capped(EnvDiskCacheOverrideBlocks, 0, 0),
		DiskCacheDir:            p.path(EnvDiskCacheDir, DefaultDiskCacheDir),
		DiskDisableODirect:      p.boolean(EnvDiskDisableODirect, false),
		DiskZerofillFallback:    p.present(EnvDiskZerofillFallback),
		DiskAllocatorType:       p.choice(EnvDiskAllocatorType, DiskAllocatorDefault, DiskAllocatorOpenDirect),
		DiskPersist:             p.boolean(EnvDiskPersist, false),

		DisableDiskOffloadFilter:     p.boolean(EnvDisableDiskOffloadFilter, false),
		HostOffloadPrefixMinPriority: p.count(EnvHostOffloadPrefixMinPriority, 0, 0),

		LeaderWorkerInitTimeout: p.seconds(EnvLeaderWorkerInitTimeoutSecs, DefaultLeaderWorkerInitTimeout),
		LeaderWorkerLiveness:    p.seconds(EnvLeaderWorkerLivenessSecs, DefaultLeaderWorkerLiveness),
		LeaderWorkerSecret:      p.str(EnvLeaderWorkerSecret, ""),
		LeaderZMQHost:           p.host(EnvLeaderZMQHost, DefaultLeaderZMQHost),
		LeaderZMQPubPort:        p.port(EnvLeaderZMQPubPort, DefaultLeaderZMQPubPort),
		LeaderZMQAckPort:        p.port(EnvLeaderZMQAckPort, DefaultLeaderZMQAckPort),
		LeaderRequestIdle:       p.requestIdleTimeout(),

		MaxConcurrentTransfers: p.capped(EnvMaxConcurrentTransfers, DefaultMaxConcurrentTransfers, 1),
		MaxTransferBatchSize:   p.capped(EnvMaxTransferBatchSize, DefaultMaxTransferBatchSize, 1),

		Metrics:     p.boolean(EnvMetrics, false),
		MetricsPort: p.port(EnvMetricsPort, DefaultMetricsPort),
		MetricsHost: p.host(EnvMetricsHost, DefaultMetricsHost),

		MetricsMaxConnections:    p.count(EnvMetricsMaxConnections, DefaultMetricsMaxConnections, 1),
		MetricsReadHeaderTimeout: p.seconds(EnvMetricsReadHeaderTimeoutSecs, DefaultMetricsReadHeaderTimeout),
		MetricsReadTimeout:       p.seconds(EnvMetricsReadTimeoutSecs, DefaultMetricsReadTimeout),
		MetricsWriteTimeout:      p.seconds(EnvMetricsWriteTimeoutSecs, DefaultMetricsWriteTimeout),
		MetricsIdleTimeout:       p.seconds(EnvMetricsIdleTimeoutSecs, DefaultMetricsIdleTimeout),

		CacheStatsMaxRequests: p.capped(EnvCacheStatsMaxRequests, DefaultCacheStatsMaxRequests, 1),
		CacheStatsLogInterval: p.seconds(EnvCacheStatsLogIntervalSecs, DefaultCacheStatsLogInterval),

		EnableConsolidator:    p.boolean(EnvEnableConsolidator, true),
		ConsolidatorMaxBlocks: p.capped(EnvConsolidatorMaxBlocks, 0, 1),
		ConsolidatorMode:      p.choice(EnvConsolidatorMode, "dedup", "passthrough"),
		TrtllmZMQPort:         p.port(EnvTrtllmZMQPort, 0),
		NatsServer:            p.natsURLs(EnvNatsServer, DefaultNatsServer),

		ZMQMaxMessageMB: p.capped(EnvZMQMaxMessageMB, DefaultZMQMaxMessageMB, 1),

		Object:    p.object(),
		Lifecycle: p.lifecycle(),

		CUDA: p.cuda(),
		Log:  p.logLevel(),

		LoadPolicy: p.loadPolicy(),

		StorageSecret: p.storageSecret(),
	}
	if c.DiskPersist && len(c.StorageSecret) == 0 && p.ok(EnvStorageSecret, EnvStorageSecretFile) {
		c.StorageSecretDir = p.storageSecretDir()
	}

	c.Admission = p.admission(c.DisableDiskOffloadFilter)
	c.Warnings = p.unsupported(c)

	// Cross-variable rules, only when the inputs themselves parsed (an error
	// about a value the user already sees as invalid would be noise).
	if p.ok(EnvLeaderZMQPubPort, EnvLeaderZMQAckPort) && c.LeaderZMQPubPort == c.LeaderZMQAckPort {
		p.fail(EnvLeaderZMQAckPort, fmt.Sprint(c.LeaderZMQAckPort),
			"must differ from "+EnvLeaderZMQPubPort+" (both sockets bind on the leader)")
	}
	p.persistentDir(c) // before the write check creates the directory (persist.go)
	if p.ok(EnvDiskCacheGB, EnvDiskCacheOverrideBlocks, EnvDiskCacheDir) && c.DiskEnabled() {
		if err := checkWritableDir(c.DiskCacheDir); err != nil {
			p.fail(EnvDiskCacheDir, c.DiskCacheDir, err.Error())
		} else if reason := checkCapacity(uint64(gbToBytes(c.DiskCacheGB)), "disk space in "+c.DiskCacheDir,
			func() (uint64, bool) {
				free, ok := availableDisk(c.DiskCacheDir)
				if ok && c.DiskPersist {
					free += persistentTierBytes(c.DiskCacheDir)
				}
				return free, ok
			}); reason != "" {
			p.fail(EnvDiskCacheGB, fmt.Sprint(c.DiskCacheGB), reason)
		}
	}
	// Checked when set: the default fits any open-file limit worth running an engine under.
	if _, set := p.get(EnvMetricsMaxConnections); !set || !p.ok(EnvMetricsMaxConnections) {
	} else if c.MetricsMaxConnections > MaxMetricsConnections {
		p.fail(EnvMetricsMaxConnections, fmt.Sprint(c.MetricsMaxConnections),
			fmt.Sprintf("must be at most %d (each connection holds a file descriptor of the engine's process)",
				MaxMetricsConnections))
	} else if limit, ok := openFilesLimit(); ok && uint64(c.MetricsMaxConnections) > limit/2 {
		p.fail(EnvMetricsMaxConnections, fmt.Sprint(c.MetricsMaxConnections),
			fmt.Sprintf("more than half of this process's open-file limit (%d): a flood of metrics "+
				"connections would leave the engine without descriptors", limit))
	}
	if p.ok(EnvMetricsReadHeaderTimeoutSecs, EnvMetricsReadTimeoutSecs) &&
		c.MetricsReadHeaderTimeout > c.MetricsReadTimeout {
		p.fail(EnvMetricsReadHeaderTimeoutSecs, fmt.Sprint(int64(c.MetricsReadHeaderTimeout/time.Second)),
			"must not exceed "+EnvMetricsReadTimeoutSecs+" (the headers are part of the request)")
	}
	// A size the machine cannot hold fails here, at start-up; the block
	// counts are checked again against the block size (CheckBlocks).
	if p.ok(EnvCPUCacheGB) {
		if reason := checkCapacity(uint64(gbToBytes(c.CPUCacheGB)), "memory", availableMemory); reason != "" {
			p.fail(EnvCPUCacheGB, fmt.Sprint(c.CPUCacheGB), reason)
		}
	}

	if err := p.err(); err != nil {
		return nil, err
	}
	return c, nil
}

// unsupported reads the Dynamo variables kvbm accepts but does not act on;
// one warning for each that is set.
func (p *parser) unsupported(c *Config) []string {
	var w []string
	// Dynamo reads true/1/yes; a value that is no boolean is an error here.
	if p.boolean(EnvNcclMLAMode, false) {
		w = append(w, EnvNcclMLAMode+" is on but kvbm has no NCCL replicated mode: every rank keeps and "+
			"moves its own shard of the KV blocks (sharded mode), as Dynamo does when built without its nccl feature")
	}
	if raw, set := p.get(EnvNcclMaxCTAs); set {
		w = append(w, fmt.Sprintf("%s=%q is ignored: kvbm uses no NCCL", EnvNcclMaxCTAs, raw))
	}
	if raw, set := p.get(EnvTransferBatchSize); set {
		w = append(w, fmt.Sprintf("%s=%q is ignored (a KVBM v2 setting): kvbm's transfer batch size is %s (%d)",
			EnvTransferBatchSize, raw, EnvMaxTransferBatchSize, c.MaxTransferBatchSize))
	}
	return w
}

// HostEnabled reports whether the host (G2) tier is configured.
func (c *Config) HostEnabled() bool { return c.CPUCacheOverrideBlocks > 0 || c.CPUCacheGB > 0 }

// DiskEnabled reports whether the disk (G3) tier is configured.
func (c *Config) DiskEnabled() bool { return c.DiskCacheOverrideBlocks > 0 || c.DiskCacheGB > 0 }

// HostBlocks is the G2 block count: the override if set, else
// floor(CPUCacheGB·10⁹ / bytesPerBlockAllWorkers). bytesPerBlockAllWorkers
// is one block's bytes summed over all workers (TP ranks), because the GB
// budget is a total. Returns 0 when bytesPerBlockAllWorkers ≤ 0.
func (c *Config) HostBlocks(bytesPerBlockAllWorkers int64) int {
	return clampBlocks(blocks(c.CPUCacheOverrideBlocks, c.CPUCacheGB, bytesPerBlockAllWorkers))
}

// DiskBlocks is HostBlocks for the disk (G3) tier.
func (c *Config) DiskBlocks(bytesPerBlockAllWorkers int64) int {
	return clampBlocks(blocks(c.DiskCacheOverrideBlocks, c.DiskCacheGB, bytesPerBlockAllWorkers))
}

// HostBlocks and DiskBlocks are at most MaxBlocks; CheckBlocks reports a
// configuration that asks for more.
func clampBlocks(n int64) int { return int(min(n, MaxBlocks)) }

func blocks(override int, gb float64, bytesPerBlock int64) int64 {
	if override > 0 {
		return int64(override)
	}
	if bytesPerBlock <= 0 || gb <= 0 {
		return 0
	}
	// Round GB·10⁹ to whole bytes first: 2.01·1e9 is 2009999999.9999998 in
	// float64, and flooring that before dividing would lose a block whenever
	// the budget is an exact multiple of the block size.
	total := int64(gbToBytes(gb))
	return total / bytesPerBlock
}

// ErrNoTier is returned by Validate when neither cache tier is configured.
var ErrNoTier = fmt.Errorf("config: no KV cache tier configured: set %s and/or %s (or their _OVERRIDE_NUM_BLOCKS variants)",
	EnvCPUCacheGB, EnvDiskCacheGB)

// Validate checks what the offload path needs beyond per-variable parsing:
// at least one tier must be configured. It is separate from FromLookup so
// that tools that never offload do not need a tier.
func (c *Config) Validate() error {
	if !c.HostEnabled() && !c.DiskEnabled() {
		return ErrNoTier
	}
	return nil
}

// Summary is a multi-line, human-readable description of c for the start-up
// log.
func (c *Config) Summary() string {
	var b strings.Builder
	tier := func(name string, enabled bool, gb float64, override int) {
		switch {
		case !enabled:
			fmt.Fprintf(&b, "  %s tier: disabled\n", name)
		case override > 0:
			fmt.Fprintf(&b, "  %s tier: %d blocks (override)\n", name, override)
		default:
			fmt.Fprintf(&b, "  %s tier: %g GB\n", name, gb)
		}
	}
	b.WriteString("kvbm configuration:\n")
	tier("host (G2)", c.HostEnabled(), c.CPUCacheGB, c.CPUCacheOverrideBlocks)
	if c.HostEnabled() {
		fmt.Fprintf(&b, "  host tier NUMA placement: %s\n", onOff(c.EnableNUMA))
	}
	tier("disk (G3)", c.DiskEnabled(), c.DiskCacheGB, c.DiskCacheOverrideBlocks)
	if c.DiskEnabled() {
		fmt.Fprintf(&b, "  disk dir: %s (O_DIRECT %s, allocator %s, offload filter %s, persistent %s, zero-fill fallback %s)\n",
			c.DiskCacheDir, onOff(!c.DiskDisableODirect), c.DiskAllocatorType, onOff(!c.DisableDiskOffloadFilter),
			onOff(c.DiskPersist), onOff(c.DiskZerofillFallback))
	}
	b.WriteString(c.Object.summary())
	fmt.Fprintf(&b, "  host offload min priority: %d\n", c.HostOffloadPrefixMinPriority)
	fmt.Fprintf(&b, "  transfers: %d concurrent batches of up to %d blocks\n",
		c.MaxConcurrentTransfers, c.MaxTransferBatchSize)
	fmt.Fprintf(&b, "  leader: zmq %s pub %d ack %d, worker init timeout %s, liveness timeout %s\n",
		c.LeaderZMQHost, c.LeaderZMQPubPort, c.LeaderZMQAckPort, c.LeaderWorkerInitTimeout, c.LeaderWorkerLiveness)
	fmt.Fprintf(&b, "  zmq: messages up to %d MiB\n", c.ZMQMaxMessageMB)
	if c.Metrics {
		fmt.Fprintf(&b, "  metrics: on, %s/metrics (up to %d connections; timeouts: headers %s, "+
			"request %s, response %s, idle %s)\n", c.MetricsAddr(), c.MetricsMaxConnections,
			c.MetricsReadHeaderTimeout, c.MetricsReadTimeout, c.MetricsWriteTimeout, c.MetricsIdleTimeout)
	} else {
		b.WriteString("  metrics: off\n")
	}
	fmt.Fprintf(&b, "  cache stats: window %d requests, logged every %s\n",
		c.CacheStatsMaxRequests, c.CacheStatsLogInterval)
	fmt.Fprintf(&b, "  consolidator: %s (%s), nats %s", onOff(c.EnableConsolidator), c.ConsolidatorMode, c.NatsServer)
	if c.TrtllmZMQPort > 0 {
		fmt.Fprintf(&b, ", trtllm zmq port %d", c.TrtllmZMQPort)
	}
	return b.String()
}

func onOff(v bool) string {
	if v {
		return "on"
	}
	return "off"
}

// logOnce guards LogOnce: the leader, each worker and the consolidator may
// all construct a Config in one process, and one summary is enough.
var logOnce sync.Once

// LogOnce logs Summary through logf the first time it is called in this
// process; later calls (with any Config) do nothing.
func (c *Config) LogOnce(logf func(format string, args ...any)) {
	logOnce.Do(func() { logf("%s", c.Summary()) })
}

// warnOnce guards WarnOnce, as logOnce does LogOnce.
var warnOnce sync.Once

// WarnOnce passes each of c.Warnings to warn the first time it is called in
// this process (the leader and the workers all start from a Config).
func (c *Config) WarnOnce(warn func(msg string)) {
	warnOnce.Do(func() {
		for _, w := range c.Warnings {
			warn(w)
		}
	})
}
