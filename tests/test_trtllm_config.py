"""kvbm.trtllm_integration.consolidator_config: when the consolidator runs in
a TensorRT-LLM engine and on which endpoints (design §7.3)."""

from __future__ import annotations

import logging

import pytest

from kvbm.trtllm_integration import consolidator_config as cc

OURS = {"kv_connector_config": {"connector_module": "kvbm.trtllm_integration.connector"}}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in ("DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR", "DYN_KVBM_TRTLLM_ZMQ_PORT", "DYN_KVBM_LEADER_ZMQ_PUB_PORT",
              "NATS_SERVER", "DYN_NAMESPACE", "DYN_KVBM_WORKER_ID"):
        monkeypatch.delenv(k, raising=False)


@pytest.mark.parametrize("env, arg_map, want", [
    (None, OURS, True),
    ("true", OURS, True),
    ("0", OURS, False),
    ("off", OURS, False),
    (None, {"kv_connector_config": {"connector_module": "lmcache.integration.tensorrt_llm"}}, False),
    (None, {}, False),
])
def test_should_enable_consolidator(monkeypatch, env, arg_map, want):
    if env is not None:
        monkeypatch.setenv("DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR", env)
    assert cc.should_enable_consolidator(arg_map) is want


def test_should_enable_reads_llm_args_objects():
    from trtllm_contract import make_llm_args

    assert cc.should_enable_consolidator(make_llm_args({"tp": 1, "bs": 32})) is True


def test_endpoints(monkeypatch):
    assert cc.get_consolidator_endpoints() == ("tcp://*:56001", "tcp://0.0.0.0:57001", "tcp://127.0.0.1:57001")
    monkeypatch.setenv("DYN_KVBM_TRTLLM_ZMQ_PORT", "20081")
    monkeypatch.setenv("DYN_KVBM_LEADER_ZMQ_PUB_PORT", "56100")
    assert cc.get_consolidator_endpoints() == ("tcp://*:20081", "tcp://0.0.0.0:57100", "tcp://127.0.0.1:57100")


def test_output_bind_host(monkeypatch):
    """Events carry prompt token ids: the bind host is the operator's choice."""
    monkeypatch.setenv("DYN_KVBM_KV_EVENTS_BIND_HOST", "127.0.0.1")
    assert cc.get_consolidator_endpoints()[1:] == ("tcp://127.0.0.1:57001", "tcp://127.0.0.1:57001")
    monkeypatch.setenv("DYN_KVBM_KV_EVENTS_BIND_HOST", "10.1.2.3")
    assert cc.get_consolidator_endpoints()[1:] == ("tcp://10.1.2.3:57001", "tcp://10.1.2.3:57001")
    monkeypatch.setenv("DYN_KVBM_KV_EVENTS_BIND_HOST", "::1")
    assert cc.get_consolidator_endpoints()[1:] == ("tcp://[::1]:57001", "tcp://[::1]:57001")
    for bad in ("tcp://1.2.3.4", "host:5", "-x"):
        monkeypatch.setenv("DYN_KVBM_KV_EVENTS_BIND_HOST", bad)
        with pytest.raises(ValueError, match="DYN_KVBM_KV_EVENTS_BIND_HOST"):
            cc.get_consolidator_endpoints()


@pytest.mark.parametrize("value", ["abc", "0", "70000"])
def test_invalid_port_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("DYN_KVBM_TRTLLM_ZMQ_PORT", value)
    with pytest.raises(ValueError, match="DYN_KVBM_TRTLLM_ZMQ_PORT"):
        cc.get_consolidator_endpoints()


def test_options_without_port_log_the_variable_and_run_without(caplog):
    with caplog.at_level(logging.ERROR):
        assert cc.consolidator_options(OURS) is None
    assert "DYN_KVBM_TRTLLM_ZMQ_PORT" in caplog.text


def test_options_zmq_and_nats(monkeypatch):
    monkeypatch.setenv("DYN_KVBM_TRTLLM_ZMQ_PORT", "20081")
    assert cc.consolidator_options(OURS) == {
        "engine": "trtllm", "engine_endpoint": "tcp://127.0.0.1:20081", "zmq_bind": "tcp://0.0.0.0:57001",
        "mode": "dedup"}
    monkeypatch.setenv("NATS_SERVER", "nats://10.0.0.1:4222")
    monkeypatch.setenv("DYN_NAMESPACE", "prod")
    monkeypatch.setenv("DYN_KVBM_WORKER_ID", "7")
    opts = cc.consolidator_options(OURS)
    # The component is left to the consolidator's default for the engine ("tensorrt_llm").
    assert opts["nats"] is True and opts["namespace"] == "prod" and not opts.get("component")
    assert opts["worker_id"] == 7
    monkeypatch.setenv("DYN_KVBM_WORKER_ID", "seven")
    with pytest.raises(ValueError, match="DYN_KVBM_WORKER_ID"):
        cc.consolidator_options(OURS)
    monkeypatch.setenv("DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR", "false")
    assert cc.consolidator_options(OURS) is None


def test_options_consolidator_mode(monkeypatch):
    monkeypatch.setenv("DYN_KVBM_TRTLLM_ZMQ_PORT", "20081")
    monkeypatch.setenv("DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE", "passthrough")
    assert cc.consolidator_options(OURS)["mode"] == "passthrough"
    monkeypatch.setenv("DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE", " dedup ")
    assert cc.consolidator_options(OURS)["mode"] == "dedup"
    monkeypatch.setenv("DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE", "pass")
    with pytest.raises(ValueError, match=r"DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE='pass': must be one of dedup, passthrough"):
        cc.consolidator_options(OURS)
