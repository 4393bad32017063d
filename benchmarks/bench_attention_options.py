"""What attention's options cost, and what packing sequences without padding saves.

    python benchmarks/bench_attention_options.py            # S=2048; a 2-layer Llama on 8 sequences of 1 to 1000 tokens
    python benchmarks/bench_attention_options.py --quick    # S=256; 4 shorter sequences, fewer repetitions

(a) fusedllm.attention at B=1, Hq=16, Hkv=4, D=128, float32 and bfloat16, forward
    and forward+backward: the plain causal call against the same call with
    softcap=50 (Gemma 2's value), with attention sinks (one learned logit per
    head, its gradient included), with ALiBi slopes, with the window (S - 1, 0)
    without causal (the same keys as causal, through the (left, right) window's
    own bounds), and with all of them. The target is that an option costs at
    most 10% over the plain call ("overhead" column). "max |diff|" compares
    the last 16 rows of each call's output with the plain PyTorch path
    (fusedllm.functional.attention_with_weights, float32 or float64 inside),
    valid because masks align bottom-right.
(b) a training step (forward, cross-entropy over the next tokens within each
    sequence, backward, AdamW step) of a tiny Hugging Face LlamaForCausalLM
    (2 layers, hidden 256, 8 query / 2 kv heads) on one batch of sequences of
    mixed lengths, float32:
    - "fusedllm packed": the sequences concatenated in one row with position
      ids restarting at 0 per sequence, no attention mask: the "fusedllm"
      backend runs attention_varlen over the sequences (no padding anywhere);
    - "sdpa packed": the same row on transformers' "sdpa" backend, which
      separates the sequences with a block-diagonal mask;
    - "fusedllm padded" / "sdpa padded": one row per sequence, right-padded to
      the longest, with a padding attention mask.
    Every candidate starts from the same weights; "max |Δloss|" and "max |Δgrad|"
    compare its first loss and gradients with "sdpa padded"'s. tokens/s counts
    real tokens only. Peak memory: what torch allocates during one step above
    what was live before it (testkit.memory.peak_memory_bytes).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys

if not __package__:  # run as a file: import from the repository root, as `python -m` does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import Benchmark, dtype_name, interleaved_medians, run  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fusedllm  # noqa: E402
from fusedllm.functional import attention_with_weights  # noqa: E402
from testkit.memory import peak_memory_bytes  # noqa: E402

OVERHEAD_TARGET_PCT = 10.0


# --- (a) the options on the op ------------------------------------------------------------


def alibi_slopes(q_heads):
    """The ALiBi paper's geometric slopes 2^(-8 (h + 1) / q_heads)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / q_heads) for h in range(q_heads)])


def option_calls(seq, q_heads, device):
    """name -> keyword arguments of fusedllm.attention (sinks filled in per call)."""
    slopes = alibi_slopes(q_heads).to(device)
    return {
        "plain": dict(causal=True),
        "softcap": dict(causal=True, softcap=50.0),
        "sinks": dict(causal=True, sinks=True),
        "alibi": dict(causal=True, alibi_slopes=slopes),
        "window": dict(window=(seq - 1, 0)),
        "all": dict(causal=True, softcap=50.0, sinks=True, alibi_slopes=slopes),
    }


