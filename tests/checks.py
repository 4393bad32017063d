"""Tolerances and comparison helpers shared by the tests."""

import torch

# Tolerances for comparing a fused result with the reference, by dtype:
# (atol, rtol) for forward values and for gradients.
FORWARD_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float64: (1e-12, 1e-12),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float16: (2e-3, 2e-3),
}
GRAD_TOL = {
    torch.float32: (1e-4, 1e-4),
    torch.float64: (1e-10, 1e-10),
    torch.bfloat16: (5e-2, 5e-2),
    torch.float16: (1e-2, 1e-2),
}


def assert_close(actual, expected, tol):
    """assert_close with atol relative to the largest expected magnitude."""
    atol, rtol = tol
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected.to(actual.dtype), atol=atol * scale, rtol=rtol,
                               equal_nan=True)


def runnable_cpu_isas():
    """The compiled CPU variants this machine can execute."""
    import os

    import fusedllm

    info = fusedllm.build_info()
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    runnable = ["DEFAULT"]
    if "AVX2" in info["cpu_isas"] and " avx2" in flags:
        runnable.append("AVX2")
    if "AVX512" in info["cpu_isas"] and " avx512bw" in flags and " avx512vl" in flags:
        runnable.append("AVX512")
    return runnable
