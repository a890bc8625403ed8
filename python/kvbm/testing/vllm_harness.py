"""Run vLLM's CPU backend with or without kvbm and report what happened.

Used as a subprocess (vLLM spawns its engine processes, so each run gets a
fresh interpreter)::

    python -m kvbm.testing.vllm_harness spec.json result.json

spec: {"model": {...make_tiny_model kwargs..., "dir": path},
       "engine": {...LLM kwargs overrides...},
       "kvbm": true|false, "env": {...},
       "kv_transfer_config": {...} (another connector instead of kvbm's),
       "events": false | {"endpoint": "tcp://*:5557"},
       "collect": {name: endpoint} (ZMQ subscribers; "consolidated" is kvbm's),
       "settle_collectors": seconds (collectors other than "consolidated" are
           complete once nothing arrived for that long after the last action),
       "actions": [{"generate": [[ids...], ...], "max_tokens": 8, "tag": "first"},
                   {"each": [[ids...], ...], "max_tokens": 1, "check_tokens": 16, "tag": "timed"},
                   {"generate": [...], "salt": "tenant"} (vLLM's cache_salt),
                   {"generate": [...], "logprobs": true} (each token's log-probability too),
                   {"purge": {"salt": "tenant"} | {"all": true} | ...} (kvbm.admin.purge),
                   {"reset": true, "reset_connector": false}, {"corrupt_disk": true},
                   {"quiesce": true},
                   {"s3": "stop" | "start", "state": dir (kvbm.testing.s3server)},
                   {"wait_metric": "kvbm_...", "at_least": n, "at_most": m, "timeout_s": 60,
                    "poke": [ids...] (generated, 1 token, between scrapes: keeps the engine stepping)},
                   {"s3_objects": state dir, "bucket": name, "at_least": n, "timeout_s": 60}],
       "serve": true (after the actions, more actions one JSON line at a time
           on stdin, each answered on stdout: see serve())}
result: {"startup_s": float, "actions": [{"tag", "tokens", "secs", "ttft_s", "metrics"}...]}
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

CONNECTOR = {
    "kv_connector": "DynamoConnector",
    "kv_role": "kv_both",
    "kv_connector_module_path": "kvbm.vllm_integration.connector",
}

_METRIC_LINE = re.compile(r"^(kvbm_[a-z0-9_]+)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def scrape(port: int) -> dict:
    """kvbm_* metrics (unlabelled, or summed over labels) from the endpoint."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError as e:
        return {"_error": str(e)}
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC_LINE.match(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def engine_kwargs(model: str, spec: dict) -> dict:
    kw = dict(
        model=model,
        tokenizer=model,
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        num_gpu_blocks_override=16,
        max_model_len=448,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        enable_prefix_caching=True,
        prefix_caching_hash_algo="sha256_cbor",
        seed=0,
        disable_log_stats=True,
    )
    kw.update(spec.get("engine", {}))
    if spec.get("kv_transfer_config"):  # a peer's connector (kvbm.testing.peers)
        kw["kv_transfer_config"] = dict(spec["kv_transfer_config"])
    elif spec.get("kvbm", True):
        kw["kv_transfer_config"] = dict(CONNECTOR)
    elif spec.get("noop_connector"):
        kw["kv_transfer_config"] = {"kv_connector": "NoopConnector", "kv_role": "kv_both",
                                    "kv_connector_module_path": "kvbm.testing.noop_connector"}
    if spec.get("events"):
        kw["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                  "endpoint": spec["events"].get("endpoint", "tcp://*:5557"),
                                  "topic": spec["events"].get("topic", "")}
    return kw


class FrameCollector:
    """Collects every ZMQ message published at an endpoint (a SUB thread)."""

    def __init__(self, endpoint: str) -> None:
        import threading

        import zmq

        self.frames: list[list[bytes]] = []
        self._stop = threading.Event()
        self._joined = threading.Event()
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._sub.connect(endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                if sock is self._sub:
                    self.frames.append(self._sub.recv_multipart())
                else:
                    self._monitor.recv_multipart()
                    self._joined.set()

    def wait_joined(self, timeout: float) -> bool:
        """Whether the publisher completed the ZMTP handshake with us."""
        return self._joined.wait(timeout)

    def events(self) -> int:
        """Number of events in the batches received so far."""
        return sum(len(b[1]) for b in _decode_frames(list(self.frames)) if isinstance(b, list))

    def close(self) -> list[list[bytes]]:
        self._stop.set()
        self._thread.join(2)
        self._sub.disable_monitor()
        self._monitor.close(0)
        self._sub.close(0)
        self._ctx.term()
        return self.frames


def _wait_for(pred: Callable[[], bool], timeout: float) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


def _settle(c: FrameCollector, quiet_s: float, timeout: float = 60) -> None:
    """Wait until c received nothing new for quiet_s seconds."""
    end = time.time() + timeout
    last, since = len(c.frames), time.time()
    while time.time() < end and time.time() - since < quiet_s:
        time.sleep(0.05)
        if len(c.frames) != last:
            last, since = len(c.frames), time.time()


def _decode_frames(frames: Sequence[Sequence[bytes]]) -> list[Any]:
    import msgpack

    out: list[Any] = []
    for f in frames:
        try:
            out.append(msgpack.unpackb(f[-1], raw=False, strict_map_key=False))
        except Exception as e:  # noqa: BLE001
            out.append({"_undecodable": repr(e)})
    return out


def corrupt_disk_files(directory: str) -> int:
    """Flip bytes in every kvbm disk tier file under directory; returns files touched."""
    n = 0
    for name in os.listdir(directory):
        if not name.startswith("kvbm"):
            continue
        path = os.path.join(directory, name)
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            step = 4096
            for off in range(0, size, step):
                f.seek(off)
                b = f.read(1)
                if not b:
                    break
                f.seek(off)
                f.write(bytes([b[0] ^ 0xFF]))
        n += 1
    return n


def do_action(llm: Any, act: dict, i: int, metrics_port: int | None) -> dict:
    """One action of a spec on the running engine; its record."""
    from vllm import SamplingParams

    rec: dict = {"tag": act.get("tag", str(i))}
    if "each" in act:
        # One request at a time: the wall time of a max_tokens=1 request is
        # its time to first token on an otherwise idle engine.
        sp = SamplingParams(temperature=0.0, max_tokens=act.get("max_tokens", 1), ignore_eos=True)
        rec["secs_each"], rec["tokens"], rec["num_cached_tokens"] = [], [], []
        rec["prompt_lens"] = [len(p) for p in act["each"]]
        for j, p in enumerate(act["each"]):
            t = time.time()
            o = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
            rec["secs_each"].append(time.time() - t)
            rec["tokens"].append(list(o.outputs[0].token_ids))
            rec["num_cached_tokens"].append(getattr(o, "num_cached_tokens", None))
            if act.get("check_tokens"):
                # The same prompt continued for check_tokens tokens (its
                # KV is in G1 now, as computed or loaded): the output
                # compared across runs for correctness.
                chk = SamplingParams(temperature=0.0, max_tokens=act["check_tokens"], ignore_eos=True)
                c = llm.generate([{"prompt_token_ids": p}], chk, use_tqdm=False)[0]
                rec.setdefault("check", []).append(list(c.outputs[0].token_ids))
            if act.get("progress"):
                print(f"[{act.get('tag', i)}] request {j + 1}/{len(act['each'])}: {len(p)} prompt tokens, "
                      f"{rec['secs_each'][-1] * 1000:.0f} ms", flush=True)
    elif "generate" in act:
        sp = SamplingParams(temperature=0.0, max_tokens=act.get("max_tokens", 8), ignore_eos=True,
                            logprobs=0 if act.get("logprobs") else None)
        prompts = [{"prompt_token_ids": p} for p in act["generate"]]
        if act.get("salt") is not None:  # vLLM's cache_salt: kvbm's salt hash (design §3)
            for pr in prompts:
                pr["cache_salt"] = act["salt"]
        t = time.time()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        rec["secs"] = time.time() - t
        rec["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        rec["num_cached_tokens"] = [getattr(o, "num_cached_tokens", None) for o in outs]
        if act.get("logprobs"):  # each generated token's log-probability, per prompt
            rec["logprobs"] = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs or [], o.outputs[0].token_ids)]
                               for o in outs]
        ttfts = []
        for o in outs:
            m = getattr(o, "metrics", None)
            ft = getattr(m, "first_token_latency", None) if m is not None else None
            ttfts.append(ft)
        rec["ttft_s"] = ttfts
    elif act.get("purge"):
        # The operator endpoint of the engine's leader (kvbm.admin), as
        # `python -m kvbm purge` reaches it.
        from kvbm import admin

        rec["purge"] = admin.purge(**act["purge"])
    elif act.get("reset"):
        # reset_connector: kvbm's tiers too (vLLM calls the connector's reset_cache).
        rec["reset"] = bool(llm.reset_prefix_cache(reset_connector=bool(act.get("reset_connector"))))
    elif act.get("vllm_metric"):
        # vLLM's own counters (needs "engine": {"disable_log_stats": false}):
        # one value per label set, keyed by the label named in "by".
        by = act.get("by", "")
        rec["vllm_metric"] = {m.labels.get(by, ""): getattr(m, "value", None)
                              for m in llm.get_metrics() if m.name == act["vllm_metric"]}
    elif act.get("corrupt_disk"):
        rec["corrupted_files"] = corrupt_disk_files(os.environ.get("DYN_KVBM_DISK_CACHE_DIR", "/tmp/"))
    elif act.get("s3"):
        from kvbm.testing.s3server import S3Server

        srv = S3Server.load(act["state"])
        srv.stop() if act["s3"] == "stop" else srv.start()
        rec["s3"] = act["s3"]
    elif act.get("wait_metric") and metrics_port:
        # Background work (G4 uploads) reached a count: a condition, not a sleep.
        name, lo, hi = act["wait_metric"], act.get("at_least"), act.get("at_most")

        poke = act.get("poke")
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

        def reached() -> bool:
            if poke:  # workers report their counters with each engine step
                llm.generate([{"prompt_token_ids": poke}], one, use_tqdm=False)
            v = scrape(metrics_port).get(name)
            return v is not None and (lo is None or v >= lo) and (hi is None or v <= hi)

        rec["reached"] = _wait_for(reached, act.get("timeout_s", 60))
    elif act.get("s3_objects"):
        from kvbm.testing.s3server import count_objects

        want = act.get("at_least", 1)
        rec["reached"] = _wait_for(lambda: count_objects(act["s3_objects"], act["bucket"]) >= want,
                                   act.get("timeout_s", 60))
        rec["objects"] = count_objects(act["s3_objects"], act["bucket"])
    elif act.get("quiesce") and metrics_port:
        # kvbm's background work (G2→G3 moves, events) has finished when
        # its counters stop changing across consecutive scrapes.
        last, same = None, 0
        end = time.time() + act.get("timeout_s", 60)
        while same < 3 and time.time() < end:
            cur = {k: v for k, v in scrape(metrics_port).items() if not k.endswith("hit_rate")}
            same = same + 1 if cur == last else 0
            last = cur
            time.sleep(0.2)
        rec["quiesced"] = same >= 3
    if metrics_port:
        rec["metrics"] = scrape(metrics_port)
    return rec


