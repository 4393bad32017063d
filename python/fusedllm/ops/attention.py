"""Attention: ``attention``, ``attention_varlen`` (packed sequences) and, for
models that return their probabilities, ``attention_with_weights``.

Here: the functions, each operator's plain-PyTorch twin with its checks, the
autocast rules, the fake kernels and the DTensor rules."""

from __future__ import annotations

import math
from numbers import Integral, Real

import torch

from .. import _autocast, _fake, _plain, _sharding
from .._checks import _check_float, _check_same, _fail, _require_tensors
from .._devices import ops_for
from .._limits import FLOAT_DTYPES, KV_CODES, MAX_HEAD_DIM, accumulation_dtype
from .._philox import dropout_keep
from .._sharding import _mesh_size, _on, _placement_on, _refuse, partial, replicate, shard

__all__ = ["attention", "attention_varlen"]

_QKV = (_autocast.LOWER, ("q", "k", "v"))
_autocast.rule("attention", cpu=_QKV, cuda=_QKV)


def _window_bounds(op, window):
    """``window`` as the op's (key count of the left bound + 1, right bound), -1 meaning none."""
    if window is None:
        return -1, -1
    if isinstance(window, tuple):
        if len(window) != 2 or any(isinstance(w, bool) or not isinstance(w, Integral) or w < -1
                                   for w in window):
            raise ValueError(f"{op}: window as a tuple must be (left, right), each -1 (unbounded) or an "
                             f"int >= 0, got {window!r}")
        left, right = int(window[0]), int(window[1])
        return (-1 if left < 0 else left + 1), right
    if isinstance(window, bool) or not isinstance(window, Integral) or window < 1:
        raise ValueError(f"{op}: window must be None, an int >= 1 (the number of keys a query "
                         f"sees, itself included) or a (left, right) tuple, got {window!r}")
    return int(window), -1


