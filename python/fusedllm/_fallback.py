"""Plain-PyTorch versions of the ops, run when the compiled extension is not
loaded (see ``fusedllm.backend()``). Same signatures and results as the
``torch.ops.fusedllm`` operators; autograd comes from PyTorch itself."""

from __future__ import annotations

import torch


def _rms_scale(h: torch.Tensor, weight, eps: float, offset: float, casting: str):
    acc = torch.float64 if h.dtype == torch.float64 else torch.float32
    hf = h.to(acc)
    rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    normed = hf * rstd
    if weight is None:
        out = normed.to(h.dtype)
    elif casting == "llama":
        out = (normed.to(h.dtype).to(acc) * (weight.to(acc) + offset)).to(h.dtype)
    else:
        out = (normed * (weight.to(acc) + offset)).to(h.dtype)
    return out, rstd.squeeze(-1).detach()


def rms_norm(input, weight, eps, offset, casting):
    return _rms_scale(input, weight, eps, offset, casting)


def fused_add_rms_norm(input, residual, weight, eps, offset, casting):
    h = input + residual
    out, rstd = _rms_scale(h, weight, eps, offset, casting)
    return out, h, rstd


def attention(q, k, v, scale, causal, window):
    """softmax(q k^T * scale + mask) v with K/V repeated per query group, in
    float32 (float64 for float64 inputs); returns (out, lse). Builds the whole
    [Sq, Sk] score matrix: a reference, not a fast path."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = q.shape[1] // k.shape[1] if k.shape[1] else 1
    kf = k.to(acc).repeat_interleave(group, dim=1)
    vf = v.to(acc).repeat_interleave(group, dim=1)
    scores = torch.matmul(q.to(acc), kf.transpose(-1, -2)) * scale
    sq, sk = q.shape[2], k.shape[2]
    pos = torch.arange(sq, device=q.device).unsqueeze(1) + (sk - sq)
    key = torch.arange(sk, device=q.device).unsqueeze(0)
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        visible &= key <= pos
    if window >= 1:
        visible &= key > pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1))
    out = torch.matmul(probs, vf).to(q.dtype)
    return out, lse.detach()
