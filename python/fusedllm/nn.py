"""Drop-in ``nn.Module``s built on the fused ops. Parameter names match the
modules they replace, so their state dicts load unchanged."""

from __future__ import annotations

import torch
from torch import nn

import torch.nn.functional as torch_F

from . import functional as F

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
