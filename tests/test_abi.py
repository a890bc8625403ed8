"""The C ABI and its Python binding: lazy loading, errors, panics, fork safety."""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIB = os.path.join(ROOT, "python", "kvbm", "lib", "libkvbm.so")
DEBUG_LIB = os.path.join(ROOT, "python", "kvbm", "lib", "libkvbm_debug.so")  # make build-debug


def run_py(code, env=None):
    e = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=e, timeout=120)


def test_import_does_not_load_native_library():
    r = run_py(
        """
        import kvbm, kvbm._native as n
        import kvbm.vllm_integration.connector, kvbm.trtllm_integration.connector
        assert n._lib is None, "native library loaded at import"
        with open('/proc/self/maps') as f:
            assert 'libkvbm' not in f.read()
        print('ok')
        """
    )
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout


def test_only_kvbm_symbols_exported():
    out = subprocess.run(["nm", "-D", "--defined-only", LIB], capture_output=True, text=True, check=True).stdout
    names = [line.split()[-1] for line in out.splitlines() if line.split() and line.split()[-2] in ("T", "t")]
    assert names, "no exported functions found"
    stray = [n for n in names if not n.startswith("kvbm_")]
    assert not stray, f"symbols outside the kvbm_ namespace: {stray[:20]}"
    debug = [n for n in names if n.startswith("kvbm_debug")]
    assert not debug, f"test-only exports in the normal build: {debug}"


def test_golden_hashes_through_python():
    import kvbm
    from kvbm import _native

    # design §3: default salt ("{}"), blocks [1,2,3,4] and [5,6,7,8].
    assert _native.salt_hash() == 1389868326933519382
    seq = kvbm.sequence_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert seq == [8026409477313730465, 8178148779430958753]  # trailing partial block has no hash
    # Seed/salt 1337 chain.
    assert _native.sequence_hashes(list(range(1, 13)), 4, salt_hash=1337) == [
        14643705804678351452,
        4945711292740353085,
        12583592247330656132,
    ]
    assert kvbm.router_hashes(list(range(16)), 16) == [15310707395893867146]
    # Salt and LoRA change the hash.
    assert kvbm.sequence_hashes([1, 2, 3, 4], 4, salt="s")[0] != seq[0]
    assert kvbm.sequence_hashes([1, 2, 3, 4], 4, lora_name="a")[0] != seq[0]


def test_invalid_argument_raises_with_go_message():
    import kvbm
    from kvbm import _native

    with pytest.raises(kvbm.KvbmError, match="block_size must be positive"):
        _native.sequence_hashes([1, 2, 3], 0, salt_hash=1)


def test_config_error_names_variable():
    r = run_py(
        """
        import kvbm, kvbm._native as n
        try:
            n.config_check()
        except kvbm.KvbmConfigError as e:
            print('ERR', e)
        """,
        env={"DYN_KVBM_CPU_CACHE_GB": "lots", "DYN_KVBM_METRICS_PORT": "70000",
             "DYN_KVBM_METRICS_HOST": "http://0.0.0.0"},
    )
    assert r.returncode == 0, r.stderr
    assert "DYN_KVBM_CPU_CACHE_GB" in r.stdout and "lots" in r.stdout
    assert "DYN_KVBM_METRICS_PORT" in r.stdout and "70000" in r.stdout
    assert "DYN_KVBM_METRICS_HOST" in r.stdout and "http://0.0.0.0" in r.stdout


def test_config_requires_a_tier():
    r = run_py(
        """
        import kvbm, kvbm._native as n
        print(n.config_check(require_tier=False).splitlines()[0])
        try:
            n.config_check(require_tier=True)
        except kvbm.KvbmConfigError as e:
            print('ERR', e)
        """,
        env={"DYN_KVBM_CPU_CACHE_GB": "", "DYN_KVBM_DISK_CACHE_GB": ""},
    )
    assert r.returncode == 0, r.stderr
    assert "ERR" in r.stdout and "DYN_KVBM_CPU_CACHE_GB" in r.stdout


def test_panic_becomes_exception_and_poisons():
    r = run_py(
        """
        import kvbm, kvbm._native as n
        assert n.sequence_hashes([1,2,3,4], 4, salt_hash=1337) == [14643705804678351452]
        try:
            n.debug_panic()
        except kvbm.KvbmInternalError as e:
            assert 'panic' in str(e) and 'nil map' in str(e), e
            print('caught')
        assert n.is_poisoned()
        try:
            n.sequence_hashes([1,2,3,4], 4, salt_hash=1337)
        except kvbm.KvbmPoisonedError as e:
            print('poisoned:', str(e).splitlines()[0])
        """,
        env={"KVBM_LIBRARY": DEBUG_LIB},
    )
    assert r.returncode == 0, r.stderr
    assert "caught" in r.stdout
    assert "poisoned: kvbm is poisoned" in r.stdout


