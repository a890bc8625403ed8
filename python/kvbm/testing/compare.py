"""vLLM (CPU backend) with kvbm against three baselines, same prompts, one run
each, for bench/vllm_ttft.py and ``python -m kvbm.demo``.

Columns (every one runs the same actions on a fresh engine):

* ``no kvbm``: vLLM alone, G1 of ``g1`` blocks;
* ``no-op connector``: G1 of ``g1`` blocks and a KV connector that does nothing:
  vLLM takes another code path once any connector is configured, so this
  column tells kvbm's own cost from that path's;
* ``no kvbm, G1 + G2 bytes``: vLLM alone with G1 enlarged by exactly the bytes
  kvbm's host tier (G2) gets (``g1 + host`` blocks of the same page size): on
  the CPU backend G1 is host memory too, so this is "give vLLM the memory
  instead";
* ``kvbm``: G1 of ``g1`` blocks, kvbm with ``host`` G2 blocks and ``disk`` G3
  blocks, every block written through to disk (the disk offload frequency
  filter off: see KVBM_ENV).

Hit rates per tier come from vLLM's ``num_cached_tokens`` (G1 plus what a
connector loaded) and kvbm's onboard counters (G2→G1, G3→G1).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvbm.testing import peers

BS = 32  # vLLM block size of the harness

ENLARGED = "no kvbm, G1 + G2 bytes"
COLUMNS = ("no kvbm", "no-op connector", ENLARGED, "kvbm")
BASELINES = COLUMNS[:3]
# kvbm with vLLM's hybrid KV cache manager turned off
# (--disable-hybrid-kv-cache-manager: one KV cache group, full-size KV for
# every layer): what vLLM does with a connector that cannot handle groups.
# An extra column for models with several KV cache groups.
KVBM_HMA_OFF = "kvbm, hybrid manager off"
# kvbm with its threads left on the cores the engine's worker thread is bound
# to (DYN_KVBM_THREAD_AFFINITY=inherit): the cost bench's "before".
KVBM_INHERIT = "kvbm, threads on the model's cores"
# kvbm with G2 only (no disk tier): the cost bench's split of kvbm's cost
# between the G2 path and the G2→G3 moves.
KVBM_G2_ONLY = "kvbm, G2 only"

# Cores vLLM's CPU backend keeps free of the model's OpenMP threads, the same
# in every column. vLLM reserves one core per rank for its scheduler, and one
# more as soon as any KV connector is configured; on a machine with few cores
# that changes the model's thread count (on 2 cores: 1 OpenMP thread without
# a connector, 2 with one and no core left for the scheduler), so columns with
# and without a connector would not run the same model. Every column runs
# with VLLM_CPU_NUM_OF_RESERVED_CPU set to this (the harness runs one rank).
RESERVED_CPUS = 1


def engine_threads() -> str:
    """The thread layout every column runs with, for the bench's header."""
    n = len(os.sched_getaffinity(0))
    return (f"every column: VLLM_CPU_NUM_OF_RESERVED_CPU={RESERVED_CPUS} "
            f"({max(n - RESERVED_CPUS, 1)} OpenMP thread(s) for the model of {n} cores, "
            f"{min(RESERVED_CPUS, n - 1)} core(s) for vLLM's scheduler and kvbm)")


# kvbm's settings in the kvbm column besides the tier sizes. By default a
# block goes to disk only once it has been registered in G2 twice (a
# frequency filter that spares the disk); these workloads come back to every
# prefix, so every block is written through to disk.
KVBM_ENV = {"DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true"}


def disk_dir() -> str:
    """A directory for kvbm's G3 file: $TMPDIR, /var/tmp or /tmp, the first
    that is not memory-backed (a disk tier in tmpfs would be memory)."""
    for c in (os.environ.get("TMPDIR"), "/var/tmp", "/tmp"):
        if c and os.path.isdir(c) and os.access(c, os.W_OK) and _fstype(c) not in ("tmpfs", "ramfs"):
            return c
    return tempfile.gettempdir()


def _fstype(path: str) -> str:
    path, best, typ = os.path.realpath(path), "", "?"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                _, mnt, t = line.split()[:3]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, typ = mnt, t
    except OSError:
        pass
    return typ


_PROGRESS = re.compile(r"^\[\w+\] request \d")


