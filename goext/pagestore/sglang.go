package pagestore

// SGLangEventHash is the event hash SGLang's KV events publish for the page
// whose HiCache storage key is key: the key is the page's SHA-256 chain hash
// in hex, and the event names the page by its first 16 hex digits read as a
// 64-bit value (SGLang's hash_str_to_int64, a signed int64 that kvbm's event
// decoder bit-casts back to these 64 bits). For pages of requests with a
// LoRA adapter or a cache salt SGLang seeds the two chains differently, so
// the hash does not name the page its events do (docs/design.md §6.3).
// A key that does not start with 16 hex digits has none.
func SGLangEventHash(key []byte) Ext {
	if len(key) < 16 {
		return Ext{}
	}
	var h uint64
	for _, c := range key[:16] {
		var v byte
		switch {
		case c >= '0' && c <= '9':
			v = c - '0'
		case c >= 'a' && c <= 'f':
			v = c - 'a' + 10
		case c >= 'A' && c <= 'F':
			v = c - 'A' + 10
		default:
			return Ext{}
		}
		h = h<<4 | uint64(v)
	}
	return Ext{Hash: h, OK: true}
}
