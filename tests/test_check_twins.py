"""Each argument check of the C++ operators (csrc/include/fusedllm/*_op.h,
checks.h, autograd.cpp) has a word-for-word twin on the plain path
(fusedllm._checks, fusedllm._plain, fusedllm._limits). One table drives bad
(and a few good) inputs through both, ``torch.ops.fusedllm.X(*args)`` and
``fusedllm._plain.X(*args)``: both must accept, or both refuse with the same
exception type and the same message, and the compiled message must be the one
the table states. A coverage test runs the table's plain calls and requires
every refusal written in _checks.py, _plain.py and _limits.py to be reached,
except those listed in UNREACHABLE with the reason.

Adding an op: add rows (``row(op, name, build, expect)``). A row where the two
disagree today stays in the table with ``plain=`` (what the plain path does
now) and ``why=``: its agreement test is a strict xfail.
CPU tensors only: the compiled side runs its CPU kernels."""

from __future__ import annotations

import ast
import inspect
import os
import re
import traceback
from typing import Callable, NamedTuple

import pytest
import torch

import fusedllm  # noqa: F401  (loads the extension: torch.ops.fusedllm)
from fusedllm import _checks, _limits, _plain

ops = torch.ops.fusedllm
SAME = object()  # the plain path agrees with the compiled one


class Case(NamedTuple):
    id: str
    op: str
    build: Callable[[], tuple]  # fresh positional arguments, the same for both implementations
    # the compiled message after "fusedllm.<op>: " (attention_varlen for packed attention calls; or whole,
    # when it starts with "fusedllm."); None: accepted
    expect: str | re.Pattern | None
    plain: object  # SAME, or what the plain path does today: None (accepts), a message as expect, (type, message)
    why: str | None  # why the two disagree (a strict xfail)


CASES: list[Case] = []


def row(op, name, build, expect=None, *, plain=SAME, why=None):
    assert (plain is SAME) == (why is None), name
    CASES.append(Case(f"{op}-{name}", op, build, expect, plain, why))


