"""kvbm as SGLang HiCache's storage backend: runs tests/sglang_contract.py,
tests/sglang_hybrid_contract.py and tests/sglang_events_contract.py (the
contract tests against SGLang's real classes; hybrid pools through the v2
calls; SGLang's KV events with the disk tier's) in a pytest process of its
own, because importing sglang patches transformers for the whole process
(sglang/__init__.py applies its Hugging Face patches at import), which must
not reach the vLLM tests of this run.

The interpreter: .venv-sglang/bin/python (made by .ci/python-deps.sh: sglang
without its dependencies, over .venv's packages) when it exists, else this
one if it has sglang. Without either this is skipped with a reason, except
under CI where it fails.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SGLANG_PY = os.path.join(os.path.dirname(HERE), ".venv-sglang", "bin", "python")


def test_sglang_contract():
    if os.path.exists(SGLANG_PY):
        py = SGLANG_PY
    elif importlib.util.find_spec("sglang") is not None:
        py = sys.executable
    else:
        why = "sglang not installed: .ci/python-deps.sh makes .venv-sglang (install_sglang_env)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    r = subprocess.run(
        [py, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", "--rootdir", os.path.dirname(HERE),
         *(os.path.join(HERE, f) for f in ("sglang_contract.py", "sglang_hybrid_contract.py",
                                           "sglang_events_contract.py"))],
        capture_output=True, text=True, timeout=900,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-20000:]
    assert " passed" in out and "deselected" not in out, out[-5000:]
    if os.environ.get("CI"):  # CI has versitygw too: nothing may skip there
        assert " skipped" not in out, out[-5000:]
