"""Private helpers shared by several module families of :mod:`fusedllm.nn`: the
Hugging Face activation names, the argument checks and the repr of the attention modules."""

from __future__ import annotations

import torch

from .._limits import check_positive_int
from .kv_cache import KVCache

# Hugging Face `hidden_act` names and the gated activation they mean.
_HF_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}


def _head_layout(owner: str, d_model, n_heads, n_kv_heads, head_dim) -> tuple[int, int]:
    """Checked ``(n_kv_heads, head_dim)``; by default ``n_heads`` and ``d_model // n_heads``."""
    check_positive_int(owner, "d_model", d_model)
    check_positive_int(owner, "n_heads", n_heads)
    n_kv_heads = n_heads if n_kv_heads is None else check_positive_int(owner, "n_kv_heads", n_kv_heads)
    if n_heads % n_kv_heads:
        raise ValueError(f"{owner}: n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
    if head_dim is None:
        if d_model % n_heads:
            raise ValueError(f"{owner}: d_model ({d_model}) must be divisible by n_heads ({n_heads}), "
                             f"or pass head_dim")
        head_dim = d_model // n_heads
    check_positive_int(owner, "head_dim", head_dim)
    return n_kv_heads, head_dim


def _attention_options(owner: str, dropout, window) -> float:
    """Checks the attention dropout probability and window; returns the dropout as a float."""
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"{owner}: dropout must be a number in [0, 1), got {dropout!r}")
    if window is not None:
        check_positive_int(owner, "window", window)
    return float(dropout)


def _attention_repr(m, middle: str = "") -> str:
    """extra_repr of an attention module: heads, ``middle``, then window and dropout if set."""
    text = f"d_model={m.d_model}, n_heads={m.n_heads}, n_kv_heads={m.n_kv_heads}, head_dim={m.head_dim}"
    if middle:
        text += ", " + middle
    if m.window is not None:
        text += f", window={m.window}"
    if m.dropout:
        text += f", dropout={m.dropout}"
    return text


def _attends_in_cache(owner: str, cache, return_weights: bool) -> bool:
    """Whether a module runs attention through ``cache.attend`` (which refuses
    a mask with a window): a cache with a window (a ring, not one [kv_len]
    sequence the weights could index) or with int8 storage (read by the
    kernel, never as float weights)."""
    if cache is None or (cache.window is None and not cache.quantized):
        return False
    if return_weights:
        raise ValueError(f"{owner}: return_weights=True needs a KVCache without a window or int8 storage")
    return True


def _sequence_input(owner: str, x, d_model: int, cache, position_offset) -> int:
    """Checks ``x [batch, seq, d_model]``, the cache and ``position_offset``;
    returns the offset (by default the cache's length, else 0)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != d_model:
        shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{owner}: x must be [batch, seq, d_model={d_model}], got {shape}")
    if cache is not None and not isinstance(cache, KVCache):
        raise ValueError(f"{owner}: cache must be a fusedllm.nn.KVCache, got {type(cache).__name__}")
    if position_offset is None:
        return cache.length if cache is not None else 0
    if isinstance(position_offset, bool) or not isinstance(position_offset, int) or position_offset < 0:
        raise ValueError(f"{owner}: position_offset must be an int >= 0, got {position_offset!r}")
    return position_offset
