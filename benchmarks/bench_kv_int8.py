"""One decoding step's attention over a KV cache held in float32, bfloat16,
int8 and float8 (e4m3), dense or in pages, at several context lengths and
batch sizes.

    python benchmarks/bench_kv_int8.py           # batch 1 at 1k-32k, batch 8 at 8k and 32k, batch 32 at 4k
    python benchmarks/bench_kv_int8.py --quick   # batch 1 at 1k and 4k

Llama-3-8B's attention shape: 32 query heads, 8 kv heads of 128; one query
position against the whole cache. The int8 cache is what fusedllm.quantize_kv
makes (one float32 scale per position and kv head) and fusedllm.attention
reads it in place, dequantizing in its tile loads; the float8 cache likewise
(quantize_kv(dtype=torch.float8_e4m3fn)). The query is bfloat16 over the
bfloat16, int8 and float8 caches, float32 over the float32 one. Candidates are
timed interleaved (medians): fusedllm.attention over each cache, and torch's
SDPA (enable_gqa) over the bfloat16 cache, the bfloat16 cache in pages of 16
rows (shuffled, through a block table with kv_lens), and a device-to-device
copy of the bfloat16 cache's bytes. "MiB": the cache's keys, values and
scales; "GB/s": those bytes over the step's time; the copy's GB/s counts its
bytes read and written, and "% of copy" sets the bfloat16 step's against it.
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


PAGE = 16
SHAPES = [(1, 1024), (1, 4096), (1, 8192), (1, 32768), (8, 8192), (8, 32768), (32, 4096)]


def paged(k, v):
    """k and v [batch, kv_heads, context, d] as shuffled pages of PAGE rows, with
    their block table and kv_lens."""
    batch, heads, context, d = k.shape
    per_seq = context // PAGE
    order = torch.randperm(batch * per_seq, device=k.device)
    table = order.view(batch, per_seq).to(torch.int32)

    def pages(x):
        out = torch.empty(batch * per_seq, heads, PAGE, d, dtype=x.dtype, device=x.device)
        out[order] = x.view(batch, heads, per_seq, PAGE, d).transpose(1, 2).reshape(-1, heads, PAGE, d)
        return out

    lens = torch.full((batch,), context, dtype=torch.int32, device=k.device)
    return pages(k), pages(v), table, lens


def cases(args, device):
    shapes = [(1, 1024), (1, 4096)] if args.quick else SHAPES
    reps = args.reps or (10 if args.quick else 30)
    for batch, context in shapes:
        torch.manual_seed(0)
        k = torch.randn(batch, KV_HEADS, context, HEAD_DIM, device=device)
        v = torch.randn(batch, KV_HEADS, context, HEAD_DIM, device=device)
        q = torch.randn(batch, HEADS, 1, HEAD_DIM, device=device)
        kb, vb, qb = k.bfloat16(), v.bfloat16(), q.bfloat16()
        (k8, ks), (v8, vs) = fusedllm.quantize_kv(kb), fusedllm.quantize_kv(vb)
        f8 = torch.float8_e4m3fn
        (kf, kfs), (vf, vfs) = fusedllm.quantize_kv(kb, dtype=f8), fusedllm.quantize_kv(vb, dtype=f8)
        kp, vp, table, lens = paged(kb, vb)
        copy_k, copy_v = torch.empty_like(kb), torch.empty_like(vb)
        caches = {"float32": (k, v), "bfloat16": (kb, vb), "int8": (k8, v8, ks, vs), "float8": (kf, vf, kfs, vfs),
                  "paged": (kp, vp)}
        calls = {
            "copy": lambda: (copy_k.copy_(kb), copy_v.copy_(vb)),
            "paged": lambda: fusedllm.attention(qb, kp, vp, kv_lens=lens, block_table=table),
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
        row["copy_gbps"] = 2 * nbytes(kb, vb) / times["copy"] / 1e9
        row["bf16_of_copy"] = row["bfloat16_gbps"] / row["copy_gbps"]
        row["bf16_vs_sdpa"] = times["sdpa"] / times["bfloat16"]
        row["paged_vs_dense"] = times["bfloat16"] / times["paged"]
        row["int8_vs_bf16"] = times["bfloat16"] / times["int8"]
        row["float8_vs_bf16"] = times["bfloat16"] / times["float8"]
        row["int8_vs_sdpa"] = times["sdpa"] / times["int8"]
        row["bytes_ratio"] = row["int8_mib"] / row["bfloat16_mib"]
        yield row
        del k, v, kb, vb, k8, v8, kf, vf, kp, vp, copy_k, copy_v, caches, calls


COLUMNS = [
    ("case", "case", "s"),
    ("float32_ms", "float32 ms", ".3f"),
    ("bfloat16_ms", "bf16 ms", ".3f"),
    ("int8_ms", "int8 ms", ".3f"),
    ("float8_ms", "float8 ms", ".3f"),
    ("sdpa_ms", "SDPA bf16 ms", ".3f"),
    ("paged_ms", "bf16 paged ms", ".3f"),
    ("bf16_vs_sdpa", "bf16 × SDPA", ".2f"),
    ("paged_vs_dense", "paged × dense", ".2f"),
    ("int8_vs_bf16", "int8 × bf16", ".2f"),
    ("float8_vs_bf16", "float8 × bf16", ".2f"),
    ("int8_vs_sdpa", "int8 × SDPA", ".2f"),
    ("bfloat16_gbps", "bf16 GB/s", ".1f"),
    ("int8_gbps", "int8 GB/s", ".1f"),
    ("copy_gbps", "copy GB/s", ".1f"),
    ("bf16_of_copy", "bf16 % of copy", ".0%"),
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
