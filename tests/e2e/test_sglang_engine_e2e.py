"""A real SGLang engine with kvbm as HiCache's storage (L3), end to end: a
prompt served, the engine shut down, a new engine on the same kvbm directory
serves the same prompt with its prefix loaded from kvbm's persistent disk
tier (G3), and the output is identical.

SGLang's CPU backend serves a tiny random Llama (kvbm.testing.tiny_model) with
its torch-native attention; HiCache needs two CUDA-only pieces on this
CUDA-less machine, which tests/e2e/sglang_cpu_shim replaces (see its
docstring). Runs in .venv-sglang (SGLang 0.5.23 over .venv's packages, made by
.ci/python-deps.sh); without it this is skipped with that reason, except under
CI where it fails. Each engine start takes a minute or two on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SGLANG_PY = os.path.join(ROOT, ".venv-sglang", "bin", "python")
RECOVERED = re.compile(r"kvbm: SGLang HiCache storage \(kv pool\): .*, (\d+) pages of (\d+) bytes, (\d+) recovered")


def _run(model: str, kvbm_dir: str) -> tuple[dict, int]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(HERE, "sglang_cpu_shim"), os.path.join(ROOT, "python"),
                                         env.get("PYTHONPATH", "")])
    for k in list(env):
        if k.startswith("DYN_KVBM_"):
            del env[k]
    r = subprocess.run([SGLANG_PY, os.path.join(HERE, "sglang_engine_run.py"), model, kvbm_dir],
                       capture_output=True, text=True, timeout=900, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-8000:]
    m = RECOVERED.search(out)
    assert m, "kvbm's store did not open in SGLang's attach:\n" + out[-8000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), int(m.group(3))


def test_prompt_served_again_from_kvbm_g3_after_restart(tmp_path):
    if not os.path.exists(SGLANG_PY):
        why = "no .venv-sglang: .ci/python-deps.sh makes it (install_sglang_env)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    from kvbm.testing.tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path / "model"))
    kvbm_dir = tmp_path / "kvbm"
    kvbm_dir.mkdir(mode=0o700)

    first, recovered = _run(model, str(kvbm_dir))
    assert recovered == 0 and first["cached"] == 0, first
    full_pages = first["prompt_tokens"] // 16

    second, recovered = _run(model, str(kvbm_dir))
    # Every full page of the prompt was backed up to kvbm and survived the
    # restart; SGLang prefetched them from kvbm instead of computing them.
    assert recovered >= full_pages, (recovered, full_pages)
    assert second["cached"] >= full_pages * 16 - 16, second
    details = second["details"] or {}
    assert details.get("storage") == second["cached"], details  # SGLang's count of tokens from its L3
    assert details.get("storage_backend") == "KvbmHiCacheStorage", details
    assert second["ids"] == first["ids"], (first, second)
    print(f"prompt {first['prompt_tokens']} tokens; restart: {recovered} pages recovered, "
          f"{second['cached']} tokens cached ({second['details']}); output {second['ids']} both times")
