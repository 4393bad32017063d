"""RMSNorm: ``rms_norm`` and ``fused_add_rms_norm``.

Here: the functions, each operator's plain-PyTorch twin with its checks, the
autocast rules, the fake kernels and the DTensor rules."""

from __future__ import annotations

import math

import torch

from .. import _autocast, _fake, _plain, _sharding
from .._checks import _check_float, _check_same, _fail, _require_tensors
from .._devices import ops_for
from .._limits import CASTINGS, accumulation_dtype
from .._sharding import _on, _rows, partial, replicate, shard

__all__ = ["rms_norm", "fused_add_rms_norm"]

_autocast.rule("rms_norm", cuda=(_autocast.FLOAT32, ("input", "weight")))
# h = input + residual (output 1) keeps the dtype of that add, as autocast leaves an add alone
_autocast.rule("fused_add_rms_norm",
               cuda=(_autocast.FLOAT32, ("input", "residual", "weight"), {1: ("input", "residual")}))


_HALF = (torch.bfloat16, torch.float16)


def _mixed(a: torch.dtype, b: torch.dtype) -> bool:
    """Whether ``b`` is float32 and ``a`` bfloat16 / float16: the pair mixed
    precision makes (float32 norm weights or residual stream, half-precision
    activations), accepted where the modules the norms replace accept it.
    Other dtype pairs stay an error of the op, naming the argument."""
    return a in _HALF and b == torch.float32


def _norm_with_float32_weight(norm, x, weight, offset, casting):
    """``norm(x, weight)`` for half-precision x and a float32 weight. Llama
    casting gives ``weight * normalized.to(x.dtype)``, float32 as in Hugging
    Face's LlamaRMSNorm; Gemma casting multiplies in float32 and casts to
    x.dtype last, as GemmaRMSNorm. Composed of the kernel and torch ops (the
    kernels read one dtype); returns what the op returns (rstd last)."""
    if casting == "llama":
        outs = norm(x, None, 0.0)
        scale = weight + offset if offset else weight
        return (outs[0] * scale, *outs[1:])
    outs = norm(x.float(), weight, offset)
    return (*(t.to(x.dtype) for t in outs[:-1]), outs[-1])  # the last is the float32 rstd


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
             offset: float = 0.0, casting: str = "llama") -> torch.Tensor:
    """RMSNorm over the last dim: ``x * rsqrt(mean(x**2) + eps) * (offset + weight)``.

    Statistics are computed in float32 (float64 for float64 input); the result
    has the dtype of ``x``. ``casting="llama"`` casts the normalized value to
    ``x.dtype`` before multiplying by the weight (Llama, Mistral, Qwen);
    ``"gemma"`` multiplies in float32 and casts last (Gemma, with ``offset=1``).
    A float32 weight with bfloat16 / float16 ``x`` (mixed precision) is taken
    as Hugging Face's norms take it: the Llama casting's result is then float32
    (the weight times the normalized value in x's dtype), the Gemma casting's
    x's dtype. docs/mixed-precision.md: this and the behaviour under autocast.
    """
    _require_tensors("fusedllm.rms_norm", "input", x, weight=weight)
    if weight is not None and _mixed(x.dtype, weight.dtype) and not _autocast.casts_to_float32("rms_norm", x):
        return _norm_with_float32_weight(
            lambda h, w, off: ops_for(h).rms_norm(h, w, eps, off, casting), x, weight, offset, casting)[0]
    out, _rstd = ops_for(x).rms_norm(x, weight, eps, offset, casting)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None,
                       eps: float = 1e-6, offset: float = 0.0, casting: str = "llama"):
    """``h = x + residual; return rms_norm(h), h`` in one pass over memory.

    ``h`` (rounded to ``x.dtype``) is the new residual stream of a pre-norm block.
    A float32 residual with bfloat16 / float16 ``x`` or the other way round (a
    float32 residual stream under autocast) adds in float32, as ``x + residual``
    would, and ``h`` is float32; the weight is then taken as in :func:`rms_norm`.
    """
    _require_tensors("fusedllm.fused_add_rms_norm", "input", x, residual=residual, weight=weight)
    mixed_residual = _mixed(x.dtype, residual.dtype) or _mixed(residual.dtype, x.dtype)
    mixed_weight = weight is not None and _mixed(x.dtype, weight.dtype)
    # (under an autocast that casts to float32 the op takes any mix itself)
    if (mixed_residual or mixed_weight) and not _autocast.casts_to_float32("fused_add_rms_norm", x):
        if mixed_residual:
            x, residual = x.float(), residual.float()  # exact; the add then rounds once, as torch's would
        else:
            out, residual_out, _rstd = _norm_with_float32_weight(
                lambda h, w, off: ops_for(h).fused_add_rms_norm(h, residual.to(h.dtype), w, eps, off, casting),
                x, weight, offset, casting)
            return out, residual_out
    out, residual_out, _rstd = ops_for(x).fused_add_rms_norm(x, residual, weight, eps, offset, casting)
    return out, residual_out


