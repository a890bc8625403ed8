"""Environment helpers shared by the engine integrations (pure Python: usable
before the native library is loaded, e.g. in an engine's front-end process)."""

import os

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


def env_port(name: str, default=None):
    """A TCP port from the environment (1..65535) or ``default`` when unset."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        port = int(raw.strip())
    except ValueError:
        raise ValueError(f"invalid {name}={raw!r}: not an integer port") from None
    return check_port(port, name)


def check_port(port: int, what: str) -> int:
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ValueError(f"invalid {what}={port!r}: a port must be an integer in 1..65535")
    return port


def consolidator_enabled() -> bool:
    return env_bool("DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR", True)


def consolidator_output_port() -> int:
    pub = env_port("DYN_KVBM_LEADER_ZMQ_PUB_PORT", 56001)
    return check_port(pub + 1000, "DYN_KVBM_LEADER_ZMQ_PUB_PORT + 1000 (consolidator output port)")
