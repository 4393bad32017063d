"""Helpers shared by the notebook-compatible modules."""

from __future__ import annotations

import torch
from torch import nn

from .. import functional as F


def keep_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The notebooks mask with ``scores.masked_fill(mask == 0, ...)``: a 1/0 (or
    True/False) tensor where nonzero means "attend". The fused op wants a bool
    keep-mask, which is exactly ``mask != 0``."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    mask = mask.detach()
    return mask if mask.dtype == torch.bool else mask != 0


def dropout_p(module: nn.Dropout) -> float:
    """The probability the fused op should drop with: the module's ``p`` in
    training mode, 0 in evaluation mode (as nn.Dropout behaves)."""
    return module.p if module.training else 0.0


def attention_with_weights(q, k, v, keep=None, causal=False, scale=None, dropout: nn.Module | None = None):
    """Plain softmax attention that also returns the probabilities, for callers
    that ask for them (the fused kernel never forms them).

    Same conventions as :func:`fusedllm.attention`: K/V heads are shared by
    groups of query heads, ``causal`` is aligned bottom-right, and a query that
    sees no key gets zero weights and a zero output (not NaN, and not the
    uniform weights a ``-1e9`` fill gives)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    q_len, kv_len = q.shape[2], k.shape[2]
    visible = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device)
    if causal:
        visible = torch.ones_like(visible).tril(kv_len - q_len)
    if keep is not None:
        visible = visible & keep
    scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.softmax(scores, dim=-1).masked_fill(~visible, 0.0)
    if dropout is not None:
        weights = dropout(weights)
    return torch.matmul(weights, v), weights


def fused_attention(q, k, v, keep=None, causal=False, scale=None, dropout: nn.Dropout | None = None):
    """:func:`fusedllm.attention` with the dropout of an ``nn.Dropout`` module."""
    p = dropout_p(dropout) if dropout is not None else 0.0
    return F.attention(q, k, v, causal=causal, scale=scale, mask=keep, dropout_p=p)
