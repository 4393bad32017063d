"""Drop-ins for the LLaMA classes of the "From GPT-2 to LLaMA" notebook.

Same constructors (a config object), forward signatures, return values and
parameter / buffer names (``q_proj`` ... ``o_proj``, ``rope.inv_freq``; ``w1``,
``w2``, ``w3``; ``attention_norm``, ``attention``, ``ffn_norm``,
``feed_forward``; ``token_embeddings``, ``layers``, ``norm``, ``lm_head``), so
the notebook's state dicts load unchanged. Where the notebook's code is wrong,
these compute what it means to compute:

- Rotary embedding: the notebook's ``apply_rotary_embeddings`` fails with a
  shape error (it multiplies ``[seq, head_dim]`` tables with half-width
  slices), and its second half ``x_even * cos + x_odd * sin`` is not a
  rotation. Its indexing pairs features ``(2i, 2i + 1)`` with frequency ``i``
  (Meta's original LLaMA / GPT-J layout), so this module rotates exactly those
  pairs, ``(x_2i, x_2i+1) -> (x_2i cos - x_2i+1 sin, x_2i sin + x_2i+1 cos)``,
  with the fused kernel, and returns them in the input's layout.
- ``LLaMAGroupQueryAttention`` rotated each shared key head once for every
  query head of its group (so keys were rotated ``n_heads / n_kv_heads``
  times); here every query and key head is rotated once, and the query heads
  of a group read their key / value head without copies.
- Its ``attention_mask`` argument was ignored; here it is applied on top of
  the causal mask (bool: True attends; float: added to the scores, like the
  notebook's GPT-2 attention).
- ``LLaMASwiGLU`` is KEPT as the notebook writes it: ``w2(w1(x) * silu(w3(x)))``,
  gating with ``w3``, while Meta's LLaMA gates with ``w1``
  (``w2(silu(w1(x)) * w3(x))``). Its weights therefore give the same function
  here; to load Meta / Hugging Face weights swap ``w1`` and ``w3``.
- ``RMSNorm`` computes its statistics in float32 (the notebook: in the input
  dtype); identical in float32, more accurate in bfloat16 / float16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import functional as FF
from .. import nn as fnn
from ._common import gated_linears, is_linear, shell

__all__ = ["LLaMAConfig", "RMSNorm", "RotaryEmbedding", "apply_rotary_embeddings",
           "LLaMAGroupQueryAttention", "LLaMASwiGLU", "LLaMABlock", "LLaMAModel"]


@dataclass
class LLaMAConfig:
    """The notebook's configuration fields and defaults. ``LLaMAConfig()`` then
    setting attributes works as in the notebook; keywords work too."""

    vocab_size: int = 32000
    hidden_size: int = 768
    intermediate_size: int = 2048
    n_layers: int = 12
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 64
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0


class RMSNorm(fnn.RMSNorm):
    """``RMSNorm(dim, eps=1e-5)`` with a ``weight``, fused."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__(dim, eps=eps)


class RotaryEmbedding(nn.Module):
    """``RotaryEmbedding(dim, max_position=2048, base=10000.0)`` with the
    ``inv_freq`` buffer ``[dim / 2]``.

    ``forward(x, seq_len=None) -> (cos, sin)``, each ``[seq_len, dim]`` with the
    angle of pair ``i`` in columns ``i`` and ``i + dim / 2`` (the notebook's
    layout; ``seq_len`` defaults to ``x.shape[1]``). :meth:`tables` gives the
    ``[seq_len, dim / 2]`` tables the fused kernel reads.
    """

    def __init__(self, dim: int, max_position: int = 2048, base: float = 10000.0):
        super().__init__()
        if dim < 2 or dim % 2:
            raise ValueError(f"RotaryEmbedding: dim must be a positive even int, got {dim!r}")
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)))
        self.max_position = max_position
        self.dim = dim

    def tables(self, seq_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``cos, sin [seq_len, dim / 2]`` for positions ``0 .. seq_len - 1``."""
        inv_freq = self.inv_freq.float() if device is None else self.inv_freq.float().to(device)
        angles = torch.outer(torch.arange(seq_len, device=inv_freq.device, dtype=torch.float32), inv_freq)
        return angles.cos(), angles.sin()

    def forward(self, x: torch.Tensor, seq_len: int | None = None):
        cos, sin = self.tables(x.shape[1] if seq_len is None else seq_len, x.device)
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


def apply_rotary_embeddings(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate pairs ``(2i, 2i + 1)`` of ``q`` and ``k`` (``[batch, heads, seq,
    dim]``, or ``[batch, seq, dim]``) by the angles in ``cos`` / ``sin``: either
    :class:`RotaryEmbedding`'s ``[seq, dim]`` output or ``[seq, dim / 2]``
    tables. Fused; see the module docstring for how this differs from the
    notebook's function (which fails)."""
    three_d = q.dim() == 3
    if three_d:
        q, k = q.unsqueeze(1), k.unsqueeze(1)
    half = q.shape[-1] // 2
    if cos.dim() != 2 or cos.shape[-1] not in (half, 2 * half):
        raise ValueError(f"apply_rotary_embeddings: cos and sin must be [seq, {2 * half}] or "
                         f"[seq, {half}], got {list(cos.shape)}")
    cos, sin = cos[:, :half].float(), sin[:, :half].float()
    q, k = FF.apply_rope(q, k, cos, sin, interleaved=True)
    return (q.squeeze(1), k.squeeze(1)) if three_d else (q, k)


class LLaMAGroupQueryAttention(nn.Module):
    """``LLaMAGroupQueryAttention(config)``: grouped-query attention with
    ``n_heads`` query heads sharing ``n_kv_heads`` key / value heads, bias-free
    ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, rotary embedding ``rope`` and
    a causal mask. ``forward(x, attention_mask=None) -> output``.

    Fused: one rotary kernel call for all heads, then :func:`fusedllm.attention`,
    which maps query head ``h`` to kv head ``h // n_rep`` without repeating K/V.
    """

    def __init__(self, config: LLaMAConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.hidden_size = config.hidden_size
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ValueError(f"LLaMAGroupQueryAttention: config.n_heads ({self.n_heads}) must be a "
                             f"multiple of config.n_kv_heads ({self.n_kv_heads})")
        self.n_rep = self.n_heads // self.n_kv_heads
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)
        self.rope = RotaryEmbedding(self.head_dim, max_position=config.max_position_embeddings,
                                    base=config.rope_theta)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rope.tables(seq, x.device)
        q, k = FF.apply_rope(q, k, cos, sin, interleaved=True)
        mask = None if attention_mask is None else attention_mask.detach()
        out = FF.attention(q, k, v, causal=True, mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim))


