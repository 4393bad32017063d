"""GQAttention, causal grouped-query self-attention on the fused ``rope`` and ``attention`` ops."""

from __future__ import annotations

import torch
from torch import nn

from .. import functional as FF
from ._common import _attends_in_cache, _attention_options, _attention_repr, _head_layout, _sequence_input
from .kv_cache import KVCache
from .rope import RotaryEmbedding


class GQAttention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings, on the fused
    ``rope`` and ``attention`` ops.

    Parameters ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (``nn.Linear``,
    named as in Hugging Face's ``LlamaAttention``); ``n_kv_heads`` (default
    ``n_heads``) must divide ``n_heads``; ``head_dim`` defaults to
    ``d_model // n_heads``. ``rope=True`` rotates q and k with a
    :class:`RotaryEmbedding` (``rotary``, base ``rope_base``, tables for
    ``max_positions`` that grow on demand). ``window=w`` is a sliding window
    (Mistral / HF ``sliding_window``: a query sees its last ``w`` keys, itself
    included). ``dropout`` drops attention probabilities in training mode only.

    ``forward(x, mask=None, position_offset=None, cache=None, return_weights=False)``:

    - ``x`` is ``[batch, seq, d_model]``; the result has the same shape.
    - Attention is always causal. ``mask`` adds to that: a bool keep-mask (True
      attends) or an additive float mask, broadcastable to
      ``[batch, n_heads, seq, kv_len]`` (e.g. a padding mask ``[batch, 1, 1, kv_len]``).
    - With ``cache`` (a :class:`KVCache`), the new keys and values are appended
      to it and the queries attend to every cached position; the queries are
      the last ``seq`` positions (causality is aligned bottom-right), and RoPE
      positions start at ``position_offset``, by default the cache's length
      before the call (0 without a cache).
    - ``return_weights=True`` returns ``(out, weights)`` with the attention
      probabilities ``[batch, n_heads, seq, kv_len]`` (after dropout in
      training mode: what multiplied the values) from
      :func:`fusedllm.functional.attention_with_weights`, a plain PyTorch path
      that builds the whole score matrix: slow and memory hungry, for
      inspection and plots. Queries that see no key have zero weights and
      outputs, as in the fused op.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None,
                 head_dim: int | None = None, bias: bool = False, rope: bool = True,
                 rope_base: float = 10000.0, max_positions: int = 8192, dropout: float = 0.0,
                 window: int | None = None, device=None, dtype=None):
        super().__init__()
        owner = "fusedllm.nn.GQAttention"
        n_kv_heads, head_dim = _head_layout(owner, d_model, n_heads, n_kv_heads, head_dim)
        if rope and head_dim % 2:
            raise ValueError(f"{owner}: rope=True needs an even head_dim, got {head_dim}")
        self.dropout = _attention_options(owner, dropout, window)
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = d_model, n_heads, n_kv_heads, head_dim
        self.window = window
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias, **factory)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=bias, **factory)
        self.rotary = (RotaryEmbedding(head_dim, max_positions=max_positions, base=rope_base, device=device)
                       if rope else None)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, position_offset: int | None = None,
                cache: KVCache | None = None, return_weights: bool = False):
        position_offset = _sequence_input("fusedllm.nn.GQAttention", x, self.d_model, cache, position_offset)
        batch, seq, _ = x.shape
        # [B, S, H*D] -> [B, H, S, D] as strided views: rope and attention read strides
        q = self.q_proj(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.rotary is not None:
            q, k = self.rotary(q, k, position_offset=position_offset)
        dropout_p = self.dropout if self.training else 0.0
        weights = None
        if _attends_in_cache("fusedllm.nn.GQAttention", cache, return_weights):
            out = cache.attend(q, k, v, window=self.window, dropout_p=dropout_p, mask=mask)
            return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim))
        if cache is not None:
            k, v = cache.append(k, v)
        if return_weights:
            out, weights = FF.attention_with_weights(q, k, v, causal=True, window=self.window, mask=mask,
                                                    dropout_p=dropout_p)
        else:
            out = FF.attention(q, k, v, causal=True, window=self.window, mask=mask, dropout_p=dropout_p)
        out = self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim))
        return (out, weights) if return_weights else out

    def extra_repr(self) -> str:
        return _attention_repr(self)
