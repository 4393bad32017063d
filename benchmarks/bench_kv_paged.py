"""One batched decoding step over sequences of different lengths: a paged
cache read through its block table, against a padded cache and against one
call per sequence.

    python benchmarks/bench_kv_paged.py           # 8 sequences of 256 to 32k positions; 8 x 8k
    python benchmarks/bench_kv_paged.py --quick   # 4 sequences of 256 to 4k

Llama-3-8B's attention shape: 32 query heads, 8 kv heads of 128, bfloat16
queries and caches; one query position per sequence. Candidates, timed
interleaved (medians):

- "paged 16" / "paged 128": pools of pages of 16 / 128 positions handed out in
  a shuffled order (what a pool looks like after sequences come and go),
  one fusedllm.attention call with block_table and kv_lens;
- "paged int8": the page-16 pool in int8 with its scales;
- "padded": one [batch, kv_heads, longest, head_dim] cache, one call with kv_lens;
- "per sequence": one fusedllm.attention call per sequence over its own rows;
- "SDPA masked": torch's SDPA over the padded cache with a padding mask.

"MiB": the bytes each layout holds for the batch (keys, values, scales).
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


def paged(rows, page_size, device):
    """The sequences' rows in a pool of shuffled pages: (k pages, v pages, block table)."""
    counts = [-(-k.shape[1] // page_size) for k, _ in rows]
    order = torch.randperm(sum(counts)).tolist()
    pool_k = torch.zeros(sum(counts), KV_HEADS, page_size, HEAD_DIM, dtype=torch.bfloat16, device=device)
    pool_v = torch.zeros_like(pool_k)
    table = torch.zeros(len(rows), max(counts), dtype=torch.int32)
    taken = 0
    for b, (k, v) in enumerate(rows):
        n = k.shape[1]
        pages = order[taken:taken + counts[b]]
        taken += counts[b]
        table[b, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        for i, page in enumerate(pages):
            span = slice(i * page_size, min(n, (i + 1) * page_size))
            pool_k[page, :, :span.stop - span.start] = k[:, span]
            pool_v[page, :, :span.stop - span.start] = v[:, span]
    return pool_k, pool_v, table.to(device)


def cases(args, device):
    if args.quick:
        batches = {"4 of 256-4k": [4096, 1024, 512, 256]}
    else:
        batches = {"8 of 256-32k": [32768, 16384, 8192, 4096, 2048, 1024, 512, 256],
                   "8 of 8k": [8192] * 8}
    reps = args.reps or (10 if args.quick else 20)
    for name, lens in batches.items():
        torch.manual_seed(0)
        rows = [(torch.randn(KV_HEADS, n, HEAD_DIM, device=device).bfloat16(),
                 torch.randn(KV_HEADS, n, HEAD_DIM, device=device).bfloat16()) for n in lens]
        batch, longest = len(lens), max(lens)
        q = torch.randn(batch, HEADS, 1, HEAD_DIM, device=device).bfloat16()
        kv_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        pad_k = torch.zeros(batch, KV_HEADS, longest, HEAD_DIM, dtype=torch.bfloat16, device=device)
        pad_v = torch.zeros_like(pad_k)
        for b, (k, v) in enumerate(rows):
            pad_k[b, :, :k.shape[1]] = k
            pad_v[b, :, :k.shape[1]] = v
        keep = (torch.arange(longest, device=device) < kv_lens.view(-1, 1)).view(batch, 1, 1, longest)
        p16, p128 = paged(rows, 16, device), paged(rows, 128, device)
        (k8, ks), (v8, vs) = fusedllm.quantize_kv(p16[0]), fusedllm.quantize_kv(p16[1])
        held = {"paged 16": p16[:2], "paged 128": p128[:2], "paged int8": (k8, v8, ks, vs),
                "padded": (pad_k, pad_v), "per sequence": [t for r in rows for t in r]}
        calls = {
            "paged 16": lambda: fusedllm.attention(q, *p16[:2], kv_lens=kv_lens, block_table=p16[2]),
            "paged 128": lambda: fusedllm.attention(q, *p128[:2], kv_lens=kv_lens, block_table=p128[2]),
            "paged int8": lambda: fusedllm.attention(q, k8, v8, k_scale=ks, v_scale=vs, kv_lens=kv_lens,
                                                     block_table=p16[2]),
            "padded": lambda: fusedllm.attention(q, pad_k, pad_v, kv_lens=kv_lens),
            "per sequence": lambda: [fusedllm.attention(q[b:b + 1], k.unsqueeze(0), v.unsqueeze(0))
                                     for b, (k, v) in enumerate(rows)],
            "SDPA masked": lambda: F.scaled_dot_product_attention(q, pad_k, pad_v, attn_mask=keep,
                                                                  enable_gqa=True),
        }
        with torch.no_grad():
            times = interleaved_medians(calls, device, reps, min_seconds=2.0)
        row = dict(case=name, batch=batch, positions=sum(lens), longest=longest)
        for key, t in times.items():
            row[key] = t * 1e3
        for key, tensors in held.items():
            row[f"{key} MiB"] = nbytes(*tensors) / 2**20
        row["paged_vs_per_sequence"] = times["per sequence"] / times["paged 16"]
        row["paged_vs_padded"] = times["padded"] / times["paged 16"]
        yield row
        del rows, pad_k, pad_v, p16, p128, k8, v8, calls


COLUMNS = [
    ("case", "sequences", "s"),
    ("paged 16", "paged 16 ms", ".2f"),
    ("paged 128", "paged 128 ms", ".2f"),
    ("paged int8", "paged int8 ms", ".2f"),
    ("padded", "padded ms", ".2f"),
    ("per sequence", "per sequence ms", ".2f"),
    ("SDPA masked", "SDPA masked ms", ".2f"),
    ("paged_vs_per_sequence", "paged 16 × per sequence", ".2f"),
    ("paged_vs_padded", "paged 16 × padded", ".2f"),
    ("paged 16 MiB", "paged MiB", ".0f"),
    ("paged int8 MiB", "paged int8 MiB", ".0f"),
    ("padded MiB", "padded MiB", ".0f"),
]


def describe(row):
    return (f"{row['case']:<14} paged16 {row['paged 16']:7.2f} paged128 {row['paged 128']:7.2f} "
            f"int8 {row['paged int8']:7.2f} padded {row['padded']:7.2f} per-seq {row['per sequence']:7.2f} "
            f"sdpa {row['SDPA masked']:7.2f} ms")


BENCHMARK = Benchmark("kv_paged", __doc__, cases, COLUMNS, "paged_vs_per_sequence",
                      "batched decode over a paged cache: speed-up over one call per sequence",
                      describe=describe)


def main(argv=None):
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    main()
