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


@pytest.fixture
def host_lib_named_cuda(tmp_path):
    """The host build copied under the CUDA variant's file name."""
    dst = tmp_path / "libkvbm_cuda.so"
    shutil.copy(LIB, dst)
    return str(dst)


# A KV cache tensor of vLLM's flash-attention layout on a device that is not
# the CPU (torch's meta device: no memory, any process), as the vLLM worker
# sees a GPU one.
VLLM_DESCRIBE = """
    import torch
    from kvbm import _native
    from kvbm.testing.vllm_fakes import vllm_config
    from kvbm.vllm_integration.connector.vllm_worker import VllmConnectorWorker

    kv = {f"model.layers.{i}.self_attn.attn": torch.empty((2, 8, 4, 2, 8), dtype=torch.float16, device="meta")
          for i in range(2)}
    w = VllmConnectorWorker(vllm_config(4))
    print("variant", _native.build_info()["variant"], "loaded", _native.loaded_path())
    try:
        _, kind, _ = w._describe_caches(kv)
        print("accepted", kind)
    except ValueError as e:
        print("refused", e)
"""


def test_host_library_under_a_cuda_name_reports_host(host_lib_named_cuda):
    out = run_py("""
        from kvbm import _native
        info = _native.build_info()
        print(info["variant"], _native.has_cuda(), info["version"] == _native.version())
    """, host_lib_named_cuda)
    assert out.split() == ["host", "False", "True"]


def test_vllm_adapter_refuses_gpu_tensors_with_the_host_build_whatever_its_name(host_lib_named_cuda):
    out = run_py(VLLM_DESCRIBE, host_lib_named_cuda)
    assert f"variant host loaded {host_lib_named_cuda}" in out
    assert "refused" in out and "is the host build, without CUDA support" in out, out


def test_vllm_adapter_follows_the_library_answer_not_the_file_name():
    """The default file name (libkvbm.so) with a library answering "cuda"
    (its answer stood in for: building the CUDA variant needs CUDA headers):
    the adapter hands the GPU tensors on."""
    code = textwrap.dedent("""
        from kvbm import _native
        _native._build_info = {"variant": "cuda", "version": _native.version(), "go": ""}
    """) + textwrap.dedent(VLLM_DESCRIBE)
    out = run_py(code, LIB)
    assert f"variant cuda loaded {LIB}" in out
    assert "accepted flash_attn" in out, out


def test_trtllm_adapter_refuses_gpu_tensors_with_the_host_build_whatever_its_name(host_lib_named_cuda):
    out = run_py("""
        import torch
        from trtllm_contract import make_llm_args
        from kvbm.trtllm_integration.connector import DynamoKVBMConnectorWorker

        w = DynamoKVBMConnectorWorker(make_llm_args({"bs": 4, "tp": 1}))
        w.register_kv_caches(torch.empty((8, 2, 2, 64), dtype=torch.float16, device="meta"))
        print("worker", w._worker, "reason", w._disabled_reason)
    """, host_lib_named_cuda)
    assert "worker None" in out
    assert "is the host build, without CUDA support" in out, out
