"""Fused linear cross-entropy: the LM head and the loss, forward+backward, against
eager `F.cross_entropy(F.linear(h, W), t)` and torch.compile of it; time and
peak memory of the whole step, gradients of hidden and weight included (the
logits, their softmax and gradient are what the fused op never builds).

    python benchmarks/bench_cross_entropy.py            # tables -> benchmarks/results/
    python benchmarks/bench_cross_entropy.py --quick    # small sizes
    python benchmarks/bench_cross_entropy.py --tokens 4096 16384 --vocab 32000 128256
    python benchmarks/bench_cross_entropy.py --out DIR  # the json, md and png into DIR

The model rows time a training step (forward with labels, backward) of a small
Hugging Face Llama (4 layers, hidden 512, vocabulary 32000), unpatched against
`fusedllm.patch(model, cross_entropy=True)` (the loss only: no other module
swapped).

On a GPU where Liger-Kernel is installed, its LigerFusedLinearCrossEntropyLoss
(default options) is timed beside them, and in the model rows its
`apply_liger_kernel_to_llama(model=..., fused_linear_cross_entropy=True)` with
every other kernel off.
"""

from __future__ import annotations

import os
import sys

if not __package__:  # run as a file: import from the repository root, as `python -m` does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import (Benchmark, dtype_name, forward_backward, interleaved_medians, liger,  # noqa: E402
                                liger_notes, run)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fusedllm  # noqa: E402
from testkit.memory import peak_memory_bytes  # noqa: E402


def eager_loss(h, w, t):
    return F.cross_entropy(F.linear(h, w), t)


def fused_loss(h, w, t):
    return fusedllm.linear_cross_entropy(h, w, t)


def liger_relative_tolerance(dtype) -> float:
    """How far Liger's loss may sit from fusedllm's, relative to the loss (loose:
    a wrong reduction or ignore_index is off by far more)."""
    return 1e-4 if dtype == torch.float32 else 2e-2


def bench_case(tokens, hidden, vocab, dtype, device, reps, with_compile, lk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * hidden ** -0.5).to(device=device, dtype=dtype)
    w.requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    t[::7] = -100
    fns = {"eager": eager_loss, "fusedllm": fused_loss}
    if with_compile:
        torch._dynamo.reset()  # a fresh compilation per case: each shape and dtype is its own graph
        fns["compile"] = torch.compile(eager_loss, fullgraph=True)
    if lk is not None:
        liger_module = lk.transformers.LigerFusedLinearCrossEntropyLoss()  # ignore_index -100, mean
        fns["liger"] = lambda h_, w_, t_: liger_module(w_, h_, t_)  # (weight, hidden, target)
    grad = torch.ones((), dtype=dtype, device=device)
    with torch.no_grad():
        fused_value = fused_loss(h, w, t).float().item()
        diff = abs(eager_loss(h, w, t).float().item() - fused_value)
    peer = {}
    if "liger" in fns:
        # Liger computes the gradients inside its forward: on copies, outside no_grad
        liger_value = fns["liger"](h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_(),
                                   t).float().item()
        peer["liger_diff"] = abs(liger_value - fused_value)
        peer["liger_close"] = peer["liger_diff"] <= liger_relative_tolerance(dtype) * max(1.0, abs(fused_value))
    # Liger's loss is float32 whatever the inputs' dtype: a gradient of its own dtype, as .backward() gives
    grads = {k: torch.ones((), dtype=torch.float32, device=device) if k == "liger" else grad for k in fns}
    candidates = {k: forward_backward(lambda h_, w_, f=f: f(h_, w_, t), [h, w], grads[k])
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
        liger_ms=times["liger"] * 1e3 if "liger" in times else None,
        fused_ms=t_f * 1e3, vs_eager=times["eager"] / t_f,
        vs_compile=times["compile"] / t_f if "compile" in times else None,
        vs_liger=times["liger"] / t_f if "liger" in times else None,
        fused_gflops=flops / t_f / 1e9,
        liger_gflops=flops / times["liger"] / 1e9 if "liger" in times else None,
        eager_peak_mb=peaks["eager"] / 2**20, fused_peak_mb=peaks["fusedllm"] / 2**20,
        compile_peak_mb=peaks["compile"] / 2**20 if "compile" in peaks else None,
        liger_peak_mb=peaks["liger"] / 2**20 if "liger" in peaks else None,
        peak_vs_eager=peaks["fusedllm"] / peaks["eager"],
        peak_vs_liger=peaks["fusedllm"] / peaks["liger"] if "liger" in peaks else None,
        loss_abs_diff=diff, **peer)


