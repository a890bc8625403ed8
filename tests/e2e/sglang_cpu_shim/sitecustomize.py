"""Test shim that lets SGLang 0.5.23's HiCache run on a machine without CUDA
(tests/e2e/test_sglang_engine_e2e.py puts this directory on PYTHONPATH, so every
SGLang process imports it at start).

Two pieces of HiCache need CUDA whatever the device: its host pool registers
its memory with cudaHostRegister (pool_host/common.py, _cuda_host_register),
and its copies between device and host memory are sgl_kernel ops, which PyPI
ships as CUDA builds only. The shim makes the registration a no-op and gives
the direct layer-first copy (transfer_kv_direct: per layer, rows at
src_indices to rows at dst_indices) a torch implementation. Everything else,
the engine, scheduler, radix cache, HiCache controller and kvbm's storage
backend, is SGLang's and kvbm's own code.
"""
import importlib.abc, importlib.machinery, sys


def _transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size=None, **_):
    import torch

    for src, dst in zip(src_layers, dst_layers):
        si = src_indices.to(src.device, torch.int64)
        di = dst_indices.to(dst.device, torch.int64)
        dst.index_copy_(0, di, src.index_select(0, si).to(dst.device))


_PATCHES = {
    "sglang.srt.mem_cache.pool_host.common": {"_cuda_host_register": lambda *a, **k: None},
    "sglang.srt.mem_cache.pool_host.mha": {"transfer_kv_direct": _transfer_kv_direct},
}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patches = _PATCHES.get(name)
        if patches is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        orig = spec.loader.exec_module

        def exec_module(module):
            orig(module)
            for k, v in patches.items():
                setattr(module, k, v)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
