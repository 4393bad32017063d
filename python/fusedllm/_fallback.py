"""Plain-PyTorch versions of the ops, run when the compiled extension is not
loaded (see ``fusedllm.backend()``). Same signatures and results as the
``torch.ops.fusedllm`` operators; autograd comes from PyTorch itself."""

from __future__ import annotations

import math

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

# Philox-4x32-10, the counter-based generator of fusedllm/dropout.h, on int64
# tensors holding 32-bit words (products split in 16-bit halves: no overflow).
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_U32 = 0xFFFFFFFF


def _mulhilo(a: int, b: torch.Tensor):
    low, high = a * (b & 0xFFFF), a * (b >> 16)
    return (high + (low >> 16)) >> 16, ((high << 16) + low) & _U32


def philox_words(seed: int, counter: torch.Tensor) -> torch.Tensor:
    """The four 32-bit outputs (last dim) of Philox-4x32-10 for 64-bit counters
    (int64 tensor, high words zero) under a 64-bit key."""
    k0, k1 = seed & _U32, (seed >> 32) & _U32
    c0, c1 = counter & _U32, (counter >> 32) & _U32
    c2, c3 = torch.zeros_like(c0), torch.zeros_like(c0)
    for r in range(10):
        hi0, lo0 = _mulhilo(_PHILOX_M[0], c0)
        hi1, lo1 = _mulhilo(_PHILOX_M[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX_W[0]) & _U32, (k1 + _PHILOX_W[1]) & _U32
    return torch.stack((c0, c1, c2, c3), dim=-1)


def dropout_keep(seed: int, shape, dropout_p: float, device=None) -> torch.Tensor:
    """Boolean [B, Hq, Sq, Sk] mask of the attention probabilities the kernels
    keep: element n (row-major index) draws word n % 4 of Philox(n // 4)."""
    n = torch.arange(math.prod(shape), dtype=torch.int64, device=device)
    words = philox_words(seed, n >> 2).gather(-1, (n & 3).unsqueeze(-1)).squeeze(-1)
    return ((words >> 8) >= dropout_threshold(dropout_p)).reshape(shape)


def dropout_threshold(dropout_p: float) -> int:
    """A 24-bit draw is kept when it is >= this (so P(drop) = dropout_p to 2^-24)."""
    return math.ceil(dropout_p * (1 << 24))


def attention_with_probs(q, k, v, mask, scale, causal, window, dropout_p, seed):
    """softmax(q k^T * scale + mask) v with K/V repeated per query group, in
    float32 (float64 for float64 inputs), dropout as the kernels draw it;
    returns (out, lse, probabilities after dropout). Builds the whole [Sq, Sk]
    score matrix: a reference, not a fast path."""
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
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            # The dtype's most negative finite value means "masked" (as -inf).
            scores = (scores + mask.to(acc)).masked_fill(mask <= torch.finfo(mask.dtype).min,
                                                         float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1))
    if dropout_p > 0:
        keep = dropout_keep(int(seed.item()), probs.shape, dropout_p, q.device)
        probs = probs * keep / (1.0 - dropout_p)
    out = torch.matmul(probs, vf).to(q.dtype)
    return out, lse.detach(), probs


def attention(q, k, v, mask, scale, causal, window, dropout_p, seed):
    """The attention op's plain path: (out, lse)."""
    out, lse, _ = attention_with_probs(q, k, v, mask, scale, causal, window, dropout_p, seed)
    return out, lse
