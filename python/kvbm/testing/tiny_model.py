"""Build small, randomly initialised HF-format models that vLLM can load offline.

No model hub is reachable from this project's machines, so end-to-end tests and
benchmarks create their own model directory:

    from kvbm.testing.tiny_model import make_tiny_model
    path = make_tiny_model("/tmp/kvbm-tiny")              # ~1 MB, 2 layers
    path = make_tiny_model("/tmp/kvbm-05b", **QWEN2_05B_LIKE)  # ~0.4B params

The directory holds ``config.json``, ``model.safetensors`` (plus
``generation_config.json``) and a byte-level tokenizer (``tokenizer.json``,
``tokenizer_config.json``, ``special_tokens_map.json``).  Creation is
idempotent: a ``.kvbm_tiny_model.json`` stamp records the parameters and a
matching directory is reused as is.  Everything is seeded, so two builds with
the same parameters give identical weights.

The vLLM CPU attention backend accepts head sizes
32, 64, 80, 96, 112, 128, 160, 192, 224, 256 (and 512 on some versions), so
``hidden // heads`` must be one of those.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)

# Qwen2-0.5B dimensions with a smaller vocabulary (saves memory; ids < vocab).
QWEN2_05B_LIKE: dict[str, Any] = dict(
    hidden=896,
    layers=24,
    heads=14,
    kv_heads=2,
    intermediate=4864,
    vocab=32000,
    arch="qwen2",
    dtype="bfloat16",
)

_STAMP = ".kvbm_tiny_model.json"
_SPECIALS = ("<unk>", "<s>", "</s>")


def _build_tokenizer(vocab: int) -> Any:
    """Byte-level tokenizer: ids 0..2 specials, 3..258 one token per byte,
    the rest filler tokens (valid ids that text never maps to)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # 256 printable stand-ins
    alphabet.sort()
    if vocab < len(_SPECIALS) + len(alphabet):
        raise ValueError(f"vocab must be >= {len(_SPECIALS) + len(alphabet)}")
    table: dict[str, int] = {}
    for tok in _SPECIALS:
        table[tok] = len(table)
    for ch in alphabet:
        table[ch] = len(table)
    i = 0
    while len(table) < vocab:
        table[f"<extra_{i}>"] = len(table)
        i += 1
    tokenizer = Tokenizer(models.BPE(vocab=table, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
    )
    return fast


def _params(**kw: Any) -> dict[str, Any]:
    return {k: kw[k] for k in sorted(kw)}


def make_tiny_model(
    dir: str | os.PathLike,
    *,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    intermediate: int | None = None,
    max_pos: int = 4096,
    arch: str = "llama",
    dtype: str = "float32",
    seed: int = 0,
    tie_word_embeddings: bool | None = None,
    sliding_window: int | None = None,
) -> str:
    """Create (or reuse) a random model directory and return its absolute path.

    arch: "llama" (LlamaForCausalLM) or "qwen2" (Qwen2ForCausalLM, qkv bias).
    dtype: "float32" or "bfloat16" (weights on disk; vLLM's ``dtype=`` decides
    the runtime dtype).
    arch "nemotron_h" (NemotronHForCausalLM) is a hybrid SSM model: Mamba2,
    MLP, attention and MLP layers in turn, whose Mamba2 layers vLLM keeps in
    KV cache groups of their own (MambaSpec) beside the attention group.
    arch "lfm2" (Lfm2ForCausalLM) is a hybrid with short-convolution state
    layers (vLLM: MambaSpec, the ShortConv backend, which vLLM's CPU platform
    runs, with prefix caching too) and full attention layers in turn.
    sliding_window: with "llama", odd layers attend within a sliding window
    of this many tokens and even layers attend fully (``layer_types``, as
    Gemma 3 interleaves them); vLLM's hybrid KV cache manager gives each
    kind its own KV cache group.
    """
    path = os.path.abspath(os.fspath(dir))
    if hidden % heads:
        raise ValueError("hidden must be divisible by heads")
    head_dim = hidden // heads
    if head_dim not in CPU_HEAD_SIZES:
        raise ValueError(f"head_dim {head_dim} not supported by vLLM CPU attention {CPU_HEAD_SIZES}")
    if heads % kv_heads:
        raise ValueError("heads must be divisible by kv_heads")
    if arch not in ("llama", "qwen2", "nemotron_h", "lfm2"):
        raise ValueError("arch must be 'llama', 'qwen2', 'nemotron_h' or 'lfm2'")
    if arch == "nemotron_h" and layers % 4:
        raise ValueError("nemotron_h repeats Mamba2, MLP, attention, MLP: layers must be a multiple of 4")
    if intermediate is None:
        intermediate = 4 * hidden
    if tie_word_embeddings is None:
        tie_word_embeddings = arch == "qwen2"
    params = _params(
        hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, vocab=vocab,
        intermediate=intermediate, max_pos=max_pos, arch=arch, dtype=dtype, seed=seed,
        tie_word_embeddings=tie_word_embeddings, version=1,
    )
    if sliding_window is not None:
        if arch != "llama":
            raise ValueError("sliding_window is supported with arch='llama'")
        params["sliding_window"] = int(sliding_window)  # absent otherwise: older stamps still match
    stamp = os.path.join(path, _STAMP)
    try:
        with open(stamp) as f:
            if json.load(f) == params and os.path.exists(os.path.join(path, "model.safetensors")):
                return path
    except (OSError, ValueError):
        pass

    import torch
    import transformers

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    if arch == "llama":
        extra: dict[str, Any] = {}
        if sliding_window is not None:
            extra = dict(sliding_window=int(sliding_window),
                         layer_types=["sliding_attention" if i % 2 else "full_attention" for i in range(layers)])
        cfg = transformers.LlamaConfig(head_dim=head_dim, **common, **extra)
        cls = transformers.LlamaForCausalLM
    elif arch == "nemotron_h":
        cfg = transformers.NemotronHConfig(
            head_dim=head_dim, hybrid_override_pattern="M-*-" * (layers // 4), mamba_num_heads=heads,
            mamba_head_dim=head_dim, ssm_state_size=16, n_groups=1, chunk_size=32, expand=1, **common)
        cls = transformers.NemotronHForCausalLM
    elif arch == "lfm2":
        lfm = {k: v for k, v in common.items() if k not in ("rms_norm_eps", "rope_theta")}
        cfg = transformers.Lfm2Config(
            norm_eps=1e-5, conv_L_cache=3, block_auto_adjust_ff_dim=False,
            layer_types=["conv" if i % 2 == 0 else "full_attention" for i in range(layers)], **lfm)
        cfg.conv_dim = cfg.block_dim = hidden  # what vLLM's Lfm2 reads (LFM2 checkpoints carry them)
        cls = transformers.Lfm2ForCausalLM
    else:
        cfg = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM

    parent = os.path.dirname(path) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-model-", dir=parent)
    os.chmod(tmp, 0o755)
    try:
        torch.manual_seed(seed)
        model = cls(cfg)
        # A bit more signal than the default init so greedy outputs are not
        # all the same token.
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed)
            for name, p in model.named_parameters():
                if p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1] ** 0.5))
        model = model.to(torch_dtype)
        model.save_pretrained(tmp)
        _build_tokenizer(vocab).save_pretrained(tmp)
        with open(os.path.join(tmp, _STAMP), "w") as f:
            json.dump(params, f)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return path


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--big", action="store_true", help="Qwen2-0.5B-like dims")
    a = ap.parse_args()
    print(make_tiny_model(a.dir, **(QWEN2_05B_LIKE if a.big else {})))
