"""Fused linear cross-entropy: the LM head and the loss, forward+backward, against
eager `F.cross_entropy(F.linear(h, W), t)` and torch.compile of it; time and
peak memory of the whole step, gradients of hidden and weight included (the
logits, their softmax and gradient are what the fused op never builds).

    python benchmarks/bench_cross_entropy.py            # tables -> benchmarks/results/
    python benchmarks/bench_cross_entropy.py --quick    # small sizes
    python benchmarks/bench_cross_entropy.py --tokens 4096 16384 --vocab 32000 128256
"""

from __future__ import annotations

import os
import sys

if not __package__:  # run as a file: import from the repository root, as `python -m` does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import Benchmark, dtype_name, forward_backward, interleaved_medians, run  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fusedllm  # noqa: E402
from testkit.memory import peak_memory_bytes  # noqa: E402


def eager_loss(h, w, t):
    return F.cross_entropy(F.linear(h, w), t)


def fused_loss(h, w, t):
    return fusedllm.linear_cross_entropy(h, w, t)


def bench_case(tokens, hidden, vocab, dtype, device, reps, with_compile):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * hidden ** -0.5).to(device=device, dtype=dtype)
    w.requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    t[::7] = -100
    fns = {"eager": eager_loss, "fusedllm": fused_loss}
    if with_compile:
        fns["compile"] = torch.compile(eager_loss, fullgraph=True)
    grad = torch.ones((), dtype=dtype, device=device)
    with torch.no_grad():
        diff = abs(eager_loss(h, w, t).float().item() - fused_loss(h, w, t).float().item())
    candidates = {k: forward_backward(lambda h_, w_, f=f: f(h_, w_, t), [h, w], grad)
                  for k, f in fns.items()}
    times = interleaved_medians(candidates, device, reps, warmup=1)
    peaks = {}
    for k, fn in candidates.items():
        h.grad = w.grad = None  # the peak of a step, not net of the last step's gradients
        peaks[k] = peak_memory_bytes(fn, device)
    flops = 3 * 2 * tokens * hidden * vocab  # logits, grad hidden, grad weight
    t_f = times["fusedllm"]
    return dict(
        case=f"{tokens}x{hidden}->{vocab} {dtype_name(dtype)} fwd+bwd", dtype=str(dtype),
        tokens=tokens, hidden=hidden, vocab=vocab,
        eager_ms=times["eager"] * 1e3, compile_ms=times["compile"] * 1e3 if "compile" in times else None,
        fused_ms=t_f * 1e3, vs_eager=times["eager"] / t_f,
        vs_compile=times["compile"] / t_f if "compile" in times else None,
        fused_gflops=flops / t_f / 1e9,
        eager_peak_mb=peaks["eager"] / 2**20, fused_peak_mb=peaks["fusedllm"] / 2**20,
        compile_peak_mb=peaks["compile"] / 2**20 if "compile" in peaks else None,
        peak_vs_eager=peaks["fusedllm"] / peaks["eager"],
        loss_abs_diff=diff)


def options(parser):
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument("--vocab", type=int, nargs="+", default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])


def cases(args, device):
    if args.quick:
        tokens, vocab, hidden, reps = [512], [8000], 256, args.reps or 5
    else:
        tokens, vocab, hidden, reps = [4096], [32000], 2048, args.reps or 3
    tokens = args.tokens or tokens
    vocab = args.vocab or vocab
    hidden = args.hidden or hidden
    for dtype in (getattr(torch, d) for d in args.dtypes):
        for n in tokens:
            for v in vocab:
                yield bench_case(n, hidden, v, dtype, device, reps, not args.no_compile)


def describe(row):
    return (f"{row['case']:<36} fused {row['fused_ms']:9.1f} ms  x{row['vs_eager']:.2f} eager  "
            + (f"x{row['vs_compile']:.2f} compile  " if row["vs_compile"] else "")
            + f"peak MiB eager {row['eager_peak_mb']:.0f} fused {row['fused_peak_mb']:.0f} "
            + f"({100 * row['peak_vs_eager']:.0f}%)"
            + (f" compile {row['compile_peak_mb']:.0f}" if row["compile_peak_mb"] is not None else ""))


COLUMNS = [
    ("case", "case", "s"),
    ("eager_ms", "eager ms", ".0f"),
    ("compile_ms", "compile ms", ".0f"),
    ("fused_ms", "fusedllm ms", ".0f"),
    ("vs_eager", "× eager", ".2f"),
    ("vs_compile", "× compile", ".2f"),
    ("fused_gflops", "fusedllm GFLOP/s", ".0f"),
    ("eager_peak_mb", "eager peak MiB", ".0f"),
    ("compile_peak_mb", "compile peak MiB", ".0f"),
    ("fused_peak_mb", "fusedllm peak MiB", ".0f"),
    ("peak_vs_eager", "peak / eager", ".2f"),
]

BENCH = Benchmark(name="cross_entropy", doc=__doc__, cases=cases, columns=COLUMNS,
                  plot_key="vs_eager", plot_label="speed-up over eager (fwd+bwd)",
                  describe=describe, options=options)

if __name__ == "__main__":
    run(BENCH)
