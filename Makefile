# Set-up from nothing, incremental afterwards:
#   make demo   venv + torch + dependencies + build, then the demo
#   make test   the same set-up, then the whole test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# On x86-64 this is the CUDA 13.0 build: with nvcc present the CUDA kernels compile too.
TORCH_SPEC ?= torch==2.14.1
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc 2>/dev/null || echo 2)

SOURCES := $(shell find csrc python -type f -not -path '*/__pycache__/*') CMakeLists.txt pyproject.toml

.PHONY: all venv deps build test test-fast demo bench clean

all: build

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch-installed: | $(BIN)/python
	$(BIN)/pip install "$(TORCH_SPEC)"
	@echo "$(TORCH_SPEC)" > $@

$(VENV)/.deps-installed: requirements-dev.txt $(VENV)/.torch-installed
	$(BIN)/pip install -r requirements-dev.txt "$(TORCH_SPEC)"
	@touch $@

# The verbose build log keeps nvcc's `ptxas -v` register and spill report.
# FUSEDLLM_SIMT builds fusedllm._simt, the CUDA kernels emulated on the CPU.
$(VENV)/.built: $(SOURCES) $(VENV)/.deps-installed
	@mkdir -p build
	@echo "building fusedllm (log: build/build.log)"
	@$(BIN)/pip install -v --no-build-isolation --no-deps -C cmake.define.FUSEDLLM_SIMT=ON -e . \
	  > build/build.log 2>&1 \
	  || { tail -n 60 build/build.log; exit 1; }
	@grep -E "fusedllm: (CUDA|CPU|torch|SIMT)" build/build.log | sed 's/^ *//' || true
	@touch $@

venv: $(BIN)/python
deps: $(VENV)/.deps-installed
build: $(VENV)/.built

test: build
	$(BIN)/python -m pytest -q

# Skips torch.compile and notebook runs.
test-fast: build
	$(BIN)/python -m pytest -q -m "not slow"

demo: build
	$(BIN)/python benchmarks/demo.py

bench: build
	$(BIN)/python benchmarks/bench_rms_norm.py
	$(BIN)/python benchmarks/bench_swiglu.py
	$(BIN)/python benchmarks/bench_rope.py
	$(BIN)/python benchmarks/bench_attention.py
	$(BIN)/python benchmarks/bench_decode.py
	$(BIN)/python benchmarks/bench_model.py

clean:
	rm -rf build $(VENV)/.built