def bench_options(batch, q_heads, kv_heads, seq, head_dim, dtype, device, reps):
    torch.manual_seed(0)
    q = torch.randn(batch, q_heads, seq, head_dim, dtype=dtype, device=device)
    k = torch.randn(batch, kv_heads, seq, head_dim, dtype=dtype, device=device)
    v = torch.randn(batch, kv_heads, seq, head_dim, dtype=dtype, device=device)
    sinks = torch.randn(q_heads, device=device)
    grad_out = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    options = option_calls(seq, q_heads, device)

    def kwargs_of(name, sinks_tensor):
        kw = dict(options[name])
        if kw.pop("sinks", False):
            kw["sinks"] = sinks_tensor
        return kw

    # correctness of the timed calls, on the last rows
    diffs = {}
    tail = 16
    with torch.no_grad():
        for name in options:
            got = fusedllm.attention(q, k, v, **kwargs_of(name, sinks))[:, :, -tail:]
            expected, _ = attention_with_weights(q[:, :, -tail:], k, v, **kwargs_of(name, sinks))
            diffs[name] = (got.float() - expected.float()).abs().max().item()

    def forward(name):
        kw = kwargs_of(name, sinks)

        def call():
            with torch.no_grad():
                fusedllm.attention(q, k, v, **kw)
        return call

    def forward_backward(name):
        kw = kwargs_of(name, leaves[3])
        with_sinks = "sinks" in kw

        def call():
            for t in leaves:
                t.grad = None
            fusedllm.attention(*leaves[:3], **kw).backward(grad_out)
            if not with_sinks:
                leaves[3].grad = None
        return call

    rows = []
    for mode, wrap in (("fwd", forward), ("fwd+bwd", forward_backward)):
        calls = {name: wrap(name) for name in options}
        times = interleaved_medians(calls, device, reps, warmup=1)
        for name, seconds in times.items():
            overhead = 100.0 * (seconds / times["plain"] - 1.0)
            rows.append(dict(
                part="options", case=f"S={seq} {dtype_name(dtype)} {mode}: {name}", option=name, mode=mode,
                dtype=str(dtype), seq=seq,
                shape=dict(batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim),
                ms=seconds * 1e3, baseline="plain", baseline_ms=times["plain"] * 1e3,
                vs_baseline=seconds / times["plain"],
                overhead_pct=None if name == "plain" else overhead,
                within_target=None if name == "plain" else overhead <= OVERHEAD_TARGET_PCT,
                max_abs_diff=diffs[name],
            ))
    return rows


# --- (b) padding-free training of a tiny Llama ---------------------------------------------------


LLAMA = dict(vocab=2048, hidden=256, intermediate=688, layers=2, heads=8, kv_heads=2)
LENGTHS = [512, 37, 1000, 200, 5, 300, 64, 1]
QUICK_LENGTHS = [120, 7, 60, 31]


def llama(attn, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=LLAMA["vocab"], hidden_size=LLAMA["hidden"],
                         intermediate_size=LLAMA["intermediate"], num_hidden_layers=LLAMA["layers"],
                         num_attention_heads=LLAMA["heads"], num_key_value_heads=LLAMA["kv_heads"],
                         max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.set_attn_implementation(attn)
    return model


def packed_batch(sequences, device):
    """One row: the sequences concatenated, positions restarting at 0 per
    sequence; a sequence's first token is not predicted from the one before it
    (label -100), as DataCollatorWithFlattening writes it."""
    ids = torch.cat(sequences).unsqueeze(0).to(device)
    positions = torch.cat([torch.arange(len(s)) for s in sequences]).unsqueeze(0).to(device)
    labels = ids.clone()
    starts = torch.tensor([0] + [len(s) for s in sequences[:-1]]).cumsum(0)
    labels[0, starts.to(device)] = -100
    return dict(input_ids=ids, position_ids=positions, labels=labels)


def padded_batch(sequences, device):
    """One row per sequence, right-padded to the longest, with its padding mask."""
    longest = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    mask = torch.zeros(len(sequences), longest, dtype=torch.long)
    for row, s in enumerate(sequences):
        ids[row, :len(s)] = s
        mask[row, :len(s)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device))


def step_loss(model, batch):
    """Mean cross-entropy of every token predicted from the one before it in the
    same sequence (labels -100 predict nothing), the same set in either layout."""
    kwargs = {key: value for key, value in batch.items() if key != "labels"}
    logits = model(**kwargs, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1),
                           ignore_index=-100)


