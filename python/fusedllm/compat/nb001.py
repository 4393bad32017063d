"""Drop-ins for the classes of the "original vs modern transformer block"
notebook: post-norm / ReLU with separate Q, K, V projections against pre-norm /
GELU with a fused QKV projection.

Same constructors, forward signatures, return values and parameter names as
the notebook; attention runs :func:`fusedllm.attention`. The feed-forward
networks (ReLU, exact GELU) and LayerNorms have no fused kernel here and stay
plain ``nn`` modules under their original names. Differences, on purpose:

- A query row whose keys are all masked gets a zero output; the notebook's
  ``-1e9`` fill averages the values uniformly instead.
- Attention dropout uses the fused kernel's random stream (eval mode has no
  dropout and matches the notebook).
- ``need_weights=True`` (keyword) additionally returns the attention
  probabilities, from a plain path; by default the return value is the
  notebook's single tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import attention_with_weights, dropout_of, fused_attention, heads_ok, is_linear, keep_mask, shell

__all__ = ["OriginalMultiHeadAttention", "ModernMultiHeadAttention", "OriginalTransformerBlock",
           "ModernTransformerBlock"]


def _check_heads(cls: str, d_model: int, num_heads: int) -> None:
    if num_heads < 1 or d_model % num_heads:
        raise ValueError(f"{cls}: d_model ({d_model}) must be a multiple of num_heads ({num_heads})")


class OriginalMultiHeadAttention(nn.Module):
    """``OriginalMultiHeadAttention(d_model, num_heads, dropout=0.1)`` with biased
    ``W_q``, ``W_k``, ``W_v``, ``W_o``.

    ``forward(query, key, value, mask=None, *, need_weights=False)``: query
    ``[batch, q_len, d_model]``, key / value ``[batch, kv_len, d_model]`` (cross
    attention works); ``mask`` nonzero / True attends, broadcastable to
    ``[batch, heads, q_len, kv_len]``. Returns the output, or
    ``(output, weights)`` when asked.
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.1):
        super().__init__()
        _check_heads(type(self).__name__, d_model, num_heads)
        self.d_model = d_model
        self.num_heads = num_heads
        self.d_k = d_model // num_heads
        self.W_q = nn.Linear(d_model, d_model)
        self.W_k = nn.Linear(d_model, d_model)
        self.W_v = nn.Linear(d_model, d_model)
        self.W_o = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(t.shape[0], t.shape[1], self.num_heads, self.d_k).transpose(1, 2)

    def forward(self, query, key, value, mask=None, *, need_weights: bool = False):
        q = self._heads(self.W_q(query))
        k = self._heads(self.W_k(key))
        v = self._heads(self.W_v(value))
        keep = keep_mask(mask, type(self).__name__)
        if need_weights:
            out, weights = attention_with_weights(q, k, v, keep, dropout=self.dropout)
        else:
            out = fused_attention(q, k, v, keep, dropout=self.dropout)
        out = self.W_o(out.transpose(1, 2).reshape(query.shape[0], query.shape[1], self.d_model))
        return (out, weights) if need_weights else out


