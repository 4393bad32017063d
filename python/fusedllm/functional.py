"""One function per fused op. The ops check their own arguments (the C++
operators, or the plain path's twins of those checks) and their messages name
the argument; here only what they cannot say: Python types, devices (the
dispatcher picks a kernel by device before any check runs), the arguments
this layer adds (``None`` defaults, rope table layouts, the dropout seed)."""

from __future__ import annotations

import math
from numbers import Integral, Real

import torch

from . import _autocast, _checks, _plain
from ._devices import ops_for
from ._limits import GPT_OSS_ALPHA, GPT_OSS_LIMIT, check_reduction, check_rotary_dim

# Each call takes its implementation from ops_for(first tensor): the compiled
# operators on CPU (and CUDA when built with its kernels), the plain path
# (same names and signatures) on other devices or without the extension.


def _require_tensor(op: str, name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")


def _require_tensors(op: str, ref_name: str, ref, **others) -> None:
    """Tensors (None allowed among ``others``) on the device of ``ref``."""
    _require_tensor(op, ref_name, ref)
    for name, t in others.items():
        if t is None:
            continue
        _require_tensor(op, name, t)
        if t.device != ref.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}")


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


def _attention_with_lse(q, k, v, causal=False, window=None, mask=None, dropout_p=0.0, k_scale=None,
                        v_scale=None, scale=None, softcap=None):
    """:func:`attention` and its float32 log-sum-exp ``[batch, q_heads, q_len]``
    (``-inf`` for a query that sees no key): what merging the outputs of
    attention over disjoint key sets needs (:func:`_merge_attention`)."""
    scale, window, right, softcap, mask, dropout_p, seed = _attention_args(
        "fusedllm.attention", q, k, v, causal, scale, window, mask, dropout_p, softcap, k_scale=k_scale,
        v_scale=v_scale)
    return ops_for(q).attention(q, k, v, mask, scale, causal, window, dropout_p, seed, right, softcap,
                                None, None, None, None, 0, 0, k_scale, v_scale)


def _merge_attention(pieces, dtype: torch.dtype, sinks: torch.Tensor | None = None) -> torch.Tensor:
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
    _checks.check_attention(op, q, k, v, mask, scale, window, dropout_p, max_head_dim=None,
                            window_right=right, softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes)
    out, _lse, probs = _plain.attention_with_probs(q, k, v, mask, scale, causal, window, dropout_p, seed,
                                                   window_right=right, softcap=softcap, sinks=sinks,
                                                   alibi_slopes=alibi_slopes)
    return out, probs.to(q.dtype)


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


