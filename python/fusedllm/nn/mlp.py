"""The gated feed-forward modules (GatedMLP, PackedGatedMLP, SwiGLU) and
:func:`gated_projection`, the fused gating they share."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import functional as FF
from .._limits import ACTIVATIONS, check_positive_int
from ._common import _HF_ACTIVATIONS


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
            check_positive_int(f"fusedllm.nn.{type(self).__name__}", name, value)
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"fusedllm.nn.{type(self).__name__}: activation must be one of {ACTIVATIONS}, got {activation!r}")
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_projection(x, self.gate_proj, self.up_proj, self.activation))


class PackedGatedMLP(nn.Module):
    """``down_proj(act(gate) * up)`` where ``gate_up_proj`` produces the packed
    ``[gate | up]`` (Phi-3's MLP): the fused op reads the packed projection as
    it is, with no chunk and no copies."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu",
                 bias: bool = False, device=None, dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"fusedllm.nn.PackedGatedMLP: activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.activation = activation
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias, device=device, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(FF.swiglu(self.gate_up_proj(x), activation=self.activation))


# Below this many tokens the gate and up projections run as two matrix
# multiplies: concatenating their weights would copy more bytes than the
# products read from the activations (a decoding step), so it cannot pay off.
_PACKED_MIN_TOKENS = 32


def _own_weights(linear: nn.Linear) -> bool:
    """Whether ``linear`` is plain enough to bypass its call: no hooks (tensor
    parallelism, adapters and quantizers work through them) and plain tensors
    for parameters (not DTensors, whose shards a concatenation would mix)."""
    if linear._forward_pre_hooks or linear._forward_hooks:
        return False
    return all(type(p) in (nn.Parameter, torch.Tensor) for p in (linear.weight, linear.bias) if p is not None)


def gated_projection(x: torch.Tensor, gate: nn.Linear, up: nn.Linear, activation: str = "silu"):
    """``act(gate(x)) * up(x)`` with the fused gating. From ``_PACKED_MIN_TOKENS``
    tokens on, gate and up run as one matrix multiply on weights concatenated
    at call time (the parameters stay separate ``nn.Linear`` objects)."""
    tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if tokens < _PACKED_MIN_TOKENS or not (_own_weights(gate) and _own_weights(up)):
        return FF.swiglu(gate(x), up(x), activation=activation)
    weight = torch.cat([gate.weight, up.weight], dim=0)
    bias = None if gate.bias is None else torch.cat([gate.bias, up.bias], dim=0)
    return FF.swiglu(F.linear(x, weight, bias), activation=activation)


class SwiGLU(GatedMLP):
    """Drop-in for the SwiGLU feed-forward of the modern-transformer notebook:
    same constructor ``(input_dim, hidden_dim, bias=True)``, same parameters
    (``gate_proj``, ``up_proj``, ``down_proj``) and the same function,
    ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, input_dim: int, hidden_dim: int, bias: bool = True, device=None, dtype=None):
        super().__init__(input_dim, hidden_dim, bias=bias, activation="silu", device=device, dtype=dtype)
