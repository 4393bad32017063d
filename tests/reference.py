"""Plain-PyTorch formulas the fused ops are tested against, written to be read.

Each follows the op contract in DESIGN.md step by step, in float32
(float64 for float64 inputs), with the casts where the contract puts them.
"""

import torch


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


# Tolerances for comparing a fused result with the reference, by dtype:
# (atol, rtol) for forward values and for gradients.
FORWARD_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float64: (1e-12, 1e-12),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float16: (2e-3, 2e-3),
}
GRAD_TOL = {
    torch.float32: (1e-4, 1e-4),
    torch.float64: (1e-10, 1e-10),
    torch.bfloat16: (5e-2, 5e-2),
    torch.float16: (1e-2, 1e-2),
}
