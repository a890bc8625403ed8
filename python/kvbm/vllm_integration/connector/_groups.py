"""vLLM's KV cache groups (its hybrid KV cache manager) as kvbm serves them.

A model whose layers differ in attention kind (full attention beside
sliding-window or chunked local attention layers) gets one block table per
group of layers from vLLM; all groups draw blocks from one pool and layer i
of every group shares one tensor. kvbm keeps a block as one token position
of the prompt holding every layer's KV: its hash, its tiers and its G4 key
are the position's, as for a single-group model. The leader plans with the
block of the primary group (the first full-attention group, which holds a
block at every position of a prefix); each step's plan carries, per G1 block
it copies, the block every group holds at that position (``"g"`` rows,
goext/plan/groups.go), and the worker copies layer l from or to its group's
block. A sliding-window or chunked-local group holds vLLM's null block before
its window: those layers are not loaded.

Recurrent-state groups (vLLM's MambaSpec: Mamba, Mamba2, short convolution,
linear attention, gated delta nets) with vLLM's prefix caching of their state
(``mamba_cache_mode='align'``) are served beside an attention group: a group's
block at position j holds the state after the position's last token when the
step that computed it ended there. kvbm stores such a position a second time
under its state key, and a hit ends on a position whose state is stored (the
leader's ``stateCut``). A state layer's block is moved as the raw page vLLM
binds it to (``state_views``). Groups kvbm cannot serve (state without
prefix caching, speculative state blocks, any spec kvbm does not know) turn
kvbm off for the engine with a reason naming them; vLLM keeps its hybrid
manager and serves the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# vLLM's BlockPool hands out block 0 as its null block: a group's entry for
# a position it does not hold (a sliding window's blocks before the window).
NULL_BLOCK_ID = 0
# What a group row says for it (goext/layout.NoBlock).
NO_BLOCK = -1


def group_kind(spec: Any) -> str:
    """A short name of a group's attention kind, for logs and refusals."""
    name = type(spec).__name__
    window = getattr(spec, "sliding_window", None)
    chunk = getattr(spec, "attention_chunk_size", None)
    if name in ("SlidingWindowSpec", "SlidingWindowMLASpec"):
        return f"sliding_window({window})"
    if name == "ChunkedLocalAttentionSpec":
        return f"chunked_local({chunk})"
    if name in ("FullAttentionSpec", "MLAAttentionSpec"):
        return "full_attention"
    return name.removesuffix("Spec").lower() or name


# What group_kind calls vLLM's MambaSpec (goext/layout.StateKind).
STATE_KIND = "mamba"


def _served(kind: str) -> bool:
    return kind in ("full_attention", STATE_KIND) or kind.startswith(("sliding_window(", "chunked_local("))


