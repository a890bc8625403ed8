package main

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
)

// pagestoreOpts: a non-persistent store of two 64-byte pages in /tmp (the
// file is removed when the handle is freed).
const pagestoreOpts = `{"identity":"abi-test","page_bytes":64,"env":{"DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS":"2",` +
	`"DYN_KVBM_DISK_DISABLE_O_DIRECT":"true"}}`

// abiPutPage and abiGetPage are the pages the argument checks' valid put
// and get use: separate, since TestFreeRacingCalls runs a put and a get at
// once (a get writes its page while a put reads its own).
var abiPutPage, abiGetPage [64]byte

// pagestoreIO is a valid kvbm_pagestore_put / _get call: one key, "ab", and
// its page.
func pagestoreIO(page *[64]byte) cCall {
	return cCall{"keys": []byte("ab"), "key_ends": []int64{2},
		"segs": []uint64{uint64(uintptr(unsafe.Pointer(&page[0]))), 64}, "page_ends": []int64{1}, "out_ok": make([]byte, 1)}
}

// TestPagestoreRoundTrip: a page put through the ABI (in segments) reads
// back byte-exact under its key string, another key misses, and bad key or
// page offsets, a page size other than the store's or a null segment are
// refused before any memory is touched.
func TestPagestoreRoundTrip(t *testing.T) {
	protos := parseHeader(t)
	h := newTestHandle(t, protos, "kvbm_pagestore_new", pagestoreOpts)
	defer freeTestHandle("pagestore", h)
	src, dst := make([]byte, 64), make([]byte, 64)
	for i := range src {
		src[i] = byte(i*5 + 1)
	}
	addr := func(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(&b[0]))) }
	ok := make([]byte, 2)
	// The page in two segments.
	r := invoke(t, protos["kvbm_pagestore_put"], kvbm_pagestore_put, cCall{"hd": h, "keys": []byte("k1"),
		"key_ends": []int64{2}, "segs": []uint64{addr(src), 10, addr(src[10:]), 54}, "page_ends": []int64{2}, "out_ok": ok})
	require.Equal(t, statusOK, r.rc, "%s", r)
	require.Equal(t, byte(1), ok[0])
	var hits int64
	r = invoke(t, protos["kvbm_pagestore_exists"], kvbm_pagestore_exists, cCall{"hd": h, "keys": []byte("k1k2"),
		"key_ends": []int64{2, 4}, "out_hits": &hits})
	require.Equal(t, statusOK, r.rc, "%s", r)
	require.Equal(t, int64(1), hits)
	r = invoke(t, protos["kvbm_pagestore_get"], kvbm_pagestore_get, cCall{"hd": h, "keys": []byte("k2k1"),
		"key_ends": []int64{2, 4}, "segs": []uint64{addr(make([]byte, 64)), 64, addr(dst), 64}, "page_ends": []int64{1, 2},
		"out_ok": ok})
	require.Equal(t, statusOK, r.rc, "%s", r)
	require.Equal(t, []byte{0, 1}, ok)
	require.Equal(t, src, dst)

	r = invoke(t, protos["kvbm_pagestore_get"], kvbm_pagestore_get, cCall{"hd": h, "keys": []byte("k2"),
		"key_ends": []int64{3}, "segs": []uint64{addr(dst), 64}, "page_ends": []int64{1}, "out_ok": ok})
	require.Equal(t, statusInvalid, r.rc)
	require.Contains(t, r.msg, "key_ends[0]=3")
	r = invoke(t, protos["kvbm_pagestore_get"], kvbm_pagestore_get, cCall{"hd": h, "keys": []byte("k2"),
		"key_ends": []int64{2}, "segs": []uint64{addr(dst), 32}, "page_ends": []int64{1}, "out_ok": ok})
	require.Equal(t, statusInvalid, r.rc)
	require.Contains(t, r.msg, "page 0 has 32 bytes, the store's pages have 64")
	r = invoke(t, protos["kvbm_pagestore_get"], kvbm_pagestore_get, cCall{"hd": h, "keys": []byte("k2"),
		"key_ends": []int64{2}, "segs": []uint64{addr(dst), 64}, "page_ends": []int64{2}, "out_ok": ok})
	require.Equal(t, statusInvalid, r.rc)
	require.Contains(t, r.msg, "page_ends[0]=2")
	r = invoke(t, protos["kvbm_pagestore_get"], kvbm_pagestore_get, cCall{"hd": h, "keys": []byte("k2"),
		"key_ends": []int64{2}, "segs": []uint64{0, 64}, "page_ends": []int64{1}, "out_ok": ok})
	require.Equal(t, statusInvalid, r.rc)
	require.Contains(t, r.msg, "address 0x0")
}

