package config

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
)

// Load-or-recompute and admission (goext/policy; design §4.1, §4.2).
const (
	EnvLoadPolicy         = "DYN_KVBM_LOAD_POLICY"
	EnvPrefillUsPerToken  = "DYN_KVBM_PREFILL_US_PER_TOKEN"
	EnvDiskAdmission      = "DYN_KVBM_DISK_ADMISSION"
	EnvObjectAdmission    = "DYN_KVBM_OBJECT_ADMISSION"
	EnvDiskWriteMBps      = "DYN_KVBM_DISK_WRITE_MBPS"
	EnvObjectPutsPerSec   = "DYN_KVBM_OBJECT_PUTS_PER_SEC"
	loadPolicyCapPrefix   = "never-slower-than="
	maxPolicyMilliseconds = 3_600_000 // an hour: far above any load worth waiting for
)

// DYN_KVBM_LOAD_POLICY modes.
const (
	// LoadAlways loads every matched block (kvbm's behaviour before the
	// cost model; the default).
	LoadAlways = "always"
	// LoadCost loads the matched prefix that the cost model expects to
	// save the most time against recomputing it.
	LoadCost = "cost"
	// LoadCap loads the longest matched prefix whose expected load time
	// is at most LoadPolicy.CapMs.
	LoadCap = "never-slower-than"
)

// Admission modes of DYN_KVBM_DISK_ADMISSION and DYN_KVBM_OBJECT_ADMISSION.
const (
	// AdmitFrequency: G3 only; the frequency filter (a block goes to disk
	// on its second sighting within the decay window). The G3 default.
	AdmitFrequency = "frequency"
	// AdmitSketch: a block is written once a count-min sketch over sequence
	// hashes has seen it at least twice (bounded memory, aging).
	AdmitSketch = "sketch"
	// AdmitAll writes every candidate block (the G4 default; for G3 the
	// same as DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER=1).
	AdmitAll = "all"
)

// LoadPolicy is DYN_KVBM_LOAD_POLICY and the prefill cost it compares with.
type LoadPolicy struct {
	Mode  string  // LoadAlways, LoadCost or LoadCap
	CapMs float64 // LoadCap: the bound in milliseconds; 0 otherwise
	// PrefillUsPerToken is DYN_KVBM_PREFILL_US_PER_TOKEN: what one prompt
	// token costs the engine to compute, in microseconds; 0 = measured from
	// the engine's step timings.
	PrefillUsPerToken float64
}

// Admission is the G3 and G4 admission policy and write budgets.
type Admission struct {
	Disk   string // AdmitFrequency, AdmitSketch or AdmitAll
	Object string // AdmitAll or AdmitSketch
	// DiskWriteMBps bounds G2→G3 writes (decimal MB/s, all ranks); 0 = none.
	DiskWriteMBps float64
	// ObjectPutsPerSec bounds G4 uploads (objects/s); 0 = none.
	ObjectPutsPerSec float64
}

// loadPolicy parses DYN_KVBM_LOAD_POLICY and DYN_KVBM_PREFILL_US_PER_TOKEN.
func (p *parser) loadPolicy() LoadPolicy {
	lp := LoadPolicy{Mode: LoadAlways, PrefillUsPerToken: p.positiveFloat(EnvPrefillUsPerToken, 1e6)}
	raw, set := p.get(EnvLoadPolicy)
	if !set {
		return lp
	}
	v := strings.TrimSpace(raw)
	switch {
	case v == LoadAlways || v == LoadCost:
		lp.Mode = v
	case strings.HasPrefix(v, loadPolicyCapPrefix):
		ms, err := strconv.ParseFloat(strings.TrimPrefix(v, loadPolicyCapPrefix), 64)
		if err != nil || math.IsNaN(ms) || ms <= 0 || ms > maxPolicyMilliseconds {
			p.fail(EnvLoadPolicy, raw, fmt.Sprintf("%s<ms> needs a number of milliseconds in (0, %d]",
				loadPolicyCapPrefix, maxPolicyMilliseconds))
			return lp
		}
		lp.Mode, lp.CapMs = LoadCap, ms
	default:
		p.fail(EnvLoadPolicy, raw, "must be one of always, cost, "+loadPolicyCapPrefix+"<ms>")
	}
	return lp
}

// admission parses the admission modes and budgets. An explicit disk
// admission other than "all" contradicts DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER.
func (p *parser) admission(disableFilter bool) Admission {
	a := Admission{
		Disk:             p.choice(EnvDiskAdmission, AdmitFrequency, AdmitSketch, AdmitAll),
		Object:           p.choice(EnvObjectAdmission, AdmitAll, AdmitSketch),
		DiskWriteMBps:    p.budget(EnvDiskWriteMBps),
		ObjectPutsPerSec: p.budget(EnvObjectPutsPerSec),
	}
	if disableFilter {
		if _, set := p.get(EnvDiskAdmission); set && a.Disk != AdmitAll && p.ok(EnvDiskAdmission) {
			p.fail(EnvDiskAdmission, a.Disk, EnvDisableDiskOffloadFilter+" is on (offload every block); "+
				"unset one of the two")
		}
		a.Disk = AdmitAll
	}
	return a
}

// budget parses a rate: a finite number ≥ 0; unset or 0 = no budget.
func (p *parser) budget(name string) float64 {
	return p.nonNegativeFloat(name, 1e12)
}

// positiveFloat parses a finite number in (0, max]; unset = 0.
func (p *parser) positiveFloat(name string, max float64) float64 {
	v, ok := p.float(name, max)
	if ok && v == 0 {
		raw, _ := p.get(name)
		p.fail(name, raw, "must be positive (unset it to measure instead)")
		return 0
	}
	return v
}

// nonNegativeFloat parses a finite number in [0, max]; unset = 0.
func (p *parser) nonNegativeFloat(name string, max float64) float64 {
	v, _ := p.float(name, max)
	return v
}

func (p *parser) float(name string, max float64) (float64, bool) {
	raw, set := p.get(name)
	if !set {
		return 0, false
	}
	v, err := strconv.ParseFloat(strings.TrimSpace(raw), 64)
	switch {
	case err != nil && !errors.Is(err, strconv.ErrRange):
		p.fail(name, raw, "not a number")
	case err != nil || math.IsNaN(v) || math.IsInf(v, 0):
		p.fail(name, raw, "must be a finite number")
	case v < 0:
		p.fail(name, raw, "must not be negative")
	case v > max:
		p.fail(name, raw, fmt.Sprintf("must be at most %g", max))
	default:
		return v, true
	}
	return 0, false
}
