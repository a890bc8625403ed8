package object_test

import (
	"fmt"
	"testing"

	"github.com/kvbm/kvbm/goext/object"
)

// BenchmarkEncodeVerify: the CPU cost of an object's header, checksums and
// MAC, per payload byte (the network's cost is bench/g4's).
func BenchmarkEncodeVerify(b *testing.B) {
	f := fp("bench")
	for _, size := range []int{256 << 10, 2 << 20} {
		payload := make([]byte, size)
		b.Run(fmt.Sprintf("encode/%dKiB", size>>10), func(b *testing.B) {
			b.SetBytes(int64(size))
			for b.Loop() {
				_ = object.Encode(testKey, f, 7, 3, payload)
			}
		})
		body := object.Encode(testKey, f, 7, 3, payload)
		b.Run(fmt.Sprintf("verify/%dKiB", size>>10), func(b *testing.B) {
			b.SetBytes(int64(size))
			for b.Loop() {
				if _, _, err := object.Verify(body, testKey, f, 7, size); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
