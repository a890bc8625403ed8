package wire

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/kvbm/kvbm/goext/config"
)

// The handshake: every rank reports its sizes; the leader checks that they
// agree, sizes the tiers and tells every rank to allocate.

// Handshake is the outcome of a completed handshake.
type Handshake struct {
	NumWorkers      int
	BytesPerBlock   int64 // one rank's share of a block (leader.Options.BytesPerBlock)
	NumDeviceBlocks int
	NumHostBlocks   int
	NumDiskBlocks   int
}

// Handshake runs the start-up protocol (package comment) and returns the
// sizes once every rank allocated. It is bounded by InitTimeout and ctx.
// Calling it again returns the same result (or the same failure).
func (l *Coordinator) Handshake(ctx context.Context) (Handshake, error) {
	l.mu.Lock()
	closed := l.closedErr != nil
	l.mu.Unlock()
	if closed {
		return Handshake{}, ErrClosed
	}
	// InitTimeout bounds the handshake as a whole, across calls.
	l.mu.Lock()
	if l.hsStart.IsZero() {
		l.hsStart = time.Now()
	}
	start := l.hsStart
	l.mu.Unlock()
	deadline := start.Add(l.opts.InitTimeout)
	caller := ctx
	ctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	tick := time.NewTicker(l.opts.RetryInterval)
	defer tick.Stop()
	for {
		frames, hs, err := l.handshakeStep()
		if err != nil {
			return Handshake{}, err
		}
		if hs != nil {
			l.hbOnce.Do(func() {
				l.log.Info("ZMQ handshake complete; workers allocation ready", "workers", hs.NumWorkers,
					"bytes_per_block", hs.BytesPerBlock, "num_device_blocks", hs.NumDeviceBlocks,
					"host_blocks", hs.NumHostBlocks, "disk_blocks", hs.NumDiskBlocks, "took", time.Since(start).Round(time.Millisecond))
				l.wg.Add(1)
				go l.heartbeat()
			})
			return *hs, nil
		}
		if err := l.t.broadcast(frames); err != nil && !errors.Is(err, errTransportClosed) {
			l.log.Debug("kvbm leader side channel: handshake send", "err", err)
		}
		select {
		case <-ctx.Done():
			if caller.Err() != nil && time.Now().Before(deadline) {
				return Handshake{}, fmt.Errorf("%w (%s so far)", ErrHandshakePending,
					time.Since(start).Round(time.Millisecond))
			}
			return Handshake{}, l.timeoutError(ctx, time.Since(start))
		case <-l.closed:
			return Handshake{}, ErrClosed
		case <-tick.C:
		case <-l.changed:
		}
	}
}

// handshakeStep advances the handshake: the message to (re)send, or the
// result once every rank is ready, or a fatal error.
func (l *Coordinator) handshakeStep() ([][]byte, *Handshake, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.hs != nil {
		return nil, l.hs, nil
	}
	if l.conflict != nil {
		return nil, nil, l.conflict
	}
	for _, rs := range l.ranks {
		if rs.md == nil {
			return encodeLeader(l.nextID.Add(1), fnWorkerMetadata, nil), nil, nil
		}
	}
	if l.meta == nil {
		if err := l.checkAgreement(); err != nil {
			l.conflict = err
			return nil, nil, err
		}
		md := l.ranks[0].md
		host, disk, err := l.opts.Size(md.BytesPerBlock, len(l.ranks))
		if err != nil {
			l.conflict = fmt.Errorf("wire: tier sizing: %w", err)
			return nil, nil, l.conflict
		}
		l.meta = &LeaderMetadata{NumHostBlocks: host, NumDiskBlocks: disk, WorldSize: len(l.ranks)}
		l.metaID = l.nextID.Add(1)
		l.log.Info("kvbm leader: all workers reported; asking them to allocate", "workers", len(l.ranks),
			"bytes_per_block", md.BytesPerBlock, "host_blocks", host, "disk_blocks", disk)
	}
	var failed []string
	all := true
	for r, rs := range l.ranks {
		if rs.allocErr != "" {
			// The rank's own error starts with this package's prefix too.
			failed = append(failed, fmt.Sprintf("rank %d: %s", r, strings.TrimPrefix(rs.allocErr, "wire: ")))
		}
		all = all && rs.ready
	}
	if len(failed) > 0 {
		l.conflict = fmt.Errorf("wire: worker allocation failed: %s", strings.Join(failed, "; "))
		return nil, nil, l.conflict
	}
	if all {
		md := l.ranks[0].md
		l.hs = &Handshake{NumWorkers: len(l.ranks), BytesPerBlock: md.BytesPerBlock, NumDeviceBlocks: md.NumDeviceBlocks,
			NumHostBlocks: l.meta.NumHostBlocks, NumDiskBlocks: l.meta.NumDiskBlocks}
		now := time.Now()
		for r := range l.ranks {
			l.ranks[r].lastSeen = now // the heartbeat clock starts now
		}
		return nil, l.hs, nil
	}
	return encodeLeader(l.metaID, fnLeaderMetadata, marshal(l.meta)), nil, nil
}

