"""Decoding one attention layer against its KV cache: the whole cache
(`fusedllm.nn.KVCache()`) against a sliding-window ring
(`KVCache(window=W, sink=4)`, what a Mistral-style or Gemma local layer needs),
at several context lengths.

    python benchmarks/bench_kv_cache.py           # contexts 1k, 8k, 32k; window 4096
    python benchmarks/bench_kv_cache.py --quick   # contexts 1k, 4k; window 1024

One fusedllm.nn.GQAttention layer (d_model 2048, 32 query / 8 kv heads, head
dim 64, RoPE), bfloat16, batch 1. The cache is filled with the context's
keys and values (not timed); then `new` decoding steps of one token each
through the layer (projections, RoPE, attention, cache update), the median
step time. "cache MiB" is the keys' and values' storage after the steps:
the whole cache grows with the context, the ring stays at W + 4 positions.
The ring layer has the window; the whole-cache layer attends to everything.
"""

from __future__ import annotations

import os
import statistics
import sys

if not __package__:  # run as a file: import from the repository root, as `python -m` does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import Benchmark, run, time_once  # noqa: E402

import torch  # noqa: E402

from fusedllm.nn import GQAttention, KVCache  # noqa: E402

D_MODEL, HEADS, KV_HEADS, SINK = 2048, 32, 8, 4


def cache_bytes(cache):
    return 2 * cache._k.numel() * cache._k.element_size()


def bench_one(layer, cache, context, new, device):
    head_dim = D_MODEL // HEADS
    torch.manual_seed(0)
    with torch.no_grad():
        chunk = 4096
        for start in range(0, context, chunk):  # the context's keys and values, in chunks
            n = min(chunk, context - start)
            kv = torch.randn(1, KV_HEADS, n, head_dim, dtype=torch.bfloat16, device=device)
            cache.append(kv, kv)
        x = torch.randn(1, 1, D_MODEL, dtype=torch.bfloat16, device=device)
        layer(x, cache=cache)  # warm-up
        times = [time_once(lambda: layer(x, cache=cache), device) for _ in range(new)]
    return statistics.median(times), cache_bytes(cache)


def cases(args, device):
    contexts = [1024, 4096] if args.quick else [1024, 8192, 32768]
    window = 1024 if args.quick else 4096
    new = args.reps or (8 if args.quick else 16)
    full_layer = GQAttention(D_MODEL, HEADS, KV_HEADS, max_positions=max(contexts) + 2 * new + 8,
                             device=device, dtype=torch.bfloat16).eval()
    ring_layer = GQAttention(D_MODEL, HEADS, KV_HEADS, max_positions=max(contexts) + 2 * new + 8,
                             window=window, device=device, dtype=torch.bfloat16).eval()
    ring_layer.load_state_dict(full_layer.state_dict())
    for context in contexts:
        full_s, full_b = bench_one(full_layer, KVCache(), context, new, device)
        ring_s, ring_b = bench_one(ring_layer, KVCache(window=window, sink=SINK), context, new, device)
        yield dict(case=f"context {context}", context=context, window=window, sink=SINK,
                   full_ms=full_s * 1e3, ring_ms=ring_s * 1e3, ring_speedup=full_s / ring_s,
                   full_mib=full_b / 2**20, ring_mib=ring_b / 2**20)


COLUMNS = [
    ("case", "case", "s"),
    ("full_ms", "whole cache ms/token", ".2f"),
    ("ring_ms", "ring ms/token", ".2f"),
    ("ring_speedup", "ring ×", ".2f"),
    ("full_mib", "whole cache MiB", ".1f"),
    ("ring_mib", "ring MiB", ".1f"),
]


def describe(row):
    return (f"{row['case']:<16} whole {row['full_ms']:7.2f} ms/token {row['full_mib']:7.1f} MiB   "
            f"ring (window {row['window']}, sink {row['sink']}) {row['ring_ms']:7.2f} ms/token "
            f"{row['ring_mib']:7.1f} MiB")


BENCHMARK = Benchmark("kv_cache", __doc__, cases, COLUMNS, "ring_speedup",
                      "decode step: ring cache over whole cache", describe=describe)


def main(argv=None):
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    main()
