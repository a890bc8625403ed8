// Package layout describes where the bytes of one KV block live: inside the
// engine's own KV tensors (G1, design §5) and inside kvbm's host and disk tiers
// (G2/G3, the "fully contiguous" layout). It only does arithmetic on shapes,
// strides and addresses; it never touches memory.
//
// The unit of copying is a chunk: the bytes of one (block, layer, outer) triple,
// where outer is K or V (outer_dim 2) or the single MLA latent (outer_dim 1).
// Every supported engine layout keeps a chunk contiguous, so a block moves as
// num_layers × outer_dim memcpys of ChunkBytes each.
//
// Host/disk format: kvbm copies each chunk verbatim, so the bytes inside a
// chunk stay in the engine's order ("engine-native chunk order"): tokens ×
// heads × head_dim for FlashAttention/FlashInfer (NHD), heads × tokens ×
// head_dim for the CPU backend, TensorRT-LLM and HND-strided tensors. A G2/G3
// block is therefore only meaningful to an engine with the same Kind, block
// size, head count and dtype — which is always the case, since the tiers live
// and die with one engine instance.
package layout

import (
	"fmt"
	"strings"
)

// Kind names an engine KV tensor layout (design §5).
type Kind uint8

const (
	// Auto asks NewEngine to detect the layout from the shapes.
	Auto Kind = iota
	// FlashAttn is vLLM FlashAttention (also FlexAttention, ROCm): one tensor
	// per layer, [2, num_blocks, block_size, kv_heads, head_dim].
	FlashAttn
	// FlashInfer is vLLM FlashInfer / Triton: one tensor per layer,
	// [num_blocks, 2, block_size, kv_heads, head_dim].
	FlashInfer
	// CPU is vLLM's CPU attention backend: one tensor per layer,
	// [2, num_blocks, kv_heads, block_size, head_dim].
	CPU
	// MLA is vLLM's MLA backends: one tensor per layer,
	// [num_blocks, block_size, latent_dim] (no K/V split).
	MLA
	// TRTLLM is TensorRT-LLM's single pool tensor,
	// [num_blocks, num_layers, kv_factor, kv_heads × block_size × head_dim].
	TRTLLM
	// CPUPaged is vLLM's per-layer KV cache view since the KVCacheLayout
	// rework (0.30+; the CPU and the GPU model runners of 0.32 alike): one
	// tensor per layer, [num_blocks, kv_heads, block_size, 2 × head_dim],
	// blocks outermost, its memory order the backend's (LBHNC, or LBNHC's
	// NHD-ordered page). K and V share each page, so one (block, layer) page
	// is the single chunk (outer_dim 1).
	CPUPaged
)

var kindNames = [...]string{
	Auto:       "auto",
	FlashAttn:  "flash_attn",
	FlashInfer: "flashinfer",
	CPU:        "cpu",
	MLA:        "mla",
	TRTLLM:     "trtllm",
	CPUPaged:   "cpu_paged",
}

func (k Kind) String() string {
	if int(k) < len(kindNames) {
		return kindNames[k]
	}
	return fmt.Sprintf("Kind(%d)", uint8(k))
}

// ParseKind maps a kind name ("flash_attn", "flashinfer", "cpu", "mla",
// "trtllm"; "" or "auto" for detection) to its Kind. It accepts a few aliases
// engines use for the same layout ("triton", "flash_attention", "cpu_attn").
func ParseKind(s string) (Kind, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "auto":
		return Auto, nil
	case "flash_attn", "flash_attention", "flashattention", "flex_attention":
		return FlashAttn, nil
	case "flashinfer", "triton", "triton_attn":
		return FlashInfer, nil
	case "cpu", "cpu_attn", "torch_sdpa":
		return CPU, nil
	case "mla":
		return MLA, nil
	case "trtllm", "tensorrt_llm", "tensorrt-llm":
		return TRTLLM, nil
	case "cpu_paged", "lbhnc":
		return CPUPaged, nil
	}
	return Auto, fmt.Errorf("layout: unknown KV layout kind %q (want one of flash_attn, flashinfer, cpu, cpu_paged, mla, trtllm, or auto)", s)
}
