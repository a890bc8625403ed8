// Package main is kvbm's C ABI, built with -buildmode=c-shared and loaded by
// the Python package through ctypes.
//
// House rules (checked by tests):
//   - Only kvbm_* symbols are exported.
//   - Every export returns an int status (KVBM_OK or an error code) and, on
//     error, a message in *err that the caller frees with kvbm_free_string.
//   - Every export recovers panics: a panic is reported as KVBM_ERR_INTERNAL
//     with its message, the library is marked poisoned, and every later call
//     fails fast with KVBM_ERR_POISONED. A panic never unwinds into the engine.
//   - Go objects reach C only as opaque handles (runtime/cgo.Handle); C never
//     holds a Go pointer. Buffers returned to C are C.malloc'ed and released
//     with kvbm_free_buffer.
//   - Every buffer and output pointer is checked (checkIn, checkOut) before
//     it is used; every export with a handle holds it for the whole call,
//     and its _free waits for those calls (lifetime.go).
package main

/*
#include "kvbm.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"runtime/cgo"
	"runtime/debug"
	"sync/atomic"
	"unsafe"

	"github.com/kvbm/kvbm/goext/node"
)

// Status codes: enum kvbm_status in kvbm.h (python/kvbm/_errors.py maps
// each to an exception class; tests/test_abi.py checks they agree).
const (
	statusOK       = C.KVBM_OK
	statusInvalid  = C.KVBM_ERR_INVALID  // bad argument or input
	statusConfig   = C.KVBM_ERR_CONFIG   // invalid configuration (names the variable)
	statusIO       = C.KVBM_ERR_IO       // file system, network, memory mapping
	statusState    = C.KVBM_ERR_STATE    // unknown handle, call in the wrong state
	statusInternal = C.KVBM_ERR_INTERNAL // a panic was recovered; the library is now poisoned
	statusPoisoned = C.KVBM_ERR_POISONED // an earlier panic poisoned the library
)

// codedError carries a status code to the ABI boundary.
type codedError struct {
	code int
	err  error
}

func (e *codedError) Error() string { return e.err.Error() }
func (e *codedError) Unwrap() error { return e.err }

func withCode(code int, err error) error {
	if err == nil {
		return nil
	}
	return &codedError{code: code, err: err}
}

func errorf(code int, format string, args ...any) error {
	return &codedError{code: code, err: fmt.Errorf(format, args...)}
}

// kindCode is the status of each kind of error the assembly (goext/node) returns.
func kindCode(k node.Kind) int {
	switch k {
	case node.KindConfig:
		return statusConfig
	case node.KindIO:
		return statusIO
	case node.KindState:
		return statusState
	}
	return statusInvalid
}

// poison holds the message of the first recovered panic; empty while healthy.
var poison atomic.Pointer[string]

func setErr(errOut **C.char, msg string) {
	if errOut != nil {
		*errOut = C.CString(msg)
	}
}

// finish converts a Go error into a status code and message.
func finish(err error, errOut **C.char) C.int {
	if err == nil {
		return statusOK
	}
	code := statusInvalid
	var ce *codedError
	if errors.As(err, &ce) {
		code = ce.code
	} else if k, ok := node.KindOf(err); ok {
		code = kindCode(k)
	}
	setErr(errOut, err.Error())
	return C.int(code)
}

// guard must be deferred directly by every export: recover only works in the
// deferred function itself. Exports that return no status (the *_free
// helpers) defer guardVoid instead.
func guard(rc *C.int, errOut **C.char) {
	r := recover()
	if r == nil {
		return
	}
	msg := fmt.Sprintf("kvbm internal error (library poisoned, restart the process): panic: %v\n%s", r, debug.Stack())
	poison.CompareAndSwap(nil, &msg)
	setErr(errOut, msg)
	*rc = statusInternal
}

// guardVoid is guard for exports that return nothing: a panic poisons the
// library (later calls fail with the message) instead of unwinding into C.
func guardVoid() {
	r := recover()
	if r == nil {
		return
	}
	msg := fmt.Sprintf("kvbm internal error (library poisoned, restart the process): panic while freeing: %v\n%s", r, debug.Stack())
	poison.CompareAndSwap(nil, &msg)
}

// freeHook runs inside every *_free export (guarded); debug builds use it to
// prove that a panic there poisons instead of crashing.
var freeHook = func() {}

// healthy is the first check of every export.
func healthy() error {
	if p := poison.Load(); p != nil {
		first := *p
		if i := indexByte(first, '\n'); i >= 0 {
			first = first[:i]
		}
		return errorf(statusPoisoned, "kvbm is poisoned by an earlier internal error; restart the process (%s)", first)
	}
	return nil
}

func indexByte(s string, b byte) int {
	for i := 0; i < len(s); i++ {
		if s[i] == b {
			return i
		}
	}
	return -1
}

// handle resolves an opaque handle to T. An unknown or freed handle is an
// error for the caller, not a panic that poisons the library: cgo.Handle.Value
// panics on one, and handles are never reused, so a freed one stays unknown.
func handle[T any](h C.uint64_t) (v T, err error) {
	var zero T
	if h == 0 {
		return zero, errorf(statusState, "null handle")
	}
	defer func() {
		if recover() != nil {
			v, err = zero, errorf(statusState, "handle %d is unknown or already freed", uint64(h))
		}
	}()
	v, ok := cgo.Handle(uintptr(h)).Value().(T)
	if !ok {
		return zero, errorf(statusState, "handle %d is not a %T", uint64(h), zero)
	}
	return v, nil
}

// live is the usual first step of an export taking a handle: the library is
// healthy and the handle names a T.
func live[T any](h C.uint64_t) (T, error) {
	if err := healthy(); err != nil {
		var zero T
		return zero, err
	}
	return handle[T](h)
}

func newHandle(v any) C.uint64_t { return C.uint64_t(cgo.NewHandle(v)) }

func deleteHandle(h C.uint64_t) {
	if h != 0 {
		cgo.Handle(uintptr(h)).Delete()
	}
}

// maxABILen bounds a length the caller passes with a pointer (elements or
// bytes). The caller's array cannot be measured, but a negative or absurd
// length (an uninitialised or corrupted value) is refused before Go builds a
// slice over it: a slice that long panics, or reads far past the array.
const maxABILen = 1 << 31

// checkIn checks a pointer/length pair (an input buffer, or an output
// array and its capacity): 0 ≤ n ≤ maxABILen, and a non-NULL pointer when
// n > 0. The error names the export, the buffer and the length.
func checkIn(fn, what string, p unsafe.Pointer, n C.int64_t) error {
	var why string
	switch {
	case n < 0:
		why = "negative length"
	case n > maxABILen:
		why = fmt.Sprintf("longer than %d", maxABILen)
	case n > 0 && p == nil:
		why = "null pointer"
	default:
		return nil
	}
	return errorf(statusInvalid, "%s: invalid %s (n=%d: %s)", fn, what, int64(n), why)
}

// checkOut checks that no output pointer is NULL.
func checkOut(fn string, ptrs ...unsafe.Pointer) error {
	for _, p := range ptrs {
		if p == nil {
			return errorf(statusInvalid, "%s: null output pointer", fn)
		}
	}
	return nil
}

// checkReqID checks a request id string.
func checkReqID(fn string, id *C.char) error {
	if id == nil {
		return errorf(statusInvalid, "%s: null request id", fn)
	}
	return nil
}

func ptr[T any](p *T) unsafe.Pointer { return unsafe.Pointer(p) }

// goBytes views C memory as a Go slice without copying; valid only during the call.
func goBytes(p unsafe.Pointer, n C.int64_t) []byte {
	if p == nil || n <= 0 {
		return nil
	}
	return unsafe.Slice((*byte)(p), int(n))
}

// cBuffer copies b into C memory the caller frees with kvbm_free_buffer.
func cBuffer(b []byte, out **C.uint8_t, outLen *C.int64_t) {
	if len(b) == 0 {
		*out = nil
		*outLen = 0
		return
	}
	p := C.malloc(C.size_t(len(b)))
	copy(unsafe.Slice((*byte)(p), len(b)), b)
	*out = (*C.uint8_t)(p)
	*outLen = C.int64_t(len(b))
}

//export kvbm_free_string
func kvbm_free_string(s *C.char) {
	defer guardVoid()
	C.free(unsafe.Pointer(s))
}

//export kvbm_free_buffer
func kvbm_free_buffer(p *C.uint8_t) {
	defer guardVoid()
	C.free(unsafe.Pointer(p))
}

//export kvbm_is_poisoned
func kvbm_is_poisoned() C.int {
	defer guardVoid()
	if poison.Load() != nil {
		return 1
	}
	return 0
}

func main() {}
