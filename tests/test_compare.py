"""The bench and demo harness (kvbm.testing.compare): every column's engine
runs the same model thread layout."""

from kvbm.testing import compare


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
