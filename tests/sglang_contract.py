"""kvbm as SGLang HiCache's storage backend, against SGLang's real classes.

Everything here uses the PyPI ``sglang`` package itself (installed without its
CUDA kernels by .ci/python-deps.sh): the backend is created by SGLang's own
``StorageBackendFactory`` from a ``dynamic`` config, pages live in SGLang's
real host pool (``MHATokenToKVPoolHost`` on CPU tensors, page-first and
layer-first layouts), and pages move through the controller's own methods
(``HiCacheController._storage_hit_query`` with SGLang's page-key hashing,
``_page_backup`` / ``_page_set_zero_copy`` / ``_page_get_zero_copy`` and the
generic ``_generic_page_set`` / ``_generic_page_get``), called on a minimal
controller object holding only what they read.

Run by tests/test_sglang_backend.py in a pytest process of its own: importing
sglang patches transformers process-wide (sglang/__init__.py), which must not
leak into the vLLM tests of the main run. Directly:
``python -m pytest tests/sglang_contract.py``. Without sglang the module is
skipped with a reason, except under CI where it fails: CI installs it.
"""

from __future__ import annotations

import inspect
import os
import types

import pytest

if os.environ.get("CI"):
    import sglang  # noqa: F401  (CI installs it: its absence is a failure there)
sglang = pytest.importorskip("sglang", reason="sglang not installed: .ci/python-deps.sh installs it (--no-deps)")

import torch  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvbm import KvbmError  # noqa: E402
from kvbm.sglang_integration import KvbmHiCacheStorage  # noqa: E402

LAYERS, HEADS, DIM, PAGE, TOKENS = 2, 2, 8, 4, 64
SECRET = "sglang-backend-test-secret"


def host_pool(layout: str) -> MHATokenToKVPoolHost:
    """SGLang's real MHA host pool, on CPU, over small device buffers (CPU too)."""
    k = tuple(torch.zeros(TOKENS, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS))
    v = tuple(torch.zeros(TOKENS, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS))

    def ptrs(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD),
        page_size=PAGE, head_num=HEADS, head_dim=DIM, v_head_dim=DIM, dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS)


def storage_config(tmp_path, layout: str, *, model: str = "test/model", extra=None, **kw) -> HiCacheStorageConfig:
    d = tmp_path / "kvbm"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    cfg = {
        "backend_name": "kvbm",
        "module_path": "kvbm.sglang_integration",
        "class_name": "KvbmHiCacheStorage",
        "interface_v1": 1,
        "DYN_KVBM_DISK_CACHE_DIR": str(d),
        "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": 64,
        "DYN_KVBM_STORAGE_SECRET": SECRET,
    }
    cfg.update(extra or {})
    args = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                enable_storage_metrics=False, is_page_first_layout=layout == "page_first", model_name=model,
                extra_config=cfg)
    args.update(kw)
    return HiCacheStorageConfig(**args)


def attach(cfg: HiCacheStorageConfig, pool: MHATokenToKVPoolHost):
    """What HiCacheController.attach_storage_backend does: the factory, the
    host pool registration, then on_host_pools_registered."""
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def controller(backend, pool):
    """The state HiCacheController's storage methods read."""
    ns = types.SimpleNamespace(storage_backend=backend, storage_host_pool=pool, mem_pool_host=pool, page_size=PAGE)
    ns.page_set_func = types.MethodType(HiCacheController._page_set_zero_copy, ns)
    return ns


