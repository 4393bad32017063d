"""Helpers shared by the notebook-compatible modules, and by the builders
that make them from a notebook's own modules (``PATCH_RULES``, read by
:func:`fusedllm.patch`)."""

from __future__ import annotations

import torch
from torch import nn

from .. import functional as FF


def keep_mask(mask: torch.Tensor | None, owner: str) -> torch.Tensor | None:
    """The notebooks mask with ``scores.masked_fill(mask == 0, ...)``: a 1/0 (or
    True/False) tensor where nonzero means "attend". The fused op wants a bool
    keep-mask, which is exactly ``mask != 0``. ``owner`` names the module in errors."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{owner}: mask must be a torch.Tensor or None, got {type(mask).__name__}")
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


# --- recognising a module by its structure --------------------------------------------

def is_linear(m, in_features=None, out_features=None) -> bool:
    return (isinstance(m, nn.Linear) and (in_features is None or m.in_features == in_features)
            and (out_features is None or m.out_features == out_features))


def norm_weight(module) -> torch.Tensor | None:
    """The only parameter of a norm module, a 1-D ``weight``, or None."""
    w = module._parameters.get("weight")
    if not isinstance(w, nn.Parameter) or w.dim() != 1:
        return None
    if len(module._parameters) != 1 or len(module._modules) != 0:
        return None
    return w


def eps_of(module, *names):
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            return float(value)
    return None


def gated_linears(module, gate, up, down):
    """The three ``nn.Linear`` of a gated MLP, if their shapes fit, else None."""
    g, u, d = (getattr(module, n, None) for n in (gate, up, down))
    if not (is_linear(g) and is_linear(u) and is_linear(d)):
        return None
    if g.weight.shape != u.weight.shape or d.in_features != g.out_features or d.out_features != g.in_features:
        return None
    if (g.bias is None) != (u.bias is None):
        return None
    return g, u, d


def heads_ok(d_model, heads) -> bool:
    return isinstance(heads, int) and heads >= 1 and d_model % heads == 0


def dropout_of(m, name="dropout") -> float | None:
    """``p`` of the ``nn.Dropout`` at attribute ``name``, or None."""
    d = getattr(m, name, None)
    return d.p if isinstance(d, nn.Dropout) else None


def shell(cls, *args, **kwargs):
    """Build a replacement without allocating its parameters; the original's
    parameters and submodules are attached right after."""
    with torch.device("meta"):
        return cls(*args, **kwargs)
