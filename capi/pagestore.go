package main

/*
#include "kvbm.h"
*/
import "C"

import (
	"encoding/json"
	"math"
	"unsafe"

	"github.com/kvbm/kvbm/goext/node"
	"github.com/kvbm/kvbm/goext/pagestore"
)

// The page store (goext/pagestore) behind the SGLang HiCache backend
// (python/kvbm/sglang_integration): pages keyed by SGLang's own key strings,
// held in the disk tier. Keys cross the ABI as one byte buffer and the end
// offset of each key in it; pages as (address, length) segments of host
// memory (SGLang's host pool, CPU) that the call reads or fills: a strided
// page (page-first: a K and a V half; layer-first: one piece per layer and
// half) is gathered or scattered by the one copy to or from the tier's
// aligned I/O buffer, with no staging copy in Python.

type pagestoreHandle struct {
	lifetime
	s      *pagestore.Store
	n      *node.PageStore
	events bool // pages carry SGLang's event hashes to a consolidator
}

type pagestoreOptions struct {
	// Identity: what makes two pages of one SGLang key interchangeable
	// (model, parallel layout, page layout, dtype); hashed into the
	// fingerprint that names the tier file and salts every key.
	Identity  string            `json:"identity"`
	PageBytes int64             `json:"page_bytes"`
	Rank      int               `json:"rank"`
	Env       map[string]string `json:"env"`
	// Share is the fraction of the disk tier's size (DYN_KVBM_DISK_CACHE_GB
	// or _OVERRIDE_NUM_BLOCKS) this store gets, in (0, 1]; 0: all of it.
	// SGLang's hybrid models store one pool per store and split the size.
	Share float64 `json:"share"`
	// Pool labels the store's counters on kvbm's metrics endpoint
	// (DYN_KVBM_METRICS); "": "kv".
	Pool string `json:"pool"`
	// Consolidator, when not 0, is a consolidator handle
	// (kvbm_consolidator_new, engine "sglang") that receives the store's
	// pages as disk tier events named by SGLang's event hash of each key
	// (pagestore.SGLangEventHash).
	Consolidator uint64 `json:"consolidator"`
}

//export kvbm_pagestore_new
func kvbm_pagestore_new(optsJSON *C.char, out *C.uint64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	const fn = "kvbm_pagestore_new"
	if err := healthy(); err != nil {
		return finish(err, errOut)
	}
	if err := checkOut(fn, ptr(out)); err != nil {
		return finish(err, errOut)
	}
	if optsJSON == nil {
		return finish(errorf(statusInvalid, "%s: null options", fn), errOut)
	}
	var o pagestoreOptions
	if err := parseOptions(fn, optsJSON, &o); err != nil {
		return finish(err, errOut)
	}
	switch {
	case o.Identity == "":
		return finish(errorf(statusInvalid, "%s: options: empty identity", fn), errOut)
	case o.PageBytes <= 0:
		return finish(errorf(statusInvalid, "%s: options: page_bytes=%d, must be > 0", fn, o.PageBytes), errOut)
	case o.Rank < 0:
		return finish(errorf(statusInvalid, "%s: options: rank=%d, must be >= 0", fn, o.Rank), errOut)
	case math.IsNaN(o.Share) || o.Share < 0 || o.Share > 1:
		return finish(errorf(statusInvalid, "%s: options: share=%g, must be in (0, 1]", fn, o.Share), errOut)
	}
	if o.Pool == "" {
		o.Pool = "kv"
	}
	cfg, err := configFor(o.Env, false)
	if err != nil {
		return finish(err, errOut)
	}
	spec := node.PageStoreSpec{Identity: o.Identity, PageBytes: o.PageBytes, Rank: o.Rank, Share: o.Share, Pool: o.Pool}
	if o.Consolidator != 0 {
		c, done, err := acquire[*consolidatorHandle](C.uint64_t(o.Consolidator))
		if err != nil {
			done()
			return finish(err, errOut)
		}
		spec.Events = c.c // a closed consolidator ignores events: no lifetime tie needed
		done()
	}
	n, err := node.NewPageStore(cfg, spec, fn, nodeDeps())
	if err != nil {
		return finish(err, errOut)
	}
	*out = newHandle(&pagestoreHandle{s: n.S, n: n, events: o.Consolidator != 0})
	return statusOK
}

//export kvbm_pagestore_free
func kvbm_pagestore_free(hd C.uint64_t) {
	defer guardVoid()
	freeHook()
	freeHandle(hd, nil, func(h *pagestoreHandle) { h.n.Close() })
}

