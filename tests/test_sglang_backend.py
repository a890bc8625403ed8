"""kvbm as SGLang HiCache's storage backend: runs tests/sglang_contract.py
(the contract tests against SGLang's real classes) in a pytest process of its
own, because importing sglang patches transformers for the whole process
(sglang/__init__.py applies its Hugging Face patches at import), which must
not reach the vLLM tests of this run.

Without sglang this is skipped with a reason, except under CI where it
fails: .ci/python-deps.sh installs it (--no-deps).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def test_sglang_contract():
    if importlib.util.find_spec("sglang") is None:
        if os.environ.get("CI"):
            pytest.fail("sglang not installed: .ci/python-deps.sh installs it (--no-deps)")
        pytest.skip("sglang not installed: .ci/python-deps.sh installs it (--no-deps)")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", "--rootdir", os.path.dirname(HERE),
         os.path.join(HERE, "sglang_contract.py")],
        capture_output=True, text=True, timeout=900,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-20000:]
    assert " passed" in out and "deselected" not in out, out[-5000:]
    if os.environ.get("CI"):  # CI has versitygw too: nothing may skip there
        assert " skipped" not in out, out[-5000:]
