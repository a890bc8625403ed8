//go:build cuda

package cuda

/*
#cgo LDFLAGS: -lcuda
#include <cuda.h>
#include <stdint.h>
#include <stdlib.h>

// What gorgonia.org/cu lacks: page-locking memory we did not allocate,
// mapped pinned allocations, pointer attributes, and event/stream calls on
// raw handles owned by the engine (PyTorch's current stream).

static int kvbm_host_register(uintptr_t p, size_t n, uintptr_t* dev) {
	CUresult r = cuMemHostRegister((void*)p, n, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP);
	if (r != CUDA_SUCCESS) return r;
	CUdeviceptr d = 0;
	r = cuMemHostGetDevicePointer(&d, (void*)p, 0);
	if (r != CUDA_SUCCESS) {
		cuMemHostUnregister((void*)p);
		return r;
	}
	*dev = (uintptr_t)d;
	return CUDA_SUCCESS;
}

static int kvbm_host_unregister(uintptr_t p) { return cuMemHostUnregister((void*)p); }

static int kvbm_host_alloc(size_t n, uintptr_t* host) {
	void* p = 0;
	CUresult r = cuMemHostAlloc(&p, n, CU_MEMHOSTALLOC_PORTABLE);
	*host = (uintptr_t)p;
	return r;
}

static int kvbm_host_free(uintptr_t p) { return cuMemFreeHost((void*)p); }

// kvbm_pointer_device: *ordinal = the device holding p, or -1 when p is not
// device memory (host memory, or an address CUDA does not know).
static int kvbm_pointer_device(uintptr_t p, int* ordinal) {
	unsigned int mt = 0;
	*ordinal = -1;
	CUresult r = cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)p);
	if (r == CUDA_ERROR_INVALID_VALUE) return CUDA_SUCCESS; // not a CUDA allocation
	if (r != CUDA_SUCCESS) return r;
	if (mt != CU_MEMORYTYPE_DEVICE) return CUDA_SUCCESS;
	return cuPointerGetAttribute(ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, (CUdeviceptr)p);
}

// kvbm_fence: record ev on the engine's stream, make n of ours wait for it.
static int kvbm_fence(uintptr_t ev, uintptr_t engine, const uintptr_t* streams, int n) {
	CUresult r = cuEventRecord((CUevent)ev, (CUstream)engine);
	for (int i = 0; r == CUDA_SUCCESS && i < n; i++) r = cuStreamWaitEvent((CUstream)streams[i], (CUevent)ev, 0);
	return r;
}

static const char* kvbm_cu_error(int r) {
	const char* s = 0;
	if (cuGetErrorString((CUresult)r, &s) != CUDA_SUCCESS || s == 0) return "unknown CUDA error";
	return s;
}
*/
import "C"

import (
	"fmt"
	"unsafe"

	"gorgonia.org/cu"
)

// getenv reads the process environment as C sees it: a Go c-shared library
// keeps the copy it took at load time in os.Getenv, which misses variables
// the host process (Python) set afterwards.
func getenv(name string) string {
	cs := C.CString(name)
	defer C.free(unsafe.Pointer(cs))
	if v := C.getenv(cs); v != nil {
		return C.GoString(v)
	}
	return ""
}

func cuErr(what string, r C.int) error {
	if r == 0 {
		return nil
	}
	return fmt.Errorf("%s: CUDA error %d: %s", what, int(r), C.GoString(C.kvbm_cu_error(r)))
}

// DeviceOf reports which GPU holds address p, or -1 when p is not device
// memory (a CPU tensor). It needs no current context.
func DeviceOf(p uintptr) (int, error) {
	var ord C.int
	if err := cuErr("cuPointerGetAttribute", C.kvbm_pointer_device(C.uintptr_t(p), &ord)); err != nil {
		return -1, err
	}
	return int(ord), nil
}

// hostRegister page-locks [p, p+n) and maps it for the device; dev is the
// address kernels use for p.
func hostRegister(p uintptr, n int64) (dev uintptr, err error) {
	var d C.uintptr_t
	err = cuErr(fmt.Sprintf("cuMemHostRegister(%#x, %d bytes)", p, n), C.kvbm_host_register(C.uintptr_t(p), C.size_t(n), &d))
	return uintptr(d), err
}

func hostUnregister(p uintptr) error {
	return cuErr("cuMemHostUnregister", C.kvbm_host_unregister(C.uintptr_t(p)))
}

// hostAlloc allocates n bytes of page-locked host memory.
func hostAlloc(n int64) (uintptr, error) {
	var p C.uintptr_t
	err := cuErr(fmt.Sprintf("cuMemHostAlloc(%d bytes)", n), C.kvbm_host_alloc(C.size_t(n), &p))
	return uintptr(p), err
}

func hostFree(p uintptr) error { return cuErr("cuMemFreeHost", C.kvbm_host_free(C.uintptr_t(p))) }

// rawStream and rawEvent expose the driver handles inside cu's wrappers
// (single-pointer structs) for the calls cu does not offer on raw handles.
func rawStream(s *cu.Stream) uintptr { return *(*uintptr)(unsafe.Pointer(s)) }
func rawEvent(e *cu.Event) uintptr   { return *(*uintptr)(unsafe.Pointer(e)) }

// fence records ev on the engine stream and makes every one of streams wait for it.
func fence(ev, engine uintptr, streams ...uintptr) error {
	cs := make([]C.uintptr_t, len(streams))
	for i, s := range streams {
		cs[i] = C.uintptr_t(s)
	}
	return cuErr("fence on the engine stream", C.kvbm_fence(C.uintptr_t(ev), C.uintptr_t(engine), &cs[0], C.int(len(cs))))
}