@dataclass(frozen=True)
class GroupLayout:
    """The KV cache groups of an engine kvbm serves."""

    kinds: tuple[str, ...]  # per group
    primary: int  # the group whose blocks the leader plans with
    layer_group: dict[str, int]  # layer name -> group
    page_bytes: int  # bytes of one layer's block (every group's, vLLM makes them uniform)
    # Per group: (sliding window, extra retained tokens) or (0, chunk size)
    # for chunked local attention; (0, 0) for full attention.
    windows: tuple[tuple[int, int], ...] = ()

    @property
    def with_rows(self) -> bool:
        """Whether plans carry group rows: several groups, or one group that
        frees the blocks before its window (vLLM replaces them with its null
        block, which must be neither loaded into nor saved from)."""
        return self.num_groups > 1 or any(w != (0, 0) for w in self.windows)

    def skipped_blocks(self, group: int, num_computed: int) -> int:
        """How many leading blocks of a request ``group`` may have freed
        once ``num_computed`` tokens are computed (vLLM's
        get_num_skipped_tokens; it frees on processed tokens, never more)."""
        window, extra = self.windows[group] if self.windows else (0, 0)
        if window:
            return max(0, num_computed - window + 1 - extra) // self._block_size
        if extra:  # chunked local attention: everything before the current chunk
            return (num_computed // extra) * extra // self._block_size
        return 0

    @property
    def state(self) -> tuple[bool, ...]:
        """Per group: whether it keeps recurrent state."""
        return tuple(k == STATE_KIND for k in self.kinds)

    @property
    def has_state(self) -> bool:
        return STATE_KIND in self.kinds

    @property
    def full_hit_ok(self) -> bool:
        """Whether a prompt cached whole may load every block and leave vLLM
        its last token (leader load_full_hit). Not with a sliding-window or
        chunked-local group: vLLM allocates that group's window for the hit
        length, and a window ending one token short of a block boundary
        starts one block later than the window of the block-aligned hit its
        own prefix cache takes (it caps hits at the prompt's last whole
        block before its last token), so the block that window needs is
        never allocated and that prompt never hits G1 again. The hit stays
        block aligned, as vLLM's own."""
        return not any(w != (0, 0) for w in self.windows) and not self.has_state

    _block_size: int = 1

    @property
    def num_groups(self) -> int:
        return len(self.kinds)

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    def describe(self) -> str:
        return ", ".join(f"{k} ({sum(1 for g in self.layer_group.values() if g == i)} layers)"
                         for i, k in enumerate(self.kinds))


def kv_groups(kv_cache_config: Any, block_size: int) -> tuple[GroupLayout | None, str | None]:
    """The groups of a vLLM KVCacheConfig kvbm serves, or None with the reason.

    One group: served as before (whatever its attention kind; a group of
    recurrent state, a pure state-space model, is refused). Several: every group
    must be full, sliding-window or chunked-local attention with the
    engine's block size, and one must be full attention. Host-memory and
    CUDA KV caches alike (the CUDA copier copies per group, goext/cuda)."""
    if kv_cache_config is None:
        return None, "no kv_cache_config"
    groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
    if not groups:
        return None, "no KV cache groups"
    kinds = tuple(group_kind(g.kv_cache_spec) for g in groups)
    layer_group = {name: i for i, g in enumerate(groups) for name in g.layer_names}
    page = int(groups[0].kv_cache_spec.page_size_bytes)
    windows = tuple(_window(g.kv_cache_spec, k) for g, k in zip(groups, kinds))
    what = ", ".join(kinds)
    if len(groups) == 1 and not _is_state_spec(groups[0].kv_cache_spec):
        return GroupLayout(kinds, 0, layer_group, page, windows, block_size), None
    unserved = sorted({k for k in kinds if not _served(k)})
    if unserved:
        return None, (f"KV cache groups of kind {', '.join(unserved)} are not served by kvbm yet "
                      f"(this model's groups: {what}); kvbm serves full, sliding-window and chunked local "
                      "attention, and recurrent state beside them")
    state = [g.kv_cache_spec for g in groups if _is_state_spec(g.kv_cache_spec)]
    if state and (why := state_groups_missing(state)):
        return None, f"KV cache groups of kind mamba are not served by kvbm here (this model's groups: {what}): {why}"
    if state and len(groups) == len(state):
        return None, f"only recurrent-state groups ({what}): kvbm plans positions with a full-attention group"
    if "full_attention" not in kinds:
        return None, f"several KV cache groups ({what}) and none of full attention, which kvbm plans positions with"
    for i, g in enumerate(groups):
        bs = int(getattr(g.kv_cache_spec, "block_size", block_size))
        if bs != block_size:
            return None, f"KV cache group {i} ({kinds[i]}) has block size {bs}, the engine {block_size}"
        if int(g.kv_cache_spec.page_size_bytes) != page:
            return None, (f"KV cache groups with different page sizes ({what}): group 0 "
                          f"{page} B, group {i} {int(g.kv_cache_spec.page_size_bytes)} B")
        if not getattr(g, "enable_kv_transfer", True):
            return None, f"KV cache group {i} ({kinds[i]}) is not transferable"
    if len(layer_group) != sum(len(g.layer_names) for g in groups):
        return None, f"a layer is in several KV cache groups ({what})"
    return GroupLayout(kinds, kinds.index("full_attention"), layer_group, page, windows, block_size), None


def _is_state_spec(spec: Any) -> bool:
    # vLLM's MambaSpec covers every recurrent-state layer kind (Mamba,
    # Mamba2, short convolution, linear attention, gated delta nets).
    return any(c.__name__ == "MambaSpec" for c in type(spec).__mro__)


def state_groups_missing(specs: list[Any]) -> str | None:
    """Why kvbm cannot serve these recurrent-state groups (docs/design.md
    §11), or None when it can."""
    modes = sorted({str(getattr(s, "mamba_cache_mode", "none")) for s in specs})
    if modes != ["align"]:
        return (f"with mamba_cache_mode={'/'.join(modes)} (prefix caching off) vLLM keeps only each "
                "request's running state, so no prefix of such a model can be stored or loaded")
    spec = [int(getattr(s, "num_speculative_blocks", 0) or 0) for s in specs]
    if any(spec):
        return (f"state groups with {max(spec)} speculative blocks (speculative decoding) move the running "
                "state between blocks, which kvbm does not follow")
    return None


def state_views(kv_caches: dict[str, Any], layout: GroupLayout) -> dict[str, Any]:
    """kv_caches with each state layer's tensor replaced by a view shaped as
    the attention layers' over the same bytes.

    vLLM binds a state layer to a byte view of the tensor it shares with an
    attention layer (``[num_blocks, 1, 1, state bytes]``, one page per
    block) and pads the state page to the attention page, so block b of
    either is the page at ``b × page_bytes``. kvbm copies a state layer's
    block as that whole page, like an attention layer's. Raises ValueError
    when the pages do not line up."""
    if not layout.has_state:
        return kv_caches
    state = layout.state
    attn = next((t for n, t in kv_caches.items() if not state[layout.layer_group[n]]), None)
    if attn is None:
        raise ValueError("no attention layer to shape the state layers' pages after")
    import torch

    page = layout.page_bytes
    if attn.stride(0) * attn.element_size() != page:
        raise ValueError(f"attention layers are not one {page}-byte page per block "
                         f"(shape {tuple(attn.shape)}, stride {attn.stride()})")
    out = dict(kv_caches)
    for name, t in kv_caches.items():
        if not state[layout.layer_group[name]]:
            continue
        if isinstance(t, (list, tuple)):
            raise ValueError(f"state layer {name} is registered as {len(t)} separate tensors, not one page view")
        off = t.storage_offset() * t.element_size()
        if t.stride(0) * t.element_size() != page or off % attn.element_size():
            raise ValueError(f"state layer {name}: block stride {t.stride(0) * t.element_size()} B, "
                             f"the attention page is {page} B")
        nbytes = off + attn.shape[0] * page
        if t.untyped_storage().nbytes() < nbytes:
            raise ValueError(f"state layer {name}: its storage ends before its last block's page")
        v = torch.empty(0, dtype=attn.dtype, device=t.device)
        v.set_(t.untyped_storage(), off // attn.element_size(), attn.shape, attn.stride())
        out[name] = v
    return out


def _window(spec: Any, kind: str) -> tuple[int, int]:
    if kind.startswith("sliding_window("):
        return int(spec.sliding_window), int(getattr(spec, "extra_retained_tokens", 0) or 0)
    if kind.startswith("chunked_local("):
        return 0, int(spec.attention_chunk_size)
    return 0, 0
