package config

import (
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
)

// The CUDA build's copier settings (goext/cuda, docs/cuda.md) and the log
// level: read here with every other setting, so kvbm_config_check validates
// them and nothing else reads the environment.
const (
	EnvCUDACopy           = "DYN_KVBM_CUDA_COPY"
	EnvCUDAStagingMiB     = "KVBM_CUDA_STAGING_MIB"
	EnvCUDAPipelineDepth  = "KVBM_CUDA_PIPELINE_DEPTH"
	EnvCUDAStagedCTAs     = "KVBM_CUDA_STAGED_CTAS"
	EnvCUDAStagedThreads  = "KVBM_CUDA_STAGED_THREADS"
	EnvCUDAStagedPriority = "KVBM_CUDA_STAGED_PRIORITY"
	EnvCUDADMAStreams     = "KVBM_CUDA_DMA_STREAMS"
	EnvCUDASplitPct       = "KVBM_CUDA_SPLIT_PCT"
	EnvCUDASplitChunkMiB  = "KVBM_CUDA_SPLIT_CHUNK_MIB"
	EnvCUDASplitStreams   = "KVBM_CUDA_SPLIT_STREAMS"
	EnvCUDASplitProbeUs   = "KVBM_CUDA_SPLIT_PROBE_US"
	EnvCUDASplitBusy      = "KVBM_CUDA_SPLIT_BUSY"
	EnvCUDAKernels        = "KVBM_CUDA_KERNELS"
	EnvLog                = "DYN_LOG"
)

// CUDACopyModes are DYN_KVBM_CUDA_COPY's values ("" means auto; zerocopy and
// zero_copy are kernel's other names).
var CUDACopyModes = []string{"auto", "kernel", "staged", "direct", "batch", "split"}

// Hard caps of the copier's knobs: each sizes device or pinned memory, or
// a count of streams or thread blocks; the copier refuses more streams
// than it has.
const (
	CapCUDAStagingMiB    = 1 << 16 // 64 GiB of device staging memory per direction
	CapCUDAPipelineDepth = 64
	CapCUDAStagedCTAs    = 1 << 16
	CapCUDAStagedThreads = 256
	CapCUDADMAStreams    = 8
	CapCUDASplitPct      = 99
	CapCUDASplitChunkMiB = 1 << 16
	CapCUDASplitStreams  = 8
	CapCUDASplitProbeUs  = 1_000_000 // one probe a second
)

// CUDA is the CUDA build's copier configuration; zero values pick the
// copier's defaults (goext/cuda.Options).
type CUDA struct {
	// Copy is DYN_KVBM_CUDA_COPY as written (goext/cuda.ParseMode reads
	// it; checked here against CUDACopyModes).
	Copy              string
	StagingBytes      int64
	PipelineDepth     int
	StagedCTAs        int
	StagedThreads     int // a multiple of 32 in [32, 256]
	StagedLowPriority bool
	DMAStreams        int
	SplitPercent      int
	SplitChunkBytes   int64
	SplitStreams      int
	SplitProbeMicros  int
	// SplitBusyBatch: KVBM_CUDA_SPLIT_BUSY=batch (split's copies while the
	// GPU is busy go by the driver's batched copy; the default, blocks, is
	// one plain copy per block where the layout allows).
	SplitBusyBatch bool
	KernelsFile    string
}

// LogLevel is DYN_LOG's level (debug, info, warn, error; trace is debug,
// anything else info); LogLevelSet reports whether DYN_LOG was set.
type LogLevel struct {
	Level slog.Level
	Set   bool
}

// ParseLogLevel reads a DYN_LOG value: debug (or trace), warn (or
// warning), error; anything else is info.
func ParseLogLevel(s string) slog.Level {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "debug", "trace":
		return slog.LevelDebug
	case "warn", "warning":
		return slog.LevelWarn
	case "error":
		return slog.LevelError
	}
	return slog.LevelInfo
}

// ProcessLogLevel is DYN_LOG's level in the process environment, for the
// logger that exists before any configuration was loaded.
func ProcessLogLevel() slog.Level {
	v, _ := os.LookupEnv(EnvLog)
	return ParseLogLevel(v)
}

func (p *parser) logLevel() LogLevel {
	raw, set := p.get(EnvLog)
	if !set {
		return LogLevel{Level: slog.LevelInfo}
	}
	return LogLevel{Level: ParseLogLevel(raw), Set: true}
}

// cudaKnob parses a positive integer of at most max, times unit; unset: 0.
func (p *parser) cudaKnob(name string, max int64) int64 {
	raw, set := p.get(name)
	if !set {
		return 0
	}
	n, err := strconv.ParseInt(strings.TrimSpace(raw), 10, 64)
	switch {
	case err != nil || n <= 0:
		p.fail(name, raw, "want a positive integer")
	case n > max:
		p.fail(name, raw, fmt.Sprintf("must be at most %d", max))
	default:
		return n
	}
	return 0
}

// cudaEither reads a knob of two words (case and surrounding spaces
// ignored): true for the second, false for the first or when unset.
func (p *parser) cudaEither(name, first, second string) bool {
	raw, set := p.get(name)
	if !set {
		return false
	}
	switch strings.ToLower(strings.TrimSpace(raw)) {
	case first:
		return false
	case second:
		return true
	}
	p.fail(name, raw, "want "+first+" or "+second)
	return false
}

func (p *parser) cuda() CUDA {
	c := CUDA{
		StagingBytes:     p.cudaKnob(EnvCUDAStagingMiB, CapCUDAStagingMiB) << 20,
		PipelineDepth:    int(p.cudaKnob(EnvCUDAPipelineDepth, CapCUDAPipelineDepth)),
		StagedCTAs:       int(p.cudaKnob(EnvCUDAStagedCTAs, CapCUDAStagedCTAs)),
		StagedThreads:    int(p.cudaKnob(EnvCUDAStagedThreads, CapCUDAStagedThreads)),
		DMAStreams:       int(p.cudaKnob(EnvCUDADMAStreams, CapCUDADMAStreams)),
		SplitPercent:     int(p.cudaKnob(EnvCUDASplitPct, CapCUDASplitPct)),
		SplitChunkBytes:  p.cudaKnob(EnvCUDASplitChunkMiB, CapCUDASplitChunkMiB) << 20,
		SplitStreams:     int(p.cudaKnob(EnvCUDASplitStreams, CapCUDASplitStreams)),
		SplitProbeMicros: int(p.cudaKnob(EnvCUDASplitProbeUs, CapCUDASplitProbeUs)),
		KernelsFile:      strings.TrimSpace(p.str(EnvCUDAKernels, "")),
	}
	if t := c.StagedThreads; t != 0 && (t < 32 || t%32 != 0) {
		raw, _ := p.get(EnvCUDAStagedThreads)
		p.fail(EnvCUDAStagedThreads, raw, "want a multiple of 32 in [32, 256]")
	}
	c.StagedLowPriority = p.cudaEither(EnvCUDAStagedPriority, "high", "low")
	c.SplitBusyBatch = p.cudaEither(EnvCUDASplitBusy, "blocks", "batch")
	if raw, set := p.get(EnvCUDACopy); set {
		c.Copy = strings.TrimSpace(raw)
		switch strings.ToLower(c.Copy) {
		case "auto", "kernel", "zerocopy", "zero_copy", "staged", "direct", "batch", "split":
		default:
			p.fail(EnvCUDACopy, raw, "want auto, kernel, staged, direct, batch or split")
		}
	}
	return c
}
