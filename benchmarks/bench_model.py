"""Whole models: a training step and greedy decoding, eager PyTorch against
torch.compile and fusedllm, for two model families of the same size.

    python benchmarks/bench_model.py           # hidden 512, 4 layers, 8 heads, 2 kv heads, batch 4 x 256 tokens
    python benchmarks/bench_model.py --quick   # hidden 256, 2 layers, batch 2 x 128, fewer repetitions
    OMP_NUM_THREADS=1 python benchmarks/bench_model.py   # one thread: steadier on a shared machine

    python benchmarks/bench_model.py --dtype bfloat16   # the same models in bfloat16 (results/model_bfloat16.*)

(a) notebook 003's LLaMA ("From GPT-2 to LLaMA"), in float32 (or --dtype):
    - "notebook eager": the plain-PyTorch classes of testkit/notebook_models.py
      (per-head attention loop, complex-number RoPE, unfused RMSNorm / SwiGLU);
    - "notebook compile": torch.compile of that model;
    - "fusedllm compat": fusedllm.compat.nb003.LLaMAModel loading the same
      state dict (fused RMSNorm with the residual add, packed SwiGLU, fused
      RoPE and attention);
    - "fusedllm patch": fusedllm.patch() of a copy of the eager model (norms,
      MLP and attention swapped; the block's residual adds stay eager);
    - "fusedllm compat, fused loss": the compat model computing its own loss
      (forward(ids, labels=ids): fusedllm.linear_cross_entropy, no logits).
(b) a Hugging Face LlamaForCausalLM of the same size: attention "eager",
    "sdpa", torch.compile of the sdpa model, fusedllm.patch() of the sdpa
    model (RMSNorms, gated MLPs and the "fusedllm" attention backend),
    torch.compile of that patched model, and "fusedllm patch, fused loss":
    patch(model, cross_entropy=True) trained as transformers trains, with
    model(ids, labels=ids).loss (no logits).
The other candidates' loss is F.cross_entropy over their logits, outside the
model. The fused-loss candidates do not decode (they are the same models).

Training step: forward on a [batch, seq] batch of token ids, cross-entropy
against the next tokens, backward, AdamW step, gradients set to None. All
candidates are timed in one process, interleaved, medians of the
repetitions. Peak memory: what torch allocates during one step above what
was live before it (testkit.memory.peak_memory_bytes; parameters, AdamW state and
the batch are already live). Every candidate starts from the same weights;
"max |Δlogits|" and "max |Δgrad|" compare its first forward / backward with
its family's eager model (the HF eager model for (b)).

Decode: greedy generation of `new` tokens after a `prompt`-token prompt,
batch 1, prefill included in the time; tokens/s = new / time. The notebook
model has no KV cache, so "notebook eager" and "notebook compile" run the
whole sequence again for every token, and so does "fusedllm compat". "fusedllm
compat + KVCache" decodes the compat model with fusedllm.nn.KVCache: each
layer's attention runs as fusedllm.nn.GQAttention holding that layer's
projections (see CachedLLaMA). The HF models decode with transformers'
DynamicCache. "tokens agree" compares the generated tokens with the family's
eager model.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import os
import sys
import time

if not __package__:  # run as a file: import from the repository root, as `python -m` does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import Benchmark, interleaved_medians, run  # noqa: E402
from testkit.hf import cache_keyword  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fusedllm  # noqa: E402
import fusedllm.compat.nb003 as compat  # noqa: E402
from testkit.memory import peak_memory_bytes  # noqa: E402
from testkit.notebook_models import nb003  # noqa: E402

FULL = dict(vocab=8192, hidden=512, intermediate=1408, layers=4, heads=8, kv_heads=2, batch=4, seq=256,
            prompt=64, new=32)
QUICK = dict(vocab=4096, hidden=256, intermediate=704, layers=2, heads=8, kv_heads=2, batch=2, seq=128,
             prompt=32, new=16)


# --- models ---------------------------------------------------------------------------

def notebook_config(size):
    cfg = nb003.LLaMAConfig()
    cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size = size["vocab"], size["hidden"], size["intermediate"]
    cfg.n_layers, cfg.n_heads, cfg.n_kv_heads = size["layers"], size["heads"], size["kv_heads"]
    cfg.head_dim = size["hidden"] // size["heads"]
    cfg.max_position_embeddings = 2048
    return cfg


def notebook_models(size, seed=0):
    """The eager notebook-003 model and fusedllm's compat model with its weights."""
    cfg = notebook_config(size)
    torch.manual_seed(seed)
    eager = nb003.LLaMAModel(cfg)
    fused = compat.LLaMAModel(compat.LLaMAConfig(**vars(cfg)))
    fused.load_state_dict(eager.state_dict())
    return eager, fused


