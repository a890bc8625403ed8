"""TensorRT-LLM KV cache connector backed by kvbm.

Engine YAML (``--extra_llm_api_options`` / ``--config``)::

    backend: pytorch
    cuda_graph_config: null
    kv_cache_config: {enable_partial_reuse: false}
    kv_connector_config:
      connector_module: kvbm.trtllm_integration.connector
      connector_scheduler_class: DynamoKVBMConnectorLeader
      connector_worker_class: DynamoKVBMConnectorWorker

Importing this module never loads kvbm's native library and works without
TensorRT-LLM installed (the classes then derive from plain stand-ins).
"""

from kvbm.trtllm_integration.connector._common import HAVE_TRTLLM
from kvbm.trtllm_integration.connector.kvbm_connector_leader import DynamoKVBMConnectorLeader
from kvbm.trtllm_integration.connector.kvbm_connector_worker import DynamoKVBMConnectorWorker

__all__ = ["DynamoKVBMConnectorLeader", "DynamoKVBMConnectorWorker", "HAVE_TRTLLM"]