def harness_env(spec: dict, root: str, run_dir: str) -> dict[str, str]:
    """The environment of one column's engine process: the caller's, the
    column's own variables, kvbm's disk tier in the run's private directory,
    and the same core reservation in every column (RESERVED_CPUS)."""
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update({k: str(v) for k, v in (spec.get("env") or {}).items()})
    env.setdefault("DYN_KVBM_DISK_CACHE_DIR", run_dir)
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(RESERVED_CPUS)
    return env


def _root() -> str:
    """The directory holding the kvbm package (python/ in a checkout)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _checkout() -> str:
    """The checkout's top directory, where .venv-lmcache lives."""
    return os.path.dirname(_root())


_ERROR_LINE = re.compile(r"(?:^|\) )((?:[\w.]+\.)?\w*(?:Error|Exception): .+)$")


def startup_error(lines: Sequence[str]) -> str:
    """The root cause among an engine's last output lines: the first
    exception line (vLLM prints the engine core's own error before the
    front end's "Engine core initialization failed"), without the process
    prefix; else the last line."""
    errs = [m.group(1).strip() for m in (_ERROR_LINE.search(ln.rstrip()) for ln in lines) if m]
    errs = [e for e in errs if "initialization failed" not in e] or errs
    if errs:
        return errs[0]
    rest = [ln.strip() for ln in lines if ln.strip()]
    return rest[-1] if rest else "no output"


def _wait_port(port: int, proc: subprocess.Popen, timeout: float) -> bool:
    end = time.time() + timeout
    while time.time() < end and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            time.sleep(0.2)
    return False


def _start_server(server: dict, run_dir: str, label: str) -> tuple[subprocess.Popen, Any]:
    """A peer's server process (its own session, output to a log in the run
    directory), once it accepts connections on server["port"]."""
    log = open(os.path.join(run_dir, "server.log"), "w+")
    argv = [a.replace("{run_dir}", run_dir) for a in server["argv"]]
    env = dict(os.environ, **{k: str(v) for k, v in (server.get("env") or {}).items()})
    p = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    if not _wait_port(server["port"], p, server.get("timeout_s", 180)):
        log.seek(0)
        tail = log.read().splitlines()[-40:]
        _stop_server(p, log)
        raise _ColumnFailed(f"{label}: server did not start: " + startup_error(tail), tail)
    return p, log


def _stop_server(p: subprocess.Popen, log: Any) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    log.close()


class _ColumnFailed(Exception):
    def __init__(self, msg: str, tail: Sequence[str]) -> None:
        super().__init__(msg)
        self.tail = list(tail)


def _spawn_harness(spec: dict, run_dir: str, **popen: Any) -> subprocess.Popen:
    """kvbm.testing.vllm_harness on spec (written to run_dir/spec.json), with
    spec["python"] when given, else this interpreter; output merged into its
    stdout, a text pipe."""
    sp, op = os.path.join(run_dir, "spec.json"), os.path.join(run_dir, "out.json")
    with open(sp, "w") as f:
        json.dump(spec, f)
    return subprocess.Popen([spec.get("python") or sys.executable, "-m", "kvbm.testing.vllm_harness", sp, op],
                            env=harness_env(spec, _root(), run_dir), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **popen)


def run_harness(spec: dict, label: str, may_fail: bool = False) -> dict:
    """One engine run of kvbm.testing.vllm_harness in a subprocess (with
    spec["python"] when given, else this interpreter), after the column's
    server (spec["server"]) when it has one; prints its per-request progress
    lines. may_fail: a run that fails returns {"error": its root cause}
    instead of ending the bench."""
    with tempfile.TemporaryDirectory(prefix="kvbm-run-", dir=disk_dir()) as d:
        print(f"== {label}: starting vLLM (CPU backend) ...", flush=True)
        t0 = time.time()
        server = None
        try:
            if spec.get("server"):
                server = _start_server(spec["server"], d, label)
            p = _spawn_harness(spec, d)
            tail: list[str] = []
            assert p.stdout is not None
            for line in p.stdout:
                tail = (tail + [line])[-200:]
                if _PROGRESS.match(line):
                    print("   " + line.rstrip()[:200], flush=True)
            if p.wait() != 0:
                raise _ColumnFailed(f"{label}: vLLM run failed (exit {p.returncode}): {startup_error(tail)}", tail)
        except _ColumnFailed as e:
            if not may_fail:
                sys.stdout.write("".join(x if x.endswith("\n") else x + "\n" for x in e.tail))
                raise SystemExit(str(e)) from None
            print(f"== {e}", flush=True)
            return {"error": startup_error(e.tail)}
        finally:
            if server is not None:
                _stop_server(*server)
        print(f"== {label}: finished in {time.time() - t0:.0f} s", flush=True)
        with open(os.path.join(d, "out.json")) as f:
            out: dict[str, Any] = json.load(f)
            return out


