import os

import pytest
import torch

# The suite tests the compiled kernels; CI also sets this so the plain-PyTorch
# path can never stand in for a broken build.
os.environ.setdefault("FUSEDLLM_REQUIRE_EXTENSION", "1")

import fusedllm  # noqa: E402

HAS_CUDA = torch.cuda.is_available()

# "simt" and "simt-warp" run the CUDA kernels on the CPU through the SIMT
# emulator (fusedllm.simt), under the round-robin and the warp-at-a-time
# schedule; the tensors are CPU tensors.
SIMT_SCHEDULES = {"simt": "lockstep", "simt-warp": "warp"}
# Tests of numerics over long runs (gradcheck, long sequences, run-to-run
# determinism, error against SDPA) run under the round-robin schedule only:
# the warp-at-a-time schedule reorders threads, which they do not exercise
# beyond the shorter tests, and took them 3 minutes.
LOCKSTEP_ONLY = ("gradcheck", "deterministic", "long_prefill", "no_worse_than_sdpa")

DEVICES = [
    "cpu",
    *(pytest.param(name, marks=pytest.mark.simt) for name in SIMT_SCHEDULES),
    pytest.param("cuda", marks=[pytest.mark.cuda,
                                pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")]),
]


def cpu_variants(values, *chosen):
    """A parametrize list of `values` with the `chosen` ones marked
    cpu_variants (re-run under every compiled CPU variant by
    test_cpu_variants.py)."""
    missing = [c for c in chosen if c not in values]
    assert not missing, f"{missing} not among {values}"
    return [pytest.param(v, marks=pytest.mark.cpu_variants) if v in chosen else v for v in values]


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items):
    # @pytest.mark.cpu_variants(name=[values], ...) on a test keeps the mark
    # only on the cases whose parameters all take one of the listed values:
    # marks on parametrize entries can pick values of one parameter, not
    # combinations of several.
    for item in items:
        mark = item.get_closest_marker("cpu_variants")
        if mark is None or not mark.kwargs:
            continue
        params = item.callspec.params if hasattr(item, "callspec") else {}
        unknown = set(mark.kwargs) - set(params)
        if unknown:
            raise pytest.UsageError(f"{item.nodeid}: cpu_variants names no parameter {sorted(unknown)}")
        if not all(params[name] in values for name, values in mark.kwargs.items()):
            item.own_markers = [m for m in item.own_markers if m.name != "cpu_variants"]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Marks an item skipped in its set-up or call: the device fixture's
    teardown reads it."""
    report = yield
    if report.skipped:
        item.was_skipped = True
    return report


@pytest.fixture(params=DEVICES)
def device(request):
    if request.param not in SIMT_SCHEDULES:
        yield request.param
        return
    if request.node.get_closest_marker("slow"):
        # torch.compile traces and 8k-token memory runs, too large for the
        # emulator; their kernels run under it in the other tests.
        pytest.skip("slow tests do not run under the SIMT emulator")
    if request.param == "simt-warp" and any(word in request.node.originalname for word in LOCKSTEP_ONLY):
        pytest.skip("runs under the round-robin schedule only")
    import fusedllm.simt

    # The emulated tensor-core attention kernels cost several times the SIMT
    # ones: they run the grid of tests/test_attention_tensor_core.py, and every
    # other emulated attention test runs the SIMT kernels (on a GPU, both run
    # as dispatch chooses).
    tensor_core_grid = request.module.__name__.endswith("test_attention_tensor_core")
    saved = os.environ.get("FUSEDLLM_CUDA_ATTENTION")
    os.environ["FUSEDLLM_CUDA_ATTENTION"] = "auto" if tensor_core_grid else "simt"
    try:
        with fusedllm.simt.kernels(schedule=SIMT_SCHEDULES[request.param]) as mode:
            yield "cpu"
    finally:
        if saved is None:
            os.environ.pop("FUSEDLLM_CUDA_ATTENTION", None)
        else:
            os.environ["FUSEDLLM_CUDA_ATTENTION"] = saved
    # A simt test that ran no fusedllm op would be a CPU test under another name.
    assert mode.calls > 0 or getattr(request.node, "was_skipped", False), \
        "this test ran no fusedllm op under the SIMT emulator"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
