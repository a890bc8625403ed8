// Package rows appends a benchmark's summary rows to the JSON-lines file that
// bench/summary.py turns into the closing table of `make bench`. The file is
// $KVBM_BENCH_OUT/rows.jsonl; without KVBM_BENCH_OUT nothing is written.
package rows

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
)

// Row is one figure: kvbm's result, the baseline(s) it is compared with
// (named, with their result, measured in the same run), the ratio and the
// target. OK is nil when the figure has no target or the ratio was refused.
type Row struct {
	Bench    string `json:"bench"`
	Figure   string `json:"figure"`
	Kvbm     string `json:"kvbm"`
	Baseline string `json:"baseline"`
	Ratio    string `json:"ratio"`
	Target   string `json:"target"`
	OK       *bool  `json:"ok"`
}

// Machine is what one bench learnt about the machine (merged by summary.py).
type Machine map[string]any

// Bool is a *bool for Row.OK.
func Bool(b bool) *bool { return &b }

// Emit appends r; a failure to write is reported on stderr, never fatal:
// the bench's own table has already been printed.
func Emit(r Row) { write(r) }

// EmitMachine appends a machine record.
func EmitMachine(m Machine) { write(map[string]any{"machine": m}) }

func write(v any) {
	dir := os.Getenv("KVBM_BENCH_OUT") // envread: the bench harness's output directory, no kvbm setting
	if dir == "" {
		return
	}
	b, err := json.Marshal(v)
	if err == nil {
		var f *os.File
		f, err = os.OpenFile(filepath.Join(dir, "rows.jsonl"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
		if err == nil {
			_, err = f.Write(append(b, '\n'))
			if cerr := f.Close(); err == nil {
				err = cerr
			}
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench rows (KVBM_BENCH_OUT):", err)
	}
}