@contextlib.contextmanager
def quiet_stderr():
    """The profiler behind the CPU peak-memory measurement prints warnings on
    stderr; they are not results."""
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


@contextlib.contextmanager
def counting_varlen_calls():
    """Counts fusedllm.attention_varlen calls (the transformers backend looks it
    up on fusedllm.functional at each call) into the yielded one-item list."""
    import fusedllm.functional as functional

    original, count = functional.attention_varlen, [0]

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    functional.attention_varlen = counted
    try:
        yield count
    finally:
        functional.attention_varlen = original


def bench_training(lengths, device, reps):
    import fusedllm.hf  # noqa: F401  registers the "fusedllm" attention backend

    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, LLAMA["vocab"], (n,), generator=generator) for n in lengths]
    packed, padded = packed_batch(sequences, device), padded_batch(sequences, device)
    real_tokens = sum(lengths)
    candidates = {
        "fusedllm packed": ("fusedllm", packed),
        "sdpa packed": ("sdpa", packed),
        "fusedllm padded": ("fusedllm", padded),
        "sdpa padded": ("sdpa", padded),
    }
    models = {name: llama(attn).to(device) for name, (attn, _) in candidates.items()}

    # first loss and gradients from the same weights, against sdpa padded;
    # and whether each candidate's attention ran on attention_varlen
    first, varlen_calls = {}, {}
    for name, (_, batch) in candidates.items():
        with counting_varlen_calls() as calls:
            loss = step_loss(models[name], batch)
        varlen_calls[name] = calls[0]
        loss.backward()
        first[name] = (loss.item(), [p.grad.clone() for p in models[name].parameters()])
        models[name].zero_grad(set_to_none=True)
    base_loss, base_grads = first["sdpa padded"]

    def train_step(name):
        model, batch = models[name], candidates[name][1]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def call():
            step_loss(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return call

    calls = {name: train_step(name) for name in candidates}
    times = interleaved_medians(calls, device, reps, warmup=2)
    rows = []
    for name, (_, batch) in candidates.items():
        gc.collect()
        with quiet_stderr():
            peak = peak_memory_bytes(calls[name], device)
        loss, grads = first[name]
        rows.append(dict(
            part="training", case=f"Llama train step: {name}", candidate=name,
            lengths=list(lengths), tokens=real_tokens, row_tokens=batch["input_ids"].numel(),
            ms=times[name] * 1e3, baseline="sdpa padded", baseline_ms=times["sdpa padded"] * 1e3,
            vs_baseline=times[name] / times["sdpa padded"], tokens_per_s=real_tokens / times[name],
            peak_mb=peak / 2**20, loss=loss, varlen_attention_calls=varlen_calls[name], max_dloss=abs(loss - base_loss),
            max_dgrad=max((g - b).abs().max().item() for g, b in zip(grads, base_grads)),
        ))
    return rows


# --- table, plot, command line -----------------------------------------------------------


COLUMNS = [
    ("case", "case", "s"),
    ("ms", "ms", ".1f"),
    ("baseline", "against", "s"),
    ("vs_baseline", "time / theirs", ".2f"),
    ("overhead_pct", "overhead %", "+.1f"),
    ("tokens_per_s", "real tokens/s", ".0f"),
    ("row_tokens", "tokens incl. padding", "d"),
    ("peak_mb", "peak MB", ".0f"),
    ("max_abs_diff", "max |diff|", ".1e"),
    ("max_dloss", "max |Δloss|", ".1e"),
    ("max_dgrad", "max |Δgrad|", ".1e"),
    ("varlen_attention_calls", "varlen calls per forward", "d"),
]


def options(parser):
    parser.add_argument("--seq", type=int, default=None, help="sequence length of part (a)")
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    parser.add_argument("--lengths", type=int, nargs="*", default=None,
                        help="sequence lengths of part (b)'s batch")
    parser.add_argument("--skip-training", action="store_true", help="part (a) only")
    parser.add_argument("--skip-options", action="store_true", help="part (b) only")


def cases(args, device):
    if not args.skip_options:
        seq = args.seq or (256 if args.quick else 2048)
        for name in args.dtypes:
            reps = args.reps or (2 if args.quick else 7)
            yield from bench_options(1, 16, 4, seq, 128, getattr(torch, name), device, reps)
    if not args.skip_training:
        lengths = args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS)
        yield from bench_training(lengths, device, args.reps or (2 if args.quick else 5))


