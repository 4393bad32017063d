import os

import pytest
import torch

# The suite tests the compiled kernels; CI also sets this so the reference
# fallback can never stand in for a broken build.
os.environ.setdefault("FUSEDLLM_REQUIRE_EXTENSION", "1")

import fusedllm  # noqa: E402

HAS_CUDA = torch.cuda.is_available()

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda,
                                pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")]),
]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
