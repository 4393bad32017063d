# Set-up from nothing, incremental afterwards:
#   make demo     venv + torch + build tools + build, then the demo
#   make test     the same, plus the test dependencies and the CUDA emulator, then the whole test suite
#   make jupyter  the demo's set-up plus Jupyter, then a Jupyter kernel named fusedllm for this user
#                 (then: .venv/bin/jupyter execute notebooks/00_fused_rmsnorm.ipynb)
#   TORCH=cpu     with any of them: torch's CPU-only build (a fresh .venv)
#   make gpu-check OUT=dir   build, test and benchmark on this machine's GPU (benchmarks/gpu_check.py)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# On x86-64 this is the CUDA 13.0 build. The CUDA kernels compile for the GPUs
# torch sees, as sm_80 PTX where none is visible; FUSEDLLM_CUDA=1 (as CI runs)
# for every default architecture, FUSEDLLM_CUDA=0 never (CMakeLists.txt).
TORCH_SPEC ?= torch==2.14.1
# TORCH=cpu: torch's CPU-only build from PyTorch's own index (no CUDA libraries; fusedllm then has
# no CUDA kernels). Read when torch is first installed into .venv: rm -rf .venv to switch.
TORCH ?=
TORCH_INDEX_cpu := https://download.pytorch.org/whl/cpu
TORCH_PIP_ARGS := $(if $(TORCH),$(if $(TORCH_INDEX_$(TORCH)),--index-url $(TORCH_INDEX_$(TORCH)),$(error TORCH=$(TORCH): only TORCH=cpu is known)))
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc 2>/dev/null || echo 2)

SOURCES := $(shell find csrc python build_support -type f -not -path '*/__pycache__/*') CMakeLists.txt pyproject.toml

.PHONY: all venv deps build test test-fast test-simt sanitize demo jupyter bench gpu-check clean

all: build

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch-installed: | $(BIN)/python
	$(BIN)/pip install $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	@echo "$(TORCH_SPEC) $(TORCH)" > $@

# What building and the demo need (requirements.txt), then what the tests,
# benchmarks and Jupyter add (requirements-dev.txt): make demo installs the first only.
$(VENV)/.deps-installed: requirements.txt $(VENV)/.torch-installed
	$(BIN)/pip install -r requirements.txt "$(TORCH_SPEC)"
	@touch $@

$(VENV)/.dev-deps-installed: requirements-dev.txt $(VENV)/.deps-installed
	$(BIN)/pip install -r requirements-dev.txt "$(TORCH_SPEC)"
	@touch $@

# The verbose build log keeps nvcc's `ptxas -v` register and spill report; the
# terminal shows what is configured and each compile step as it starts.
# FUSEDLLM_SIMT=ON also builds fusedllm._simt, the CUDA kernels emulated on the
# CPU, which the tests need and the demo does not; once it has been built,
# every rebuild keeps it (.built-simt), so that it never goes stale.
define build_extension
	@mkdir -p build
	@echo "building fusedllm$(if $(filter ON,$(1)), and its CUDA emulator,) (full log: build/build.log)"
	@set -o pipefail; $(BIN)/pip install -v --no-build-isolation --no-deps -C cmake.define.FUSEDLLM_SIMT=$(1) -e . 2>&1 \
	  | tee build/build.log \
	  | sed -unE 's/^ *-- (fusedllm: .*)/  \1/p; s/^\*\*\* (.*)/  \1/p; s|.*\[([0-9]+/[0-9]+)\] Building [A-Z]+ object CMakeFiles/([^/]+)\.dir/(.*)\.o$$|  [\1] \3 (\2)|p' \
	  || { tail -n 60 build/build.log; exit 1; }
	@touch $(VENV)/.built $(if $(filter ON,$(1)),$(VENV)/.built-simt)
endef

$(VENV)/.built: $(SOURCES) $(VENV)/.deps-installed
	$(call build_extension,$(if $(wildcard $(VENV)/.built-simt),ON,OFF))

$(VENV)/.built-simt: $(SOURCES) $(VENV)/.deps-installed
	$(call build_extension,ON)

venv: $(BIN)/python
deps: $(VENV)/.dev-deps-installed
build: $(VENV)/.built-simt $(VENV)/.dev-deps-installed

