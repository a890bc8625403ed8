"""The vLLM connector API kvbm has been reviewed against: every method of
vLLM's ``KVConnectorBase_V1`` (abstract or not) per vLLM release, with its
signature as ``inspect.signature`` prints it, and how kvbm handles it.

tests/test_vllm_api.py compares the installed vLLM's base class with this
table: a method that a new release adds, drops or changes fails the check
until it has been reviewed and listed here (and DynamoConnector follows it
where it must). The signatures were taken from each release's base class.
"""

# How kvbm handles each method: "kvbm: ..." DynamoConnector overrides it;
# "base: ..." the base class's default is right for kvbm (why).
HANDLING: dict[str, str] = {
    '__init__': 'kvbm: takes kv_cache_config (vLLM >= 0.12) and picks the scheduler or worker side',
    'bind_connector_metadata': "kvbm: hands the step's plan to the worker",
    'bind_gpu_block_pool': "base: kvbm keeps no view of vLLM's block pool",
    'bind_kv_cache_manager': "base: kvbm keeps no view of vLLM's cache manager",
    'build_connector_meta': 'kvbm',
    'build_connector_worker_meta': "kvbm: rank 0's G4 fingerprint, G4 reports and timed load batches",
    'build_kv_connector_stats': 'kvbm',
    'build_prom_metrics': 'kvbm',
    'clear_connector_metadata': 'kvbm',
    'finish_forward': "base: saves run in wait_for_save, before the step's blocks can be reused",
    'get_block_ids_with_load_errors': 'kvbm',
    'get_external_cache_hit_sources': 'kvbm',
    'get_finished': 'kvbm',
    'get_finished_count': 'kvbm',
    'get_handshake_metadata': "kvbm: the recovered persistent disk tier index and rank 0's G4 fingerprint",
    'get_kv_connector_kv_cache_events': "base: kvbm's tier events go through take_events (scheduler side)",
    'get_kv_connector_stats': 'kvbm',
    'get_loaded_kv_cache_group_ids': "base: the prefix-cacheable groups; a kvbm block holds every layer of each",
    'get_mem_pool_context': 'kvbm',
    'get_num_new_matched_tokens': 'kvbm: None while a G4 lookup is pending',
    'get_required_kvcache_layout': 'base: kvbm reads whichever layout vLLM allocates',
    'get_transfer_results': "kvbm: the base's answer plus, with several KV cache groups, requests whose load failed (vLLM takes those per request)",
    'handle_preemptions': "base: offloads finish inside wait_for_save of their step, so a preempted request's blocks hold no pending save",
    'has_connector_metadata': 'base',
    'has_pending_block_frees': "base: kvbm never holds vLLM's blocks past get_finished",
    'has_pending_push_work': 'base: no push-mode transfers',
    'on_new_request': 'base: kvbm learns of requests at matching',
    'register_finished_partial_tail': 'base: kvbm stores full blocks only',
    'register_kv_caches': 'kvbm',
    'request_finished': 'kvbm',
    'requires_kv_delivery': 'kvbm: False, a dropped save is a future miss',
    'requires_piecewise_for_cudagraph': 'base: no layer-wise hooks (wait_for_layer_load/save_kv_layer do nothing)',
    'reset_cache': 'kvbm',
    'reset_capture_state': 'base: nothing changes during CUDA graph capture',
    'restore_kv_caches': 'kvbm: kvbm declines sleep mode (supports_sleep_mode); reached anyway it leaves kvbm off',
    'role': 'base',
    'save_kv_layer': 'kvbm: a no-op (saves run in wait_for_save)',
    'set_host_xfer_buffer_ops': 'base: kvbm copies with its own host (and CUDA) code',
    'set_xfer_handshake_metadata': "kvbm: registers every rank's recovered disk tier, takes rank 0's G4 fingerprint",
    'set_xfer_handshake_metadata_pp_aware': 'base: forwards pp rank 0 to set_xfer_handshake_metadata (kvbm has no pipeline parallelism)',
    'shutdown': 'kvbm',
    'start_load_kv': 'kvbm',
    'supports_divergent_local_hybrid_hits': 'base: False, kvbm serves no state (Mamba) groups',
    'supports_sleep_mode': "kvbm: False with a log line; the KV cache remap would leave kvbm's worker with stale addresses",
    'take_events': 'kvbm',
    'unregister_kv_caches': 'kvbm: kvbm declines sleep mode (supports_sleep_mode); reached anyway it turns kvbm off before the memory goes',
    'update_connector_output': 'kvbm',
    'update_state_after_alloc': 'kvbm: also when vLLM 0.33 defers it past a later step (HiSparse)',
    'wait_for_layer_load': 'kvbm: a no-op (loads are per step)',
    'wait_for_save': 'kvbm',
}

