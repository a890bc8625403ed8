package rows

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The rows a bench emits must reach summary.py as one JSON object per line,
// appended (several benches write to the same file).
func TestEmitAppendsJSONLines(t *testing.T) {
	dir := t.TempDir()
	t.Setenv("KVBM_BENCH_OUT", dir)
	Emit(Row{Bench: "b", Figure: "f | with a bar", Kvbm: "1", Baseline: "x: 2", Ratio: "50%", Target: ">= 90%", OK: Bool(false)})
	EmitMachine(Machine{"o_direct": true})
	Emit(Row{Bench: "b", Figure: "g"})
	data, err := os.ReadFile(filepath.Join(dir, "rows.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSuffix(string(data), "\n"), "\n")
	if len(lines) != 3 {
		t.Fatalf("want 3 lines, got %d: %q", len(lines), data)
	}
	var r Row
	if err := json.Unmarshal([]byte(lines[0]), &r); err != nil || r.Figure != "f | with a bar" || r.OK == nil || *r.OK {
		t.Fatalf("first row %q: %+v %v", lines[0], r, err)
	}
	var m map[string]map[string]any
	if err := json.Unmarshal([]byte(lines[1]), &m); err != nil || m["machine"]["o_direct"] != true {
		t.Fatalf("machine line %q: %v", lines[1], err)
	}
	if err := json.Unmarshal([]byte(lines[2]), &r); err != nil || r.OK != nil {
		t.Fatalf("a row without a target must have ok null: %q", lines[2])
	}
}

// Without KVBM_BENCH_OUT a bench prints its own table only.
func TestEmitWithoutOutDirWritesNothing(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	t.Setenv("KVBM_BENCH_OUT", "")
	Emit(Row{Bench: "b"})
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Fatalf("wrote %v", ents)
	}
}