def fill(pool: MHATokenToKVPoolHost, indices: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for i in range(0, len(indices), PAGE):
        page = torch.randn(pool.get_dummy_flat_data_page().numel(), generator=g).to(torch.bfloat16)
        pool.set_from_flat_data_page(int(indices[i]), page)


def pages(pool: MHATokenToKVPoolHost, indices: torch.Tensor) -> list[torch.Tensor]:
    return [pool.get_data_page(int(indices[i]), flat=True).clone() for i in range(0, len(indices), PAGE)]


def backup(ctl, keys: list[str], host: torch.Tensor) -> int:
    op = types.SimpleNamespace(hash_value=keys, host_indices=host, prefix_keys=None, completed_tokens=0)
    HiCacheController._page_backup(ctl, op)
    return op.completed_tokens


def hit_query(ctl, tokens: list[int]) -> tuple[list[str], int]:
    op = types.SimpleNamespace(last_hash=None, token_ids=tokens, prefix_keys=None)
    return HiCacheController._storage_hit_query(ctl, op)


@pytest.fixture(autouse=True)
def _no_ambient_kvbm_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("DYN_KVBM_"):
            monkeypatch.delenv(k)


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
def test_backup_then_prefetch_byte_exact_and_across_restart(tmp_path, layout):
    pool = host_pool(layout)
    backend = attach(storage_config(tmp_path, layout), pool)
    assert isinstance(backend, KvbmHiCacheStorage)
    ctl = controller(backend, pool)

    tokens = list(range(1000, 1000 + 5 * PAGE))
    keys, hits = hit_query(ctl, tokens)
    assert (keys, hits) == ([], 0), "an empty store hits nothing"
    host = pool.alloc(5 * PAGE)
    fill(pool, host, seed=1)
    want = pages(pool, host)
    op = types.SimpleNamespace(last_hash=None, token_ids=tokens, prefix_keys=None)
    HiCacheController._storage_hit_query(ctl, op)
    all_keys = op.all_hash_values
    assert len(all_keys) == 5
    assert backup(ctl, all_keys, host) == 5 * PAGE

    keys, hits = hit_query(ctl, tokens)
    assert keys == all_keys and hits == 5 * PAGE
    # A longer request hits its stored prefix only.
    keys, hits = hit_query(ctl, tokens + list(range(7, 7 + 2 * PAGE)))
    assert keys == all_keys and hits == 5 * PAGE

    def prefetch(backend, pool) -> list[torch.Tensor]:
        dst = pool.alloc(5 * PAGE)
        fill(pool, dst, seed=99)  # not what was stored
        got = HiCacheController._page_get_zero_copy(controller(backend, pool), types.SimpleNamespace(request_id="r"),
                                                    all_keys, dst)
        assert got == 5
        return pages(pool, dst)

    for a, b in zip(want, prefetch(backend, pool)):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    backend.close()

    # A restart: a new backend object, a new host pool, the same directory.
    pool2 = host_pool(layout)
    backend2 = attach(storage_config(tmp_path, layout), pool2)
    assert backend2.kvbm_info()["recovered"] == 5
    keys, hits = hit_query(controller(backend2, pool2), tokens)
    assert hits == 5 * PAGE
    for a, b in zip(want, prefetch(backend2, pool2)):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    backend2.close()


def test_generic_interface_without_interface_v1(tmp_path):
    pool = host_pool("page_first")
    backend = attach(storage_config(tmp_path, "page_first", extra={"interface_v1": 0}), pool)
    ctl = controller(backend, pool)
    host = pool.alloc(2 * PAGE)
    fill(pool, host, seed=3)
    want = pages(pool, host)
    assert HiCacheController._generic_page_set(ctl, ["a", "b"], host)
    dst = pool.alloc(2 * PAGE)
    got = HiCacheController._generic_page_get(
        ctl, types.SimpleNamespace(request_id="r", is_terminated=lambda: False), ["a", "b", "c"], dst)
    assert got == 2
    for a, b in zip(want, pages(pool, dst)):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert backend.exists("a") and not backend.exists("c")
    backend.close()


def test_batch_exists_is_a_prefix(tmp_path):
    pool = host_pool("page_first")
    backend = attach(storage_config(tmp_path, "page_first"), pool)
    host = pool.alloc(3 * PAGE)
    fill(pool, host, seed=4)
    assert backend.batch_set_v1(["k0", "k1", "k2"], host) == [True] * 3
    assert backend.batch_exists(["k0", "k1", "k2", "k3"]) == 3
    assert backend.batch_exists(["k0", "kx", "k2"]) == 1
    assert backend.batch_exists(["kx", "k0"]) == 0
    assert backend.batch_exists([]) == 0
    backend.clear()
    assert backend.batch_exists(["k0"]) == 0
    backend.close()


def _corrupt_payload(path: str, slot_bytes: int, payload_at: int, slot: int) -> None:
    with open(path, "r+b") as f:
        f.seek(slot * slot_bytes + payload_at + 10)
        b = f.read(1)
        f.seek(slot * slot_bytes + payload_at + 10)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("restart", [False, True])
def test_corrupt_page_is_missing_never_returned(tmp_path, restart):
    pool = host_pool("page_first")
    backend = attach(storage_config(tmp_path, "page_first"), pool)
    host = pool.alloc(2 * PAGE)
    fill(pool, host, seed=5)
    want = pages(pool, host)
    assert backend.batch_set_v1(["p0", "p1"], host) == [True, True]
    info = backend.kvbm_info()
    page_bytes = info["page_bytes"]
    stride = -(-page_bytes // 4096) * 4096
    if restart:
        backend.close()
        backend = attach(storage_config(tmp_path, "page_first"), pool)
    # Slots are handed out from the file's start: p0 is slot 0.
    _corrupt_payload(info["path"], 4096 + stride, 4096, 0)
    dst = pool.alloc(2 * PAGE)
    fill(pool, dst, seed=77)
    before = pages(pool, dst)
    assert backend.batch_get_v1(["p0", "p1"], dst) == [False, True]
    got = pages(pool, dst)
    assert torch.equal(got[0].view(torch.int16), before[0].view(torch.int16)), "the corrupt page is not written"
    assert torch.equal(got[1].view(torch.int16), want[1].view(torch.int16))
    assert backend.batch_exists(["p0"]) == 0, "a page that failed is dropped"
    assert backend.kvbm_info()["corrupt"] == 1
    backend.close()


def test_identity_separates_setups(tmp_path):
    pool = host_pool("page_first")
    a = attach(storage_config(tmp_path, "page_first", model="model-a"), pool)
    host = pool.alloc(PAGE)
    fill(pool, host, seed=6)
    assert a.batch_set_v1(["k"], host) == [True]
    a.close()
    for cfg, p in [
        (storage_config(tmp_path, "page_first", model="model-b"), pool),
        (storage_config(tmp_path, "layer_first"), host_pool("layer_first")),
        (storage_config(tmp_path, "page_first", model="model-a", tp_size=2, tp_rank=1), pool),
    ]:
        b = attach(cfg, p)
        assert b.batch_exists(["k"]) == 0
        b.close()
    a = attach(storage_config(tmp_path, "page_first", model="model-a"), pool)
    assert a.batch_exists(["k"]) == 1
    a.close()


def test_new_weights_under_one_path_do_not_find_old_pages(tmp_path):
    """The model identity carries a digest of the checkpoint's config and
    weight-file heads when the model name is a local path."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"hidden_size": 16}')
    (ckpt / "model.safetensors").write_bytes(b"weights-v1" * 100)
    pool = host_pool("page_first")
    a = attach(storage_config(tmp_path, "page_first", model=str(ckpt)), pool)
    host = pool.alloc(PAGE)
    fill(pool, host, seed=12)
    assert a.batch_set_v1(["k"], host) == [True]
    a.close()
    b = attach(storage_config(tmp_path, "page_first", model=str(ckpt)), pool)
    assert b.batch_exists(["k"]) == 1, "the same checkpoint finds its pages"
    b.close()
    (ckpt / "model.safetensors").write_bytes(b"weights-v2" * 100)
    c = attach(storage_config(tmp_path, "page_first", model=str(ckpt)), pool)
    assert c.batch_exists(["k"]) == 0
    c.close()


def test_bad_settings_fail_at_attach_naming_them(tmp_path):
    pool = host_pool("page_first")
    with pytest.raises(KvbmError, match="DYN_KVBM_DISK_CACHE_GB"):
        attach(storage_config(tmp_path, "page_first", extra={"DYN_KVBM_DISK_CACHE_GB": "lots"}), pool)
    with pytest.raises(ValueError, match="disk_size"):
        attach(storage_config(tmp_path, "page_first", extra={"disk_size": 3}), pool)
    cfg = storage_config(tmp_path, "page_first")
    del cfg.extra_config["DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS"]
    with pytest.raises(KvbmError, match="DYN_KVBM_DISK_CACHE_GB"):
        attach(cfg, pool)
    with pytest.raises(ValueError, match="MLA.*DYN_KVBM_OBJECT_ENABLED"):
        attach(storage_config(tmp_path, "page_first", is_mla_model=True, tp_size=2), pool)


def _wait_exists(backend, keys: list[str], want: int) -> int:
    """batch_exists once the background uploads landed (bounded wait)."""
    import time

    deadline = time.monotonic() + 60
    while (n := backend.batch_exists(keys)) < want and time.monotonic() < deadline:
        time.sleep(0.1)
    return n


def test_object_tier_shares_pages_between_instances(tmp_path, s3_server):
    """G4 on a real S3 server: pages one instance backed up are found and
    read byte-exact by another instance with an empty disk tier (another
    host), through the same SGLang calls; with MLA and TP = 2 the non-writer
    rank finds the writer's pages there."""
    g4 = s3_server.env("kvbm-sglang")
    pool = host_pool("page_first")
    a = attach(storage_config(tmp_path / "a", "page_first", extra=g4), pool)
    host = pool.alloc(3 * PAGE)
    fill(pool, host, seed=11)
    want = pages(pool, host)
    assert a.batch_set_v1(["g0", "g1", "g2"], host) == [True] * 3

    pool_b = host_pool("page_first")
    b = attach(storage_config(tmp_path / "b", "page_first", extra=g4), pool_b)
    assert b.kvbm_info()["used"] == 0
    assert _wait_exists(b, ["g0", "g1", "g2", "g3"], 3) == 3
    dst = pool_b.alloc(3 * PAGE)
    assert b.batch_get_v1(["g0", "g1", "g2"], dst) == [True] * 3
    for x, y in zip(want, pages(pool_b, dst)):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    info = b.kvbm_info()
    assert info["object_hits"] == 3 and info["used"] == 3, info
    a.close()
    b.close()

    # MLA, TP = 2: rank 0 writes, rank 1 (no writes of its own) reads G4.
    mla = dict(is_mla_model=True, tp_size=2, model="mla-model", extra=g4)
    w = attach(storage_config(tmp_path / "w", "page_first", tp_rank=0, **mla), pool)
    r = attach(storage_config(tmp_path / "r", "page_first", tp_rank=1, **mla), pool_b)
    assert w.storage_config.is_storage_writer and not r.storage_config.is_storage_writer
    assert r.batch_set_v1(["m0"], host[:PAGE]) == [True]  # SGLang skips it for a reader; nothing stored
    assert r.kvbm_info()["used"] == 0
    assert w.batch_set_v1(["m0"], host[:PAGE]) == [True]
    assert _wait_exists(r, ["m0"], 1) == 1
    assert r.batch_get_v1(["m0"], dst[:PAGE]) == [True]
    assert torch.equal(pages(pool_b, dst[:PAGE])[0].view(torch.int16), want[0].view(torch.int16))
    w.close()
    r.close()


def test_pool_without_flat_pages_is_refused_at_attach(tmp_path):
    """A host pool kvbm cannot read whole pages of is refused by name when
    SGLang registers it, not at the first prefetch."""
    with pytest.raises(NotImplementedError, match="SimpleNamespace .*has no flat pages"):
        attach(storage_config(tmp_path, "page_first"), types.SimpleNamespace(page_size=PAGE))
    pool = host_pool("page_first")
    backend = attach(storage_config(tmp_path, "page_first"), pool)
    with pytest.raises(NotImplementedError, match="has no flat pages"):
        backend.register_mem_host_pool_v2(types.SimpleNamespace(page_size=1), PoolName.INDEXER)
    backend.close()


def test_signatures_match_sglang_base_class():
    """The methods SGLang calls keep the base class's parameters."""
    for name in ("batch_get_v1", "batch_set_v1", "batch_exists", "get", "set", "batch_get", "batch_set", "exists",
                 "clear", "get_stats", "register_mem_pool_host", "register_mem_host_pool_v2", "on_host_pools_registered",
                 "batch_exists_v2", "batch_get_v2", "batch_set_v2"):
        ours = list(inspect.signature(getattr(KvbmHiCacheStorage, name)).parameters)
        base = list(inspect.signature(getattr(HiCacheStorage, name)).parameters)
        assert ours == base, f"{name}: {ours} vs SGLang's {base}"
    assert not KvbmHiCacheStorage.__abstractmethods__


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct", "page_head"])
def test_page_segments_are_the_flat_page(layout):
    """The segments kvbm gathers are the bytes of SGLang's flat page, in order."""
    import ctypes

    from kvbm.sglang_integration.storage import segments

    pool = host_pool(layout)
    idx = pool.alloc(2 * PAGE)
    fill(pool, idx, seed=8)
    index = int(idx[PAGE])
    segs = segments(pool.get_data_page(index, flat=False))
    want = {"page_first": 2, "layer_first": 2 * LAYERS, "page_first_direct": 2, "page_head": 2}[layout]
    assert len(segs) == want
    got = b"".join(ctypes.string_at(a, n) for a, n in segs)
    assert got == pool.get_data_page(index, flat=True).contiguous().view(torch.uint8).numpy().tobytes()