def _attention_args(op, q, k, v, causal, scale, window, mask, dropout_p, softcap=None, sinks=None,
                    alibi_slopes=None, k_scale=None, v_scale=None, kv_lens=None, block_table=None):
    """The arguments this layer adds, checked, as the op takes them:
    (scale, window, window_right, softcap, mask, dropout_p, seed)."""
    _require_tensors(op, "q", q, k=k, v=v, mask=mask, sinks=sinks, alibi_slopes=alibi_slopes,
                     k_scale=k_scale, v_scale=v_scale, kv_lens=kv_lens, block_table=block_table)
    if not isinstance(causal, bool):
        raise ValueError(f"{op}: causal must be True or False, got {causal!r}")
    if scale is None:  # a q the op refuses gets any scale: its error comes first
        scale = q.shape[-1] ** -0.5 if q.dim() and q.shape[-1] else 1.0
    window, window_right = _window_bounds(op, window)
    if softcap is None:
        softcap = 0.0
    elif isinstance(softcap, bool) or not isinstance(softcap, Real) or not softcap > 0 \
            or not math.isfinite(softcap):
        raise ValueError(f"{op}: softcap must be None or a positive number, got {softcap!r}")
    if mask is not None and mask.requires_grad:
        raise ValueError(f"{op}: mask requires grad, but no gradient flows to the mask; "
                         f"pass mask.detach()")
    if alibi_slopes is not None and alibi_slopes.requires_grad:
        raise ValueError(f"{op}: alibi_slopes requires grad, but no gradient flows to the slopes; "
                         f"pass alibi_slopes.detach()")
    # The seed is drawn here, from torch's default generator (so torch.manual_seed
    # repeats it), and only for a probability that needs one.
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, Real) or not dropout_p >= 0.0:
        raise ValueError(f"{op}: dropout_p must be >= 0, got {dropout_p!r}")
    if dropout_p >= 1.0:
        raise ValueError(f"{op}: dropout_p must be in [0, 1), got {dropout_p!r}")
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64) if dropout_p > 0 else None
    return scale, window, window_right, float(softcap), mask, float(dropout_p), seed


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: float | None = None, window: int | tuple[int, int] | None = None,
              mask: torch.Tensor | None = None, dropout_p: float = 0.0, softcap: float | None = None,
              sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
              k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
              kv_lens: torch.Tensor | None = None, block_table: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped-query attention ``softmax(q k^T * scale + mask) v``, flash style.

    ``q`` is ``[batch, q_heads, q_len, head_dim]``, ``k`` and ``v`` are
    ``[batch, kv_heads, kv_len, head_dim]`` with ``q_heads`` a multiple of
    ``kv_heads``: query head ``h`` attends with kv head ``h // (q_heads // kv_heads)``
    (K and V are never repeated in memory). ``scale`` defaults to ``head_dim ** -0.5``.

    Masks are aligned bottom-right: query ``i`` sits at position ``p = i + kv_len - q_len``
    (the queries are the last ``q_len`` positions, as when decoding with a KV cache).
    ``causal=True`` lets it see keys ``j <= p``. This equals
    ``F.scaled_dot_product_attention(is_causal=True)`` when ``q_len == kv_len``; when
    they differ SDPA aligns top-left (query ``i`` sees keys ``j <= i``) instead.
    ``window=w`` keeps only the last ``w`` keys up to a query's position,
    ``j > p - w`` (itself included): with ``causal=True`` this is Mistral's /
    Hugging Face's ``sliding_window``. ``window=(left, right)`` is
    FlashAttention's local window: keys ``p - left <= j <= p + right``, ``-1``
    leaving a side unbounded (``window=w`` is ``(w - 1, -1)``).

    ``mask`` (optional) is applied inside the kernel, on top of ``causal`` and
    ``window``: a bool keep-mask (True attends, False is masked) or an additive
    float mask (added to the scaled scores; ``-inf`` masks), of any shape that
    broadcasts to ``[batch, q_heads, q_len, kv_len]`` (a padding mask
    ``[batch, 1, 1, kv_len]``, a full ``[q_len, kv_len]`` causal mask, Hugging
    Face's 4-D masks). It is read where it lies: no ``[q_len, kv_len]`` tensor is
    built. In a float mask the dtype's most negative finite value (``finfo.min``,
    what Hugging Face writes) counts as ``-inf``. A query that sees no key at all
    gets an output of zeros and zero gradients, never NaN. No gradient flows to
    the mask.

    ``softcap`` (Gemma 2's ``attn_logit_softcapping``) replaces each scaled
    score ``s`` by ``softcap * tanh(s / softcap)``; gradients flow through it.
    ``alibi_slopes`` (float32 or float64, ``[q_heads]`` or ``[batch, q_heads]``)
    adds ``-slope * |p - j|`` to the score of query position ``p`` and key
    ``j`` (after the cap, before the masks); computed in the kernel, never
    materialized, no gradient. ``sinks`` (``[q_heads]``, gpt-oss's learned
    attention sinks) adds one logit per head to every row's softmax
    denominator: ``softmax([scores, sink])`` with the sink multiplying no value
    (a row that sees no key gets zeros); differentiable.

    ``dropout_p > 0`` drops attention probabilities with that probability and
    scales the rest by ``1 / (1 - dropout_p)`` (pass 0 in evaluation, as with
    SDPA). The dropout pattern comes from a counter-based generator keyed by a
    seed drawn from torch's default generator, so ``torch.manual_seed`` repeats
    it; backward regenerates it instead of storing it.

    float32, float64, bfloat16 and float16, accumulated in float32 (float64 for
    float64); memory grows linearly with the sequence lengths, never with
    ``q_len * kv_len``. Differentiable in ``q``, ``k``, ``v`` and ``sinks``.

    **Quantized keys and values.** ``k`` and ``v`` may be int8 with ``k_scale``
    and ``v_scale`` (float32 ``[batch, kv_heads, kv_len]``, any strides), as
    :func:`quantize_kv` makes them: key row ``j`` is ``k[..., j, :] * k_scale[..., j]``.
    The kernels read the int8 rows themselves, tile by tile, so no float copy of
    the cache is ever made: float32 tiles dequantize as they load; bfloat16
    products on ``vdpbf16ps`` take the integers as bfloat16 (exact) and apply
    the key scales to the float32 scores and the value scales to the
    probabilities; a bfloat16 decoding step on a CPU with AVX512-VNNI
    multiplies the codes as int16 against q and the probabilities rounded
    to int16 (2^-16 of a row's largest value, below bfloat16's rounding of
    those values elsewhere). q is float32, bfloat16 or float16 and the output has q's
    dtype. For inference only (no gradient). With scales ``s_k``, ``s_v`` of
    the rows a query reads, ``eps = scale * sum|q| * max s_k / 2`` bounds the
    error of any score, and the output differs from attention over the
    unquantized rows by at most ``max s_v / 2 + (exp(2 eps) - 1) * max|v|``
    per entry, beyond the rounding attention in q's dtype has over float rows
    (tests/test_kv_quant.py checks this bound). ``k`` and ``v`` may instead be
    ``torch.float8_e4m3fn`` codes (``quantize_kv(..., dtype=torch.float8_e4m3fn)``),
    read the same way (each code is exact in bfloat16); an entry is then off
    by at most ``28 s`` (``2^-4`` of entries up to ``448 s``), and the same
    bound holds with ``28 s`` in place of ``s / 2``.

    **Caches of several lengths, paged caches.** ``kv_lens`` (int32
    ``[batch]``) gives each sequence its own number of keys: sequence ``b``
    attends over the first ``kv_lens[b]`` rows of its keys, and its queries are
    the last ``q_len`` of its positions (causal and window bounds per
    sequence); a sequence with no key gets zeros. With ``block_table`` (int32
    ``[batch, max_pages]``) ``k`` and ``v`` are pages ``[num_pages, kv_heads,
    page_size, head_dim]`` (any strides; int8 scales ``[num_pages, kv_heads,
    page_size]``) and key ``j`` of sequence ``b`` is row ``j % page_size`` of
    page ``block_table[b, j // page_size]``: the kernels read the rows through
    the table, no gathered copy is made. Entries past a sequence's last page
    are not read. On the CPU both are checked first (a ``ValueError`` names
    a length past the table or a page outside the pool); on a GPU the kernels
    test each entry as they read it, without a copy to the host, and a
    sequence whose length or pages cannot be read gets NaN rows. For
    inference only (no gradient, no ``mask``, no dropout);
    :class:`fusedllm.nn.PagedKVCache` keeps such a pool.
    """
    scale, window, right, softcap, mask, dropout_p, seed = _attention_args(
        "fusedllm.attention", q, k, v, causal, scale, window, mask, dropout_p, softcap, sinks,
        alibi_slopes, k_scale, v_scale, kv_lens, block_table)
    out, _lse = ops_for(q).attention(q, k, v, mask, scale, causal, window, dropout_p, seed, right, softcap,
                                     sinks, alibi_slopes, None, None, 0, 0, k_scale, v_scale, kv_lens,
                                     block_table)
    return out


def attention_with_lse(q, k, v, causal=False, window=None, mask=None, dropout_p=0.0, k_scale=None,
                       v_scale=None, scale=None, softcap=None):
    """:func:`attention` and its float32 log-sum-exp ``[batch, q_heads, q_len]``
    (``-inf`` for a query that sees no key): what merging the outputs of
    attention over disjoint key sets needs (:func:`merge_attention`)."""
    scale, window, right, softcap, mask, dropout_p, seed = _attention_args(
        "fusedllm.attention", q, k, v, causal, scale, window, mask, dropout_p, softcap, k_scale=k_scale,
        v_scale=v_scale)
    return ops_for(q).attention(q, k, v, mask, scale, causal, window, dropout_p, seed, right, softcap,
                                None, None, None, None, 0, 0, k_scale, v_scale)


def merge_attention(pieces, dtype: torch.dtype, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One attention output from ``(out, lse)`` pieces over disjoint key sets
    of the same queries: each weighted by its share of the total softmax
    denominator, to which ``sinks`` (one logit per query head) adds its term.
    A query that sees no key in any piece gets zeros, as attention gives it."""
    if len(pieces) == 1 and sinks is None:
        return pieces[0][0]
    lses = [lse for _, lse in pieces]
    if sinks is not None:
        lses.append(sinks.float()[:, None].expand_as(lses[0]))
    total = torch.logsumexp(torch.stack(lses), dim=0)
    total = torch.where(torch.isfinite(total), total, torch.inf)  # no key seen: every weight 0
    acc = torch.promote_types(dtype, torch.float32)
    out = sum(o.to(acc) * torch.exp(lse - total).unsqueeze(-1) for o, lse in pieces)
    return out.to(dtype)


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int | None = None,
                     max_seqlen_k: int | None = None, causal: bool = False, scale: float | None = None,
                     window: int | tuple[int, int] | None = None, softcap: float | None = None,
                     sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
                     dropout_p: float = 0.0, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`attention` over packed sequences of different lengths, with no
    padding (FlashAttention's variable-length layout).

    ``q`` is ``[total_q, q_heads, head_dim]``, ``k`` and ``v`` are ``[total_k,
    kv_heads, head_dim]``; ``cu_seqlens_q`` / ``cu_seqlens_k`` (int32
    ``[num_seqs + 1]``, on q's device, from 0, non-decreasing, ending at
    ``total_q`` / ``total_k``) delimit the sequences: sequence ``b``'s queries
    are rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and its keys rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``. Each sequence attends only within
    itself; ``causal``, ``window`` and ``alibi_slopes`` (``[q_heads]`` or
    ``[num_seqs, q_heads]``) are aligned bottom-right per sequence, so one query
    per sequence over its own cache length is a batched decoding step.
    ``max_seqlen_q`` / ``max_seqlen_k`` default to the longest lengths (given,
    they must be at least that). The lengths are checked on the host (one copy
    for CUDA tensors).

    Returns ``[total_q, q_heads, head_dim]`` (a strided view). Equals calling
    :func:`attention` per sequence for every option, to rounding: the packed
    call may cut its work differently (and on CUDA pick other kernels), so
    outputs and gradients can differ by up to about one unit in the last place
    of their largest element; dropout draws its own pattern. Differentiable in ``q``, ``k``, ``v`` and ``sinks``; no ``mask``.
    int8 ``k`` and ``v`` take ``k_scale`` / ``v_scale`` ``[total_k, kv_heads]``
    (see :func:`attention`).
    """
    op = "fusedllm.attention_varlen"
    _require_tensors(op, "q", q, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    scale, window, right, softcap, _mask, dropout_p, seed = _attention_args(
        op, q, k, v, causal, scale, window, None, dropout_p, softcap, sinks, alibi_slopes, k_scale, v_scale)
    lengths = []
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value is None:
            lengths.append(0)
        elif isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
            raise ValueError(f"{op}: {name} must be None or an int >= 1, got {value!r}")
        else:
            lengths.append(int(value))
    out, _lse = ops_for(q).attention(q, k, v, None, scale, causal, window, dropout_p, seed, right, softcap,
                                     sinks, alibi_slopes, cu_seqlens_q, cu_seqlens_k, *lengths, k_scale,
                                     v_scale)
    return out


def attention_with_weights(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                           scale: float | None = None, window: int | tuple[int, int] | None = None,
                           mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                           softcap: float | None = None, sinks: torch.Tensor | None = None,
                           alibi_slopes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention` on a plain PyTorch path that also returns the attention
    probabilities ``[batch, q_heads, q_len, kv_len]`` in q's dtype: those that
    multiplied ``v`` (after dropout, drawn as the fused kernel draws it). It
    builds the whole score matrix, so it is slow and memory hungry: for code
    that inspects or plots the weights. Queries that see no key get zero
    weights and a zero output. Same arguments, checks and conventions as
    :func:`attention`, without its head_dim limit; differentiable in q, k, v and sinks."""
    op = "fusedllm.attention_with_weights"
    scale, window, right, softcap, mask, dropout_p, seed = _attention_args(
        op, q, k, v, causal, scale, window, mask, dropout_p, softcap, sinks, alibi_slopes)
    check_attention(op, q, k, v, mask, scale, window, dropout_p, max_head_dim=None,
                            window_right=right, softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes)
    out, _lse, probs = attention_with_probs(q, k, v, mask, scale, causal, window, dropout_p, seed,
                                                   window_right=right, softcap=softcap, sinks=sinks,
                                                   alibi_slopes=alibi_slopes)
    return out, probs.to(q.dtype)


# --- the plain path: twins of the compiled operator's checks and results ---------------------------


def _check_cu_seqlens(op, name, cu, q, total, total_name, max_len, max_name):
    """Cumulative lengths as the op checks them; returns the longest length."""
    if cu.dtype != torch.int32:
        _fail(op, f"{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        _fail(op, f"{name} must be 1-D [num_seqs + 1], got shape {list(cu.shape)}")
    if cu.device != q.device:
        _fail(op, f"{name} is on {cu.device} but q is on {q.device}")
    c = cu.tolist()
    if c[0] != 0:
        _fail(op, f"{name} must start at 0, got {c[0]}")
    for i in range(1, len(c)):
        if c[i] < c[i - 1]:
            _fail(op, f"{name} must be non-decreasing, got {c[i - 1]} then {c[i]} at index {i}")
    if c[-1] != total:
        _fail(op, f"{name} must end at {total_name} = {total}, got {c[-1]}")
    longest = max((b - a for a, b in zip(c, c[1:])), default=0)
    if max_len < 0:
        _fail(op, f"{max_name} must be >= 0 (0: the longest), got {max_len}")
    if max_len and max_len < longest:
        _fail(op, f"{max_name} is {max_len} but {name} has a sequence of length {longest}")
    return max_len or longest


def _check_kv_dtypes(op, q, k, v, k_scale, v_scale):
    """k and v in q's dtype, or both int8 / both float8_e4m3fn with their scales (check_kv_dtypes)."""
    k8, v8 = k.dtype in KV_CODES, v.dtype in KV_CODES
    if not (k8 or v8) and k_scale is None and v_scale is None:
        _check_same(op, "q", q, "k", k)
        _check_same(op, "q", q, "v", v)
        return
    if not (k8 or v8):
        _fail(op, f"k_scale / v_scale are the scales of int8 (or float8_e4m3fn) k and v, but k and v are "
                  f"{k.dtype}")
    if not (k8 and v8 and k.dtype == v.dtype):
        _fail(op, f"k and v are int8 (or float8_e4m3fn) together or not at all, got k {k.dtype} and v {v.dtype}")
    if k_scale is None or v_scale is None:
        _fail(op, f"{k.dtype} k and v need k_scale and v_scale (float32, one scale per position and kv head)")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        _fail(op, f"with {k.dtype} k and v, q must be float32, bfloat16 or float16, got {q.dtype}")
    for name, t in (("k", k), ("v", v), ("k_scale", k_scale), ("v_scale", v_scale)):
        if t.device != q.device:
            _fail(op, f"{name} is on {t.device} but q is on {q.device}")


def check_attention(op, q, k, v, mask, scale, window, dropout_p, max_head_dim=MAX_HEAD_DIM,
                    window_right=-1, softcap=0.0, sinks=None, alibi_slopes=None, cu_seqlens_q=None,
                    cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, k_scale=None, v_scale=None,
                    kv_lens=None, block_table=None):
    """The attention op's checks but its seed's and its scales' (check_attention_call), in the
    order of check_attention_params (csrc/include/fusedllm/attention_op.h): the arguments, then
    mask, sinks, alibi_slopes and dropout_p. ``max_head_dim=None`` lifts the kernels' head_dim
    limit. Returns (number of sequences, longest query length, longest key length)."""
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        _fail(op, "cu_seqlens_q and cu_seqlens_k go together: pass both or neither")
    if packed:
        for name, t, total, heads in (("q", q, "total_q", "q_heads"), ("k", k, "total_k", "kv_heads"),
                                      ("v", v, "total_k", "kv_heads")):
            if t.dim() != 3:
                _fail(op, f"with cu_seqlens, {name} must be 3-D [{total}, {heads}, head_dim], "
                          f"got shape {list(t.shape)}")
    else:
        for name, t, heads, length in (("q", q, "q_heads", "q_len"), ("k", k, "kv_heads", "kv_len"),
                                       ("v", v, "kv_heads", "kv_len")):
            if t.dim() != 4:
                _fail(op, f"{name} must be 4-D [batch, {heads}, {length}, head_dim], got shape "
                          f"{list(t.shape)}")
    _check_float(op, "q", q)
    _check_kv_dtypes(op, q, k, v, k_scale, v_scale)
    if k.shape != v.shape:
        _fail(op, f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
    q_heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[-1]
    if k.shape[-1] != head_dim:
        _fail(op, f"q and k/v must have the same head_dim, got {head_dim} and {k.shape[-1]}")
    if packed:
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            _fail(op, f"cu_seqlens_q and cu_seqlens_k must have the same length (num_seqs + 1), got "
                      f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
        sq = _check_cu_seqlens(op, "cu_seqlens_q", cu_seqlens_q, q, q.shape[0], "total_q", max_seqlen_q,
                               "max_seqlen_q")
        sk = _check_cu_seqlens(op, "cu_seqlens_k", cu_seqlens_k, q, k.shape[0], "total_k", max_seqlen_k,
                               "max_seqlen_k")
        batch = cu_seqlens_q.numel() - 1
        if mask is not None:
            _fail(op, "mask is not supported with packed sequences (cu_seqlens); each sequence attends "
                      "within itself, with causal / window bounds")
    else:
        batch, sq, sk = q.shape[0], q.shape[2], k.shape[2]
        if block_table is None and k.shape[0] != batch:  # with block_table, k and v are pages
            _fail(op, f"q and k/v must have the same batch size, got {batch} and {k.shape[0]}")
        if max_seqlen_q or max_seqlen_k:
            _fail(op, "max_seqlen_q / max_seqlen_k are for packed sequences (cu_seqlens) only")
    if kv_lens is not None or block_table is not None:
        sk = _check_kv_lens(op, q, k, kv_lens, block_table, mask, dropout_p, cu_seqlens_q, batch)
    if (q_heads % kv_heads != 0) if kv_heads else q_heads != 0:
        _fail(op, f"the number of query heads ({q_heads}) must be a multiple of the number of key/value "
                  f"heads ({kv_heads})")
    if max_head_dim is not None and not 1 <= head_dim <= max_head_dim:
        _fail(op, f"head_dim must be between 1 and {max_head_dim}, got {head_dim}")
    if head_dim < 1:
        _fail(op, f"head_dim must be at least 1, got {head_dim}")
    if not math.isfinite(scale):
        _fail(op, f"scale must be a finite number, got {scale:g}")
    if window != -1 and window < 1:
        _fail(op, f"window must be -1 (no window) or a number of keys >= 1, got {window}")
    if window_right < -1:
        _fail(op, f"window_right must be -1 (no bound) or a number of keys >= 0, got {window_right}")
    if not (math.isfinite(softcap) and softcap >= 0):
        _fail(op, f"softcap must be 0 (none) or a positive number, got {softcap:g}")
    if mask is not None:  # check_tensor_mask
        if mask.device != q.device:
            _fail(op, f"mask is on {mask.device} but q is on {q.device}")
        if mask.dtype != torch.bool and mask.dtype not in FLOAT_DTYPES:
            _fail(op, f"mask must be a bool keep-mask or a float32, float64, bfloat16 or float16 additive "
                      f"mask, got {mask.dtype}")
        target = [batch, q_heads, sq, sk]
        if mask.dim() > 4 or any(m not in (1, t) for m, t in zip(reversed(mask.shape), reversed(target))):
            _fail(op, f"mask of shape {list(mask.shape)} does not broadcast to [batch, q_heads, q_len, "
                      f"kv_len] = {target}")
    if sinks is not None:  # check_score_mods
        _check_float(op, "sinks", sinks)
        if sinks.device != q.device:
            _fail(op, f"sinks is on {sinks.device} but q is on {q.device}")
        if sinks.dim() != 1 or sinks.shape[0] != q_heads:
            _fail(op, f"sinks must be 1-D [q_heads] = [{q_heads}], got shape {list(sinks.shape)}")
    if alibi_slopes is not None:
        if alibi_slopes.dtype not in (torch.float32, torch.float64):
            _fail(op, f"alibi_slopes must be float32 or float64, got {alibi_slopes.dtype}")
        if alibi_slopes.device != q.device:
            _fail(op, f"alibi_slopes is on {alibi_slopes.device} but q is on {q.device}")
        if tuple(alibi_slopes.shape) not in ((q_heads,), (batch, q_heads)):
            _fail(op, f"alibi_slopes must be [q_heads] = [{q_heads}] or [{'num_seqs' if packed else 'batch'}, "
                      f"q_heads] = [{batch}, {q_heads}], got shape {list(alibi_slopes.shape)}")
    if not 0.0 <= dropout_p < 1.0:  # check_dropout
        _fail(op, f"dropout_p must be in [0, 1), got {dropout_p:g}")
    return batch, sq, sk


def _check_kv_lens(op, q, k, kv_lens, block_table, mask, dropout_p, cu_seqlens_q, batch):
    """The op's checks of kv_lens / block_table (check_kv_lens); returns the longest length."""
    if kv_lens is None:
        _fail(op, "block_table needs kv_lens (int32 [batch], the number of keys of each sequence)")
    if cu_seqlens_q is not None:
        _fail(op, "kv_lens / block_table take q as [batch, q_heads, q_len, head_dim], not packed "
                  "sequences (cu_seqlens)")
    if mask is not None:
        _fail(op, "mask is not supported with kv_lens / block_table; each sequence's keys end at its "
                  "kv_lens entry, bounded by causal / window")
    if dropout_p != 0.0:
        _fail(op, f"kv_lens / block_table read a KV cache for inference; dropout_p must be 0, got "
                  f"{dropout_p:g}")
    for name, t, dims, shape in (("kv_lens", kv_lens, 1, "[batch]"),
                                 ("block_table", block_table, 2, "[batch, max_pages]")):
        if t is None:
            continue
        if t.dtype != torch.int32:
            _fail(op, f"{name} must be int32, got {t.dtype}")
        if t.device != q.device:
            _fail(op, f"{name} is on {t.device} but q is on {q.device}")
        if t.dim() != dims or t.shape[0] != batch:
            _fail(op, f"{name} must be {shape} with batch = {batch}, got shape {list(t.shape)}")
    page_size = k.shape[2]
    capacity = k.shape[2]
    if block_table is not None:
        if page_size < 1:
            _fail(op, f"with block_table, k and v are pages [num_pages, kv_heads, page_size, head_dim] "
                      f"with page_size >= 1, got shape {list(k.shape)}")
        capacity = block_table.shape[1] * page_size
    lens = kv_lens.tolist()
    for b, n in enumerate(lens):
        if not 0 <= n <= capacity:
            where = "block_table's max_pages * page_size" if block_table is not None else "k's kv_len"
            _fail(op, f"kv_lens[{b}] = {n} is not in [0, {capacity}] ({where})")
        if block_table is None:
            continue
        used = -(-n // page_size)
        for i, page in enumerate(block_table[b, :used].tolist()):
            if not 0 <= page < k.shape[0]:
                _fail(op, f"block_table[{b}, {i}] = {page} is not a page of k / v (num_pages = "
                          f"{k.shape[0]}); sequence {b} has {n} keys, so its first {used} entries are read")
    return max(lens, default=0)


def check_attention_call(op, q, k, v, mask, scale, window, dropout_p, seed, window_right, softcap, sinks,
                         alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, k_scale,
                         v_scale, kv_lens, block_table):
    """Every check of one call of the attention op, in the C++ order: the autograd kernel's
    refusal of gradients through a KV cache (csrc/attention.cpp), check_attention, the seed
    (check_dropout), then the scales of int8 / float8 k and v (plan_attention_forward).
    Returns check_attention's (number of sequences, longest query length, longest key length)."""
    quantized = k_scale is not None or v_scale is not None
    if (quantized or kv_lens is not None or block_table is not None) and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, sinks, k_scale, v_scale)):
        kind = "quantized k and v (k_scale / v_scale)" if quantized else "kv_lens / block_table"
        _fail(op, f"{kind} read a KV cache for inference and have no backward; run under torch.no_grad() "
                  f"or torch.inference_mode(), or detach q, k and v")
    shape = check_attention(op, q, k, v, mask, scale, window, dropout_p, window_right=window_right,
                            softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                            cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                            k_scale=k_scale, v_scale=v_scale, kv_lens=kv_lens, block_table=block_table)
    if dropout_p > 0 and not (seed is not None and seed.dtype == torch.int64 and seed.numel() == 1
                              and seed.device.type == "cpu"):
        _fail(op, "dropout_p > 0 needs seed, a one-element int64 CPU tensor")
    if k_scale is not None:  # check_kv_dtypes has seen v_scale too
        layout = ("[total_k, kv_heads]" if cu_seqlens_q is not None
                  else "[num_pages, kv_heads, page_size]" if block_table is not None else "[batch, kv_heads, kv_len]")
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if t.dtype != torch.float32:
                _fail(op, f"{name} must be float32, got {t.dtype}")
            if list(t.shape) != list(k.shape[:-1]):
                _fail(op, f"{name} must be {layout} = {list(k.shape[:-1])}, got shape {list(t.shape)}")
    return shape


def attention_with_probs(q, k, v, mask, scale, causal, window, dropout_p, seed, window_right=-1,
                         softcap=0.0, sinks=None, alibi_slopes=None, dropout_counter=None):
    """softmax(q k^T * scale + mask) v with K/V repeated per query group, in
    float32 (float64 for float64 inputs), dropout as the kernels draw it;
    returns (out, lse, probabilities after dropout). Builds the whole [Sq, Sk]
    score matrix: a reference, not a fast path. Scores are soft-capped, then
    get the ALiBi bias and the masks; sinks join each row's denominator."""
    acc = accumulation_dtype(q)
    group = q.shape[1] // k.shape[1] if k.shape[1] else 1
    kf = k.to(acc).repeat_interleave(group, dim=1)
    vf = v.to(acc).repeat_interleave(group, dim=1)
    scores = torch.matmul(q.to(acc), kf.transpose(-1, -2)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    sq, sk = q.shape[2], k.shape[2]
    pos = torch.arange(sq, device=q.device).unsqueeze(1) + (sk - sq)
    key = torch.arange(sk, device=q.device).unsqueeze(0)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(acc).reshape(-1, q.shape[1], 1, 1)
        scores = scores - slopes * (pos - key).abs().to(acc)
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        visible &= key <= pos
    if window >= 1:
        visible &= key > pos - window
    if window_right >= 0:
        visible &= key <= pos + window_right
    scores = scores.masked_fill(~visible, float("-inf"))
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            # The dtype's most negative finite value means "masked" (as -inf).
            scores = (scores + mask.to(acc)).masked_fill(mask <= torch.finfo(mask.dtype).min,
                                                         float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.to(acc).reshape(1, -1, 1))
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1))
    if dropout_p > 0:
        keep = dropout_keep(int(seed.item()), probs.shape, dropout_p, q.device, dropout_counter)
        probs = probs * keep / (1.0 - dropout_p)
    out = torch.matmul(probs, vf).to(q.dtype)
    return out, lse.detach(), probs


def _cache_rows(t, b, n, block_table):
    """The first n rows of sequence b of a dense or paged k / v, as [1, heads, n, head_dim]."""
    if block_table is None:
        return t[b:b + 1, :, :n]
    page_size = t.shape[2]
    pages = block_table[b, :-(-n // page_size)].long()
    rows = t[pages].transpose(0, 1).flatten(1, 2)  # [heads, pages * page_size, head_dim]
    return rows[:, :n].unsqueeze(0)


def _zeros_of(q, k, v):
    """Zeros of q's shape that autograd sees as a function of q, k and v (zero
    gradients), as the op's outputs are, even where no key exists."""
    never = torch.zeros((), dtype=torch.bool, device=q.device)
    return torch.where(never, q, 0.0) + torch.where(never, k.sum() + v.sum(), 0.0).to(q.dtype)


@_plain.op("attention")
def _plain_attention(q, k, v, mask, scale, causal, window, dropout_p, seed, window_right=-1, softcap=0.0,
                     sinks=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
                     max_seqlen_k=0, k_scale=None, v_scale=None, kv_lens=None, block_table=None):
    """The attention op: (out, lse). Every check runs first, on the whole call
    (check_attention_call). int8 / float8 k and v run dequantized to float32,
    with q in float32 and the output cast back. Packed sequences, and caches of
    several lengths (kv_lens, block_table), run one sequence at a time."""
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None  # attention_varlen's call: its name
    op = "fusedllm.attention_varlen" if packed else "fusedllm.attention"
    _, _, max_k = check_attention_call(op, q, k, v, mask, scale, window, dropout_p, seed, window_right, softcap,
                                       sinks, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, k_scale, v_scale, kv_lens, block_table)
    opts = dict(window_right=window_right, softcap=softcap, sinks=sinks)
    if k_scale is not None:  # float32 k * k_scale, v * v_scale (any layout: a scale per row of k / v)
        out, lse = _attention(q.float(), k.float() * k_scale.unsqueeze(-1), v.float() * v_scale.unsqueeze(-1),
                              mask, scale, causal, window, dropout_p, seed, alibi_slopes, cu_seqlens_q,
                              cu_seqlens_k, max_k, kv_lens, block_table, opts)
        return out.to(q.dtype), lse
    return _attention(q, k, v, mask, scale, causal, window, dropout_p, seed, alibi_slopes, cu_seqlens_q,
                      cu_seqlens_k, max_k, kv_lens, block_table, opts)


def _attention(q, k, v, mask, scale, causal, window, dropout_p, seed, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
               max_k, kv_lens, block_table, opts):
    """The attention op's result on checked arguments (max_k: the longest key length, packed)."""
    sinks = opts["sinks"]
    if kv_lens is not None:  # a cache of several lengths (no dropout, no gradient): a sequence at a time
        outs, lses = [], []
        for b, n in enumerate(kv_lens.tolist()):
            if n == 0:  # no keys: zeros, and the sink's logit (or -inf) as lse
                ob = q.new_zeros(q[b:b + 1].shape)
                lb = q.new_full(q.shape[1:-1], float("-inf"), dtype=accumulation_dtype(q)).unsqueeze(0)
                if sinks is not None:
                    lb = lb.logaddexp(sinks.to(lb.dtype).view(1, -1, 1))
            else:
                slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b:b + 1]
                ob, lb, _ = attention_with_probs(q[b:b + 1], _cache_rows(k, b, n, block_table),
                                                 _cache_rows(v, b, n, block_table), None, scale, causal, window,
                                                 0.0, None, alibi_slopes=slopes, **opts)
            outs.append(ob)
            lses.append(lb)
        if not outs:
            return q.new_zeros(q.shape), q.new_empty(q.shape[:-1], dtype=accumulation_dtype(q))
        return torch.cat(outs), torch.cat(lses)
    if cu_seqlens_q is None:
        out, lse, _ = attention_with_probs(q, k, v, mask, scale, causal, window, dropout_p, seed,
                                           alibi_slopes=alibi_slopes, **opts)
        return out, lse
    total_q, heads = q.shape[0], q.shape[1]
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(cq) == 1:  # no sequence at all
        return _zeros_of(q, k, v), q.new_empty((heads, 0), dtype=accumulation_dtype(q))
    outs, lses = [], []
    for b in range(len(cq) - 1):
        qb = q[cq[b]:cq[b + 1]].transpose(0, 1).unsqueeze(0)
        kb = k[ck[b]:ck[b + 1]].transpose(0, 1).unsqueeze(0)
        vb = v[ck[b]:ck[b + 1]].transpose(0, 1).unsqueeze(0)
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
        counter = None
        if dropout_p > 0:
            # The packed rows' draws: row h * total_q + cu_q[b] + i, key j at row * max_seqlen_k + j.
            rows = (torch.arange(heads, device=q.device).view(-1, 1) * total_q
                    + cq[b] + torch.arange(qb.shape[2], device=q.device).view(1, -1))
            counter = (rows.unsqueeze(-1) * max_k + torch.arange(kb.shape[2], device=q.device)).unsqueeze(0)
        if kb.shape[2] == 0:
            # no keys: zeros, and the sink's logit (or -inf) as lse
            ob = _zeros_of(qb, kb, vb)
            lb = qb.new_full((1, heads, qb.shape[2]), float("-inf"), dtype=accumulation_dtype(q))
            if sinks is not None:
                lb = lb.logaddexp(sinks.to(lb.dtype).view(1, -1, 1)).detach()
        else:
            ob, lb, _ = attention_with_probs(qb, kb, vb, None, scale, causal, window, dropout_p, seed,
                                             alibi_slopes=slopes, dropout_counter=counter, **opts)
        outs.append(ob[0].transpose(0, 1))
        lses.append(lb[0])
    return torch.cat(outs, 0), torch.cat(lses, 1)


# --- fake kernels ----------------------------------------------------------------------------------


def _attention_rows(t, heads_dim_first):
    """A fresh tensor shaped like q / k in the kernels' row order: contiguous
    dense [B, H, S, D], or packed [total, H, D] over [H, total, D] storage."""
    if heads_dim_first:
        return t.new_empty(t.shape[1], t.shape[0], t.shape[2]).permute(1, 0, 2)
    return t.new_empty(t.shape)


@_fake.fake("attention")
def _attention_fake(q, k, v, mask, scale, causal, window, dropout_p, seed, window_right=-1,
                    softcap=0.0, sinks=None, alibi_slopes=None, cu_seqlens_q=None,
                    cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, k_scale=None, v_scale=None,
                    kv_lens=None, block_table=None):
    packed = cu_seqlens_q is not None
    lse_shape = (q.shape[1], q.shape[0]) if packed else q.shape[:-1]
    return _attention_rows(q, packed), q.new_empty(lse_shape, dtype=accumulation_dtype(q))


@_fake.fake("attention_backward")
def _attention_backward_fake(grad_out, q, k, v, out, lse, mask, scale, causal, window,
                             dropout_p, seed, window_right=-1, softcap=0.0, sinks=None,
                             alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None,
                             max_seqlen_q=0, max_seqlen_k=0):
    packed = cu_seqlens_q is not None
    grad_sinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty(0)
    return (_attention_rows(q, packed), _attention_rows(k, packed), _attention_rows(v, packed),
            grad_sinks)


# --- on DTensors -----------------------------------------------------------------------------------


def _attention_placements(q, k, mask, sinks, alibi_slopes, cu_seqlens_q, k_scale, kv_lens,
                          block_table, dim):
    """Placements of q, k (v alike), out, lse, mask, sinks, alibi_slopes, the
    sequence tensors (cu_seqlens, kv_lens, block_table) and the scales when
    the batch (dim 0) or the heads (dim 1) are sharded; None where that split
    cannot be computed shard by shard."""
    packed, paged = cu_seqlens_q is not None, block_table is not None
    heads_dim = 1  # [B, H, S, D], packed [total, H, D], pages [num_pages, H, page, D]
    batch = None if packed else q.shape[0]
    if dim == 0:
        if packed:
            return None  # the batch is a list of sequences along the token dim
        m = None if mask is None else _placement_on(mask, len(mask.shape) - 4, batch)
        kv = replicate() if paged else shard(0)  # pages are found through each sequence's table
        alibi = None
        if alibi_slopes is not None:
            alibi = _placement_on(alibi_slopes, 0, batch) if len(alibi_slopes.shape) == 2 else replicate()
        return dict(q=shard(0), kv=kv, out=shard(0), lse=shard(0), mask=m, sinks=replicate(),
                    alibi=alibi, seq=shard(0), scales=kv)
    # heads: the query heads of a group must land with their key/value head,
    # which uneven shards (torch.chunk's) would break
    hq, hkv = q.shape[heads_dim], k.shape[heads_dim]
    if hq != hkv and hkv % _mesh_size(q):
        return None
    m = None if mask is None else _placement_on(mask, len(mask.shape) - 3, hq)
    alibi = None if alibi_slopes is None else shard(len(alibi_slopes.shape) - 1)
    return dict(q=shard(1), kv=shard(1), out=shard(1), lse=shard(0) if packed else shard(1), mask=m,
                sinks=shard(0), alibi=alibi, seq=replicate(), scales=shard(1))


def _attention_rules(op, q, k, mask, dropout_p, sinks, alibi_slopes, cu_seqlens_q, k_scale, kv_lens,
                     block_table):
    if dropout_p > 0:
        _refuse(op, f"dropout_p={dropout_p} would drop the same pattern on every rank's shard (the "
                    f"seed is not split by shard); use dropout_p=0, or call it on local tensors")
    splits = [dict(q=replicate(), kv=replicate(), out=replicate(), lse=replicate(), mask=replicate(),
                   sinks=replicate(), alibi=replicate(), seq=replicate(), scales=replicate())]
    for dim in (0, 1):
        p = _attention_placements(q, k, mask, sinks, alibi_slopes, cu_seqlens_q, k_scale, kv_lens,
                                  block_table, dim)
        if p is not None:
            splits.append(p)
    return splits


@_sharding.rule("attention")
def _shard_attention(q, k, v, mask, scale, causal, window, dropout_p, seed, window_right=-1, softcap=0.0,
                     sinks=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
                     max_seqlen_k=0, k_scale=None, v_scale=None, kv_lens=None, block_table=None):
    rules = []
    for p in _attention_rules("attention", q, k, mask, dropout_p, sinks, alibi_slopes, cu_seqlens_q,
                              k_scale, kv_lens, block_table):
        rules.append(([p["out"], p["lse"]],
                      [p["q"], p["kv"], p["kv"], _on(mask, p["mask"]), None, None, None, None,
                       _on(seed, replicate()), None, None, _on(sinks, p["sinks"]),
                       _on(alibi_slopes, p["alibi"]), _on(cu_seqlens_q, p["seq"]),
                       _on(cu_seqlens_k, p["seq"]), None, None, _on(k_scale, p["scales"]),
                       _on(v_scale, p["scales"]), _on(kv_lens, p["seq"]), _on(block_table, p["seq"])]))
    return rules


@_sharding.rule("attention_backward")
def _shard_attention_backward(grad_out, q, k, v, out, lse, mask, scale, causal, window, dropout_p, seed,
                              window_right=-1, softcap=0.0, sinks=None, alibi_slopes=None, cu_seqlens_q=None,
                              cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0):
    rules = []
    for p in _attention_rules("attention_backward", q, k, mask, dropout_p, sinks, alibi_slopes,
                              cu_seqlens_q, None, None, None):
        # a batch shard gives part of the sinks' gradient (a sum over ranks); without sinks it is empty
        grad_sinks = (partial() if p["q"] == shard(0) else p["sinks"]) if sinks is not None else replicate()
        rules.append(([p["out"], p["kv"], p["kv"], grad_sinks],
                      [p["out"], p["q"], p["kv"], p["kv"], p["out"], p["lse"], _on(mask, p["mask"]),
                       None, None, None, None, _on(seed, replicate()), None, None,
                       _on(sinks, p["sinks"]), _on(alibi_slopes, p["alibi"]),
                       _on(cu_seqlens_q, p["seq"]), _on(cu_seqlens_k, p["seq"]), None, None]))
    return rules
