"""One function per fused op: checks arguments (errors name the argument),
then calls ``torch.ops.fusedllm`` or, without the extension, the plain path."""

from __future__ import annotations

import math
from numbers import Integral, Real

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


_MAX_HEAD_DIM = 256


def _check_attention(op, q, k, v, causal, scale, window):
    for name, t in (("q", q), ("k", k), ("v", v)):
        _require_tensor(op, name, t)
    _require_float(op, "q", q)
    _require_like(op, "k", k, "q", q)
    _require_like(op, "v", v, "q", q)
    for name, t, heads, length in (("q", q, "q_heads", "q_len"), ("k", k, "kv_heads", "kv_len"),
                                   ("v", v, "kv_heads", "kv_len")):
        if t.dim() != 4:
            raise ValueError(f"{op}: {name} must be 4-D [batch, {heads}, {length}, head_dim], "
                             f"got shape {list(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"{op}: k and v must have the same shape, got {list(k.shape)} and "
                         f"{list(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"{op}: q and k/v must have the same batch size, got {q.shape[0]} and "
                         f"{k.shape[0]}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"{op}: q and k/v must have the same head_dim, got {q.shape[3]} and "
                         f"{k.shape[3]}")
    q_heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[3]
    if (q_heads % kv_heads != 0) if kv_heads else q_heads != 0:
        raise ValueError(f"{op}: the number of query heads ({q_heads}) must be a multiple of the "
                         f"number of key/value heads ({kv_heads})")
    if not 1 <= head_dim <= _MAX_HEAD_DIM:
        raise ValueError(f"{op}: head_dim must be between 1 and {_MAX_HEAD_DIM}, got {head_dim}")
    if not isinstance(causal, bool):
        raise ValueError(f"{op}: causal must be True or False, got {causal!r}")
    scale = head_dim ** -0.5 if scale is None else _require_number(op, "scale", scale)
    if window is None:
        window = -1
    elif isinstance(window, bool) or not isinstance(window, Integral) or window < 1:
        raise ValueError(f"{op}: window must be None or an int >= 1 (the number of keys a query "
                         f"sees, itself included), got {window!r}")
    return scale, int(window)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """Grouped-query attention ``softmax(q k^T * scale + mask) v``, flash style.

    ``q`` is ``[batch, q_heads, q_len, head_dim]``, ``k`` and ``v`` are
    ``[batch, kv_heads, kv_len, head_dim]`` with ``q_heads`` a multiple of
    ``kv_heads``: query head ``h`` attends with kv head ``h // (q_heads // kv_heads)``
    (K and V are never repeated in memory). ``scale`` defaults to ``head_dim ** -0.5``.

    Masks are aligned bottom-right: query ``i`` sits at position ``i + kv_len - q_len``
    (the queries are the last ``q_len`` positions, as when decoding with a KV cache).
    ``causal=True`` lets it see keys ``j <= i + kv_len - q_len``. This equals
    ``F.scaled_dot_product_attention(is_causal=True)`` when ``q_len == kv_len``; when
    they differ SDPA aligns top-left (query ``i`` sees keys ``j <= i``) instead.
    ``window=w`` keeps only the last ``w`` keys up to a query's position,
    ``j > i + kv_len - q_len - w`` (itself included): with ``causal=True`` this is
    Mistral's / Hugging Face's ``sliding_window``. A query that sees no key
    (possible when ``q_len > kv_len``) gets an output of zeros.

    float32, float64, bfloat16 and float16, accumulated in float32 (float64 for
    float64); memory grows linearly with the sequence lengths, never with
    ``q_len * kv_len``. Differentiable in ``q``, ``k`` and ``v``.
    """
    op = "fusedllm.attention"
    scale, window = _check_attention(op, q, k, v, causal, scale, window)
    impl = torch.ops.fusedllm.attention if has_extension() else _fallback.attention
    out, _lse = impl(q, k, v, scale, causal, window)
    return out