# --- the plain path: twins of the compiled operator's checks and results ---------------------------


def _check_rms_norm(op, input, residual, weight, eps, offset, casting):
    if input.dim() < 1:
        _fail(op, "input must have at least one dimension")
    _check_float(op, "input", input)
    if not (math.isfinite(eps) and eps >= 0):
        _fail(op, f"eps must be a finite number >= 0, got {eps:g}")
    if not math.isfinite(offset):
        _fail(op, f"offset must be finite, got {offset:g}")
    n = input.shape[-1]
    if weight is not None:
        _check_same(op, "input", input, "weight", weight)
        if weight.dim() != 1 or weight.shape[0] != n:
            _fail(op, f"weight must have shape [{n}] (the last dim of input), got {list(weight.shape)}")
    elif offset != 0.0:
        _fail(op, f"offset={offset:g} needs a weight (y = x * rstd * (offset + weight))")
    if casting not in CASTINGS:
        _fail(op, f"casting must be 'llama' or 'gemma', got '{casting}'")
    if residual is not None:
        _check_same(op, "input", input, "residual", residual)
        if residual.shape != input.shape:
            _fail(op, f"residual must have the shape of input {list(input.shape)}, got {list(residual.shape)}")


def _rms_scale(h: torch.Tensor, weight, eps: float, offset: float, casting: str):
    acc = accumulation_dtype(h)
    hf = h.to(acc)
    rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    normed = hf * rstd
    if weight is None:
        out = normed.to(h.dtype)
    elif casting == "llama":
        out = (normed.to(h.dtype).to(acc) * (weight.to(acc) + offset)).to(h.dtype)
    else:
        out = (normed * (weight.to(acc) + offset)).to(h.dtype)
    return out, rstd.squeeze(-1).detach()


@_plain.op("rms_norm")
def _plain_rms_norm(input, weight, eps, offset, casting):
    _check_rms_norm("fusedllm.rms_norm", input, None, weight, eps, offset, casting)
    return _rms_scale(input, weight, eps, offset, casting)


@_plain.op("fused_add_rms_norm")
def _plain_fused_add_rms_norm(input, residual, weight, eps, offset, casting):
    _check_rms_norm("fusedllm.fused_add_rms_norm", input, residual, weight, eps, offset, casting)
    h = input + residual
    out, rstd = _rms_scale(h, weight, eps, offset, casting)
    return out, h, rstd


# --- fake kernels ----------------------------------------------------------------------------------


@_fake.fake("rms_norm")
def _rms_norm_fake(input, weight, eps, offset, casting):
    return input.new_empty(input.shape), input.new_empty(input.shape[:-1], dtype=accumulation_dtype(input))


@_fake.fake("fused_add_rms_norm")
def _fused_add_rms_norm_fake(input, residual, weight, eps, offset, casting):
    return (
        input.new_empty(input.shape),
        input.new_empty(input.shape),
        input.new_empty(input.shape[:-1], dtype=accumulation_dtype(input)),
    )


@_fake.fake("rms_norm_backward")
def _rms_norm_backward_fake(grad_out, input, rstd, weight, offset, casting, grad_residual,
                            compute_weight_grad):
    n = input.shape[-1] if (weight is not None and compute_weight_grad) else 0
    return input.new_empty(input.shape), input.new_empty((n,))


# --- on DTensors -----------------------------------------------------------------------------------


@_sharding.rule("rms_norm")
def _shard_rms_norm(input, weight, eps, offset, casting):
    # out, rstd | input, weight
    rules = [([replicate(), replicate()], [replicate(), _on(weight, replicate())])]
    rules += [([shard(d), shard(d)], [shard(d), _on(weight, replicate())]) for d in _rows(input)]
    return rules


@_sharding.rule("fused_add_rms_norm")
def _shard_fused_add_rms_norm(input, residual, weight, eps, offset, casting):
    rules = [([replicate()] * 3, [replicate(), replicate(), _on(weight, replicate())])]
    rules += [([shard(d)] * 3, [shard(d), shard(d), _on(weight, replicate())]) for d in _rows(input)]
    return rules


@_sharding.rule("rms_norm_backward")
def _shard_rms_norm_backward(grad_out, input, rstd, weight, offset, casting, grad_residual,
                             compute_weight_grad):
    # grad_input, grad_weight | grad_out, input, rstd, weight, grad_residual.
    # A shard's rows give part of the weight's gradient: a sum over ranks (Partial).
    rules = [([replicate(), replicate()],
              [replicate(), replicate(), replicate(), _on(weight, replicate()), None, None,
               _on(grad_residual, replicate())])]
    grad_weight = partial() if weight is not None else replicate()  # else an empty tensor
    rules += [([shard(d), grad_weight],
               [shard(d), shard(d), shard(d), _on(weight, replicate()), None, None,
                _on(grad_residual, shard(d))]) for d in _rows(input)]
    return rules
