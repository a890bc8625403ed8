"""Run vLLM (CPU backend) offline on a tiny random model with ProbeConnector.

    .venv/bin/python tests/e2e/run_probe.py [--log /tmp/probe.jsonl] [--events] [--model-dir DIR]

Writes the connector call log (JSONL, see probe_connector.py) and prints
timings, generated token ids and, with --events, the KV events received from
vLLM's ZMQ publisher.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _events_subscriber(endpoint: str, topic: str, sink: list, stop: threading.Event) -> None:
    import msgpack
    import zmq

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    while not stop.is_set():
        if not poller.poll(100):
            continue
        frames = sub.recv_multipart()
        rec = {"n_frames": len(frames), "topic": frames[0].decode(errors="replace")}
        if len(frames) >= 3:
            rec["seq"] = int.from_bytes(frames[1], "big")
            try:
                rec["payload"] = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
            except Exception as e:  # noqa: BLE001
                rec["payload_err"] = repr(e)
        sink.append(rec)
    sub.close(0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", default="/tmp/kvbm-probe.jsonl")
    ap.add_argument("--model-dir", default="/tmp/kvbm-tiny-model")
    ap.add_argument("--events", action="store_true", help="enable kv_events_config (zmq tcp://*:5557)")
    ap.add_argument("--blocks", type=int, default=64, help="num_gpu_blocks_override")
    ap.add_argument("--block-size", type=int, default=32)  # CPU_ATTN: MultipleOf(32) in 0.32
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--events-out", default=None, help="write received KV events here (JSON)")
    a = ap.parse_args()

    # Must be set before vLLM is imported (env is read at import / in children).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("PYTHONHASHSEED", "0")
    os.environ["KVBM_PROBE_LOG"] = a.log
    # Spawned worker processes must be able to import the connector module.
    pp = os.environ.get("PYTHONPATH", "")
    if HERE not in pp.split(os.pathsep):
        os.environ["PYTHONPATH"] = HERE + (os.pathsep + pp if pp else "")
    sys.path.insert(0, HERE)
    if os.path.exists(a.log):
        os.remove(a.log)

    from tiny_model import make_tiny_model

    t0 = time.time()
    model = make_tiny_model(a.model_dir)
    print(f"[probe] model ready in {time.time() - t0:.1f}s: {model}", flush=True)

    from vllm import LLM, SamplingParams

    kw = {}
    events: list = []
    stop = threading.Event()
    if a.events:
        kw["kv_events_config"] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "topic": "kv-events",
        }
        th = threading.Thread(target=_events_subscriber,
                              args=("tcp://127.0.0.1:5557", "kv-events", events, stop), daemon=True)
        th.start()

    t0 = time.time()
    llm = LLM(
        model=model,
        tokenizer=model,
        dtype="float32",
        enforce_eager=True,
        block_size=a.block_size,
        num_gpu_blocks_override=a.blocks,
        max_model_len=512,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        enable_prefix_caching=True,
        prefix_caching_hash_algo="sha256_cbor",
        seed=0,
        kv_transfer_config={
            "kv_connector": "ProbeConnector",
            "kv_connector_module_path": "probe_connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"probe": True},
        },
        **kw,
    )
    t_start = time.time() - t0
    print(f"[probe] LLM startup {t_start:.1f}s", flush=True)

    prefix = [(7 * i + 3) % 500 + 3 for i in range(40)]
    prompts = [
        {"prompt_token_ids": prefix + [11, 12, 13, 14, 15]},
        {"prompt_token_ids": prefix + [21, 22, 23]},
    ]
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)

    results = []
    for phase in ("first", "repeat_cached", "after_reset"):
        if phase == "after_reset":
            ok = llm.reset_prefix_cache()
            print(f"[probe] reset_prefix_cache -> {ok}", flush=True)
        t0 = time.time()
        outs = llm.generate(prompts, sp)
        dt = time.time() - t0
        toks = [list(o.outputs[0].token_ids) for o in outs]
        cached = [getattr(o, "num_cached_tokens", None) for o in outs]
        print(f"[probe] {phase}: {dt:.2f}s tokens={toks} num_cached_tokens={cached}", flush=True)
        results.append({"phase": phase, "secs": dt, "tokens": toks, "num_cached_tokens": cached})

    # A longer request to see multi-step decode and block growth.
    t0 = time.time()
    outs = llm.generate([{"prompt_token_ids": list(range(3, 103))}],
                        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    print(f"[probe] long: {time.time() - t0:.2f}s ntok={len(outs[0].outputs[0].token_ids)}", flush=True)

    if a.events:
        time.sleep(1.0)
        stop.set()
        print(f"[probe] kv events batches received: {len(events)}", flush=True)
        for e in events[:6]:
            print("[probe] event", json.dumps(e, default=repr)[:600], flush=True)
        if a.events_out:
            with open(a.events_out, "w") as f:
                json.dump(events, f, default=repr)

    same = results[0]["tokens"] == results[1]["tokens"] == results[2]["tokens"]
    print(f"[probe] outputs identical across phases: {same}", flush=True)
    print(f"[probe] startup_s={t_start:.1f} log={a.log}", flush=True)
    del llm
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