# Two pytest processes (pytest-xdist): most tests keep one core busy, and
# on 2 cores the suite took 28 minutes in one process. Each process keeps
# torch's threads (one per core), so that the CPU kernels run threaded; with
# OpenMP's threads waiting passively instead of spinning, one process's
# threads no longer take the cores from the other's: the CPU tests of three
# files took 56 s instead of 147 s on a 2-core Zen 3, as fast as with one
# thread per process.
TEST_JOBS ?= 2
PYTEST := OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest

test: build
	$(PYTEST) -q -n $(TEST_JOBS)

# Skips torch.compile and notebook runs.
test-fast: build
	$(PYTEST) -q -n $(TEST_JOBS) -m "not slow"

# Only the CUDA kernels, executed on the CPU by the SIMT emulator.
test-simt: build
	$(PYTEST) -q -n $(TEST_JOBS) -m simt

# The emulated CUDA kernels built with AddressSanitizer and UBSan (out-of-bounds,
# misaligned and undefined accesses that x86 would let pass), then their tests.
SANITIZE_DIR := build/sanitize
# Every kernel and code path, round-robin schedule, in bfloat16 and float32
# (float16 has bfloat16's layout; float16 and float64 cases, and the float16
# attention grid on an emulated sm_75, run unsanitized in make test). Under the sanitizers the emulator runs about 15x slower, more on
# slower CPUs (a Zen 3 took 3.5x a Zen 4's time); SANITIZE_TESTS="not simt-warp"
# runs all. opcheck and the float32 error against SDPA check schemas and
# numerics, which the sanitizers do not see: 4 minutes of a Zen 3's run.
SANITIZE_TESTS ?= not simt-warp and not long_prefill and not deterministic and not gradcheck \
  and not torch.float16 and not torch.float64 and not opcheck and not no_worse_than_sdpa \
  and not attention_grid_on_turing \
  and not (attention_options and (float16 or float64 or local_windows or long_sequence or head_dim_class))
sanitize: build
	@mkdir -p $(SANITIZE_DIR)
	FUSEDLLM_CUDA=0 $(BIN)/cmake -S . -B $(SANITIZE_DIR) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCMAKE_MAKE_PROGRAM=$(abspath $(BIN)/ninja) -DPython_EXECUTABLE=$(abspath $(BIN)/python) \
	  -DFUSEDLLM_SIMT=ON -DFUSEDLLM_SIMT_SANITIZE=ON > $(SANITIZE_DIR)/configure.log
	$(BIN)/cmake --build $(SANITIZE_DIR) --target _simt
	LD_PRELOAD="$$($(CXX) -print-file-name=libasan.so) $$($(CXX) -print-file-name=libubsan.so)" \
	  ASAN_OPTIONS=detect_leaks=0:alloc_dealloc_mismatch=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  FUSEDLLM_SIMT_LIBRARY="$$(ls $(SANITIZE_DIR)/_simt*.so)" \
	  $(PYTEST) -q -n $(TEST_JOBS) -p no:cacheprovider --capture=sys -m "simt and not slow" \
	  -k "$(SANITIZE_TESTS)"

demo: $(VENV)/.built
	$(BIN)/python benchmarks/demo.py

# A kernel named "fusedllm" for this user's Jupyter (any Jupyter, not only this venv's).
jupyter: $(VENV)/.built $(VENV)/.dev-deps-installed
	$(BIN)/python -m ipykernel install --user --name fusedllm --display-name "Python (fusedllm)"

bench: $(VENV)/.built $(VENV)/.dev-deps-installed
	$(BIN)/python benchmarks/bench_rms_norm.py
	$(BIN)/python benchmarks/bench_swiglu.py
	$(BIN)/python benchmarks/bench_rope.py
	$(BIN)/python benchmarks/bench_attention.py
	$(BIN)/python benchmarks/bench_attention_options.py
	$(BIN)/python benchmarks/bench_decode.py
	$(BIN)/python benchmarks/bench_kv_cache.py
	$(BIN)/python benchmarks/bench_hf_cache.py
	$(BIN)/python benchmarks/bench_model.py
	$(BIN)/python benchmarks/bench_parallel_block.py
	$(BIN)/python benchmarks/bench_cross_entropy.py
	$(BIN)/python benchmarks/bench_moe.py

# On a machine with a GPU: build for it in OUT/build, run every cuda test, then
# the GPU benchmarks, with the Python that has torch (no venv of ours, no network).
OUT ?= build/gpu-check
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py --out $(OUT)

clean:
	rm -rf build $(VENV)/.built $(VENV)/.built-simt
