"""Decoding a Hugging Face Llama with transformers' DynamicCache against
fusedllm.hf.FusedCache, at several context lengths and batch sizes.

    python benchmarks/bench_hf_cache.py           # contexts 1k, 8k, 32k; batch 1 and 8; bf16 and float32
    python benchmarks/bench_hf_cache.py --quick   # contexts 1k, 4k; batch 1 and 4; bf16

A small LlamaForCausalLM (hidden 256, 4 layers, 8 query / 2 kv heads of 32,
vocabulary 32000) with the "fusedllm" attention backend, and the same shape as
a MistralForCausalLM with a sliding window of 4096 on every layer ("window"
rows: DynamicCache concatenates the window's past with each new position,
FusedCache's ring writes two slots), and the Llama under
FusedCache(window=4096, sink=4) ("sinks" rows: StreamingLLM's bounded
attention, against DynamicCache keeping and attending to every position, so
a different computation: the rows show the bounded memory and step time).
On the full-layer rows also: FusedCache
with int8 storage (read in place by the fusedllm attention), DynamicCache
under transformers' "sdpa" attention, and, where optimum-quanto is installed,
transformers' QuantizedCache (4-bit). On a GPU (not --quick) also a Llama
large enough that attention shows in a step ("llama 8x4096" rows: 8 layers,
hidden 4096, 32 query / 8 kv heads of 128, MLP 4096, bfloat16), full
layers. Each layer's cache
is filled with the context's keys and values (random, not timed); then `new`
greedy decoding steps of one token each through the whole model, the median
step time. DynamicCache concatenates each layer's whole past with the new
position at every step; FusedCache writes only the new position. "cache
MiB": the keys' and values' storage after the steps (FusedCache's grows by
half when full, here once, at the first step after the context).
"""

from __future__ import annotations

import os
import statistics
import sys

if not __package__:  # run as a file: import from the repository root, as `python -m` does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import Benchmark, dtype_name, run, time_once  # noqa: E402
from testkit.hf import cache_keyword  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402

import fusedllm.hf  # noqa: E402,F401  (registers "fusedllm")
from fusedllm.hf import FusedCache  # noqa: E402

CONFIG = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, vocab_size=32000, max_position_embeddings=65536)
# Llama-3-8B's attention shape in 8 layers, with an MLP no wider than the model
# so that the KV cache's reads weigh in the step: 32k keys make 1 GiB of cache
# at batch 1 against 1.1 GB of weights.
LARGE = dict(CONFIG, hidden_size=4096, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=32,
             num_key_value_heads=8)


def storage_mib(cache):
    """Keys, values and (int8 storage) their scales."""
    tensors = [t for layer in cache.layers
               for t in (layer._tensors() if hasattr(layer, "_k") else (layer.keys, layer.values))]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def quantized_cache(config):
    """transformers' QuantizedCache on optimum-quanto (4-bit, groups of 32,
    the last 128 positions kept in full precision), or None where
    optimum-quanto is not installed."""
    try:
        import optimum.quanto  # noqa: F401
    except ImportError:
        return None
    return transformers.QuantizedCache(backend="quanto", config=config, nbits=4, q_group_size=32,
                                       residual_length=128)


def bench_one(model, cache, batch, context, new, device, dtype):
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for idx in range(config.num_hidden_layers):  # the context's keys and values
            k = torch.randn(batch, config.num_key_value_heads, context, head_dim, generator=g, device=device)
            cache.update(k.to(dtype), k.to(dtype), idx)
        token = torch.randint(0, config.vocab_size, (batch, 1), generator=g, device=device)
        position = [context]

        keyword = cache_keyword(model)

        def step():
            out = model(input_ids=token, use_cache=True, **{keyword: cache},
                        position_ids=torch.full((batch, 1), position[0], device=device))
            position[0] += 1
            return out.logits

        step()  # warm-up
        times = [time_once(step, device) for _ in range(new)]
    # (a quantized cache's storage is quanto's tensors: not counted here)
    return statistics.median(times), None if isinstance(cache, transformers.QuantizedCache) else storage_mib(cache)


