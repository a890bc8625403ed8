"""Which library variant is loaded is the library's own answer
(kvbm_build_info), not its file name: KVBM_LIBRARY may name any file, and
both adapters decide from that answer whether GPU tensors can be handed to
kvbm."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIB = os.path.join(ROOT, "python", "kvbm", "lib", "libkvbm.so")


def run_py(code, lib_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "python"), os.path.join(ROOT, "tests")]),
               KVBM_LIBRARY=lib_path, KVBM_DISABLE_CUDA="1")
    for k in [k for k in env if k.startswith("DYN_KVBM_")]:
        del env[k]
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def host_lib_named_cuda(tmp_path_factory):
    """The host build copied under the CUDA variant's file name."""
    dst = tmp_path_factory.mktemp("lib") / "libkvbm_cuda.so"
    shutil.copy(LIB, dst)
    return str(dst)


def test_host_library_under_a_cuda_name_reports_host(host_lib_named_cuda):
    out = run_py("""
        from kvbm import _native
        info = _native.build_info()
        print(info["variant"], _native.has_cuda(), info["version"] == _native.version())
    """, host_lib_named_cuda)
    assert out.split() == ["host", "False", "True"]


# KV cache tensors on a device that is not the CPU (torch's meta device: no
# memory), as a GPU's would be, handed to both adapters in this process,
# whose library is the host build: the library's answer is replaced where a
# test needs the CUDA build's, and the file-name guess (library_path) is
# made to say the opposite of the answer each time.

def vllm_describe():
    import torch

    from kvbm.testing.vllm_fakes import vllm_config
    from kvbm.vllm_integration.connector.vllm_worker import VllmConnectorWorker

    kv = {f"model.layers.{i}.self_attn.attn": torch.empty((2, 8, 4, 2, 8), dtype=torch.float16, device="meta")
          for i in range(2)}
    return VllmConnectorWorker(vllm_config(4))._describe_caches(kv)


def trtllm_register():
    import torch
    from trtllm_contract import make_llm_args

    from kvbm.trtllm_integration.connector import DynamoKVBMConnectorWorker

    w = DynamoKVBMConnectorWorker(make_llm_args({"bs": 4, "tp": 1}))
    w.register_kv_caches(torch.empty((8, 2, 2, 64), dtype=torch.float16, device="meta"))
    return w


@pytest.fixture
def answer(monkeypatch):
    from kvbm import _native

    assert _native.build_info()["variant"] == "host"  # the library of this process

    def set_answer(variant, name_says):
        monkeypatch.setattr(_native, "_build_info", dict(_native.build_info(), variant=variant))
        monkeypatch.setattr(_native, "library_path", lambda: (f"/x/{name_says}.so", name_says))
    return set_answer


def test_adapters_refuse_gpu_tensors_when_the_library_answers_host(answer):
    answer("host", "cuda")
    with pytest.raises(ValueError, match="is the host build, without CUDA support"):
        vllm_describe()
    w = trtllm_register()
    assert w._worker is None and "is the host build, without CUDA support" in (w._disabled_reason or "")


def test_adapters_take_gpu_tensors_when_the_library_answers_cuda(answer):
    """(The answer stood in for: building the CUDA variant needs CUDA headers.)"""
    answer("cuda", "custom")
    _, kind, _ = vllm_describe()
    assert kind == "flash_attn"
    w = trtllm_register()
    assert "CUDA" not in (w._disabled_reason or ""), w._disabled_reason


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_vllm_views_from_its_own_allocator_are_paged_on_a_gpu(answer, layout):
    """vLLM 0.32's model runners (GPU and CPU alike) view the KV cache as
    [num_blocks, kv_heads, block_size, 2 × head_dim] per layer
    (vllm.v1.worker.utils.allocate_kv_cache, in the backend's memory order):
    the worker takes those views on a GPU as on the CPU, as the paged kind."""
    pytest.importorskip("vllm")
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from kvbm.testing.vllm_fakes import vllm_config
    from kvbm.vllm_integration.connector.vllm_worker import VllmConnectorWorker

    answer("cuda", "custom")
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    spec = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float16)
    kvc = KVCacheConfig(num_blocks=8, kv_cache_tensors=[
        KVCacheTensor(size=spec.page_size_bytes * 8 * 2, layers=names, layer_stride=spec.page_size_bytes * 8,
                      block_stride=spec.page_size_bytes)], kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    kv = allocate_kv_cache(kvc, torch.device("meta"), KVCacheLayout[layout])
    assert all(t.device.type == "meta" and t.dim() == 4 for t in kv.values())
    tensors, kind, dtype_bytes = VllmConnectorWorker(vllm_config(4))._describe_caches(kv)
    assert kind == "cpu_paged" and dtype_bytes == 2
    assert [shape for _, shape, _ in tensors] == [[8, 2, 4, 16]] * 2