def test_panic_in_free_poisons_instead_of_crashing():
    r = run_py(
        """
        import kvbm, kvbm._native as n
        from kvbm._core import Leader
        leader = Leader(block_size=4, bytes_per_block=64)
        n.lib().kvbm_debug_panic_in_free()
        leader.close()  # kvbm_leader_free panics inside the library
        assert n.is_poisoned()
        try:
            n.sequence_hashes([1,2,3,4], 4, salt_hash=1337)
        except kvbm.KvbmPoisonedError as e:
            assert 'panic while freeing' in str(e), e
            print('poisoned')
        """,
        env={"KVBM_LIBRARY": DEBUG_LIB, "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "4"},
    )
    assert r.returncode == 0, r.stderr
    assert "poisoned" in r.stdout


def test_fork_then_call_raises():
    r = run_py(
        """
        import os, kvbm, kvbm._native as n
        n.salt_hash()
        pid = os.fork()
        if pid == 0:
            try:
                n.salt_hash()
                os._exit(3)
            except kvbm.KvbmForkError as e:
                os._exit(0 if 'forked' in str(e) or 'fork' in str(e) else 4)
        _, status = os.waitpid(pid, 0)
        print('child', os.waitstatus_to_exitcode(status))
        print('parent still works', n.salt_hash() == 1389868326933519382)
        """
    )
    assert r.returncode == 0, r.stderr
    assert "child 0" in r.stdout
    assert "parent still works True" in r.stdout


HEADER = os.path.join(ROOT, "capi", "kvbm.h")


def _header_prototypes():
    import re

    with open(HEADER) as f:
        src = re.sub(r"/\*.*?\*/", "", f.read(), flags=re.S)
    protos = {}
    for m in re.finditer(r"^([a-z0-9_]+[ *]+)(kvbm_[a-z0-9_]+)\(([^)]*)\);", src, flags=re.M):
        params = [p.strip() for p in m.group(3).replace("\n", " ").split(",") if p.strip() not in ("", "void")]
        # "uint8_t **out" -> "uint8_t **"; "const void *list" -> "void *"
        types = [re.sub(r"\s*\b[a-z_][a-z0-9_]*$", "", p.replace("const ", "")).replace(" ", "") for p in params]
        protos[m.group(2)] = (m.group(1).replace(" ", ""), types)
    return protos


def _ctypes_for(ctype):
    """The ctypes types a binding may use for a C type of the header."""
    import ctypes as c

    base = {"int": c.c_int, "int32_t": c.c_int32, "int64_t": c.c_int64, "uint32_t": c.c_uint32,
            "uint64_t": c.c_uint64, "uint8_t": c.c_uint8}
    if ctype in ("void", ""):
        return {None}
    if ctype == "char*":
        return {c.c_char_p, c.c_void_p}
    if ctype in ("void*", "uint8_t*"):
        return {c.c_void_p, c.c_char_p}
    if ctype == "char**":
        return {c.POINTER(c.c_char_p)}
    if ctype.endswith("**"):
        return {c.POINTER(c.POINTER(base[ctype[:-2]]))}
    if ctype.endswith("*"):
        return {c.POINTER(base[ctype[:-1]])}
    return {base[ctype]}


@pytest.mark.skipif(not os.path.exists(HEADER), reason="capi/kvbm.h is in the source tree only")
def test_ctypes_bindings_match_header():
    from kvbm import _native

    protos = _header_prototypes()
    sigs = _native.signatures()
    # The C-written list reader is bound with PYFUNCTYPE (GIL held), not through this table.
    assert set(protos) - set(sigs) == {"kvbm_tokens_from_pylist"}, "exports without a Python binding"
    assert not set(sigs) - set(protos), "bindings for symbols the header does not declare"
    for name, (res, args) in sigs.items():
        hres, hargs = protos[name]
        assert res in _ctypes_for(hres), f"{name}: result {res} vs header {hres}"
        assert len(args) == len(hargs), f"{name}: {len(args)} arguments vs {len(hargs)} in the header"
        for i, (a, h) in enumerate(zip(args, hargs)):
            assert a in _ctypes_for(h), f"{name} argument {i}: {a} vs header {h}"


@pytest.mark.skipif(not os.path.exists(HEADER), reason="capi/kvbm.h is in the source tree only")
def test_status_codes_match_header():
    import re

    from kvbm._errors import BY_CODE

    with open(HEADER) as f:
        enum = dict((n, int(v)) for n, v in re.findall(r"(KVBM_(?:OK|ERR_[A-Z]+)) = (\d+)", f.read()))
    assert enum.pop("KVBM_OK") == 0
    assert sorted(enum.values()) == sorted(BY_CODE), "every error status maps to an exception class"
    for name, code in enum.items():
        assert BY_CODE[code].code == code, name


def test_missing_symbol_is_an_error():
    r = run_py(
        """
        import kvbm._native as n
        n.register_signatures({"kvbm_no_such_export": (None, [])})
        try:
            n.lib()
        except n.KvbmError as e:
            print("error:", e)
        """
    )
    assert r.returncode == 0, r.stderr
    assert "error:" in r.stdout and "kvbm_no_such_export" in r.stdout
