"""Rotary position embedding: ``apply_rope``.

Here: the functions, each operator's plain-PyTorch twin with its checks, the
fake kernels and the DTensor rules (no autocast rule: autocast leaves it alone)."""

from __future__ import annotations

from numbers import Integral

import torch

from .. import _fake, _plain, _sharding
from .._checks import _check_float, _check_same, _fail, _require_tensors
from .._devices import ops_for
from .._limits import accumulation_dtype, check_rotary_dim
from .._sharding import _on, _pinned, _placement_on, replicate, shard

__all__ = ["apply_rope"]


def _hf_table_layout(op: str, cos: torch.Tensor, q: torch.Tensor, rotary_dim: int,
                     rotary_dim_given: bool) -> bool:
    """Whether cos/sin are Hugging Face's full-width tables (True) or ours (False).

    Ours are half-width: ``[positions, rotary_dim / 2]`` or per token
    ``[B, S, rotary_dim / 2]``. Hugging Face's are full-width ``[B, S, rotary_dim]``
    with duplicated halves, read per token only (what its rotary module returns):
    a 2-D table of width rotary_dim is as likely ours built for twice the dim,
    so it is refused rather than guessed. Per token, width head_dim / 2 without
    rotary_dim is our full rotation or Hugging Face's rotation of half the head:
    refused too.
    """
    width, half = cos.shape[-1], rotary_dim // 2
    shapes = f"cos and sin have shape {list(cos.shape)}, q has shape {list(q.shape)}"
    if cos.dim() == 3 and width == half and not rotary_dim_given:
        raise ValueError(f"{op}: per-token cos and sin are ambiguous ({shapes}): last dim {width} reads "
                         f"as fusedllm's half-width table for rotary_dim={rotary_dim} or as Hugging "
                         f"Face's full-width one for rotary_dim={width}; pass rotary_dim")
    if width == half:
        return False
    if cos.dim() == 3 and width == rotary_dim:
        return True
    raise ValueError(f"{op}: cos and sin do not fit rotary_dim={rotary_dim} ({shapes}): read as "
                     f"fusedllm's half-width table [positions, rotary_dim / 2] (or per token "
                     f"[B, S, rotary_dim / 2]) they need last dim {half}; Hugging Face's full-width "
                     f"duplicated-halves layout [B, S, rotary_dim] (last dim {rotary_dim}) is read "
                     f"per token only")


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               position_ids: torch.Tensor | None = None, offset: int = 0, interleaved: bool = False,
               rotary_dim: int | None = None, inplace: bool = False):
    """Rotary position embedding of ``q [B, Hq, S, D]`` and ``k [B, Hkv, S, D]``.

    ``cos`` / ``sin`` are either tables ``[positions, rotary_dim / 2]`` (from
    :func:`fusedllm.rope_tables`), looked up at ``position_ids`` (``[S]`` or
    ``[B, S]``) or at ``offset + s`` (a KV cache's length), or Hugging Face's
    per-token ``[B, S, rotary_dim]`` tables with duplicated halves (what its
    rotary embedding module returns), so this stands in for HF's
    ``apply_rotary_pos_emb``. Tables are used in float32 whatever q's dtype.
    A table whose width fits neither reading, or (per token, without
    ``rotary_dim``) both, is an error.

    ``interleaved=False`` pairs feature ``i`` with ``i + rotary_dim / 2`` (NeoX,
    Llama); ``True`` pairs ``2i`` with ``2i + 1`` (GPT-J). Only the first
    ``rotary_dim`` features (default: all) rotate; the rest pass through.
    q and k may be strided views (e.g. slices of a fused QKV projection).
    Returns new tensors, or rotates q and k in place with ``inplace=True``
    (inference only: no autograd).
    """
    op = "fusedllm.apply_rope"
    _require_tensors(op, "q", q, k=k, cos=cos, sin=sin, position_ids=position_ids)
    rotary_dim_given = rotary_dim is not None
    rotary_dim = check_rotary_dim(op, rotary_dim, q.shape[-1] if q.dim() else 0)
    if isinstance(offset, bool) or not isinstance(offset, Integral):
        raise ValueError(f"{op}: offset must be an int, got {offset!r}")
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError(f"{op}: cos and sin are constants here; gradients to them are not computed")
    if cos.dim() in (2, 3) and _hf_table_layout(op, cos, q, rotary_dim, rotary_dim_given):
        # both members of a pair carry the angle: keep one of each pair
        pick = slice(0, None, 2) if interleaved else slice(0, rotary_dim // 2)
        cos, sin = cos[..., pick], sin[..., pick]
    if inplace:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            raise ValueError(f"{op}: inplace=True has no autograd; use inplace=False for training")
        ops_for(q).rope_(q, k, cos, sin, position_ids, int(offset), interleaved, rotary_dim, False)
        return q, k
    return ops_for(q).rope(q, k, cos, sin, position_ids, int(offset), interleaved, rotary_dim, False)


# --- the plain path: twins of the compiled operator's checks and results ---------------------------


def _check_rope(op, q, k, cos, sin, position_ids, offset, rotary_dim, in_place=False):
    """rope's checks in plan_rope's order (csrc/include/fusedllm/rope_op.h); returns rotary_dim.
    ``in_place``: rope_, whose q and k need unit stride along their last dim."""
    _check_float(op, "q", q)
    _check_same(op, "q", q, "k", k)
    if q.dim() != 4 or k.dim() != 4:
        _fail(op, f"q and k must be [B, H, S, D], got {list(q.shape)} and {list(k.shape)}")
    batch, seq, head_dim = q.shape[0], q.shape[2], q.shape[3]
    if k.shape[0] != batch or k.shape[2] != seq:
        _fail(op, f"q and k must have the same batch and sequence sizes, got {list(q.shape)} and "
                  f"{list(k.shape)}")
    if k.shape[3] != head_dim:
        _fail(op, f"q and k must have the same head dim, got {head_dim} and {k.shape[3]}")
    rotary_dim = check_rotary_dim(op, None if rotary_dim == -1 else rotary_dim, head_dim)
    if offset < 0:
        _fail(op, f"offset must be >= 0, got {offset}")
    # the tables
    if cos.shape != sin.shape:
        _fail(op, f"cos and sin must have the same shape, got {list(cos.shape)} and {list(sin.shape)}")
    _check_float(op, "cos", cos)
    if cos.device != q.device or sin.device != q.device:
        _fail(op, f"cos and sin must be on {q.device} like q")
    if sin.dtype != cos.dtype:
        _fail(op, "cos and sin must have the same dtype")
    if cos.dim() not in (2, 3):
        _fail(op, f"cos and sin must be [positions, rotary_dim / 2] or [B, S, rotary_dim / 2], got "
                  f"{list(cos.shape)}")
    if cos.shape[-1] != rotary_dim // 2:
        _fail(op, f"cos and sin must have last dim {rotary_dim // 2} (rotary_dim / 2), got {cos.shape[-1]}")
    if cos.dim() == 3:
        if cos.shape[0] not in (1, batch):
            _fail(op, f"per-token cos/sin [B, S, rotary_dim / 2] must have batch 1 or {batch}, got "
                      f"{cos.shape[0]}")
        if cos.shape[1] != seq:
            _fail(op, f"per-token cos/sin must have {seq} rows (the sequence length), got {cos.shape[1]}")
        if position_ids is not None or offset:
            _fail(op, "per-token cos/sin [B, S, rotary_dim / 2] are already indexed by position; pass "
                      "position_ids or offset only with a [positions, rotary_dim / 2] table")
    rows = cos.shape[-2]  # a per-token table has a row per position of the sequence
    # the positions
    if position_ids is not None:
        if position_ids.dtype not in (torch.int64, torch.int32):
            _fail(op, f"position_ids must be int64 or int32, got {position_ids.dtype}")
        if position_ids.device != q.device:
            _fail(op, f"position_ids is on {position_ids.device} but q is on {q.device}")
        if not (tuple(position_ids.shape) == (seq,) or (position_ids.dim() == 2 and position_ids.shape[0]
                                                        in (1, batch) and position_ids.shape[1] == seq)):
            _fail(op, f"position_ids must be [S] or [B, S] = [{batch}, {seq}], got {list(position_ids.shape)}")
        if offset:
            _fail(op, "pass either position_ids or offset, not both")
        # A host read: this path is a reference, not a fast one; indexing would wrap negatives.
        outside = position_ids[(position_ids < 0) | (position_ids >= rows)]
        if outside.numel():
            _fail(op, f"position {int(outside[0])} is outside the cos/sin table of {rows} positions")
    elif offset + seq > rows:
        _fail(op, f"positions {offset}..{offset + seq - 1} are past the cos/sin table of {rows} positions")
    # the operands
    if in_place:
        for name, t in (("q", q), ("k", k)):
            if t.shape[3] > 1 and t.stride(3) != 1:
                _fail(op, f"in place, {name} needs unit stride along its last dim")
    return rotary_dim


def _rotate(x, cos, sin, interleaved, rotary_dim, inverse):
    acc = accumulation_dtype(x)
    xr = x[..., :rotary_dim].to(acc)
    if interleaved:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
    else:
        x0, x1 = xr.chunk(2, dim=-1)
    c, s = cos.to(acc), (-sin if inverse else sin).to(acc)
    r0, r1 = x0 * c - x1 * s, x1 * c + x0 * s
    rotated = torch.stack((r0, r1), dim=-1).flatten(-2) if interleaved else torch.cat((r0, r1), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


def _rope(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse):
    if cos.dim() == 3:  # per token [B, S, R/2]
        c, s = cos[:, None], sin[:, None]
    elif position_ids is not None:
        c, s = cos[position_ids], sin[position_ids]
        if c.dim() == 3:
            c, s = c[:, None], s[:, None]
    else:
        c, s = cos[offset:offset + q.shape[2]], sin[offset:offset + q.shape[2]]
    return (_rotate(q, c, s, interleaved, rotary_dim, inverse),
            _rotate(k, c, s, interleaved, rotary_dim, inverse))


@_plain.op("rope")
def _plain_rope(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse):
    rotary_dim = _check_rope("fusedllm.rope", q, k, cos, sin, position_ids, offset, rotary_dim)
    return _rope(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse)


@_plain.op("rope_")
def _plain_rope_(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse):
    rotary_dim = _check_rope("fusedllm.rope_", q, k, cos, sin, position_ids, offset, rotary_dim, in_place=True)
    rq, rk = _rope(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse)
    q.copy_(rq)
    k.copy_(rk)


# --- fake kernels ----------------------------------------------------------------------------------


@_fake.fake("rope")
def _rope_fake(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@_fake.fake("rope_")
def _rope_inplace_fake(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse):
    return None


# --- on DTensors -----------------------------------------------------------------------------------


def _rope_inputs(q, cos, position_ids, dim):
    """Placements of (q, k, cos, sin, position_ids) sharding q and k along
    ``dim`` of [B, H, S, D], or None where a shard cannot find its positions."""
    batch = q.shape[0]
    per_token = len(cos.shape) == 3  # [B or 1, S, rotary_dim / 2], already indexed by position
    if dim == 1:  # heads: every head rotates alike
        tables, pos = replicate(), replicate()
    elif dim == 0:
        tables = _placement_on(cos, 0, batch) if per_token else replicate()
        pos = None if position_ids is None else _placement_on(position_ids, len(position_ids.shape) - 2, batch)
    elif dim == 2:  # a shard of the sequence must know its positions
        if per_token:
            tables, pos = shard(1), None
        elif position_ids is not None:
            tables, pos = replicate(), shard(len(position_ids.shape) - 1)
        else:
            return None
    else:
        return None
    return [shard(dim), shard(dim), tables, tables, _on(position_ids, pos)]


def _rope_rules(q, k, cos, sin, position_ids):
    """(outputs' placement, inputs' placements) pairs; inputs q, k, cos, sin, position_ids."""
    rules = [(replicate(), [replicate()] * 4 + [_on(position_ids, replicate())])]
    for dim in (0, 1, 2):
        inputs = _rope_inputs(q, cos, position_ids, dim)
        if inputs is not None:
            rules.append((shard(dim), inputs))
    return rules


@_sharding.rule("rope")
def _shard_rope(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse):
    return [([out, out], inputs + [None] * 4) for out, inputs in _rope_rules(q, k, cos, sin, position_ids)]


@_sharding.rule("rope_")
def _shard_rope_inplace(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse):
    rules = [(inputs + [None] * 4, (0, 1)) for _, inputs in _rope_rules(q, k, cos, sin, position_ids)]
    return [([], inputs) for inputs in _pinned("rope_", ("q", "k"), (q, k), rules)]