def T(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def I(*values, dtype=torch.int32):  # noqa: E743
    return torch.tensor(values, dtype=dtype)


F8 = torch.float8_e4m3fn
NAN, INF = float("nan"), float("inf")


# --- rms_norm, fused_add_rms_norm: (input, [residual,] weight, eps, offset, casting) ---------------

def rms(x=None, weight=None, eps=1e-6, offset=0.0, casting="llama"):
    return (T(4, 16) if x is None else x, weight, eps, offset, casting)


row("rms_norm", "valid", lambda: rms(weight=T(16), offset=1.0, casting="gemma"))
row("rms_norm", "valid_no_weight", lambda: rms())
row("rms_norm", "zero_dims", lambda: rms(torch.tensor(1.0)), "input must have at least one dimension")
row("rms_norm", "input_int", lambda: rms(torch.ones(4, 16, dtype=torch.long)),
    "input must be float32, float64, bfloat16 or float16, got torch.int64")
row("rms_norm", "input_int32", lambda: rms(torch.ones(4, 16, dtype=torch.int32)),
    "input must be float32, float64, bfloat16 or float16, got torch.int32")
row("rms_norm", "eps_negative", lambda: rms(eps=-1e-6), "eps must be a finite number >= 0, got -1e-06")
row("rms_norm", "eps_nan", lambda: rms(eps=NAN), "eps must be a finite number >= 0, got nan")
row("rms_norm", "offset_inf", lambda: rms(weight=T(16), offset=INF), "offset must be finite, got inf")
row("rms_norm", "weight_dtype", lambda: rms(weight=T(16).half()),
    "weight has dtype torch.float16 but input has dtype torch.float32")
row("rms_norm", "weight_shape", lambda: rms(weight=T(15)),
    "weight must have shape [16] (the last dim of input), got [15]")
row("rms_norm", "weight_2d", lambda: rms(weight=T(1, 16)),
    "weight must have shape [16] (the last dim of input), got [1, 16]")
row("rms_norm", "offset_without_weight", lambda: rms(offset=1.0),
    "offset=1 needs a weight (y = x * rstd * (offset + weight))")
row("rms_norm", "casting", lambda: rms(casting="t5"), "casting must be 'llama' or 'gemma', got 't5'")


def add_rms(x=None, residual=None, weight=None, eps=1e-6, offset=0.0, casting="llama"):
    return (T(4, 16) if x is None else x, T(4, 16) if residual is None else residual, weight, eps, offset,
            casting)


row("fused_add_rms_norm", "valid", lambda: add_rms(weight=T(16)))
row("fused_add_rms_norm", "zero_dims", lambda: add_rms(torch.tensor(1.0), torch.tensor(2.0)),
    "input must have at least one dimension")
row("fused_add_rms_norm", "input_int", lambda: add_rms(torch.ones(4, 16, dtype=torch.long)),
    "input must be float32, float64, bfloat16 or float16, got torch.int64")
row("fused_add_rms_norm", "eps_inf", lambda: add_rms(eps=INF), "eps must be a finite number >= 0, got inf")
row("fused_add_rms_norm", "weight_shape", lambda: add_rms(weight=T(8)),
    "weight must have shape [16] (the last dim of input), got [8]")
row("fused_add_rms_norm", "casting", lambda: add_rms(casting="Llama"),
    "casting must be 'llama' or 'gemma', got 'Llama'")
row("fused_add_rms_norm", "residual_shape", lambda: add_rms(residual=T(4, 8)),
    "residual must have the shape of input [4, 16], got [4, 8]")
row("fused_add_rms_norm", "residual_1d", lambda: add_rms(residual=T(16)),
    "residual must have the shape of input [4, 16], got [16]")
row("fused_add_rms_norm", "residual_dtype", lambda: add_rms(residual=T(4, 16).double()),
    "residual has dtype torch.float64 but input has dtype torch.float32")


# --- swiglu (gate, up, activation), swiglu_packed (gate_up, activation) --------------------------

row("swiglu", "valid", lambda: (T(4, 8), T(4, 8), "gelu_tanh"))
row("swiglu", "shape", lambda: (T(4, 8), T(4, 9), "silu"),
    "gate and up must have the same shape, got [4, 8] and [4, 9]")
row("swiglu", "up_dtype", lambda: (T(4, 8), T(4, 8).half(), "silu"),
    "up has dtype torch.float16 but gate has dtype torch.float32")
row("swiglu", "gate_int", lambda: (torch.ones(4, 8, dtype=torch.int32),) * 2 + ("silu",),
    "gate must be float32, float64, bfloat16 or float16, got torch.int32")
row("swiglu", "zero_dims", lambda: (torch.tensor(1.0), torch.tensor(2.0), "silu"),
    "gate must have at least one dimension")
row("swiglu", "activation", lambda: (T(4, 8), T(4, 8), "relu"), "activation must be 'silu' or 'gelu_tanh', got 'relu'")

row("swiglu_packed", "valid", lambda: (T(4, 8), "silu"))
row("swiglu_packed", "odd", lambda: (T(4, 7), "silu"),
    "gate_up must be packed [..., 2 * F] as [gate | up]; its last dim 7 is odd")
row("swiglu_packed", "int", lambda: (torch.ones(4, 8, dtype=torch.long), "silu"),
    "gate_up must be float32, float64, bfloat16 or float16, got torch.int64")
row("swiglu_packed", "zero_dims", lambda: (torch.tensor(1.0), "silu"), "gate_up must have at least one dimension")
row("swiglu_packed", "activation", lambda: (T(4, 8), "tanh"), "activation must be 'silu' or 'gelu_tanh', got 'tanh'")


# --- rope, rope_: (q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse) -------
# q [2, 4, 5, 16], k [2, 2, 5, 16], tables of 8 positions [8, 8].

def rope(q=None, k=None, cos=None, sin=None, position_ids=None, offset=0, interleaved=False, rotary_dim=-1,
         inverse=False):
    cos = T(8, 8) if cos is None else cos
    return (T(2, 4, 5, 16) if q is None else q, T(2, 2, 5, 16) if k is None else k, cos,
            T(*cos.shape) if sin is None else sin, position_ids, offset, interleaved, rotary_dim, inverse)


for _op in ("rope", "rope_"):
    row(_op, "valid", lambda: rope(interleaved=True, inverse=True))
    row(_op, "valid_positions", lambda: rope(position_ids=I(7, 6, 0, 1, 2)))
    row(_op, "valid_per_token", lambda: rope(cos=T(1, 5, 8)))
    row(_op, "valid_partial", lambda: rope(cos=T(8, 4), rotary_dim=8))
    row(_op, "q_int", lambda: rope(q=torch.ones(2, 4, 5, 16, dtype=torch.long)),
        "q must be float32, float64, bfloat16 or float16, got torch.int64")
    row(_op, "k_dtype", lambda: rope(k=T(2, 2, 5, 16).double()),
        "k has dtype torch.float64 but q has dtype torch.float32")
    row(_op, "q_3d", lambda: rope(q=T(2, 5, 16)), "q and k must be [B, H, S, D], got [2, 5, 16] and [2, 2, 5, 16]")
    row(_op, "batch", lambda: rope(k=T(1, 2, 5, 16)),
        "q and k must have the same batch and sequence sizes, got [2, 4, 5, 16] and [1, 2, 5, 16]")
    row(_op, "head_dim", lambda: rope(k=T(2, 2, 5, 8)), "q and k must have the same head dim, got 16 and 8")
    for _r in (7, 0, 32, -2):
        row(_op, f"rotary_dim_{_r}", lambda r=_r: rope(cos=T(8, max(r, 0) // 2), rotary_dim=r),
            f"rotary_dim must be a positive even number at most the head dim 16, got {_r}")
    row(_op, "offset_negative", lambda: rope(offset=-1), "offset must be >= 0, got -1")
    row(_op, "table_shapes", lambda: rope(cos=T(8, 8), sin=T(8, 4)),
        "cos and sin must have the same shape, got [8, 8] and [8, 4]")
    row(_op, "table_int", lambda: rope(cos=torch.ones(8, 8, dtype=torch.long), sin=torch.ones(8, 8, dtype=torch.long)),
        "cos must be float32, float64, bfloat16 or float16, got torch.int64")
    row(_op, "table_1d", lambda: rope(cos=T(8)),
        "cos and sin must be [positions, rotary_dim / 2] or [B, S, rotary_dim / 2], got [8]")
    row(_op, "table_width", lambda: rope(cos=T(8, 5)), "cos and sin must have last dim 8 (rotary_dim / 2), got 5")
    row(_op, "per_token_with_offset", lambda: rope(cos=T(2, 5, 8), offset=1),
        "per-token cos/sin [B, S, rotary_dim / 2] are already indexed by position; pass position_ids or offset "
        "only with a [positions, rotary_dim / 2] table")
    row(_op, "per_token_with_positions", lambda: rope(cos=T(2, 5, 8), position_ids=I(0, 1, 2, 3, 4)),
        "per-token cos/sin [B, S, rotary_dim / 2] are already indexed by position; pass position_ids or offset "
        "only with a [positions, rotary_dim / 2] table")
    row(_op, "offset_past_table", lambda: rope(offset=4), "positions 4..8 are past the cos/sin table of 8 positions")
    row(_op, "positions_dtype", lambda: rope(position_ids=torch.zeros(5)),
        "position_ids must be int64 or int32, got torch.float32")
    row(_op, "positions_shape", lambda: rope(position_ids=torch.zeros(3, 5, dtype=torch.long)),
        "position_ids must be [S] or [B, S] = [2, 5], got [3, 5]")
    row(_op, "positions_and_offset", lambda: rope(position_ids=I(0, 1, 2, 3, 4), offset=1),
        "pass either position_ids or offset, not both")
    row(_op, "position_past_table", lambda: rope(position_ids=I(0, 1, 2, 3, 8, dtype=torch.long)),
        f"fusedllm.{_op}: position 8 is outside the cos/sin table of 8 positions")
    row(_op, "position_negative", lambda: rope(position_ids=I([0, 1, 2, 3, 4], [0, 1, -1, 3, 4])),
        f"fusedllm.{_op}: position -1 is outside the cos/sin table of 8 positions")
    row(_op, "position_past_table_no_heads",
        lambda: rope(T(2, 0, 5, 16), T(2, 0, 5, 16), position_ids=I(0, 1, 2, 3, 8)),
        f"fusedllm.{_op}: position 8 is outside the cos/sin table of 8 positions")
    # the tables' dtypes, the per-token table's batch and rows
    row(_op, "sin_dtype", lambda: rope(cos=T(8, 8), sin=T(8, 8).double()), "cos and sin must have the same dtype")
    row(_op, "per_token_batch", lambda: rope(cos=T(3, 5, 8)),
        "per-token cos/sin [B, S, rotary_dim / 2] must have batch 1 or 2, got 3")
    row(_op, "per_token_rows", lambda: rope(cos=T(2, 4, 8)),
        "per-token cos/sin must have 5 rows (the sequence length), got 4")
row("rope_", "strided", lambda: rope(q=T(2, 4, 5, 32)[..., ::2]), "in place, q needs unit stride along its last dim")


# --- attention: the 21 positional arguments of the schema --------------------------------------

ATTENTION_ARGS = ("mask", "scale", "causal", "window", "dropout_p", "seed", "window_right", "softcap", "sinks",
                  "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "k_scale",
                  "v_scale", "kv_lens", "block_table")
ATTENTION_DEFAULTS = dict(mask=None, scale=0.5, causal=False, window=-1, dropout_p=0.0, seed=None, window_right=-1,
                          softcap=0.0, sinks=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None,
                          max_seqlen_q=0, max_seqlen_k=0, k_scale=None, v_scale=None, kv_lens=None,
                          block_table=None)


def attn(q, k, v, **options):
    assert set(options) <= set(ATTENTION_ARGS), options
    values = dict(ATTENTION_DEFAULTS, **options)
    return (q, k, v, *(values[name] for name in ATTENTION_ARGS))


def dense(q=None, k=None, v=None, **options):
    """q [2, 4, 5, 8], k and v [2, 2, 5, 8]."""
    return attn(T(2, 4, 5, 8) if q is None else q, T(2, 2, 5, 8) if k is None else k,
                T(2, 2, 5, 8) if v is None else v, **options)


def varlen(q=None, k=None, v=None, cu_q=None, cu_k=None, **options):
    """Three sequences of 2, 3 and 4 queries and 4, 3 and 2 keys: q [9, 4, 8], k and v [9, 2, 8]."""
    return attn(T(9, 4, 8) if q is None else q, T(9, 2, 8) if k is None else k, T(9, 2, 8) if v is None else v,
                cu_seqlens_q=I(0, 2, 5, 9) if cu_q is None else cu_q,
                cu_seqlens_k=I(0, 4, 7, 9) if cu_k is None else cu_k, **options)


row("attention", "valid", lambda: dense(mask=torch.ones(5, 5, dtype=torch.bool), causal=True, window=3,
                                        window_right=1, softcap=20.0, sinks=T(4), alibi_slopes=T(2, 4)))
row("attention", "valid_float_mask_dropout",
    lambda: dense(mask=T(2, 1, 1, 5).half(), dropout_p=0.3, seed=I(7, dtype=torch.long)))
row("attention", "valid_empty", lambda: dense(T(0, 4, 5, 8), T(0, 2, 5, 8), T(0, 2, 5, 8)))
row("attention", "valid_head_dim_256", lambda: dense(T(1, 2, 2, 256), T(1, 1, 2, 256), T(1, 1, 2, 256)))
row("attention", "cu_seqlens_q_alone", lambda: dense(T(9, 4, 8), T(9, 2, 8), T(9, 2, 8), cu_seqlens_q=I(0, 9)),
    "cu_seqlens_q and cu_seqlens_k go together: pass both or neither")
row("attention", "cu_seqlens_k_alone", lambda: dense(T(9, 4, 8), T(9, 2, 8), T(9, 2, 8), cu_seqlens_k=I(0, 9)),
    "cu_seqlens_q and cu_seqlens_k go together: pass both or neither")
row("attention", "q_not_4d", lambda: dense(q=T(2, 3, 8)),
    "q must be 4-D [batch, q_heads, q_len, head_dim], got shape [2, 3, 8]")
row("attention", "k_not_4d", lambda: dense(k=T(2, 5, 8)),
    "k must be 4-D [batch, kv_heads, kv_len, head_dim], got shape [2, 5, 8]")
row("attention", "v_not_4d", lambda: dense(v=T(1, 2, 2, 5, 8)),
    "v must be 4-D [batch, kv_heads, kv_len, head_dim], got shape [1, 2, 2, 5, 8]")
row("attention", "q_int", lambda: dense(*(torch.ones(2, 2, 5, 8, dtype=torch.long),) * 3),
    "q must be float32, float64, bfloat16 or float16, got torch.int64")
row("attention", "k_dtype", lambda: dense(k=T(2, 2, 5, 8).double()),
    "k has dtype torch.float64 but q has dtype torch.float32")
row("attention", "v_dtype", lambda: dense(v=T(2, 2, 5, 8).half()),
    "v has dtype torch.float16 but q has dtype torch.float32")
row("attention", "k_v_shapes", lambda: dense(v=T(2, 2, 6, 8)),
    "k and v must have the same shape, got [2, 2, 5, 8] and [2, 2, 6, 8]")
row("attention", "head_dims", lambda: dense(k=T(2, 2, 5, 16), v=T(2, 2, 5, 16)),
    "q and k/v must have the same head_dim, got 8 and 16")
row("attention", "batch", lambda: dense(k=T(1, 2, 5, 8), v=T(1, 2, 5, 8)),
    "q and k/v must have the same batch size, got 2 and 1")
row("attention", "max_seqlen_dense", lambda: dense(max_seqlen_k=5),
    "max_seqlen_q / max_seqlen_k are for packed sequences (cu_seqlens) only")
row("attention", "heads", lambda: dense(T(1, 6, 5, 8), T(1, 4, 5, 8), T(1, 4, 5, 8)),
    "the number of query heads (6) must be a multiple of the number of key/value heads (4)")
row("attention", "zero_kv_heads", lambda: dense(k=T(2, 0, 5, 8), v=T(2, 0, 5, 8)),
    "the number of query heads (4) must be a multiple of the number of key/value heads (0)")
row("attention", "head_dim_300", lambda: dense(T(1, 2, 3, 300), T(1, 2, 3, 300), T(1, 2, 3, 300)),
    "head_dim must be between 1 and 256, got 300")
row("attention", "head_dim_0", lambda: dense(T(1, 2, 3, 0), T(1, 2, 3, 0), T(1, 2, 3, 0)),
    "head_dim must be between 1 and 256, got 0")
row("attention", "scale_nan", lambda: dense(scale=NAN), "scale must be a finite number, got nan")
row("attention", "scale_inf", lambda: dense(scale=-INF), "scale must be a finite number, got -inf")
row("attention", "window_0", lambda: dense(window=0), "window must be -1 (no window) or a number of keys >= 1, got 0")
row("attention", "window_-2", lambda: dense(window=-2),
    "window must be -1 (no window) or a number of keys >= 1, got -2")
row("attention", "window_right", lambda: dense(window_right=-3),
    "window_right must be -1 (no bound) or a number of keys >= 0, got -3")
row("attention", "softcap_negative", lambda: dense(softcap=-1.0),
    "softcap must be 0 (none) or a positive number, got -1")
row("attention", "softcap_nan", lambda: dense(softcap=NAN), "softcap must be 0 (none) or a positive number, got nan")
row("attention", "sinks_int", lambda: dense(sinks=torch.ones(4, dtype=torch.long)),
    "sinks must be float32, float64, bfloat16 or float16, got torch.int64")
row("attention", "sinks_shape", lambda: dense(sinks=T(5)), "sinks must be 1-D [q_heads] = [4], got shape [5]")
row("attention", "sinks_2d", lambda: dense(sinks=T(1, 4)), "sinks must be 1-D [q_heads] = [4], got shape [1, 4]")
row("attention", "alibi_dtype", lambda: dense(alibi_slopes=T(4).bfloat16()),
    "alibi_slopes must be float32 or float64, got torch.bfloat16")
row("attention", "alibi_shape", lambda: dense(alibi_slopes=T(3)),
    "alibi_slopes must be [q_heads] = [4] or [batch, q_heads] = [2, 4], got shape [3]")
row("attention", "alibi_batch", lambda: dense(alibi_slopes=T(3, 4)),
    "alibi_slopes must be [q_heads] = [4] or [batch, q_heads] = [2, 4], got shape [3, 4]")
row("attention", "alibi_3d", lambda: dense(alibi_slopes=T(2, 4, 1)),
    "alibi_slopes must be [q_heads] = [4] or [batch, q_heads] = [2, 4], got shape [2, 4, 1]")
row("attention", "mask_dtype", lambda: dense(mask=torch.ones(5, 5, dtype=torch.long)),
    "mask must be a bool keep-mask or a float32, float64, bfloat16 or float16 additive mask, got torch.int64")
row("attention", "mask_shape", lambda: dense(mask=T(5, 4)),
    "mask of shape [5, 4] does not broadcast to [batch, q_heads, q_len, kv_len] = [2, 4, 5, 5]")
row("attention", "mask_batch", lambda: dense(mask=T(3, 1, 5, 5)),
    "mask of shape [3, 1, 5, 5] does not broadcast to [batch, q_heads, q_len, kv_len] = [2, 4, 5, 5]")
row("attention", "mask_5d", lambda: dense(mask=T(1, 1, 1, 5, 5)),
    "mask of shape [1, 1, 1, 5, 5] does not broadcast to [batch, q_heads, q_len, kv_len] = [2, 4, 5, 5]")
row("attention", "dropout_1", lambda: dense(dropout_p=1.0, seed=I(1, dtype=torch.long)),
    "dropout_p must be in [0, 1), got 1")
row("attention", "dropout_negative", lambda: dense(dropout_p=-0.1), "dropout_p must be in [0, 1), got -0.1")
row("attention", "dropout_without_seed", lambda: dense(dropout_p=0.5),
    "dropout_p > 0 needs seed, a one-element int64 CPU tensor")
row("attention", "dropout_float_seed", lambda: dense(dropout_p=0.5, seed=torch.tensor([1.0])),
    "dropout_p > 0 needs seed, a one-element int64 CPU tensor")
row("attention", "mask_and_sinks", lambda: dense(mask=torch.ones(5, 5, dtype=torch.long), sinks=T(5)),
    "mask must be a bool keep-mask or a float32, float64, bfloat16 or float16 additive mask, got torch.int64")
row("attention", "mask_and_alibi", lambda: dense(mask=T(5, 4), alibi_slopes=T(3)),
    "mask of shape [5, 4] does not broadcast to [batch, q_heads, q_len, kv_len] = [2, 4, 5, 5]")

# packed sequences (cu_seqlens)
row("attention", "varlen_valid", lambda: varlen(causal=True, sinks=T(4), alibi_slopes=T(3, 4), max_seqlen_q=4,
                                                max_seqlen_k=4))
row("attention", "varlen_no_sequence", lambda: varlen(T(0, 4, 8), T(0, 2, 8), T(0, 2, 8), I(0), I(0)))
row("attention", "varlen_q_4d", lambda: varlen(q=T(1, 4, 9, 8)),
    "with cu_seqlens, q must be 3-D [total_q, q_heads, head_dim], got shape [1, 4, 9, 8]")
row("attention", "varlen_k_4d", lambda: varlen(k=T(1, 2, 9, 8)),
    "with cu_seqlens, k must be 3-D [total_k, kv_heads, head_dim], got shape [1, 2, 9, 8]")
row("attention", "varlen_v_2d", lambda: varlen(v=T(9, 16)),
    "with cu_seqlens, v must be 3-D [total_k, kv_heads, head_dim], got shape [9, 16]")
row("attention", "varlen_lengths", lambda: varlen(cu_q=I(0, 5, 9)),
    "cu_seqlens_q and cu_seqlens_k must have the same length (num_seqs + 1), got 3 and 4")
row("attention", "varlen_q_dtype", lambda: varlen(cu_q=I(0, 2, 5, 9, dtype=torch.long)),
    "cu_seqlens_q must be int32, got torch.int64")
row("attention", "varlen_k_dtype", lambda: varlen(cu_k=I(0, 4, 7, 9, dtype=torch.long)),
    "cu_seqlens_k must be int32, got torch.int64")
row("attention", "varlen_q_2d", lambda: varlen(cu_q=I(0, 2, 5, 9).view(2, 2)),
    "cu_seqlens_q must be 1-D [num_seqs + 1], got shape [2, 2]")
row("attention", "varlen_empty", lambda: varlen(cu_q=I(), cu_k=I()),
    "cu_seqlens_q must be 1-D [num_seqs + 1], got shape [0]")
row("attention", "varlen_q_start", lambda: varlen(cu_q=I(1, 2, 5, 9)), "cu_seqlens_q must start at 0, got 1")
row("attention", "varlen_k_start", lambda: varlen(cu_k=I(2, 4, 7, 9)), "cu_seqlens_k must start at 0, got 2")
row("attention", "varlen_q_decreasing", lambda: varlen(cu_q=I(0, 5, 2, 9)),
    "cu_seqlens_q must be non-decreasing, got 5 then 2 at index 2")
row("attention", "varlen_k_decreasing", lambda: varlen(cu_k=I(0, 4, 3, 9)),
    "cu_seqlens_k must be non-decreasing, got 4 then 3 at index 2")
row("attention", "varlen_q_end", lambda: varlen(cu_q=I(0, 2, 5, 8)), "cu_seqlens_q must end at total_q = 9, got 8")
row("attention", "varlen_k_end", lambda: varlen(cu_k=I(0, 4, 7, 10)), "cu_seqlens_k must end at total_k = 9, got 10")
row("attention", "varlen_max_q_negative", lambda: varlen(max_seqlen_q=-1),
    "max_seqlen_q must be >= 0 (0: the longest), got -1")
row("attention", "varlen_max_q_short", lambda: varlen(max_seqlen_q=3),
    "max_seqlen_q is 3 but cu_seqlens_q has a sequence of length 4")
row("attention", "varlen_max_k_short", lambda: varlen(max_seqlen_k=3),
    "max_seqlen_k is 3 but cu_seqlens_k has a sequence of length 4")
row("attention", "varlen_mask", lambda: varlen(mask=T(9, 9)),
    "mask is not supported with packed sequences (cu_seqlens); each sequence attends within itself, with causal "
    "/ window bounds")
row("attention", "varlen_alibi", lambda: varlen(alibi_slopes=T(2, 4)),
    "alibi_slopes must be [q_heads] = [4] or [num_seqs, q_heads] = [3, 4], got shape [2, 4]")
row("attention", "varlen_sinks", lambda: varlen(sinks=T(2)), "sinks must be 1-D [q_heads] = [4], got shape [2]")
row("attention", "varlen_window", lambda: varlen(window_right=-3),
    "window_right must be -1 (no bound) or a number of keys >= 0, got -3")
row("attention", "varlen_dropout", lambda: varlen(dropout_p=1.0), "dropout_p must be in [0, 1), got 1")


# a KV cache of several lengths, dense: q [2, 4, 3, 8], k and v [2, 2, 6, 8], kv_lens [4, 6]
def cache(q=None, k=None, v=None, kv_lens=None, **options):
    return attn(T(2, 4, 3, 8) if q is None else q, T(2, 2, 6, 8) if k is None else k,
                T(2, 2, 6, 8) if v is None else v, kv_lens=I(4, 6) if kv_lens is None else kv_lens, **options)


# paged: q [2, 4, 1, 8], pages [6, 2, 4, 8], block_table [[0, 1, 2], [3, 4, 5]], kv_lens [5, 9]
def paged(q=None, k=None, v=None, table=None, kv_lens=None, **options):
    return attn(T(2, 4, 1, 8) if q is None else q, T(6, 2, 4, 8) if k is None else k,
                T(6, 2, 4, 8) if v is None else v, kv_lens=I(5, 9) if kv_lens is None else kv_lens,
                block_table=I([0, 1, 2], [3, 4, 5]) if table is None else table, **options)


CACHE_GRAD = ("read a KV cache for inference and have no backward; run under torch.no_grad() or "
              "torch.inference_mode(), or detach q, k and v")

row("attention", "cache_valid", lambda: cache(causal=True, sinks=T(4), alibi_slopes=T(2, 4)))
row("attention", "cache_valid_empty_rows", lambda: cache(kv_lens=I(0, 6)))
row("attention", "cache_with_cu_seqlens", lambda: varlen(T(2, 4, 8), T(2, 2, 8), T(2, 2, 8), I(0, 1, 2), I(0, 1, 2),
                                                         kv_lens=I(1, 1)),
    "kv_lens / block_table take q as [batch, q_heads, q_len, head_dim], not packed sequences (cu_seqlens)")
row("attention", "cache_mask", lambda: cache(mask=torch.ones(3, 6, dtype=torch.bool)),
    "mask is not supported with kv_lens / block_table; each sequence's keys end at its kv_lens entry, bounded by "
    "causal / window")
row("attention", "cache_dropout", lambda: cache(dropout_p=0.1),
    "kv_lens / block_table read a KV cache for inference; dropout_p must be 0, got 0.1")
row("attention", "cache_lens_dtype", lambda: cache(kv_lens=I(4, 6, dtype=torch.long)),
    "kv_lens must be int32, got torch.int64")
row("attention", "cache_lens_shape", lambda: cache(kv_lens=I(4)),
    "kv_lens must be [batch] with batch = 2, got shape [1]")
row("attention", "cache_lens_2d", lambda: cache(kv_lens=I([4, 6])),
    "kv_lens must be [batch] with batch = 2, got shape [1, 2]")
row("attention", "cache_lens_over", lambda: cache(kv_lens=I(4, 7)), "kv_lens[1] = 7 is not in [0, 6] (k's kv_len)")
row("attention", "cache_lens_negative", lambda: cache(kv_lens=I(-1, 6)),
    "kv_lens[0] = -1 is not in [0, 6] (k's kv_len)")
row("attention", "cache_batch", lambda: cache(k=T(1, 2, 6, 8), v=T(1, 2, 6, 8)),
    "q and k/v must have the same batch size, got 2 and 1")
row("attention", "cache_window", lambda: cache(window=0),
    "window must be -1 (no window) or a number of keys >= 1, got 0")
row("attention", "cache_sinks", lambda: cache(sinks=T(3)), "sinks must be 1-D [q_heads] = [4], got shape [3]")
row("attention", "cache_grad", lambda: cache(q=T(2, 4, 3, 8).requires_grad_()), "kv_lens / block_table " + CACHE_GRAD)
row("attention", "cache_q_3d", lambda: cache(q=T(2, 4, 8)),
    "q must be 4-D [batch, q_heads, q_len, head_dim], got shape [2, 4, 8]")
row("attention", "cache_max_seqlen", lambda: cache(max_seqlen_k=3),
    "max_seqlen_q / max_seqlen_k are for packed sequences (cu_seqlens) only")
row("attention", "paged_k_3d", lambda: paged(k=T(6, 2, 8), v=T(6, 2, 8)),
    "k must be 4-D [batch, kv_heads, kv_len, head_dim], got shape [6, 2, 8]")
row("attention", "cache_alibi_batch", lambda: cache(alibi_slopes=T(3, 4)),
    "alibi_slopes must be [q_heads] = [4] or [batch, q_heads] = [2, 4], got shape [3, 4]")
row("attention", "cache_no_keys_scale", lambda: cache(kv_lens=I(0, 0), scale=NAN),
    "scale must be a finite number, got nan")
row("attention", "cache_grad_and_lens_dtype",
    lambda: cache(q=T(2, 4, 3, 8).requires_grad_(), kv_lens=I(4, 6, dtype=torch.long)),
    "kv_lens / block_table " + CACHE_GRAD)

row("attention", "paged_valid", lambda: paged(causal=True))
row("attention", "paged_valid_unread_entry", lambda: paged(table=I([0, 1, -1], [3, 4, 5])))
row("attention", "paged_without_lens", lambda: attn(T(2, 4, 1, 8), T(6, 2, 4, 8), T(6, 2, 4, 8),
                                                    block_table=I([0, 1, 2], [3, 4, 5])),
    "block_table needs kv_lens (int32 [batch], the number of keys of each sequence)")
row("attention", "paged_table_dtype", lambda: paged(table=I([0, 1, 2], [3, 4, 5], dtype=torch.long)),
    "block_table must be int32, got torch.int64")
row("attention", "paged_table_3d", lambda: paged(table=I([0, 1, 2], [3, 4, 5])[:, :, None]),
    "block_table must be [batch, max_pages] with batch = 2, got shape [2, 3, 1]")
row("attention", "paged_page_size_0", lambda: paged(k=T(6, 2, 0, 8), v=T(6, 2, 0, 8)),
    "with block_table, k and v are pages [num_pages, kv_heads, page_size, head_dim] with page_size >= 1, got "
    "shape [6, 2, 0, 8]")
row("attention", "paged_lens_over", lambda: paged(kv_lens=I(13, 9)),
    "kv_lens[0] = 13 is not in [0, 12] (block_table's max_pages * page_size)")
row("attention", "paged_entry", lambda: paged(table=I([0, 99, 2], [3, 4, 5])),
    "block_table[0, 1] = 99 is not a page of k / v (num_pages = 6); sequence 0 has 5 keys, so its first 2 entries "
    "are read")
row("attention", "paged_entry_negative", lambda: paged(table=I([0, 1, 2], [3, 4, -1])),
    "block_table[1, 2] = -1 is not a page of k / v (num_pages = 6); sequence 1 has 9 keys, so its first 3 entries "
    "are read")
row("attention", "paged_grad", lambda: paged(v=T(6, 2, 4, 8).requires_grad_()), "kv_lens / block_table " + CACHE_GRAD)


# int8 / float8 k and v with their scales: q [1, 4, 3, 16], k and v [1, 2, 6, 16], scales [1, 2, 6]
def codes(*shape, dtype=torch.int8):
    return torch.randint(-127, 128, shape, dtype=torch.int8) if dtype == torch.int8 else T(*shape).to(dtype)


def quantized(q=None, k=None, v=None, k_scale=None, v_scale=None, code=torch.int8, **options):
    return attn(T(1, 4, 3, 16) if q is None else q, codes(1, 2, 6, 16, dtype=code) if k is None else k,
                codes(1, 2, 6, 16, dtype=code) if v is None else v,
                k_scale=torch.rand(1, 2, 6) if k_scale is None else k_scale,
                v_scale=torch.rand(1, 2, 6) if v_scale is None else v_scale, **options)


def quantized_pages(k_scale=None, q=None, **options):
    """int8 pages [6, 2, 4, 8] with their scales [6, 2, 4]."""
    return paged(q, codes(6, 2, 4, 8), codes(6, 2, 4, 8), k_scale=torch.rand(6, 2, 4) if k_scale is None else k_scale,
                 v_scale=torch.rand(6, 2, 4), **options)


QUANT_GRAD = "quantized k and v (k_scale / v_scale) " + CACHE_GRAD

row("attention", "int8_valid", lambda: quantized(T(1, 4, 3, 16).bfloat16(), causal=True, sinks=T(4)))
row("attention", "float8_valid", lambda: quantized(code=F8, window=2))
row("attention", "int8_varlen_valid", lambda: varlen(T(9, 4, 8), codes(9, 2, 8), codes(9, 2, 8),
                                                     k_scale=torch.rand(9, 2), v_scale=torch.rand(9, 2)))
row("attention", "int8_paged_valid", lambda: quantized_pages(causal=True))
row("attention", "int8_v_float", lambda: quantized(v=T(1, 2, 6, 16)),
    "k and v are int8 (or float8_e4m3fn) together or not at all, got k torch.int8 and v torch.float32")
row("attention", "int8_v_float8", lambda: quantized(v=codes(1, 2, 6, 16, dtype=F8)),
    "k and v are int8 (or float8_e4m3fn) together or not at all, got k torch.int8 and v torch.float8_e4m3fn")
row("attention", "int8_scales_of_floats", lambda: quantized(k=T(1, 2, 6, 16), v=T(1, 2, 6, 16)),
    "k_scale / v_scale are the scales of int8 (or float8_e4m3fn) k and v, but k and v are torch.float32")
row("attention", "int8_no_scales", lambda: dense(T(1, 4, 3, 16), codes(1, 2, 6, 16), codes(1, 2, 6, 16)),
    "torch.int8 k and v need k_scale and v_scale (float32, one scale per position and kv head)")
row("attention", "float8_no_v_scale",
    lambda: dense(T(1, 4, 3, 16), codes(1, 2, 6, 16, dtype=F8), codes(1, 2, 6, 16, dtype=F8),
                  k_scale=torch.rand(1, 2, 6)),
    "torch.float8_e4m3fn k and v need k_scale and v_scale (float32, one scale per position and kv head)")
row("attention", "int8_q_double", lambda: quantized(T(1, 4, 3, 16).double()),
    "with torch.int8 k and v, q must be float32, bfloat16 or float16, got torch.float64")
row("attention", "int8_k_scale_shape", lambda: quantized(k_scale=torch.rand(1, 2, 5)),
    "k_scale must be [batch, kv_heads, kv_len] = [1, 2, 6], got shape [1, 2, 5]")
row("attention", "int8_v_scale_dtype", lambda: quantized(v_scale=torch.rand(1, 2, 6).half()),
    "v_scale must be float32, got torch.float16")
row("attention", "int8_varlen_scale_shape", lambda: varlen(T(9, 4, 8), codes(9, 2, 8), codes(9, 2, 8),
                                                           k_scale=torch.rand(9, 2, 1), v_scale=torch.rand(9, 2)),
    "k_scale must be [total_k, kv_heads] = [9, 2], got shape [9, 2, 1]")
row("attention", "int8_k_3d", lambda: quantized(k=codes(2, 6, 16)),
    "k must be 4-D [batch, kv_heads, kv_len, head_dim], got shape [2, 6, 16]")
row("attention", "int8_heads", lambda: quantized(T(1, 3, 3, 16)),
    "the number of query heads (3) must be a multiple of the number of key/value heads (2)")
row("attention", "int8_q_grad", lambda: quantized(T(1, 4, 3, 16).requires_grad_()), QUANT_GRAD)
row("attention", "int8_scale_grad", lambda: quantized(k_scale=torch.rand(1, 2, 6).requires_grad_()), QUANT_GRAD)
row("attention", "int8_paged_scale_shape", lambda: quantized_pages(k_scale=torch.rand(6, 2, 3)),
    "k_scale must be [num_pages, kv_heads, page_size] = [6, 2, 4], got shape [6, 2, 3]")
row("attention", "int8_cache_scale_shape",
    lambda: cache(T(2, 4, 3, 16), codes(2, 2, 6, 16), codes(2, 2, 6, 16), k_scale=torch.rand(2, 2, 6),
                  v_scale=torch.rand(2, 1, 6)),
    "v_scale must be [batch, kv_heads, kv_len] = [2, 2, 6], got shape [2, 1, 6]")
row("attention", "int8_paged_scale_dtype", lambda: quantized_pages(k_scale=torch.rand(6, 2, 4).double()),
    "k_scale must be float32, got torch.float64")
row("attention", "int8_paged_grad", lambda: quantized_pages(q=T(2, 4, 1, 8).requires_grad_()), QUANT_GRAD)
row("attention", "int8_sinks_grad", lambda: quantized(sinks=T(4).requires_grad_()), QUANT_GRAD)
row("attention", "int8_scale_shape_and_window", lambda: quantized(k_scale=torch.rand(1, 2, 5), window=0),
    "window must be -1 (no window) or a number of keys >= 1, got 0")
row("attention", "int8_cache_no_keys_q_double",
    lambda: cache(T(2, 4, 3, 16).double(), codes(2, 2, 6, 16), codes(2, 2, 6, 16), kv_lens=I(0, 0),
                  k_scale=torch.rand(2, 2, 6), v_scale=torch.rand(2, 2, 6)),
    "with torch.int8 k and v, q must be float32, bfloat16 or float16, got torch.float64")


# --- quantize_kv (x, values, scales) ------------------------------------------------------------

def quant(x=None, values=None, scales=None):
    x = T(4, 8) if x is None else x
    return (x, torch.empty(x.shape, dtype=torch.int8) if values is None else values,
            torch.empty(x.shape[:-1]) if scales is None else scales)


row("quantize_kv", "valid", lambda: quant(T(2, 3, 5, 8).half()))
row("quantize_kv", "valid_float8", lambda: quant(values=torch.empty(4, 8, dtype=F8)))
row("quantize_kv", "valid_1d", lambda: quant(T(8)))
row("quantize_kv", "x_int", lambda: quant(torch.ones(4, 8, dtype=torch.long)),
    "x must be float32, float64, bfloat16 or float16, got torch.int64")
row("quantize_kv", "x_5d", lambda: quant(T(1, 2, 3, 4, 5)),
    "x must have 1 to 4 dims [..., head_dim], got shape [1, 2, 3, 4, 5]")
row("quantize_kv", "x_0d", lambda: quant(torch.tensor(1.0)), "x must have 1 to 4 dims [..., head_dim], got shape []")
row("quantize_kv", "values_dtype", lambda: quant(values=torch.empty(4, 8)),
    "values must be int8 or float8_e4m3fn, got torch.float32")
row("quantize_kv", "scales_dtype", lambda: quant(scales=torch.empty(4).half()),
    "scales must be float32, got torch.float16")
row("quantize_kv", "values_shape", lambda: quant(values=torch.empty(4, 7, dtype=torch.int8)),
    "values must have x's shape [4, 8], got [4, 7]")
row("quantize_kv", "scales_shape", lambda: quant(scales=torch.empty(4, 1)),
    "scales must be x's shape without its last dim [4], got [4, 1]")
row("quantize_kv", "values_expanded", lambda: quant(values=torch.empty(1, 8, dtype=torch.int8).expand(4, 8)),
    "values has elements that share memory (an expanded view): it is written to")
row("quantize_kv", "scales_expanded", lambda: quant(scales=torch.empty(1).expand(4)),
    "scales has elements that share memory (an expanded view): it is written to")


# --- linear_cross_entropy ------------------------------------------------------------------------
# (hidden, weight, bias, target, ignore_index, reduction, label_smoothing, softcap, z_loss):
# hidden [5, 8], weight [50, 8], bias [50], target [5] (one ignored)

def ce(hidden=None, weight=None, bias=None, target=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
       softcap=0.0, z_loss=0.0):
    return (T(5, 8) if hidden is None else hidden, T(50, 8) if weight is None else weight, bias,
            I(0, 49, -100, 3, 7, dtype=torch.long) if target is None else target, ignore_index, reduction,
            label_smoothing, softcap, z_loss)


row("linear_cross_entropy", "valid", lambda: ce(bias=T(50), reduction="sum", label_smoothing=0.1, softcap=30.0,
                                                z_loss=1e-4))
row("linear_cross_entropy", "valid_none", lambda: ce(reduction="none", label_smoothing=1.0))
row("linear_cross_entropy", "hidden_int", lambda: ce(T(5, 8).int()),
    "hidden must be float32, float64, bfloat16 or float16, got torch.int32")
row("linear_cross_entropy", "hidden_3d", lambda: ce(T(1, 5, 8)),
    "hidden must be [tokens, hidden_size], got shape [1, 5, 8]")
row("linear_cross_entropy", "weight_dtype", lambda: ce(weight=T(50, 8).half()),
    "weight has dtype torch.float16 but hidden has dtype torch.float32")
row("linear_cross_entropy", "weight_width", lambda: ce(weight=T(50, 5)),
    "weight must be [vocab, 8] (hidden's last dim), got shape [50, 5]")
row("linear_cross_entropy", "weight_1d", lambda: ce(weight=T(8)),
    "weight must be [vocab, 8] (hidden's last dim), got shape [8]")
row("linear_cross_entropy", "empty_vocab", lambda: ce(weight=T(0, 8)), "weight has an empty vocabulary (shape [0, 8])")
row("linear_cross_entropy", "bias_shape", lambda: ce(bias=T(7)),
    "bias must be [50] (weight's vocabulary), got shape [7]")
row("linear_cross_entropy", "bias_dtype", lambda: ce(bias=T(50).double()),
    "bias has dtype torch.float64 but hidden has dtype torch.float32")
row("linear_cross_entropy", "target_dtype", lambda: ce(target=T(5)),
    "target must hold int64 class indices, got torch.float32")
row("linear_cross_entropy", "target_shape", lambda: ce(target=I(0, 1, 2, dtype=torch.long)),
    "target must be [5] (one per token of hidden), got shape [3]")
row("linear_cross_entropy", "smoothing", lambda: ce(label_smoothing=1.5), "label_smoothing must be in [0, 1], got 1.5")
row("linear_cross_entropy", "smoothing_nan", lambda: ce(label_smoothing=NAN),
    "label_smoothing must be in [0, 1], got nan")
row("linear_cross_entropy", "softcap", lambda: ce(softcap=-1.0),
    "softcap must be a finite number > 0 (0: no cap), got -1")
row("linear_cross_entropy", "softcap_inf", lambda: ce(softcap=INF),
    "softcap must be a finite number > 0 (0: no cap), got inf")
row("linear_cross_entropy", "z_loss", lambda: ce(z_loss=-0.1), "z_loss must be a finite number >= 0, got -0.1")
row("linear_cross_entropy", "z_loss_nan", lambda: ce(z_loss=NAN), "z_loss must be a finite number >= 0, got nan")
row("linear_cross_entropy", "reduction", lambda: ce(reduction="avg"),
    "reduction must be 'mean', 'sum' or 'none', got 'avg'")
row("linear_cross_entropy", "target_over", lambda: ce(target=I(0, 1, 50, 3, 4, dtype=torch.long)),
    "target[2] = 50 is not a class index in [0, 50) nor ignore_index (-100)")
row("linear_cross_entropy", "target_negative", lambda: ce(target=I(0, -3, 2, 3, 4, dtype=torch.long), ignore_index=0),
    "target[1] = -3 is not a class index in [0, 50) nor ignore_index (0)")
row("linear_cross_entropy", "reduction_and_hidden", lambda: ce(T(5, 8).int(), reduction="avg"),
    "reduction must be 'mean', 'sum' or 'none', got 'avg'")


# --- moe_route (router_logits, top_k, scoring, normalize, correction_bias, num_groups, top_groups, scaling)
# router_logits [5, 4]

def route(logits=None, top_k=2, scoring="softmax", normalize=True, bias=None, num_groups=1, top_groups=1,
          scaling=1.0):
    return (T(5, 4) if logits is None else logits, top_k, scoring, normalize, bias, num_groups, top_groups, scaling)


row("moe_route", "valid", lambda: route(scoring="sigmoid", bias=T(4), num_groups=2, top_groups=1, scaling=2.5))
row("moe_route", "logits_int", lambda: route(torch.ones(5, 4, dtype=torch.long)),
    "router_logits must be float32, float64, bfloat16 or float16, got torch.int64")
row("moe_route", "logits_1d", lambda: route(T(4)), "router_logits must be [tokens, num_experts], got shape [4]")
row("moe_route", "no_experts", lambda: route(T(5, 0)), "router_logits must be [tokens, num_experts], got shape [5, 0]")
row("moe_route", "top_k_over", lambda: route(top_k=5), "top_k must be in [1, num_experts = 4], got 5")
row("moe_route", "top_k_0", lambda: route(top_k=0), "top_k must be in [1, num_experts = 4], got 0")
row("moe_route", "scoring", lambda: route(scoring="relu"), "scoring must be 'softmax' or 'sigmoid', got 'relu'")
row("moe_route", "bias_int", lambda: route(bias=torch.zeros(4, dtype=torch.long)),
    "correction_bias must be float32, float64, bfloat16 or float16, got torch.int64")
row("moe_route", "bias_shape", lambda: route(bias=T(3)), "correction_bias must be [4] (one per expert), got shape [3]")
row("moe_route", "groups", lambda: route(num_groups=3),
    "num_groups must be a positive divisor of num_experts = 4, got 3")
row("moe_route", "groups_0", lambda: route(num_groups=0),
    "num_groups must be a positive divisor of num_experts = 4, got 0")
row("moe_route", "top_groups", lambda: route(num_groups=2, top_groups=3),
    "top_groups must be in [1, num_groups = 2], got 3")
row("moe_route", "top_groups_0", lambda: route(num_groups=2, top_groups=0),
    "top_groups must be in [1, num_groups = 2], got 0")
row("moe_route", "top_k_over_groups", lambda: route(top_k=3, num_groups=2, top_groups=1),
    "top_k = 3 is more than the 2 experts of the top_groups = 1 groups kept")
row("moe_route", "scaling_nan", lambda: route(scaling=NAN), "scaling must be finite, got nan")
row("moe_route", "scaling_inf", lambda: route(scaling=INF), "scaling must be finite, got inf")


# --- moe_experts (hidden, indices, weights, gate_up_proj, down_proj, activation, save_for_backward,
# gate_up_bias, down_bias, transposed, interleaved, alpha, limit): hidden [5, 8], 4 experts of
# intermediate 4: gate_up_proj [4, 8, 8], down_proj [4, 8, 4]; indices and weights [5, 2]

def experts(hidden=None, indices=None, weights=None, gate_up=None, down=None, activation="silu", save=False,
            gate_up_bias=None, down_bias=None, transposed=False, interleaved=False, alpha=1.702, limit=7.0):
    if indices is None:
        indices = I([0, 1], [2, 3], [1, 0], [3, 3], [2, 0], dtype=torch.long)
    return (T(5, 8) if hidden is None else hidden, indices, torch.rand(5, 2) if weights is None else weights,
            T(4, 8, 8) if gate_up is None else gate_up, T(4, 8, 4) if down is None else down, activation, save,
            gate_up_bias, down_bias, transposed, interleaved, alpha, limit)


row("moe_experts", "valid", lambda: experts(save=True, gate_up_bias=T(4, 8), down_bias=T(4, 8), interleaved=True,
                                            activation="gpt_oss", limit=INF))
row("moe_experts", "valid_transposed", lambda: experts(gate_up=T(4, 8, 8), down=T(4, 4, 8), transposed=True))
row("moe_experts", "valid_bf16_float32_weights", lambda: experts(T(5, 8).bfloat16(), gate_up=T(4, 8, 8).bfloat16(),
                                                                 down=T(4, 8, 4).bfloat16()))
row("moe_experts", "hidden_int", lambda: experts(torch.ones(5, 8, dtype=torch.long)),
    "hidden must be float32, float64, bfloat16 or float16, got torch.int64")
row("moe_experts", "hidden_3d", lambda: experts(T(1, 5, 8)),
    "hidden must be [tokens, hidden_size], got shape [1, 5, 8]")
row("moe_experts", "indices_dtype", lambda: experts(indices=torch.zeros(5, 2, dtype=torch.int32)),
    "indices must hold int64 expert indices, got torch.int32")
row("moe_experts", "indices_tokens", lambda: experts(indices=torch.zeros(4, 2, dtype=torch.long)),
    "indices must be [5, top_k] (hidden's tokens), got shape [4, 2]")
row("moe_experts", "indices_no_k", lambda: experts(indices=torch.zeros(5, 0, dtype=torch.long)),
    "indices must be [5, top_k] (hidden's tokens), got shape [5, 0]")
row("moe_experts", "indices_1d", lambda: experts(indices=torch.zeros(5, dtype=torch.long)),
    "indices must be [5, top_k] (hidden's tokens), got shape [5]")
row("moe_experts", "weights_dtype", lambda: experts(weights=torch.rand(5, 2).half()),
    "weights must have hidden's dtype torch.float32, got torch.float16")
row("moe_experts", "weights_dtype_bf16", lambda: experts(T(5, 8).bfloat16(), weights=torch.rand(5, 2).half(),
                                                         gate_up=T(4, 8, 8).bfloat16(), down=T(4, 8, 4).bfloat16()),
    "weights must have hidden's dtype torch.bfloat16 or torch.float32, got torch.float16")
row("moe_experts", "weights_shape", lambda: experts(weights=torch.rand(5, 1)),
    "weights must have indices' shape [5, 2], got [5, 1]")
row("moe_experts", "gate_up_dtype", lambda: experts(gate_up=T(4, 8, 8).double()),
    "gate_up_proj has dtype torch.float64 but hidden has dtype torch.float32")
row("moe_experts", "down_dtype", lambda: experts(down=T(4, 8, 4).half()),
    "down_proj has dtype torch.float16 but hidden has dtype torch.float32")
row("moe_experts", "gate_up_odd", lambda: experts(gate_up=T(4, 7, 8)),
    "gate_up_proj must be [num_experts, 2 * intermediate, 8] (hidden's last dim), got shape [4, 7, 8]")
row("moe_experts", "gate_up_width", lambda: experts(gate_up=T(4, 8, 6)),
    "gate_up_proj must be [num_experts, 2 * intermediate, 8] (hidden's last dim), got shape [4, 8, 6]")
row("moe_experts", "no_experts", lambda: experts(gate_up=T(0, 8, 8)),
    "gate_up_proj must be [num_experts, 2 * intermediate, 8] (hidden's last dim), got shape [0, 8, 8]")
row("moe_experts", "gate_up_transposed", lambda: experts(gate_up=T(4, 6, 8), transposed=True),
    "gate_up_proj must be [num_experts, 8, 2 * intermediate] (hidden's last dim; transposed=True), got shape [4, 6, 8]")
row("moe_experts", "down_shape", lambda: experts(down=T(4, 8, 3)),
    "down_proj must be [4, 8, 4] (num_experts, hidden_size, intermediate), got shape [4, 8, 3]")
row("moe_experts", "down_transposed", lambda: experts(transposed=True),
    "down_proj must be [4, 4, 8] (num_experts, intermediate, hidden_size; transposed=True), got shape [4, 8, 4]")
row("moe_experts", "gate_up_bias_shape", lambda: experts(gate_up_bias=T(4, 4)),
    "gate_up_bias must be [4, 8] (num_experts, 2 * intermediate), got shape [4, 4]")
row("moe_experts", "gate_up_bias_dtype", lambda: experts(gate_up_bias=torch.zeros(4, 8, dtype=torch.long)),
    "gate_up_bias has dtype torch.int64 but hidden has dtype torch.float32")
row("moe_experts", "down_bias_shape", lambda: experts(down_bias=T(8)),
    "down_bias must be [4, 8] (num_experts, hidden_size), got shape [8]")
row("moe_experts", "down_bias_dtype", lambda: experts(down_bias=T(4, 8).double()),
    "down_bias has dtype torch.float64 but hidden has dtype torch.float32")
row("moe_experts", "activation", lambda: experts(activation="relu"),
    "activation must be 'silu', 'gelu_tanh' or 'gpt_oss', got 'relu'")
row("moe_experts", "alpha", lambda: experts(activation="gpt_oss", alpha=NAN), "alpha must be finite, got nan")
row("moe_experts", "limit_0", lambda: experts(activation="gpt_oss", limit=0.0),
    "limit must be positive (inf: no clamp), got 0")
row("moe_experts", "limit_nan", lambda: experts(limit=NAN), "limit must be positive (inf: no clamp), got nan")
row("moe_experts", "index_over", lambda: experts(indices=I([0, 1], [2, 3], [1, 0], [3, 4], [2, 0], dtype=torch.long)),
    "indices[3, 1] = 4 is not an expert index in [0, 4)")
row("moe_experts", "index_negative",
    lambda: experts(indices=I([0, -1], [2, 3], [1, 0], [3, 3], [2, 0], dtype=torch.long)),
    "indices[0, 1] = -1 is not an expert index in [0, 4)")


# --- the refusals no CPU-only table can reach -----------------------------------------------------
# (module file, function, words of the message) -> why
DEVICE = "a device mismatch: every tensor here is a CPU tensor (a meta tensor sends the op to its fake kernel)"
UNREACHABLE = {
    ("_checks.py", "_check_same", "is on"): DEVICE,
    ("_checks.py", "_check_rope", "cos and sin must be on"): DEVICE,
    ("_checks.py", "_check_rope", "position_ids is on"): DEVICE,
    ("_checks.py", "_check_cu_seqlens", "is on"): DEVICE,
    ("_checks.py", "check_attention", "sinks is on"): DEVICE,
    ("_checks.py", "check_attention", "alibi_slopes is on"): DEVICE,
    ("_checks.py", "check_attention", "mask is on"): DEVICE,
    ("_checks.py", "check_attention", "head_dim must be at least 1"):
        "only with max_head_dim=None (fusedllm.attention_with_weights); the op keeps the kernels' limit",
    ("_checks.py", "_check_kv_lens", "is on"): DEVICE,
    ("_checks.py", "check_cross_entropy", "target is on"): DEVICE,
    ("_checks.py", "check_moe_route", "correction_bias is on"): DEVICE,
    ("_checks.py", "check_moe_experts", "indices is on"): DEVICE,
    ("_checks.py", "check_moe_experts", "weights is on"): DEVICE,
    ("_checks.py", "_check_kv_dtypes", "is on"): DEVICE,
    ("_plain.py", "quantize_kv", "is on"): DEVICE,
    ("_limits.py", "check_rotary_dim", "rotary_dim must be an int"):
        "the op's schema takes an int: a float is refused by the dispatcher (RuntimeError) before any check",
    ("_limits.py", "check_positive_int", "must be a positive int"):
        "the modules' and caches' constructors' check, no op's: their own tests reach it",
}


# --- the tests ------------------------------------------------------------------------------------

def _outcome(impl, case):
    """None when the call runs, else (exception type name, message, exception)."""
    args = case.build()
    try:
        getattr(impl, case.op)(*args)
    except Exception as error:  # noqa: BLE001 - any exception is an outcome to compare
        return type(error).__name__, str(error), error
    return None


def _short(outcome):
    return None if outcome is None else outcome[:2]


def _name(case):
    """The name the case's errors carry: a call of the attention op with packed
    sequences is what fusedllm.attention_varlen makes, and answers as it."""
    if case.op == "attention":
        args = dict(zip(ATTENTION_ARGS, case.build()[3:]))
        if args["cu_seqlens_q"] is not None or args["cu_seqlens_k"] is not None:
            return "attention_varlen"
    return case.op


def _whole(case, message):
    return message if message.startswith("fusedllm.") else f"fusedllm.{_name(case)}: {message}"


def _tabled_plain(case):
    if case.plain is None or isinstance(case.plain, tuple):
        return case.plain
    return "ValueError", _whole(case, case.plain)


def _param(case):
    marks = [pytest.mark.xfail(strict=True, reason=case.why)] if case.why else []
    return pytest.param(case, id=case.id, marks=marks)


def _ops_of_both():
    registered = {name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("fusedllm::")}
    plain = {name for name, f in vars(_plain).items()
             if inspect.isfunction(f) and f.__module__ == _plain.__name__ and not name.startswith("_")}
    return registered & plain


def test_table_covers_every_op_of_both():
    both = _ops_of_both()
    assert {"rms_norm", "fused_add_rms_norm", "swiglu", "swiglu_packed", "rope", "rope_", "attention",
            "quantize_kv", "linear_cross_entropy", "moe_route", "moe_experts"} <= both, both
    tabled = {case.op for case in CASES}
    assert tabled == both
    for op in both:
        rows = [case for case in CASES if case.op == op]
        assert any(case.expect is None for case in rows), f"{op}: no call both accept"
        assert any(case.expect is not None for case in rows), f"{op}: no bad input"
    assert len({case.id for case in CASES}) == len(CASES), "case ids must be unique"


@pytest.mark.parametrize("case", [pytest.param(case, id=case.id) for case in CASES])
def test_compiled_outcome_is_as_tabled(case):
    """The compiled op does what the row says; for a row where the two disagree, the
    plain path still does what the row says it does today (so the xfail is this one)."""
    got = _short(_outcome(ops, case))
    if case.expect is None:
        assert got is None, got
    else:
        assert got is not None and got[0] == "ValueError", got
        if isinstance(case.expect, re.Pattern):
            prefix = f"fusedllm.{_name(case)}: "
            assert got[1].startswith(prefix) and case.expect.fullmatch(got[1][len(prefix):]), got[1]
        else:
            assert got[1] == _whole(case, case.expect)
    if case.why:
        assert _short(_outcome(_plain, case)) == _tabled_plain(case)


@pytest.mark.parametrize("case", [_param(case) for case in CASES])
def test_twins_agree(case):
    """Both accept, or both raise the same exception type with the same message."""
    assert _short(_outcome(_plain, case)) == _short(_outcome(ops, case))


# --- every refusal of the plain path is reached ---------------------------------------------------

def _path(module):
    return os.path.realpath(inspect.getsourcefile(module))


MODULES = {_path(m): m for m in (_checks, _plain, _limits)}


class Site(NamedTuple):
    file: str  # base name
    function: str
    first: int
    last: int
    text: str  # the message's source


def _sites():
    """Every call of _fail and every raise in the plain path's modules (but _fail's own raise)."""
    sites = {}
    for path in MODULES:
        with open(path) as f:
            tree = ast.parse(f.read())
        functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for function in functions:  # ast.walk is breadth first: a nested function comes after its parent
            if function.name == "_fail":
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_fail":
                    message = node.args[1]
                elif isinstance(node, ast.Raise):
                    message = node.exc.args[0] if isinstance(node.exc, ast.Call) and node.exc.args else node.exc
                else:
                    continue
                sites[(path, node.lineno)] = Site(os.path.basename(path), function.name, node.lineno,
                                                  node.end_lineno, ast.unparse(message))
    return sites


def _site_of(error, sites):
    """The refusal that raised ``error``: the innermost frame in the plain path's modules
    (the caller of _fail when _fail raised)."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        path = os.path.realpath(frame.filename)
        if path not in MODULES or (frame.name == "_fail" and path == _path(_checks)):
            continue
        for (site_path, _), site in sites.items():
            if site_path == path and site.first <= frame.lineno <= site.last:
                return site
        return None
    return None


def _unreachable(site):
    return next((why for (file, function, words), why in UNREACHABLE.items()
                 if (file, function) == (site.file, site.function) and words in site.text), None)


def test_every_refusal_of_the_plain_path_is_reached():
    sites = _sites()
    assert len(sites) > 100, len(sites)  # the parse found them
    reached = {}
    for case in CASES:
        outcome = _outcome(_plain, case)
        if outcome is not None and outcome[0] == "ValueError":
            site = _site_of(outcome[2], sites)
            assert site is not None, (case.id, outcome[1])
            reached.setdefault(site, []).append(case.id)
    for key in UNREACHABLE:  # every entry names a refusal that exists
        assert any(_unreachable(site) and (site.file, site.function) == key[:2] and key[2] in site.text
                   for site in sites.values()), key
    listed = {site for site in sites.values() if _unreachable(site)}
    wrongly_listed = {f"{s.file}:{s.first} {s.function}: {s.text}": reached[s] for s in listed & set(reached)}
    assert not wrongly_listed, f"reached, yet listed in UNREACHABLE: {wrongly_listed}"
    missed = [f"{s.file}:{s.first} {s.function}: {s.text}" for s in sites.values()
              if s not in reached and s not in listed]
    assert not missed, "refusals no row reaches:\n" + "\n".join(missed)
