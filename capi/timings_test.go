package main

import (
	"os"
	"reflect"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/policy"
)

// Timed load batches of a worker in another process reach the leader's
// load-cost model through kvbm_leader_transfer_timings; a report of this
// process's own workers is ignored (the model hears them directly), and a
// malformed one is refused.
func TestLeaderTransferTimings(t *testing.T) {
	protos := parseHeader(t)
	hd := newTestHandle(t, protos, "kvbm_leader_new", leaderOpts)
	defer freeTestHandle("leader", hd)
	call := func(r transferTimings) callResult {
		b, err := msgpack.Marshal(r)
		require.NoError(t, err)
		return invoke(t, protos["kvbm_leader_transfer_timings"], kvbm_leader_transfer_timings, cCall{"hd": hd, "buf": b})
	}
	measured := func() uint64 {
		fn := reflect.ValueOf(leaderOf) // no cgo in tests: the handle type by reflection
		out := fn.Call([]reflect.Value{reflect.ValueOf(hd).Convert(fn.Type().In(0))})
		defer out[1].Interface().(func())()
		require.Nil(t, out[2].Interface())
		return out[0].Interface().(*leaderHandle).l.CostModel().Snapshot().Measured[plan.G3]
	}
	ts := []policy.Timing{{Dir: "g3_to_g1", Bytes: 1 << 20, Seconds: 0.002}, {Dir: "g1_to_g2", Bytes: 1 << 20, Seconds: 0.001}}
	require.Equal(t, statusOK, call(transferTimings{Pid: os.Getpid(), Timings: ts}).rc)
	require.Zero(t, measured(), "this process's workers are heard directly")
	require.Equal(t, statusOK, call(transferTimings{Pid: os.Getpid() + 1, Timings: ts}).rc)
	require.Equal(t, uint64(1), measured(), "one load batch; the save is not a measurement")
	r := invoke(t, protos["kvbm_leader_transfer_timings"], kvbm_leader_transfer_timings, cCall{"hd": hd, "buf": []byte{0xc1}})
	require.Equal(t, statusInvalid, r.rc, "%s", r)
}
