"""Rotary embedding: the notebook's module (chunk / cat rotate_half), Hugging Face's
apply_rotary_pos_emb, torch.compile of it, and fusedllm.

    python benchmarks/bench_rope.py            # B=4, Hq=32, Hkv=8, S=2048, D=128
    python benchmarks/bench_rope.py --quick    # small sizes
"""

from __future__ import annotations

import os
import sys

if not __package__:  # run as a file: import from the repository root, as `python -m` does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# harness before torch: with --thp it configures torch's allocator
from benchmarks.harness import (Benchmark, Roofline, dtype_name, forward_only, interleaved_medians,  # noqa: E402
                                roofline_row, run)

import torch  # noqa: E402

import fusedllm  # noqa: E402
from testkit.notebook_models import NotebookRotaryEmbedding  # noqa: E402  (the notebook's eager module)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def hf_style(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb with [B, S, D] tables."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def forward_backward_dense(fn, q, k):
    """A zero-argument callable running fn(q, k) and its backward with dense
    random gradients for both outputs (as inside a model; a `.sum()` loss would
    hand every candidate a broadcast gradient instead)."""
    qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
    gq, gk = torch.randn_like(q), torch.randn_like(k)

    def run():
        qr.grad = kr.grad = None
        torch.autograd.backward(fn(qr, kr), (gq, gk))
    return run


def bench_case(batch, hq, hkv, seq, dim, dtype, device, reps, with_compile):
    q = torch.randn(batch, hq, seq, dim, dtype=dtype, device=device)
    k = torch.randn(batch, hkv, seq, dim, dtype=dtype, device=device)
    notebook = NotebookRotaryEmbedding(dim, max_len=seq).to(device)
    fused = fusedllm.nn.RotaryEmbedding(dim, max_positions=seq).to(device)
    cos_full = torch.cat([fused.cos_cached, fused.cos_cached], -1)[None].expand(batch, -1, -1).to(dtype)
    sin_full = torch.cat([fused.sin_cached, fused.sin_cached], -1)[None].expand(batch, -1, -1).to(dtype)
    fns = {
        "notebook": lambda a, b: notebook(a, b),
        "hf": lambda a, b: hf_style(a, b, cos_full, sin_full),
        "fusedllm": lambda a, b: fused(a, b),
    }
    if with_compile:
        compiled = torch.compile(hf_style, fullgraph=True)
        fns["compile"] = lambda a, b: compiled(a, b, cos_full, sin_full)
    ref = fns["hf"](q, k)
    got = fns["fusedllm"](q, k)
    max_diff = max((ref[0].float() - got[0].float()).abs().max().item(),
                   (ref[1].float() - got[1].float()).abs().max().item())
    size = (q.numel() + k.numel()) * q.element_size()
    roofline = Roofline(size, device)
    for mode in ("forward", "forward+backward"):
        if mode == "forward":
            candidates = {n: forward_only(f, q, k) for n, f in fns.items()}
            moved = 2 * size
        else:
            candidates = {n: forward_backward_dense(f, q, k) for n, f in fns.items()}
            moved = 4 * size  # forward reads and writes q, k; backward the same for the grads
        if mode == "forward":
            # The same kernel writing into q and k: no fresh outputs to fault in.
            # Rotating back and forth keeps the inputs bounded over the repetitions.
            qi, ki = q.clone(), k.clone()
            inverse = [False]

            def in_place():
                torch.ops.fusedllm.rope_(qi, ki, fused.cos_cached, fused.sin_cached, None, 0,
                                         False, -1, inverse[0])
                inverse[0] = not inverse[0]
            candidates["in_place"] = in_place
        candidates.update(roofline.calls)
        times = interleaved_medians(candidates, device, reps)
        t = times["fusedllm"]
        in_place = {}
        if "in_place" in times:
            in_place = roofline_row(moved, times, roofline.work, subject="in_place", key="in_place",
                                    pct_prefix="in_place_")
        yield dict(
            case=f"{batch}x{hq}/{hkv}x{seq}x{dim} {dtype_name(dtype)} {'fwd' if mode == 'forward' else 'fwd+bwd'}",
            mode=mode, dtype=str(dtype),
            notebook_ms=times["notebook"] * 1e3, hf_ms=times["hf"] * 1e3,
            compile_ms=times["compile"] * 1e3 if "compile" in times else None, fused_ms=t * 1e3,
            vs_notebook=times["notebook"] / t, vs_hf=times["hf"] / t,
            vs_compile=times["compile"] / t if "compile" in times else None,
            **roofline_row(moved, times, roofline.work),
            in_place_ms=times["in_place"] * 1e3 if "in_place" in times else None,
            in_place_pct_copy=in_place.get("in_place_pct_copy"),
            max_abs_diff=max_diff)


COLUMNS = [
    ("case", "case", "s"),
    ("notebook_ms", "notebook ms", ".2f"),
    ("hf_ms", "HF ms", ".2f"),
    ("compile_ms", "compile ms", ".2f"),
    ("fused_ms", "fusedllm ms", ".2f"),
    ("vs_notebook", "× notebook", ".2f"),
    ("vs_hf", "× HF", ".2f"),
    ("vs_compile", "× compile", ".2f"),
    ("fused_gbps", "fusedllm GB/s", ".1f"),
    ("copy_gbps", "copy GB/s", ".1f"),
    ("pct_copy", "% of copy", ".0f"),
    ("clone_gbps", "clone GB/s", ".1f"),
    ("pct_clone", "% of clone", ".0f"),
    ("in_place_ms", "in place ms", ".2f"),
    ("in_place_pct_copy", "in place % of copy", ".0f"),
]


def cases(args, device):
    shape = (1, 32, 8, 256, 128) if args.quick else (4, 32, 8, 2048, 128)
    reps = args.reps or (10 if args.quick else 15)
    for dtype in (torch.float32, torch.bfloat16):
        yield from bench_case(*shape, dtype, device, reps, not args.no_compile)


def describe(row):
    return (f"{row['case']:<34} fused {row['fused_ms']:8.2f} ms  x{row['vs_notebook']:.2f} notebook  "
            f"x{row['vs_hf']:.2f} HF  " + (f"x{row['vs_compile']:.2f} compile  " if row["vs_compile"] else "")
            + f"{row['fused_gbps']:.1f} GB/s ({row['pct_copy']:.0f}% of copy, {row['pct_clone']:.0f}% of clone)  "
            f"max|diff| {row['max_abs_diff']:.1e}")


BENCHMARK = Benchmark("rope", __doc__, cases, COLUMNS, "vs_notebook", "speedup over the notebook module",
                      describe=describe)


def main(argv=None):
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    main()
