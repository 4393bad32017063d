"""Drop-ins for the classes of the normalization lab notebook: RMSNorm, a
single-head attention, and pre-norm / post-norm blocks.

Same constructors, forward signatures, return values and parameter names
(``weight``; ``qkv``, ``out``; ``attention``, ``ffn``, ``ln1``, ``ln2``). The
RMSNorm is fused (and each residual add feeding an RMSNorm runs in the same
pass), the attention runs :func:`fusedllm.attention`, the GELU feed-forward
stays plain ``nn`` modules. ``SimpleAttention`` treats the whole width as one
head; the fused kernel takes head sizes up to 256, so wider models take a
plain softmax path with the same result.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .. import nn as fnn
from .._limits import MAX_HEAD_DIM
from ._common import attention_with_weights, fused_attention, is_linear, shell

__all__ = ["RMSNorm", "SimpleAttention", "PreNormBlock", "PostNormBlock"]


class RMSNorm(fnn.RMSNorm):
    """``RMSNorm(dim, eps=1e-6)`` with a ``weight``: statistics in float32, the
    normalized value cast back to the input dtype, then scaled, exactly the
    lab's convention (and :class:`fusedllm.nn.RMSNorm`'s default)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__(dim, eps=eps)


class SimpleAttention(nn.Module):
    """``SimpleAttention(dim)``: one head as wide as the model, bias-free ``qkv``
    (output ``[q | k | v]``) and ``out`` projections, no mask, scale
    ``dim ** -0.5`` (kept as the ``scale`` attribute). ``forward(x) -> out``."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.scale = dim ** -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        # [3, batch, 1 head, seq, dim] views of the projection, not copies
        q, k, v = self.qkv(x).view(batch, seq, 3, 1, dim).permute(2, 0, 3, 1, 4)
        if dim <= MAX_HEAD_DIM:
            out = fused_attention(q, k, v, scale=self.scale)
        else:
            out, _ = attention_with_weights(q, k, v, scale=self.scale)
        return self.out(out.squeeze(1))


def _gelu_ffn(dim: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(dim, dim * 4), nn.GELU(), nn.Linear(dim * 4, dim))


class PostNormBlock(nn.Module):
    """``PostNormBlock(dim)``: ``ln1(x + attention(x))`` then ``ln2(x + ffn(x))``,
    each add-and-normalize one fused pass. ``forward(x) -> x``."""

    def __init__(self, dim: int):
        super().__init__()
        self.attention = SimpleAttention(dim)
        self.ffn = _gelu_ffn(dim)
        self.ln1 = RMSNorm(dim)
        self.ln2 = RMSNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self.ln1(self.attention(x), x)
        x, _ = self.ln2(self.ffn(x), x)
        return x


class PreNormBlock(nn.Module):
    """``PreNormBlock(dim)``: ``x + attention(ln1(x))`` then ``x + ffn(ln2(x))``;
    the first residual add and ``ln2`` run as one fused pass. ``forward(x) -> x``."""

    def __init__(self, dim: int):
        super().__init__()
        self.attention = SimpleAttention(dim)
        self.ffn = _gelu_ffn(dim)
        self.ln1 = RMSNorm(dim)
        self.ln2 = RMSNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed, x = self.ln2(self.attention(self.ln1(x)), x)
        return x + self.ffn(normed)


# --- built from the notebook's own modules, for fusedllm.patch ------------------------

def _build_simple_attention(m):
    qkv, out = getattr(m, "qkv", None), getattr(m, "out", None)
    if not (is_linear(qkv) and is_linear(out) and qkv.out_features == 3 * qkv.in_features):
        return "expected nn.Linear qkv (d -> 3d) and out"
    dim = qkv.in_features
    if not math.isclose(float(getattr(m, "scale", -1.0)), dim ** -0.5):
        return "expected scale == dim ** -0.5"
    new = shell(SimpleAttention, dim)
    new.qkv, new.out = qkv, out
    return new


# class name -> (fusedllm.patch flag, builder, probe input kind)
PATCH_RULES = {
    "SimpleAttention": ("attention", _build_simple_attention, "hidden"),
}