def models(args, device):
    """(label, model class, config, dtypes, contexts, FusedCache options, full
    layers): the Llama with full layers only, the same shape as a Mistral with
    a sliding window on every layer, the Llama with FusedCache bounding its full
    layers (StreamingLLM: 4 sink positions and the window), and on a GPU the
    larger Llama."""
    contexts = [1024, 4096] if args.quick else [1024, 8192, 32768]
    dtypes = [torch.bfloat16] if args.quick else [torch.bfloat16, torch.float32]
    window = 1024 if args.quick else 4096
    yield "", transformers.LlamaForCausalLM, transformers.LlamaConfig(**CONFIG), dtypes, contexts, {}, True
    yield (f"window {window} ", transformers.MistralForCausalLM,
           transformers.MistralConfig(**CONFIG, sliding_window=window), [torch.bfloat16], contexts[1:], {}, False)
    yield (f"sinks 4 + window {window} ", transformers.LlamaForCausalLM, transformers.LlamaConfig(**CONFIG),
           [torch.bfloat16], contexts[1:], dict(window=window, sink=4), False)
    if device.type == "cuda" and not args.quick:
        yield ("llama 8x4096 ", transformers.LlamaForCausalLM, transformers.LlamaConfig(**LARGE), [torch.bfloat16],
               contexts, {}, True)


def cases(args, device):
    batches = [1, 4] if args.quick else [1, 8]
    new = args.reps or (6 if args.quick else 12)
    for label, cls, config, dtypes, contexts, options, full in models(args, device):
        for dtype in dtypes:
            torch.manual_seed(0)
            model = cls(config).to(device, dtype).eval()
            model.set_attn_implementation("fusedllm")
            for batch in batches:
                for context in contexts:
                    dyn_s, dyn_mib = bench_one(model, transformers.DynamicCache(config=model.config), batch,
                                               context, new, device, dtype)
                    fused_s, fused_mib = bench_one(model, FusedCache(model.config, **options), batch, context, new,
                                                   device, dtype)
                    row = dict(case=f"{label}B={batch} context {context} {dtype_name(dtype)}", batch=batch,
                               context=context, dtype=dtype_name(dtype), dynamic_ms=dyn_s * 1e3,
                               fused_ms=fused_s * 1e3, speedup=dyn_s / fused_s, dynamic_tok_s=batch / dyn_s,
                               fused_tok_s=batch / fused_s, dynamic_mib=dyn_mib, fused_mib=fused_mib)
                    if full:
                        int8_s, int8_mib = bench_one(model, FusedCache(model.config, dtype=torch.int8), batch,
                                                     context, new, device, dtype)
                        model.set_attn_implementation("sdpa")
                        sdpa_s = bench_one(model, transformers.DynamicCache(config=model.config), batch, context,
                                           new, device, dtype)[0]
                        model.set_attn_implementation("fusedllm")
                        quantized = quantized_cache(model.config)
                        quant_s = bench_one(model, quantized, batch, context, new, device, dtype)[0] if quantized else None
                        row.update(int8_ms=int8_s * 1e3, int8_mib=int8_mib, int8_vs_fused=fused_s / int8_s,
                                   sdpa_ms=sdpa_s * 1e3, int8_vs_sdpa=sdpa_s / int8_s,
                                   quantized_ms=quant_s * 1e3 if quant_s else None,
                                   vs_quantized=quant_s / fused_s if quant_s else None)
                    yield row


COLUMNS = [
    ("case", "case", "s"),
    ("dynamic_ms", "DynamicCache ms/step", ".2f"),
    ("fused_ms", "FusedCache ms/step", ".2f"),
    ("speedup", "FusedCache ×", ".2f"),
    ("int8_ms", "FusedCache int8 ms/step", ".2f"),
    ("int8_vs_fused", "int8 × FusedCache", ".2f"),
    ("sdpa_ms", "DynamicCache + sdpa ms/step", ".2f"),
    ("int8_vs_sdpa", "int8 × sdpa", ".2f"),
    ("quantized_ms", "QuantizedCache (quanto 4-bit) ms/step", ".2f"),
    ("vs_quantized", "FusedCache × QuantizedCache", ".2f"),
    ("dynamic_tok_s", "DynamicCache tok/s", ".0f"),
    ("fused_tok_s", "FusedCache tok/s", ".0f"),
    ("dynamic_mib", "DynamicCache MiB", ".0f"),
    ("fused_mib", "FusedCache MiB", ".0f"),
    ("int8_mib", "int8 MiB", ".0f"),
]


def describe(row):
    return (f"{row['case']:<32} DynamicCache {row['dynamic_ms']:8.2f} ms/step   FusedCache {row['fused_ms']:8.2f} "
            f"ms/step   x{row['speedup']:.2f}")


def notes(rows):
    if any(row["quantized_ms"] is not None for row in rows):
        return ["QuantizedCache: transformers' own, on optimum-quanto (4-bit, groups of 32, the last 128 "
                "positions in full precision), full-layer rows only"]
    return ["QuantizedCache: not run (optimum-quanto is not installed: pip install optimum-quanto)"]


BENCHMARK = Benchmark("hf_cache", __doc__, cases, COLUMNS, "speedup",
                      "decode step: FusedCache over DynamicCache", describe=describe, notes=notes)


def main(argv=None):
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    main()
