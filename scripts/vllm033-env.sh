#!/usr/bin/env bash
# The vLLM 0.33 contract environment (.venv-vllm033): PyPI's vllm 0.33.0
# installed without its dependencies over the packages of a base environment
# (default .venv: torch, transformers, pytest and the rest of what vLLM 0.32's
# CPU backend brought), so that kvbm's fake-vLLM suites import 0.33's real
# connector base class and metadata types. No CUDA package is downloaded:
# 0.33's compiled extensions are never imported by those modules.
#
#   scripts/vllm033-env.sh [BASE_PYTHON]
#
# Idempotent: a stamp records the version and the base; a second run with the
# same ones returns at once. Prints the environment's interpreter last.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CONTRACT_VERSION=0.33.0
base_py=${1:-.venv/bin/python}
dir=${KVBM_VLLM033_ENV:-.venv-vllm033}

[ -x "$base_py" ] || { echo "vllm033-env: no base interpreter at $base_py (create .venv first: .ci/run)" >&2; exit 1; }
base_site=$("$base_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
want="vllm==${VLLM_CONTRACT_VERSION} base=${base_site}"
stamp="$dir/.kvbm-vllm-env"

if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  rm -rf "$dir"
  # The base's interpreter (same Python version as its packages), no pip of
  # its own: the base's pip installs into it.
  base_exe=$("$base_py" -c 'import sys; print(sys._base_executable)')
  "$base_exe" -m venv --without-pip "$dir"
  site=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$base_py" -m pip --python "$dir/bin/python" install -q --disable-pip-version-check --no-deps --no-compile \
    "vllm==${VLLM_CONTRACT_VERSION}"
  # The base's packages, after the environment's own (vllm 0.33 wins over
  # the base's vllm 0.32).
  echo "$base_site" > "$site/zz-kvbm-base-env.pth"
  "$dir/bin/python" - "$VLLM_CONTRACT_VERSION" <<'EOF'
import sys
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1 import base
want = sys.argv[1]
if vllm.__version__ != want:
    sys.exit(f"vllm033-env: imported vllm {vllm.__version__} from {vllm.__file__}, want {want}")
EOF
  echo "$want" > "$stamp"
fi
echo "$dir/bin/python"