class LiveColumn:
    """One column's engine kept running (the harness's serve mode): actions
    sent one at a time, each answered with its record. Several live columns
    let a bench interleave requests: each measured request runs while the
    other engines are idle, and consecutive requests of different columns see
    the machine of the same moment (bench/vllm_ttft.py --cost).

    Start every column first, then wait for each with ready(): the engines
    start at once, and no request is timed while another engine starts."""

    def __init__(self, col: str, model: dict, engine: dict, g1: int, host: int, disk: int,
                 kv_env: dict | None = None, python: str | None = None) -> None:
        from kvbm.testing.vllm_harness import RESULT

        self.label, self._result = col, RESULT
        self.spec = column_spec(col, model, engine, g1, host, disk, [], kv_env, port=free_port(),
                                http_port=free_port())
        self.spec["serve"] = True
        if python:
            self.spec["python"] = python
        self._dir = tempfile.TemporaryDirectory(prefix="kvbm-run-", dir=disk_dir())
        d = self._dir.name
        self._server = _start_server(self.spec["server"], d, col) if self.spec.get("server") else None
        self.tail: list[str] = []
        self.proc = _spawn_harness(self.spec, d, stdin=subprocess.PIPE)

    def _answer(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(self._result):
                rec: dict = json.loads(line[len(self._result):])
                return rec
            self.tail = (self.tail + [line])[-200:]
        code = self.proc.wait()
        raise RuntimeError(f"{self.label}: engine exited (exit {code}): {startup_error(self.tail)}")

    def ready(self) -> None:
        """Returns once the engine is up (raises with its root cause if it
        exited)."""
        self._answer()

    def do(self, act: dict) -> dict:
        """One action (vllm_harness's spec format); its record. An action the
        engine could not run raises with the engine's error."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(act) + "\n")
        self.proc.stdin.flush()
        rec = self._answer()
        if "error" in rec:
            raise RuntimeError(f"{self.label}: {act.get('tag', 'action')}: {rec['error']}")
        return rec

    def close(self) -> None:
        """Ends the engine (end of its input; killed after 120 s) and the
        column's server; removes its run directory."""
        try:
            if self.proc.stdin is not None and not self.proc.stdin.closed:
                self.proc.stdin.close()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        finally:
            if self._server is not None:
                _stop_server(*self._server)
            self._dir.cleanup()


def _cannot_run(col: str) -> str | None:
    """Why a column cannot run on this machine before its engine starts (a
    peer without its environment), or None."""
    if col == peers.LMCACHE and peers.lmcache_python(_checkout()) is None:
        return (f"no LMCache environment at {peers.lmcache_env_dir(_checkout())} "
                "(scripts/lmcache-env.sh creates it)")
    return None


def start_columns(columns: Sequence[str], model: dict, engine: dict, g1: int, host: int, disk: int,
                  kv_env: dict | None = None, python: dict[str, str] | None = None
                  ) -> tuple[dict[str, LiveColumn], dict[str, str]]:
    """Every column's engine started at once and waited for: ({column: live
    engine}, {peer column: why it could not start}). A peer that cannot run
    (no LMCache environment, a start-up error) is left out with its reason;
    any other column that fails ends the caller (SystemExit with the
    engine's root cause), after the engines already started are closed.
    python: an interpreter per column, in place of the column's own."""
    live: dict[str, LiveColumn] = {}
    failed: dict[str, str] = {}
    t0 = time.time()
    print(f"== starting {len(columns)} engines side by side (vLLM CPU backend): {', '.join(columns)} ...", flush=True)
    try:
        for col in columns:
            why = _cannot_run(col)
            if why:
                failed[col] = why
                continue
            try:
                live[col] = LiveColumn(col, model, engine, g1, host, disk, kv_env, (python or {}).get(col))
            except (OSError, _ColumnFailed) as e:
                if col not in peers.PEERS:
                    raise
                failed[col] = str(e)
        for col in list(live):
            try:
                live[col].ready()
            except RuntimeError as e:
                if col not in peers.PEERS:
                    raise SystemExit(str(e)) from None
                failed[col] = startup_error(live[col].tail)
                live.pop(col).close()
        for col, why in failed.items():
            print(f"== {col}: not run: {why}", flush=True)
        print(f"== {len(live)} engines up in {time.time() - t0:.0f} s", flush=True)
        return live, failed
    except BaseException:
        for c in live.values():
            c.close()
        raise


def mean_interval(xs: Sequence[float], seed: int = 0, resamples: int = 2000) -> tuple[float, float, float]:
    """Mean of paired differences (one per request or window, each measured
    against its pair moments apart) and its 95% bootstrap interval:
    (mean, low, high)."""
    if not xs:
        raise ValueError("mean_interval: no values")
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(xs, k=len(xs))) for _ in range(resamples))
    return statistics.fmean(xs), means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def paired_ratio(ratios: Sequence[float], seed: int = 0, resamples: int = 2000) -> tuple[float, float, float]:
    """Geometric mean of paired ratios (one per request or batch, each
    measured against its pair moments apart) and its 95% bootstrap interval:
    (mean, low, high)."""
    if not ratios or min(ratios) <= 0:
        raise ValueError(f"paired_ratio: want positive ratios, got {list(ratios)!r}")
    m, lo, hi = mean_interval([math.log(r) for r in ratios], seed, resamples)
    return math.exp(m), math.exp(lo), math.exp(hi)


