"""Tolerances and comparison helpers shared by the tests."""

import contextlib
import re

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


@contextlib.contextmanager
def one_thread():
    """torch on one thread: for tiny models, thread hand-offs cost more than
    they save on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


# What csrc/cpu/dispatch.cpp asks of the CPU before it runs a variant.
_ISA_FLAGS = {
    "DEFAULT": set(),
    "AVX2": {"avx2", "fma", "bmi2"},
    "AVX512": {"avx2", "fma", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "AVX512_BF16": {"avx2", "fma", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                    "avx512_vnni"},
    # dispatch.cpp also asks Linux for the tile data state: where that is
    # refused, the AMX cases fail, naming the variant that ran instead
    "AMX": {"avx2", "fma", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
            "avx512_vnni", "amx_tile", "amx_bf16"},
}

# ATEN_CPU_CAPABILITY for each variant: torch has no AVX512-BF16 or AMX level, so
# those variants run under torch's AVX512 with FUSEDLLM_CPU_ISA naming them.
ATEN_CAPABILITY = {"DEFAULT": "default", "AVX2": "avx2", "AVX512": "avx512", "AVX512_BF16": "avx512",
                   "AMX": "avx512"}

# The kernel tables a variant has a kernel in, where not every table: on the
# others it runs the variant below it (KernelTable::get).
VARIANT_TABLES = {"AMX": {"attention_forward", "attention_backward"}}


def variant_run(isa: str, table: str) -> str:
    """The variant whose kernel of `table` runs when `isa` is the active one."""
    return isa if isa not in VARIANT_TABLES or table in VARIANT_TABLES[isa] else "AVX512_BF16"


def compiled_cpu_isas():
    """The CPU variants the extension was built with (DEFAULT, AVX2, AVX512, AVX512_BF16, AMX)."""
    import fusedllm

    return list(fusedllm.build_info().get("cpu_isas", []))


def runnable_cpu_isas():
    """The compiled CPU variants this machine can execute."""
    flags = _cpu_flags()
    return [isa for isa in compiled_cpu_isas() if _ISA_FLAGS.get(isa, {"?"}) <= flags]


def run_python(*parts, timeout=300, **env_overrides):
    """Runs the code pieces (each dedented on its own) in a new interpreter, in
    the repository root with tests/ importable, without the fusedllm and torch
    variables of this process unless given again."""
    import os
    import subprocess
    import sys
    import textwrap

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    code = "\n".join(textwrap.dedent(part) for part in parts)
    env = dict(os.environ)
    for name in ("FUSEDLLM_REQUIRE_EXTENSION", "FUSEDLLM_DISABLE_EXTENSION", "ATEN_CPU_CAPABILITY",
                 "FUSEDLLM_CPU_ISA"):
        env.pop(name, None)
    env.update(env_overrides)
    env["PYTHONPATH"] = tests_dir + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=os.path.dirname(tests_dir))


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


def whole(message: str) -> str:
    """A pytest.raises match= for exactly this message."""
    return "^" + re.escape(message) + "$"