def bench_model(tokens_per_seq, batch, dtype, device, reps, lk):
    """A training step (forward with labels, backward) of a small Hugging Face
    Llama with a 32k vocabulary, unpatched against patch(cross_entropy=True)
    (and Liger's fused linear cross-entropy patched into a third copy)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408,
                                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                      max_position_embeddings=tokens_per_seq)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).train()
    fused = transformers.AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).train()
    fused.load_state_dict(eager.state_dict())
    fusedllm.patch(fused, cross_entropy=True, rms_norm=False, swiglu=False, rope=False, attention=False,
                   parallel=False)
    ids = torch.randint(0, 32000, (batch, tokens_per_seq), device=device)

    def step(model):
        def run():
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
        return run

    candidates = {"eager": step(eager), "fusedllm": step(fused)}
    models = [eager, fused]
    with torch.no_grad():
        fused_value = fused(input_ids=ids, labels=ids).loss.item()
        diff = abs(eager(input_ids=ids, labels=ids).loss.item() - fused_value)
    peer = {}
    if lk is not None:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        peer_model = transformers.AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).train()
        peer_model.load_state_dict(eager.state_dict())
        # the loss only, on this instance (model=...: the class and the other copies stay as they are)
        apply_liger_kernel_to_llama(rope=False, cross_entropy=False, fused_linear_cross_entropy=True,
                                    rms_norm=False, swiglu=False, model=peer_model)
        try:
            # Liger computes the gradients inside its forward: not under no_grad
            liger_value = peer_model(input_ids=ids, labels=ids).loss.item()
            peer_model.zero_grad(set_to_none=True)
        except Exception as exc:  # its patched forward against this transformers version
            print(f"  Liger-Kernel's patched Llama forward failed, left out of the model row: "
                  f"{type(exc).__name__}: {exc}", flush=True)
        else:
            candidates["liger"] = step(peer_model)
            models.append(peer_model)
            peer["liger_diff"] = abs(liger_value - fused_value)
            peer["liger_close"] = peer["liger_diff"] <= liger_relative_tolerance(dtype) * max(1.0, abs(fused_value))
    times = interleaved_medians(candidates, device, reps, warmup=1)
    peaks = {}
    for k, fn in candidates.items():
        for m in models:
            m.zero_grad(set_to_none=True)
        peaks[k] = peak_memory_bytes(fn, device)
    t_f = times["fusedllm"]
    return dict(
        case=f"HF Llama step {batch}x{tokens_per_seq}, V=32000 {dtype_name(dtype)}", dtype=str(dtype),
        tokens=batch * tokens_per_seq, hidden=512, vocab=32000,
        eager_ms=times["eager"] * 1e3, compile_ms=None, fused_ms=t_f * 1e3, vs_eager=times["eager"] / t_f,
        liger_ms=times["liger"] * 1e3 if "liger" in times else None,
        vs_liger=times["liger"] / t_f if "liger" in times else None,
        vs_compile=None, fused_gflops=None,
        eager_peak_mb=peaks["eager"] / 2**20, fused_peak_mb=peaks["fusedllm"] / 2**20, compile_peak_mb=None,
        liger_peak_mb=peaks["liger"] / 2**20 if "liger" in peaks else None,
        peak_vs_eager=peaks["fusedllm"] / peaks["eager"],
        peak_vs_liger=peaks["fusedllm"] / peaks["liger"] if "liger" in peaks else None,
        loss_abs_diff=diff, **peer)


def options(parser):
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument("--vocab", type=int, nargs="+", default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--no-model", action="store_true", help="skip the Hugging Face model step")


# (tokens, vocab, dtype) by default: on a 2-core CPU an eager float32 step at
# 16384 tokens takes about a minute, and at 16384 tokens and a 128k vocabulary
# its float32 logits alone outgrow 24 GiB; --tokens / --vocab / --dtypes run
# the full grid.
DEFAULT_CASES = [(4096, 32000, "float32"), (4096, 32000, "bfloat16"), (16384, 32000, "bfloat16"),
                 (4096, 128256, "bfloat16")]


def cases(args, device):
    hidden = args.hidden or (256 if args.quick else 2048)
    reps = args.reps or (5 if args.quick else 3)
    lk = liger(device, args)
    if args.quick:
        grid = [(512, 8000, d) for d in args.dtypes]
    elif args.tokens or args.vocab:
        grid = [(n, v, d) for d in args.dtypes for n in args.tokens or [4096] for v in args.vocab or [32000]]
    else:
        grid = DEFAULT_CASES
    for n, v, d in grid:
        yield bench_case(n, hidden, v, getattr(torch, d), device, reps, not args.no_compile, lk)
    if not args.no_model:
        for dtype in (getattr(torch, d) for d in args.dtypes):
            yield bench_model(128 if args.quick else 512, 2 if args.quick else 4, dtype, device,
                              args.reps or 5, lk)


def describe(row):
    return (f"{row['case']:<44} fused {row['fused_ms']:9.1f} ms  x{row['vs_eager']:.2f} eager  "
            + (f"x{row['vs_compile']:.2f} compile  " if row["vs_compile"] else "")
            + f"peak MiB eager {row['eager_peak_mb']:.0f} fused {row['fused_peak_mb']:.0f} "
            + f"({100 * row['peak_vs_eager']:.0f}%)"
            + (f" compile {row['compile_peak_mb']:.0f}" if row["compile_peak_mb"] is not None else "")
            + (f"  x{row['vs_liger']:.2f} Liger, Liger peak {row['liger_peak_mb']:.0f} MiB "
               f"(|loss diff| {row['liger_diff']:.1e}{'' if row['liger_close'] else ' NOT CLOSE'})"
               if row.get("vs_liger") else ""))


COLUMNS = [
    ("case", "case", "s"),
    ("eager_ms", "eager ms", ".0f"),
    ("compile_ms", "compile ms", ".0f"),
    ("liger_ms", "Liger ms", ".1f"),
    ("fused_ms", "fusedllm ms", ".0f"),
    ("vs_eager", "× eager", ".2f"),
    ("vs_compile", "× compile", ".2f"),
    ("vs_liger", "× Liger", ".2f"),
    ("fused_gflops", "fusedllm GFLOP/s", ".0f"),
    ("liger_gflops", "Liger GFLOP/s", ".0f"),
    ("eager_peak_mb", "eager peak MiB", ".0f"),
    ("compile_peak_mb", "compile peak MiB", ".0f"),
    ("liger_peak_mb", "Liger peak MiB", ".0f"),
    ("fused_peak_mb", "fusedllm peak MiB", ".0f"),
    ("peak_vs_eager", "peak / eager", ".2f"),
    ("peak_vs_liger", "peak / Liger", ".2f"),
]


def notes(rows):
    return liger_notes(rows, "liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss with its defaults "
                             "(ignore_index -100, mean; in bfloat16 its accum_dtype None keeps the weight "
                             "gradient in bfloat16); in the model rows apply_liger_kernel_to_llama(model=..., "
                             "fused_linear_cross_entropy=True) with every other kernel off",
                       ("liger_diff",))


BENCH = Benchmark(name="cross_entropy", doc=__doc__, cases=cases, columns=COLUMNS,
                  plot_key="vs_eager", plot_label="speed-up over eager (fwd+bwd)",
                  describe=describe, options=options, notes=notes)

if __name__ == "__main__":
    run(BENCH)
