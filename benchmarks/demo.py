"""fusedllm in about a minute, on a tiny LLaMA built the way the notebook
notebooks/02_gpt2_to_llama ("From GPT-2 to LLaMA") builds it. Run with `make demo`.

1. The same weights in two models: the eager plain-PyTorch notebook model
   (testkit/notebook_models.py) and fusedllm.compat.gpt2_to_llama.LLaMAModel (fused
   RMSNorm with the residual add, SwiGLU, RoPE and attention). One batch
   through both, forward and backward: largest differences of the logits and
   of every parameter's gradient, and the time of a forward+backward step.
2. Greedy generation. The notebook model has no KV cache, so eager generation
   runs the whole sequence again for every new token. fusedllm decodes with
   fusedllm.nn.KVCache: each layer's attention as fusedllm.nn.GQAttention on
   the compat model's own projections (benchmarks/bench_model.py, CachedLLaMA).
   The compat model without a cache is timed too, to separate what the
   kernels give from what the cache gives.
3. Each fused op at the model's sizes against the notebook's eager code (and
   torch's own function where there is one), forward+backward.
4. A plot of the speedups: build/demo.png (untracked; --out PATH elsewhere).

Times are medians of interleaved repetitions (harness.interleaved_medians).
The demo runs torch on one thread unless OMP_NUM_THREADS is set: on a shared
machine whose other cores are busy, multi-threaded runs of these small ops
mostly measure waits for descheduled threads.
`make bench` runs the full tables, with torch.compile and Hugging Face models.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if not __package__:  # run as a file: import from the repository root, as `python -m` does
    sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fusedllm  # noqa: E402
from benchmarks.bench_attention import notebook_core  # noqa: E402
from benchmarks.bench_model import CachedLLaMA, generate_without_cache, notebook_models  # noqa: E402
from benchmarks.harness import interleaved_medians, machine_description  # noqa: E402
from testkit.notebook_models import rotate_pairs  # noqa: E402

SIZE = dict(vocab=1024, hidden=256, intermediate=704, layers=4, heads=8, kv_heads=2)
BATCH, SEQ = 4, 128            # training batch
PROMPT, NEW = 32, 48           # greedy generation, batch 1
REPS = 5


def max_diff(a, b):
    return (a.detach().float() - b.detach().float()).abs().max().item()


def header(device):
    info = fusedllm.build_info()
    print(f"fusedllm {fusedllm.__version__}: backend {fusedllm.backend()}, built against torch "
          f"{info.get('torch_version')}, CPU variants {info.get('cpu_isas')} "
          f"(running {info.get('cpu_isa_active')}), CUDA kernels "
          f"{'for ' + ','.join(info['cuda_archs']) if info.get('cuda') else 'not built'}")
    print(f"running on {machine_description(device)} (one unless OMP_NUM_THREADS is set), float32\n")


def model_step(eager, fused, device):
    """Forward + backward of a language-model loss, both models, same batch."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SIZE["vocab"], (BATCH, SEQ), generator=generator).to(device)

    def loss_of(model):
        logits = model(ids)
        return logits, F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    results = {}
    for name, model in (("eager", eager), ("fused", fused)):
        model.zero_grad(set_to_none=True)
        logits, loss = loss_of(model)
        loss.backward()
        results[name] = (logits.detach(), loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (le, loss_e, ge), (lf, loss_f, gf) = results["eager"], results["fused"]
    worst = max(ge, key=lambda n: max_diff(ge[n], gf[n]))
    print(f"1. forward + backward, batch {BATCH} x {SEQ} tokens, same weights, same batch")
    print(f"   loss eager {loss_e:.6f}, fused {loss_f:.6f}")
    print(f"   max |logits eager - fused|     {max_diff(le, lf):.2e}   (logits up to {le.abs().max().item():.2f})")
    print(f"   max |grad eager - fused|       {max_diff(ge[worst], gf[worst]):.2e}   (worst parameter: {worst}; "
          f"{len(ge)} parameters compared)")

    def step(model):
        def run():
            model.zero_grad(set_to_none=True)
            loss_of(model)[1].backward()
        return run

    times = interleaved_medians({"eager": step(eager), "fused": step(fused)}, device, REPS, warmup=1)
    speedup = times["eager"] / times["fused"]
    print(f"   step time eager {times['eager'] * 1e3:.1f} ms, fused {times['fused'] * 1e3:.1f} ms: "
          f"x{speedup:.2f}")
    eager.zero_grad(set_to_none=True)
    fused.zero_grad(set_to_none=True)
    return speedup


def generation(eager, fused, device):
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, SIZE["vocab"], (1, PROMPT), generator=generator).to(device)
    cached = CachedLLaMA(fused)
    tokens = {}
    runs = {
        "eager, no cache": lambda: generate_without_cache(eager, ids, NEW),
        "fused, no cache": lambda: generate_without_cache(fused, ids, NEW),
        "fused + KVCache": lambda: cached.generate(ids, NEW),
    }

    def keep(name, fn):
        def run():
            tokens[name] = fn()
        return run

    times = interleaved_medians({n: keep(n, f) for n, f in runs.items()}, device, 3, warmup=1)
    print(f"\n2. greedy generation, prompt {PROMPT} tokens, {NEW} new tokens (prefill included)")
    reference = tokens["eager, no cache"]
    speedups = {}
    for name, t in times.items():
        agree = torch.equal(tokens[name], reference)
        speedups[name] = times["eager, no cache"] / t
        print(f"   {name:<17} {NEW / t:7.1f} tokens/s   x{speedups[name]:5.2f}   "
              f"tokens agree with eager: {agree}" + ("" if agree else
                                                     f" (first difference at token "
                                                     f"{int((tokens[name] != reference).int().argmax())})"))
    return speedups


