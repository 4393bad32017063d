"""RMSNorm: notebook-style eager module vs F.rms_norm vs torch.compile vs fusedllm,
and Liger-Kernel's LigerRMSNorm on a GPU where it is installed. The "add+norm" rows
time the residual add fused with the norm (``h = x + residual``; the norm of h
and h itself), with the add done separately before the eager, F.rms_norm and
compiled norms, against fusedllm.nn.RMSNorm's ``forward(x, residual)`` and
Liger's LigerFusedAddRMSNorm.

    python benchmarks/bench_rms_norm.py            # full table -> benchmarks/results/
    python benchmarks/bench_rms_norm.py --quick    # small sizes
    python benchmarks/bench_rms_norm.py --out DIR  # the json, md and png into DIR
"""

from __future__ import annotations

import os
import sys

if not __package__:  # run as a file: import from the repository root, as `python -m` does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# harness before torch: with --thp it configures torch's allocator
from benchmarks.harness import (Benchmark, Roofline, agreement, dtype_name, forward_backward,  # noqa: E402
                                forward_only, interleaved_medians, liger, liger_notes, roofline_row, run)

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


class AddThenNorm(nn.Module):
    """The unfused pre-norm step: ``h = x + residual``, then a norm module;
    returns (norm(h), h) as a fused add + norm does."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x, residual):
        h = x + residual
        return self.norm(h), h


class FusedAddNorm(nn.Module):
    """fusedllm.nn.RMSNorm's fused add: ``forward(x, residual)``."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x, residual):
        return self.norm(x, residual)


def make_candidates(dim, dtype, device, with_compile, lk, add):
    """The candidate modules, each taking x (and residual with `add`); `lk`:
    the liger_kernel package or None."""
    eager = NotebookRMSNorm(dim).to(device=device, dtype=dtype)
    with torch.no_grad():
        eager.weight.copy_(1 + 0.1 * torch.randn(dim))
    torch_norm = TorchRMSNorm(dim).to(device=device, dtype=dtype)
    fused = fusedllm.nn.RMSNorm(dim).to(device=device, dtype=dtype)
    torch_norm.load_state_dict(eager.state_dict())
    fused.load_state_dict(eager.state_dict())
    if add:
        modules = {"eager": AddThenNorm(eager), "F.rms_norm": AddThenNorm(torch_norm), "fusedllm": FusedAddNorm(fused)}
    else:
        modules = {"eager": eager, "F.rms_norm": torch_norm, "fusedllm": fused}
    if with_compile:
        # A fresh compilation per case: past 8 shapes and dtypes of one module,
        # dynamo refuses to recompile (a hard error under fullgraph=True).
        torch._dynamo.reset()
        compiled_src = NotebookRMSNorm(dim).to(device=device, dtype=dtype)
        compiled_src.load_state_dict(eager.state_dict())
        modules["compile"] = torch.compile(AddThenNorm(compiled_src) if add else compiled_src, fullgraph=True)
    if lk is not None:
        # fusedllm's default casting: normalize in float32, cast to x's dtype, then scale.
        # in_place=False: with True, LigerRMSNorm's backward writes dx into the incoming
        # gradient, which here is one tensor shared by every candidate (inside a model
        # that gradient is dead after the norm, so the time is the same).
        if add:
            peer = lk.transformers.LigerFusedAddRMSNorm(dim, eps=fused.eps, offset=0.0, casting_mode="llama",
                                                        in_place=False)
        else:
            peer = lk.transformers.LigerRMSNorm(dim, eps=fused.eps, offset=0.0, casting_mode="llama",
                                                in_place=False)
        modules["liger"] = peer.to(device=device, dtype=dtype)
        modules["liger"].load_state_dict(eager.state_dict())
    return modules


