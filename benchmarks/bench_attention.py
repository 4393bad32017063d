"""Causal grouped-query attention: the notebook's per-head loop, eager softmax
attention with repeated K/V, F.scaled_dot_product_attention(enable_gqa=True),
torch.compile of the eager version, and fusedllm.attention; on a GPU also SDPA
restricted to each of its backends (flash, cuDNN, memory-efficient, math),
fusedllm held to its SIMT kernels and, on an sm_90 GPU (where fusedllm takes
its Hopper kernels), fusedllm held to its mma.sync tensor-core kernels
(FUSEDLLM_CUDA_ATTENTION=mma, forward and backward).

    python benchmarks/bench_attention.py            # B=1, Hq=32, Hkv=8, D=128, S in 512/2048/4096
    python benchmarks/bench_attention.py --quick    # small sizes, fewer repetitions
    python benchmarks/bench_attention.py --head-dim 256 --out /tmp/d256   # Gemma's head (cases named D256)

GFLOP/s counts the useful matrix products only: a causal forward is
4*B*Hq*S*S*D / 2 FLOPs (QK^T and PV over the visible half), forward+backward
three times that (the backward's four products; recomputation not counted), the
same figure for every candidate. "matmul GFLOP/s" is torch.matmul's rate on
[S, Hq*D] @ [Hq*D, Hq*D] in the same dtype, timed interleaved with the
candidates: the machine's matrix-multiply rate that attention's products are
measured against ("fusedllm % of matmul"). Peak memory is what torch allocates during
one call beyond the inputs (see testkit.memory.peak_memory_bytes).
"""

from __future__ import annotations

import gc
import math
import os
import sys

if not __package__:  # run as a file: import from the repository root, as `python -m` does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import Benchmark, dtype_name, interleaved_medians, roofline_row, run  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fusedllm  # noqa: E402
from testkit.env import env_var  # noqa: E402
from testkit.memory import peak_memory_bytes  # noqa: E402


def notebook_core(q, k, v):
    """The attention core of notebook 003's LLaMAGroupQueryAttention, restated:
    one query head at a time, scores against the kv head it maps to
    (h // (Hq / Hkv)), a lower-triangular mask built from a [S, S] matrix of
    ones, softmax, then P V written into a preallocated output."""
    batch, q_heads, seq, head_dim = q.shape
    per_kv = q_heads // k.shape[1]
    out = torch.zeros(batch, q_heads, seq, head_dim, dtype=q.dtype, device=q.device)
    for h in range(q_heads):
        kv = h // per_kv
        scores = (q[:, h] @ k[:, kv].transpose(-2, -1)) * (1.0 / math.sqrt(head_dim))
        keep = torch.tril(torch.ones(seq, seq, device=q.device)).unsqueeze(0)
        scores = scores.masked_fill(keep == 0, float("-inf"))
        out[:, h] = F.softmax(scores, dim=-1) @ v[:, kv]
    return out


def eager_core(q, k, v):
    """Softmax attention the way eager Hugging Face code writes it: repeat each
    kv head for its query heads, full [S, S] scores, causal mask, softmax in
    float32, cast back, P V."""
    per_kv = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(per_kv, dim=1)
    v = v.repeat_interleave(per_kv, dim=1)
    seq = q.shape[2]
    scores = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def sdpa_core(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def fused_core(q, k, v):
    return fusedllm.attention(q, k, v, causal=True)


# On a GPU, SDPA restricted to each of its backends as well as left to choose.
SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION",
                 "sdpa_efficient": "EFFICIENT_ATTENTION", "sdpa_math": "MATH"}


