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

Groups kvbm cannot serve yet (Mamba and other state-space or linear-attention
groups, whose state is not per token position) turn kvbm off for the engine
with a reason naming them; vLLM keeps its hybrid manager and serves the model.
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


def _served(kind: str) -> bool:
    return kind == "full_attention" or kind.startswith(("sliding_window(", "chunked_local("))


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
        return not any(w != (0, 0) for w in self.windows)

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
        why = (f"KV cache groups of kind {', '.join(unserved)} are not served by kvbm yet "
               f"(this model's groups: {what}); kvbm serves full, sliding-window and chunked local attention")
        state = [g.kv_cache_spec for g in groups if _is_state_spec(g.kv_cache_spec)]
        if state:
            why += "; " + state_groups_missing(state)
        return None, why
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


def state_groups_missing(specs: list[Any]) -> str:
    """What kvbm lacks to serve recurrent-state groups (docs/design.md §11),
    for the line that turns kvbm off."""
    modes = sorted({str(getattr(s, "mamba_cache_mode", "none")) for s in specs})
    if modes != ["align"]:
        return (f"with mamba_cache_mode={'/'.join(modes)} (prefix caching off) vLLM keeps only each "
                "request's running state, so no prefix of such a model can be stored or loaded")
    return ("a hit of N tokens on such a model needs each state group's state at the block boundary N "
            "(vLLM's mamba_cache_mode='align' state block, handed to connectors as the scheduler "
            "output's boundary_state_offloads); kvbm's tiers keep one block per token position "
            "holding every layer and do not store boundary states yet, so its hits could not be "
            "completed; vLLM's own prefix cache still serves the model")


def _window(spec: Any, kind: str) -> tuple[int, int]:
    if kind.startswith("sliding_window("):
        return int(spec.sliding_window), int(getattr(spec, "extra_retained_tokens", 0) or 0)
    if kind.startswith("chunked_local("):
        return 0, int(spec.attention_chunk_size)
    return 0, 0
