// Package events holds the KV event wire formats kvbm reads and writes
// (design §7), and nothing about what the events mean to the tracker:
//
//   - engine.go, decode.go: the engines' KV events in — vLLM's msgpack
//     batches (events as tagged arrays or tagged maps; hashes signed,
//     unsigned or bytes) and kvbm's TensorRT-LLM publisher's maps — decoded
//     into EngineEvent values. Malformed input is an error the caller skips,
//     never a panic: lengths are bounded before anything is allocated, and
//     the decoders are fuzzed (fuzz_test.go).
//   - zmqout.go: the consolidated stream out in vLLM's format (one block per
//     BlockStored, positions kept for readers that expect lora_id at index 5).
//   - router.go: RouterEvent JSON for NATS, and its subject names.
//   - sink.go: BlockEvent and Sink, how kvbm's tiers report stores and
//     removals in-process (the consolidator implements Sink).
package events
