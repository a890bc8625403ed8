"""kvbm's figures in vLLM's own metrics: the connector stats vLLM collects
from every worker rank and from the scheduler each step
(``get_kv_connector_stats``), merges (``KVConnectorStats.aggregate``), logs
(``reduce``, its "KV Transfer metrics" line) and records on its ``/metrics``
(``build_prom_metrics``).

The payload (``KvbmConnectorStats.data``) is plain and self-describing, so
that it survives vLLM's serialisation between processes and a frontend
running another kvbm version::

    {"counters": {name: {label: number}}, "gauges": {name: {label: number}}}

Counters are increments since the previous report and add up when
aggregated; gauges are the latest value. ``label`` is the direction or tier
("" for unlabelled series). Worker ranks report transfer bytes, seconds and
batches each; blocks moved come from rank 0 only (every rank moves its shard
of the same blocks).

kvbm's own metrics endpoint (``kvbm_*`` names, DYN_KVBM_METRICS) is unchanged;
these series are named ``vllm:kvbm_*`` on vLLM's endpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

    _HAVE_VLLM_METRICS = True
except Exception:  # pragma: no cover - vLLM absent (config tooling, unit tests without it)
    _HAVE_VLLM_METRICS = False

    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]  # stand-in under vLLM's name
        data: dict[str, Any]

    class KVConnectorPromMetrics:  # type: ignore[no-redef]  # stand-in under vLLM's name
        def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                     per_engine_labelvalues: dict[int, list[object]]) -> None:
            from prometheus_client import Counter, Gauge, Histogram

            self._gauge_cls = metric_types[Gauge]
            self._counter_cls = metric_types[Counter]
            self._histogram_cls = metric_types[Histogram]
            self._labelnames = labelnames
            self.per_engine_labelvalues = per_engine_labelvalues

COUNTERS = "counters"
GAUGES = "gauges"


class Series(NamedTuple):
    kind: str  # COUNTERS or GAUGES
    label: str | None  # the label's name; None: unlabelled
    doc: str


# Every series kvbm reports through vLLM (name without the "vllm:kvbm_" prefix).
SERIES: dict[str, Series] = {
    # Worker side, per transfer direction (g1_to_g2, g2_to_g1, g2_to_g3, g3_to_g1, g1_to_g3, g4_to_g2, g2_to_g4).
    "transfer_blocks": Series(COUNTERS, "direction", "Blocks kvbm moved between tiers"),
    "transfer_failed_blocks": Series(COUNTERS, "direction", "Block copies that failed, summed over tensor-parallel ranks"),
    "transfer_bytes": Series(COUNTERS, "direction", "Bytes kvbm moved between tiers, summed over tensor-parallel ranks"),
    "transfer_seconds": Series(COUNTERS, "direction",
                               "Time spent in kvbm transfer batches, summed over ranks (divide by transfer_batches "
                               "for the mean batch latency)"),
    "transfer_batches": Series(COUNTERS, "direction", "kvbm transfer batches timed, summed over ranks"),
    "load_errors": Series(COUNTERS, None,
                          "Blocks whose kvbm load failed or did not verify, per rank (vLLM recomputes them)"),
    # Scheduler side.
    "lookup_tokens": Series(COUNTERS, None, "Prompt tokens past vLLM's own prefix cache that kvbm looked up"),
    "loaded_tokens": Series(COUNTERS, "tier", "Tokens kvbm planned to load into vLLM, by the tier they come from"),
    "hit_blocks": Series(COUNTERS, "tier", "Blocks kvbm planned to load into vLLM, by the tier they come from"),
    "g4_lookup_hits": Series(COUNTERS, None, "Object storage (G4) lookups that found the block"),
    "g4_lookup_misses": Series(COUNTERS, None, "Object storage (G4) lookups that did not find the block"),
    "kv_events_unmapped": Series(COUNTERS, None,
                                 "kvbm tier events not published in vLLM's KV event stream: the block's vLLM hash "
                                 "was unknown (a recovered disk tier block, or one stored long after its request)"),
    "kv_events_dropped": Series(COUNTERS, None, "kvbm tier events dropped because they were not taken in time"),
    "host_blocks_registered": Series(GAUGES, None, "Blocks registered in kvbm's host tier (G2)"),
    "disk_blocks_registered": Series(GAUGES, None, "Blocks registered in kvbm's disk tier (G3)"),
    "degraded": Series(GAUGES, None, "1 while kvbm is in degraded mode (a tensor-parallel rank is gone)"),
    "g4_queue_depth": Series(GAUGES, None, "Object storage (G4) uploads waiting in the queue"),
    "g4_breakers_open": Series(GAUGES, None, "Object storage (G4) circuit breakers open"),
}

PREFIX = "vllm:kvbm_"


@dataclass
class KvbmConnectorStats(KVConnectorStats):
    """kvbm's connector stats for one interval (see the module docstring)."""

    def __post_init__(self) -> None:
        if not isinstance(self.data, dict) or COUNTERS not in self.data or GAUGES not in self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, Any] = {COUNTERS: {}, GAUGES: {}}

    def add(self, name: str, value: float, label: str = "") -> None:
        """Add ``value`` to counter ``name`` (nothing for 0)."""
        if value:
            c = self.data[COUNTERS].setdefault(name, {})
            c[label] = c.get(label, 0) + value

    def set_gauge(self, name: str, value: float, label: str = "") -> None:
        self.data[GAUGES].setdefault(name, {})[label] = value

    def aggregate(self, other: KVConnectorStats) -> KvbmConnectorStats:
        """Counters add up; a gauge takes ``other``'s value (the later
        report). Returns self, as vLLM expects."""
        if other is None or other.is_empty():
            return self
        odata = other.data
        for name, series in (odata.get(COUNTERS) or {}).items():
            for label, v in series.items():
                self.add(name, v, label)
        for name, series in (odata.get(GAUGES) or {}).items():
            for label, v in series.items():
                self.set_gauge(name, v, label)
        return self

    def is_empty(self) -> bool:
        return not any(v for s in self.data[COUNTERS].values() for v in s.values()) and not any(
            self.data[GAUGES].values())

    def counter(self, name: str, label: str = "") -> float:
        return float(self.data[COUNTERS].get(name, {}).get(label, 0))

    def reduce(self) -> dict[str, int | float]:
        """The interval's summary for vLLM's "KV Transfer metrics" log line."""
        out: dict[str, int | float] = {}
        c = self.data[COUNTERS]
        for d in sorted(c.get("transfer_bytes", {}) | c.get("transfer_blocks", {})):
            blocks = self.counter("transfer_blocks", d)
            mib = self.counter("transfer_bytes", d) / 2**20
            secs = self.counter("transfer_seconds", d)
            batches = self.counter("transfer_batches", d)
            out[f"kvbm {d} blocks"] = int(blocks)
            out[f"kvbm {d} MiB"] = round(mib, 3)
            if batches:
                out[f"kvbm {d} avg batch ms"] = round(secs / batches * 1e3, 3)
            failed = self.counter("transfer_failed_blocks", d)
            if failed:
                out[f"kvbm {d} failed blocks"] = int(failed)
        lookup = self.counter("lookup_tokens")
        if lookup:
            out["kvbm lookup tokens"] = int(lookup)
            loaded = sum(c.get("loaded_tokens", {}).values())
            out["kvbm hit rate %"] = round(100.0 * loaded / lookup, 2)
        for tier, n in sorted(c.get("loaded_tokens", {}).items()):
            out[f"kvbm {tier} hit tokens"] = int(n)
        for name in ("load_errors", "g4_lookup_hits", "g4_lookup_misses", "kv_events_unmapped", "kv_events_dropped"):
            if self.counter(name):
                out[f"kvbm {name.replace('_', ' ')}"] = int(self.counter(name))
        for name, series in sorted(self.data[GAUGES].items()):
            for label, v in series.items():
                out[f"kvbm {name.replace('_', ' ')}{' ' + label if label else ''}"] = v
        return out


