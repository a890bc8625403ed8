// kvbm_tokens_from_pylist: a CPython list of token ids read in place into a
// uint32 array — the first conversion of a prompt on the engine's match path
// (array.array('I').fromlist takes ~4 ns a token, so a
// 32K-token prompt spent more in conversion than in matching).
//
// It reads CPython's object layout directly (no Python headers, no libpython
// link): the caller (kvbm._native.pylist_layout) enables it only on the
// 64-bit, GIL-enabled, non-debug CPython versions whose layout is known, checks
// it on probe lists before first use, and calls it with the GIL held (ctypes
// PYFUNCTYPE), so the list cannot change underneath. Anything unexpected (an
// item that is not exactly an int, a negative value, one of 2^32 or more) stops
// the conversion: the caller converts the rest the ordinary way.
//
//   PyListObject: ob_refcnt, ob_type, ob_size, ob_item (PyObject **) at 24.
//   PyLongObject: ob_refcnt, ob_type, then at 16
//     layout 1 (3.9–3.11): ob_size, the signed number of 30-bit digits;
//     layout 2 (3.12+):    lv_tag = ndigits << 3 | sign (0 positive, 1 zero,
//                          2 negative);
//   and the 30-bit digits (uint32) from offset 24.

#include <stddef.h>
#include <stdint.h>

#include "kvbm.h"

int64_t kvbm_tokens_from_pylist(const void *list, int64_t n, const void *int_type, int32_t layout, uint32_t *out) {
	if (list == NULL || out == NULL || n <= 0 || (layout != 1 && layout != 2)) {
		return 0;
	}
	const char *l = (const char *)list;
	int64_t size = *(const int64_t *)(l + 16);
	if (n > size) {
		n = size;
	}
	const char *const *items = *(const char *const *const *)(l + 24);
	for (int64_t i = 0; i < n; i++) {
		const char *v = items[i];
		if (*(const void *const *)(v + 8) != int_type) {
			return i;
		}
		uint64_t tag = *(const uint64_t *)(v + 16);
		uint64_t ndigits;
		if (layout == 1) {
			if ((int64_t)tag < 0) {
				return i;
			}
			ndigits = tag;
		} else {
			if ((tag & 3) == 2) {
				return i;
			}
			ndigits = (tag & 3) == 1 ? 0 : tag >> 3;
		}
		const uint32_t *d = (const uint32_t *)(v + 24);
		uint64_t x;
		if (ndigits == 0) {
			x = 0;
		} else if (ndigits == 1) {
			x = d[0];
		} else if (ndigits == 2) {
			x = (uint64_t)d[0] | ((uint64_t)d[1] << 30);
			if (x > 0xffffffffu) {
				return i;
			}
		} else {
			return i;
		}
		out[i] = (uint32_t)x;
	}
	return n;
}