_V0_32_0 = {
    '__init__': "method (self, vllm_config: 'VllmConfig', role: vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorRole, kv_cache_config: 'KVCacheConfig')",
    'bind_connector_metadata': 'method (self, connector_metadata: vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorMetadata) -> None',
    'bind_gpu_block_pool': "method (self, gpu_block_pool: 'BlockPool') -> None",
    'bind_kv_cache_manager': "method (self, kv_cache_manager: 'KVCacheManager') -> None",
    'build_connector_meta': 'abstract method (self, scheduler_output: vllm.v1.core.sched.output.SchedulerOutput) -> vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorMetadata',
    'build_connector_worker_meta': 'method (self) -> vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorWorkerMetadata | None',
    'build_kv_connector_stats': "classmethod (cls, data: dict[str, typing.Any] | None = None) -> 'KVConnectorStats | None'",
    'build_prom_metrics': "classmethod (cls, vllm_config: 'VllmConfig', metric_types: dict[type['PromMetric'], type['PromMetricT']], labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> 'KVConnectorPromMetrics | None'",
    'clear_connector_metadata': 'method (self) -> None',
    'finish_forward': 'method (self) -> None',
    'get_block_ids_with_load_errors': 'method (self) -> set[int]',
    'get_external_cache_hit_sources': "method (self, request: 'Request', num_external_tokens: int) -> dict[vllm.v1.metrics.cache_hit_source.CacheHitSource, int]",
    'get_finished': 'method (self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]',
    'get_finished_count': 'method (self) -> int | None',
    'get_handshake_metadata': 'method (self) -> vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorHandshakeMetadata | None',
    'get_kv_connector_kv_cache_events': "method (self) -> 'KVConnectorKVEvents | None'",
    'get_kv_connector_stats': "method (self) -> 'KVConnectorStats | None'",
    'get_loaded_kv_cache_group_ids': "method (self, request: 'Request') -> tuple[int, ...]",
    'get_mem_pool_context': 'method (self) -> contextlib.AbstractContextManager | None',
    'get_num_new_matched_tokens': "abstract method (self, request: 'Request', num_computed_tokens: int) -> tuple[int | None, bool]",
    'get_required_kvcache_layout': "classmethod (cls, vllm_config: 'VllmConfig') -> str | None",
    'get_transfer_results': 'method (self, finished_req_ids: set[str]) -> vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorTransferResults',
    'handle_preemptions': 'method (self, kv_connector_metadata: vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorMetadata)',
    'has_connector_metadata': 'method (self) -> bool',
    'has_pending_block_frees': 'method (self) -> bool',
    'has_pending_push_work': 'method (self) -> bool',
    'on_new_request': "method (self, request: 'Request') -> None",
    'register_finished_partial_tail': "method (self, request: 'Request', block_ids: tuple[list[int], ...], partial_tail_offloads: list[tuple[int, int, int]]) -> bool",
    'register_kv_caches': 'method (self, kv_caches: dict[str, torch.Tensor])',
    'request_finished': "method (self, request: 'Request', block_ids: list[int]) -> tuple[bool, dict[str, typing.Any] | None]",
    'requires_kv_delivery': 'property (self) -> bool',
    'requires_piecewise_for_cudagraph': 'classmethod (cls, extra_config: dict[str, typing.Any]) -> bool',
    'reset_cache': 'method (self) -> bool | None',
    'reset_capture_state': 'method (self) -> None',
    'role': 'property (self) -> vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorRole',
    'save_kv_layer': "abstract method (self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: 'AttentionMetadata', **kwargs: Any) -> None",
    'set_host_xfer_buffer_ops': "method (self, copy_operation: collections.abc.Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], list[int], list[int], typing.Literal['h2d', 'd2h']], None])",
    'set_xfer_handshake_metadata': 'method (self, metadata: dict[int, vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorHandshakeMetadata]) -> None',
    'set_xfer_handshake_metadata_pp_aware': 'method (self, metadata: dict[tuple[int, int], vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorHandshakeMetadata]) -> None',
    'shutdown': 'method (self)',
    'start_load_kv': "abstract method (self, forward_context: 'ForwardContext', **kwargs: Any) -> None",
    'supports_divergent_local_hybrid_hits': 'property (self) -> bool',
    'take_events': "method (self) -> collections.abc.Iterable['KVCacheEvent']",
    'update_connector_output': 'method (self, connector_output: vllm.v1.outputs.KVConnectorOutput)',
    'update_state_after_alloc': "abstract method (self, request: 'Request', blocks: 'KVCacheBlocks', num_external_tokens: int)",
    'wait_for_layer_load': 'abstract method (self, layer_name: str) -> None',
    'wait_for_save': 'abstract method (self)',
}

# vLLM 0.33.0: 0.32.0's base class plus the sleep-mode hooks.
_V0_33_0 = {
    **_V0_32_0,
    'restore_kv_caches': 'method (self) -> None',
    'supports_sleep_mode': "classmethod (cls, kv_transfer_config: 'KVTransferConfig') -> bool",
    'unregister_kv_caches': 'method (self) -> None',
}

# vLLM release → {method: "[abstract ]method|classmethod|property <signature>"}.
REVIEWED: dict[str, dict[str, str]] = {
    "0.32.0": _V0_32_0,
    "0.33.0": _V0_33_0,
}

# vLLM's connector call sites (read with ast from the installed source: the
# scheduler and GPU worker modules need CUDA to import) and the receivers
# that are the KV connector there.
CALL_SITES: list[str] = [
    "v1/core/sched/scheduler.py",  # self.connector
    "v1/worker/kv_connector_model_runner_mixin.py",  # kv_connector
    "v1/worker/gpu/kv_connector.py",  # self.kv_connector
    "v1/worker/gpu_worker.py",  # get_kv_transfer_group()
]

# Methods called there that are not KVConnectorBase_V1's: other connectors'
# interfaces, called only on connectors that have them.
OTHER_INTERFACES: dict[str, str] = {
    "request_finished_all_groups": "SupportsHMA (hybrid models): DynamoConnector implements it",
    "get_aligned_num_cpu_blocks": "vLLM's SimpleCPUOffloadConnector only",
}
