"""When and where the KV Event Consolidator runs in a vLLM deployment (design §7.3)."""

from __future__ import annotations

import logging
import re
from typing import Any

from kvbm._envs import check_port, consolidator_enabled, consolidator_output_endpoints

log = logging.getLogger("kvbm")

_CONNECTOR_NAMES = ("DynamoConnector",)


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _uses_kvbm(kv_transfer_config: Any) -> bool:
    name = _get(kv_transfer_config, "kv_connector")
    module = _get(kv_transfer_config, "kv_connector_module_path") or ""
    if name in _CONNECTOR_NAMES:
        return True
    if name == "PdConnector":
        extra = _get(kv_transfer_config, "kv_connector_extra_config") or {}
        for c in extra.get("connectors", []) or []:
            if _get(c, "kv_connector") in _CONNECTOR_NAMES:
                return True
    return "kvbm.vllm_integration" in module and name in _CONNECTOR_NAMES


def should_enable_consolidator(vllm_config: Any) -> bool:
    """True when the consolidator should run: enabled by
    DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR (default true), kvbm is the KV
    connector, prefix caching is on and vLLM publishes KV events."""
    if not consolidator_enabled():
        return False
    if not _uses_kvbm(_get(vllm_config, "kv_transfer_config")):
        return False
    if not _get(_get(vllm_config, "cache_config"), "enable_prefix_caching", False):
        return False
    events = _get(vllm_config, "kv_events_config")
    return bool(events is not None and _get(events, "enable_kv_cache_events", False) and _get(events, "endpoint"))


_ENDPOINT = re.compile(r"^(?P<scheme>[a-z]+)://(?P<host>[^:]+|\[[^\]]+\]):(?P<port>\d+)$")


def get_consolidator_endpoints(vllm_config: Any) -> tuple[str, str, str]:
    """(vLLM events endpoint to subscribe to, output bind endpoint, output connect endpoint)."""
    events = _get(vllm_config, "kv_events_config")
    endpoint = _get(events, "endpoint")
    if not endpoint:
        raise ValueError("kv_events_config.endpoint is not set; cannot consolidate vLLM KV events")
    m = _ENDPOINT.match(endpoint)
    if not m:
        raise ValueError(f"kv_events_config.endpoint={endpoint!r}: expected tcp://host:port")
    port = check_port(int(m.group("port")), "kv_events_config.endpoint port")
    dp_rank = _get(_get(vllm_config, "parallel_config"), "data_parallel_rank", 0) or 0
    if dp_rank:
        log.warning("kvbm consolidator: data parallel rank %d; subscribing to rank 0's endpoint", dp_rank)
    host = m.group("host").replace("*", "127.0.0.1")
    if host == "0.0.0.0":
        host = "127.0.0.1"
    bind, local = consolidator_output_endpoints()
    return f"{m.group('scheme')}://{host}:{port}", bind, local
