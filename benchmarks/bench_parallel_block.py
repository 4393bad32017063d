"""Parallel attention + feed-forward block (PaLM / GPT-J style), forward and
forward+backward, float32 and bfloat16:

- "eager": the parallel block in plain PyTorch, ``x + attn(norm(x)) + mlp(norm(x))``
  with separate q, k, v, o, gate, up, down ``nn.Linear`` layers, RMSNorm and
  rotate-half RoPE written out, and torch's own fused attention
  (``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)``);
- "compile": ``torch.compile(fullgraph=True)`` of that module;
- "sequential": the sequential pre-norm block on fusedllm modules (RMSNorm,
  GQAttention, the fused residual add + RMSNorm, GatedMLP): the same sizes,
  not the same function;
- "fusedllm": ``fusedllm.nn.ParallelBlock`` with the eager block's weights
  (one input GEMM for q, k, v, gate and up, fused RoPE / attention / SwiGLU,
  one output GEMM with the residual).

    python benchmarks/bench_parallel_block.py           # d_model 1024, 16 heads, 4 kv heads, 2816, 1 x 4096 tokens
    python benchmarks/bench_parallel_block.py --quick   # d_model 256, 4 heads, 1 kv head, 704, 1 x 512 tokens
"""

from __future__ import annotations

import os
import sys

if not __package__:  # run as a file: import from the repository root, as `python -m` does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# harness before torch: with --thp it configures torch's allocator
from benchmarks.harness import Benchmark, dtype_name, interleaved_medians, run, speed_and_peak_plot  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import fusedllm  # noqa: E402
from fusedllm.nn import GatedMLP, GQAttention, ParallelBlock, RMSNorm  # noqa: E402
from testkit.memory import peak_memory_bytes  # noqa: E402

FULL = dict(d_model=1024, heads=16, kv_heads=4, intermediate=2816, batch=1, seq=4096)
QUICK = dict(d_model=256, heads=4, kv_heads=1, intermediate=704, batch=1, seq=512)


