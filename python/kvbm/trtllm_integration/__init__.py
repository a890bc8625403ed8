"""kvbm for TensorRT-LLM: ``kvbm.trtllm_integration.connector``."""