def per_op(eager, fused, device):
    """One layer's ops at the model's sizes, forward + backward."""
    cfg = eager.config
    torch.manual_seed(3)
    b, s, d, hd = BATCH, SEQ, cfg.hidden_size, cfg.head_dim
    x = torch.randn(b, s, d, device=device)
    q = torch.randn(b, cfg.n_heads, s, hd, device=device)
    k = torch.randn(b, cfg.n_kv_heads, s, hd, device=device)
    v = torch.randn(b, cfg.n_kv_heads, s, hd, device=device)
    cos, sin = fused.layers[0].attention.rope.tables(s, device)
    e_layer, f_layer = eager.layers[0], fused.layers[0]
    weight = e_layer.attention_norm.weight.detach()
    ops = {
        f"RMSNorm [{b}x{s}, {d}]": (x, {
            "eager": e_layer.attention_norm,
            "torch": lambda t: F.rms_norm(t, (d,), weight, cfg.norm_eps),
            "fused": f_layer.attention_norm,
        }),
        f"SwiGLU MLP {d}->{cfg.intermediate_size}->{d}": (x, {
            "eager": e_layer.feed_forward,
            "fused": f_layer.feed_forward,
        }),
        f"RoPE q {cfg.n_heads} + k {cfg.n_kv_heads} heads x {hd}": ((q, k), {
            "eager": lambda a, c: (rotate_pairs(a, cos, sin), rotate_pairs(c, cos, sin)),
            "fused": lambda a, c: fusedllm.apply_rope(a, c, cos, sin, interleaved=True),
        }),
        f"attention {cfg.n_heads}/{cfg.n_kv_heads} heads, S={s}": ((q, k, v), {
            "eager": notebook_core,
            "torch": lambda a, c, e: F.scaled_dot_product_attention(a, c, e, is_causal=True, enable_gqa=True),
            "fused": lambda a, c, e: fusedllm.attention(a, c, e, causal=True),
        }),
    }
    print(f"\n3. per op at the model's sizes, forward + backward (eager: the notebook's code; "
          f"torch: F.rms_norm, F.scaled_dot_product_attention)")
    speedups = {}
    for label, (inputs, fns) in ops.items():
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        leaves = {n: [t.clone().requires_grad_() for t in inputs] for n in fns}
        outs = {n: fn(*leaves[n]) for n, fn in fns.items()}
        outs = {n: o if isinstance(o, tuple) else (o,) for n, o in outs.items()}
        grads = [torch.randn_like(o) for o in outs["eager"]]
        for n, o in outs.items():
            torch.autograd.backward(list(o), grads)
        dy = max(max_diff(a, c) for a, c in zip(outs["eager"], outs["fused"]))
        dx = max(max_diff(a.grad, c.grad) for a, c in zip(leaves["eager"], leaves["fused"]))

        def run(n):
            def go():
                for t in leaves[n]:
                    t.grad = None
                o = fns[n](*leaves[n])
                torch.autograd.backward(list(o) if isinstance(o, tuple) else [o], grads)
            return go

        times = interleaved_medians({n: run(n) for n in fns}, device, 7, warmup=2, min_seconds=0.5)
        speedups[label] = times["eager"] / times["fused"]
        torch_text = (f", torch {times['torch'] * 1e3:6.2f} ms (fused x{times['torch'] / times['fused']:.2f})"
                      if "torch" in times else "")
        print(f"   {label:<34} eager {times['eager'] * 1e3:6.2f} ms, fused {times['fused'] * 1e3:6.2f} ms: "
              f"x{speedups[label]:5.2f}{torch_text}   max|dy| {dy:.1e} max|dx| {dx:.1e}")
    for mod in (e_layer, f_layer):
        mod.zero_grad(set_to_none=True)
    return speedups