def _number(op: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{op}: {name} must be a number, got {value!r}")
    return float(value)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0,
                         softcap: float | None = None, z_loss: float = 0.0) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T + bias, target)`` without the logits.

    ``hidden`` is ``[..., hidden_size]`` (any leading shape), ``weight``
    ``[vocab, hidden_size]`` (an LM head's), ``bias`` ``[vocab]`` or None,
    ``target`` int64 class indices of hidden's leading shape; tokens whose
    target is ``ignore_index`` add nothing. The logits are formed a chunk of
    tokens at a time (about as many as the hidden states hold, at least 4 MiB;
    with a float32 weight's gradient at least a quarter of its size), never
    the whole ``[tokens, vocab]`` matrix once there are more tokens than a
    chunk; each logit is rounded once to the inputs' dtype, as an eager linear
    layer rounds it, and softmax and loss are float32 (float64 for float64
    inputs). With ``reduction`` "mean" or "sum" the gradients are formed in
    the same pass; with "none" backward recomputes them chunk by chunk. A
    bfloat16 / float16 weight's gradient over several chunks takes no float32
    buffer of the weight's size: on CUDA, with chunks of 512 tokens or more,
    it is summed over them in its own dtype (rounded once a chunk); otherwise
    it is made a vocabulary slab at a time (each slab's logits made again, a
    fourth multiply, one rounding). Every multiply sums in float32.

    ``reduction``: "mean" (over the tokens not ignored; NaN when all are, as
    ``cross_entropy``), "sum", or "none" (per-token losses of target's shape, 0
    where ignored). ``label_smoothing`` as in ``F.cross_entropy``.
    ``softcap`` (Gemma 2's final-logit soft-capping) replaces the logits by
    ``softcap * tanh(logits / softcap)`` first. ``z_loss`` adds
    ``z_loss * logsumexp(logits) ** 2`` per token (PaLM's auxiliary loss).
    The loss is float32 (float64 for float64 inputs) whatever hidden's dtype,
    as Hugging Face computes it; differentiable in hidden, weight and bias.
    """
    op = "fusedllm.linear_cross_entropy"
    _require_tensors(op, "hidden", hidden, weight=weight, target=target, bias=bias)
    if hidden.dim() < 1:
        raise ValueError(f"{op}: hidden must have at least one dimension (hidden_size), got a scalar")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"{op}: target must have hidden's leading shape {list(hidden.shape[:-1])}, "
                         f"got {list(target.shape)}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, Integral):
        raise ValueError(f"{op}: ignore_index must be an int, got {ignore_index!r}")
    check_reduction(op, reduction)
    if softcap is None:
        cap = 0.0
    else:
        cap = _number(op, "softcap", softcap)
        if not cap > 0:
            raise ValueError(f"{op}: softcap must be > 0 (or None for no cap), got {softcap!r}")
    loss = ops_for(hidden).linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, target.reshape(-1), int(ignore_index),
        reduction, _number(op, "label_smoothing", label_smoothing), cap, _number(op, "z_loss", z_loss))
    return loss.reshape(target.shape) if reduction == "none" else loss


def _int(op: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{op}: {name} must be an int, got {value!r}")
    return int(value)


def moe_route(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax",
              normalize: bool = True, correction_bias: torch.Tensor | None = None,
              num_groups: int = 1, top_groups: int | None = None, scaling: float = 1.0):
    """A mixture-of-experts router: ``(weights, indices)``, each ``[tokens, top_k]``.

    ``router_logits`` is ``[..., num_experts]`` (any leading shape, flattened to
    tokens). ``scoring="softmax"`` scores the experts by a softmax over all of
    them (Mixtral, Qwen2/3-MoE, OLMoE); ``"sigmoid"`` by a sigmoid of each logit
    (DeepSeek-V3). The ``top_k`` best scores are chosen per token, larger first;
    on exact ties the lower expert index wins (``torch.topk`` leaves the order
    of ties unspecified, and it differs between sizes and devices).
    ``correction_bias`` ``[num_experts]`` is added to the scores for choosing
    only (DeepSeek-V3's ``e_score_correction_bias``). ``num_groups > 1``:
    experts form equal groups, each scored by the sum of its two best
    (biased) scores, and only the ``top_groups`` best groups are chosen from.
    ``weights`` are the chosen scores, divided by their sum when ``normalize``
    (Mixtral always; ``norm_topk_prob`` in the others), times ``scaling``;
    float32 (float64 for float64 logits), differentiable in ``router_logits``.
    ``indices`` is int64.
    """
    op = "fusedllm.moe_route"
    _require_tensors(op, "router_logits", router_logits, correction_bias=correction_bias)
    if router_logits.dim() < 1:
        raise ValueError(f"{op}: router_logits must be [..., num_experts], got a scalar")
    top_k = _int(op, "top_k", top_k)
    num_groups = _int(op, "num_groups", num_groups)
    top_groups = num_groups if top_groups is None else _int(op, "top_groups", top_groups)
    if not isinstance(normalize, bool):
        raise ValueError(f"{op}: normalize must be a bool, got {normalize!r}")
    return ops_for(router_logits).moe_route(router_logits.reshape(-1, router_logits.shape[-1]), top_k,
                                            scoring, normalize, correction_bias, num_groups, top_groups,
                                            _number(op, "scaling", scaling))


def moe_experts(hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                activation: str = "silu", *, gate_up_bias: torch.Tensor | None = None,
                down_bias: torch.Tensor | None = None, transposed: bool = False,
                interleaved: bool = False, alpha: float = GPT_OSS_ALPHA, limit: float = GPT_OSS_LIMIT) -> torch.Tensor:
    """The experts of a mixture-of-experts layer, each token through its chosen ones.

    ``hidden`` ``[..., hidden_size]``; ``indices`` (int64) and ``weights``
    ``[..., top_k]`` of hidden's leading shape (what ``moe_route`` gives);
    ``gate_up_proj`` ``[num_experts, 2 * intermediate, hidden_size]`` (rows
    ``[gate | up]``) and ``down_proj`` ``[num_experts, hidden_size,
    intermediate]``, the expert weights as transformers stores them. For each
    token ``t`` and choice ``j``, with ``e = indices[t, j]``:
    ``out[t] += weights[t, j] * down_proj[e] @ (act(gate) * up)`` where
    ``[gate | up] = gate_up_proj[e] @ hidden[t]``, ``act`` silu or gelu_tanh.

    gpt-oss's experts (``GptOssExperts``) are the same with four options:
    ``gate_up_bias`` ``[num_experts, 2 * intermediate]`` and ``down_bias``
    ``[num_experts, hidden_size]`` are added to expert ``e``'s gate/up and down
    products (in the products' epilogues); ``transposed=True`` reads the
    weights stored as ``gate_up_proj [num_experts, hidden_size, 2 *
    intermediate]`` and ``down_proj [num_experts, intermediate, hidden_size]``
    (``hidden @ gate_up_proj[e]``), where they lie, without a transposed copy;
    ``interleaved=True`` takes the gate from the even columns of the gate/up
    product and up from the odd ones; ``activation="gpt_oss"`` is the clamped
    SwiGLU ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with
    ``g = clamp(gate, max=limit)`` (``limit`` is the config's
    ``swiglu_limit``; its gradient is zero where a clamp holds, as autograd of
    that formula gives; ``limit=inf`` clamps nothing). The options combine
    freely with each other and with silu and gelu_tanh.

    Tokens are grouped by expert (a stable counting sort), each expert's rows
    multiplied at once, and each token's outputs summed in float32 in a fixed
    order (deterministic: choice order when a gradient will be needed; on the
    CPU without one, expert order). Experts with no tokens cost nothing. The
    gathered rows and their gate/up rows and activation exist a part at a
    time; when a gradient will be needed the gate/up rows and the experts'
    outputs are kept whole for backward. Out has hidden's dtype;
    differentiable in hidden, weights, both projections and both biases.
    """
    op = "fusedllm.moe_experts"
    _require_tensors(op, "hidden", hidden, indices=indices, weights=weights,
                     gate_up_proj=gate_up_proj, down_proj=down_proj, gate_up_bias=gate_up_bias,
                     down_bias=down_bias)
    if hidden.dim() < 1:
        raise ValueError(f"{op}: hidden must be [..., hidden_size], got a scalar")
    lead = tuple(hidden.shape[:-1])
    if indices.dim() < 1 or tuple(indices.shape[:-1]) != lead:
        raise ValueError(f"{op}: indices must be [..., top_k] with hidden's leading shape {list(lead)}, "
                         f"got {list(indices.shape)}")
    if tuple(weights.shape) != tuple(indices.shape):
        raise ValueError(f"{op}: weights must have indices' shape {list(indices.shape)}, "
                         f"got {list(weights.shape)}")
    for name, flag in (("transposed", transposed), ("interleaved", interleaved)):
        if not isinstance(flag, bool):
            raise ValueError(f"{op}: {name} must be a bool, got {flag!r}")
    top_k = indices.shape[-1]
    out = ops_for(hidden).moe_experts(hidden.reshape(-1, hidden.shape[-1]), indices.reshape(-1, top_k),
                                      weights.reshape(-1, top_k), gate_up_proj, down_proj, activation, False,
                                      gate_up_bias, down_bias, transposed, interleaved,
                                      _number(op, "alpha", alpha), _number(op, "limit", limit))[0]
    return out.reshape(hidden.shape)


def moe_load_balancing_loss(router_logits: torch.Tensor, indices: torch.Tensor,
                            num_experts: int | None = None) -> torch.Tensor:
    """The Switch Transformer / Mixtral auxiliary loss that pushes a router
    toward an even load: ``num_experts * sum_e f_e * P_e``, where ``f_e`` is the
    fraction of the (token, choice) pairs routed to expert ``e`` (``indices``,
    as ``moe_route`` gives) and ``P_e`` the mean softmax probability of ``e``
    over the tokens. Equals transformers' ``load_balancing_loss_func`` without an
    attention mask. Differentiable in ``router_logits`` (float32)."""
    op = "fusedllm.moe_load_balancing_loss"
    _require_tensors(op, "router_logits", router_logits, indices=indices)
    experts = router_logits.shape[-1] if num_experts is None else _int(op, "num_experts", num_experts)
    if router_logits.dim() < 1 or router_logits.shape[-1] != experts:
        raise ValueError(f"{op}: router_logits must be [..., {experts}], got {list(router_logits.shape)}")
    if indices.dtype != torch.int64:
        raise ValueError(f"{op}: indices must be int64, got {indices.dtype}")
    probs = router_logits.reshape(-1, experts).float().softmax(-1)
    chosen = indices.reshape(probs.shape[0], -1)
    if chosen.shape[0] != probs.shape[0]:
        raise ValueError(f"{op}: indices must have one row of choices per token of router_logits "
                         f"({probs.shape[0]}), got shape {list(indices.shape)}")
    if probs.shape[0] == 0:
        return probs.new_zeros(())
    fraction = torch.zeros(experts, device=probs.device, dtype=probs.dtype)
    fraction = fraction.index_add(0, chosen.reshape(-1), torch.ones_like(chosen.reshape(-1), dtype=probs.dtype))
    fraction = fraction / chosen.shape[0]
    return experts * (fraction * probs.mean(0)).sum()
