"""Stand-ins for the vLLM objects the connector reads, for tests and benchmarks
that drive DynamoConnector without importing vLLM's scheduler."""

from __future__ import annotations

from types import SimpleNamespace


class ConstantList:
    """vLLM's ``vllm.v1.utils.ConstantList``: a read-only view of ``_x``."""

    def __init__(self, x):
        self._x = x

    def __len__(self):
        return len(self._x)

    def __getitem__(self, i):
        return self._x[i]

    def __iter__(self):
        return iter(self._x)


def vllm_config(block_size: int):
    """The parts of ``VllmConfig`` the connector reads: kvbm as the KV
    connector, prefix caching on, TP=1, no KV events."""
    return SimpleNamespace(
        cache_config=SimpleNamespace(block_size=block_size, enable_prefix_caching=True),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        kv_transfer_config=SimpleNamespace(kv_connector="DynamoConnector", kv_role="kv_both",
                                           kv_connector_module_path="kvbm.vllm_integration.connector",
                                           kv_connector_extra_config={}),
        kv_events_config=None,
    )
