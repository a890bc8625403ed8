package hashing

import (
	"encoding/json"
	"math/rand/v2"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
	"github.com/zeebo/xxh3"
)

func seq(from, to uint32) []uint32 {
	out := make([]uint32, 0, to-from)
	for t := from; t < to; t++ {
		out = append(out, t)
	}
	return out
}

// Golden vectors from the reference's lib/tokens tests (TEST_SALT_HASH = 1337).
func TestKVBMGoldenSeed1337(t *testing.T) {
	const salt = 1337
	b0 := BlockHash([]uint32{1, 2, 3, 4}, salt)
	b1 := BlockHash([]uint32{5, 6, 7, 8}, salt)
	b2 := BlockHash([]uint32{9, 10, 11, 12}, salt)
	require.Equal(t, uint64(14643705804678351452), b0)
	require.Equal(t, uint64(16777012769546811212), b1)
	require.Equal(t, uint64(483935686894639516), b2)

	s1 := ChainHash(b0, b1, salt)
	s2 := ChainHash(s1, b2, salt)
	require.Equal(t, uint64(4945711292740353085), s1)
	require.Equal(t, uint64(12583592247330656132), s2)

	got := SequenceHashes(seq(1, 13), 4, salt, nil)
	require.Equal(t, []uint64{14643705804678351452, 4945711292740353085, 12583592247330656132}, got)
}

func TestKVBMGoldenDefaultSalt(t *testing.T) {
	require.Equal(t, DefaultSaltHash, SaltHash("", false, "", false))
	require.Equal(t, uint64(1389868326933519382), xxh3.HashSeed([]byte("{}"), 0))

	require.Equal(t, uint64(8026409477313730465), BlockHash([]uint32{1, 2, 3, 4}, DefaultSaltHash))
	require.Equal(t, uint64(4932910930253085737), BlockHash([]uint32{5, 6, 7, 8}, DefaultSaltHash))
	got := SequenceHashes(seq(1, 9), 4, DefaultSaltHash, nil)
	require.Equal(t, []uint64{8026409477313730465, 8178148779430958753}, got)
}

func TestSaltHashGolden(t *testing.T) {
	for _, tc := range []struct {
		name     string
		salt     string
		hasSalt  bool
		lora     string
		hasLora  bool
		wantJSON string
		want     uint64
	}{
		{name: "none", wantJSON: `{}`, want: 1389868326933519382},
		{name: "lora", lora: "my-adapter", hasLora: true, wantJSON: `{"lora_name":"my-adapter"}`, want: 6145460909938861783},
		{name: "salt", salt: "abc", hasSalt: true, wantJSON: `{"salt":"abc"}`, want: 7355571969895925867},
		{name: "both", salt: "abc", hasSalt: true, lora: "my-adapter", hasLora: true,
			wantJSON: `{"salt":"abc","lora_name":"my-adapter"}`, want: 17381227117365802203},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.wantJSON, string(saltJSON(nil, tc.salt, tc.hasSalt, tc.lora, tc.hasLora)))
			require.Equal(t, tc.want, SaltHash(tc.salt, tc.hasSalt, tc.lora, tc.hasLora))
		})
	}
}

func TestSaltHashPresenceMatters(t *testing.T) {
	// Some("") is not None in the reference: an empty salt is its own key.
	require.NotEqual(t, DefaultSaltHash, SaltHash("", true, "", false))
	require.Equal(t, xxh3.HashString(`{"salt":""}`), SaltHash("", true, "", false))
	require.Equal(t, xxh3.HashString(`{"lora_name":""}`), SaltHash("", false, "", true))
	// The has* flags gate the values: a value without its flag is ignored.
	require.Equal(t, DefaultSaltHash, SaltHash("abc", false, "x", false))
}

// The expected strings are what Python's
// json.dumps(v, separators=(',', ':'), ensure_ascii=False) prints (checked by
// hand with CPython 3), which is also serde_json's compact output.
func TestAppendJSONStringMatchesSerdeJSON(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"plain", `"plain"`},
		{`q"b\s`, `"q\"b\\s"`},
		{"\b\f\n\r\t", `"\b\f\n\r\t"`},
		{"\x00\x01\x1f", `"\u0000\u0001\u001f"`},
		{"\x7f", "\"\x7f\""},                 // DEL is not escaped
		{"</script>&", `"</script>&"`},       // no HTML escaping
		{"a/b", `"a/b"`},                     // no solidus escaping
		{"héllo ✓ 日本", `"héllo ✓ 日本"`},       // raw UTF-8 (ensure_ascii=False)
		{"\u2028\u2029", "\"\u2028\u2029\""}, // Go's encoding/json would write \u2028
		{"😀", `"😀"`},                         // astral plane stays raw, no surrogate pair
		{"a\xffb", "\"a\ufffdb\""},           // invalid UTF-8 → U+FFFD
	} {
		require.Equal(t, tc.want, string(appendJSONString(nil, tc.in)), "input %q", tc.in)
	}
}

