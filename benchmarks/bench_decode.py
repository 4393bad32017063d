"""A tiny Hugging Face Llama with each attention backend: "eager", "sdpa" and
"fusedllm" (fusedllm.hf). Only the attention function differs; the model,
its weights and the KV cache (transformers' DynamicCache) are the same.

    python benchmarks/bench_decode.py           # hidden 256, 4 layers, 8 heads, 2 kv heads, vocab 1000
    python benchmarks/bench_decode.py --quick   # shorter prompts and prefill, fewer repetitions
    OMP_NUM_THREADS=1 python benchmarks/bench_decode.py   # one thread: steadier on a shared machine

On a machine whose other core is busy, two-thread runs of these small
decoding ops mostly measure waits for the descheduled thread.

Decode: prefill a prompt (not timed), then time greedy decoding of
`new` tokens one at a time with the cache; tokens/s = batch * new / time. The
batch-4 case is left-padded, so every step carries a padding mask. Prefill: one
forward of a left-padded batch (4 sequences of 512 positions, 0/64/128/192 pad
tokens) with its attention mask, and the peak memory torch allocates during it.
Candidates run interleaved, medians of the repetitions. "tokens agree" checks
that the three backends decode the same greedy tokens.
"""

from __future__ import annotations

import copy
import gc
import os
import sys

if not __package__:  # run as a file: import from the repository root, as `python -m` does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import Benchmark, interleaved_medians, run, time_once  # noqa: E402
from testkit.hf import cache_keyword  # noqa: E402

import torch  # noqa: E402

import fusedllm  # noqa: E402,F401  (registers "fusedllm" with transformers once its models load)
from testkit.memory import peak_memory_bytes  # noqa: E402

BACKENDS = ("eager", "sdpa", "fusedllm")


def tiny_llama(device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096)
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    models = {}
    for name in BACKENDS:
        model = copy.deepcopy(base)  # same weights, own config
        model.set_attn_implementation(name)
        models[name] = model
    return models


def left_padded_batch(batch, seq, pads, device):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 1000, (batch, seq), generator=generator).to(device)
    mask = torch.ones(batch, seq, dtype=torch.long, device=device)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids, mask


