"""One decoding step's attention over a KV cache held in float32, bfloat16,
int8 and float8 (e4m3), at several context lengths and batch sizes.

    python benchmarks/bench_kv_int8.py           # contexts 1k, 8k, 32k; batch 1 and 8
    python benchmarks/bench_kv_int8.py --quick   # contexts 1k, 4k; batch 1

Llama-3-8B's attention shape: 32 query heads, 8 kv heads of 128; one query
position against the whole cache. The int8 cache is what fusedllm.quantize_kv
makes (one float32 scale per position and kv head) and fusedllm.attention
reads it in place, dequantizing in its tile loads; the float8 cache likewise
(quantize_kv(dtype=torch.float8_e4m3fn)). The query is bfloat16 over the
bfloat16, int8 and float8 caches, float32 over the float32 one. Candidates are
timed interleaved (medians): fusedllm.attention over each cache, and torch's
SDPA (enable_gqa) over the bfloat16 cache. "MiB": the cache's keys, values
and scales; "GB/s": those bytes over the step's time.
"""

from __future__ import annotations

import os
import sys

if not __package__:  # run as a file: import from the repository root, as `python -m` does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import Benchmark, interleaved_medians, run  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fusedllm  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def cases(args, device):
    contexts = [1024, 4096] if args.quick else [1024, 8192, 32768]
    batches = [1] if args.quick else [1, 8]
    reps = args.reps or (10 if args.quick else 30)
    for batch in batches:
        for context in contexts:
            torch.manual_seed(0)
            k = torch.randn(batch, KV_HEADS, context, HEAD_DIM, device=device)
            v = torch.randn(batch, KV_HEADS, context, HEAD_DIM, device=device)
            q = torch.randn(batch, HEADS, 1, HEAD_DIM, device=device)
            kb, vb, qb = k.bfloat16(), v.bfloat16(), q.bfloat16()
            (k8, ks), (v8, vs) = fusedllm.quantize_kv(kb), fusedllm.quantize_kv(vb)
            f8 = torch.float8_e4m3fn
            (kf, kfs), (vf, vfs) = fusedllm.quantize_kv(kb, dtype=f8), fusedllm.quantize_kv(vb, dtype=f8)
            caches = {"float32": (k, v), "bfloat16": (kb, vb), "int8": (k8, v8, ks, vs), "float8": (kf, vf, kfs, vfs)}
            calls = {
                "float32": lambda: fusedllm.attention(q, k, v),
                "bfloat16": lambda: fusedllm.attention(qb, kb, vb),
                "int8": lambda: fusedllm.attention(qb, k8, v8, k_scale=ks, v_scale=vs),
                "float8": lambda: fusedllm.attention(qb, kf, vf, k_scale=kfs, v_scale=vfs),
                "sdpa": lambda: F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True),
            }
            with torch.no_grad():
                times = interleaved_medians(calls, device, reps, min_seconds=2.0)
            row = dict(case=f"batch {batch}, context {context}", batch=batch, context=context)
            for name, held in caches.items():
                row[f"{name}_ms"] = times[name] * 1e3
                row[f"{name}_mib"] = nbytes(*held) / 2**20
                row[f"{name}_gbps"] = nbytes(*held) / times[name] / 1e9
            row["sdpa_ms"] = times["sdpa"] * 1e3
            row["int8_vs_bf16"] = times["bfloat16"] / times["int8"]
            row["float8_vs_bf16"] = times["bfloat16"] / times["float8"]
            row["int8_vs_sdpa"] = times["sdpa"] / times["int8"]
            row["bytes_ratio"] = row["int8_mib"] / row["bfloat16_mib"]
            yield row
            del k, v, kb, vb, k8, v8, kf, vf, caches, calls


COLUMNS = [
    ("case", "case", "s"),
    ("float32_ms", "float32 ms", ".3f"),
    ("bfloat16_ms", "bf16 ms", ".3f"),
    ("int8_ms", "int8 ms", ".3f"),
    ("float8_ms", "float8 ms", ".3f"),
    ("sdpa_ms", "SDPA bf16 ms", ".3f"),
    ("int8_vs_bf16", "int8 × bf16", ".2f"),
    ("float8_vs_bf16", "float8 × bf16", ".2f"),
    ("int8_vs_sdpa", "int8 × SDPA", ".2f"),
    ("bfloat16_gbps", "bf16 GB/s", ".1f"),
    ("int8_gbps", "int8 GB/s", ".1f"),
    ("bfloat16_mib", "bf16 MiB", ".1f"),
    ("int8_mib", "int8 MiB", ".1f"),
]


def describe(row):
    return (f"{row['case']:<26} f32 {row['float32_ms']:8.3f}  bf16 {row['bfloat16_ms']:8.3f}  "
            f"int8 {row['int8_ms']:8.3f}  f8 {row['float8_ms']:8.3f}  sdpa {row['sdpa_ms']:8.3f} ms   int8 {row['int8_vs_bf16']:.2f}x bf16, "
            f"{row['bytes_ratio']:.3f} of its bytes")


BENCHMARK = Benchmark("kv_int8", __doc__, cases, COLUMNS, "int8_vs_bf16",
                      "decode attention: int8 cache over bf16 cache", describe=describe)


def main(argv=None):
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    main()
