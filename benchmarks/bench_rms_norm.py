"""RMSNorm: notebook-style eager module vs F.rms_norm vs torch.compile vs fusedllm.

    python benchmarks/bench_rms_norm.py            # full table -> benchmarks/results/
    python benchmarks/bench_rms_norm.py --quick    # small sizes
"""

from __future__ import annotations

import os
import sys

if not __package__:  # run as a file: import from the repository root, as `python -m` does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# harness before torch: with --thp it configures torch's allocator
from benchmarks.harness import (Benchmark, Roofline, dtype_name, forward_backward, forward_only,  # noqa: E402
                                interleaved_medians, roofline_row, run)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import fusedllm  # noqa: E402
from testkit.notebook_models import NotebookRMSNorm  # noqa: E402  (the notebooks' eager module)


class TorchRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def make_candidates(dim, dtype, device, with_compile):
    eager = NotebookRMSNorm(dim).to(device=device, dtype=dtype)
    with torch.no_grad():
        eager.weight.copy_(1 + 0.1 * torch.randn(dim))
    torch_norm = TorchRMSNorm(dim).to(device=device, dtype=dtype)
    fused = fusedllm.nn.RMSNorm(dim).to(device=device, dtype=dtype)
    torch_norm.load_state_dict(eager.state_dict())
    fused.load_state_dict(eager.state_dict())
    modules = {"eager": eager, "F.rms_norm": torch_norm, "fusedllm": fused}
    if with_compile:
        compiled_src = NotebookRMSNorm(dim).to(device=device, dtype=dtype)
        compiled_src.load_state_dict(eager.state_dict())
        modules["compile"] = torch.compile(compiled_src, fullgraph=True)
    return modules


def bench_case(rows, dim, dtype, device, reps, with_compile):
    x = torch.randn(rows, dim, dtype=dtype, device=device)
    roofline = Roofline(x.numel() * x.element_size(), device)
    g = torch.randn_like(x)
    modules = make_candidates(dim, dtype, device, with_compile)

    # correctness of the fused module against the eager one
    xe = x.clone().requires_grad_()
    xf = x.clone().requires_grad_()
    ye, yf = modules["eager"](xe), modules["fusedllm"](xf)
    ye.backward(g)
    yf.backward(g)
    max_diff = (ye.float() - yf.float()).abs().max().item()
    grad_diff = (xe.grad.float() - xf.grad.float()).abs().max().item()

    for mode in ("forward", "forward+backward"):
        if mode == "forward":
            candidates = {k: forward_only(m, x) for k, m in modules.items()}
        else:
            xr = x.clone().requires_grad_()
            candidates = {k: forward_backward(m, [xr], g) for k, m in modules.items()}
        candidates.update(roofline.calls)
        times = interleaved_medians(candidates, device, reps)
        # forward reads x, writes y; backward reads x, dy (and rstd), writes dx
        moved = (2 if mode == "forward" else 5) * x.numel() * x.element_size()
        fused_t = times["fusedllm"]
        yield dict(
            case=f"{rows}x{dim} {dtype_name(dtype)} {'fwd' if mode == 'forward' else 'fwd+bwd'}",
            shape=[rows, dim], dtype=str(dtype), mode=mode,
            ms={k: v * 1e3 for k, v in times.items()},
            eager_ms=times["eager"] * 1e3, torch_ms=times["F.rms_norm"] * 1e3,
            compile_ms=times["compile"] * 1e3 if "compile" in times else None,
            fused_ms=fused_t * 1e3,
            vs_eager=times["eager"] / fused_t, vs_torch=times["F.rms_norm"] / fused_t,
            vs_compile=times["compile"] / fused_t if "compile" in times else None,
            **roofline_row(moved, times, roofline.work),
            max_abs_diff=max_diff, max_grad_diff=grad_diff,
        )


def cases(args, device):
    shapes = [(2048, 1024)] if args.quick else [(4096, 4096), (16384, 1024)]
    reps = args.reps or (15 if args.quick else 40)
    for rows, dim in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            yield from bench_case(rows, dim, dtype, device, reps, not args.no_compile)


def describe(row):
    return (f"{row['case']:<28} fused {row['fused_ms']:8.3f} ms   "
            f"x{row['vs_eager']:.2f} eager   x{row['vs_torch']:.2f} F.rms_norm   "
            + (f"x{row['vs_compile']:.2f} compile   " if row['vs_compile'] else "")
            + f"{row['fused_gbps']:.1f} GB/s ({row['pct_copy']:.0f}% of copy at {row['copy_gbps']:.1f})   "
            f"max|diff| {row['max_abs_diff']:.2e}")


COLUMNS = [
    ("case", "case", "s"),
    ("eager_ms", "eager ms", ".3f"),
    ("torch_ms", "F.rms_norm ms", ".3f"),
    ("compile_ms", "compile ms", ".3f"),
    ("fused_ms", "fusedllm ms", ".3f"),
    ("vs_eager", "× eager", ".2f"),
    ("vs_torch", "× F.rms_norm", ".2f"),
    ("vs_compile", "× compile", ".2f"),
    ("fused_gbps", "fusedllm GB/s", ".1f"),
    ("copy_gbps", "copy GB/s", ".1f"),
    ("pct_copy", "% of copy", ".0f"),
    ("clone_gbps", "clone GB/s", ".1f"),
    ("pct_clone", "% of clone", ".0f"),
]

BENCHMARK = Benchmark("rms_norm", __doc__, cases, COLUMNS, "vs_eager", "speedup over the eager module",
                      describe=describe)


def main(argv=None):
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    main()
