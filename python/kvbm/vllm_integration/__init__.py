"""kvbm for vLLM: ``kvbm.vllm_integration.connector.DynamoConnector``."""
