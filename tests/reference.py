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


def attention(q, k, v, causal=False, scale=None, window=None):
    """Grouped-query attention, the plain way: softmax(q k^T * scale + mask) v.

    q: [B, Hq, Sq, D]; k, v: [B, Hkv, Sk, D]. Query head h uses kv head
    h // (Hq / Hkv), done here by repeating each kv head Hq / Hkv times.
    Masks are aligned bottom-right: query i sits at position i + Sk - Sq.
    causal keeps keys j <= position; window w keeps keys j > position - w.
    Returns (out in q.dtype, lse = logsumexp of the masked scores, float32 or
    float64); a query that sees no key gets out = 0 and lse = -inf.
    """
    acc = accumulation_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    keys = k.to(acc).repeat_interleave(group, dim=1)
    values = v.to(acc).repeat_interleave(group, dim=1)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    scores = torch.matmul(q.to(acc), keys.transpose(-1, -2)) * scale
    q_len, kv_len = q.shape[2], k.shape[2]
    position = torch.arange(q_len, device=q.device).unsqueeze(1) + (kv_len - q_len)
    key = torch.arange(kv_len, device=q.device).unsqueeze(0)
    visible = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device)
    if causal:
        visible = visible & (key <= position)
    if window is not None:
        visible = visible & (key > position - window)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(visible, probs, torch.zeros((), dtype=acc, device=q.device))
    out = torch.matmul(probs, values)
    return out.to(q.dtype), lse
