"""Environment helpers shared by the engine integrations (pure Python: usable
before the native library is loaded, e.g. in an engine's front-end process).

goext/config reads and validates every kvbm variable (kvbm_config_check). The
adapters read only what they must know before the library loads, or what
configures Python alone:

- DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR, DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE,
  DYN_KVBM_KV_EVENTS_BIND_HOST, DYN_KVBM_LEADER_ZMQ_PUB_PORT (and
  DYN_KVBM_TRTLLM_ZMQ_PORT): whether and where the adapter starts the
  consolidator, decided in processes that never load the library (an
  engine's front end);
- KVBM_LIBRARY, KVBM_DISABLE_CUDA (_native.py): which library to load;
- DYN_KVBM_THREAD_AFFINITY (_affinity.py): the cores the Go runtime starts
  its threads on, decided before the library loads;
- KVBM_CUDA_PACK_KV_CACHE (_kvpool.py), DYN_KVBM_ENABLE_RECORD and
  DYN_KVBM_RECORD_PATH (_record.py): Python-side features.

Their defaults are Go's (goext/config); tests/test_config_agree.py checks
that they agree with what the library reports.
"""

from __future__ import annotations

import ipaddress
import os
import re
from typing import overload

# goext/config.DefaultLeaderZMQPubPort; the consolidated event stream is
# published at this port + CONSOLIDATOR_PORT_OFFSET.
DEFAULT_LEADER_ZMQ_PUB_PORT = 56001
CONSOLIDATOR_PORT_OFFSET = 1000

TRUTHY = ("1", "true", "on", "yes")
FALSY = ("0", "false", "off", "no")


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    v = raw.strip().lower()
    if v in TRUTHY:
        return True
    if v in FALSY:
        return False
    raise ValueError(f"invalid {name}={raw!r}: expected one of 1/true/on/yes or 0/false/off/no")


@overload
def env_port(name: str, default: int) -> int: ...


@overload
def env_port(name: str, default: None = None) -> int | None: ...


def env_port(name: str, default: int | None = None) -> int | None:
    """A TCP port from the environment (1..65535) or ``default`` when unset."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        port = int(raw.strip())
    except ValueError:
        raise ValueError(f"invalid {name}={raw!r}: not an integer port") from None
    return check_port(port, name)


def check_port(port: object, what: str) -> int:
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ValueError(f"invalid {what}={port!r}: a port must be an integer in 1..65535")
    return port


def consolidator_enabled() -> bool:
    return env_bool("DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR", True)


CONSOLIDATOR_MODES = ("dedup", "passthrough")


def consolidator_mode() -> str:
    """DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE: ``dedup`` (default: engine and
    kvbm tier events merged, one STORE per logical block) or ``passthrough``
    (the engine's events forwarded as they arrive, kvbm's not forwarded; see
    goext/consolidator.ModePassthrough)."""
    raw = os.environ.get("DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE")
    if raw is None or raw.strip() == "":
        return CONSOLIDATOR_MODES[0]
    mode = raw.strip()
    if mode not in CONSOLIDATOR_MODES:
        raise ValueError(
            f"invalid DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE={raw!r}: must be one of {', '.join(CONSOLIDATOR_MODES)}"
        )
    return mode


def consolidator_output_port() -> int:
    pub = env_port("DYN_KVBM_LEADER_ZMQ_PUB_PORT", DEFAULT_LEADER_ZMQ_PUB_PORT)
    return check_port(pub + CONSOLIDATOR_PORT_OFFSET, "DYN_KVBM_LEADER_ZMQ_PUB_PORT + 1000 (consolidator output port)")


_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def consolidator_output_host() -> str:
    """DYN_KVBM_KV_EVENTS_BIND_HOST: where the consolidated event stream is
    published (default 0.0.0.0, Dynamo's, for routers on other machines).
    Events carry prompt token ids: anyone who can reach the port can read
    prompts, so set 127.0.0.1 when the router runs on this host."""
    raw = os.environ.get("DYN_KVBM_KV_EVENTS_BIND_HOST")
    if raw is None or raw.strip() == "":
        return "0.0.0.0"
    host = raw.strip()
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    if len(host) <= 253 and all(_HOST_LABEL.match(lbl) for lbl in host.rstrip(".").split(".")):
        return host
    raise ValueError(f"invalid DYN_KVBM_KV_EVENTS_BIND_HOST={raw!r}: expected an IP address or a host name")


def consolidator_output_endpoints() -> tuple[str, str]:
    """(bind endpoint, local connect endpoint) of the consolidated event stream."""
    host, port = consolidator_output_host(), consolidator_output_port()
    local = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    if ":" in host:
        host = f"[{host}]"
    if ":" in local:
        local = f"[{local}]"
    return f"tcp://{host}:{port}", f"tcp://{local}:{port}"
