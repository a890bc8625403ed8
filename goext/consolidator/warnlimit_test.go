package consolidator

import (
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/events"
)

// fakeClock steps time by hand for a warnLimiter.
type fakeClock struct{ t time.Time }

func (c *fakeClock) now() time.Time { return c.t }

func TestWarnLimiterBurstThenSummary(t *testing.T) {
	rec := &logRecorder{}
	clock := &fakeClock{t: time.Unix(1000, 0)}
	l := newWarnLimiter(slog.New(rec), "test")
	l.burst, l.period, l.now = 3, time.Minute, clock.now

	for i := range 10 {
		l.Warn(fmt.Sprint("bad input ", i))
	}
	require.Equal(t, []string{"WARN bad input 0", "WARN bad input 1", "WARN bad input 2"}, rec.all(),
		"the first burst in full, the rest only counted")

	clock.t = clock.t.Add(30 * time.Second)
	l.Warn("bad input 10") // same period: counted
	require.Len(t, rec.all(), 3)

	clock.t = clock.t.Add(30 * time.Second)
	l.Warn("bad input 11") // a new period: summary, then in full again
	lines := rec.all()
	require.Len(t, lines, 5)
	require.Equal(t, "WARN Suppressed 8 test warning(s) in the last 1m0s after the first 3 (8 suppressed in all) "+
		"suppressed=8 total_suppressed=8", lines[3])
	require.Equal(t, "WARN bad input 11", lines[4])

	l.Flush() // nothing suppressed in this period
	require.Len(t, rec.all(), 5)
	for i := range 4 {
		l.Warn(fmt.Sprint("more ", i))
	}
	l.Flush()
	require.Equal(t, "WARN Suppressed 2 test warning(s) in the last 0s after the first 3 (10 suppressed in all) "+
		"suppressed=2 total_suppressed=10", rec.all()[7])
}

// TestInvalidEngineInputWarningsRateLimited: a flood of malformed engine
// messages is counted in full but logs only the first few lines and a
// summary, not one line each.
func TestInvalidEngineInputWarningsRateLimited(t *testing.T) {
	const flood = 50_000
	rec := &logRecorder{}
	c := &Consolidator{log: slog.New(rec), tr: NewTracker(EngineVllm, nil), wake: make(chan struct{}, 1)}
	warn := newWarnLimiter(c.log, "invalid engine input from tcp://127.0.0.1:5557")
	dec := events.NewDecoder()
	garbage := [][]byte{[]byte("kv"), make([]byte, 8), {0xc1}}
	for range flood / 2 {
		c.handleMessage(dec, warn, "tcp://127.0.0.1:5557", garbage)
	}
	// A well-formed batch whose events are all malformed: each is skipped.
	bad := mustPack(t, []any{1.0, []any{[]any{"BlockStored", "not hashes"}, []any{"NoSuchEvent"}}, nil})
	for range flood / 4 {
		c.handleMessage(dec, warn, "tcp://127.0.0.1:5557", [][]byte{[]byte("kv"), make([]byte, 8), bad})
	}
	require.Equal(t, uint64(flood), c.Stats().Invalid, "every invalid message and event counted")
	require.Len(t, rec.grep("WARN"), defaultWarnBurst)
	require.NotEmpty(t, rec.grep("Failed to deserialize event batch from tcp://127.0.0.1:5557"))

	warn.Flush() // the subscriber's exit
	summary := rec.grep("Suppressed")
	require.Len(t, summary, 1)
	require.Contains(t, summary[0], fmt.Sprintf("Suppressed %d invalid engine input from tcp://127.0.0.1:5557 warning(s)",
		flood-defaultWarnBurst))
}
