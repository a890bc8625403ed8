package wire

import (
	"context"
	"fmt"

	"github.com/kvbm/kvbm/goext/plan"
)

// Runner executes a plan step on one rank: satisfied by *worker.Worker,
// whose Run orders a side-channel operation after the engine step it
// follows and serialises it with the engine's step calls.
type Runner interface {
	Run(ctx context.Context, s *plan.Step) (loadErrors []int64, err error)
}

// RunOn is a MemberOptions.Execute that decodes each operation and runs it
// on r. A load that failed on this rank fails the operation (its G1 blocks
// hold nothing valid). ctx is the Member's: Close ends a Run still waiting
// for its engine step.
func RunOn(r Runner) func(ctx context.Context, step []byte) error {
	return func(ctx context.Context, step []byte) error {
		st, err := plan.Decode(step)
		if err != nil {
			return err
		}
		failed, err := r.Run(ctx, st)
		if err != nil {
			return err
		}
		if len(failed) > 0 {
			return fmt.Errorf("wire: loads into G1 blocks %v failed", failed)
		}
		return nil
	}
}

// ExpectSizes is a MemberOptions.Allocate for a rank that already sized its
// tiers from its own view of the configuration: it accepts the leader's
// sizes only when they are the same (the leader then reports a mismatch
// naming the rank).
func ExpectSizes(hostBlocks, diskBlocks int) func(LeaderMetadata) error {
	return func(md LeaderMetadata) error {
		if md.NumHostBlocks != hostBlocks || md.NumDiskBlocks != diskBlocks {
			return fmt.Errorf("wire: this rank sized %d host and %d disk blocks from its own environment, the leader sized %d and %d: "+
				"DYN_KVBM_CPU_CACHE_* / DYN_KVBM_DISK_CACHE_* differ between the scheduler and worker processes",
				hostBlocks, diskBlocks, md.NumHostBlocks, md.NumDiskBlocks)
		}
		return nil
	}
}