// TestPagestoreNeedsTheDiskTier: without a disk tier size, attach fails
// naming the variable.
func TestPagestoreNeedsTheDiskTier(t *testing.T) {
	protos := parseHeader(t)
	var h uint64
	r := invoke(t, protos["kvbm_pagestore_new"], kvbm_pagestore_new, cCall{
		"opts_json": `{"identity":"x","page_bytes":64,"env":{}}`, "out": &h})
	require.Equal(t, statusConfig, r.rc, "%s", r)
	require.Contains(t, r.msg, "DYN_KVBM_DISK_CACHE_GB")
	r = invoke(t, protos["kvbm_pagestore_new"], kvbm_pagestore_new, cCall{
		"opts_json": `{"identity":"x","page_bytes":64,"env":{"DYN_KVBM_DISK_CACHE_GB":"lots"}}`, "out": &h})
	require.Equal(t, statusConfig, r.rc, "%s", r)
	require.Contains(t, r.msg, "DYN_KVBM_DISK_CACHE_GB")
}

// TestPagestoreHasAndShare: kvbm_pagestore_has answers key by key, and a
// store given a share of the disk tier's size gets that share of its pages.
func TestPagestoreHasAndShare(t *testing.T) {
	protos := parseHeader(t)
	opts := `{"identity":"abi-has","page_bytes":64,"share":0.5,"pool":"mamba","env":{` +
		`"DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS":"8","DYN_KVBM_DISK_DISABLE_O_DIRECT":"true"}}`
	h := newTestHandle(t, protos, "kvbm_pagestore_new", opts)
	defer freeTestHandle("pagestore", h)
	src := make([]byte, 64)
	addr := uint64(uintptr(unsafe.Pointer(&src[0])))
	ok := make([]byte, 3)
	r := invoke(t, protos["kvbm_pagestore_put"], kvbm_pagestore_put, cCall{"hd": h, "keys": []byte("k1k3"),
		"key_ends": []int64{2, 4}, "segs": []uint64{addr, 64, addr, 64}, "page_ends": []int64{1, 2}, "out_ok": ok})
	require.Equal(t, statusOK, r.rc, "%s", r)
	r = invoke(t, protos["kvbm_pagestore_has"], kvbm_pagestore_has, cCall{"hd": h, "keys": []byte("k1k2k3"),
		"key_ends": []int64{2, 4, 6}, "out_ok": ok})
	require.Equal(t, statusOK, r.rc, "%s", r)
	require.Equal(t, []byte{1, 0, 1}, ok)
	// Half of 8 pages: five more pages evict the two above and the first new one.
	five := make([]uint64, 0, 10)
	for range 5 {
		five = append(five, addr, 64)
	}
	ok = make([]byte, 5)
	r = invoke(t, protos["kvbm_pagestore_put"], kvbm_pagestore_put, cCall{"hd": h, "keys": []byte("a0a1a2a3a4"),
		"key_ends": []int64{2, 4, 6, 8, 10}, "segs": five, "page_ends": []int64{1, 2, 3, 4, 5}, "out_ok": ok})
	require.Equal(t, statusOK, r.rc, "%s", r)
	got := make([]byte, 6)
	r = invoke(t, protos["kvbm_pagestore_has"], kvbm_pagestore_has, cCall{"hd": h, "keys": []byte("a0a1a2a3a4k1"),
		"key_ends": []int64{2, 4, 6, 8, 10, 12}, "out_ok": got})
	require.Equal(t, statusOK, r.rc, "%s", r)
	require.Equal(t, []byte{0, 1, 1, 1, 1, 0}, got, "4 pages: k1, k3 and a0 were evicted")

	bad := `{"identity":"abi-has","page_bytes":64,"share":1.5,"env":{"DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS":"8"}}`
	var out uint64
	r = invoke(t, protos["kvbm_pagestore_new"], kvbm_pagestore_new, cCall{"opts_json": bad, "out": &out})
	require.Equal(t, statusInvalid, r.rc)
	require.Contains(t, r.msg, "share=1.5")
	tiny := `{"identity":"abi-has","page_bytes":64,"share":0.1,"pool":"swa","env":{"DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS":"8"}}`
	r = invoke(t, protos["kvbm_pagestore_new"], kvbm_pagestore_new, cCall{"opts_json": tiny, "out": &out})
	require.Equal(t, statusConfig, r.rc)
	require.Contains(t, r.msg, "pool swa")
}
