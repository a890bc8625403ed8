"""The model's identity in the block fingerprint: new weights under the same
path or hub id never match the old weights' stored KV (kvbm._model_digest,
through both engines' adapters into the worker's fingerprint)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from kvbm import _model_digest
from kvbm._core import Worker
from kvbm.trtllm_integration.connector._common import model_identity as trtllm_identity
from kvbm.vllm_integration.connector._common import _model_identity as vllm_identity
from test_core import BS, describe, env, flash_attn_caches  # noqa: F401 - env is a fixture

MiB = 1 << 20


def fingerprint(model: str) -> str:
    """The worker's fingerprint with the vLLM adapter's model identity; the
    TensorRT-LLM adapter's identity is the same string."""
    ident = vllm_identity(SimpleNamespace(model_config=SimpleNamespace(model=model, revision=None)))
    assert ident == trtllm_identity(SimpleNamespace(model=model))
    caches = flash_attn_caches()
    w = Worker(tensors=describe(caches), kind="flash_attn", num_blocks=caches[0].shape[1], block_size=BS,
               dtype_bytes=caches[0].itemsize, model=ident, dtype="torch.bfloat16")
    try:
        return w.info()["fingerprint"]
    finally:
        w.close()


def write_model(d, *, layers=2, shards=(b"A" * 64, b"B" * 64), index=True, generation=None):
    d.mkdir(parents=True, exist_ok=True)
    for p in d.iterdir():
        p.unlink()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": layers}))
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for n, data in zip(names, shards):
        (d / n).write_bytes(data)
    if index:
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": sum(map(len, shards))},
                        "weight_map": {f"w{i}": n for i, n in enumerate(names)}}))
    if generation is not None:
        (d / "generation_config.json").write_text(json.dumps(generation))


def test_new_weights_under_the_same_path_change_the_fingerprint(env, tmp_path):
    d = tmp_path / "llama"
    write_model(d)
    ref = fingerprint(str(d))
    os.utime(d / "config.json", (1, 1))  # times and copies do not matter, contents do
    assert fingerprint(str(d)) == ref, "same content, same fingerprint"

    changes = {
        "config.json": dict(layers=3),
        "index": dict(shards=(b"A" * 64, b"B" * 64, b"C" * 64)),
        "shard head, same config and index": dict(shards=(b"X" * 64, b"B" * 64)),
        "generation_config.json": dict(generation={"temperature": 0.6}),
    }
    seen = {ref: "reference"}
    for what, kw in changes.items():
        write_model(d, **kw)
        fp = fingerprint(str(d))
        assert fp not in seen, f"{what}: same fingerprint as {seen.get(fp)}"
        seen[fp] = what
    write_model(d)
    assert fingerprint(str(d)) == ref, "the first content again"


def test_without_an_index_each_weight_file_head_and_size_count(env, tmp_path):
    d = tmp_path / "m"
    big = b"h" * MiB + b"tail"
    write_model(d, index=False, shards=(big,))
    ref = fingerprint(str(d))
    write_model(d, index=False, shards=(b"H" + big[1:],))
    assert fingerprint(str(d)) != ref, "first MiB"
    write_model(d, index=False, shards=(big + b"!",))
    assert fingerprint(str(d)) != ref, "size"
    # Bytes past the first MiB are not read (weights are never hashed whole):
    # the documented limit.
    write_model(d, index=False, shards=(big[:-4] + b"TAIL",))
    assert fingerprint(str(d)) == ref


def test_identity_names_the_revision_and_the_hub_snapshot(tmp_path, monkeypatch):
    sha_a, sha_b = "a" * 40, "b" * 40
    repo = tmp_path / "hub" / "models--org--tiny"
    for sha in (sha_a, sha_b):
        write_model(repo / "snapshots" / sha)
    a = _model_digest.model_identity(str(repo / "snapshots" / sha_a))
    b = _model_digest.model_identity(str(repo / "snapshots" / sha_b))
    digest = _model_digest.files_digest(str(repo / "snapshots" / sha_a))
    assert a == f"{repo}/snapshots/{sha_a}#snapshot={sha_a}#files={digest}"
    assert b.endswith(f"#snapshot={sha_b}#files={digest}")  # same files, another commit

    # A hub id resolves to the snapshot the local cache holds (refs/main), never the network.
    hub = pytest.importorskip("huggingface_hub")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha_b)
    monkeypatch.setattr(hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert _model_digest.model_identity("org/tiny") == f"org/tiny#snapshot={sha_b}#files={digest}"
    assert _model_digest.model_identity("org/tiny", sha_a) == f"org/tiny@{sha_a}#files={digest}"
    assert _model_digest.model_identity("org/absent", "v1") == "org/absent@v1"
    vllm = SimpleNamespace(model_config=SimpleNamespace(model="org/tiny", revision=None),
                           load_config=SimpleNamespace(download_dir=str(tmp_path / "elsewhere")))
    assert vllm_identity(vllm) == "org/tiny", "the engine's download directory, not the default cache"


def test_files_digest_golden_vector(tmp_path):
    """The digest's encoding is part of every stored block's key: changing it
    orphans all stored KV, so it changes only deliberately (with
    DIGEST_VERSION)."""
    d = tmp_path / "m"
    write_model(d, generation={"temperature": 0.6})
    (d / "tokenizer.json").write_text("{}")  # not an identity file
    assert _model_digest.files_digest(str(d)) == "fc3d90d64d38fac3c7cdb3847a8fa470"
    assert _model_digest.files_digest(str(tmp_path / "absent")) == ""
    (tmp_path / "empty").mkdir()
    assert _model_digest.files_digest(str(tmp_path / "empty")) == ""
