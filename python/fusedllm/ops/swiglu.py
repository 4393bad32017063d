"""Gated activations: ``swiglu`` (SwiGLU, GeGLU), split or packed.

Here: the functions, each operator's plain-PyTorch twin with its checks, the
fake kernels and the DTensor rules (no autocast rule: autocast leaves it alone)."""

from __future__ import annotations

import torch

from .. import _fake, _plain, _sharding
from .._checks import _check_float, _check_same, _fail, _require_tensors
from .._devices import ops_for
from .._limits import ACTIVATIONS, accumulation_dtype
from .._sharding import _rows, replicate, shard

__all__ = ["swiglu"]


def swiglu(gate: torch.Tensor, up: torch.Tensor | None = None, activation: str = "silu") -> torch.Tensor:
    """Gated activation ``act(gate) * up``, computed in float32 (float64 for float64).

    ``activation`` is ``"silu"`` (SwiGLU: Llama, Mistral, Qwen) or ``"gelu_tanh"``
    (GeGLU with the tanh approximation: Gemma). With ``up=None``, ``gate`` is one
    packed ``[..., 2 * F]`` tensor laid out ``[gate | up]`` (the output of a single
    fused projection) and the result is ``[..., F]``. Backward recomputes the
    activation from the inputs, so nothing else is kept for it.
    """
    _require_tensors("fusedllm.swiglu", "gate", gate, up=up)
    if up is None:
        return ops_for(gate).swiglu_packed(gate, activation)
    return ops_for(gate).swiglu(gate, up, activation)


# --- the plain path: twins of the compiled operator's checks and results ---------------------------


def _check_activation(op, activation):
    if activation not in ACTIVATIONS:
        _fail(op, f"activation must be 'silu' or 'gelu_tanh', got '{activation}'")


def _activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return torch.nn.functional.silu(x)
    return torch.nn.functional.gelu(x, approximate="tanh")


def _gated(gate, up, activation):
    acc = accumulation_dtype(gate)
    return (_activation(gate.to(acc), activation) * up.to(acc)).to(gate.dtype)


@_plain.op("swiglu")
def _plain_swiglu(gate, up, activation):
    op = "fusedllm.swiglu"
    _check_float(op, "gate", gate)
    _check_same(op, "gate", gate, "up", up)
    if gate.shape != up.shape:
        _fail(op, f"gate and up must have the same shape, got {list(gate.shape)} and {list(up.shape)}")
    if gate.dim() < 1:
        _fail(op, "gate must have at least one dimension")
    _check_activation(op, activation)
    return _gated(gate, up, activation)


@_plain.op("swiglu_packed")
def _plain_swiglu_packed(gate_up, activation):
    op = "fusedllm.swiglu_packed"
    _check_float(op, "gate_up", gate_up)
    if gate_up.dim() < 1:
        _fail(op, "gate_up must have at least one dimension")
    if gate_up.shape[-1] % 2:
        _fail(op, f"gate_up must be packed [..., 2 * F] as [gate | up]; its last dim {gate_up.shape[-1]} is odd")
    _check_activation(op, activation)
    gate, up = gate_up.chunk(2, dim=-1)
    return _gated(gate, up, activation)


# --- fake kernels ----------------------------------------------------------------------------------


@_fake.fake("swiglu")
def _swiglu_fake(gate, up, activation):
    return gate.new_empty(gate.shape)


@_fake.fake("swiglu_packed")
def _swiglu_packed_fake(gate_up, activation):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@_fake.fake("swiglu_backward")
def _swiglu_backward_fake(grad_out, gate, up, activation):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


@_fake.fake("swiglu_packed_backward")
def _swiglu_packed_backward_fake(grad_out, gate_up, activation):
    return gate_up.new_empty(gate_up.shape)


# --- on DTensors -----------------------------------------------------------------------------------


@_sharding.rule("swiglu")
def _shard_swiglu(gate, up, activation):
    rules = [([replicate()], [replicate(), replicate()])]
    return rules + [([shard(d)], [shard(d), shard(d)]) for d in _rows(gate, 0)]


@_sharding.rule("swiglu_backward")
def _shard_swiglu_backward(grad_out, gate, up, activation):
    rules = [([replicate()] * 2, [replicate()] * 3)]
    return rules + [([shard(d)] * 2, [shard(d)] * 3) for d in _rows(gate, 0)]


@_sharding.rule("swiglu_packed")
def _shard_swiglu_packed(gate_up, activation):
    # [gate | up] along the last dim: a shard of it is not a gate and its up.
    rules = [([replicate()], [replicate()])]
    return rules + [([shard(d)], [shard(d)]) for d in _rows(gate_up)]


@_sharding.rule("swiglu_packed_backward")
def _shard_swiglu_packed_backward(grad_out, gate_up, activation):
    rules = [([replicate()], [replicate(), replicate()])]
    return rules + [([shard(d)], [shard(d), shard(d)]) for d in _rows(gate_up)]
