"""vLLM KV connector (v1) backed by kvbm.

Load it with::

    --kv-transfer-config '{"kv_connector":"DynamoConnector","kv_role":"kv_both",
                           "kv_connector_module_path":"kvbm.vllm_integration.connector"}'
"""

from kvbm.vllm_integration.connector.dynamo_connector import DynamoConnector, DynamoConnectorMetadata

__all__ = ["DynamoConnector", "DynamoConnectorMetadata"]