def hf_model(size, attn, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=size["vocab"], hidden_size=size["hidden"],
                         intermediate_size=size["intermediate"], num_hidden_layers=size["layers"],
                         num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"],
                         max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.set_attn_implementation(attn)
    return model


class CachedLLaMA:
    """Greedy decoding of a fusedllm.compat.nb003.LLaMAModel with a KV cache.

    The compat model's forward takes no cache, so each layer's attention runs
    here as a fusedllm.nn.GQAttention that holds the layer's own q/k/v/o
    nn.Linear modules and an interleaved fusedllm.nn.RotaryEmbedding with the
    model's base (notebook 003 rotates pairs (2i, 2i + 1)); each layer keeps a
    fusedllm.nn.KVCache. Norms, the fused residual add and the MLP are the
    compat model's own modules, called as its blocks call them."""

    def __init__(self, model: compat.LLaMAModel):
        cfg = model.config
        self.model = model
        self.attention = []
        for layer in model.layers:
            old = layer.attention
            new = fusedllm.nn.GQAttention(cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, head_dim=cfg.head_dim,
                                          rope=False, device="meta")
            new.q_proj, new.k_proj, new.v_proj, new.o_proj = old.q_proj, old.k_proj, old.v_proj, old.o_proj
            new.rotary = fusedllm.nn.RotaryEmbedding(cfg.head_dim, max_positions=cfg.max_position_embeddings,
                                                     base=cfg.rope_theta, interleaved=True,
                                                     device=old.q_proj.weight.device)
            self.attention.append(new)

    def _last_logits(self, ids, caches):
        m = self.model
        h = m.token_embeddings(ids)
        for layer, attention, cache in zip(m.layers, self.attention, caches):
            normed, h = layer.ffn_norm(attention(layer.attention_norm(h), cache=cache), h)
            h = h + layer.feed_forward(normed)
        return m.lm_head(m.norm(h[:, -1:]))

    @torch.no_grad()
    def generate(self, ids, new):
        caches = fusedllm.nn.KVCache.layers(len(self.attention), capacity=ids.shape[1] + new)
        token = self._last_logits(ids, caches).argmax(-1)
        tokens = [token]
        for _ in range(new - 1):
            token = self._last_logits(token, caches).argmax(-1)
            tokens.append(token)
        return torch.cat(tokens, dim=1)


@torch.no_grad()
def generate_without_cache(forward, ids, new):
    """Greedy: the whole sequence through `forward` (ids -> logits) for every token."""
    tokens = []
    for _ in range(new):
        token = forward(ids)[:, -1:].argmax(-1)
        tokens.append(token)
        ids = torch.cat([ids, token], dim=1)
    return torch.cat(tokens, dim=1)


@torch.no_grad()
def generate_hf(model, ids, new):
    """Greedy with transformers' DynamicCache."""
    keyword = cache_keyword(model)
    out = model(ids, use_cache=True)
    token = out.logits[:, -1:].argmax(-1)
    tokens = [token]
    for _ in range(new - 1):
        out = model(token, use_cache=True, **{keyword: getattr(out, keyword)})
        token = out.logits[:, -1:].argmax(-1)
        tokens.append(token)
    return torch.cat(tokens, dim=1)


# --- candidates -------------------------------------------------------------------------

class Candidate:
    def __init__(self, family, name, model, logits_of, generate, base=None, loss_of=None):
        self.family, self.name = family, name
        self.loss_of = loss_of                    # (model, ids) -> loss without logits, or None
        self.model = model                        # what is called (maybe compiled)
        self.base = base if base is not None else model   # the nn.Module holding the parameters
        self.logits_of = logits_of                # (model, ids) -> logits [B, S, V]
        self.generate = generate                  # (ids, new) -> tokens [B, new], or None
        self.optimizer = torch.optim.AdamW(self.base.parameters(), lr=1e-4)
        self.row = dict(family=family, candidate=name, case=f"{family}: {name}")

    def loss(self, ids):
        if self.loss_of is not None:  # the model's own fused LM head + loss: no logits
            return None, self.loss_of(self.model, ids)
        logits = self.logits_of(self.model, ids)
        return logits, F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    def train_step(self, ids):
        def run():
            _, loss = self.loss(ids)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return run


def notebook_logits(model, ids):
    return model(ids)


def hf_logits(model, ids):
    return model(ids, use_cache=False).logits


def build_candidates(size, with_compile, dtype=torch.float32):
    eager, fused = notebook_models(size)
    eager.to(dtype)
    fused.to(dtype)
    patched = copy.deepcopy(eager)
    fusedllm.patch(patched)
    cached = CachedLLaMA(fused)
    out = [
        Candidate("notebook", "eager", eager, notebook_logits,
                  lambda ids, new: generate_without_cache(eager, ids, new)),
    ]
    if with_compile:
        # its own copy of the weights, so that each candidate trains its own parameters;
        # a second compiled wrapper, with dynamic shapes, decodes the growing sequences
        own = copy.deepcopy(eager)
        decode_compiled = torch.compile(own, dynamic=True)
        out.append(Candidate("notebook", "compile", torch.compile(own), notebook_logits,
                             lambda ids, new, m=decode_compiled: generate_without_cache(m, ids, new), base=own))
    out.append(Candidate("notebook", "fusedllm compat", fused, notebook_logits,
                         lambda ids, new: generate_without_cache(fused, ids, new)))
    out[-1].extra_generate = ("fusedllm compat + KVCache", cached.generate)
    out.append(Candidate("notebook", "fusedllm patch", patched, notebook_logits,
                         lambda ids, new: generate_without_cache(patched, ids, new)))
    # The compat model's own loss (labels=): fused LM head + cross-entropy, no logits.
    fused_loss = copy.deepcopy(fused)
    out.append(Candidate("notebook", "fusedllm compat, fused loss", fused_loss, notebook_logits, None,
                         loss_of=lambda model, ids: model(ids, labels=ids)))

    hf = {attn: hf_model(size, attn).to(dtype) for attn in ("eager", "sdpa")}
    out.append(Candidate("HF Llama", "eager", hf["eager"], hf_logits,
                         lambda ids, new: generate_hf(hf["eager"], ids, new)))
    out.append(Candidate("HF Llama", "sdpa", hf["sdpa"], hf_logits,
                         lambda ids, new: generate_hf(hf["sdpa"], ids, new)))
    if with_compile:
        own = hf_model(size, "sdpa").to(dtype)
        compiled = torch.compile(own)
        decode_compiled = torch.compile(own, dynamic=True)
        out.append(Candidate("HF Llama", "compile(sdpa)", compiled, hf_logits,
                             lambda ids, new, m=decode_compiled: generate_hf(m, ids, new), base=own))
    patched_hf = hf_model(size, "sdpa").to(dtype)
    fusedllm.patch(patched_hf)
    out.append(Candidate("HF Llama", "fusedllm patch", patched_hf, hf_logits,
                         lambda ids, new: generate_hf(patched_hf, ids, new)))
    # Trained the way transformers trains (labels=), with patch(cross_entropy=True).
    fused_loss_hf = hf_model(size, "sdpa").to(dtype)
    fusedllm.patch(fused_loss_hf, cross_entropy=True)
    out.append(Candidate("HF Llama", "fusedllm patch, fused loss", fused_loss_hf, hf_logits, None,
                         loss_of=lambda model, ids: model(ids, labels=ids, use_cache=False).loss))
    if with_compile:
        own = hf_model(size, "sdpa").to(dtype)
        fusedllm.patch(own)
        compiled = torch.compile(own)
        decode_compiled = torch.compile(own, dynamic=True)
        out.append(Candidate("HF Llama", "compile(fusedllm patch)", compiled, hf_logits,
                             lambda ids, new, m=decode_compiled: generate_hf(m, ids, new), base=own))
    return out


# --- measurements -----------------------------------------------------------------------

def check(candidates, ids):
    """First forward / backward of each candidate against its family's eager
    model; the first call of a compiled candidate is its compilation time."""
    reference = {}
    for c in candidates:
        t0 = time.perf_counter()
        logits, loss = c.loss(ids)
        loss.backward()
        first = time.perf_counter() - t0
        grads = {n: p.grad.detach().clone() for n, p in c.base.named_parameters()}
        c.optimizer.zero_grad(set_to_none=True)
        if logits is None:
            with torch.no_grad():
                logits = c.logits_of(c.model, ids)
        logits = logits.detach()
        if c.family not in reference:
            reference[c.family] = (logits, grads)
            c.row.update(max_dlogits=0.0, max_dgrad=0.0)
        else:
            ref_logits, ref_grads = reference[c.family]
            c.row["max_dlogits"] = (logits - ref_logits).abs().max().item()
            c.row["max_dgrad"] = max((grads[n] - g).abs().max().item() for n, g in ref_grads.items())
        if c.name.startswith("compile"):
            c.row["first_call_s"] = first
        print(f"  {c.row['case']:<32} loss {loss.item():.4f}   max|Δlogits| {c.row['max_dlogits']:.1e}   "
              f"max|Δgrad| {c.row['max_dgrad']:.1e}" + (f"   (first call, compiling: {first:.1f} s)"
                                                       if "first_call_s" in c.row else ""), flush=True)


def bench_decode(candidates, size, reps, device):
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, size["vocab"], (1, size["prompt"]), generator=generator).to(device)
    new = size["new"]
    calls, tokens, owner = {}, {}, {}
    for c in candidates:
        entries = [(c.name, c.generate)] if c.generate is not None else []
        if hasattr(c, "extra_generate"):
            entries.append(c.extra_generate)
        for name, gen in entries:
            key = f"{c.family}: {name}"

            def run(gen=gen, key=key):
                tokens[key] = gen(ids, new)
            calls[key] = run
            owner[key] = c
    first = {}
    for key, fn in calls.items():  # warm-up and, for compiled models, compilation
        t0 = time.perf_counter()
        fn()
        first[key] = time.perf_counter() - t0
        print(f"  {key:<40} first run {first[key]:6.1f} s", flush=True)
    times = interleaved_medians(calls, device, reps, warmup=0)
    rows = {}
    for key, t in times.items():
        c = owner[key]
        reference = tokens[f"{c.family}: eager"]
        rows[key] = dict(decode_tok_s=ids.shape[0] * new / t, decode_ms=t * 1e3,
                         tokens_agree=bool(torch.equal(tokens[key], reference)), decode_first_s=first[key])
    return rows


