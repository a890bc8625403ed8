package object

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestBreaker(t *testing.T) {
	now := time.Unix(0, 0)
	b := newBreaker(2, time.Second, func() time.Time { return now })
	require.True(t, b.allow())
	b.done(false)
	require.False(t, b.isOpen(), "one failure is below the threshold")
	require.True(t, b.allow())
	opened, _ := b.done(false)
	require.True(t, opened)
	require.False(t, b.allow(), "open: refused without a request")
	require.True(t, b.refusing())

	now = now.Add(time.Second)
	require.False(t, b.refusing())
	require.True(t, b.allow(), "after the cool-down one request tests the store")
	require.False(t, b.allow(), "only one at a time")
	b.done(false)
	require.False(t, b.allow(), "a failed test reopens it for another cool-down")

	now = now.Add(time.Second)
	require.True(t, b.allow())
	b.abandon()
	require.True(t, b.allow(), "an abandoned test frees the slot")
	_, closed := b.done(true)
	require.True(t, closed)
	require.False(t, b.isOpen())
	require.True(t, b.allow())
}
