"""kvbm's Go threads start off the cores an engine binds its model to
(kvbm._affinity, DYN_KVBM_THREAD_AFFINITY)."""

import os
import subprocess
import sys
import textwrap

import pytest

from kvbm import _affinity

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_engine_cores_from_vllms_variables():
    assert _affinity.engine_cores({"OMP_PLACES": "{1}", "OMP_PROC_BIND": "true"}) == {1}
    assert _affinity.engine_cores({"OMP_PLACES": "{2,3,5}", "OMP_PROC_BIND": "true"}) == {2, 3, 5}
    assert _affinity.engine_cores({"OMP_PLACES": "{4:3}", "OMP_PROC_BIND": "close"}) == {4, 5, 6}
    assert _affinity.engine_cores({"OMP_PLACES": "{0},{2}", "OMP_PROC_BIND": "true"}) == {0, 2}
    assert _affinity.engine_cores({"GOMP_CPU_AFFINITY": "0 2-3"}) == {0, 2, 3}
    # not bound, or not a form read here: nothing changes
    assert _affinity.engine_cores({"OMP_PLACES": "{1}"}) is None
    assert _affinity.engine_cores({"OMP_PLACES": "cores", "OMP_PROC_BIND": "true"}) is None
    assert _affinity.engine_cores({"OMP_PLACES": "{a}", "OMP_PROC_BIND": "true"}) is None
    assert _affinity.engine_cores({}) is None


def test_runtime_cores_are_the_others():
    bound = {"OMP_PLACES": "{1}", "OMP_PROC_BIND": "true"}
    assert _affinity.runtime_cores(bound, available={0, 1}) == {0}
    assert _affinity.runtime_cores(bound, available={1}) is None  # no other core: unchanged
    assert _affinity.runtime_cores({}, available={0, 1}) is None
    assert _affinity.runtime_cores(dict(bound, DYN_KVBM_THREAD_AFFINITY="inherit"), available={0, 1}) is None
    with pytest.raises(ValueError, match="DYN_KVBM_THREAD_AFFINITY"):
        _affinity.runtime_cores(dict(bound, DYN_KVBM_THREAD_AFFINITY="engine"), available={0, 1})


PROBE = textwrap.dedent("""
    import glob, json, os, sys
    os.sched_setaffinity(0, {int(sys.argv[1])})  # as vLLM's OpenMP binding leaves the worker's main thread
    from kvbm import _native
    _native.lib()
    masks = {}
    for t in glob.glob("/proc/self/task/*"):
        tid = int(os.path.basename(t))
        masks[tid] = sorted(os.sched_getaffinity(tid))
    print(json.dumps({"main": sorted(os.sched_getaffinity(0)), "tid": os.getpid(), "masks": masks}))
""")


def _probe(model_core: int, env: dict) -> dict:
    import json

    e = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), OMP_PLACES="{%d}" % model_core,
             OMP_PROC_BIND="true", **env)
    out = subprocess.run([sys.executable, "-c", PROBE, str(model_core)], env=e, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to bind the model to one of them")
def test_go_threads_start_off_the_model_core():
    """The library loaded from a thread bound to the model's core: the Go
    runtime's threads run on the process's other cores, the loading thread
    keeps its own core; with inherit they stay on the model's core."""
    cores = sorted(os.sched_getaffinity(0))
    model = cores[-1]
    r = _probe(model, {})
    assert r["main"] == [model]
    go = [m for tid, m in r["masks"].items() if int(tid) != r["tid"]]
    assert go, "the Go runtime started no thread"
    assert all(model not in m for m in go), r["masks"]
    r = _probe(model, {"DYN_KVBM_THREAD_AFFINITY": "inherit"})
    assert all(m == [model] for m in r["masks"].values()), r["masks"]
