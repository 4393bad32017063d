"""Rotary embedding: the notebook's module (chunk / cat rotate_half), Hugging Face's
apply_rotary_pos_emb, torch.compile of it, and fusedllm; on a GPU where
Liger-Kernel is installed, also its liger_rotary_pos_emb.

    python benchmarks/bench_rope.py            # B=4, Hq=32, Hkv=8, S=2048, D=128
    python benchmarks/bench_rope.py --quick    # small sizes
    python benchmarks/bench_rope.py --out DIR  # the json, md and png into DIR

q and k are [B, H, S, D] tensors stored in that order. Liger's kernel reads
them stored as a Hugging Face attention layer leaves them, [B, S, H, D]
transposed to [B, H, S, D] (any other order it copies first), and rotates them
in place; it gets the same values stored that way, with cos and sin
[1, S, D]. So that "× Liger" compares one layout, fusedllm is timed on those
strided views as well ("fusedllm, HF layout").
"""

from __future__ import annotations

import os
import sys

if not __package__:  # run as a file: import from the repository root, as `python -m` does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# harness before torch: with --thp it configures torch's allocator
from benchmarks.harness import (Benchmark, Roofline, agreement, dtype_name, forward_only,  # noqa: E402
                                interleaved_medians, liger, liger_notes, roofline_row, run)

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


