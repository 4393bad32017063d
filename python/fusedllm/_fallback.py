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


def _activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return torch.nn.functional.silu(x)
    return torch.nn.functional.gelu(x, approximate="tanh")


def swiglu(gate, up, activation):
    acc = torch.float64 if gate.dtype == torch.float64 else torch.float32
    return (_activation(gate.to(acc), activation) * up.to(acc)).to(gate.dtype)


def swiglu_packed(gate_up, activation):
    gate, up = gate_up.chunk(2, dim=-1)
    return swiglu(gate, up, activation)


def _rotate(x, cos, sin, interleaved, rotary_dim, inverse):
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xr = x[..., :rotary_dim].to(acc)
    if interleaved:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
    else:
        x0, x1 = xr.chunk(2, dim=-1)
    c, s = cos.to(acc), (-sin if inverse else sin).to(acc)
    r0, r1 = x0 * c - x1 * s, x1 * c + x0 * s
    rotated = torch.stack((r0, r1), dim=-1).flatten(-2) if interleaved else torch.cat((r0, r1), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


def rope(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse):
    rotary_dim = q.shape[-1] if rotary_dim < 0 else rotary_dim
    if cos.dim() == 3:  # per token [B, S, R/2]
        c, s = cos[:, None], sin[:, None]
    elif position_ids is not None:
        c, s = cos[position_ids], sin[position_ids]
        if c.dim() == 3:
            c, s = c[:, None], s[:, None]
    else:
        c, s = cos[offset:offset + q.shape[2]], sin[offset:offset + q.shape[2]]
    return (_rotate(q, c, s, interleaved, rotary_dim, inverse),
            _rotate(k, c, s, interleaved, rotary_dim, inverse))

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
