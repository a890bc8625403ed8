"""A do-nothing vLLM KV connector that logs every call it receives.

Load it with
    kv_transfer_config={"kv_connector": "ProbeConnector",
                        "kv_connector_module_path": "probe_connector",   # or tests.e2e.probe_connector
                        "kv_role": "kv_both"}
and set KVBM_PROBE_LOG=/path/to/log.jsonl (default /tmp/kvbm-probe.jsonl).
Every process (frontend, EngineCore/scheduler, worker) appends one JSON object
per call: {"t", "pid", "role", "seq", "m": method, ...details}.

It never reports external hits (get_num_new_matched_tokens -> (0, False)),
never delays frees (request_finished -> (False, None)) and moves no data.
Methods of the installed base class that are not overridden explicitly are
wrapped automatically, so calls added in newer vLLM versions show up too.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import json
import os
import threading
import time
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

_LOCK = threading.Lock()
_SEQ = [0]


def _log_path() -> str:
    return os.environ.get("KVBM_PROBE_LOG", "/tmp/kvbm-probe.jsonl")


def _emit(role: str | None, method: str, **kw: Any) -> None:
    with _LOCK:
        _SEQ[0] += 1
        rec = {"t": time.time(), "pid": os.getpid(), "role": role, "seq": _SEQ[0], "m": method}
        rec.update(kw)
        line = json.dumps(rec, default=_fallback) + "\n"
        with open(_log_path(), "a") as f:
            f.write(line)


def _fallback(o: Any) -> Any:
    return _summ(o)


def _tensor(t: torch.Tensor) -> dict[str, Any]:
    d: dict[str, Any] = {
        "tensor": True,
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "dtype": str(t.dtype),
        "device": str(t.device),
        "contig": t.is_contiguous(),
    }
    try:
        d["data_ptr"] = t.data_ptr()
        d["storage_ptr"] = t.untyped_storage().data_ptr()
        d["storage_nbytes"] = t.untyped_storage().nbytes()
        d["storage_offset"] = t.storage_offset()
    except Exception as e:  # noqa: BLE001
        d["ptr_err"] = repr(e)
    if t.numel() and t.numel() <= 16:
        d["values"] = t.tolist()
    return d


def _summ(o: Any, depth: int = 0, maxlist: int = 24) -> Any:
    """JSON-friendly summary of arbitrary vLLM objects."""
    if depth > 4:
        return f"<{type(o).__name__}>"
    if o is None or isinstance(o, (bool, int, float, str)):
        return o
    if isinstance(o, bytes):
        return {"bytes": len(o), "hex": o[:16].hex()}
    if isinstance(o, torch.Tensor):
        return _tensor(o)
    if isinstance(o, enum.Enum):
        return f"{type(o).__name__}.{o.name}"
    if isinstance(o, dict):
        items = list(o.items())
        out = {str(k): _summ(v, depth + 1, maxlist) for k, v in items[:maxlist]}
        if len(items) > maxlist:
            out["__more__"] = len(items) - maxlist
        return out
    if isinstance(o, (list, tuple, set, frozenset)) or type(o).__name__ == "ConstantList":
        seq = list(o)
        out = [_summ(v, depth + 1, maxlist) for v in seq[:maxlist]]
        if len(seq) > maxlist:
            out.append(f"... (+{len(seq) - maxlist}, len={len(seq)})")
        return out
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        d = {"__type__": type(o).__name__}
        for f in dataclasses.fields(o):
            try:
                d[f.name] = _summ(getattr(o, f.name), depth + 1, maxlist)
            except Exception as e:  # noqa: BLE001
                d[f.name] = f"<err {e!r}>"
        return d
    return f"<{type(o).__module__}.{type(o).__name__}>"


def _request(req: Any) -> dict[str, Any]:
    """Attributes of a vllm.v1.request.Request a scheduler connector may use."""
    d: dict[str, Any] = {"__type__": type(req).__name__}
    for name in (
        "request_id", "status", "num_tokens", "num_prompt_tokens", "num_computed_tokens",
        "num_output_tokens", "cache_salt", "lora_request", "kv_transfer_params",
        "num_preemptions", "skip_reading_prefix_cache", "priority", "client_index",
        "num_publishable_block_hashes", "max_tokens",
    ):
        if hasattr(req, name):
            try:
                d[name] = _summ(getattr(req, name))
            except Exception as e:  # noqa: BLE001
                d[name] = f"<err {e!r}>"
        else:
            d[name] = "<MISSING>"
    for name in ("all_token_ids", "prompt_token_ids", "output_token_ids"):
        v = getattr(req, name, "<MISSING>")
        if isinstance(v, str):
            d[name] = v
        elif v is None:
            d[name] = None
        else:
            v = list(v)
            d[name] = {"type": type(getattr(req, name)).__name__, "len": len(v), "head": v[:8], "tail": v[-4:]}
    bh = getattr(req, "block_hashes", "<MISSING>")
    if isinstance(bh, str):
        d["block_hashes"] = bh
    else:
        bh = list(bh)
        d["block_hashes"] = {
            "len": len(bh),
            "elem_type": type(bh[0]).__name__ if bh else None,
            "first": _summ(bh[0]) if bh else None,
            "last": _summ(bh[-1]) if bh else None,
        }
    sp = getattr(req, "sampling_params", None)
    if sp is not None:
        d["sampling_params.extra_args"] = _summ(getattr(sp, "extra_args", None))
    return d


def _sched_output(so: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"__type__": type(so).__name__}
    if dataclasses.is_dataclass(so):
        d["__fields__"] = [f.name for f in dataclasses.fields(so)]
    new = []
    for r in so.scheduled_new_reqs:
        e = {}
        if dataclasses.is_dataclass(r):
            e["__fields__"] = [f.name for f in dataclasses.fields(r)]
        e["req_id"] = r.req_id
        ptids = getattr(r, "prompt_token_ids", None)
        e["prompt_token_ids"] = None if ptids is None else {"len": len(ptids), "head": list(ptids[:8])}
        e["block_ids"] = _summ(r.block_ids)
        e["num_computed_tokens"] = r.num_computed_tokens
        e["lora_request"] = _summ(getattr(r, "lora_request", "<MISSING>"))
        pf = getattr(r, "prefill_token_ids", "<MISSING>")
        e["prefill_token_ids"] = pf if isinstance(pf, str) or pf is None else {"len": len(pf)}
        new.append(e)
    d["scheduled_new_reqs"] = new
    c = so.scheduled_cached_reqs
    cd: dict[str, Any] = {"__type__": type(c).__name__}
    if dataclasses.is_dataclass(c):
        cd["__fields__"] = [f.name for f in dataclasses.fields(c)]
    cd["req_ids"] = list(c.req_ids)
    cd["resumed_req_ids"] = sorted(getattr(c, "resumed_req_ids", []) or [])
    cd["new_block_ids"] = _summ(c.new_block_ids)
    cd["num_computed_tokens"] = list(c.num_computed_tokens)
    cd["num_output_tokens"] = _summ(getattr(c, "num_output_tokens", "<MISSING>"))
    cd["new_token_ids"] = [len(x) for x in getattr(c, "new_token_ids", [])]
    atid = getattr(c, "all_token_ids", "<MISSING>")
    cd["all_token_ids"] = atid if isinstance(atid, str) else {k: len(v) for k, v in atid.items()}
    d["scheduled_cached_reqs"] = cd
    for name in (
        "num_scheduled_tokens", "total_num_scheduled_tokens", "finished_req_ids", "preempted_req_ids",
        "has_sync_kv_loads", "new_block_ids_to_zero", "kv_cache_block_copies", "kv_connector_block_state",
        "num_common_prefix_blocks", "scheduled_spec_decode_tokens",
    ):
        d[name] = _summ(getattr(so, name, "<MISSING>"))
    return d


def _kv_cache_config(kc: Any) -> Any:
    if kc is None:
        return None
    d: dict[str, Any] = {"__type__": type(kc).__name__, "num_blocks": getattr(kc, "num_blocks", None)}
    if dataclasses.is_dataclass(kc):
        d["__fields__"] = [f.name for f in dataclasses.fields(kc)]
        for f in dataclasses.fields(kc):
            if f.name not in ("kv_cache_tensors", "kv_cache_groups", "num_blocks"):
                d[f.name] = _summ(getattr(kc, f.name))
    # vLLM 0.32: KVCacheTensor(size, layers, layer_stride, block_stride, offset, host_resident);
    # older: KVCacheTensor(size, shared_by)
    d["kv_cache_tensors"] = [_summ(t) for t in getattr(kc, "kv_cache_tensors", [])]
    groups = []
    for g in getattr(kc, "kv_cache_groups", []):
        spec = g.kv_cache_spec
        sd = {"layer_names": list(g.layer_names), "spec_type": type(spec).__name__}
        for a in ("block_size", "num_kv_heads", "head_size", "dtype", "page_size_bytes", "sliding_window",
                  "real_page_size_bytes", "page_size_padded"):
            if hasattr(spec, a):
                try:
                    sd[a] = _summ(getattr(spec, a)) if a != "dtype" else str(getattr(spec, a))
                except Exception as e:  # noqa: BLE001
                    sd[a] = f"<err {e!r}>"
        groups.append(sd)
    d["kv_cache_groups"] = groups
    for a in ("prefix_cacheable_group_ids", "transfer_group_ids"):
        if hasattr(kc, a):
            d[a] = _summ(getattr(kc, a))
    return d


@dataclasses.dataclass
class ProbeMetadata(KVConnectorMetadata):
    step: int
    built_pid: int
    built_obj_id: int
    req_ids: list[str]
    new_block_ids: dict[str, Any]
    loads: dict[str, Any] = dataclasses.field(default_factory=dict)


class ProbeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._rname = role.name
        self._step = 0
        self._layer_calls: dict[str, int] = {}
        # KVBM_PROBE_FAKE_HIT=sync|async: claim an external hit (no data moved!) for a
        # prompt seen before, to observe the load-path call order. Output is garbage then.
        self._fake = os.environ.get("KVBM_PROBE_FAKE_HIT", "")
        self._seen_prompts: set[tuple[int, ...]] = set()
        self._pending_loads: dict[str, Any] = {}
        self._worker_async_loads: set[str] = set()
        cc = vllm_config.cache_config
        self._bs = cc.block_size
        ktc = vllm_config.kv_transfer_config
        _emit(
            self._rname, "__init__",
            ctor_sig=str(inspect.signature(KVConnectorBase_V1.__init__)),
            block_size=cc.block_size,
            cache_dtype=str(cc.cache_dtype),
            enable_prefix_caching=cc.enable_prefix_caching,
            num_gpu_blocks=getattr(cc, "num_gpu_blocks", None),
            num_gpu_blocks_override=getattr(cc, "num_gpu_blocks_override", None),
            model_dtype=str(vllm_config.model_config.dtype),
            model=vllm_config.model_config.model,
            hash_algo=getattr(cc, "prefix_caching_hash_algo", None),
            kv_transfer_config=_summ(ktc),
            parallel=dict(
                tp=vllm_config.parallel_config.tensor_parallel_size,
                pp=vllm_config.parallel_config.pipeline_parallel_size,
                executor=str(vllm_config.parallel_config.distributed_executor_backend),
                world_size=vllm_config.parallel_config.world_size,
            ),
            kv_events_config=_summ(getattr(vllm_config, "kv_events_config", None)),
            use_v2_model_runner=_safe(lambda: vllm_config.use_v2_model_runner),
            kv_cache_config=_kv_cache_config(kv_cache_config),
            env={k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "KVBM_", "OMP_", "PYTHONHASHSEED"))},
        )

    # ---------------- worker side ----------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = {}
        storages: dict[int, list[str]] = {}
        for name, t in kv_caches.items():
            if isinstance(t, torch.Tensor):
                layers[name] = _tensor(t)
                storages.setdefault(t.untyped_storage().data_ptr(), []).append(name)
            else:
                layers[name] = _summ(t)
        _emit(self._rname, "register_kv_caches", n_layers=len(kv_caches), layers=layers,
              shared_storages=[v for v in storages.values() if len(v) > 1],
              dict_type=type(kv_caches).__name__)

    def register_cross_layers_kv_cache(self, kv_cache: torch.Tensor, attn_backend: Any) -> None:
        _emit(self._rname, "register_cross_layers_kv_cache", kv_cache=_tensor(kv_cache),
              attn_backend=getattr(attn_backend, "__name__", str(attn_backend)))

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        _emit(self._rname, "set_host_xfer_buffer_ops", op=getattr(copy_operation, "__qualname__", str(copy_operation)))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        m = connector_metadata
        _emit(self._rname, "bind_connector_metadata", meta_type=type(m).__name__,
              meta_step=getattr(m, "step", None), built_pid=getattr(m, "built_pid", None),
              same_object=(getattr(m, "built_obj_id", None) == id(m)),
              req_ids=getattr(m, "req_ids", None))
        self._layer_calls = {}
        loads = getattr(m, "loads", None) or {}
        if loads:
            _emit(self._rname, "bind_connector_metadata.loads", loads=loads)
            self._worker_async_loads.update(k for k, v in loads.items() if v.get("async"))
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        _emit(self._rname, "clear_connector_metadata", layer_calls=self._layer_calls)
        super().clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        _emit(self._rname, "handle_preemptions", meta_type=type(kv_connector_metadata).__name__,
              meta_step=getattr(kv_connector_metadata, "step", None))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        am = getattr(forward_context, "attn_metadata", "<MISSING>")
        info: Any
        if isinstance(am, dict):
            k0 = next(iter(am), None)
            info = {"type": "dict", "n": len(am), "first_key": k0,
                    "first_type": type(am[k0]).__name__ if k0 is not None else None}
        elif isinstance(am, list):
            info = {"type": "list", "n": len(am)}
        else:
            info = type(am).__name__
        _emit(self._rname, "start_load_kv", fc_type=type(forward_context).__name__, attn_metadata=info,
              kwargs=list(kwargs), has_meta=self.has_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._layer_calls["wait_for_layer_load"] = self._layer_calls.get("wait_for_layer_load", 0) + 1
        if self._layer_calls["wait_for_layer_load"] <= 1:
            _emit(self._rname, "wait_for_layer_load", layer_name=layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._layer_calls["save_kv_layer"] = self._layer_calls.get("save_kv_layer", 0) + 1
        if self._layer_calls["save_kv_layer"] <= 1:
            sm = getattr(attn_metadata, "slot_mapping", None)
            fields = None
            if dataclasses.is_dataclass(attn_metadata):
                fields = [f.name for f in dataclasses.fields(attn_metadata)]
            _emit(self._rname, "save_kv_layer", layer_name=layer_name,
                  kv_layer=_tensor(kv_layer) if isinstance(kv_layer, torch.Tensor) else _summ(kv_layer),
                  attn_metadata_type=type(attn_metadata).__name__, attn_metadata_fields=fields,
                  slot_mapping=_tensor(sm) if isinstance(sm, torch.Tensor) else _summ(sm),
                  kwargs=list(kwargs))

    def wait_for_save(self) -> None:
        _emit(self._rname, "wait_for_save", layer_calls=self._layer_calls)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        recv = self._worker_async_loads
        self._worker_async_loads = set()
        _emit(self._rname, "get_finished", finished_req_ids=sorted(finished_req_ids), reporting_recving=sorted(recv))
        return None, (recv or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        _emit(self._rname, "get_block_ids_with_load_errors")
        return set()

    # ---------------- scheduler side ----------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        _emit(self._rname, "get_num_new_matched_tokens", num_computed_tokens=num_computed_tokens,
              request=_request(request))
        if self._fake and tuple(request.prompt_token_ids or ()) in self._seen_prompts:
            n = ((request.num_tokens - 1) // self._bs) * self._bs - num_computed_tokens
            if n > 0:
                _emit(self._rname, "fake_hit", req_id=request.request_id, n=n, mode=self._fake)
                return n, self._fake == "async"
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        b: dict[str, Any] = {"type": type(blocks).__name__}
        try:
            b["block_ids"] = _summ(blocks.get_block_ids(), maxlist=64)
        except Exception as e:  # noqa: BLE001
            b["block_ids_err"] = repr(e)
        try:
            b["unhashed"] = _summ(blocks.get_unhashed_block_ids(), maxlist=64)
        except Exception as e:  # noqa: BLE001
            b["unhashed_err"] = repr(e)
        _emit(self._rname, "update_state_after_alloc", req_id=request.request_id,
              num_external_tokens=num_external_tokens, blocks=b,
              req_num_computed_tokens=request.num_computed_tokens)
        if num_external_tokens > 0:
            self._pending_loads[request.request_id] = {
                "n": num_external_tokens, "async": self._fake == "async",
                "block_ids": _summ(blocks.get_block_ids(), maxlist=64)}

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self._step += 1
        so = _sched_output(scheduler_output)
        req_ids = [r["req_id"] for r in so["scheduled_new_reqs"]] + so["scheduled_cached_reqs"]["req_ids"]
        nb = {r["req_id"]: r["block_ids"] for r in so["scheduled_new_reqs"]}
        meta = ProbeMetadata(step=self._step, built_pid=os.getpid(), built_obj_id=0, req_ids=req_ids,
                             new_block_ids=nb)
        meta.built_obj_id = id(meta)
        meta.loads, self._pending_loads = self._pending_loads, {}
        _emit(self._rname, "build_connector_meta", step=self._step, scheduler_output=so)
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        _emit(self._rname, "request_finished", block_ids=_summ(block_ids, maxlist=64), request=_request(request))
        self._seen_prompts.add(tuple(request.prompt_token_ids or ()))
        return False, None

    def update_connector_output(self, connector_output: Any) -> None:
        _emit(self._rname, "update_connector_output", out=_summ(connector_output))

    def take_events(self):  # noqa: ANN201
        return ()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        _emit(None, "get_required_kvcache_layout(cls)")
        return None


def _safe(fn: Any) -> Any:
    try:
        return _summ(fn())
    except Exception as e:  # noqa: BLE001
        return f"<err {e!r}>"


# Wrap every other public method of the installed base class so new hooks show up.
_SKIP = {"__init__", "take_events"}


def _make_wrapper(name: str, base_fn: Any) -> Any:
    def wrapper(self, *args: Any, **kwargs: Any) -> Any:
        res = base_fn(self, *args, **kwargs)
        _emit(getattr(self, "_rname", None), name, auto=True,
              args=_summ(list(args)), kwargs=_summ(kwargs), ret=_summ(res))
        return res

    wrapper.__name__ = name
    return wrapper


for _name, _attr in list(vars(KVConnectorBase_V1).items()):
    if _name.startswith("__") or _name in _SKIP or _name in vars(ProbeConnector):
        continue
    if isinstance(_attr, (classmethod, staticmethod, property)):
        continue
    if _name in ("_get_connector_metadata", "has_connector_metadata", "role"):
        continue
    if inspect.isfunction(_attr):
        setattr(ProbeConnector, _name, _make_wrapper(_name, _attr))

# Which processes import this module (frontend, EngineCore, worker)?
_emit(None, "module_import")
