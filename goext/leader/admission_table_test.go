package leader

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/plan"
)

// Blocks written to G3 and G4 by a workload where 20% of the requests
// reuse one of 10 popular 3-block prefixes and the rest are unique, under
// each admission (printed as a table with -v; the counts are exact, not
// timings). The reused blocks are 20% × 3 / 4 = 15% of all blocks seen.
func TestAdmissionWritesTable(t *testing.T) {
	const requests = 1000
	run := func(a config.Admission, g4 bool) (g3, g4w int) {
		e := newAdmissionEnv(t, 4096, a, g4)
		rng := rand.New(rand.NewPCG(7, 7))
		for i := range requests {
			var prompt []uint32
			if rng.IntN(5) == 0 {
				prompt = append(toks(1_000_000*(1+rng.IntN(10)), 3*bs), toks(50_000_000+i*10*bs, bs+1)...)
			} else {
				prompt = toks(100_000_000+i*10*bs, 4*bs+1)
			}
			for _, s := range e.request(t, fmt.Sprint("r", i), prompt) {
				g3 += moves(s)
				g4w += uploads(s)
			}
		}
		for _, s := range []*plan.Step{e.step(t), e.step(t)} {
			g3 += moves(s)
			g4w += uploads(s)
		}
		return g3, g4w
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\n%-28s %10s %10s\n", "admission (G3 / G4)", "G3 blocks", "G4 blocks")
	rows := map[string][2]int{}
	for _, c := range []struct {
		name string
		a    config.Admission
	}{
		{"all / all (no admission)", config.Admission{Disk: config.AdmitAll, Object: config.AdmitAll}},
		{"frequency / all (defaults)", config.Admission{Disk: config.AdmitFrequency, Object: config.AdmitAll}},
		{"sketch / sketch", config.Admission{Disk: config.AdmitSketch, Object: config.AdmitSketch}},
	} {
		g3, g4 := run(c.a, true)
		rows[c.name] = [2]int{g3, g4}
		fmt.Fprintf(&b, "%-28s %10d %10d\n", c.name, g3, g4)
	}
	t.Log(b.String())
	all, sk := rows["all / all (no admission)"], rows["sketch / sketch"]
	require.GreaterOrEqual(t, all[1], 3*requests, "every block saved into G2 is uploaded")
	// The sketch writes each popular prefix once per tier (at most 30
	// blocks), and almost none of the rest.
	require.LessOrEqual(t, sk[0], 30+requests/50)
	require.LessOrEqual(t, sk[1], 30+requests/50)
	require.Positive(t, sk[0])
	require.Positive(t, sk[1])
}
