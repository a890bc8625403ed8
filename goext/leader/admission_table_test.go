package leader

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/plan"
)

// admissionRequests is the workload's size: requests, 20% of them reusing
// one of 10 popular 3-block prefixes, the rest unique.
const admissionRequests = 1000

// admissionBlockBytes turns written blocks into bytes in the printed table:
// a 32-token block of a Qwen2-0.5B-like model's KV in bf16 (24 layers × K
// and V × 2 KV heads × 64 × 2 bytes × 32 tokens). Admission decides per
// block, so the block counts do not depend on it.
const admissionBlockBytes = 24 * 2 * 2 * 64 * 2 * 32

type admissionRow struct {
	name   string
	g3, g4 int // blocks written
}

// admissionWrites runs the workload under each admission and returns the
// blocks written to G3 (moves) and G4 (uploads); exact counts, no timings.
// The reused blocks are 20% × 3 / 4 = 15% of all blocks seen.
func admissionWrites(tb testing.TB) []admissionRow {
	run := func(a config.Admission) (g3, g4w int) {
		e := newAdmissionEnv(tb, 4096, a, true)
		rng := rand.New(rand.NewPCG(7, 7))
		for i := range admissionRequests {
			var prompt []uint32
			if rng.IntN(5) == 0 {
				prompt = append(toks(1_000_000*(1+rng.IntN(10)), 3*bs), toks(50_000_000+i*10*bs, bs+1)...)
			} else {
				prompt = toks(100_000_000+i*10*bs, 4*bs+1)
			}
			for _, s := range e.request(tb, fmt.Sprint("r", i), prompt) {
				g3 += moves(s)
				g4w += uploads(s)
			}
		}
		for _, s := range []*plan.Step{e.step(tb), e.step(tb)} {
			g3 += moves(s)
			g4w += uploads(s)
		}
		return g3, g4w
	}
	var out []admissionRow
	for _, c := range []struct {
		name string
		a    config.Admission
	}{
		{"all / all (no admission)", config.Admission{Disk: config.AdmitAll, Object: config.AdmitAll}},
		{"frequency / all (defaults)", config.Admission{Disk: config.AdmitFrequency, Object: config.AdmitAll}},
		{"sketch / sketch", config.Admission{Disk: config.AdmitSketch, Object: config.AdmitSketch}},
	} {
		g3, g4 := run(c.a)
		out = append(out, admissionRow{c.name, g3, g4})
	}
	return out
}

func admissionTable(rows []admissionRow) string {
	mib := func(blocks int) float64 { return float64(blocks) * admissionBlockBytes / (1 << 20) }
	var b strings.Builder
	fmt.Fprintf(&b, "\n%d requests, 20%% reusing one of 10 popular 3-block prefixes; MiB at %d KiB a block\n",
		admissionRequests, admissionBlockBytes>>10)
	fmt.Fprintf(&b, "%-28s %10s %9s %10s %9s\n", "admission (G3 / G4)", "G3 blocks", "G3 MiB", "G4 blocks", "G4 MiB")
	for _, r := range rows {
		fmt.Fprintf(&b, "%-28s %10d %9.1f %10d %9.1f\n", r.name, r.g3, mib(r.g3), r.g4, mib(r.g4))
	}
	return b.String()
}

// Blocks written to G3 and G4 by the workload under each admission
// (printed as a table with -v; BenchmarkAdmissionWrites prints it in
// `make bench`).
func TestAdmissionWritesTable(t *testing.T) {
	rows := admissionWrites(t)
	t.Log(admissionTable(rows))
	all, sk := rows[0], rows[2]
	require.GreaterOrEqual(t, all.g4, 3*admissionRequests, "every block saved into G2 is uploaded")
	// The sketch writes each popular prefix once per tier (at most 30
	// blocks), and almost none of the rest.
	require.LessOrEqual(t, sk.g3, 30+admissionRequests/50)
	require.LessOrEqual(t, sk.g4, 30+admissionRequests/50)
	require.Positive(t, sk.g3)
	require.Positive(t, sk.g4)
}

// BenchmarkAdmissionWrites prints the table of TestAdmissionWritesTable's
// workload (bytes written to G3 and G4 with and without admission; the
// baseline, no admission, in the same run) and appends its summary row
// to $KVBM_BENCH_OUT/rows.jsonl (bench/summary.py). Counts, not timings:
// run it with -benchtime 1x.
func BenchmarkAdmissionWrites(b *testing.B) {
	var rows []admissionRow
	for b.Loop() {
		rows = admissionWrites(b)
	}
	fmt.Print(admissionTable(rows))
	all, sk := rows[0], rows[2]
	b.ReportMetric(float64(sk.g3+sk.g4)/float64(all.g3+all.g4), "written/no-admission")
	if dir := os.Getenv("KVBM_BENCH_OUT"); dir != "" {
		row, _ := json.Marshal(map[string]any{
			"bench": "admission", "figure": "blocks written to G3 + G4, 20% reuse (sketch / sketch)",
			"kvbm": fmt.Sprintf("%d + %d", sk.g3, sk.g4), "baseline": fmt.Sprintf("no admission %d + %d", all.g3, all.g4),
			"ratio": fmt.Sprintf("%.1f× fewer", float64(all.g3+all.g4)/float64(max(1, sk.g3+sk.g4))), "target": "", "ok": nil,
		})
		f, err := os.OpenFile(filepath.Join(dir, "rows.jsonl"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
		if err == nil {
			_, err = f.Write(append(row, '\n'))
			if cerr := f.Close(); err == nil {
				err = cerr
			}
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench rows (KVBM_BENCH_OUT):", err)
		}
	}
}
