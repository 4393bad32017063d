"""Plain-PyTorch formulas the fused ops are tested against, written to be read.

Each follows the op contract in DESIGN.md step by step, in float32
(float64 for float64 inputs), with the casts where the contract puts them.
"""

import math

import torch
from torch import nn


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x, weight=None, eps=1e-6, offset=0.0, casting="llama"):
    """y = x / sqrt(mean(x^2) + eps) * (offset + weight).

    llama: the normalized value is cast to x.dtype, then multiplied by the weight.
    gemma: the weight multiply happens in float32; one cast at the end.
    """
    acc = accumulation_dtype(x.dtype)
    xs = x.to(acc)
    mean_square = (xs * xs).sum(dim=-1, keepdim=True) / x.shape[-1]
    normalized = xs / torch.sqrt(mean_square + eps)
    if weight is None:
        return normalized.to(x.dtype)
    scale = offset + weight.to(acc)
    if casting == "llama":
        return (normalized.to(x.dtype).to(acc) * scale).to(x.dtype)
    return (normalized * scale).to(x.dtype)


def fused_add_rms_norm(x, residual, weight=None, eps=1e-6, offset=0.0, casting="llama"):
    """h = x + residual (stored in x.dtype); returns (rms_norm(h), h)."""
    acc = accumulation_dtype(x.dtype)
    h = (x.to(acc) + residual.to(acc)).to(x.dtype)
    return rms_norm(h, weight, eps, offset, casting), h


def silu(x):
    """x * sigmoid(x)."""
    return x / (1 + torch.exp(-x))


def gelu_tanh(x):
    """GELU with the tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def swiglu(gate, up=None, activation="silu"):
    """act(gate) * up in float32 (float64 for float64); up=None: gate is [gate | up]."""
    if up is None:
        gate, up = gate.chunk(2, dim=-1)
    acc = accumulation_dtype(gate.dtype)
    act = silu if activation == "silu" else gelu_tanh
    return (act(gate.to(acc)) * up.to(acc)).to(gate.dtype)


# --- eager modules written the way the notebooks write them ---------------------------
# (same constructor arguments and parameter names as the notebooks' classes; the
# baselines of the benchmarks and the originals of the state-dict tests)


class NotebookRMSNorm(nn.Module):
    """RMSNorm(dim, eps) with a `weight`: float32 statistics, cast back, scale."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class NotebookSwiGLU(nn.Module):
    """SwiGLU(input_dim, hidden_dim, bias=True) with gate_proj / up_proj / down_proj:
    down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, input_dim, hidden_dim, bias=True):
        super().__init__()
        self.gate_proj = nn.Linear(input_dim, hidden_dim, bias=bias)
        self.up_proj = nn.Linear(input_dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, input_dim, bias=bias)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
