"""Drop-ins for the classes of the "Modern Transformer Architecture
Improvements" notebook (RMSNorm, SwiGLU, RoPE, pre/post-norm blocks and a full
decoder).

Constructors, forward signatures, return values and parameter / buffer names
are the notebook's, so a state dict saved from a notebook model loads into
these unchanged and, in eval mode, gives the same outputs and gradients
(float32 rounding aside). Differences, all on purpose:

- ``RMSNorm`` computes its statistics in float32 whatever the input dtype
  (the notebook computes them in the input dtype): identical in float32, more
  accurate in bfloat16 / float16.
- The attention modules run :func:`fusedllm.attention` and return ``None``
  where the notebook returns the attention probabilities, unless called with
  ``need_weights=True`` (then a plain path computes and returns them).
- A query row whose keys are all masked gets a zero output; the notebook's
  ``-1e9`` fill spreads it uniformly over the masked keys instead.
- Dropout on attention probabilities uses the fused kernel's own random
  stream, so training-mode outputs differ from the notebook's draw for draw
  (same distribution); eval mode has no dropout and matches.
- ``ModernFeedForward`` raises on an unknown ``activation`` instead of
  silently using ReLU.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .. import nn as fnn
from ._common import (attention_with_weights, dropout_of, eps_of, fused_attention, gated_linears, heads_ok,
                      is_linear, keep_mask, norm_weight, shell)

__all__ = ["RMSNorm", "SwiGLU", "ModernFeedForward", "RotaryPositionalEmbedding", "RoPEAttention",
           "PreNormTransformerBlock", "PostNormTransformerBlock", "ModernTransformerBlock",
           "ModernTransformer"]


class RMSNorm(fnn.RMSNorm):
    """``RMSNorm(d_model, eps=1e-6)`` with a ``weight``: ``x / rms(x) * weight``,
    fused. ``forward(x, residual)`` also adds first (see :class:`fusedllm.nn.RMSNorm`)."""

    def __init__(self, d_model: int, eps: float = 1e-6):
        super().__init__(d_model, eps=eps)


# The fused module already has the notebook's constructor, names and math.
SwiGLU = fnn.SwiGLU

_PLAIN_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "mish": nn.Mish}


class ModernFeedForward(nn.Module):
    """``ModernFeedForward(d_model, d_ff, activation='swiglu', dropout=0.1)``.

    ``'swiglu'``: a fused :class:`SwiGLU` of hidden size ``int(2 * d_ff / 3)``
    (so the parameter count stays near a plain ``d_ff`` FFN) under ``ffn``.
    ``'relu'``, ``'gelu'``, ``'silu'``, ``'mish'``: the plain two-layer FFN
    ``ffn = Sequential(Linear, act, Dropout, Linear, Dropout)`` (no fused kernel
    applies; kept so state dicts of every variant load).
    """

    def __init__(self, d_model: int, d_ff: int, activation: str = "swiglu", dropout: float = 0.1):
        super().__init__()
        if activation != "swiglu" and activation not in _PLAIN_ACTIVATIONS:
            raise ValueError(f"ModernFeedForward: activation must be 'swiglu' or one of "
                             f"{sorted(_PLAIN_ACTIVATIONS)}, got {activation!r}")
        self.activation_type = activation
        if activation == "swiglu":
            self.ffn = SwiGLU(d_model, int(2 * d_ff / 3))
        else:
            self.ffn = nn.Sequential(nn.Linear(d_model, d_ff), _PLAIN_ACTIVATIONS[activation](),
                                     nn.Dropout(dropout), nn.Linear(d_ff, d_model), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn(x)


class RotaryPositionalEmbedding(fnn.RotaryEmbedding):
    """``RotaryPositionalEmbedding(d_model, max_len=8192, base=10000.0)``:
    ``forward(q, k, position_offset=0) -> (q_rotated, k_rotated)`` for
    ``[batch, heads, seq, d_model]`` tensors, half-split pairs (feature ``i``
    with ``i + d_model / 2``), rotated by the fused kernel.

    ``cos_cached`` / ``sin_cached`` ``[max_len, d_model / 2]`` are saved in the
    state dict as in the notebook (the parent module does not save them). They
    stay float32 when the module is cast to another dtype, and positions past
    ``max_len`` grow the tables instead of failing.
    """

    def __init__(self, d_model: int, max_len: int = 8192, base: float = 10000.0, device=None):
        super().__init__(d_model, max_positions=max_len, base=base, device=device)
        self.d_model = d_model
        self.register_buffer("cos_cached", self.cos_cached, persistent=True)
        self.register_buffer("sin_cached", self.sin_cached, persistent=True)

    @property
    def max_len(self) -> int:
        return self.max_positions

    @staticmethod
    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        """``(x1, x2) -> (-x2, x1)`` over the two halves of the last dim (plain)."""
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    def apply_rotary_emb(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Plain rotation of ``x [B, H, S, D]`` by table rows ``cos, sin [S, D / 2]``,
        for code that calls the notebook's helper directly."""
        cos = torch.cat([cos, cos], dim=-1)
        sin = torch.cat([sin, sin], dim=-1)
        return x * cos + self.rotate_half(x) * sin


