"""When and where the KV Event Consolidator runs in a TensorRT-LLM deployment (design §7.3)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvbm._envs import (
    DEFAULT_LEADER_ZMQ_PUB_PORT,
    consolidator_enabled,
    consolidator_mode,
    consolidator_output_endpoints,
    env_port,
)

if TYPE_CHECKING:
    from kvbm._core import ConsolidatorOptions

log = logging.getLogger("kvbm")


def _connector_module(kv_connector_config: Any) -> str:
    if kv_connector_config is None:
        return ""
    if isinstance(kv_connector_config, dict):
        return str(kv_connector_config.get("connector_module") or "")
    return str(getattr(kv_connector_config, "connector_module", "") or "")


def should_enable_consolidator(arg_map: Any) -> bool:
    """True when the consolidator is enabled (DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR)
    and the engine's ``kv_connector_config`` uses kvbm's TensorRT-LLM connector."""
    if not consolidator_enabled():
        return False
    cfg = arg_map.get("kv_connector_config") if isinstance(arg_map, dict) else getattr(arg_map, "kv_connector_config", None)
    return "kvbm.trtllm_integration.connector" in _connector_module(cfg)


def engine_events_port() -> int | None:
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
    engine = env_port("DYN_KVBM_TRTLLM_ZMQ_PORT") or env_port("DYN_KVBM_LEADER_ZMQ_PUB_PORT", DEFAULT_LEADER_ZMQ_PUB_PORT)
    bind, local = consolidator_output_endpoints()
    return f"tcp://*:{engine}", bind, local


def consolidator_options(arg_map: Any) -> ConsolidatorOptions | None:
    """The ``consolidator=`` options for kvbm's leader in a TensorRT-LLM
    engine, or None when it should not run (disabled, not our connector, or
    DYN_KVBM_TRTLLM_ZMQ_PORT unset: then an error names the variable).

    Input: the engine events that ``ZmqKvEventPublisher`` binds on
    DYN_KVBM_TRTLLM_ZMQ_PORT. Output: ZMQ PUB on DYN_KVBM_LEADER_ZMQ_PUB_PORT +
    1000 (what Dynamo's worker-side publisher reads), plus RouterEvents on NATS
    when NATS_SERVER is set, on ``namespace.{DYN_NAMESPACE or dynamo}.component.
    tensorrt_llm.kv-events`` with worker id DYN_KVBM_WORKER_ID (default 0).
    Mode: DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE (``dedup`` or ``passthrough``;
    another value raises ValueError naming it).
    """
    import os

    if not should_enable_consolidator(arg_map):
        return None
    mode = consolidator_mode()
    port = engine_events_port()
    if port is None:
        return None
    _, out_bind, _ = get_consolidator_endpoints()
    opts: ConsolidatorOptions = {
        "engine": "trtllm",
        "engine_endpoint": f"tcp://127.0.0.1:{port}",
        "zmq_bind": out_bind,
        "mode": mode,
    }
    if os.environ.get("NATS_SERVER", "").strip():
        raw_id = os.environ.get("DYN_KVBM_WORKER_ID", "0").strip() or "0"
        try:
            worker_id = int(raw_id)
        except ValueError:
            raise ValueError(f"invalid DYN_KVBM_WORKER_ID={raw_id!r}: not an integer") from None
        # An empty namespace/component takes the consolidator's defaults
        # ("dynamo", and "tensorrt_llm" for this engine).
        opts["nats"] = True
        opts["namespace"] = os.environ.get("DYN_NAMESPACE", "").strip()
        opts["worker_id"] = worker_id
    return opts
