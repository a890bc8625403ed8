package main

/*
#include "kvbm.h"
*/
import "C"

import (
	"encoding/json"
	"runtime"
)

// buildVariant names what this build's workers can copy G1 from: "host"
// (KV cache tensors in host memory) or "cuda" (also GPU memory; set by
// buildinfo_cuda.go). The adapters ask the loaded library for it, so a
// library loaded through KVBM_LIBRARY under any file name is judged by what
// it is, not by its name.
var buildVariant = "host"

// buildInfo is kvbm_build_info's answer (BuildInfo in python/kvbm/_native.py).
type buildInfo struct {
	Variant string `json:"variant"`
	Version string `json:"version"`
	Go      string `json:"go"`
}

// kvbm_build_info answers JSON describing this build: its variant, version
// and Go release. No handle; it works on a poisoned library too (it only
// reports constants).
//
//export kvbm_build_info
func kvbm_build_info(out **C.uint8_t, outLen *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	if err := checkOut("kvbm_build_info", ptr(out), ptr(outLen)); err != nil {
		return finish(err, errOut)
	}
	b, _ := json.Marshal(buildInfo{Variant: buildVariant, Version: version, Go: runtime.Version()}) // strings only: cannot fail
	cBuffer(b, out, outLen)
	return statusOK
}
