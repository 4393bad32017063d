"""SwiGLU: the gating op against eager `F.silu(g) * u` and torch.compile of it, and
the gated MLP module against the notebook's SwiGLU module and torch.compile of it;
on a GPU where Liger-Kernel is installed, also against its gating function
(liger_kernel.transformers.functional.liger_swiglu, what its LigerSwiGLUMLP calls)
and an MLP that calls it as LigerSwiGLUMLP does.

    python benchmarks/bench_swiglu.py            # full tables -> benchmarks/results/
    python benchmarks/bench_swiglu.py --quick    # small sizes
    python benchmarks/bench_swiglu.py --out DIR  # the json, md and png into DIR
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
from testkit.memory import peak_memory_bytes  # noqa: E402
from testkit.notebook_models import NotebookSwiGLU  # noqa: E402  (the notebook's eager module)


def eager_gate(g, u):
    return F.silu(g) * u


def gate_grads(fn, g, u, dh):
    """fn(g, u) and the gradients of copies of g and u."""
    gr, ur = g.clone().requires_grad_(), u.clone().requires_grad_()
    h = fn(gr, ur)
    h.backward(dh)
    return h, [gr.grad, ur.grad]


def bench_op(rows, features, dtype, device, reps, with_compile, lk):
    g = torch.randn(rows, features, dtype=dtype, device=device)
    u = torch.randn_like(g)
    dh = torch.randn_like(g)
    size = g.numel() * g.element_size()
    roofline = Roofline(size, device)
    fns = {"eager": eager_gate, "fusedllm": fusedllm.swiglu}
    if with_compile:
        fns["compile"] = torch.compile(eager_gate, fullgraph=True)
    if lk is not None:
        fns["liger"] = lk.transformers.functional.liger_swiglu
    max_diff = (fns["eager"](g, u).float() - fusedllm.swiglu(g, u).float()).abs().max().item()
    peer = {}
    if "liger" in fns:
        hf, gf = gate_grads(fusedllm.swiglu, g, u, dh)
        hl, gl = gate_grads(fns["liger"], g, u, dh)
        (out_diff, out_ok), (in_diff, in_ok) = agreement(hf, hl), agreement(gf, gl)
        peer = dict(liger_diff=out_diff, liger_grad_diff=in_diff, liger_close=out_ok and in_ok)
    for mode in ("forward", "forward+backward"):
        if mode == "forward":
            candidates = {k: forward_only(f, g, u) for k, f in fns.items()}
            moved = 3 * size  # read gate and up, write h
        else:
            gr, ur = g.clone().requires_grad_(), u.clone().requires_grad_()
            candidates = {k: forward_backward(f, [gr, ur], dh) for k, f in fns.items() if k != "liger"}
            if "liger" in fns:
                # Liger's backward writes the two gradients over the gate and up it saved,
                # here the leaves themselves (in a model, the projections' dead outputs):
                # its own copies, so the others' inputs stay as they are.
                gl, ul = g.clone().requires_grad_(), u.clone().requires_grad_()
                candidates["liger"] = forward_backward(fns["liger"], [gl, ul], dh)
            moved = 8 * size  # forward 3, backward reads dh, gate, up and writes two grads
        candidates.update(roofline.calls)
        times = interleaved_medians(candidates, device, reps)
        t = times["fusedllm"]
        yield dict(
            case=f"{rows}x{features} {dtype_name(dtype)} {'fwd' if mode == 'forward' else 'fwd+bwd'}",
            kind="op", mode=mode, dtype=str(dtype), shape=[rows, features],
            eager_ms=times["eager"] * 1e3, compile_ms=times["compile"] * 1e3 if "compile" in times else None,
            liger_ms=times["liger"] * 1e3 if "liger" in times else None,
            fused_ms=t * 1e3, vs_eager=times["eager"] / t,
            vs_compile=times["compile"] / t if "compile" in times else None,
            vs_liger=times["liger"] / t if "liger" in times else None,
            **roofline_row(moved, times, roofline.work),
            liger_gbps=moved / times["liger"] / 1e9 if "liger" in times else None,
            max_abs_diff=max_diff, **peer)


class LigerGatedMLP(nn.Module):
    """The notebook module's projections (with their biases) around Liger's
    gating function: the forward of Liger's LigerSwiGLUMLP, which itself
    builds bias-free projections from a config."""

    def __init__(self, lk, template: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = template.gate_proj, template.up_proj, template.down_proj
        self.gate = lk.transformers.functional.liger_swiglu

    def forward(self, x):
        return self.down_proj(self.gate(self.gate_proj(x), self.up_proj(x)))


def bench_mlp(tokens, hidden, intermediate, dtype, device, reps, with_compile, lk):
    eager = NotebookSwiGLU(hidden, intermediate).to(device=device, dtype=dtype)
    fused = fusedllm.nn.SwiGLU(hidden, intermediate).to(device=device, dtype=dtype)
    fused.load_state_dict(eager.state_dict())
    modules = {"eager": eager, "fusedllm": fused}
    if with_compile:
        src = NotebookSwiGLU(hidden, intermediate).to(device=device, dtype=dtype)
        src.load_state_dict(eager.state_dict())
        modules["compile"] = torch.compile(src, fullgraph=True)
    if lk is not None:
        src = NotebookSwiGLU(hidden, intermediate).to(device=device, dtype=dtype)
        src.load_state_dict(eager.state_dict())
        modules["liger"] = LigerGatedMLP(lk, src)
    x = torch.randn(tokens, hidden, dtype=dtype, device=device, requires_grad=True)
    grad = torch.randn(tokens, hidden, dtype=dtype, device=device)
    max_diff = (eager(x).float() - fused(x).float()).abs().max().item()
    peer = {}
    if "liger" in modules:
        with torch.no_grad():
            peer["liger_diff"], peer["liger_close"] = agreement(fused(x), modules["liger"](x))
    candidates = {k: forward_backward(m, [x], grad) for k, m in modules.items()}
    times = interleaved_medians(candidates, device, reps, warmup=2)
    peaks = {k: peak_memory_bytes(fn, device) for k, fn in candidates.items()}
    t = times["fusedllm"]
    return dict(
        case=f"MLP {tokens}x{hidden}->{intermediate} {dtype_name(dtype)} fwd+bwd",
        kind="mlp", mode="forward+backward", dtype=str(dtype),
        eager_ms=times["eager"] * 1e3, compile_ms=times["compile"] * 1e3 if "compile" in times else None,
        liger_ms=times["liger"] * 1e3 if "liger" in times else None,
        fused_ms=t * 1e3, vs_eager=times["eager"] / t,
        vs_compile=times["compile"] / t if "compile" in times else None,
        vs_liger=times["liger"] / t if "liger" in times else None,
        eager_peak_mb=peaks["eager"] / 2**20, fused_peak_mb=peaks["fusedllm"] / 2**20,
        compile_peak_mb=peaks["compile"] / 2**20 if "compile" in peaks else None,
        liger_peak_mb=peaks["liger"] / 2**20 if "liger" in peaks else None,
        max_abs_diff=max_diff, **peer)


def cases(args, device):
    compile_ = not args.no_compile
    lk = liger(device, args)
    if args.quick:
        op_shapes, mlp_shape, reps = [(1024, 2816)], (512, 256, 704), args.reps or 10
    else:
        op_shapes, mlp_shape, reps = [(4096, 11008), (16384, 2816)], (4096, 1024, 2816), args.reps or 15
    for dtype in (torch.float32, torch.bfloat16):
        for rows, features in op_shapes:
            yield from bench_op(rows, features, dtype, device, reps, compile_, lk)
    # float32 only: this CPU has no bfloat16 matrix units, so bfloat16 GEMMs run a
    # slow fallback that would time the BLAS rather than the gating.
    for dtype in (torch.float32,) if device.type == "cpu" else (torch.float32, torch.bfloat16):
        yield bench_mlp(*mlp_shape, dtype, device, max(5, reps // 2), compile_, lk)


def describe(row):
    text = (f"{row['case']:<34} fused {row['fused_ms']:8.2f} ms  x{row['vs_eager']:.2f} eager  "
            + (f"x{row['vs_compile']:.2f} compile  " if row["vs_compile"] else "")
            + (f"x{row['vs_liger']:.2f} Liger (max|diff| {row['liger_diff']:.1e}"
               f"{'' if row['liger_close'] else ' NOT CLOSE'})  " if row.get("vs_liger") else ""))
    if row["kind"] == "op":
        return text + (f"{row['fused_gbps']:.1f} GB/s ({row['pct_copy']:.0f}% of copy at {row['copy_gbps']:.1f}, "
                       f"{row['pct_clone']:.0f}% of clone)")
    return text + (f"peak MiB eager {row['eager_peak_mb']:.0f} fused {row['fused_peak_mb']:.0f}"
                   + (f" compile {row['compile_peak_mb']:.0f}" if row["compile_peak_mb"] is not None else "")
                   + (f" Liger {row['liger_peak_mb']:.0f}" if row.get("liger_peak_mb") is not None else ""))


COLUMNS = [
    ("case", "case", "s"),
    ("eager_ms", "eager ms", ".2f"),
    ("compile_ms", "compile ms", ".2f"),
    ("liger_ms", "Liger ms", ".2f"),
    ("fused_ms", "fusedllm ms", ".2f"),
    ("vs_eager", "× eager", ".2f"),
    ("vs_compile", "× compile", ".2f"),
    ("vs_liger", "× Liger", ".2f"),
    ("fused_gbps", "fusedllm GB/s", ".1f"),
    ("liger_gbps", "Liger GB/s", ".1f"),
    ("pct_copy", "% of copy", ".0f"),
    ("clone_gbps", "clone GB/s", ".1f"),
    ("pct_clone", "% of clone", ".0f"),
    ("eager_peak_mb", "eager peak MiB", ".0f"),
    ("compile_peak_mb", "compile peak MiB", ".0f"),
    ("liger_peak_mb", "Liger peak MiB", ".0f"),
    ("fused_peak_mb", "fusedllm peak MiB", ".0f"),
]


def notes(rows):
    return liger_notes(rows, "liger_kernel.transformers.functional.liger_swiglu (LigerSiLUMulFunction) "
                             "for the op, and inside the notebook MLP's projections for the MLP rows",
                       ("liger_diff", "liger_grad_diff"))


BENCHMARK = Benchmark("swiglu", __doc__, cases, COLUMNS, "vs_eager", "speedup over eager", describe=describe,
                      notes=notes)


def main(argv=None):
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    main()
