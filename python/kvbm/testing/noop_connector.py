"""A KV connector that does nothing, for benchmarks: vLLM takes a different
scheduling path when any KV connector is configured, so kvbm's own overhead
is measured against this, with the same path, as well as against no
connector at all. It declares SupportsHMA, as kvbm does, so vLLM keeps its
hybrid KV cache manager for hybrid models in both columns (without it vLLM
turns the manager off, and a hybrid with state layers fails at start-up)."""

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)


class NoopConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return KVConnectorMetadata()

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
        return False, None
