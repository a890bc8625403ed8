"""The bench and demo harness (kvbm.testing.compare): every column's engine
runs the same model thread layout, and the peer columns (kvbm.testing.peers)
get kvbm's bytes. No engine runs here."""

import json
import os
import sys

import pytest

from kvbm.testing import compare, peers


def test_every_column_reserves_the_same_cores(monkeypatch):
    """vLLM's CPU backend reserves an extra core once a KV connector is
    configured; the harness overrides that the same way for every column, so
    columns with and without a connector run the model on equal threads."""
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "7")  # a caller's value does not leak into one column
    envs = {}
    for col in compare.COLUMNS:
        spec = {"kvbm": col == "kvbm", "noop_connector": col == "no-op connector",
                "env": {"DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": 8} if col == "kvbm" else {}}
        envs[col] = compare.harness_env(spec, "/root-of-tree", "/run-dir")
    assert {e["VLLM_CPU_NUM_OF_RESERVED_CPU"] for e in envs.values()} == {str(compare.RESERVED_CPUS)}
    assert envs["kvbm"]["DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS"] == "8"
    assert all(e["DYN_KVBM_DISK_CACHE_DIR"] == "/run-dir" for e in envs.values())
    assert all(e["PYTHONPATH"].startswith("/root-of-tree") for e in envs.values())
    assert f"VLLM_CPU_NUM_OF_RESERVED_CPU={compare.RESERVED_CPUS}" in compare.engine_threads()


SMALL = dict(hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1408, vocab=8000, arch="qwen2")
ENGINE = {"max_model_len": 1088, "max_num_batched_tokens": 2048, "max_num_seqs": 8}


def _specs(**kw):
    return {c: compare.column_spec(c, SMALL, ENGINE, g1=70, host=64, disk=768, actions=[{"tag": "a"}],
                                   port=5601, http_port=5602, **kw)
            for c in compare.COLUMNS + peers.PEERS}


def test_block_bytes_is_kvbm_block():
    """K and V of every layer for 32 tokens: 2 × 8 layers × 2 KV heads ×
    64 head dims × 32 tokens × 4 bytes (float32); bf16 halves it."""
    assert peers.block_bytes(SMALL, ENGINE) == 2 * 8 * 2 * 64 * 32 * 4
    assert peers.block_bytes(SMALL, dict(ENGINE, dtype="bfloat16")) == 2 * 8 * 2 * 64 * 32 * 2


def test_every_column_runs_the_same_engine_and_actions(monkeypatch):
    """Same actions and engine settings in every column; G1 differs only
    for the enlarged baseline, by exactly kvbm's host blocks; every column
    reserves the same cores."""
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "3")
    specs = _specs()
    for c, s in specs.items():
        assert s["actions"] == [{"tag": "a"}]
        want = 70 + (64 if c == compare.ENLARGED else 0)
        assert s["engine"] == dict(ENGINE, num_gpu_blocks_override=want), c
        env = compare.harness_env(s, "/root-of-tree", "/run")
        assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == str(compare.RESERVED_CPUS), c
    assert [c for c, s in specs.items() if s["kvbm"]] == ["kvbm"]
    assert [c for c, s in specs.items() if s.get("kv_transfer_config")] == list(peers.PEERS)