def sdpa_backend_core(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def core(q, k, v):
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return sdpa_core(q, k, v)
    return core


def attention_request(request):
    """FUSEDLLM_CUDA_ATTENTION=request inside the block (None: as it is)."""
    return env_var("FUSEDLLM_CUDA_ATTENTION", request)


def fused_held_core(request):
    """fusedllm.attention under FUSEDLLM_CUDA_ATTENTION=request: "simt" holds it
    to its SIMT kernels (which bfloat16 / float16 calls leave for the tensor
    cores on sm_80+), "mma" to the mma.sync tensor-core kernels. The
    timed backward runs under the same request (core.request)."""
    def core(q, k, v):
        with attention_request(request):
            return fused_core(q, k, v)
    core.request = request
    return core


def hopper_kernels_here(device):
    """An sm_90 GPU and a build with sm_90a machine code: fusedllm takes its Hopper kernels."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
            and "90a-real" in fusedllm.build_info().get("cuda_archs", []))


def candidates(with_compile, device):
    c = {"notebook": notebook_core, "eager": eager_core, "sdpa": sdpa_core}
    if device.type == "cuda":
        c.update({name: sdpa_backend_core(backend) for name, backend in SDPA_BACKENDS.items()})
        c["fusedllm_simt"] = fused_held_core("simt")
        if hopper_kernels_here(device):
            c["fusedllm_mma"] = fused_held_core("mma")
    if with_compile:
        # A fresh compilation per case: each shape and dtype is its own graph.
        torch._dynamo.reset()
        c["compile"] = torch.compile(eager_core, fullgraph=True, dynamic=False)
    c["fusedllm"] = fused_core
    return c


def bench_case(batch, q_heads, kv_heads, seq, head_dim, dtype, device, reps, cores, history,
               max_call_s):
    """One shape and dtype, forward and forward+backward. `history` maps
    (mode, candidate) to (seq, seconds) of the last size measured, to predict
    (quadratically in seq) how long a call takes now: baselines predicted past
    `max_call_s` are skipped, those past a tenth of it are timed once."""
    torch.manual_seed(0)
    q = torch.randn(batch, q_heads, seq, head_dim, dtype=dtype, device=device)
    k = torch.randn(batch, kv_heads, seq, head_dim, dtype=dtype, device=device)
    v = torch.randn(batch, kv_heads, seq, head_dim, dtype=dtype, device=device)
    grad_out = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    names = list(cores)

    with torch.no_grad():
        reference = cores["sdpa"](q, k, v).float()
        max_diff = (cores["fusedllm"](q, k, v).float() - reference).abs().max().item()
        unsupported = {}
        for n in [n for n in names if n in SDPA_BACKENDS]:
            try:  # a backend that cannot run this case (dtype, GQA, GPU) raises; it is listed as skipped
                with torch.enable_grad():
                    cores[n](*[t.detach().requires_grad_() for t in (q, k, v)]).sum().backward()
            except RuntimeError as e:
                unsupported[n] = f"unsupported here: {str(e).splitlines()[0][:80]}"
        names = [n for n in names if n not in unsupported]

    def forward(fn):
        def run():
            with torch.no_grad():
                fn(q, k, v)
        return run

    def forward_backward(fn):
        def run():
            for t in leaves:
                t.grad = None
            with attention_request(getattr(fn, "request", None)):
                fn(*leaves).backward(grad_out)
        return run

    # The machine's matrix-multiply rate in the same dtype, timed in the same
    # interleaved run: x [S, Hq*D] @ W [Hq*D, Hq*D], the output projection
    # that follows this attention in a model.
    width = q_heads * head_dim
    mm_x = torch.randn(seq, width, dtype=dtype, device=device)
    mm_w = torch.randn(width, width, dtype=dtype, device=device)
    matmul_flops = 2 * seq * width * width

    def matmul_roof():
        with torch.no_grad():
            torch.matmul(mm_x, mm_w)

    rows = []
    flops_fwd = 4 * batch * q_heads * seq * seq * head_dim / 2
    for mode, wrap, flops in (("fwd", forward, flops_fwd), ("fwd+bwd", forward_backward, 3 * flops_fwd)):
        predicted = {}
        for n in names:
            if (mode, n) in history:
                prev_seq, prev_s = history[(mode, n)]
                predicted[n] = prev_s * (seq / prev_seq) ** 2
        skipped = [n for n in names if n not in ("sdpa", "fusedllm")
                   and predicted.get(n, 0.0) > max_call_s]
        slow = [n for n in names if n not in skipped and predicted.get(n, 0.0) > max_call_s / 10]
        calls = {n: wrap(cores[n]) for n in names if n not in skipped}
        times = interleaved_medians({**{n: f for n, f in calls.items() if n not in slow},
                                     "matmul": matmul_roof}, device, reps, warmup=1)
        matmul_s = times.pop("matmul")
        for n in slow:
            times[n] = interleaved_medians({n: calls[n]}, device, 1, warmup=1)[n]
        for n, t in times.items():
            history[(mode, n)] = (seq, t)
        peaks = {}
        for n, fn in calls.items():
            # Gradients of the previous call are dropped before measuring, so
            # freeing them does not offset this call's allocations.
            for t in leaves:
                t.grad = None
            gc.collect()
            peaks[n] = peak_memory_bytes(fn, device)
        fused_t = times["fusedllm"]
        row = dict(
            case=f"S={seq}{'' if head_dim == 128 else f' D{head_dim}'} {dtype_name(dtype)} {mode}",
            seq=seq, dtype=str(dtype), mode=mode,
            shape=dict(batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim),
            ms={n: t * 1e3 for n, t in times.items()},
            timed_once=slow,
            skipped={**{n: f"predicted {predicted[n]:.0f} s per call" for n in skipped}, **unsupported},
            gflops={n: flops / t / 1e9 for n, t in times.items()},
            peak_mb={n: b / 2**20 for n, b in peaks.items()},
            max_abs_diff_vs_sdpa=max_diff,
        )
        for n in calls:
            row[f"{n}_ms"] = times[n] * 1e3
            row[f"{n}_mb"] = peaks[n] / 2**20
            if n != "fusedllm":
                row[f"vs_{n}"] = times[n] / fused_t
        row.update(roofline_row(flops, {**times, "matmul": matmul_s}, {"matmul": matmul_flops},
                                key="fused", unit="gflops"))
        row.update(roofline_row(flops, times, subject="sdpa", key="sdpa", unit="gflops"))
        rows.append(row)
    return rows


COLUMNS = [
    ("case", "case", "s"),
    ("notebook_ms", "notebook ms", ".1f"),
    ("eager_ms", "eager ms", ".1f"),
    ("sdpa_ms", "SDPA ms", ".1f"),
    ("compile_ms", "compile ms", ".1f"),
    ("fusedllm_ms", "fusedllm ms", ".1f"),
    ("vs_notebook", "× notebook", ".1f"),
    ("vs_eager", "× eager", ".2f"),
    ("vs_sdpa", "× SDPA", ".2f"),
    ("vs_compile", "× compile", ".2f"),
    *((f"vs_{name}", f"× SDPA {name[5:]}", ".2f") for name in SDPA_BACKENDS),
    ("vs_fusedllm_simt", "× fusedllm SIMT kernel", ".2f"),
    ("vs_fusedllm_mma", "× fusedllm mma.sync kernels", ".2f"),
    ("fused_gflops", "fusedllm GFLOP/s", ".0f"),
    ("matmul_gflops", "matmul GFLOP/s", ".0f"),
    ("pct_matmul", "fusedllm % of matmul", ".0f"),
    ("sdpa_gflops", "SDPA GFLOP/s", ".0f"),
    ("fusedllm_mb", "fusedllm peak MB", ".0f"),
    ("sdpa_mb", "SDPA peak MB", ".0f"),
    ("eager_mb", "eager peak MB", ".0f"),
    ("notebook_mb", "notebook peak MB", ".0f"),
]


def options(parser):
    parser.add_argument("--seqs", type=int, nargs="*", default=None)
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--max-call-seconds", type=float, default=40.0,
                        help="skip a baseline whose call is predicted to take longer")


def cases(args, device):
    seqs = args.seqs or ([256, 512] if args.quick else [512, 2048, 4096])
    batch, q_heads, kv_heads, head_dim = 1, 32, 8, args.head_dim
    for name in args.dtypes:
        dtype = getattr(torch, name)
        history = {}
        for seq in seqs:
            reps = args.reps or (3 if args.quick else (5 if seq <= 2048 else 3))
            cores = candidates(not args.no_compile, device)
            yield from bench_case(batch, q_heads, kv_heads, seq, head_dim, dtype, device, reps, cores,
                                  history, args.max_call_seconds)


def describe(row):
    ratios = "   ".join(f"x{value:.2f} {key[3:]}" for key, value in row.items() if key.startswith("vs_"))
    return (f"{row['case']:<26} fusedllm {row['fusedllm_ms']:9.1f} ms "
            f"({row['fused_gflops']:.0f} GFLOP/s = {row['pct_matmul']:.0f}% of matmul's "
            f"{row['matmul_gflops']:.0f}, {row['fusedllm_mb']:.0f} MB)   {ratios}"
            + (f"   skipped {row['skipped']}" if row["skipped"] else "")
            + f"   max|diff| vs SDPA {row['max_abs_diff_vs_sdpa']:.1e}")


BENCHMARK = Benchmark("attention", __doc__, cases, COLUMNS, "vs_sdpa",
                      "speedup over F.scaled_dot_product_attention", describe=describe, options=options)


def main(argv=None):
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    main()