class RoPEAttention(nn.Module):
    """``RoPEAttention(d_model, n_heads, max_len=8192, dropout=0.1)`` with
    bias-free ``w_q``, ``w_k``, ``w_v``, ``w_o`` and a ``rope`` submodule.

    ``forward(x, mask=None, position_offset=0, *, need_weights=False, is_causal=False)``
    returns ``(out, None)``, or ``(out, attn_weights)`` with ``need_weights=True``
    (``[batch, heads, seq, seq]``, after dropout like the notebook's, from a
    plain path that forms them). ``mask`` follows the notebook: nonzero / True
    attends, broadcastable to ``[batch, heads, seq, seq]``. ``is_causal=True``
    applies a causal mask without building one.
    """

    def __init__(self, d_model: int, n_heads: int, max_len: int = 8192, dropout: float = 0.1):
        super().__init__()
        if n_heads < 1 or d_model % n_heads:
            raise ValueError(f"RoPEAttention: d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_k = d_model // n_heads
        self.w_q = nn.Linear(d_model, d_model, bias=False)
        self.w_k = nn.Linear(d_model, d_model, bias=False)
        self.w_v = nn.Linear(d_model, d_model, bias=False)
        self.w_o = nn.Linear(d_model, d_model, bias=False)
        self.rope = RotaryPositionalEmbedding(self.d_k, max_len)
        self.dropout = nn.Dropout(dropout)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = t.shape
        return t.view(batch, seq, self.n_heads, self.d_k).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, position_offset: int = 0, *,
                need_weights: bool = False, is_causal: bool = False):
        batch, seq, d_model = x.shape
        q, k = self.rope(self._heads(self.w_q(x)), self._heads(self.w_k(x)), position_offset)
        v = self._heads(self.w_v(x))
        keep = keep_mask(mask, type(self).__name__)
        if need_weights:
            out, weights = attention_with_weights(q, k, v, keep, is_causal, dropout=self.dropout)
        else:
            out, weights = fused_attention(q, k, v, keep, is_causal, dropout=self.dropout), None
        out = out.transpose(1, 2).reshape(batch, seq, d_model)
        return self.w_o(out), weights


def _norm_pair(owner: str, d_model: int, norm_type: str):
    if norm_type == "rmsnorm":
        return RMSNorm(d_model), RMSNorm(d_model)
    if norm_type == "layernorm":
        return nn.LayerNorm(d_model), nn.LayerNorm(d_model)
    raise ValueError(f"{owner}: norm_type must be 'layernorm' or 'rmsnorm', got {norm_type!r}")


