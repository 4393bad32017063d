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


def assert_close(actual, expected, tol, what="", upcast=False):
    """assert_close with atol relative to the largest finite expected magnitude.
    Compared in actual's dtype, or with upcast=True in expected's (a float64
    reference kept unrounded); `what` prefixes the failure message."""
    atol, rtol = tol
    finite = expected[torch.isfinite(expected)]
    scale = max(1.0, finite.abs().max().item()) if finite.numel() else 1.0
    if upcast:
        actual = actual.to(expected.dtype)
    else:
        expected = expected.to(actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol * scale, rtol=rtol, equal_nan=True,
                               msg=(lambda m: f"{what}: {m}") if what else None)


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


def peak_memory_bytes(fn, device) -> int:
    """Peak bytes allocated by torch while fn() runs, above what was live before.

    CUDA: the caching allocator's peak counter. CPU: torch keeps no such counter,
    so we replay the allocation and free events the profiler records
    (profile_memory=True) in time order and take the highest running total.
    Memory that does not go through torch's allocator is not counted.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def emulated() -> bool:
    """True inside the SIMT emulator's tests (device "simt", "simt-warp")."""
    import sys

    simt = sys.modules.get("fusedllm.simt")
    return simt is not None and simt.active()


def results_across_thread_counts(device, run):
    """run()'s results under 1, 2, 2 and 1 torch threads on a CPU (twice on a
    GPU or under the SIMT emulator, which does not use torch's threads), the
    thread count restored after: for determinism tests."""
    cpu_kernels = torch.device(device).type == "cpu" and not emulated()
    thread_counts = (1, 2, 2, 1) if cpu_kernels else (None, None)
    results = []
    old = torch.get_num_threads()
    try:
        for threads in thread_counts:
            if threads:
                torch.set_num_threads(threads)
            results.append(run())
    finally:
        torch.set_num_threads(old)
    return results
