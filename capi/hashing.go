package main

/*
#include "kvbm.h"
*/
import "C"

import (
	"errors"
	"unsafe"

	"github.com/kvbm/kvbm/goext/hashing"
)

const version = "0.1.0"

var cVersion = C.CString(version)

//export kvbm_version
func kvbm_version() *C.char {
	defer guardVoid()
	return cVersion
}

func tokensView(p *C.uint32_t, n C.int64_t) []uint32 {
	if p == nil || n <= 0 {
		return nil
	}
	return unsafe.Slice((*uint32)(unsafe.Pointer(p)), int(n))
}

// kvbm_salt_hash computes the KVBM salt hash of design §3 (cache salt and LoRA
// name, each optional).
//
//export kvbm_salt_hash
func kvbm_salt_hash(salt *C.char, hasSalt C.int, lora *C.char, hasLora C.int, out *C.uint64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	if err := healthy(); err != nil {
		return finish(err, errOut)
	}
	if err := checkOut("kvbm_salt_hash", ptr(out)); err != nil {
		return finish(err, errOut)
	}
	var s, l string
	if hasSalt != 0 && salt != nil {
		s = C.GoString(salt)
	}
	if hasLora != 0 && lora != nil {
		l = C.GoString(lora)
	}
	*out = C.uint64_t(hashing.SaltHash(s, hasSalt != 0, l, hasLora != 0))
	return statusOK
}

// kvbm_sequence_hashes writes the KVBM sequence hash of every full block of
// tokens into out (capacity outCap) and the count into outN.
//
//export kvbm_sequence_hashes
func kvbm_sequence_hashes(tokens *C.uint32_t, n C.int64_t, blockSize C.int64_t, salt C.uint64_t,
	out *C.uint64_t, outCap C.int64_t, outN *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	if err := healthy(); err != nil {
		return finish(err, errOut)
	}
	if err := hashArgs("kvbm_sequence_hashes", tokens, n, blockSize, out, outCap, outN); err != nil {
		return finish(err, errOut)
	}
	full := int64(n) / int64(blockSize)
	dst := unsafe.Slice((*uint64)(unsafe.Pointer(out)), int(full))[:0]
	res := hashing.SequenceHashes(tokensView(tokens, n), int(blockSize), uint64(salt), dst)
	*outN = C.int64_t(len(res))
	return statusOK
}

// kvbm_router_hashes writes the router sequence hashes (design §3, seed 1337) of
// every full block of tokens.
//
//export kvbm_router_hashes
func kvbm_router_hashes(tokens *C.uint32_t, n C.int64_t, blockSize C.int64_t, lora *C.char,
	out *C.uint64_t, outCap C.int64_t, outN *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	if err := healthy(); err != nil {
		return finish(err, errOut)
	}
	if err := hashArgs("kvbm_router_hashes", tokens, n, blockSize, out, outCap, outN); err != nil {
		return finish(err, errOut)
	}
	full := int64(n) / int64(blockSize)
	var l string
	if lora != nil {
		l = C.GoString(lora)
	}
	res := hashing.RouterSequenceHashes(tokensView(tokens, n), int(blockSize), l)
	copy(unsafe.Slice((*uint64)(unsafe.Pointer(out)), int(full)), res)
	*outN = C.int64_t(len(res))
	return statusOK
}

// hashArgs checks the arguments of the sequence-hash exports: the token
// array, the block size, the output array (large enough for the full
// blocks) and the count.
func hashArgs(fn string, tokens *C.uint32_t, n, blockSize C.int64_t, out *C.uint64_t, outCap C.int64_t, outN *C.int64_t) error {
	if blockSize <= 0 {
		return errorf(statusInvalid, "%s: block_size must be positive, got %d", fn, int64(blockSize))
	}
	if err := errors.Join(checkIn(fn, "token array", unsafe.Pointer(tokens), n),
		checkIn(fn, "output array", unsafe.Pointer(out), outCap)); err != nil {
		return withCode(statusInvalid, err)
	}
	if full := int64(n) / int64(blockSize); int64(outCap) < full {
		return errorf(statusInvalid, "%s: output capacity %d < %d blocks", fn, int64(outCap), full)
	}
	if outN == nil {
		return errorf(statusInvalid, "%s: null output count", fn)
	}
	return nil
}