class PreNormTransformerBlock(nn.Module):
    """``PreNormTransformerBlock(d_model, n_heads, d_ff, dropout=0.1, norm_type='layernorm')``:
    ``x + attention(norm1(x))``, then ``x + feed_forward(norm2(x))``.

    ``forward(x, mask=None, *, need_weights=False)`` returns ``(x, attn_weights)``
    with ``attn_weights`` ``None`` unless asked for. With ``norm_type='rmsnorm'``
    the second residual add and ``norm2`` run as one fused pass. The notebook
    raised nothing for other ``norm_type`` values and used LayerNorm; this raises.
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.1,
                 norm_type: str = "layernorm"):
        super().__init__()
        self.attention = RoPEAttention(d_model, n_heads, dropout=dropout)
        self.feed_forward = ModernFeedForward(d_model, d_ff, "swiglu", dropout)
        self.norm1, self.norm2 = _norm_pair(type(self).__name__, d_model, norm_type)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, *, need_weights: bool = False):
        attn_out, attn_weights = self.attention(self.norm1(x), mask, need_weights=need_weights)
        if isinstance(self.norm2, RMSNorm):
            normed, x = self.norm2(self.dropout(attn_out), x)
        else:
            x = x + self.dropout(attn_out)
            normed = self.norm2(x)
        return x + self.dropout(self.feed_forward(normed)), attn_weights


class PostNormTransformerBlock(nn.Module):
    """``PostNormTransformerBlock(d_model, n_heads, d_ff, dropout=0.1, norm_type='layernorm')``:
    ``norm1(x + attention(x))``, then ``norm2(x + feed_forward(x))``; with
    ``norm_type='rmsnorm'`` each add-and-normalize is one fused pass.
    ``forward(x, mask=None, *, need_weights=False) -> (x, attn_weights)``."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.1,
                 norm_type: str = "layernorm"):
        super().__init__()
        self.attention = RoPEAttention(d_model, n_heads, dropout=dropout)
        self.feed_forward = ModernFeedForward(d_model, d_ff, "swiglu", dropout)
        self.norm1, self.norm2 = _norm_pair(type(self).__name__, d_model, norm_type)
        self.dropout = nn.Dropout(dropout)

    def _add_norm(self, norm, x, update):
        if isinstance(norm, RMSNorm):
            return norm(self.dropout(update), x)[0]
        return norm(x + self.dropout(update))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, *, need_weights: bool = False):
        attn_out, attn_weights = self.attention(x, mask, need_weights=need_weights)
        x = self._add_norm(self.norm1, x, attn_out)
        x = self._add_norm(self.norm2, x, self.feed_forward(x))
        return x, attn_weights