def plot(ops, step, gen, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [*ops, "model: forward+backward", *(f"generation: {n}" for n in gen if n != "eager, no cache")]
    values = [*ops.values(), step, *(v for n, v in gen.items() if n != "eager, no cache")]
    colors = ["#3b7dd8"] * len(ops) + ["#d8843b"] * (len(values) - len(ops))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.barh(range(len(values)), values, color=colors)
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(color="#3b7dd8", label="single ops, at the model's sizes"),
                       Patch(color="#d8843b", label="whole model: training step, generation")],
              loc="best", fontsize=8, framealpha=0.9)
    ax.axvline(1.0, color="gray", lw=1, ls="--")
    for i, value in enumerate(values):
        ax.text(value, i, f" x{value:.2f}", va="center", fontsize=8)
    ax.set_yticks(range(len(values)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("speedup over the eager notebook code (> 1 is faster)")
    h = SIZE
    ax.set_title(f"fusedllm vs eager, tiny LLaMA of notebooks/02_gpt2_to_llama (hidden {h['hidden']}, {h['layers']} layers, "
                 f"{h['heads']}/{h['kv_heads']} heads), float32, CPU", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description="fusedllm demo on the tiny LLaMA of notebooks/02_gpt2_to_llama")
    parser.add_argument("--out", default=os.path.join(HERE, "..", "build", "demo.png"),
                        help="where the plot goes (default: build/demo.png)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    header(device)
    with torch.device(device):
        eager, fused = notebook_models(SIZE)
    cfg = eager.config
    params = sum(p.numel() for p in eager.parameters())
    print(f"tiny LLaMA (the design of notebooks/02_gpt2_to_llama): vocab {cfg.vocab_size}, hidden {cfg.hidden_size}, "
          f"intermediate {cfg.intermediate_size}, {cfg.n_layers} layers, {cfg.n_heads} heads / "
          f"{cfg.n_kv_heads} kv heads of {cfg.head_dim}; {params / 1e6:.1f} M parameters")
    print("eager: the notebook's plain-PyTorch classes; fused: fusedllm.compat.gpt2_to_llama.LLaMAModel, "
          "same state dict\n")
    step = model_step(eager, fused, device)
    gen = generation(eager, fused, device)
    ops = per_op(eager, fused, device)
    path = args.out
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    plot(ops, step, gen, path)
    print(f"\nwrote {os.path.relpath(path)}")
    print("full tables: `make bench` (benchmarks/bench_model.py: training step with AdamW, peak memory, "
          "torch.compile and Hugging Face Llama)")


if __name__ == "__main__":
    main()