RESULT = "@@kvbm-harness-result "


def serve(llm: Any, metrics_port: int | None, inp: Any, out: Any) -> int:
    """Actions one JSON line at a time from inp, each answered by one line on
    out: RESULT and the action's record as JSON, or {"error": ...} for an
    action that raised (the engine stays up). Returns at the end of inp with
    the number of actions run. The engine stays up between actions, so a
    caller can interleave requests to several engines (bench/vllm_ttft.py
    --cost). The first line out, {"ready": true}, says the engine is up."""
    out.write(RESULT + json.dumps({"ready": True}) + "\n")
    out.flush()
    n = 0
    for line in inp:
        if not line.strip():
            continue
        try:
            act = json.loads(line)
            rec = do_action(llm, act, n, metrics_port)
        except Exception as e:  # noqa: BLE001 - reported to the caller, which decides
            rec = {"error": f"{type(e).__name__}: {e}"}
        out.write(RESULT + json.dumps(rec) + "\n")
        out.flush()
        n += 1
    return n


def run(spec: dict) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("PYTHONHASHSEED", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    for k, v in (spec.get("env") or {}).items():
        os.environ[k] = str(v)
    metrics_port = None
    if spec.get("kvbm", True):
        metrics_port = free_port()
        os.environ["DYN_KVBM_METRICS"] = "true"
        os.environ["DYN_KVBM_METRICS_PORT"] = str(metrics_port)

    from kvbm.testing.tiny_model import make_tiny_model

    mspec = dict(spec.get("model") or {})
    model_dir = mspec.pop("dir", "/tmp/kvbm-tiny-model")
    model = make_tiny_model(model_dir, **mspec)

    from vllm import LLM

    collectors = {name: FrameCollector(ep) for name, ep in (spec.get("collect") or {}).items()}
    t0 = time.time()
    llm = LLM(**engine_kwargs(model, spec))
    result: dict[str, Any] = {"startup_s": time.time() - t0, "metrics_port": metrics_port, "actions": []}
    for name, c in collectors.items():  # both publishers are bound once the engine is up
        if not c.wait_joined(60):
            raise RuntimeError(f"collector {name!r} did not join its publisher in 60 s")
    for i, act in enumerate(spec.get("actions", [])):
        rec = do_action(llm, act, i, metrics_port)
        result["actions"].append(rec)
        print(f"[harness] {rec['tag']}: " + json.dumps({k: v for k, v in rec.items() if k not in ('tokens',)})[:400],
              flush=True)
    if spec.get("serve"):
        serve(llm, metrics_port, sys.stdin, sys.stdout)
    if collectors:
        # The consolidated stream is complete when the collector holds every
        # event the consolidator counted as published.
        cons = collectors.get("consolidated")
        if cons is not None and metrics_port:
            port = metrics_port

            def want() -> float | None:
                n: float | None = scrape(port).get("kvbm_consolidator_events_out")
                return n

            def complete() -> bool:
                n = want()
                return n is not None and cons.events() >= n

            if not _wait_for(complete, 60):
                raise RuntimeError(f"consolidated events: received {cons.events()}, published {want()}")
        for name, c in collectors.items():
            if name != "consolidated" and spec.get("settle_collectors"):
                # The engine's own stream has no published count to wait
                # for: it is complete when nothing more arrives for a while
                # (the last action left the engine idle).
                _settle(c, spec["settle_collectors"])
        result["collected"] = {name: _decode_frames(c.close()) for name, c in collectors.items()}
    del llm
    return result


def main(argv: Sequence[str] | None = None) -> int:
    argv = argv or sys.argv[1:]
    with open(argv[0]) as f:
        spec = json.load(f)
    res = run(spec)
    with open(argv[1], "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