class ModernTransformerBlock(nn.Module):
    """``ModernTransformerBlock(d_model, n_heads, d_ff, max_len=8192, dropout=0.1)``:
    pre-norm RMSNorm, RoPE attention and a SwiGLU feed-forward, all fused (the
    residual add before ``norm2`` included).

    ``forward(x, mask=None, position_offset=0, *, need_weights=False, is_causal=False)
    -> (x, attn_weights)``."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, max_len: int = 8192, dropout: float = 0.1):
        super().__init__()
        self.attention = RoPEAttention(d_model, n_heads, max_len, dropout)
        self.feed_forward = ModernFeedForward(d_model, d_ff, "swiglu", dropout)
        self.norm1 = RMSNorm(d_model)
        self.norm2 = RMSNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, position_offset: int = 0, *,
                need_weights: bool = False, is_causal: bool = False):
        attn_out, attn_weights = self.attention(self.norm1(x), mask, position_offset,
                                                need_weights=need_weights, is_causal=is_causal)
        normed, x = self.norm2(self.dropout(attn_out), x)
        return x + self.dropout(self.feed_forward(normed)), attn_weights


class ModernTransformer(nn.Module):
    """``ModernTransformer(vocab_size, d_model, n_layers, n_heads, d_ff, max_len=8192,
    dropout=0.1, tie_weights=True)``: ``token_embedding`` (scaled by
    ``sqrt(d_model)``), ``layers`` of :class:`ModernTransformerBlock`,
    ``final_norm`` and ``lm_head`` (tied to the embedding by default), initialized
    as the notebook does (Xavier-uniform linears, normal(0, 0.02) embedding).

    ``forward(input_ids, attention_mask=None, position_offset=0) -> logits``.
    Without ``attention_mask`` the layers attend causally, as the notebook's
    default lower-triangular mask does, but no ``[seq, seq]`` mask is built.
    """

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, d_ff: int,
                 max_len: int = 8192, dropout: float = 0.1, tie_weights: bool = True):
        super().__init__()
        self.d_model = d_model
        self.n_layers = n_layers
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(
            [ModernTransformerBlock(d_model, n_heads, d_ff, max_len, dropout) for _ in range(n_layers)])
        self.final_norm = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self._tied_weights = bool(tie_weights)
        if tie_weights:
            self.lm_head.weight = self.token_embedding.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, fnn.RMSNorm):
            nn.init.ones_(module.weight)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_offset: int = 0) -> torch.Tensor:
        x = self.token_embedding(input_ids) * math.sqrt(self.d_model)
        causal = attention_mask is None
        for layer in self.layers:
            x, _ = layer(x, attention_mask, position_offset, is_causal=causal)
        return self.lm_head(self.final_norm(x))

    def count_parameters(self) -> dict:
        """Parameters per component; a tied ``lm_head`` counts 0 (its weight is
        the embedding's). The notebook always counted it a second time."""
        def count(module):
            return sum(p.numel() for p in module.parameters())

        breakdown = {"token_embedding": count(self.token_embedding),
                     "transformer_layers": count(self.layers),
                     "final_norm": count(self.final_norm),
                     "lm_head": 0 if self._tied_weights else count(self.lm_head)}
        breakdown["total"] = sum(breakdown.values())
        return breakdown


# --- built from the notebook's own modules, for fusedllm.patch ------------------------

def _build_rms_norm(m):
    w, eps = norm_weight(m), eps_of(m, "eps")
    if w is None or eps is None:
        return "expected one 1-D `weight` parameter and a numeric `eps`"
    new = shell(fnn.RMSNorm, w.shape[0], eps=eps)
    new.weight = w
    return new


def _build_swiglu(m):
    linears = gated_linears(m, "gate_proj", "up_proj", "down_proj")
    if linears is None:
        return "expected nn.Linear gate_proj / up_proj / down_proj of matching shapes"
    g, u, d = linears
    new = shell(fnn.SwiGLU, g.in_features, g.out_features, bias=g.bias is not None)
    new.gate_proj, new.up_proj, new.down_proj = g, u, d
    return new


def _rope_tables_ok(rope) -> bool:
    cos, sin = getattr(rope, "cos_cached", None), getattr(rope, "sin_cached", None)
    return (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor) and cos.dim() == 2
            and cos.shape == sin.shape)


def _build_rope(m):
    if not _rope_tables_ok(m):
        return "expected cos_cached / sin_cached buffers [max_len, d_model / 2]"
    positions, half = m.cos_cached.shape
    new = shell(RotaryPositionalEmbedding, 2 * half, positions, float(getattr(m, "base", 10000.0)))
    new.cos_cached, new.sin_cached = m.cos_cached, m.sin_cached
    return new


def _build_rope_attention(m):
    names = ("w_q", "w_k", "w_v", "w_o")
    linears = [getattr(m, n, None) for n in names]
    if not all(is_linear(lin) and lin.bias is None for lin in linears):
        return "expected bias-free nn.Linear w_q / w_k / w_v / w_o"
    d_model = linears[0].in_features
    heads, rope, p = getattr(m, "n_heads", None), getattr(m, "rope", None), dropout_of(m)
    if not heads_ok(d_model, heads) or p is None or rope is None or not _rope_tables_ok(rope):
        return "expected n_heads, a `dropout` nn.Dropout and a `rope` with cos_cached / sin_cached"
    if 2 * rope.cos_cached.shape[1] != d_model // heads:
        return "rope tables do not match the head size"
    new = shell(RoPEAttention, d_model, heads, rope.cos_cached.shape[0], p)
    for name, lin in zip(names, linears):
        setattr(new, name, lin)
    new.rope = _build_rope(rope)
    return new


# class name -> (fusedllm.patch flag, builder, probe input kind)
PATCH_RULES = {
    "RMSNorm": ("rms_norm", _build_rms_norm, "hidden"),
    "SwiGLU": ("swiglu", _build_swiglu, "hidden"),
    "RotaryPositionalEmbedding": ("rope", _build_rope, "rope"),
    "RoPEAttention": ("attention", _build_rope_attention, "hidden"),
}