def hf_layout(x):
    """x's values stored as [B, S, H, D], viewed as [B, H, S, D]: how a Hugging
    Face attention layer hands q and k to its rotary function."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def forward_backward_dense(fn, q, k):
    """A zero-argument callable running fn(q, k) and its backward with dense
    random gradients for both outputs (as inside a model; a `.sum()` loss would
    hand every candidate a broadcast gradient instead). The copies of q and k,
    and the gradients, keep q's and k's layout."""
    qr, kr = q.clone().requires_grad_(), k.clone().requires_grad_()
    gq, gk = torch.randn_like(q), torch.randn_like(k)

    def run():
        qr.grad = kr.grad = None
        torch.autograd.backward(fn(qr, kr), (gq, gk))
    return run


def bench_case(batch, hq, hkv, seq, dim, dtype, device, reps, with_compile, lk):
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
    peer = {}
    if lk is not None:
        # Liger's tables as a user passes them: [1, S, D] in q's dtype (Hugging Face's,
        # duplicated halves), read with broadcast over the batch.
        cos_one, sin_one = cos_full[:1].contiguous(), sin_full[:1].contiguous()
        rotate = lk.transformers.liger_rotary_pos_emb
        fns["liger"] = lambda a, b: rotate(a, b, cos_one, sin_one)
        fns["fused_hf"] = lambda a, b: fused(a, b)
        ql, kl = hf_layout(q), hf_layout(k)
        # forward and backward on copies: Liger rotates its inputs (and the gradients) in place
        gq, gk = torch.randn_like(q), torch.randn_like(k)

        def outputs_and_grads(fn):
            a, b = ql.clone().requires_grad_(), kl.clone().requires_grad_()
            qo, ko = fn(a, b)
            values = (qo.detach().clone(), ko.detach().clone())  # Liger's outputs are a and b themselves
            torch.autograd.backward((qo, ko), (hf_layout(gq), hf_layout(gk)))
            return values, (a.grad, b.grad)

        (of, gf), (ol, gl) = outputs_and_grads(fns["fused_hf"]), outputs_and_grads(fns["liger"])
        (out_diff, out_ok), (in_diff, in_ok) = agreement(of, ol), agreement(gf, gl)
        peer = dict(liger_diff=out_diff, liger_grad_diff=in_diff, liger_close=out_ok and in_ok)
    # the inputs each candidate is timed on: Liger and "fused_hf" in Hugging Face's layout
    inputs = {n: (ql, kl) if n in ("liger", "fused_hf") else (q, k) for n in fns}
    size = (q.numel() + k.numel()) * q.element_size()
    roofline = Roofline(size, device)
    for mode in ("forward", "forward+backward"):
        if mode == "forward":
            # Liger rotates ql and kl in place on every call: norms are kept, so the
            # values stay bounded over the repetitions
            candidates = {n: forward_only(f, *inputs[n]) for n, f in fns.items()}
            moved = 2 * size
        else:
            candidates = {n: forward_backward_dense(f, *inputs[n]) for n, f in fns.items()}
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
            liger_ms=times["liger"] * 1e3 if "liger" in times else None,
            fused_hf_ms=times["fused_hf"] * 1e3 if "fused_hf" in times else None,
            vs_notebook=times["notebook"] / t, vs_hf=times["hf"] / t,
            vs_compile=times["compile"] / t if "compile" in times else None,
            vs_liger=times["liger"] / times["fused_hf"] if "liger" in times else None,
            **roofline_row(moved, times, roofline.work),
            liger_gbps=moved / times["liger"] / 1e9 if "liger" in times else None,
            fused_hf_gbps=moved / times["fused_hf"] / 1e9 if "fused_hf" in times else None,
            in_place_ms=times["in_place"] * 1e3 if "in_place" in times else None,
            in_place_pct_copy=in_place.get("in_place_pct_copy"),
            max_abs_diff=max_diff, **peer)


COLUMNS = [
    ("case", "case", "s"),
    ("notebook_ms", "notebook ms", ".2f"),
    ("hf_ms", "HF ms", ".2f"),
    ("compile_ms", "compile ms", ".2f"),
    ("fused_ms", "fusedllm ms", ".2f"),
    ("liger_ms", "Liger ms (HF layout)", ".2f"),
    ("fused_hf_ms", "fusedllm ms (HF layout)", ".2f"),
    ("vs_notebook", "× notebook", ".2f"),
    ("vs_hf", "× HF", ".2f"),
    ("vs_compile", "× compile", ".2f"),
    ("vs_liger", "× Liger (HF layout)", ".2f"),
    ("fused_gbps", "fusedllm GB/s", ".1f"),
    ("fused_hf_gbps", "fusedllm GB/s (HF layout)", ".1f"),
    ("liger_gbps", "Liger GB/s", ".1f"),
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
    lk = liger(device, args)
    for dtype in (torch.float32, torch.bfloat16):
        yield from bench_case(*shape, dtype, device, reps, not args.no_compile, lk)


def describe(row):
    return (f"{row['case']:<34} fused {row['fused_ms']:8.2f} ms  x{row['vs_notebook']:.2f} notebook  "
            f"x{row['vs_hf']:.2f} HF  " + (f"x{row['vs_compile']:.2f} compile  " if row["vs_compile"] else "")
            + f"{row['fused_gbps']:.1f} GB/s ({row['pct_copy']:.0f}% of copy, {row['pct_clone']:.0f}% of clone)  "
            f"max|diff| {row['max_abs_diff']:.1e}"
            + (f"  HF layout: x{row['vs_liger']:.2f} Liger, fusedllm {row['fused_hf_gbps']:.1f} GB/s, "
               f"Liger {row['liger_gbps']:.1f} GB/s (max|diff| {row['liger_diff']:.1e}"
               f"{'' if row['liger_close'] else ' NOT CLOSE'})" if row.get("vs_liger") else ""))


def notes(rows):
    return liger_notes(rows, "liger_kernel.transformers.liger_rotary_pos_emb on q and k stored [B, S, H, D] "
                             "(viewed [B, H, S, D]) with cos and sin [1, S, D], rotating in place; "
                             "× Liger compares it with fusedllm on the same strided views",
                       ("liger_diff", "liger_grad_diff"))


BENCHMARK = Benchmark("rope", __doc__, cases, COLUMNS, "vs_notebook", "speedup over the notebook module",
                      describe=describe, notes=notes)


def main(argv=None):
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    main()
