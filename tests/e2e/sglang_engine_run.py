"""One SGLang engine run for tests/e2e/test_sglang_engine_e2e.py: a tiny model
on SGLang's CPU backend with HiCache and kvbm as its storage backend (L3);
serves one prompt and prints the result as JSON on the last line.

    python sglang_engine_run.py MODEL_DIR KVBM_DIR
"""

from __future__ import annotations

import json
import sys

PROMPT = "the quick brown fox jumps over the lazy dog " * 6


def main() -> None:
    import sglang as sgl

    model, kvbm_dir = sys.argv[1], sys.argv[2]
    extra = {"backend_name": "kvbm", "module_path": "kvbm.sglang_integration", "class_name": "KvbmHiCacheStorage",
             "interface_v1": 1, "prefetch_threshold": 16, "DYN_KVBM_DISK_CACHE_DIR": kvbm_dir,
             "DYN_KVBM_DISK_CACHE_GB": 0.05, "DYN_KVBM_STORAGE_SECRET": "sglang-e2e-test-secret",
             "DYN_KVBM_DISK_DISABLE_O_DIRECT": "true"}
    llm = sgl.Engine(model_path=model, device="cpu", attention_backend="torch_native", dtype="float32",
                     disable_cuda_graph=True, page_size=16, max_total_tokens=4096, enable_hierarchical_cache=True,
                     hicache_ratio=2.0, hicache_write_policy="write_through", hicache_io_backend="direct",
                     hicache_mem_layout="layer_first", hicache_storage_prefetch_policy="wait_complete",
                     hicache_storage_backend="dynamic", hicache_storage_backend_extra_config=json.dumps(extra),
                     log_level="info")
    try:
        out = llm.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0})
    finally:
        llm.shutdown()
    meta = out["meta_info"]
    print(json.dumps({"ids": out["output_ids"], "prompt_tokens": meta["prompt_tokens"],
                      "cached": meta["cached_tokens"], "details": meta.get("cached_tokens_details")}))


if __name__ == "__main__":
    main()