def run_with_grads(module, inputs, grads):
    """Forward and backward of copies of `inputs`; returns the outputs and the
    inputs' gradients."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = module(*leaves)
    torch.autograd.backward(out, grads)
    return out, [t.grad for t in leaves]


def bench_case(rows, dim, dtype, device, reps, with_compile, lk, add=False):
    x = torch.randn(rows, dim, dtype=dtype, device=device)
    size = x.numel() * x.element_size()
    roofline = Roofline(size, device)
    g = torch.randn_like(x)
    inputs = [x]
    grads = g
    if add:
        residual = torch.randn_like(x)
        inputs.append(residual)
        grads = (g, torch.randn_like(x))  # gradients of the normed output and of the new residual
    modules = make_candidates(dim, dtype, device, with_compile, lk, add)

    # correctness of the fused module against the eager one, and of Liger's against ours
    ye, ge = run_with_grads(modules["eager"], inputs, grads)
    yf, gf = run_with_grads(modules["fusedllm"], inputs, grads)
    max_diff = agreement(ye, yf)[0]
    grad_diff = agreement(ge, gf)[0]
    peer = {}
    if "liger" in modules:
        yl, gl = run_with_grads(modules["liger"], inputs, grads)
        (out_diff, out_ok), (in_diff, in_ok) = agreement(yf, yl), agreement(gf, gl)
        peer = dict(liger_diff=out_diff, liger_grad_diff=in_diff, liger_close=out_ok and in_ok)

    for mode in ("forward", "forward+backward"):
        if mode == "forward":
            candidates = {k: forward_only(m, *inputs) for k, m in modules.items()}
        else:
            leaves = [t.clone().requires_grad_() for t in inputs]
            candidates = {k: forward_backward(m, leaves, grads) for k, m in modules.items()}
        candidates.update(roofline.calls)
        times = interleaved_medians(candidates, device, reps)
        if add:
            # forward reads x and residual, writes y and h; backward reads dy, dh and h
            # (and rstd), writes one gradient that x and residual share
            moved = (4 if mode == "forward" else 8) * size
        else:
            # forward reads x, writes y; backward reads x, dy (and rstd), writes dx
            moved = (2 if mode == "forward" else 5) * size
        fused_t = times["fusedllm"]
        yield dict(
            case=f"{'add+norm ' if add else ''}{rows}x{dim} {dtype_name(dtype)} "
                 f"{'fwd' if mode == 'forward' else 'fwd+bwd'}",
            op="fused_add_rms_norm" if add else "rms_norm",
            shape=[rows, dim], dtype=str(dtype), mode=mode,
            ms={k: v * 1e3 for k, v in times.items()},
            eager_ms=times["eager"] * 1e3, torch_ms=times["F.rms_norm"] * 1e3,
            compile_ms=times["compile"] * 1e3 if "compile" in times else None,
            fused_ms=fused_t * 1e3,
            liger_ms=times["liger"] * 1e3 if "liger" in times else None,
            vs_eager=times["eager"] / fused_t, vs_torch=times["F.rms_norm"] / fused_t,
            vs_compile=times["compile"] / fused_t if "compile" in times else None,
            vs_liger=times["liger"] / fused_t if "liger" in times else None,
            **roofline_row(moved, times, roofline.work),
            liger_gbps=moved / times["liger"] / 1e9 if "liger" in times else None,
            max_abs_diff=max_diff, max_grad_diff=grad_diff, **peer,
        )


def cases(args, device):
    shapes = [(2048, 1024)] if args.quick else [(4096, 4096), (16384, 1024)]
    if device.type == "cuda" and not args.quick:  # sizes whose time is the kernels', not the per-call cost
        shapes += [(16384, 4096), (65536, 1024)]
    reps = args.reps or (15 if args.quick else 40)
    lk = liger(device, args)
    for add in (False, True):
        for rows, dim in shapes:
            for dtype in (torch.float32, torch.bfloat16):
                yield from bench_case(rows, dim, dtype, device, reps, not args.no_compile, lk, add)


def describe(row):
    return (f"{row['case']:<37} fused {row['fused_ms']:8.3f} ms   "
            f"x{row['vs_eager']:.2f} eager   x{row['vs_torch']:.2f} F.rms_norm   "
            + (f"x{row['vs_compile']:.2f} compile   " if row['vs_compile'] else "")
            + (f"x{row['vs_liger']:.2f} Liger ({row['liger_gbps']:.1f} GB/s, max|diff| {row['liger_diff']:.1e}"
               f"{'' if row['liger_close'] else ' NOT CLOSE'})   " if row.get('vs_liger') else "")
            + f"{row['fused_gbps']:.1f} GB/s ({row['pct_copy']:.0f}% of copy at {row['copy_gbps']:.1f})   "
            f"max|diff| {row['max_abs_diff']:.2e}")


COLUMNS = [
    ("case", "case", "s"),
    ("eager_ms", "eager ms", ".3f"),
    ("torch_ms", "F.rms_norm ms", ".3f"),
    ("compile_ms", "compile ms", ".3f"),
    ("liger_ms", "Liger ms", ".3f"),
    ("fused_ms", "fusedllm ms", ".3f"),
    ("vs_eager", "× eager", ".2f"),
    ("vs_torch", "× F.rms_norm", ".2f"),
    ("vs_compile", "× compile", ".2f"),
    ("vs_liger", "× Liger", ".2f"),
    ("fused_gbps", "fusedllm GB/s", ".1f"),
    ("liger_gbps", "Liger GB/s", ".1f"),
    ("copy_gbps", "copy GB/s", ".1f"),
    ("pct_copy", "% of copy", ".0f"),
    ("clone_gbps", "clone GB/s", ".1f"),
    ("pct_clone", "% of clone", ".0f"),
]

def notes(rows):
    return liger_notes(rows, "liger_kernel.transformers.LigerRMSNorm and LigerFusedAddRMSNorm "
                             "(casting_mode='llama', offset 0, in_place=False)",
                       ("liger_diff", "liger_grad_diff"))


BENCHMARK = Benchmark("rms_norm", __doc__, cases, COLUMNS, "vs_eager", "speedup over the eager module",
                      describe=describe, notes=notes)


def main(argv=None):
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    main()