def verdict(low: float, high: float, target: float) -> bool | None:
    """A target decided by an interval: True when all of it meets the target,
    False when none of it does, None (not decided) otherwise."""
    if low >= target:
        return True
    if high < target:
        return False
    return None


def column_spec(col: str, model: dict, engine: dict, g1: int, host: int, disk: int, actions: list,
                kv_env: dict | None = None, port: int = 0, http_port: int = 0) -> dict:
    """The harness spec of one column: its engine settings, connector,
    environment, interpreter and server. Every column gets G1 of g1 blocks
    (the enlarged baseline g1 + host); kvbm and the peers get host blocks'
    bytes of host memory and disk blocks' bytes on disk (peers: port and
    http_port for a server's sockets)."""
    eng = dict(engine, num_gpu_blocks_override=g1 + (host if col == ENLARGED else 0))
    with_kvbm = col in ("kvbm", KVBM_INHERIT, KVBM_HMA_OFF, KVBM_G2_ONLY)
    if col == KVBM_HMA_OFF:
        eng["disable_hybrid_kv_cache_manager"] = True
    spec: dict[str, Any] = {"model": model, "engine": eng, "kvbm": with_kvbm,
                            "noop_connector": col == "no-op connector", "actions": actions, "env": {}}
    if with_kvbm:
        spec["env"] = dict({"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": host,
                            "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": disk}, **KVBM_ENV, **(kv_env or {}))
        if col == KVBM_G2_ONLY:
            spec["env"]["DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS"] = 0
        if col == KVBM_INHERIT:
            spec["env"]["DYN_KVBM_THREAD_AFFINITY"] = "inherit"
    elif col == peers.LMCACHE:
        bb = peers.block_bytes(model, eng)
        env_dir = peers.lmcache_env_dir(_checkout())
        spec["python"] = os.path.join(env_dir, "bin", "python")
        spec["kv_transfer_config"] = peers.lmcache_transfer_config(port)
        spec["env"] = dict(peers.LMCACHE_ENV)
        spec["server"] = {"argv": peers.lmcache_server_argv(env_dir, port, http_port, host * bb, disk * bb,
                                                            os.path.join("{run_dir}", "lmcache-l2")),
                          "env": dict(peers.LMCACHE_ENV),
                          "port": port}
    elif col == peers.OFFLOADING:
        spec["kv_transfer_config"] = peers.offloading_transfer_config(host * peers.block_bytes(model, eng))
    elif col not in COLUMNS:
        raise ValueError(f"unknown column {col!r}: one of "
                         f"{', '.join(COLUMNS + peers.PEERS + (KVBM_INHERIT, KVBM_HMA_OFF, KVBM_G2_ONLY))}")
    return spec