class quiet_stderr:
    """Send file descriptor 2 to /dev/null for a while: the CPU profiler behind
    peak_memory_bytes prints start / stop lines from C++ on every use."""

    def __enter__(self):
        sys.stderr.flush()
        self.saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)


def bench_train(candidates, ids, reps, device):
    calls = {c.row["case"]: c.train_step(ids) for c in candidates}
    times = interleaved_medians(calls, device, reps, warmup=2)
    for c in candidates:
        gc.collect()
        c.row["train_ms"] = times[c.row["case"]] * 1e3
        with quiet_stderr():
            c.row["peak_mb"] = peak_memory_bytes(calls[c.row["case"]], device) / 2**20


COLUMNS = [
    ("case", "model: candidate", "s"),
    ("train_ms", "train step ms", ".0f"),
    ("train_vs_notebook", "× notebook eager", ".2f"),
    ("train_vs_sdpa", "× HF sdpa", ".2f"),
    ("peak_mb", "peak MB", ".0f"),
    ("peak_vs_notebook", "peak / notebook eager", ".2f"),
    ("peak_vs_sdpa", "peak / HF sdpa", ".2f"),
    ("decode_tok_s", "decode tok/s", ".1f"),
    ("decode_vs_eager", "decode × family eager", ".2f"),
    ("tokens_agree", "tokens agree", ""),
    ("max_dlogits", "max |Δlogits|", ".1e"),
    ("max_dgrad", "max |Δgrad|", ".1e"),
]


