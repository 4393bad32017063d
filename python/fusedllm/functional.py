"""One function per fused op: checks arguments (errors name the argument),
then calls ``torch.ops.fusedllm`` or, without the extension, the plain path."""

from __future__ import annotations

import math
from numbers import Real

import torch

from . import _fallback
from ._extension import has_extension

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_CASTINGS = ("llama", "gemma")


def _require_tensor(op: str, name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")


def _require_float(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"{op}: {name} must be float32, float64, bfloat16 or float16, got {t.dtype}")


def _require_like(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(
            f"{op}: {name} has dtype {t.dtype} but {ref_name} has dtype {ref.dtype}; "
            f"cast one of them (e.g. {name}.to({ref_name}.dtype))")
    if t.device != ref.device:
        raise ValueError(f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}")


def _require_number(op: str, name: str, value, minimum=None) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        raise ValueError(f"{op}: {name} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{op}: {name} must be >= {minimum}, got {value!r}")
    return float(value)


def _check_rms_norm(op, x, weight, eps, offset, casting):
    _require_tensor(op, "input", x)
    _require_float(op, "input", x)
    if x.dim() < 1:
        raise ValueError(f"{op}: input must have at least one dimension, got a 0-d tensor")
    if weight is not None:
        _require_tensor(op, "weight", weight)
        _require_like(op, "weight", weight, "input", x)
        if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
            raise ValueError(
                f"{op}: weight must have shape [{x.shape[-1]}] (the last dim of input "
                f"{list(x.shape)}), got {list(weight.shape)}")
    eps = _require_number(op, "eps", eps, minimum=0.0)
    offset = _require_number(op, "offset", offset)
    if weight is None and offset != 0.0:
        raise ValueError(f"{op}: offset={offset} needs a weight (y = x * rstd * (offset + weight))")
    if casting not in _CASTINGS:
        raise ValueError(f"{op}: casting must be 'llama' or 'gemma', got {casting!r}")
    return eps, offset


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
             offset: float = 0.0, casting: str = "llama") -> torch.Tensor:
    """RMSNorm over the last dim: ``x * rsqrt(mean(x**2) + eps) * (offset + weight)``.

    Statistics are computed in float32 (float64 for float64 input); the result
    has the dtype of ``x``. ``casting="llama"`` casts the normalized value to
    ``x.dtype`` before multiplying by the weight (Llama, Mistral, Qwen);
    ``"gemma"`` multiplies in float32 and casts last (Gemma, with ``offset=1``).
    """
    op = "fusedllm.rms_norm"
    eps, offset = _check_rms_norm(op, x, weight, eps, offset, casting)
    impl = torch.ops.fusedllm.rms_norm if has_extension() else _fallback.rms_norm
    out, _rstd = impl(x, weight, eps, offset, casting)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None,
                       eps: float = 1e-6, offset: float = 0.0, casting: str = "llama"):
    """``h = x + residual; return rms_norm(h), h`` in one pass over memory.

    ``h`` (rounded to ``x.dtype``) is the new residual stream of a pre-norm block.
    """
    op = "fusedllm.fused_add_rms_norm"
    eps, offset = _check_rms_norm(op, x, weight, eps, offset, casting)
    _require_tensor(op, "residual", residual)
    _require_like(op, "residual", residual, "input", x)
    if residual.shape != x.shape:
        raise ValueError(
            f"{op}: residual must have the shape of input {list(x.shape)}, got {list(residual.shape)}")
    impl = torch.ops.fusedllm.fused_add_rms_norm if has_extension() else _fallback.fused_add_rms_norm
    out, residual_out, _rstd = impl(x, residual, weight, eps, offset, casting)
    return out, residual_out


_ACTIVATIONS = ("silu", "gelu_tanh")


def swiglu(gate: torch.Tensor, up: torch.Tensor | None = None, activation: str = "silu") -> torch.Tensor:
    """Gated activation ``act(gate) * up``, computed in float32 (float64 for float64).

    ``activation`` is ``"silu"`` (SwiGLU: Llama, Mistral, Qwen) or ``"gelu_tanh"``
    (GeGLU with the tanh approximation: Gemma). With ``up=None``, ``gate`` is one
    packed ``[..., 2 * F]`` tensor laid out ``[gate | up]`` (the output of a single
    fused projection) and the result is ``[..., F]``. Backward recomputes the
    activation from the inputs, so nothing else is kept for it.
    """
    op = "fusedllm.swiglu"
    if activation not in _ACTIVATIONS:
        raise ValueError(f"{op}: activation must be 'silu' or 'gelu_tanh', got {activation!r}")
    if up is None:
        _require_tensor(op, "gate", gate)
        _require_float(op, "gate", gate)
        if gate.dim() < 1 or gate.shape[-1] % 2 != 0:
            raise ValueError(
                f"{op}: with up=None, gate must be packed [..., 2 * F] as [gate | up]; "
                f"got shape {list(gate.shape)} whose last dim is not even")
        if has_extension():
            return torch.ops.fusedllm.swiglu_packed(gate, activation)
        return _fallback.swiglu_packed(gate, activation)
    _require_tensor(op, "gate", gate)
    _require_tensor(op, "up", up)
    _require_float(op, "gate", gate)
    _require_like(op, "up", up, "gate", gate)
    if gate.shape != up.shape:
        raise ValueError(
            f"{op}: gate and up must have the same shape, got {list(gate.shape)} and {list(up.shape)}")
    if gate.dim() < 1:
        raise ValueError(f"{op}: gate must have at least one dimension, got a 0-d tensor")
    if has_extension():
        return torch.ops.fusedllm.swiglu(gate, up, activation)
    return _fallback.swiglu(gate, up, activation)