def test_lmcache_column_gets_kvbms_bytes_and_local_sockets():
    """LMCache's server: L1 = kvbm's G2 bytes (LRU), an O_DIRECT disk tier of
    kvbm's G3 bytes (LRU) in the run's directory, skip_l1, sockets on
    127.0.0.1, metrics off, usage reporting off in the server and the
    engine; the engine's connector points at the server's port."""
    s = _specs()[peers.LMCACHE]
    bb = peers.block_bytes(SMALL, ENGINE)
    argv = s["server"]["argv"]
    assert argv[0].endswith(os.path.join(".venv-lmcache", "bin", "lmcache")) and argv[1] == "server"

    def opt(name):
        return argv[argv.index(name) + 1]

    assert opt("--host") == "127.0.0.1" and opt("--http-host") == "127.0.0.1"
    assert opt("--port") == "5601" and opt("--http-port") == "5602" and s["server"]["port"] == 5601
    assert "--disable-metrics" in argv
    assert opt("--eviction-policy") == "LRU" and opt("--l2-store-policy") == "skip_l1"
    assert round(float(opt("--l1-size-gb")) * (1 << 30)) == 64 * bb
    l2 = json.loads(opt("--l2-adapter"))
    assert l2["use_odirect"] is True and l2["eviction"] == {"eviction_policy": "LRU"}
    assert round(l2["max_capacity_gb"] * (1 << 30)) == 768 * bb
    assert l2["base_path"].startswith("{run_dir}")
    assert s["server"]["env"]["LMCACHE_TRACK_USAGE"] == "false" and s["env"]["LMCACHE_TRACK_USAGE"] == "false"
    assert s["python"].endswith(os.path.join(".venv-lmcache", "bin", "python"))
    kv = s["kv_transfer_config"]
    assert kv["kv_connector"] == "LMCacheMPConnector" and kv["kv_role"] == "kv_both"
    extra = kv["kv_connector_extra_config"]
    assert extra["lmcache.mp.host"] == "tcp://127.0.0.1" and extra["lmcache.mp.port"] == 5601
    # the path the connector asks for is one the server serves
    assert extra["lmcache.mp.mp_transfer_mode"] == peers.LMCACHE_TRANSFER_MODE
    assert opt("--supported-transfer-mode") in ("auto", peers.LMCACHE_TRANSFER_MODE)


def test_offloading_column_gets_kvbms_host_bytes():
    s = _specs()[peers.OFFLOADING]
    kv = s["kv_transfer_config"]
    assert kv["kv_connector"] == "OffloadingConnector"
    assert kv["kv_connector_extra_config"]["cpu_bytes_to_use"] == 64 * peers.block_bytes(SMALL, ENGINE)
    assert "server" not in s and "python" not in s


def test_harness_uses_the_columns_connector():
    """The harness engine gets a peer's connector instead of kvbm's."""
    from kvbm.testing import vllm_harness

    specs = _specs()
    for c in peers.PEERS:
        kw = vllm_harness.engine_kwargs("/m", specs[c])
        assert kw["kv_transfer_config"] == specs[c]["kv_transfer_config"]
    assert vllm_harness.engine_kwargs("/m", specs["kvbm"])["kv_transfer_config"] == vllm_harness.CONNECTOR
    assert "kv_transfer_config" not in vllm_harness.engine_kwargs("/m", specs["no kvbm"])


def test_unknown_column_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown column 'lmcache'"):
        compare.column_spec("lmcache", SMALL, ENGINE, 70, 64, 768, [])


def test_startup_error_is_the_root_cause():
    """vLLM prints the engine core's error, then the front end's; the
    column's result is the first."""
    tail = ["INFO something\n",
            "(EngineCore_DP0 pid=12) ERROR Traceback (most recent call last):\n",
            "(EngineCore_DP0 pid=12) ValueError: CPU Offloading is currently only supported on CUDA-alike and "
            "XPU GPUs\n",
            "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n"]
    assert compare.startup_error(tail) == ("ValueError: CPU Offloading is currently only supported on CUDA-alike "
                                           "and XPU GPUs")
    assert compare.startup_error(["RuntimeError: Engine core initialization failed.\n"]).startswith("RuntimeError")
    assert compare.startup_error(["killed\n", "\n"]) == "killed"