//export kvbm_pagestore_info
func kvbm_pagestore_info(hd C.uint64_t, out **C.uint8_t, outLen *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	const fn = "kvbm_pagestore_info"
	if err := checkOut(fn, ptr(out), ptr(outLen)); err != nil {
		return finish(err, errOut)
	}
	h, done, err := acquire[*pagestoreHandle](hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	b, err := json.Marshal(h.s.Stats())
	if err != nil {
		return finish(err, errOut)
	}
	cBuffer(b, out, outLen)
	return statusOK
}

// pageKeys splits the key buffer at ends (each key's end offset) and maps
// every key to the store's.
func pageKeys(fn string, s *pagestore.Store, keys unsafe.Pointer, keysLen C.int64_t, ends *C.int64_t, n C.int64_t) ([]pagestore.Key, error) {
	ks, _, err := pageKeysExt(fn, s, keys, keysLen, ends, n, false)
	return ks, err
}

// pageKeysExt is pageKeys that also gives each key's SGLang event hash
// when withExt.
func pageKeysExt(fn string, s *pagestore.Store, keys unsafe.Pointer, keysLen C.int64_t, ends *C.int64_t, n C.int64_t,
	withExt bool) ([]pagestore.Key, []pagestore.Ext, error) {
	if err := checkIn(fn, "keys", keys, keysLen); err != nil {
		return nil, nil, err
	}
	if err := checkIn(fn, "key_ends", unsafe.Pointer(ends), n); err != nil {
		return nil, nil, err
	}
	buf := goBytes(keys, keysLen)
	var endv []C.int64_t
	if n > 0 {
		endv = unsafe.Slice(ends, int(n))
	}
	out := make([]pagestore.Key, len(endv))
	var exts []pagestore.Ext
	if withExt {
		exts = make([]pagestore.Ext, len(endv))
	}
	start := int64(0)
	for i, e := range endv {
		if int64(e) < start || int64(e) > int64(keysLen) {
			return nil, nil, errorf(statusInvalid, "%s: key_ends[%d]=%d outside [%d, %d]", fn, i, int64(e), start, int64(keysLen))
		}
		out[i] = s.Key(buf[start:int64(e)])
		if withExt {
			exts[i] = pagestore.SGLangEventHash(buf[start:int64(e)])
		}
		start = int64(e)
	}
	return out, exts, nil
}

// pageSegs views the pages: segs holds (address, length) pairs, page i is
// segments [page_ends[i-1], page_ends[i]) (in pairs), in order; a page's
// lengths add up to the store's page size.
func pageSegs(fn string, s *pagestore.Store, segs *C.uint64_t, segsLen C.int64_t, ends *C.int64_t, endsLen C.int64_t,
	want int) ([]pagestore.Page, error) {
	if err := checkIn(fn, "segs", unsafe.Pointer(segs), segsLen); err != nil {
		return nil, err
	}
	if err := checkIn(fn, "page_ends", unsafe.Pointer(ends), endsLen); err != nil {
		return nil, err
	}
	if segsLen%2 != 0 {
		return nil, errorf(statusInvalid, "%s: segs_len=%d: (address, length) pairs", fn, int64(segsLen))
	}
	if int(endsLen) != want {
		return nil, errorf(statusInvalid, "%s: %d pages for %d keys", fn, int64(endsLen), want)
	}
	var sv []C.uint64_t
	if segsLen > 0 {
		sv = unsafe.Slice(segs, int(segsLen))
	}
	var ev []C.int64_t
	if endsLen > 0 {
		ev = unsafe.Slice(ends, int(endsLen))
	}
	out := make([]pagestore.Page, len(ev))
	start := int64(0)
	for i, e := range ev {
		end := int64(e)
		if end < start || end > int64(segsLen)/2 {
			return nil, errorf(statusInvalid, "%s: page_ends[%d]=%d outside [%d, %d]", fn, i, end, start, int64(segsLen)/2)
		}
		total := int64(0)
		page := make(pagestore.Page, 0, end-start)
		for j := start; j < end; j++ {
			addr, n := uintptr(sv[2*j]), uint64(sv[2*j+1])
			if addr == 0 || n == 0 || n > uint64(s.PageBytes()) {
				return nil, errorf(statusInvalid, "%s: page %d: segment %d: address %#x, %d bytes", fn, i, j, addr, n)
			}
			total += int64(n)
			p := *(*unsafe.Pointer)(unsafe.Pointer(&addr)) // C memory: outside Go's heap
			page = append(page, unsafe.Slice((*byte)(p), int(n)))
		}
		if total != s.PageBytes() {
			return nil, errorf(statusInvalid, "%s: page %d has %d bytes, the store's pages have %d", fn, i, total, s.PageBytes())
		}
		out[i] = page
		start = end
	}
	return out, nil
}

func pageOK(fn string, ok []bool, out *C.uint8_t, outCap C.int64_t) error {
	if err := checkIn(fn, "out_ok", unsafe.Pointer(out), outCap); err != nil {
		return err
	}
	if int(outCap) < len(ok) {
		return errorf(statusInvalid, "%s: out_ok holds %d results, want %d", fn, int64(outCap), len(ok))
	}
	if len(ok) == 0 {
		return nil
	}
	dst := unsafe.Slice((*byte)(unsafe.Pointer(out)), len(ok))
	for i, v := range ok {
		dst[i] = 0
		if v {
			dst[i] = 1
		}
	}
	return nil
}

// pageIO is the body of kvbm_pagestore_put and _get.
func pageIO(fn string, h *pagestoreHandle, keys unsafe.Pointer, keysLen C.int64_t, ends *C.int64_t, n C.int64_t,
	segs *C.uint64_t, segsLen C.int64_t, pageEnds *C.int64_t, pagesLen C.int64_t, outOK *C.uint8_t, outCap C.int64_t,
	put bool) error {
	if err := checkIn(fn, "out_ok", unsafe.Pointer(outOK), outCap); err != nil {
		return err
	}
	ks, exts, err := pageKeysExt(fn, h.s, keys, keysLen, ends, n, h.events)
	if err != nil {
		return err
	}
	if int(outCap) < len(ks) { // before any I/O
		return errorf(statusInvalid, "%s: out_ok holds %d results, want %d", fn, int64(outCap), len(ks))
	}
	bufs, err := pageSegs(fn, h.s, segs, segsLen, pageEnds, pagesLen, len(ks))
	if err != nil {
		return err
	}
	var ok []bool
	if put {
		ok, err = h.s.PutExt(ks, exts, bufs)
	} else {
		ok, err = h.s.GetExt(ks, exts, bufs)
	}
	if err != nil {
		return withCode(statusIO, err)
	}
	return pageOK(fn, ok, outOK, outCap)
}

//export kvbm_pagestore_put
func kvbm_pagestore_put(hd C.uint64_t, keys unsafe.Pointer, keysLen C.int64_t, keyEnds *C.int64_t, n C.int64_t,
	segs *C.uint64_t, segsLen C.int64_t, pageEnds *C.int64_t, pagesLen C.int64_t, outOK *C.uint8_t, outCap C.int64_t,
	errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := acquire[*pagestoreHandle](hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	return finish(pageIO("kvbm_pagestore_put", h, keys, keysLen, keyEnds, n, segs, segsLen, pageEnds, pagesLen, outOK, outCap,
		true), errOut)
}

//export kvbm_pagestore_get
func kvbm_pagestore_get(hd C.uint64_t, keys unsafe.Pointer, keysLen C.int64_t, keyEnds *C.int64_t, n C.int64_t,
	segs *C.uint64_t, segsLen C.int64_t, pageEnds *C.int64_t, pagesLen C.int64_t, outOK *C.uint8_t, outCap C.int64_t,
	errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := acquire[*pagestoreHandle](hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	return finish(pageIO("kvbm_pagestore_get", h, keys, keysLen, keyEnds, n, segs, segsLen, pageEnds, pagesLen, outOK, outCap,
		false), errOut)
}

// kvbm_pagestore_exists: *out_hits is how many keys, from the first, the
// store holds (HiCache's batch_exists).
//
//export kvbm_pagestore_exists
func kvbm_pagestore_exists(hd C.uint64_t, keys unsafe.Pointer, keysLen C.int64_t, keyEnds *C.int64_t, n C.int64_t,
	outHits *C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	const fn = "kvbm_pagestore_exists"
	if err := checkOut(fn, ptr(outHits)); err != nil {
		return finish(err, errOut)
	}
	h, done, err := acquire[*pagestoreHandle](hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	ks, err := pageKeys(fn, h.s, keys, keysLen, keyEnds, n)
	if err != nil {
		return finish(err, errOut)
	}
	*outHits = C.int64_t(h.s.Exists(ks))
	return statusOK
}

// kvbm_pagestore_has: out_ok[i] = 1 where the store holds key i (the disk
// tier, else the object tier), key by key (HiCache's v2 hit policies).
//
//export kvbm_pagestore_has
func kvbm_pagestore_has(hd C.uint64_t, keys unsafe.Pointer, keysLen C.int64_t, keyEnds *C.int64_t, n C.int64_t,
	outOK *C.uint8_t, outCap C.int64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	const fn = "kvbm_pagestore_has"
	h, done, err := acquire[*pagestoreHandle](hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	if err := checkIn(fn, "out_ok", unsafe.Pointer(outOK), outCap); err != nil {
		return finish(err, errOut)
	}
	ks, err := pageKeys(fn, h.s, keys, keysLen, keyEnds, n)
	if err != nil {
		return finish(err, errOut)
	}
	if int(outCap) < len(ks) {
		return finish(errorf(statusInvalid, "%s: out_ok holds %d results, want %d", fn, int64(outCap), len(ks)), errOut)
	}
	return finish(pageOK(fn, h.s.Has(ks), outOK, outCap), errOut)
}

//export kvbm_pagestore_clear
func kvbm_pagestore_clear(hd C.uint64_t, errOut **C.char) (rc C.int) {
	defer guard(&rc, errOut)
	h, done, err := acquire[*pagestoreHandle](hd)
	defer done()
	if err != nil {
		return finish(err, errOut)
	}
	return finish(withCode(statusIO, h.s.Clear()), errOut)
}
