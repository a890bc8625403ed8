"""kvbm inside `vllm serve` (CPU backend, its worker in a process of its own):
after a re-visit served from kvbm's host tier, vLLM's own HTTP `/metrics`
shows kvbm's series from the scheduler and the worker, and vLLM's periodic
stats log carries kvbm's figures in its "KV Transfer metrics" line."""

import json
import os
import random
import re
import subprocess
import sys
import time

import pytest
import requests

from kvbm.testing.ports import free_ports
from kvbm.testing.tiny_model import make_tiny_model
from kvbm.testing.vllm_harness import CONNECTOR

pytestmark = pytest.mark.e2e

BS = 32  # vLLM's CPU attention needs a multiple of 32


def prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def series(text, name):
    """{labels: value} of one metric family in Prometheus text format."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"^" + re.escape(name) + r"(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


def test_vllm_serve_metrics_and_log_show_kvbm(tmp_path):
    model = make_tiny_model(str(tmp_path / "model"))
    (port,) = free_ports(1)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", PYTHONHASHSEED="0",
               VLLM_LOG_STATS_INTERVAL="1", DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="100",
               DYN_KVBM_DISK_CACHE_DIR=str(tmp_path))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.environ.get("KVBM_TEST_INSTALLED"):
        env["PYTHONPATH"] = os.path.join(root, "python") + os.pathsep + env.get("PYTHONPATH", "")
    log_path = tmp_path / "serve.log"
    # The OpenAI server module, not the `vllm` CLI: the CLI asks for the
    # distribution "vllm", and the CPU build is installed as "vllm-cpu".
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--enforce-eager", "--block-size", str(BS),
           "--num-gpu-blocks-override", "16", "--max-model-len", "448", "--max-num-seqs", "4",
           "--max-num-batched-tokens", "512", "--enable-prefix-caching", "--seed", "0",
           "--kv-transfer-config", json.dumps(CONNECTOR)]
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            assert p.poll() is None, log_path.read_text()[-6000:]
            try:
                if requests.get(base + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, "vllm serve did not come up:\n" + log_path.read_text()[-6000:]
            time.sleep(1)

        def complete(tokens):
            r = requests.post(base + "/v1/completions", timeout=300,
                              json={"model": model, "prompt": tokens, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        a, b = prompt(31, 6 * BS + 7), prompt(32, 13 * BS + 3)  # B pushes A out of a 16-block G1
        first = complete(a)
        complete(b)
        assert complete(a) == first

        # Stats reach the scheduler's loggers with the next steps; wait for them.
        got: dict = {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            text = requests.get(base + "/metrics", timeout=10).text
            got = {name: series(text, name) for name in (
                "vllm:kvbm_transfer_blocks_total", "vllm:kvbm_transfer_bytes_total", "vllm:kvbm_loaded_tokens_total")}
            onboarded = [v for k, v in got["vllm:kvbm_transfer_blocks_total"].items() if 'g2_to_g1' in k]
            if onboarded and onboarded[0] > 0 and re.search(r"KV Transfer metrics: .*kvbm g2_to_g1 blocks=[1-9]",
                                                            log_path.read_text()):
                break
            requests.get(base + "/health", timeout=2)
            time.sleep(1)
        blocks = got["vllm:kvbm_transfer_blocks_total"]
        assert any("g1_to_g2" in k and v > 0 for k, v in blocks.items()), got  # the worker's offloads
        assert any("g2_to_g1" in k and v > 0 for k, v in blocks.items()), got  # the worker's onboards
        assert any("g2_to_g1" in k and v > 0 for k, v in got["vllm:kvbm_transfer_bytes_total"].items()), got
        assert any("host" in k and v > 0 for k, v in got["vllm:kvbm_loaded_tokens_total"].items()), got
        lines = [ln for ln in log_path.read_text().splitlines() if "KV Transfer metrics" in ln]
        assert lines, "no KV Transfer metrics log line"
        # The worker's onboards, reported from its own process, in vLLM's log line.
        assert any(re.search(r"kvbm g2_to_g1 blocks=[1-9]", ln) for ln in lines), lines
        assert "kvbm failed" not in log_path.read_text()
    finally:
        p.terminate()
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