def plot(rows, path, machine):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if r.get("train_ms")]
    decode = [r for r in rows if r.get("decode_tok_s")]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    panels = [(axes[0], train, "train_vs_notebook", "training step: speedup over notebook eager"),
              (axes[1], train, "train_vs_sdpa", "training step: speedup over HF sdpa"),
              (axes[2], decode, "decode_vs_eager", "greedy decode: tokens/s over the family's eager")]
    for ax, subset, key, label in panels:
        values = [r.get(key) or 0.0 for r in subset]
        colors = ["#d8843b" if "fusedllm" in r["case"] else "#3b7dd8" for r in subset]
        ax.bar(range(len(values)), values, color=colors)
        ax.axhline(1.0, color="gray", lw=1, ls="--")
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(values)))
        ax.set_xticklabels([r["case"] for r in subset], rotation=40, ha="right", fontsize=7)
        ax.set_title(label, fontsize=9)
    fig.suptitle(f"whole models, {rows[0]['dtype'] if rows else ''}, {machine}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def targets(rows):
    """Whether fusedllm meets the product's targets on the training step:
    in float32 against the eager models, in bfloat16 also against
    torch.compile of the eager model of the same family."""
    by = {r["case"]: r for r in rows}
    nb_eager, sdpa = by["notebook: eager"], by["HF Llama: sdpa"]
    lines = []
    if rows and rows[0].get("dtype") == "bfloat16":
        for case, ref, goal, ref_name in (("notebook: fusedllm compat", nb_eager, 1.3, "notebook eager"),
                                          ("notebook: fusedllm patch", nb_eager, 1.3, "notebook eager"),
                                          ("notebook: fusedllm compat, fused loss", nb_eager, 1.3,
                                           "notebook eager"),
                                          ("HF Llama: fusedllm patch", sdpa, 1.15, "HF sdpa"),
                                          ("HF Llama: fusedllm patch, fused loss", sdpa, 1.15, "HF sdpa")):
            r = by[case]
            speed = ref["train_ms"] / r["train_ms"]
            compiled = by.get(f"{r['family']}: " + ("compile" if r["family"] == "notebook" else "compile(sdpa)"))
            line = f"{case}: training step ×{speed:.2f} {ref_name} (target ≥ {goal})"
            met = speed >= goal
            if compiled is not None:
                vs = compiled["train_ms"] / r["train_ms"]
                line += f", ×{vs:.2f} {compiled['case']} (target ≥ 1)"
                met = met and vs >= 1.0
            lines.append(f"{line}: {'met' if met else 'NOT met'}")
        return lines
    for case, ref, goal, ref_name in (("notebook: fusedllm compat", nb_eager, 1.5, "notebook eager"),
                                      ("notebook: fusedllm patch", nb_eager, 1.5, "notebook eager"),
                                      ("HF Llama: fusedllm patch", sdpa, 1.2, "HF sdpa")):
        r = by[case]
        speed = ref["train_ms"] / r["train_ms"]
        memory = r["peak_mb"] / ref["peak_mb"]
        met = speed >= goal and memory < 1.0
        lines.append(f"{case}: training step ×{speed:.2f} {ref_name} (target ≥ {goal}), peak memory "
                     f"×{memory:.2f} of it (target < 1): {'met' if met else 'NOT met'}")
    return lines


def options(parser):
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the models' dtype (results/model_bfloat16.* for bfloat16)")


def cases(args, device):
    size = QUICK if args.quick else FULL
    reps = args.reps or (3 if args.quick else 7)
    dtype = getattr(torch, args.dtype)
    print(f"model: vocab {size['vocab']}, hidden {size['hidden']}, intermediate {size['intermediate']}, "
          f"{size['layers']} layers, {size['heads']} heads, {size['kv_heads']} kv heads; {args.dtype}; training batch "
          f"{size['batch']} x {size['seq']} tokens; decode batch 1, prompt {size['prompt']}, {size['new']} new tokens")
    with torch.device(device):
        candidates = build_candidates(size, not args.no_compile, dtype)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=generator).to(device)

    print("\nfirst forward + backward, against the family's eager model:")
    check(candidates, ids)

    print("\ngreedy decoding (not timed yet: warm-up, compiling) ...", flush=True)
    decode_rows = bench_decode(candidates, size, reps, device)
    for key, d in decode_rows.items():
        print(f"  {key:<40} {d['decode_tok_s']:8.1f} tok/s   tokens agree: {d['tokens_agree']}", flush=True)

    print("\ntraining steps ...", flush=True)
    bench_train(candidates, ids, reps, device)

    rows = []
    for c in candidates:
        c.row.update(decode_rows.get(c.row["case"], {}))
        rows.append(c.row)
        extra = getattr(c, "extra_generate", None)
        if extra:
            key = f"{c.family}: {extra[0]}"
            rows.append(dict(family=c.family, candidate=extra[0], case=key, **decode_rows[key]))
    by = {r["case"]: r for r in rows}
    nb_eager, sdpa = by["notebook: eager"], by["HF Llama: sdpa"]
    for r in rows:
        family_eager = by[f"{r['family']}: eager"]
        if "decode_tok_s" in r:
            r["decode_vs_eager"] = r["decode_tok_s"] / family_eager["decode_tok_s"]
        if r.get("train_ms"):
            r["train_vs_notebook"] = nb_eager["train_ms"] / r["train_ms"]
            r["train_vs_sdpa"] = sdpa["train_ms"] / r["train_ms"]
            r["peak_vs_notebook"] = r["peak_mb"] / nb_eager["peak_mb"]
            r["peak_vs_sdpa"] = r["peak_mb"] / sdpa["peak_mb"]
        r.update(size={k: v for k, v in size.items()}, reps=reps, dtype=args.dtype)
    print()
    yield from rows


BENCHMARK = Benchmark("model", __doc__, cases, COLUMNS, "train_vs_notebook",
                      "training step speedup over notebook eager", plot=plot, notes=targets,
                      options=options)


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    bfloat16 = "bfloat16" in [a.split("=")[-1] for a in args if a.startswith("--dtype")] or \
        any(a == "--dtype" and b == "bfloat16" for a, b in zip(args, args[1:]))
    return run(dataclasses.replace(BENCHMARK, name="model_bfloat16") if bfloat16 else BENCHMARK, argv)


if __name__ == "__main__":
    main()
