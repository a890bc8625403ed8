# kvbm — build, test, bench, demo.
#   make build   the Go shared library into python/kvbm/lib/
#   make test    go vet + go test -race (fuzz seed corpora included) + mypy + pytest (unit and e2e)
#                + the vLLM 0.33 contract suite (.venv-vllm033)
#   make fuzz    every fuzz target of outside input for FUZZTIME each
#   make flake-hunt  the suites under a CPU hog on every core (scripts/flake-hunt)
#   make wheel   a manylinux platform wheel in dist/ (scripts/wheel-check tests it without Go)
#   make bench   every benchmark table (Go and Python), baselines measured in the same run, and a summary
#   make bench-quick  the same, each bench kept short (CI)
#   make demo    the main job: vLLM (CPU backend) serving a multi-turn workload with and without kvbm
#   make cuda    the CUDA variant of the shared library (see docs/cuda.md)

PY ?= $(shell [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)
GO ?= go
LIB := python/kvbm/lib/libkvbm.so
GO_SOURCES := $(shell find goext capi -name '*.go' -not -name '*_test.go') $(wildcard capi/*.c) go.mod go.sum
FUZZTIME ?= 5s
# Only kvbm_* symbols leave the library (ADBC-style version script).
GO_LDFLAGS := -ldflags=-extldflags=-Wl,--version-script=$(CURDIR)/capi/exports.map
export PYTHONPATH := $(CURDIR)/python$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: build build-debug test gotest typecheck fuzz pytest pytest-vllm033 flake-hunt wheel bench bench-quick demo cuda clean

build: $(LIB)

# The library with test-only exports (kvbm_debug_*: panic injection), for
# tests/test_abi.py; never installed.
DEBUG_LIB := python/kvbm/lib/libkvbm_debug.so
build-debug: $(DEBUG_LIB)

$(DEBUG_LIB): $(GO_SOURCES)
	@mkdir -p $(dir $@)
	CGO_ENABLED=1 $(GO) build -tags kvbm_debug -trimpath -buildmode=c-shared $(GO_LDFLAGS) -o $@ ./capi
	@rm -f $(basename $@).h

$(LIB): $(GO_SOURCES)
	@mkdir -p $(dir $@)
	CGO_ENABLED=1 $(GO) build -trimpath -buildmode=c-shared $(GO_LDFLAGS) -o $@ ./capi
	@rm -f $(basename $@).h

test: gotest typecheck pytest pytest-vllm033

gotest:
	@unformatted=$$(gofmt -l goext capi bench internal); if [ -n "$$unformatted" ]; then echo "gofmt needed: $$unformatted"; exit 1; fi
	$(GO) vet ./...
	$(GO) test -race -count=1 ./...

# The Python package against its annotations ([tool.mypy] in pyproject.toml).
typecheck:
	$(PY) -m mypy python/kvbm

# Every fuzz target of outside input runs briefly (FUZZTIME each).
fuzz:
	@set -e; for pkg in $$($(GO) list ./goext/...); do \
	  dir=$$($(GO) list -f '{{.Dir}}' $$pkg); \
	  for f in $$(grep -ho '^func Fuzz[A-Za-z0-9_]*' $$dir/*_test.go 2>/dev/null | sed 's/func //'); do \
	    echo "fuzz $$pkg $$f"; \
	    $(GO) test -run='^$$' -fuzz="^$$f$$" -fuzztime=$(FUZZTIME) $$pkg; \
	  done; \
	done

pytest: build build-debug
	$(PY) -m pytest -q -ra --durations=15 tests

# The fake-vLLM suites and the connector API review against vLLM 0.33's real
# classes, in .venv-vllm033 (scripts/vllm033-env.sh: vLLM 0.33 without its
# dependencies over .venv's packages). Under CI a missing environment fails.
VLLM033_PY := .venv-vllm033/bin/python
VLLM033_TESTS := tests/test_vllm_api.py tests/test_vllm_adapter.py tests/test_vllm_surfaces.py tests/test_vllm_call_orders.py tests/test_vllm_hybrid.py
pytest-vllm033: build
	@if [ ! -x $(VLLM033_PY) ]; then \
	  if [ -n "$$CI" ]; then echo "no $(VLLM033_PY): run scripts/vllm033-env.sh"; exit 1; fi; \
	  echo "SKIPPED pytest-vllm033: no $(VLLM033_PY) (create it with scripts/vllm033-env.sh)"; exit 0; \
	fi; \
	KVBM_EXPECT_VLLM=0.33.0 $(VLLM033_PY) -m pytest -q -ra $(VLLM033_TESTS)

# Every bench appends its summary rows to $(BENCH_OUT)/rows.jsonl
# (KVBM_BENCH_OUT); bench/summary.py prints them as one table at the end.
# bench-quick: the same benches kept short (CI).
BENCH_OUT ?= $(or $(TMPDIR),/tmp)/kvbm-bench-out
BENCH_QUICK ?=
QUICK_FLAG = $(if $(BENCH_QUICK),--quick)
bench: export KVBM_BENCH_OUT = $(BENCH_OUT)
bench: build
	@rm -rf $(BENCH_OUT) && mkdir -p $(BENCH_OUT)
	@echo "== hashing and C-ABI call cost"; $(PY) bench/hashing_abi.py $(QUICK_FLAG)
	@echo "== a call into Go from Python after other work (an engine step) and back to back, against libc"; $(PY) bench/go_call_cost.py $(QUICK_FLAG)
	@echo "== leader: match of a 32K-token prompt against 100K registered blocks, Go and from Python"; $(PY) bench/match_path.py $(QUICK_FLAG)
	@echo "== G2/G3 transfers"; $(GO) run ./bench/transfer $(QUICK_FLAG)
	@echo "== KV event consolidator"; $(GO) run ./bench/consolidator $(QUICK_FLAG)
	@echo "== G4 object storage vs the same S3 server's raw PUT/GET (versitygw: .ci/s3-server.sh)"; $(GO) run ./bench/g4 $(QUICK_FLAG)
	@if [ -f bench/wire/main.go ]; then echo "== leader/worker side channel"; $(GO) run ./bench/wire $(QUICK_FLAG); fi
	@echo "== LMCache's environment for the peer column (.venv-lmcache, scripts/lmcache-env.sh)"; \
	  scripts/lmcache-env.sh $(PY) >/dev/null || echo "no LMCache environment: its column will say so"
	@echo "== vLLM (CPU backend): kvbm against no kvbm, G1 + the same memory, a no-op connector, LMCache and vLLM's OffloadingConnector"; $(PY) bench/vllm_ttft.py $(QUICK_FLAG)
	@echo "== G3/G4 admission: blocks written with and without admission, 20% reuse"; $(GO) test -run '^$$' -bench AdmissionWrites -benchtime 1x ./goext/leader
	@echo "== load or recompute: re-visit TTFT from G4 behind +0/20/100 ms per request, always vs cost vs no kvbm (versitygw)"; $(PY) bench/load_policy.py $(QUICK_FLAG)
	@echo "(GPU transfers: bench/gpu_transfer.py on a CUDA machine, see docs/cuda.md)"
	@$(PY) bench/summary.py $(BENCH_OUT)

bench-quick:
	$(MAKE) bench BENCH_QUICK=1

flake-hunt:
	scripts/flake-hunt

# A platform wheel with the compiled library (and the CUDA variant when built),
# retagged manylinux by auditwheel; `scripts/wheel-check` installs and tests it
# without Go. libcuda comes from the driver: never bundled.
wheel: build
	rm -rf build dist/*.whl
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m build --wheel --no-isolation --outdir dist/raw .
	PATH=$(abspath $(dir $(PY))):$$PATH $(PY) -m auditwheel repair --exclude libcuda.so.1 -w dist dist/raw/*.whl
	rm -rf dist/raw build
	@ls -l dist/*.whl

demo: build
	$(PY) -m kvbm.demo

# CUDA variant (docs/cuda.md): gorgonia.org/cu v0.9.6 needs CUDA 11.x headers
# (not 12/13) and a linkable libcuda; scripts/cuda-deps.sh extracts both from
# Debian's nvidia-cuda-dev into CUDA_HOME (no GPU needed to build).
CUDA_HOME ?= /opt/cuda-11.8-extract/usr
CUDA_STUBS ?= $(firstword $(wildcard $(CUDA_HOME)/lib/x86_64-linux-gnu/stubs $(CUDA_HOME)/lib64/stubs) $(CUDA_HOME)/lib64/stubs)
CUDA_CGO := CGO_CFLAGS="-I$(CUDA_HOME)/include" CGO_LDFLAGS="-L$(CUDA_STUBS)"
CUDA_LIB := python/kvbm/lib/libkvbm_cuda.so

cuda: $(CUDA_LIB)

$(CUDA_LIB): $(GO_SOURCES)
	@test -f $(CUDA_HOME)/include/cuda.h || { echo "no $(CUDA_HOME)/include/cuda.h: run scripts/cuda-deps.sh (or set CUDA_HOME)"; exit 1; }
	@mkdir -p $(dir $@)
	$(CUDA_CGO) CGO_ENABLED=1 $(GO) build -tags cuda -trimpath -buildmode=c-shared $(GO_LDFLAGS) -o $@ ./capi
	@rm -f $(basename $@).h

clean:
	rm -rf python/kvbm/lib build dist *.egg-info python/*.egg-info .pytest_cache
