"""Helpers shared by the notebook-compatible modules."""

from __future__ import annotations

import torch
from torch import nn

from .. import functional as FF


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
    """:func:`fusedllm.functional.attention_with_weights` (the plain path that
    also returns the probabilities, after dropout) with the dropout of an
    ``nn.Dropout`` module. A query that sees no key gets zero weights and a zero
    output (not NaN, and not the uniform weights a ``-1e9`` fill gives)."""
    p = dropout_p(dropout) if dropout is not None else 0.0
    return FF.attention_with_weights(q, k, v, causal=causal, scale=scale, mask=keep, dropout_p=p)


def fused_attention(q, k, v, keep=None, causal=False, scale=None, dropout: nn.Dropout | None = None):
    """:func:`fusedllm.attention` with the dropout of an ``nn.Dropout`` module."""
    p = dropout_p(dropout) if dropout is not None else 0.0
    return FF.attention(q, k, v, causal=causal, scale=scale, mask=keep, dropout_p=p)