class LLaMASwiGLU(nn.Module):
    """``LLaMASwiGLU(config)``: bias-free ``w1``, ``w3`` (hidden -> intermediate)
    and ``w2`` (intermediate -> hidden), computing ``w2(w1(x) * silu(w3(x)))`` as
    the notebook does (``w3`` is the gate; see the module docstring).

    Fused: :func:`fusedllm.nn.gated_projection` (``w3`` and ``w1`` as one
    matrix multiply on concatenated weights, except for a few tokens), then the
    fused gating."""

    def __init__(self, config: LLaMAConfig):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(fnn.gated_projection(x, self.w3, self.w1))


class LLaMABlock(nn.Module):
    """``LLaMABlock(config)``: pre-norm ``x + attention(attention_norm(x))`` then
    ``h + feed_forward(ffn_norm(h))``; the middle residual add and ``ffn_norm``
    run as one fused pass. ``forward(x) -> x``."""

    def __init__(self, config: LLaMAConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.attention_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attention = LLaMAGroupQueryAttention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.feed_forward = LLaMASwiGLU(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed, h = self.ffn_norm(self.attention(self.attention_norm(x)), x)
        return h + self.feed_forward(normed)


class LLaMAModel(nn.Module):
    """``LLaMAModel(config)``: ``token_embeddings``, ``layers`` of
    :class:`LLaMABlock`, final ``norm`` and an untied ``lm_head``; linears and
    embeddings initialized normal(0, 0.02) as in the notebook.
    ``forward(input_ids) -> logits``; ``forward(input_ids, labels=labels)``
    returns the next-token loss instead (``labels`` shaped like ``input_ids``,
    position ``i`` predicting ``labels[..., i + 1]``, -100 ignored, the mean
    over the rest), computed by :func:`fusedllm.linear_cross_entropy` without
    building the logits."""

    def __init__(self, config: LLaMAConfig):
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size
        self.token_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LLaMABlock(config) for _ in range(config.n_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.token_embeddings(input_ids)
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h)
        if labels is None:
            return self.lm_head(h)
        if labels.shape != input_ids.shape:
            raise ValueError(f"LLaMAModel: labels must have the shape of input_ids "
                             f"{list(input_ids.shape)}, got {list(labels.shape)}")
        return FF.linear_cross_entropy(h[..., :-1, :], self.lm_head.weight, labels[..., 1:],
                                       bias=self.lm_head.bias)


# --- built from the notebook's own modules, for fusedllm.patch ------------------------

def _build_llama_swiglu(m):
    # w3 gates in that notebook: w2(w1(x) * silu(w3(x)))
    linears = gated_linears(m, "w3", "w1", "w2")
    if linears is None or any(lin.bias is not None for lin in linears):
        return "expected bias-free nn.Linear w1 / w2 / w3 of matching shapes"
    w3, w1, w2 = linears
    new = shell(LLaMASwiGLU, LLaMAConfig(hidden_size=w1.in_features, intermediate_size=w1.out_features))
    new.w1, new.w2, new.w3 = w1, w2, w3
    return new


def _build_gqa(m):
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    linears = [getattr(m, n, None) for n in names]
    if not all(is_linear(lin) and lin.bias is None for lin in linears):
        return "expected bias-free nn.Linear q_proj / k_proj / v_proj / o_proj"
    heads, kv_heads, head_dim = (getattr(m, n, None) for n in ("n_heads", "n_kv_heads", "head_dim"))
    rope = getattr(m, "rope", None)
    inv_freq = getattr(rope, "inv_freq", None)
    if not (all(isinstance(v, int) and v >= 1 for v in (heads, kv_heads, head_dim)) and heads % kv_heads == 0
            and isinstance(inv_freq, torch.Tensor) and inv_freq.shape == (head_dim // 2,)
            and linears[0].out_features == heads * head_dim and linears[1].out_features == kv_heads * head_dim):
        return "expected n_heads / n_kv_heads / head_dim matching the projections and rope.inv_freq"
    cfg = LLaMAConfig(hidden_size=linears[0].in_features, n_heads=heads, n_kv_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=int(getattr(rope, "max_position", 2048)))
    new = shell(LLaMAGroupQueryAttention, cfg)
    for name, lin in zip(names, linears):
        setattr(new, name, lin)
    new.rope.inv_freq = inv_freq
    return new


# class name -> (fusedllm.patch flag, builder, probe input kind)
PATCH_RULES = {
    "LLaMASwiGLU": ("swiglu", _build_llama_swiglu, "hidden"),
    "LLaMAGroupQueryAttention": ("attention", _build_gqa, "hidden"),
}