class KvbmPromMetrics(KVConnectorPromMetrics):
    """kvbm's series on vLLM's ``/metrics`` (``vllm:kvbm_*``, one set per
    engine, the label of each series after vLLM's own)."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._families: dict[str, Any] = {}
        for name, s in SERIES.items():
            cls = self._counter_cls if s.kind == COUNTERS else self._gauge_cls
            labels = list(labelnames) + ([s.label] if s.label else [])
            self._families[name] = cls(name=PREFIX + name, documentation=s.doc, labelnames=labels)
        self._bound: dict[tuple[int, str, str], Any] = {}

    def _child(self, engine_idx: int, name: str, label: str) -> Any:
        key = (engine_idx, name, label)
        m = self._bound.get(key)
        if m is None:
            values = list(self.per_engine_labelvalues[engine_idx])
            if SERIES[name].label:
                values.append(label)
            m = self._bound[key] = self._families[name].labels(*values)
        return m

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        # Series this kvbm does not know (another version's) are skipped.
        for name, series in (transfer_stats_data.get(COUNTERS) or {}).items():
            if name in SERIES and SERIES[name].kind == COUNTERS:
                for label, v in series.items():
                    if v > 0:
                        self._child(engine_idx, name, label).inc(v)
        for name, series in (transfer_stats_data.get(GAUGES) or {}).items():
            if name in SERIES and SERIES[name].kind == GAUGES:
                for label, v in series.items():
                    self._child(engine_idx, name, label).set(v)
