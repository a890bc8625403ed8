"""The bench's LMCache column on a real vLLM (CPU backend) and a real
`lmcache server`: a prompt evicted from G1 comes back and LMCache serves it
(vLLM's num_cached_tokens), with the same output as its first visit.

Not in the default selection (the file name does not match test_*.py): it
needs .venv-lmcache, which .ci/run does not build. Run it by name:

    scripts/lmcache-env.sh && make build && \\
      PYTHONPATH=$PWD/python .venv/bin/python -m pytest tests/e2e/lmcache_smoke.py -q

Without the environment it fails (never skips) and says how to create it.
One to four minutes on 2 cores, with the load.
"""

import os
import random

import pytest

from kvbm.testing import compare, peers

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = dict(hidden=512, layers=2, heads=8, kv_heads=2, intermediate=512, vocab=500, arch="qwen2",
             dir="/tmp/kvbm-lmcache-smoke-model")


def prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(3, 499) for _ in range(n)]


def test_lmcache_column_serves_an_evicted_prompt():
    assert peers.lmcache_python(ROOT), ("no LMCache environment at " + peers.lmcache_env_dir(ROOT)
                                        + ": run scripts/lmcache-env.sh")
    a, b = prompt(1, 10 * compare.BS + 5), prompt(2, 10 * compare.BS + 5)  # b evicts a from a 16-block G1
    engine = {"max_model_len": 448, "max_num_batched_tokens": 512, "max_num_seqs": 4}
    actions = [{"each": [a, b, a], "max_tokens": 8, "tag": "visits"}]
    spec = compare.column_spec(peers.LMCACHE, MODEL, engine, g1=16, host=32, disk=128, actions=actions,
                               port=compare.free_port(), http_port=compare.free_port())
    res = compare.run_harness(spec, "LMCache smoke")
    rec = res["actions"][0]
    assert rec["tokens"][2] == rec["tokens"][0]
    # LMCache stores whole 256-token chunks: the re-visit gets at least one
    # from it (G1 kept none of a's blocks: b took them).
    assert rec["num_cached_tokens"][2] >= 256, rec["num_cached_tokens"]