def run_columns(model: dict, engine: dict, g1: int, host: int, disk: int, actions: list,
                columns: Sequence[str] = COLUMNS, kv_env: dict | None = None) -> dict:
    """Every column's run of actions; returns {column: {tag: action record}}.
    A peer column that cannot run returns {"error": why} and the others go
    on (LMCache without its environment: scripts/lmcache-env.sh)."""
    out: dict[str, dict[str, Any]] = {}
    for i, col in enumerate(columns):
        why = _cannot_run(col)
        if why:
            print(f"== run {i + 1}/{len(columns)}: {col}: skipped, {why}", flush=True)
            out[col] = {"error": why}
            continue
        spec = column_spec(col, model, engine, g1, host, disk, actions, kv_env,
                           port=free_port(), http_port=free_port())
        res = run_harness(spec, f"run {i + 1}/{len(columns)}: {col} "
                                f"(G1 {spec['engine']['num_gpu_blocks_override']} blocks)",
                          may_fail=col in peers.PEERS)
        out[col] = {"error": res["error"]} if "error" in res else {a["tag"]: a for a in res["actions"]}
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def tier_split(recs: list[dict], before: dict | None, peer: str | None = None) -> dict:
    """Prompt tokens served by G1, G2, G3 and recomputed, over the timed
    requests of the records recs (in order); before: kvbm's metrics before
    the first of them (None without kvbm). kvbm's onboard counters count
    engine-sized blocks (BS tokens); a connector's tokens are part of vLLM's
    num_cached_tokens, so G1's share is what remains. peer: a peer
    connector's name; vLLM does not tell its loads from G1 hits, so they
    are counted together under "G1 or <peer>"."""
    prompt = sum(sum(r["prompt_lens"]) for r in recs)
    cached = sum(sum(c or 0 for c in r["num_cached_tokens"]) for r in recs)
    g2 = g3 = 0
    if before is not None:
        after = recs[-1].get("metrics", {})
        g2 = (after.get("kvbm_onboard_blocks_h2d", 0) - before.get("kvbm_onboard_blocks_h2d", 0)) * BS
        g3 = (after.get("kvbm_onboard_blocks_d2d", 0) - before.get("kvbm_onboard_blocks_d2d", 0)) * BS
    g1 = max(cached - g2 - g3, 0)
    out = {"prompt": prompt, "G1": g1, "G2": g2, "G3": g3, "recomputed": max(prompt - cached, 0)}
    if peer:
        out["peer"] = peer
    return out


def stored_bytes_per_token(rec: dict, prompt_tokens: int) -> float | None:
    """Bytes kvbm wrote from G1 per prompt token, by the end of the record
    rec (kvbm's offload counters × its block bytes); None without them."""
    m = rec.get("metrics") or {}
    blocks = m.get("kvbm_offload_blocks_d2h", 0) + m.get("kvbm_offload_blocks_d2d", 0)
    bb = m.get("kvbm_block_bytes")
    if not bb or prompt_tokens <= 0:
        return None
    return float(blocks * bb / prompt_tokens)


def fmt_split(s: dict) -> str:
    p = max(s["prompt"], 1)
    parts = [f"{'G1 or ' + s['peer'] if s.get('peer') else 'G1'} {100 * s['G1'] / p:.0f}%"]
    if s["G2"] or s["G3"]:
        parts += [f"G2 {100 * s['G2'] / p:.0f}%", f"G3 {100 * s['G3'] / p:.0f}%"]
    parts.append(f"recomputed {100 * s['recomputed'] / p:.0f}%")
    return ", ".join(parts)


def strongest(vals: dict, lower_is_better: bool = True) -> str:
    """The column other than kvbm's with the best value (baselines and the
    peers that ran; kvbm's own variants are not baselines)."""
    cands: list[str] = [c for c in vals if not c.startswith("kvbm")]
    best: str = (min if lower_is_better else max)(cands, key=lambda c: vals[c])
    return best


def print_table(rows: list[tuple[str, dict, Callable[[Any], str]]], columns: Sequence[str]) -> None:
    """rows: (label, {column: value}, format) as a markdown table."""
    print("| figure | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for label, vals, fmt in rows:
        print(f"| {label} | " + " | ".join(fmt(vals[c]) if c in vals else "–" for c in columns) + " |")


def mean_ms(xs: Iterable[float]) -> str:
    return f"{statistics.mean(xs) * 1000:.0f} ms"


def pct(xs: Iterable[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]
