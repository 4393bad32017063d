"""Drop-in ``nn.Module``s built on the fused ops. Parameter names match the
modules they replace, so their state dicts load unchanged."""

from __future__ import annotations

import torch
from torch import nn

import torch.nn.functional as torch_F

from . import functional as F
from .rope_scaling import rope_tables

# Hugging Face `hidden_act` names and the gated activation they mean.
_HF_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with a learned ``weight``.

    Loads the state dicts of the seed notebooks' ``RMSNorm`` classes and of
    Hugging Face's ``LlamaRMSNorm`` (``casting="llama"``, the default) or
    ``GemmaRMSNorm`` (``offset=1.0, casting="gemma"``). ``weight`` starts at
    ``1 - offset`` so a new layer scales by one.

    ``forward(x)`` returns the normalized ``x``; ``forward(x, residual)`` adds
    first and returns ``(normed, x + residual)`` from one fused pass.
    """

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0, casting: str = "llama",
                 elementwise_affine: bool = True, device=None, dtype=None):
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"fusedllm.nn.RMSNorm: dim must be a positive int, got {dim!r}")
        if casting not in ("llama", "gemma"):
            raise ValueError(f"fusedllm.nn.RMSNorm: casting must be 'llama' or 'gemma', got {casting!r}")
        if eps < 0:
            raise ValueError(f"fusedllm.nn.RMSNorm: eps must be >= 0, got {eps!r}")
        if offset != 0.0 and not elementwise_affine:
            raise ValueError("fusedllm.nn.RMSNorm: offset needs elementwise_affine=True")
        self.dim = dim
        self.eps = eps
        self.offset = float(offset)
        self.casting = casting
        if elementwise_affine:
            self.weight = nn.Parameter(torch.full((dim,), 1.0 - self.offset, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return F.rms_norm(x, self.weight, self.eps, self.offset, self.casting)
        return F.fused_add_rms_norm(x, residual, self.weight, self.eps, self.offset, self.casting)

    def extra_repr(self) -> str:
        text = f"{self.dim}, eps={self.eps}"
        if self.offset:
            text += f", offset={self.offset}"
        if self.casting != "llama":
            text += f", casting='{self.casting}'"
        return text


class GatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` with the names of Hugging
    Face's ``LlamaMLP`` (``gate_proj``, ``up_proj``, ``down_proj``).

    Forward runs one matrix multiply for gate and up (their weights are
    concatenated at call time, so the parameters stay separate ``nn.Linear``
    modules that optimizers, state dicts and patching see unchanged), then the
    fused activation on the packed result, then ``down_proj``. For backward it
    keeps the packed projection and the gated product, less than the eager
    module, which also keeps the activation output.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 activation: str = "silu", device=None, dtype=None):
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"fusedllm.nn.{type(self).__name__}: {name} must be a positive int, got {value!r}")
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(
                f"fusedllm.nn.{type(self).__name__}: activation must be 'silu' or 'gelu_tanh', got {activation!r}")
        factory = {"device": device, "dtype": dtype}
        self.activation = activation
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **factory)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **factory)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, **factory)

    @classmethod
    def from_config(cls, config, device=None, dtype=None) -> "GatedMLP":
        """From a Hugging Face config (``hidden_size``, ``intermediate_size``,
        ``hidden_act`` or ``hidden_activation``, ``mlp_bias``)."""
        act_name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if act_name not in _HF_ACTIVATIONS:
            raise ValueError(
                f"fusedllm.nn.GatedMLP.from_config: activation {act_name!r} has no fused kernel; "
                f"supported: {sorted(_HF_ACTIVATIONS)}")
        return cls(config.hidden_size, config.intermediate_size,
                   bias=bool(getattr(config, "mlp_bias", False)),
                   activation=_HF_ACTIVATIONS[act_name], device=device, dtype=dtype)

    def gate_up(self, x: torch.Tensor) -> torch.Tensor:
        """The packed ``[..., 2 * intermediate]`` projection ``[gate | up]``."""
        weight = torch.cat([self.gate_proj.weight, self.up_proj.weight], dim=0)
        bias = None
        if self.gate_proj.bias is not None:
            bias = torch.cat([self.gate_proj.bias, self.up_proj.bias], dim=0)
        return torch_F.linear(x, weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.swiglu(self.gate_up(x), activation=self.activation))


class SwiGLU(GatedMLP):
    """Drop-in for the SwiGLU feed-forward of the modern-transformer notebook:
    same constructor ``(input_dim, hidden_dim, bias=True)``, same parameters
    (``gate_proj``, ``up_proj``, ``down_proj``) and the same function,
    ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, input_dim: int, hidden_dim: int, bias: bool = True, device=None, dtype=None):
        super().__init__(input_dim, hidden_dim, bias=bias, activation="silu", device=device, dtype=dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding applied to ``q [B, Hq, S, D]`` and ``k [B, Hkv, S, D]``.

    Holds float32 ``cos_cached`` / ``sin_cached`` tables ``[positions, rotary_dim / 2]``
    (kept in float32 when the module is moved to another dtype) built by
    :func:`fusedllm.rope_tables` with ``base`` and ``scaling`` (Hugging Face style
    dict: linear, dynamic, llama3, yarn). ``forward(q, k, position_offset=0,
    position_ids=None)`` rotates positions ``position_offset + s`` (a KV cache's
    length) or ``position_ids``; asked for positions past the tables, it rebuilds
    them at least twice as long instead of failing (dynamic NTK frequencies are
    then those of the longer context, as in transformers).
    """

    def __init__(self, dim: int, max_positions: int = 8192, base: float = 10000.0,
                 scaling: dict | None = None, interleaved: bool = False, rotary_dim: int | None = None,
                 device=None):
        super().__init__()
        rotary_dim = dim if rotary_dim is None else rotary_dim
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2:
            raise ValueError(f"fusedllm.nn.RotaryEmbedding: dim must be an int >= 2, got {dim!r}")
        if not isinstance(rotary_dim, int) or rotary_dim < 2 or rotary_dim % 2 or rotary_dim > dim:
            raise ValueError(f"fusedllm.nn.RotaryEmbedding: rotary_dim must be even and at most dim={dim}, "
                             f"got {rotary_dim!r}")
        self.dim = dim
        self.rotary_dim = rotary_dim
        self.base = float(base)
        self.scaling = dict(scaling) if scaling else None
        self.interleaved = bool(interleaved)
        cos, sin = rope_tables(rotary_dim, max_positions, self.base, self.scaling, device=device)
        self.register_buffer("cos_cached", cos, persistent=False)
        self.register_buffer("sin_cached", sin, persistent=False)

    @property
    def max_positions(self) -> int:
        return self.cos_cached.shape[0]

    def _apply(self, fn, *args, **kwargs):
        # Follow device moves, but keep the angle tables in float32.
        super()._apply(fn, *args, **kwargs)
        self.cos_cached = self.cos_cached.float()
        self.sin_cached = self.sin_cached.float()
        return self

    def _grow(self, positions_needed: int) -> None:
        length = max(positions_needed, 2 * self.max_positions)
        self.cos_cached, self.sin_cached = rope_tables(
            self.rotary_dim, length, self.base, self.scaling, device=self.cos_cached.device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, position_offset: int = 0,
                position_ids: torch.Tensor | None = None):
        if not torch.compiler.is_compiling():
            if position_ids is not None:
                needed = int(position_ids.max()) + 1 if position_ids.numel() else 0
            else:
                needed = position_offset + q.shape[2]
            if needed > self.max_positions:
                self._grow(needed)
        return F.apply_rope(q, k, self.cos_cached, self.sin_cached, position_ids, position_offset,
                            self.interleaved, self.rotary_dim)

    def extra_repr(self) -> str:
        text = f"dim={self.dim}, max_positions={self.max_positions}, base={self.base}"
        if self.rotary_dim != self.dim:
            text += f", rotary_dim={self.rotary_dim}"
        if self.scaling:
            text += f", scaling={self.scaling}"
        if self.interleaved:
            text += ", interleaved=True"
        return text