def positions(mask):
    # what generate() does: count real tokens, pads sit at position 0
    return (mask.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def prefill(model, ids, mask):
    out = model(ids, attention_mask=mask, position_ids=positions(mask), use_cache=True)
    return getattr(out, cache_keyword(model)), out.logits[:, -1:].argmax(-1), mask, positions(mask)[:, -1:]


@torch.no_grad()
def decode(model, state, new_tokens):
    past, token, mask, last_pos = state
    keyword = cache_keyword(model)
    tokens = [token]
    for _ in range(new_tokens):
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        last_pos = last_pos + 1
        out = model(token, attention_mask=mask, position_ids=last_pos, use_cache=True, **{keyword: past})
        past = getattr(out, keyword)
        token = out.logits[:, -1:].argmax(-1)
        tokens.append(token)
    return torch.cat(tokens, dim=1)


def bench_decode(models, batch, prompt, pads, new_tokens, reps, device):
    ids, mask = left_padded_batch(batch, prompt, pads, device)
    for model in models.values():  # warm-up
        decode(model, prefill(model, ids, mask), 2)
    samples = {name: [] for name in models}
    tokens = {}
    for _ in range(reps):
        for name, model in models.items():
            state = prefill(model, ids, mask)

            def run(model=model, state=state, name=name):
                tokens[name] = decode(model, state, new_tokens)

            samples[name].append(time_once(run, device))
    times = {name: sorted(s)[len(s) // 2] for name, s in samples.items()}
    agree = all(torch.equal(tokens[name], tokens["eager"]) for name in models)
    case = f"decode B={batch} prompt={prompt}" + (" padded" if any(pads) else "") + f" +{new_tokens}"
    row = dict(case=case, kind="decode", batch=batch, prompt=prompt, pads=list(pads), new_tokens=new_tokens,
               tokens_agree=agree, reps=reps)
    for name, t in times.items():
        row[f"{name}_ms"] = t * 1e3 / new_tokens  # per decoding step
        row[f"{name}_tok_s"] = batch * new_tokens / t
    for name in ("eager", "sdpa"):
        row[f"vs_{name}"] = times[name] / times["fusedllm"]
    return row


def bench_prefill(models, batch, seq, pads, reps, device):
    ids, mask = left_padded_batch(batch, seq, pads, device)
    pos = positions(mask)

    def forward(model):
        def run():
            with torch.no_grad():
                return model(ids, attention_mask=mask, position_ids=pos, use_cache=True).logits
        return run

    calls = {name: forward(model) for name, model in models.items()}
    logits = {name: fn() for name, fn in calls.items()}
    real = mask.bool()
    max_diff = max((logits[n][real] - logits["eager"][real]).abs().max().item() for n in models)
    times = interleaved_medians(calls, device, reps, warmup=1)
    row = dict(case=f"prefill B={batch} S={seq} padded", kind="prefill", batch=batch, prompt=seq,
               pads=list(pads), max_abs_diff_vs_eager=max_diff, reps=reps)
    for name, fn in calls.items():
        gc.collect()
        row[f"{name}_ms"] = times[name] * 1e3
        row[f"{name}_tok_s"] = int(real.sum()) / times[name]
        row[f"{name}_mb"] = peak_memory_bytes(fn, device) / 2**20
    for name in ("eager", "sdpa"):
        row[f"vs_{name}"] = times[name] / times["fusedllm"]
    return row


COLUMNS = [
    ("case", "case", "s"),
    ("eager_ms", "eager ms", ".2f"),
    ("sdpa_ms", "SDPA ms", ".2f"),
    ("fusedllm_ms", "fusedllm ms", ".2f"),
    ("eager_tok_s", "eager tok/s", ".0f"),
    ("sdpa_tok_s", "SDPA tok/s", ".0f"),
    ("fusedllm_tok_s", "fusedllm tok/s", ".0f"),
    ("vs_eager", "× eager", ".2f"),
    ("vs_sdpa", "× SDPA", ".2f"),
    ("eager_mb", "eager peak MB", ".0f"),
    ("sdpa_mb", "SDPA peak MB", ".0f"),
    ("fusedllm_mb", "fusedllm peak MB", ".0f"),
    ("tokens_agree", "tokens agree", ""),
]


def cases(args, device):
    models = tiny_llama(device, torch.float32)
    if args.quick:
        decode_cases = [(1, 64, (0,), 16), (4, 64, (0, 8, 16, 24), 16)]
        prefill_case = (4, 128, (0, 16, 32, 48))
    else:
        decode_cases = [(1, 128, (0,), 64), (1, 1024, (0,), 32), (4, 512, (0, 64, 128, 192), 32)]
        prefill_case = (4, 512, (0, 64, 128, 192))
    reps = args.reps or (3 if args.quick else 7)
    for batch, prompt, pads, new_tokens in decode_cases:
        yield bench_decode(models, batch, prompt, pads, new_tokens, reps, device)
    yield bench_prefill(models, *prefill_case, reps, device)


def describe(row):
    if row["kind"] == "decode":
        return (f"{row['case']:<36} tok/s eager {row['eager_tok_s']:7.0f}  sdpa {row['sdpa_tok_s']:7.0f}  "
                f"fusedllm {row['fusedllm_tok_s']:7.0f}   x{row['vs_eager']:.2f} eager  x{row['vs_sdpa']:.2f} sdpa"
                f"   tokens agree: {row['tokens_agree']}")
    return (f"{row['case']:<36} ms eager {row['eager_ms']:7.1f}  sdpa {row['sdpa_ms']:7.1f}  "
            f"fusedllm {row['fusedllm_ms']:7.1f}   x{row['vs_eager']:.2f} eager  x{row['vs_sdpa']:.2f} sdpa   "
            f"peak MB {row['eager_mb']:.0f}/{row['sdpa_mb']:.0f}/{row['fusedllm_mb']:.0f}   "
            f"max|diff| {row['max_abs_diff_vs_eager']:.1e}")


BENCHMARK = Benchmark("decode", __doc__, cases, COLUMNS, "vs_sdpa", "speedup over HF sdpa attention",
                      describe=describe)


def main(argv=None):
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    main()
