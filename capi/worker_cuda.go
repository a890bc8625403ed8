//go:build cuda

package main

/*
#include "kvbm.h"
*/
import "C"

import (
	"time"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/cuda"
	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/worker"
)

func init() {
	newDeviceCopier = func(eng *layout.Engine, cfg *config.Config) (worker.G1Copier, error) {
		ord, err := cuda.DeviceOf(eng.Base(0))
		if err != nil {
			return nil, err
		}
		if ord < 0 {
			return nil, nil // CPU tensors: the plain host copies
		}
		k := cfg.CUDA
		mode, err := cuda.ParseMode(k.Copy)
		if err != nil {
			return nil, err
		}
		c, err := cuda.New(eng, cuda.Options{Mode: mode, StagingBytes: k.StagingBytes, PipelineDepth: k.PipelineDepth,
			StagedCTAs: k.StagedCTAs, StagedThreads: k.StagedThreads, StagedLowPriority: k.StagedLowPriority,
			DMAStreams: k.DMAStreams, SplitPercent: k.SplitPercent, SplitChunkBytes: k.SplitChunkBytes,
			SplitStreams: k.SplitStreams, SplitProbe: time.Duration(k.SplitProbeMicros) * time.Microsecond,
			SplitBusyBatch: k.SplitBusyBatch, KernelsFile: k.KernelsFile})
		if err != nil {
			return nil, err
		}
		return c, nil
	}
}

// kvbm_worker_set_cuda_stream names the engine's CUDA stream (a
// cudaStream_t, e.g. torch.cuda.current_stream().cuda_stream; 0 is the
// legacy default stream). The worker's saves start after the work queued on
// it when WaitForSave is called, and its loads after the work queued when
// StartLoad is called. A worker whose KV caches are host memory ignores it.
//
//export kvbm_worker_set_cuda_stream
func kvbm_worker_set_cuda_stream(hd C.uint64_t, stream C.uint64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := workerOf(hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if c, ok := h.G1.(*cuda.Copier); ok {
		c.SetEngineStream(uintptr(stream))
	}
	return statusOK
}
