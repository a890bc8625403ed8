//go:build kvbm_debug

package main

/*
#include "kvbm.h"
*/
import "C"

// Test-only exports, built with -tags kvbm_debug (make build-debug): they
// prove that a panic becomes an error and poisons the library instead of
// killing the host process. A normal build does not have them.

//export kvbm_debug_panic
func kvbm_debug_panic(errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	if err := healthy(); err != nil {
		return finish(err, errOut)
	}
	var m map[string]int
	m["boom"] = 1 // nil map write: a real runtime panic
	return statusOK
}

// kvbm_debug_panic_in_free makes the next *_free export panic.
//
//export kvbm_debug_panic_in_free
func kvbm_debug_panic_in_free() {
	defer guardVoid()
	freeHook = func() {
		freeHook = func() {}
		var p *int
		_ = *p // nil dereference: a real runtime panic
	}
}