class EagerParallelBlock(nn.Module):
    """The parallel block as plain PyTorch: separate projections (the names
    ParallelBlock's state dict uses), torch's SDPA for attention."""

    def __init__(self, d_model, heads, kv_heads, intermediate, eps=1e-6, base=10000.0, max_positions=8192):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, d_model // heads, eps
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(d_model))
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, kv_heads * self.head_dim, bias=False)
        self.gate_proj = nn.Linear(d_model, intermediate, bias=False)
        self.up_proj = nn.Linear(d_model, intermediate, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        self.down_proj = nn.Linear(intermediate, d_model, bias=False)
        inv_freq = 1.0 / base ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        angles = torch.outer(torch.arange(max_positions).float(), inv_freq)
        angles = torch.cat([angles, angles], -1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def rotate(self, t):
        half = self.head_dim // 2
        cos, sin = self.cos[:t.shape[2]].to(t.dtype), self.sin[:t.shape[2]].to(t.dtype)
        return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

    def forward(self, x):
        b, s, d = x.shape
        xf = x.float()
        h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.norm.weight
        q = self.q_proj(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        attn = F.scaled_dot_product_attention(self.rotate(q), self.rotate(k), v, is_causal=True, enable_gqa=True)
        attn = self.o_proj(attn.transpose(1, 2).reshape(b, s, d))
        mlp = self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return x + attn + mlp


class SequentialBlock(nn.Module):
    """``h = x + attn(norm1(x)); h + mlp(norm2(h))`` on fusedllm modules."""

    def __init__(self, d_model, heads, kv_heads, intermediate):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(d_model), RMSNorm(d_model)
        self.attention = GQAttention(d_model, heads, kv_heads)
        self.mlp = GatedMLP(d_model, intermediate)

    def forward(self, x):
        normed, h = self.mlp_norm(self.attention(self.attn_norm(x)), x)  # fused residual add + norm
        return h + self.mlp(normed)


def build(size, dtype, device, with_compile):
    torch.manual_seed(0)
    args = (size["d_model"], size["heads"], size["kv_heads"], size["intermediate"])
    eager = EagerParallelBlock(*args).to(device=device, dtype=dtype)
    with torch.no_grad():
        eager.norm.weight.add_(torch.randn_like(eager.norm.weight) * 0.1)
    fused = ParallelBlock(*args, device=device, dtype=dtype)
    fused.load_state_dict(eager.state_dict())
    sequential = SequentialBlock(*args).to(device=device, dtype=dtype)
    sequential.attention.load_state_dict({k: v for k, v in eager.state_dict().items()
                                          if k.split(".")[0] in ("q_proj", "k_proj", "v_proj", "o_proj")})
    modules = {"eager": eager, "sequential": sequential, "fusedllm": fused}
    if with_compile:
        modules["compile"] = torch.compile(eager, fullgraph=True)
    return modules


def cases(args, device):
    size = QUICK if args.quick else FULL
    reps = args.reps or (5 if args.quick else 3)
    for dtype in (torch.float32, torch.bfloat16):
        modules = build(size, dtype, device, not args.no_compile)
        x = torch.randn(size["batch"], size["seq"], size["d_model"], dtype=dtype, device=device)
        with torch.no_grad():
            reference = modules["eager"](x).float()
            max_diff = {name: (m(x).float() - reference).abs().max().item()
                        for name, m in modules.items() if name not in ("eager", "sequential")}
        xg = x.clone().requires_grad_()
        grad = torch.randn_like(x)
        for mode in ("forward", "forward+backward"):
            if mode == "forward":
                def make(m):
                    def call():
                        with torch.no_grad():
                            m(x)
                    return call
            else:
                def make(m):
                    def call():
                        xg.grad = None
                        m.zero_grad(set_to_none=True)
                        m(xg).backward(grad)
                    return call
            candidates = {name: make(m) for name, m in modules.items()}
            times = interleaved_medians(candidates, device, reps, warmup=1)
            peaks = {name: peak_memory_bytes(fn, device) for name, fn in candidates.items()}
            t = times["fusedllm"]
            row = dict(case=f"{size['batch']}x{size['seq']} {dtype_name(dtype)} "
                            f"{'fwd' if mode == 'forward' else 'fwd+bwd'}",
                       mode=mode, dtype=str(dtype), size=size,
                       fused_ms=t * 1e3, vs_eager=times["eager"] / t, vs_sequential=times["sequential"] / t,
                       max_abs_diff=max_diff["fusedllm"])
            for name in times:
                row[f"{name}_ms"] = times[name] * 1e3
                row[f"{name}_peak_mb"] = peaks[name] / 2**20
            if "compile" in times:
                row["vs_compile"] = times["compile"] / t
                row["compile_max_abs_diff"] = max_diff["compile"]
            if device.type == "cpu":
                row["cpu"] = cpu_features()
            yield row


def describe(row):
    text = (f"{row['case']:<26} fused {row['fused_ms']:9.1f} ms  x{row['vs_eager']:.2f} eager  "
            f"x{row['vs_sequential']:.2f} sequential")
    if row.get("vs_compile"):
        text += f"  x{row['vs_compile']:.2f} compile"
    return text + f"  peak MiB fused {row['fusedllm_peak_mb']:.0f} eager {row['eager_peak_mb']:.0f}"


def plot(rows, path, device):
    names = [n for n in ("eager", "compile", "sequential", "fusedllm") if f"{n}_ms" in rows[0]]
    speed_and_peak_plot(rows, names, path, f"parallel block ({device})", "the eager parallel block")


def cpu_features() -> str:
    """The processor and the vector / matrix extensions that decide GEMM and
    attention speed (``lscpu``'s model name and flags)."""
    from benchmarks.harness import cpu_model

    try:
        with open("/proc/cpuinfo") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return cpu_model()
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return f"{cpu_model()}; " + ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in wanted)


def notes(rows):
    cpu = [f"CPU: {rows[0]['cpu']}"] if rows[0].get("cpu") else []
    return cpu + [f"{rows[0]['size']}; eager = plain PyTorch parallel block with torch's SDPA; "
            "sequential = the sequential pre-norm block on fusedllm modules (same sizes, another function); "
            "max |Δ| compares fusedllm's forward with eager's."]


COLUMNS = [
    ("case", "case", "s"),
    ("eager_ms", "eager ms", ".0f"),
    ("compile_ms", "compile ms", ".0f"),
    ("sequential_ms", "sequential fused ms", ".0f"),
    ("fused_ms", "fusedllm ms", ".0f"),
    ("vs_eager", "× eager", ".2f"),
    ("vs_compile", "× compile", ".2f"),
    ("vs_sequential", "× sequential", ".2f"),
    ("eager_peak_mb", "eager peak MiB", ".0f"),
    ("compile_peak_mb", "compile peak MiB", ".0f"),
    ("sequential_peak_mb", "sequential peak MiB", ".0f"),
    ("fusedllm_peak_mb", "fusedllm peak MiB", ".0f"),
    ("max_abs_diff", "max |Δ|", ".1e"),
]

BENCHMARK = Benchmark("parallel_block", __doc__, cases, COLUMNS, "vs_eager", "speedup over eager",
                      describe=describe, plot=plot, notes=notes)


def main(argv=None):
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    main()