// For text without U+2028/U+2029, encoding/json with HTML escaping off must
// agree with us; this guards against drift in the hand-written encoder.
func TestAppendJSONStringAgreesWithEncodingJSON(t *testing.T) {
	inputs := []string{"", "abc", `"\`, "\b\f\n\r\t\x00\x1f\x7f", "<>&", "日本語", "tab\there", "x\x0by"}
	for _, in := range inputs {
		var sb jsonBuf
		enc := json.NewEncoder(&sb)
		enc.SetEscapeHTML(false)
		require.NoError(t, enc.Encode(in))
		want := string(sb[:len(sb)-1]) // Encode appends '\n'
		require.Equal(t, want, string(appendJSONString(nil, in)), "input %q", in)
	}
}

type jsonBuf []byte

func (b *jsonBuf) Write(p []byte) (int, error) { *b = append(*b, p...); return len(p), nil }

func TestSaltHashLongValuesSpillToHeap(t *testing.T) {
	long := string(make([]byte, 500)) // 500 NULs → 3000 escaped bytes
	want := xxh3.HashString(`{"salt":"` + repeat(`\u0000`, 500) + `"}`)
	require.Equal(t, want, SaltHash(long, true, "", false))
}

func repeat(s string, n int) string {
	out := make([]byte, 0, len(s)*n)
	for range n {
		out = append(out, s...)
	}
	return string(out)
}

// Long-block vectors: seeded XXH3 above 240 bytes takes the derived-secret
// path; values cross-checked against C xxHash (reference notes §2.1).
func TestBlockHashLongBlocks(t *testing.T) {
	require.Equal(t, uint64(3480597578098033343), BlockHash(seq(0, 64), 1337))
	require.Equal(t, uint64(9509643624113304476), BlockHash(seq(0, 128), 1337))
	require.Equal(t, uint64(13509048708924160886), BlockHash(seq(0, 256), 1337))
}

func TestSequenceHashesMatchesBlockAndChain(t *testing.T) {
	tokens := seq(100, 100+16*7)
	salt := SaltHash("s", true, "", false)
	got := SequenceHashes(tokens, 16, salt, nil)
	require.Len(t, got, 7)
	var prev uint64
	for i := range 7 {
		h := BlockHash(tokens[i*16:(i+1)*16], salt)
		if i > 0 {
			h = ChainHash(prev, h, salt)
		}
		require.Equal(t, h, got[i], "block %d", i)
		prev = h
	}
}

func TestSequenceHashesPartialTailIgnored(t *testing.T) {
	full := SequenceHashes(seq(1, 13), 4, 1337, nil)
	for extra := uint32(0); extra < 4; extra++ {
		got := SequenceHashes(seq(1, 13+extra), 4, 1337, nil)
		require.Equal(t, full, got, "with %d trailing tokens", extra)
	}
	require.Empty(t, SequenceHashes(seq(1, 4), 4, 1337, nil), "3 tokens of a 4-token block")
	require.Empty(t, SequenceHashes(nil, 4, 1337, nil))
	require.Len(t, SequenceHashes(seq(1, 17), 4, 1337, nil), 4)
}

func TestSequenceHashesAppends(t *testing.T) {
	dst := []uint64{42}
	got := SequenceHashes(seq(1, 9), 4, DefaultSaltHash, dst)
	require.Equal(t, []uint64{42, 8026409477313730465, 8178148779430958753}, got)

	// With spare capacity the caller's array is reused.
	buf := make([]uint64, 1, 8)
	got = SequenceHashes(seq(1, 9), 4, DefaultSaltHash, buf)
	require.Same(t, &buf[0], &got[0])
}

func TestSequenceHashesBadBlockSizePanics(t *testing.T) {
	require.Panics(t, func() { SequenceHashes(seq(0, 4), 0, 0, nil) })
	require.Panics(t, func() { RouterLocalHashes(seq(0, 4), -1, "", nil) })
}

func TestSaltAndLoraChangeHashes(t *testing.T) {
	tokens := seq(0, 32)
	base := SequenceHashes(tokens, 16, DefaultSaltHash, nil)
	salted := SequenceHashes(tokens, 16, SaltHash("tenant-a", true, "", false), nil)
	salted2 := SequenceHashes(tokens, 16, SaltHash("tenant-b", true, "", false), nil)
	lora := SequenceHashes(tokens, 16, SaltHash("", false, "my-adapter", true), nil)
	for i := range base {
		require.NotEqual(t, base[i], salted[i])
		require.NotEqual(t, salted[i], salted2[i])
		require.NotEqual(t, base[i], lora[i])
	}

	rBase := RouterSequenceHashes(tokens, 16, "")
	rLora := RouterSequenceHashes(tokens, 16, "my-adapter")
	for i := range rBase {
		require.NotEqual(t, rBase[i], rLora[i])
	}
	// KVBM and router families never coincide for the same tokens.
	require.NotEqual(t, base[0], rBase[0])
}

func TestSequenceHashesChainDependsOnPrefix(t *testing.T) {
	a := SequenceHashes([]uint32{1, 2, 3, 4, 9, 9, 9, 9}, 4, 1337, nil)
	b := SequenceHashes([]uint32{5, 6, 7, 8, 9, 9, 9, 9}, 4, 1337, nil)
	// The second blocks have the same content (so the same block hash) but
	// different prefixes: their sequence hashes differ.
	require.NotEqual(t, a[0], b[0])
	require.NotEqual(t, a[1], b[1], "same block content under different prefixes")
	c := SequenceHashes([]uint32{1, 2, 3, 4, 7, 7, 7, 7}, 4, 1337, nil)
	require.Equal(t, a[0], c[0], "same first block, same first sequence hash")
	require.NotEqual(t, a[1], c[1])
}

func TestRouterGolden(t *testing.T) {
	require.Equal(t, uint64(13226331709069118873), HashBytes([]byte("test data")))
	require.Equal(t, uint64(15310707395893867146), RouterLocalHash(seq(0, 16), ""))
	require.Equal(t, []uint64{15310707395893867146}, RouterSequenceHashes(seq(0, 16), 16, ""))
	require.Equal(t, uint64(2360313164392603308), RouterLoraSeed("my-adapter"))
	require.Equal(t, uint64(15633847640104431966), RouterLocalHash([]uint32{1, 2, 3, 4}, "my-adapter"))
	require.Equal(t, RouterSeed, RouterLoraSeed(""))
}

func TestRouterSequenceHashes(t *testing.T) {
	tokens := seq(0, 50) // 3 full blocks of 16, 2 tokens ignored
	for _, lora := range []string{"", "my-adapter"} {
		got := RouterSequenceHashes(tokens, 16, lora)
		require.Len(t, got, 3)
		local := RouterLocalHashes(tokens, 16, lora, nil)
		require.Equal(t, local[0], got[0])
		for i := 1; i < 3; i++ {
			// Chain seed is always 1337, even with LoRA.
			var buf [16]byte
			putLE64(buf[:8], got[i-1])
			putLE64(buf[8:], local[i])
			require.Equal(t, xxh3.HashSeed(buf[:], 1337), got[i])
			require.Equal(t, RouterSequenceHash(got[i-1], local[i]), got[i])
		}
	}
	require.Empty(t, RouterSequenceHashes(seq(0, 15), 16, ""))
}

func putLE64(b []byte, v uint64) {
	for i := range 8 {
		b[i] = byte(v >> (8 * i))
	}
}

func TestZeroAllocations(t *testing.T) {
	tokens := seq(0, 4096)
	dst := make([]uint64, 0, 4096/16)
	for _, tc := range []struct {
		name string
		fn   func()
	}{
		{"SequenceHashes", func() { dst = SequenceHashes(tokens, 16, DefaultSaltHash, dst[:0]) }},
		{"RouterLocalHashes", func() { dst = RouterLocalHashes(tokens, 16, "my-adapter", dst[:0]) }},
		{"BlockHash", func() { _ = BlockHash(tokens[:16], 1) }},
		{"ChainHash", func() { _ = ChainHash(1, 2, 3) }},
		{"RouterSequenceHash", func() { _ = RouterSequenceHash(1, 2) }},
		{"SaltHash", func() { _ = SaltHash("tenant", true, "my-adapter", true) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Zero(t, testing.AllocsPerRun(50, tc.fn))
		})
	}
}

func TestTokenBytesIsLittleEndian(t *testing.T) {
	tokens := []uint32{0x04030201, 0xddccbbaa, 0}
	var scratch scratchBuf
	require.Equal(t, []byte{1, 2, 3, 4, 0xaa, 0xbb, 0xcc, 0xdd, 0, 0, 0, 0}, tokenBytes(tokens, &scratch))
	require.Empty(t, tokenBytes(nil, &scratch))
}

// FuzzAppendJSONString checks the hand-written encoder against encoding/json
// on valid UTF-8, after undoing the one place they are meant to differ
// (encoding/json escapes U+2028 and U+2029; serde_json does not).
func FuzzAppendJSONString(f *testing.F) {
	for _, s := range []string{"", "abc", "\x00\"\\", "日本\u2028", "\b\f"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got := appendJSONString(nil, s)
		var back string
		require.NoError(t, json.Unmarshal(got, &back), "our output must be valid JSON: %q", got)
		if !utf8.ValidString(s) {
			return
		}
		require.Equal(t, s, back)
		var sb jsonBuf
		enc := json.NewEncoder(&sb)
		enc.SetEscapeHTML(false)
		require.NoError(t, enc.Encode(s))
		want := strings.NewReplacer(`\u2028`, "\u2028", `\u2029`, "\u2029").Replace(string(sb[:len(sb)-1]))
		require.Equal(t, want, string(got))
	})
}

func TestChainKeyMatchesXXH3(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	seeds := []uint64{0, 1, 1337, DefaultSaltHash, ^uint64(0)}
	for range 200 {
		seeds = append(seeds, rng.Uint64())
	}
	var buf [16]byte
	for _, seed := range seeds {
		for range 50 {
			a, b := rng.Uint64(), rng.Uint64()
			putLE64(buf[:8], a)
			putLE64(buf[8:], b)
			require.Equal(t, xxh3.HashSeed(buf[:], seed), newChainKey(seed).hash16(a, b), "seed %d", seed)
			require.Equal(t, xxh3.HashSeed(buf[:], seed), ChainHash(a, b, seed))
		}
	}
}

func TestShortKeyMatchesXXH3(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	seeds := []uint64{0, 1, 1337, DefaultSaltHash, ^uint64(0)}
	for range 50 {
		seeds = append(seeds, rng.Uint64())
	}
	buf := make([]byte, shortHashMax)
	for _, seed := range seeds {
		k := newShortKey(seed)
		for l := shortHashMin; l <= shortHashMax; l++ {
			for i := range buf[:l] {
				buf[i] = byte(rng.Uint32())
			}
			require.Equal(t, xxh3.HashSeed(buf[:l], seed), k.hash(buf[:l]), "seed %d len %d", seed, l)
		}
	}
}

// Every block size from 1 to 70 tokens crosses the boundaries between the
// inlined and xxh3.HashSeed paths; both must agree with BlockHash+ChainHash.
func TestSequenceHashesAllBlockSizes(t *testing.T) {
	tokens := seq(7, 7+500)
	salt := SaltHash("x", true, "y", true)
	for bs := 1; bs <= 70; bs++ {
		got := SequenceHashes(tokens, bs, salt, nil)
		require.Len(t, got, len(tokens)/bs)
		local := RouterLocalHashes(tokens, bs, "y", nil)
		var prev uint64
		for i := range got {
			blk := tokens[i*bs : (i+1)*bs]
			h := BlockHash(blk, salt)
			if i > 0 {
				h = ChainHash(prev, h, salt)
			}
			require.Equal(t, h, got[i], "block size %d block %d", bs, i)
			require.Equal(t, RouterLocalHash(blk, "y"), local[i], "router block size %d block %d", bs, i)
			prev = h
		}
	}
}

func TestStateHashIsNotASequenceHash(t *testing.T) {
	toks := make([]uint32, 64)
	for i := range toks {
		toks[i] = uint32(i * 7)
	}
	seq := SequenceHashes(toks, 16, 0, nil)
	seen := map[uint64]bool{}
	for _, h := range seq {
		seen[h] = true
	}
	for _, h := range seq {
		s := StateHash(h)
		if seen[s] {
			t.Fatalf("StateHash(%x) = %x collides with a sequence hash", h, s)
		}
		if s != StateHash(h) {
			t.Fatal("StateHash is not deterministic")
		}
		seen[s] = true
	}
	if StateHash(seq[0]) == StateHash(seq[1]) {
		t.Fatal("two positions share a state key")
	}
}
