"""The installed vLLM's connector base class against the API kvbm was
reviewed for (tests/vllm_connector_api.py), and DynamoConnector against the
base class. Runs under every vLLM the suites run with: 0.32 in .venv, 0.33 in
.venv-vllm033 (`make pytest-vllm033`), where KVBM_EXPECT_VLLM names the
release the environment must import."""

from __future__ import annotations

import inspect
import logging
import os
from types import SimpleNamespace

import pytest

from vllm_connector_api import HANDLING, REVIEWED

if os.environ.get("CI"):  # CI installs vLLM: its absence is a failure there
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1 as Base
else:
    vllm = pytest.importorskip("vllm")
    Base = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base").KVConnectorBase_V1


def describe(cls: type) -> dict[str, str]:
    """Every public method of cls and its bases but object and ABC (and
    __init__), as the table writes them."""
    raw_members: dict[str, object] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or klass.__module__ == "abc":
            continue
        for name, raw in vars(klass).items():
            if name.startswith("_") and name != "__init__":
                continue
            raw_members[name] = raw
    out = {}
    for name, raw in raw_members.items():
        if isinstance(raw, property):
            kind, fn = "property", raw.fget
        elif isinstance(raw, classmethod):
            kind, fn = "classmethod", raw.__func__
        elif isinstance(raw, staticmethod):
            kind, fn = "staticmethod", raw.__func__
        elif callable(raw):
            kind, fn = "method", raw
        else:
            continue
        if getattr(fn, "__isabstractmethod__", False):
            kind = "abstract " + kind
        out[name] = f"{kind} {inspect.signature(fn)}"
    return out


def test_environment_imports_the_expected_vllm():
    want = os.environ.get("KVBM_EXPECT_VLLM")
    if want:
        assert vllm.__version__ == want, f"imported vLLM {vllm.__version__} from {vllm.__file__}, want {want}"


def test_installed_base_class_is_reviewed():
    """A method added, removed or changed (abstract or not) in the installed
    vLLM's base class and not in kvbm's reviewed table fails here."""
    version = vllm.__version__
    assert version in REVIEWED, (
        f"vLLM {version}'s connector base class has not been reviewed: compare it with "
        f"tests/vllm_connector_api.py and add its table (reviewed: {', '.join(REVIEWED)})")
    installed, reviewed = describe(Base), REVIEWED[version]
    new = sorted(set(installed) - set(reviewed))
    gone = sorted(set(reviewed) - set(installed))
    changed = sorted(f"{m}: {reviewed[m]} -> {installed[m]}" for m in set(installed) & set(reviewed)
                     if installed[m] != reviewed[m])
    assert not (new or gone or changed), f"vLLM {version}: not reviewed: new {new}, gone {gone}, changed {changed}"


def test_every_reviewed_method_has_a_decision():
    for version, table in REVIEWED.items():
        missing = sorted(set(table) - set(HANDLING))
        assert not missing, f"vLLM {version}: no handling recorded for {missing}"
        bad = sorted(m for m in table if not HANDLING[m].startswith(("kvbm", "base")))
        assert not bad, f"handling must say 'kvbm' or 'base': {bad}"


def test_dynamo_connector_follows_the_table():
    """Every method kvbm handles is DynamoConnector's own, with a signature
    that accepts what the base's accepts; every abstract method is
    implemented; the ones left to the base are not shadowed by accident."""
    from kvbm.vllm_integration.connector import DynamoConnector

    assert not DynamoConnector.__abstractmethods__
    own = vars(DynamoConnector)
    for name in describe(Base):
        how = HANDLING[name]
        if how.startswith("kvbm"):
            assert name in own, f"DynamoConnector does not implement {name} ({how})"
            base_raw, ours_raw = inspect.getattr_static(Base, name), own[name]
            assert type(base_raw) is type(ours_raw), f"{name}: {type(ours_raw).__name__}, base has " \
                                                     f"{type(base_raw).__name__}"
            if isinstance(base_raw, property):
                continue
            theirs = inspect.signature(getattr(Base, name))
            ours = inspect.signature(getattr(DynamoConnector, name))
            for p in theirs.parameters.values():
                if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                    assert any(q.kind == p.kind for q in ours.parameters.values()), f"{name}: no {p}"
                else:
                    assert p.name in ours.parameters, f"{name}: the base passes {p.name}, kvbm has {ours}"
        else:
            assert name not in own, f"DynamoConnector overrides {name}, recorded as left to the base: {how}"


def test_sleep_mode_is_declined_with_a_log_line(caplog):
    """vLLM 0.33's base class says every connector follows sleep mode's KV
    cache remap (supports_sleep_mode True, unregister/restore doing nothing):
    kvbm's worker would keep the old tensors' addresses. kvbm answers False
    and says why; vLLM then refuses the configuration at start."""
    from kvbm.vllm_integration.connector import DynamoConnector

    caplog.set_level(logging.INFO, logger="vllm.kvbm")
    ktc = SimpleNamespace(kv_connector="DynamoConnector", kv_connector_extra_config={})
    assert DynamoConnector.supports_sleep_mode(ktc) is False
    assert "sleep mode" in caplog.text and "DynamoConnector" in caplog.text
    if not hasattr(Base, "supports_sleep_mode"):
        return  # vLLM < 0.33 has no sleep-mode hooks: nothing calls it
    # vLLM's own check at configuration time (VllmConfig), with kvbm loaded
    # by module path as users configure it.
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig

    cfg = KVTransferConfig(kv_connector="DynamoConnector", kv_role="kv_both",
                           kv_connector_module_path="kvbm.vllm_integration.connector")
    with pytest.raises(ValueError, match="DynamoConnector does not support sleep mode"):
        VllmConfig._verify_kv_transfer_compat(
            SimpleNamespace(kv_transfer_config=cfg, model_config=SimpleNamespace(enable_sleep_mode=True)))


def connector_calls(path: str) -> set[str]:
    """The methods called on the KV connector in one of vLLM's modules."""
    import ast

    def is_connector(node: ast.expr) -> bool:
        if isinstance(node, ast.Attribute):
            return node.attr in ("connector", "kv_connector") and isinstance(node.value, ast.Name) \
                and node.value.id == "self"
        if isinstance(node, ast.Name):
            return node.id in ("connector", "kv_connector")
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id == "get_kv_transfer_group"

    with open(path) as f:
        tree = ast.parse(f.read())
    return {n.func.attr for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and is_connector(n.func.value)}


def test_every_call_site_calls_a_reviewed_method():
    """vLLM's scheduler and workers call only methods of the reviewed base
    class (or of other connectors' interfaces, listed): a call of anything
    else is new API to review."""
    from vllm_connector_api import CALL_SITES, OTHER_INTERFACES

    root = os.path.dirname(vllm.__file__)
    known = set(describe(Base)) | set(OTHER_INTERFACES)
    seen: set[str] = set()
    for rel in CALL_SITES:
        path = os.path.join(root, rel)
        assert os.path.exists(path), f"vLLM {vllm.__version__} has no {rel}: review where it calls the connector now"
        calls = connector_calls(path)
        assert calls, f"no connector call found in {rel}"
        assert calls <= known, f"{rel} calls {sorted(calls - known)}, not in the reviewed API"
        seen |= calls
    # The calls kvbm's work depends on are among them.
    assert {"get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "start_load_kv",
            "wait_for_save", "register_kv_caches"} <= seen
