"""Quantized KV caches: ``quantize_kv`` (int8 or float8 codes and a scale per row).

Here: the functions, each operator's plain-PyTorch twin with its checks, the
fake kernels and the DTensor rules (no autocast rule: autocast leaves it alone)."""

from __future__ import annotations

import math

import torch

from .. import _fake, _plain, _sharding
from .._checks import _check_float, _fail, _require_tensors
from .._devices import ops_for
from .._limits import KV_CODES
from .._sharding import _pinned, _rows, replicate, shard

__all__ = ["quantize_kv"]


def quantize_kv(x: torch.Tensor, values: torch.Tensor | None = None,
                scales: torch.Tensor | None = None,
                dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys or values ``x [..., head_dim]`` (up to 4-D, e.g. ``[batch, kv_heads,
    seq, head_dim]`` after RoPE) as int8 rows and one float32 scale per row,
    in one pass: ``scale = max|x| / 127`` and ``values = round(x * 127 / max|x|)``
    (half to even; an all-zero row has scale 0), so ``values * scale`` is
    within ``scale / 2`` of ``x``. A row holding an infinite or NaN entry gets
    scale NaN, so attention over it gives NaN as over the float row.

    ``dtype=torch.float8_e4m3fn`` stores float8 codes instead (4 exponent
    bits, 3 mantissa bits): ``scale = max|x| / 448`` and ``values = x * 448 /
    max|x|`` rounded to the nearest code (half to even): within ``2^-4 |x|``
    of ``x`` where ``|x| >= 2^-6 scale``, within ``2^-10 scale`` below, so
    small entries keep their relative precision where int8 rounds them to a
    step of ``max|x| / 127``.

    ``values`` (int8 or float8_e4m3fn, x's shape) and ``scales`` (float32,
    x's shape without the last dim) are written in place when given, e.g.
    slots of a cache (``cache_k[:, :, start:end]``, any strides; their dtype
    then says which code); otherwise they are allocated (``dtype``: int8 by
    default). Returns ``(values, scales)``. Read them with
    ``attention(q, values, ..., k_scale=scales, ...)``. No gradient.
    """
    op = "fusedllm.quantize_kv"
    _require_tensors(op, "x", x, values=values, scales=scales)
    if (values is None) != (scales is None):
        raise ValueError(f"{op}: values and scales go together: pass both (the slots to write) or neither")
    if dtype not in (None, torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"{op}: dtype must be None, torch.int8 or torch.float8_e4m3fn, got {dtype!r}")
    if values is not None and dtype is not None and values.dtype != dtype:
        raise ValueError(f"{op}: dtype={dtype} but values is {values.dtype}: values' dtype says what is "
                         f"stored; pass one of them")
    if values is None:
        values = torch.empty(x.shape, dtype=dtype or torch.int8, device=x.device)
        scales = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    ops_for(x).quantize_kv(x, values, scales)
    return values, scales


# --- the plain path: twins of the compiled operator's checks and results ---------------------------


@_plain.op("quantize_kv")
def _plain_quantize_kv(x, values, scales):
    """The quantize_kv op: int8 (or float8_e4m3fn, as values' dtype says) rows of x and their
    float32 scales, written into values and scales."""
    op = "fusedllm.quantize_kv"
    _check_float(op, "x", x)
    if not 1 <= x.dim() <= 4:
        _fail(op, f"x must have 1 to 4 dims [..., head_dim], got shape {list(x.shape)}")
    if values.dtype not in KV_CODES:
        _fail(op, f"values must be int8 or float8_e4m3fn, got {values.dtype}")
    if scales.dtype != torch.float32:
        _fail(op, f"scales must be float32, got {scales.dtype}")
    if values.shape != x.shape:
        _fail(op, f"values must have x's shape {list(x.shape)}, got {list(values.shape)}")
    if scales.shape != x.shape[:-1]:
        _fail(op, f"scales must be x's shape without its last dim {list(x.shape[:-1])}, got {list(scales.shape)}")
    for name, t in (("values", values), ("scales", scales)):
        if t.device != x.device:
            _fail(op, f"{name} is on {t.device} but x is on {x.device}")
        if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
            _fail(op, f"{name} has elements that share memory (an expanded view): it is written to")
    xf = x.float()
    # a max that skips NaN, as the kernels' fmax does; the probe marks the row
    magnitude = xf.abs().nan_to_num(nan=0.0, posinf=math.inf)
    amax = magnitude.amax(-1) if x.shape[-1] else xf.new_zeros(x.shape[:-1])
    probe = (xf * 0).sum(-1)
    levels = 127.0 if values.dtype == torch.int8 else 448.0
    inverse = torch.where(amax > 0, torch.full_like(amax, levels) / amax, torch.zeros_like(amax))
    y = xf * inverse.unsqueeze(-1)
    if values.dtype == torch.int8:
        values.copy_(torch.nan_to_num(torch.round(y), nan=-127.0).clamp(-127, 127).to(torch.int8))
    else:  # NaN (a non-finite row) as the code 0x7F, as the kernels store it
        codes = y.clamp(-levels, levels).to(torch.float8_e4m3fn).view(torch.uint8)
        values.copy_(torch.where(y.isnan(), 0x7F, codes).to(torch.uint8).view(torch.float8_e4m3fn))
    scales.copy_(amax / levels + probe)


# --- fake kernels ----------------------------------------------------------------------------------


@_fake.fake("quantize_kv")
def _quantize_kv_fake(x, values, scales):
    return None


# --- on DTensors -----------------------------------------------------------------------------------


@_sharding.rule("quantize_kv")
def _shard_quantize_kv(x, values, scales):
    # rows of the last dim are quantized one by one: any other dim may be sharded
    rules = [([replicate()] * 3, (1, 2))] + [([shard(d)] * 3, (1, 2)) for d in _rows(x)]
    return [([], inputs) for inputs in _pinned("quantize_kv", ("values", "scales"),
                                              (values, scales), rules)]