class ModernMultiHeadAttention(nn.Module):
    """``ModernMultiHeadAttention(d_model, num_heads, dropout=0.1, bias=True)``
    with one ``qkv`` projection (output laid out ``[q | k | v]``, heads inside
    each), ``proj``, ``attn_dropout`` and ``proj_dropout``.

    ``forward(x, mask=None, *, need_weights=False)`` returns the output, or
    ``(output, weights)`` when asked. Q, K and V are read as strided views of
    the ``qkv`` output, not copied.
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.1, bias: bool = True):
        super().__init__()
        _check_heads(type(self).__name__, d_model, num_heads)
        self.d_model = d_model
        self.num_heads = num_heads
        self.d_k = d_model // num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)
        self.attn_dropout = nn.Dropout(dropout)
        self.proj_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask=None, *, need_weights: bool = False):
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.num_heads, self.d_k).permute(2, 0, 3, 1, 4)
        keep = keep_mask(mask, type(self).__name__)
        if need_weights:
            out, weights = attention_with_weights(q, k, v, keep, dropout=self.attn_dropout)
        else:
            out = fused_attention(q, k, v, keep, dropout=self.attn_dropout)
        out = self.proj_dropout(self.proj(out.transpose(1, 2).reshape(batch, seq, d_model)))
        return (out, weights) if need_weights else out


class OriginalTransformerBlock(nn.Module):
    """``OriginalTransformerBlock(d_model, num_heads, d_ff, dropout=0.1)``, post-norm:
    ``norm1(x + attention(x))`` then ``norm2(x + ffn(x))`` with LayerNorms and a
    ReLU ``ffn`` (``Sequential(Linear, ReLU, Dropout, Linear)``).
    ``forward(x, mask=None) -> x``."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1):
        super().__init__()
        self.attention = OriginalMultiHeadAttention(d_model, num_heads, dropout)
        self.ffn = nn.Sequential(nn.Linear(d_model, d_ff), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(d_ff, d_model))
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask=None) -> torch.Tensor:
        x = self.norm1(x + self.dropout1(self.attention(x, x, x, mask)))
        return self.norm2(x + self.dropout2(self.ffn(x)))


class ModernTransformerBlock(nn.Module):
    """``ModernTransformerBlock(d_model, num_heads, d_ff, dropout=0.1, bias=True)``,
    pre-norm: ``x + attention(norm1(x))`` then ``x + ffn(norm2(x))`` with
    LayerNorms and a GELU ``ffn`` (``Sequential(Linear, GELU, Dropout, Linear,
    Dropout)``). ``forward(x, mask=None) -> x``."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1, bias: bool = True):
        super().__init__()
        self.attention = ModernMultiHeadAttention(d_model, num_heads, dropout, bias=bias)
        self.ffn = nn.Sequential(nn.Linear(d_model, d_ff, bias=bias), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(d_ff, d_model, bias=bias), nn.Dropout(dropout))
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor, mask=None) -> torch.Tensor:
        x = x + self.attention(self.norm1(x), mask)
        return x + self.ffn(self.norm2(x))


# --- built from the notebook's own modules, for fusedllm.patch ------------------------

def _build_original_mha(m):
    names = ("W_q", "W_k", "W_v", "W_o")
    linears = [getattr(m, n, None) for n in names]
    if not all(is_linear(lin) and lin.bias is not None for lin in linears):
        return "expected biased nn.Linear W_q / W_k / W_v / W_o"
    d_model, heads, p = linears[0].in_features, getattr(m, "num_heads", None), dropout_of(m)
    if not heads_ok(d_model, heads) or p is None:
        return "expected num_heads dividing d_model and a `dropout` nn.Dropout"
    new = shell(OriginalMultiHeadAttention, d_model, heads, p)
    for name, lin in zip(names, linears):
        setattr(new, name, lin)
    return new


def _build_modern_mha(m):
    qkv, proj = getattr(m, "qkv", None), getattr(m, "proj", None)
    if not (is_linear(qkv) and is_linear(proj) and qkv.out_features == 3 * qkv.in_features):
        return "expected nn.Linear qkv (d -> 3d) and proj"
    d_model, heads = qkv.in_features, getattr(m, "num_heads", None)
    p, p2 = dropout_of(m, "attn_dropout"), dropout_of(m, "proj_dropout")
    if not heads_ok(d_model, heads) or p is None or p2 != p:
        return "expected num_heads and attn_dropout / proj_dropout of the same p"
    new = shell(ModernMultiHeadAttention, d_model, heads, p, bias=qkv.bias is not None)
    new.qkv, new.proj = qkv, proj
    return new


# class name -> (fusedllm.patch flag, builder, probe input kind)
PATCH_RULES = {
    "OriginalMultiHeadAttention": ("attention", _build_original_mha, "qkv"),
    "ModernMultiHeadAttention": ("attention", _build_modern_mha, "hidden"),
}