def test_a_failing_peer_column_reports_its_error_and_the_bench_goes_on(monkeypatch, tmp_path):
    """run_harness(may_fail=True) returns the engine's root cause instead of
    ending the run (a script stands in for the engine)."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'starting'\necho '(EngineCore_DP0 pid=1) NotImplementedError: no CPU path'\n"
                    "echo 'RuntimeError: Engine core initialization failed.'\nexit 1\n")
    fake.chmod(0o755)
    spec = {"python": str(fake), "env": {}, "kvbm": False}
    assert compare.run_harness(spec, "peer", may_fail=True) == {"error": "NotImplementedError: no CPU path"}
    with pytest.raises(SystemExit, match="NotImplementedError: no CPU path"):
        compare.run_harness(spec, "baseline")


def test_lmcache_column_without_its_environment_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("KVBM_LMCACHE_ENV", str(tmp_path / "absent"))
    out = compare.run_columns(SMALL, ENGINE, 70, 64, 768, [], columns=[peers.LMCACHE])
    assert "no LMCache environment" in out[peers.LMCACHE]["error"]
    assert "scripts/lmcache-env.sh" in out[peers.LMCACHE]["error"]


def test_strongest_is_over_every_column_that_ran():
    vals = {"no kvbm": 3.0, "kvbm": 1.0, peers.LMCACHE: 2.0}
    assert compare.strongest(vals) == peers.LMCACHE
    assert compare.strongest(vals, lower_is_better=False) == "no kvbm"


def test_cost_benchs_before_column_is_kvbm_with_inherited_threads():
    s = compare.column_spec(compare.KVBM_INHERIT, SMALL, ENGINE, 70, 64, 768, [])
    k = compare.column_spec("kvbm", SMALL, ENGINE, 70, 64, 768, [])
    assert s["kvbm"] and s["env"] == dict(k["env"], DYN_KVBM_THREAD_AFFINITY="inherit")
    assert "DYN_KVBM_THREAD_AFFINITY" not in k["env"]


def test_cost_benchs_g2_only_column_is_kvbm_without_a_disk_tier():
    s = compare.column_spec(compare.KVBM_G2_ONLY, SMALL, ENGINE, 70, 64, 768, [])
    k = compare.column_spec("kvbm", SMALL, ENGINE, 70, 64, 768, [])
    assert s["kvbm"] and s["engine"] == k["engine"]
    assert s["env"] == dict(k["env"], DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS=0)
    assert k["env"]["DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS"] == 768


def test_lmcache_store_policy_is_the_benchs_choice(monkeypatch):
    monkeypatch.setattr(peers, "LMCACHE_STORE_POLICY", "default")
    argv = _specs()[peers.LMCACHE]["server"]["argv"]
    assert argv[argv.index("--l2-store-policy") + 1] == "default"


def test_harness_serve_answers_each_action_and_survives_a_failing_one(monkeypatch):
    """The harness's serve mode: a ready line, then one answer per action
    line (blank lines skipped), an action that raises answered with its
    error while the engine goes on."""
    import io

    from kvbm.testing import vllm_harness

    seen = []

    def fake(llm, act, i, metrics_port):
        seen.append((act["tag"], i, metrics_port))
        if act.get("boom"):
            raise ValueError("no such prompt")
        return {"tag": act["tag"], "secs_each": [0.25]}

    monkeypatch.setattr(vllm_harness, "do_action", fake)
    inp = io.StringIO('{"tag": "a"}\n\n{"tag": "b", "boom": true}\n{"tag": "c"}\n')
    out = io.StringIO()
    assert vllm_harness.serve(object(), 4242, inp, out) == 3
    lines = out.getvalue().splitlines()
    assert all(ln.startswith(vllm_harness.RESULT) for ln in lines)
    recs = [json.loads(ln[len(vllm_harness.RESULT):]) for ln in lines]
    assert recs == [{"ready": True}, {"tag": "a", "secs_each": [0.25]}, {"error": "ValueError: no such prompt"},
                    {"tag": "c", "secs_each": [0.25]}]
    assert seen == [("a", 0, 4242), ("b", 1, 4242), ("c", 2, 4242)]


_FAKE_ENGINE = r'''
import json, sys
RESULT = "@@kvbm-harness-result "
spec = json.load(open(sys.argv[-2]))
print("INFO engine starting, serve=%s" % spec.get("serve"), flush=True)
print(RESULT + json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    act = json.loads(line)
    if act.get("die"):
        print("(EngineCore_DP0 pid=1) RuntimeError: out of KV cache", flush=True)
        sys.exit(3)
    if act.get("boom"):
        print(RESULT + json.dumps({"error": "ValueError: bad"}), flush=True)
        continue
    print("[first_visit] request 1/1: 5 prompt tokens, 1 ms", flush=True)
    print(RESULT + json.dumps({"tag": act.get("tag"), "secs_each": [0.5], "n": len(act.get("each", []))}), flush=True)
'''


def _fake_python(tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(_FAKE_ENGINE)
    fake = tmp_path / "python"
    # Stands in for "python -m kvbm.testing.vllm_harness spec out".
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    fake.chmod(0o755)
    return str(fake)


def test_live_column_runs_actions_one_at_a_time(tmp_path):
    """compare.LiveColumn keeps a column's engine up (spec "serve") and
    returns each action's record; an action the engine could not run raises
    with its error; close() ends the engine and removes its run directory."""
    col = compare.LiveColumn("no-op connector", SMALL, ENGINE, 70, 64, 768, python=_fake_python(tmp_path))
    assert col.spec["serve"] is True and col.spec["noop_connector"] is True
    col.ready()
    assert col.do({"each": [[1, 2, 3]], "tag": "first_visit"}) == {"tag": "first_visit", "secs_each": [0.5], "n": 1}
    with pytest.raises(RuntimeError, match="no-op connector: x: ValueError: bad"):
        col.do({"boom": True, "tag": "x"})
    assert col.do({"each": [], "tag": "again"})["tag"] == "again"  # still up
    run_dir = col._dir.name
    col.close()
    assert col.proc.returncode == 0
    assert not os.path.exists(run_dir)


def test_live_column_that_dies_names_the_root_cause(tmp_path):
    col = compare.LiveColumn("kvbm", SMALL, ENGINE, 70, 64, 768, python=_fake_python(tmp_path))
    col.ready()
    with pytest.raises(RuntimeError, match=r"kvbm: engine exited \(exit 3\): RuntimeError: out of KV cache"):
        col.do({"die": True})
    col.close()


def test_paired_ratio_interval():
    """Geometric mean of paired ratios with a bootstrap interval around it:
    no spread, no width; spread widens it; the same seed, the same answer."""
    assert compare.paired_ratio([0.9] * 8) == pytest.approx((0.9, 0.9, 0.9))
    rs = [0.8, 1.2, 0.95, 1.05, 0.9, 1.1]
    m, lo, hi = compare.paired_ratio(rs)
    assert m == pytest.approx((0.8 * 1.2 * 0.95 * 1.05 * 0.9 * 1.1) ** (1 / 6))
    assert lo < m < hi and 0.8 <= lo and hi <= 1.2
    assert compare.paired_ratio(rs) == (m, lo, hi)
    # More pairs with the same spread: a narrower interval.
    m2, lo2, hi2 = compare.paired_ratio(rs * 8)
    assert hi2 - lo2 < hi - lo
    with pytest.raises(ValueError, match="positive"):
        compare.paired_ratio([1.0, 0.0])
    with pytest.raises(ValueError):
        compare.paired_ratio([])


def test_mean_interval_of_differences():
    """The arithmetic counterpart (gpu_transfer's paired slowdown points):
    no spread, no width; a shift moves the interval with it."""
    assert compare.mean_interval([0.4] * 6) == pytest.approx((0.4, 0.4, 0.4))
    ds = [0.1, 0.9, -0.3, 0.5, 0.2, 0.6]
    m, lo, hi = compare.mean_interval(ds)
    assert m == pytest.approx(sum(ds) / 6) and -0.3 <= lo < m < hi <= 0.9
    m2, lo2, hi2 = compare.mean_interval([d + 1 for d in ds])
    assert (m2, lo2, hi2) == pytest.approx((m + 1, lo + 1, hi + 1))
    with pytest.raises(ValueError):
        compare.mean_interval([])


def test_verdict_decides_only_when_the_interval_does():
    assert compare.verdict(0.96, 1.02, 0.95) is True
    assert compare.verdict(0.90, 0.94, 0.95) is False
    assert compare.verdict(0.93, 0.97, 0.95) is None
    assert compare.verdict(0.95, 0.99, 0.95) is True


def test_start_columns_leaves_out_a_peer_that_cannot_start(tmp_path):
    """The engines start side by side; a peer whose engine fails at start is
    left out with its root cause and the others run; a baseline that fails
    ends the caller with its root cause, the engines already up closed."""
    dead = tmp_path / "dead"
    dead.mkdir()
    bad = dead / "python"
    bad.write_text("#!/bin/sh\necho '(EngineCore_DP0 pid=1) NotImplementedError: no CPU path'\nexit 1\n")
    bad.chmod(0o755)
    good = _fake_python(tmp_path)
    live, failed = compare.start_columns(["no-op connector", peers.OFFLOADING], SMALL, ENGINE, 70, 64, 768,
                                         python={"no-op connector": good, peers.OFFLOADING: str(bad)})
    try:
        assert list(live) == ["no-op connector"]
        assert failed == {peers.OFFLOADING: "NotImplementedError: no CPU path"}
        assert live["no-op connector"].do({"each": [[1]], "tag": "t"})["tag"] == "t"
    finally:
        for c in live.values():
            c.close()
    with pytest.raises(SystemExit, match="no kvbm: engine exited.*NotImplementedError: no CPU path"):
        compare.start_columns(["no-op connector", "no kvbm"], SMALL, ENGINE, 70, 64, 768,
                              python={"no-op connector": good, "no kvbm": str(bad)})


class _Chat:
    """A column's engine for kvbm.demo.converse: replies derived from the
    prompt (so a column's history shows in its next prompt), the calls
    logged in one list shared by every column."""

    def __init__(self, name, log, kvbm=False, offset=0, secs_per_token=0.001, ttft_loads=0, reply_loads=1):
        self.name, self.log, self.offset, self.secs = name, log, offset, secs_per_token
        self.spec = {"kvbm": kvbm}
        # kvbm: blocks loaded from G2 by each TTFT request and by each reply
        # (whose prompt is a G1 hit but for its last block).
        self.loads, self.h2d = {"ttft": ttft_loads, "reply": reply_loads}, 0

    def do(self, act):
        self.log.append((self.name, act["tag"]))
        self.h2d += self.loads.get(act["tag"], 0)
        rec = {"metrics": {"kvbm_onboard_blocks_h2d": self.h2d, "kvbm_onboard_blocks_d2d": 0}} \
            if self.spec["kvbm"] else {}
        if act["tag"] == "quiesce":
            return rec
        p = act.get("each", act.get("generate"))[0]
        if "each" in act:
            return {**rec, "secs_each": [len(p) * self.secs], "num_cached_tokens": [len(p) // 2], "tokens": [[0]]}
        return {**rec, "tokens": [[(len(p) + self.offset) % 97] * act["max_tokens"]]}


def test_demo_sends_each_request_to_every_column_in_turn():
    """kvbm.demo's chat is paired: every request (TTFT, then the reply) goes to
    each column before the next request, in an order rotated per request;
    kvbm's column waits for its background work after each; each column's
    history carries its own replies."""
    from kvbm import demo

    log = []
    cols = ["no kvbm", "kvbm", "odd"]
    live = {"no kvbm": _Chat("no kvbm", log), "kvbm": _Chat("kvbm", log, kvbm=True), "odd": _Chat("odd", log, offset=1)}
    chat = {"conversations": 2, "turns": 2, "prefix_len": 8, "user_len": 4, "reply_len": 3, "vocab": 50}
    out = demo.converse(live, cols, chat)
    firsts = [name for name, tag in log if tag == "ttft"]
    assert firsts == ["no kvbm", "kvbm", "odd", "kvbm", "odd", "no kvbm", "odd", "no kvbm", "kvbm",
                      "no kvbm", "kvbm", "odd"]
    for i, (name, tag) in enumerate(log):  # a request is whole before the next column's starts
        if tag == "ttft":
            want = ["reply", "quiesce"] if name == "kvbm" else ["reply"]
            assert [t for _, t in log[i + 1:i + 1 + len(want)]] == want
    assert out["no kvbm"]["prompt_lens"] == [12, 12, 19, 19]  # prefix + user, then + reply + user
    assert out["no kvbm"]["ttft_each"] == [0.012, 0.012, 0.019, 0.019]
    assert out["no kvbm"]["num_cached_tokens"] == [6, 6, 9, 9]
    assert out["no kvbm"]["tokens"] == out["kvbm"]["tokens"] != out["odd"]["tokens"]
    assert log[0] == ("kvbm", "quiesce")  # its counters before the first request
    assert out["kvbm"]["metrics"]["kvbm_onboard_blocks_h2d"] == 4  # from its last quiesce: 4 replies' loads
    assert out["kvbm"]["ttft_onboard"] == {"kvbm_onboard_blocks_h2d": 0, "kvbm_onboard_blocks_d2d": 0}
    assert out["no kvbm"]["metrics"] == {} and "ttft_onboard" not in out["no kvbm"]


def test_demo_columns():
    """--columns picks columns in the table's order; unknown names, or a set
    without kvbm and another column, end the demo naming the problem."""
    from kvbm.demo import pick_columns

    assert pick_columns("") == list(compare.COLUMNS)
    assert "no-op connector" not in pick_columns("", skip_noop=True)
    assert pick_columns("", with_peers=True) == list(compare.COLUMNS) + list(peers.PEERS)
    assert pick_columns(" kvbm , no-op connector") == ["no-op connector", "kvbm"]
    with pytest.raises(SystemExit, match="unknown column.*'no-op'.*known: no kvbm"):
        pick_columns("no-op,kvbm")
    with pytest.raises(SystemExit, match="must name kvbm and at least one other"):
        pick_columns("no kvbm,no-op connector")
    with pytest.raises(SystemExit, match="must name kvbm and at least one other"):
        pick_columns("kvbm,kvbm")


@pytest.mark.parametrize("kvbm_secs, verdict", [(0.001, "met"), (0.00125, "NOT met")])
def test_demo_report_of_one_turn(capsys, kvbm_secs, verdict):
    """A one-turn chat on two columns (the demo's turn-1 cost, measured with
    two engines): the report gives turn 1's paired ratio against the no-op
    connector with its verdict, no turns-2-on figures, and checks the replies
    against the no-op connector's (no "no kvbm" column to compare with)."""
    from kvbm import demo

    log = []
    cols = ["no-op connector", "kvbm"]
    live = {"no-op connector": _Chat("no-op connector", log),
            "kvbm": _Chat("kvbm", log, kvbm=True, secs_per_token=kvbm_secs)}
    chat = {"conversations": 40, "turns": 1, "prefix_len": 8, "user_len": 4, "reply_len": 3, "vocab": 50}
    chats = demo.converse(live, cols, chat)
    same = demo.report(chats, cols, cols, {}, 40, 3)
    out = capsys.readouterr().out
    assert same == {"no-op connector": True, "kvbm": True}
    assert "identical to no-op connector" in out
    # The replies' loads of their last block are not counted as TTFT tokens served by G2.
    assert "| prompt tokens served by | G1 50%, recomputed 50% | G1 50%, recomputed 50% |" in out
    assert "turns 2–" not in out and "enlarged-G1" not in out
    speed = 100 * 0.001 / kvbm_secs
    assert f"kvbm at {speed:.1f}% of the no-op connector's speed (geometric mean of 40 paired requests" in out
    assert f"target ≥ 95%: {verdict})" in out


def test_demo_counts_only_the_ttft_requests_loads(capsys):
    """The tier split charges kvbm's G2 loads to the TTFT requests only when
    they happen during them: one block of each two-block prompt here, while
    the replies' loads (one block each) are left out."""
    from kvbm import demo

    log = []
    cols = ["no-op connector", "kvbm"]
    live = {"no-op connector": _Chat("no-op connector", log),
            "kvbm": _Chat("kvbm", log, kvbm=True, ttft_loads=1, reply_loads=1)}
    n, prompt = 40, 2 * compare.BS
    chat = {"conversations": n, "turns": 1, "prefix_len": prompt - 4, "user_len": 4, "reply_len": 3, "vocab": 50}
    chats = demo.converse(live, cols, chat)
    assert chats["kvbm"]["ttft_onboard"]["kvbm_onboard_blocks_h2d"] == n
    split = compare.tier_split([dict(chats["kvbm"], metrics=chats["kvbm"]["ttft_onboard"])], {})
    assert split == {"prompt": n * prompt, "G1": 0, "G2": n * compare.BS, "G3": 0, "recomputed": n * prompt // 2}
    demo.report(chats, cols, cols, {}, n, 3)
    assert "G1 0%, G2 50%, G3 0%, recomputed 50%" in capsys.readouterr().out


def test_demo_report_flags_different_replies():
    from kvbm import demo

    log = []
    cols = ["no kvbm", "no-op connector", "kvbm"]
    live = {"no kvbm": _Chat("no kvbm", log), "no-op connector": _Chat("no-op connector", log, offset=1),
            "kvbm": _Chat("kvbm", log, kvbm=True)}
    chat = {"conversations": 3, "turns": 2, "prefix_len": 8, "user_len": 4, "reply_len": 3, "vocab": 50}
    chats = demo.converse(live, cols, chat)
    assert demo.report(chats, cols, cols, {}, 3, 3) == {
        "no kvbm": True, "no-op connector": False, "kvbm": True}


def test_start_columns_says_why_lmcache_cannot_run(monkeypatch, tmp_path):
    monkeypatch.setenv("KVBM_LMCACHE_ENV", str(tmp_path / "absent"))
    live, failed = compare.start_columns([peers.LMCACHE], SMALL, ENGINE, 70, 64, 768)
    assert live == {}
    assert "no LMCache environment" in failed[peers.LMCACHE] and "scripts/lmcache-env.sh" in failed[peers.LMCACHE]
