# kvbm — build, test, bench, demo.
#   make build   the Go shared library into python/kvbm/lib/
#   make test    go vet + go test -race + short fuzzing + pytest (unit and e2e)
#   make bench   every benchmark table (Go and Python), baselines measured in the same run
#   make demo    the main job: vLLM (CPU backend) serving a multi-turn workload with and without kvbm
#   make cuda    the CUDA variant of the shared library (see docs/cuda.md)

PY ?= $(shell [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)
GO ?= go
LIB := python/kvbm/lib/libkvbm.so
GO_SOURCES := $(shell find goext capi -name '*.go' -not -name '*_test.go') go.mod go.sum
FUZZTIME ?= 5s
# Only kvbm_* symbols leave the library (ADBC-style version script).
GO_LDFLAGS := -ldflags=-extldflags=-Wl,--version-script=$(CURDIR)/capi/exports.map
export PYTHONPATH := $(CURDIR)/python$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: build test gotest fuzz pytest bench demo cuda clean

build: $(LIB)

$(LIB): $(GO_SOURCES)
	@mkdir -p $(dir $@)
	CGO_ENABLED=1 $(GO) build -trimpath -buildmode=c-shared $(GO_LDFLAGS) -o $@ ./capi
	@rm -f $(basename $@).h

test: gotest fuzz pytest

gotest:
	$(GO) vet ./...
	$(GO) test -race -count=1 ./...

# Every fuzz target of outside input runs briefly (FUZZTIME each).
fuzz:
	@set -e; for pkg in $$($(GO) list ./goext/...); do \
	  dir=$$($(GO) list -f '{{.Dir}}' $$pkg); \
	  for f in $$(grep -ho '^func Fuzz[A-Za-z0-9_]*' $$dir/*_test.go 2>/dev/null | sed 's/func //'); do \
	    echo "fuzz $$pkg $$f"; \
	    $(GO) test -run='^$$' -fuzz="^$$f$$" -fuzztime=$(FUZZTIME) $$pkg; \
	  done; \
	done

pytest: build
	$(PY) -m pytest -q -ra tests

bench: build
	$(GO) test -run='^$$' -bench=. -benchmem ./goext/...
	@for d in bench/*/; do [ -f $$d/main.go ] && { echo "== $$d"; $(GO) run ./$$d; } || true; done
	@for f in bench/*.py; do [ -f $$f ] && { echo "== $$f"; $(PY) $$f; } || true; done

demo: build
	$(PY) -m kvbm.demo

clean:
	rm -rf python/kvbm/lib build dist *.egg-info python/*.egg-info .pytest_cache
