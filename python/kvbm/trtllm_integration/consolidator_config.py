"""When and where the KV Event Consolidator runs in a TensorRT-LLM deployment (SPEC §7.3)."""

from __future__ import annotations

import logging

from kvbm._envs import consolidator_enabled, consolidator_output_port, env_port

log = logging.getLogger("kvbm")


def _connector_module(kv_connector_config):
    if kv_connector_config is None:
        return ""
    if isinstance(kv_connector_config, dict):
        return kv_connector_config.get("connector_module") or ""
    return getattr(kv_connector_config, "connector_module", "") or ""


def should_enable_consolidator(arg_map) -> bool:
    """True when the consolidator is enabled (DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR)
    and the engine's ``kv_connector_config`` uses kvbm's TensorRT-LLM connector."""
    if not consolidator_enabled():
        return False
    cfg = arg_map.get("kv_connector_config") if isinstance(arg_map, dict) else getattr(arg_map, "kv_connector_config", None)
    return "kvbm.trtllm_integration.connector" in _connector_module(cfg)


def engine_events_port():
    """DYN_KVBM_TRTLLM_ZMQ_PORT, or None (with an error log naming it) when unset."""
    port = env_port("DYN_KVBM_TRTLLM_ZMQ_PORT")
    if port is None:
        log.error(
            "KV Event Consolidator: No ZMQ port found for TensorRT-LLM KV events; "
            "export DYN_KVBM_TRTLLM_ZMQ_PORT=20081 (any free port) to enable it. Continuing without it."
        )
    return port


def get_consolidator_endpoints() -> tuple[str, str, str]:
    """(engine publisher bind endpoint, output bind endpoint, output connect endpoint)."""
    engine = env_port("DYN_KVBM_TRTLLM_ZMQ_PORT") or env_port("DYN_KVBM_LEADER_ZMQ_PUB_PORT", 56001)
    out = consolidator_output_port()
    return f"tcp://*:{engine}", f"tcp://0.0.0.0:{out}", f"tcp://127.0.0.1:{out}"