def describe(row):
    if row["part"] == "options":
        extra = "" if row["overhead_pct"] is None else f"   overhead {row['overhead_pct']:+6.1f}%"
        return f"{row['case']:<38} {row['ms']:9.1f} ms{extra}   max|diff| {row['max_abs_diff']:.1e}"
    return (f"{row['case']:<38} {row['ms']:9.1f} ms   x{row['vs_baseline']:.2f} sdpa padded   "
            f"{row['tokens_per_s']:.0f} tok/s   {row['peak_mb']:.0f} MB   |Δloss| {row['max_dloss']:.1e}   "
            f"|Δgrad| {row['max_dgrad']:.1e}")


def notes(rows):
    lines = []
    over = [r for r in rows if r["part"] == "options" and r["within_target"] is False]
    measured = [r for r in rows if r["part"] == "options" and r["within_target"] is not None]
    if measured:
        lines.append(f"options over the {OVERHEAD_TARGET_PCT:.0f}% target: "
                     + (", ".join(f"{r['case']} ({r['overhead_pct']:+.1f}%)" for r in over) or "none"))
    training = {r["candidate"]: r for r in rows if r["part"] == "training"}
    if "fusedllm packed" in training:
        packed, padded = training["fusedllm packed"], training["sdpa padded"]
        lines.append(f"training batch: lengths {packed['lengths']}, {packed['tokens']} real tokens; "
                     f"fusedllm packed takes {packed['ms'] / padded['ms']:.2f}x the time of sdpa padded "
                     f"({padded['row_tokens']} tokens with padding)")
    return lines


def plot(rows, path, machine):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    option_rows = [r for r in rows if r["part"] == "options" and r["overhead_pct"] is not None]
    training_rows = [r for r in rows if r["part"] == "training"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw=dict(width_ratios=[3, 1.3]))
    if option_rows:
        groups = list(dict.fromkeys(r["case"].split(":")[0] for r in option_rows))
        names = list(dict.fromkeys(r["option"] for r in option_rows))
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            by_group = {r["case"].split(":")[0]: r["overhead_pct"] for r in option_rows if r["option"] == name}
            axes[0].bar([g + i * width for g in range(len(groups))], [by_group.get(g, 0) for g in groups],
                        width, label=name)
        axes[0].axhline(OVERHEAD_TARGET_PCT, color="red", lw=1, ls="--", label=f"{OVERHEAD_TARGET_PCT:.0f}% target")
        axes[0].axhline(0, color="gray", lw=1)
        axes[0].set_xticks([g + width * (len(names) - 1) / 2 for g in range(len(groups))])
        axes[0].set_xticklabels(groups, fontsize=8)
        axes[0].set_ylabel("time over the plain causal call, % (lower is better)")
        axes[0].legend(fontsize=7)
    if training_rows:
        axes[1].bar(range(len(training_rows)), [r["ms"] for r in training_rows], color="#3b7dd8")
        axes[1].set_xticks(range(len(training_rows)))
        axes[1].set_xticklabels([r["candidate"] for r in training_rows], rotation=30, ha="right", fontsize=8)
        axes[1].set_ylabel("Llama training step, ms (lower is better)")
    fig.suptitle(f"attention options and padding-free training, {machine}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


BENCHMARK = Benchmark("attention_options", __doc__, cases, COLUMNS, "vs_baseline", "time over the baseline",
                      describe=describe, options=options, plot=plot, notes=notes)


def main(argv=None):
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    main()
