"""Python's few kvbm variables (kvbm/_envs.py) against the library's
configuration (goext/config): the defaults Python writes agree with Go's,
and the CUDA copier's knobs reach kvbm_config_check through the environment
snapshot the adapters pass."""

from __future__ import annotations

import pytest

from kvbm import _envs, _native
from kvbm._errors import KvbmConfigError


def test_consolidator_port_default_agrees(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_KVBM_LEADER_ZMQ_PUB_PORT", raising=False)
    summary = _native.config_check(require_tier=False)
    assert f"pub {_envs.DEFAULT_LEADER_ZMQ_PUB_PORT} " in summary, summary
    bind, _ = _envs.consolidator_output_endpoints()
    assert bind.endswith(f":{_envs.DEFAULT_LEADER_ZMQ_PUB_PORT + _envs.CONSOLIDATOR_PORT_OFFSET}")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("KVBM_CUDA_STAGING_MIB", "12MiB"),
        ("KVBM_CUDA_DMA_STREAMS", "9"),
        ("KVBM_CUDA_STAGED_THREADS", "48"),
        ("KVBM_CUDA_STAGED_PRIORITY", "medium"),
        ("KVBM_CUDA_SPLIT_BUSY", "dma"),
        ("DYN_KVBM_CUDA_COPY", "teleport"),
    ],
)
def test_cuda_knobs_are_checked(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(KvbmConfigError, match=name):
        _native.config_check(require_tier=False)


def test_cuda_knobs_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"KVBM_CUDA_STAGING_MIB": "64", "KVBM_CUDA_STAGED_PRIORITY": "low",
                        "DYN_KVBM_CUDA_COPY": "split", "KVBM_CUDA_SPLIT_PCT": "50",
                        "KVBM_CUDA_SPLIT_BUSY": "batch"}.items():
        monkeypatch.setenv(name, value)
    _native.config_check(require_tier=False)
