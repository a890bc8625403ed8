package config

import (
	"errors"
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// VarError is one invalid variable. Callers can errors.As the joined error
// from FromLookup to list them.
type VarError struct {
	Name   string // the environment variable
	Value  string // the value as set
	Reason string
}

func (e *VarError) Error() string {
	return fmt.Sprintf("config: invalid %s=%q: %s", e.Name, e.Value, e.Reason)
}

// parser reads variables through lookup and records one VarError per bad
// variable instead of stopping at the first.
type parser struct {
	lookup func(string) (string, bool)
	errs   []error
	bad    map[string]bool
}

// get returns the trimmed value and whether it counts as set. Whitespace is
// trimmed because shells and YAML manifests add it invisibly; an empty value
// is "unset", matching `export X=` meaning "no value".
func (p *parser) get(name string) (raw string, set bool) {
	v, ok := p.lookup(name)
	if !ok || strings.TrimSpace(v) == "" {
		return v, false
	}
	return v, true
}

func (p *parser) fail(name, value, reason string) {
	p.errs = append(p.errs, &VarError{Name: name, Value: value, Reason: reason})
	if p.bad == nil {
		p.bad = map[string]bool{}
	}
	p.bad[name] = true
}

// ok reports whether none of names failed to parse.
func (p *parser) ok(names ...string) bool {
	for _, n := range names {
		if p.bad[n] {
			return false
		}
	}
	return true
}

func (p *parser) err() error { return errors.Join(p.errs...) }

func (p *parser) str(name, def string) string {
	v, set := p.get(name)
	if !set {
		return def
	}
	return strings.TrimSpace(v)
}

// path is str for a file-system path. A path must be valid UTF-8 and free of
// U+FFFD: the value reaches Go through JSON from Python, which turns bytes
// that are not UTF-8 into U+FFFD, so the tier would land in another
// directory than the one named.
func (p *parser) path(name, def string) string {
	v := p.str(name, def)
	if !utf8.ValidString(v) || strings.ContainsRune(v, utf8.RuneError) {
		p.fail(name, v, "not valid UTF-8; use a path whose name is UTF-8")
		return def
	}
	return v
}

// present reports whether name is set, whatever its value: Dynamo reads
// some switches by presence alone, so "0" turns them on too.
func (p *parser) present(name string) bool {
	_, set := p.get(name)
	return set
}

// choice accepts one of def and others, exactly as written (after
// trimming); unset is def.
func (p *parser) choice(name, def string, others ...string) string {
	raw, set := p.get(name)
	if !set {
		return def
	}
	v := strings.TrimSpace(raw)
	allowed := append([]string{def}, others...)
	for _, a := range allowed {
		if v == a {
			return v
		}
	}
	p.fail(name, raw, "must be one of "+strings.Join(allowed, ", "))
	return def
}

// boolean accepts 1/true/on/yes and 0/false/off/no, case-insensitively.
func (p *parser) boolean(name string, def bool) bool {
	raw, set := p.get(name)
	if !set {
		return def
	}
	switch strings.ToLower(strings.TrimSpace(raw)) {
	case "1", "true", "on", "yes":
		return true
	case "0", "false", "off", "no":
		return false
	}
	p.fail(name, raw, "not a boolean (use 1/true/on/yes or 0/false/off/no)")
	return def
}

// integer parses a base-10 integer ≥ min (min ≥ 0).
func (p *parser) integer(name string, min int64) (int64, bool) {
	raw, _ := p.get(name)
	n, err := strconv.ParseInt(strings.TrimSpace(raw), 10, 64)
	switch {
	case err != nil && errors.Is(err, strconv.ErrRange):
		p.fail(name, raw, "out of range")
	case err != nil:
		p.fail(name, raw, "not an integer")
	case n < 0:
		p.fail(name, raw, "must not be negative")
	case n < min:
		p.fail(name, raw, fmt.Sprintf("must be at least %d", min))
	default:
		return n, true
	}
	return 0, false
}

// count parses a non-negative int (at least min) with default def.
func (p *parser) count(name string, def, min int) int {
	if _, set := p.get(name); !set {
		return def
	}
	n, ok := p.integer(name, int64(min))
	if !ok {
		return def
	}
	if n > math.MaxInt32 {
		raw, _ := p.get(name)
		p.fail(name, raw, fmt.Sprintf("must be at most %d", math.MaxInt32))
		return def
	}
	return int(n)
}

// port parses a TCP port, 1..65535.
func (p *parser) port(name string, def int) int {
	raw, set := p.get(name)
	if !set {
		return def
	}
	n, ok := p.integer(name, 0)
	if !ok {
		return def
	}
	if n < 1 || n > 65535 {
		p.fail(name, raw, "port out of range 1..65535")
		return def
	}
	return int(n)
}

// maxSeconds keeps Duration arithmetic from overflowing (~292 years).
const maxSeconds = math.MaxInt64 / int64(time.Second)

// seconds parses a whole number of seconds, at least 1: a zero timeout or
// log interval would make the leader give up at once or log in a busy loop.
func (p *parser) seconds(name string, def time.Duration) time.Duration {
	raw, set := p.get(name)
	if !set {
		return def
	}
	n, ok := p.integer(name, 1)
	if !ok {
		return def
	}
	if n > maxSeconds {
		p.fail(name, raw, "out of range")
		return def
	}
	return time.Duration(n) * time.Second
}

// gigabytes parses a decimal GB size: a finite, non-negative float. 0 means
// the tier is off, as if unset.
func (p *parser) gigabytes(name string) float64 {
	raw, set := p.get(name)
	if !set {
		return 0
	}
	v, err := strconv.ParseFloat(strings.TrimSpace(raw), 64)
	switch {
	case err != nil && errors.Is(err, strconv.ErrRange):
		p.fail(name, raw, "out of range")
	case err != nil:
		p.fail(name, raw, "not a number (decimal GB, e.g. 4 or 0.5)")
	case math.IsNaN(v) || math.IsInf(v, 0):
		p.fail(name, raw, "must be a finite number")
	case v < 0:
		p.fail(name, raw, "must not be negative")
	case gbToBytes(v) > math.MaxInt64/2:
		p.fail(name, raw, "too large")
	default:
		return v
	}
	return 0
}

func gbToBytes(gb float64) float64 { return math.Round(gb * 1e9) }

// checkWritableDir makes dir if needed and proves we can create a file in
// it, so a bad disk tier fails at start-up rather than on the first offload.
func checkWritableDir(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("cannot create directory: %w", err) // errprefix: wrapped: the reason of a VarError
	}
	f, err := os.CreateTemp(dir, ".kvbm-write-check-*")
	if err != nil {
		return fmt.Errorf("directory not writable: %w", err) // errprefix: wrapped: the reason of a VarError
	}
	name := f.Name()
	_ = f.Close()
	if err := os.Remove(name); err != nil {
		return fmt.Errorf("cannot remove write-check file %s: %w", name, err) // errprefix: wrapped: the reason of a VarError
	}
	return nil
}