// checkAgreement: every rank must describe the same shard geometry.
func (l *Coordinator) checkAgreement() error {
	first := l.ranks[0].md
	var errs []string
	for r, rs := range l.ranks {
		md := rs.md
		if md.WorldSize != len(l.ranks) {
			errs = append(errs, fmt.Sprintf("rank %d was started with world size %d, the leader expects %d", r, md.WorldSize, len(l.ranks)))
		}
		if md.BytesPerBlock != first.BytesPerBlock {
			errs = append(errs, fmt.Sprintf("rank %d reports bytes_per_block %d, rank 0 reports %d", r, md.BytesPerBlock, first.BytesPerBlock))
		}
		if md.NumDeviceBlocks != first.NumDeviceBlocks {
			errs = append(errs, fmt.Sprintf("rank %d reports num_device_blocks %d, rank 0 reports %d", r, md.NumDeviceBlocks, first.NumDeviceBlocks))
		}
		if md.BytesPerBlock <= 0 {
			errs = append(errs, fmt.Sprintf("rank %d reports bytes_per_block %d", r, md.BytesPerBlock))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("wire: workers disagree (every tensor-parallel rank must hold an equal shard of the same KV cache): %s",
			strings.Join(errs, "; "))
	}
	return nil
}

func (l *Coordinator) timeoutError(ctx context.Context, waited time.Duration) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	var silent, allocating, notAcked []int
	for r, rs := range l.ranks {
		switch {
		case rs.md == nil:
			silent = append(silent, r)
		case l.meta != nil && !rs.ready && rs.allocating:
			allocating = append(allocating, r)
		case l.meta != nil && !rs.ready:
			notAcked = append(notAcked, r)
		}
	}
	var parts []string
	if len(silent) > 0 {
		parts = append(parts, fmt.Sprintf("rank(s) %v of %d never answered", silent, len(l.ranks)))
	}
	if len(notAcked) > 0 {
		parts = append(parts, fmt.Sprintf("rank(s) %v reported but never acknowledged the tier sizes", notAcked))
	}
	if len(allocating) > 0 {
		parts = append(parts, fmt.Sprintf("rank(s) %v were still allocating their host/disk tiers", allocating))
	}
	why := "timed out"
	if ctx.Err() == context.Canceled {
		why = "cancelled"
	}
	return fmt.Errorf("%w (%s after %s; %s=%s): %s (transport %s, %s / %s)",
		ErrHandshakeTimeout, why, waited.Round(time.Millisecond), config.EnvLeaderWorkerInitTimeoutSecs,
		l.opts.InitTimeout, strings.Join(parts, "; "), l.transport, l.ep.PubURL(), l.ep.AckURL())
}
