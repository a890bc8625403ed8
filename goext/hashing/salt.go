package hashing

import (
	"unicode/utf8"

	"github.com/zeebo/xxh3"
)

// DefaultSaltHash is the salt hash of a request with neither a cache salt nor
// a LoRA adapter: XXH3(seed 0) of the two bytes "{}". TensorRT-LLM requests
// always use it (the reference passes neither value).
const DefaultSaltHash uint64 = 1389868326933519382

// SaltHash returns the seed for a request's KVBM block and sequence hashes:
// XXH3 (seed 0) of the compact JSON object {"salt":<salt>,"lora_name":<name>},
// each key present only when its has* flag is set, keys in that order.
//
// The reference serialises with serde_json (Rust) and the Python side with
// json.dumps(separators=(',', ':'), ensure_ascii=False); both write non-ASCII
// text as raw UTF-8 and escape only '"', '\\' and control characters. Go's
// encoding/json differs (it always escapes U+2028/U+2029 and, by default,
// <, > and &), so we encode by hand; see appendJSONString.
//
// An empty-but-present salt ("") is distinct from an absent one, as in the
// reference (Some("") serialises as "salt":"").
func SaltHash(salt string, hasSalt bool, loraName string, hasLora bool) uint64 {
	if !hasSalt && !hasLora {
		return DefaultSaltHash
	}
	// Salts and adapter names are short; 128 bytes keeps the common case on
	// the stack.
	var stack [128]byte
	b := saltJSON(stack[:0], salt, hasSalt, loraName, hasLora)
	return xxh3.HashSeed(b, 0)
}

// saltJSON appends the compact JSON object hashed by SaltHash to dst.
func saltJSON(dst []byte, salt string, hasSalt bool, loraName string, hasLora bool) []byte {
	dst = append(dst, '{')
	if hasSalt {
		dst = append(dst, `"salt":`...)
		dst = appendJSONString(dst, salt)
	}
	if hasLora {
		if hasSalt {
			dst = append(dst, ',')
		}
		dst = append(dst, `"lora_name":`...)
		dst = appendJSONString(dst, loraName)
	}
	return append(dst, '}')
}

// appendJSONString appends s as a JSON string exactly as serde_json's compact
// formatter (and Python's json.dumps with ensure_ascii=False) writes it:
// '"' and '\\' get a backslash; \b \f \n \r \t use their short escapes; other
// bytes below 0x20 become \u00XX with lower-case hex; everything else,
// including DEL and U+2028/U+2029, is copied as UTF-8.
//
// Rust and Python strings are always valid Unicode, so the reference never
// sees invalid UTF-8. A Go string may hold it (e.g. bytes from C); we replace
// each invalid byte with U+FFFD, which is what a Python caller decoding
// those bytes with errors="replace" would hash.
func appendJSONString(dst []byte, s string) []byte {
	const hex = "0123456789abcdef"
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' {
				i++
				continue
			}
			dst = append(dst, s[start:i]...)
			switch c {
			case '"', '\\':
				dst = append(dst, '\\', c)
			case '\b':
				dst = append(dst, '\\', 'b')
			case '\f':
				dst = append(dst, '\\', 'f')
			case '\n':
				dst = append(dst, '\\', 'n')
			case '\r':
				dst = append(dst, '\\', 'r')
			case '\t':
				dst = append(dst, '\\', 't')
			default:
				dst = append(dst, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			dst = append(dst, s[start:i]...)
			dst = utf8.AppendRune(dst, utf8.RuneError)
			i++
			start = i
			continue
		}
		i += size
	}
	dst = append(dst, s[start:]...)
	return append(dst, '"')
}
