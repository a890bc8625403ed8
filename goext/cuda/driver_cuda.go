//go:build cuda

package cuda

/*
#cgo LDFLAGS: -lcuda
#include <cuda.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

// The driver's batched copy (CUDA >= 12.8), looked up at run time so that
// this file still builds against CUDA 11 headers and loads on older drivers.
// Types as in CUDA 12.8's cuda.h (cuMemcpyBatchAsync, 12.8 ABI with failIdx).
typedef struct { int type; int id; } kvbm_memloc;
typedef struct {
	int srcAccessOrder;     // CUmemcpySrcAccessOrder
	kvbm_memloc srcLocHint; // CUmemLocation
	kvbm_memloc dstLocHint;
	unsigned int flags;
} kvbm_memcpy_attrs;
typedef CUresult (*kvbm_batch_fn)(CUdeviceptr*, CUdeviceptr*, size_t*, size_t, kvbm_memcpy_attrs*, size_t*, size_t, size_t*, CUstream);
static kvbm_batch_fn kvbm_batch = 0;
static int kvbm_batch_hints = 1;

static int kvbm_batch_init(void) {
	if (kvbm_batch) return CUDA_SUCCESS;
	int v = 0;
	CUresult r = cuDriverGetVersion(&v);
	if (r != CUDA_SUCCESS) return r;
	if (v < 12080) return CUDA_ERROR_NOT_SUPPORTED;
	void* p = 0;
	r = cuGetProcAddress("cuMemcpyBatchAsync", &p, 12080, 0);
	if (r != CUDA_SUCCESS) return r;
	if (!p) return CUDA_ERROR_NOT_FOUND;
	kvbm_batch = (kvbm_batch_fn)p;
	return CUDA_SUCCESS;
}

// kvbm_memcpy_batch: n copies in stream order; to_dev: host → device.
static int kvbm_memcpy_batch(uint64_t* dsts, uint64_t* srcs, uint64_t* sizes, size_t n, int to_dev, int ordinal, uintptr_t stream) {
	kvbm_memcpy_attrs a;
	memset(&a, 0, sizeof a);
	a.srcAccessOrder = 1; // CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
	a.flags = 1;          // CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
	if (kvbm_batch_hints) {
		kvbm_memloc dev = {1, ordinal}, host = {2, 0}; // CU_MEM_LOCATION_TYPE_DEVICE, _HOST
		a.srcLocHint = to_dev ? host : dev;
		a.dstLocHint = to_dev ? dev : host;
	}
	size_t idx = 0, fail = 0;
	CUresult r = kvbm_batch((CUdeviceptr*)dsts, (CUdeviceptr*)srcs, (size_t*)sizes, n, &a, &idx, 1, &fail, (CUstream)stream);
	if (r == CUDA_ERROR_INVALID_VALUE && kvbm_batch_hints) {
		kvbm_batch_hints = 0; // a driver that rejects the hints: go without
		return kvbm_memcpy_batch(dsts, srcs, sizes, n, to_dev, ordinal, stream);
	}
	return r;
}

// The driver's batched 3D copy (CUDA >= 12.8, 12.8 ABI with failIdx), for
// one pitched copy per block: rows of a block's pieces across layers (and
// K/V) on the G1 side, contiguous on the host side. Types as in CUDA 12.8's
// cuda.h (CUDA_MEMCPY3D_BATCH_OP: 112 bytes; checked below).
typedef struct {
	int type;          // CUmemcpy3DOperandType: 1 = pointer
	int pad_;
	uint64_t ptr;      // CUdeviceptr
	size_t rowLength;  // bytes between rows
	size_t layerHeight; // rows between layers
	kvbm_memloc locHint;
} kvbm_operand;
typedef struct {
	kvbm_operand src, dst;
	size_t width, height, depth; // CUextent3D: bytes, rows, layers
	int srcAccessOrder;
	unsigned int flags;
} kvbm_batch3d_op;
typedef char kvbm_batch3d_op_size_check[sizeof(kvbm_batch3d_op) == 112 ? 1 : -1];
typedef char kvbm_operand_size_check[sizeof(kvbm_operand) == 40 ? 1 : -1];
typedef CUresult (*kvbm_batch3d_fn)(size_t, kvbm_batch3d_op*, size_t*, unsigned long long, CUstream);
static kvbm_batch3d_fn kvbm_batch3d = 0;

static int kvbm_batch3d_init(void) {
	if (kvbm_batch3d) return CUDA_SUCCESS;
	int v = 0;
	CUresult r = cuDriverGetVersion(&v);
	if (r != CUDA_SUCCESS) return r;
	if (v < 12080) return CUDA_ERROR_NOT_SUPPORTED;
	void* p = 0;
	r = cuGetProcAddress("cuMemcpy3DBatchAsync", &p, 12080, 0);
	if (r != CUDA_SUCCESS) return r;
	if (!p) return CUDA_ERROR_NOT_FOUND;
	kvbm_batch3d = (kvbm_batch3d_fn)p;
	return CUDA_SUCCESS;
}

// kvbm_memcpy_batch3d: n pitched copies in stream order, copy i between
// g1[i] (rows g1_row apart, g1_layer rows a layer) and host[i] (rows of
// width bytes back to back), width × height × depth; to_dev: host → G1.
static int kvbm_memcpy_batch3d(uint64_t* g1, uint64_t* host, size_t n, int to_dev, int ordinal,
		size_t width, size_t height, size_t depth, size_t g1_row, size_t g1_layer, uintptr_t stream) {
	kvbm_operand dev, hst;
	memset(&dev, 0, sizeof dev);
	memset(&hst, 0, sizeof hst);
	dev.type = hst.type = 1; // CU_MEMCPY_OPERAND_TYPE_POINTER
	dev.rowLength = g1_row;
	dev.layerHeight = g1_layer;
	dev.locHint.type = 1; // CU_MEM_LOCATION_TYPE_DEVICE
	dev.locHint.id = ordinal;
	hst.rowLength = width;
	hst.layerHeight = height;
	hst.locHint.type = 2; // CU_MEM_LOCATION_TYPE_HOST
	// The driver reads the descriptors during the call only.
	kvbm_batch3d_op* ops = (kvbm_batch3d_op*)malloc(n * sizeof *ops);
	if (!ops) return CUDA_ERROR_OUT_OF_MEMORY;
	for (size_t i = 0; i < n; i++) {
		kvbm_batch3d_op* o = &ops[i];
		memset(o, 0, sizeof *o);
		dev.ptr = g1[i];
		hst.ptr = host[i];
		o->src = to_dev ? hst : dev;
		o->dst = to_dev ? dev : hst;
		o->width = width;
		o->height = height;
		o->depth = depth;
		o->srcAccessOrder = 1; // CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
		o->flags = 1;          // CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
	}
	size_t fail = 0;
	CUresult r = kvbm_batch3d(n, ops, &fail, 0, (CUstream)stream);
	free(ops);
	return r;
}

// kvbm_event_done: 1 when every work recorded before ev finished, 0 while
// some is pending, -r on an error.
static int kvbm_event_done(uintptr_t ev) {
	CUresult r = cuEventQuery((CUevent)ev);
	if (r == CUDA_SUCCESS) return 1;
	if (r == CUDA_ERROR_NOT_READY) return 0;
	return -(int)r;
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

func cuErr(what string, r C.int) error {
	if r == 0 {
		return nil
	}
	// errprefix: wrapped by the copier's errors; DeviceOf, Fence and Close add it too
	return fmt.Errorf("%s: CUDA error %d: %s", what, int(r), C.GoString(C.kvbm_cu_error(r)))
}

// DeviceOf reports which GPU holds address p, or -1 when p is not device
// memory (a CPU tensor). It needs no current context.
func DeviceOf(p uintptr) (int, error) {
	var ord C.int
	if err := cuErr("cuPointerGetAttribute", C.kvbm_pointer_device(C.uintptr_t(p), &ord)); err != nil {
		return -1, fmt.Errorf("cuda: %w", err)
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

// eventDone reports whether the work recorded before ev has finished.
func eventDone(ev *cu.Event) (bool, error) {
	r := C.kvbm_event_done(C.uintptr_t(rawEvent(ev)))
	if r < 0 {
		return false, cuErr("cuEventQuery", -r)
	}
	return r == 1, nil
}

// fence records ev on the engine stream and makes every one of streams wait for it.
func fence(ev, engine uintptr, streams ...uintptr) error {
	cs := make([]C.uintptr_t, len(streams))
	for i, s := range streams {
		cs[i] = C.uintptr_t(s)
	}
	return cuErr("fence on the engine stream", C.kvbm_fence(C.uintptr_t(ev), C.uintptr_t(engine), &cs[0], C.int(len(cs))))
}

// batchInit looks up cuMemcpyBatchAsync; an error means the driver has none.
func batchInit() error {
	return cuErr("cuMemcpyBatchAsync (CUDA >= 12.8 driver)", C.kvbm_batch_init())
}

// batch3DInit looks up cuMemcpy3DBatchAsync; an error means the driver has none.
func batch3DInit() error {
	return cuErr("cuMemcpy3DBatchAsync (CUDA >= 12.8 driver)", C.kvbm_batch3d_init())
}

// pitch describes one pitched copy per block (see Copier.pitched): width
// bytes per row, height rows per layer (g1Row bytes apart in G1), depth
// layers (g1Layer rows apart in G1); the host side is contiguous.
type pitch struct {
	width, height, depth, g1Row, g1Layer uint64
}

// memcpyBatch3D enqueues one pitched copy per entry on stream s.
func memcpyBatch3D(g1, host []uint64, p pitch, toDev bool, ordinal int, s uintptr) error {
	td := C.int(0)
	if toDev {
		td = 1
	}
	return cuErr("cuMemcpy3DBatchAsync", C.kvbm_memcpy_batch3d((*C.uint64_t)(unsafe.Pointer(&g1[0])), (*C.uint64_t)(unsafe.Pointer(&host[0])), C.size_t(len(g1)), td, C.int(ordinal),
		C.size_t(p.width), C.size_t(p.height), C.size_t(p.depth), C.size_t(p.g1Row), C.size_t(p.g1Layer), C.uintptr_t(s)))
}

// memcpyBatch enqueues len(sizes) copies on stream s (host addresses are
// page-locked, addressed through unified addressing).
func memcpyBatch(dsts, srcs []uint64, sizes []uint64, toDev bool, ordinal int, s uintptr) error {
	td := C.int(0)
	if toDev {
		td = 1
	}
	return cuErr("cuMemcpyBatchAsync", C.kvbm_memcpy_batch((*C.uint64_t)(unsafe.Pointer(&dsts[0])),
		(*C.uint64_t)(unsafe.Pointer(&srcs[0])), (*C.uint64_t)(unsafe.Pointer(&sizes[0])),
		C.size_t(len(sizes)), td, C.int(ordinal), C.uintptr_t(s)))
}
