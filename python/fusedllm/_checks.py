"""The plain path's argument checks (:mod:`fusedllm._plain`): twins of the C++ operators' checks."""

from __future__ import annotations

import math

import torch

from ._limits import (ACTIVATIONS, CASTINGS, FLOAT_DTYPES, GPT_OSS_ALPHA, GPT_OSS_LIMIT, KV_CODES, MAX_HEAD_DIM,
                      MOE_ACTIVATIONS, MOE_SCORINGS, accumulation_dtype, check_reduction,
                      check_rotary_dim)

# --- argument checks: the words of csrc/include/fusedllm/*_op.h, numbers printed as C++ does


def _fail(op: str, message: str):
    raise ValueError(f"{op}: {message}")


def _check_float(op, name, t):
    if t.dtype not in FLOAT_DTYPES:
        _fail(op, f"{name} must be float32, float64, bfloat16 or float16, got {t.dtype}")


def _check_same(op, ref_name, ref, name, t):
    if t.dtype != ref.dtype:
        _fail(op, f"{name} has dtype {t.dtype} but {ref_name} has dtype {ref.dtype}")
    if t.device != ref.device:
        _fail(op, f"{name} is on {t.device} but {ref_name} is on {ref.device}")


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


def _check_activation(op, activation):
    if activation not in ACTIVATIONS:
        _fail(op, f"activation must be 'silu' or 'gelu_tanh', got '{activation}'")


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
    refusal of gradients through a KV cache (csrc/autograd.cpp), check_attention, the seed
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


def check_cross_entropy(op, hidden, weight, bias, target, ignore_index, reduction, label_smoothing,
                        softcap, z_loss):
    # the C++ reads reduction before check_cross_entropy (csrc/include/fusedllm/cross_entropy_op.h)
    check_reduction(op, reduction)
    _check_float(op, "hidden", hidden)
    if hidden.dim() != 2:
        _fail(op, f"hidden must be [tokens, hidden_size], got shape {list(hidden.shape)}")
    _check_same(op, "hidden", hidden, "weight", weight)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        _fail(op, f"weight must be [vocab, {hidden.shape[1]}] (hidden's last dim), got shape "
                  f"{list(weight.shape)}")
    if weight.shape[0] < 1:
        _fail(op, f"weight has an empty vocabulary (shape {list(weight.shape)})")
    if bias is not None:
        _check_same(op, "hidden", hidden, "bias", bias)
        if bias.dim() != 1 or bias.shape[0] != weight.shape[0]:
            _fail(op, f"bias must be [{weight.shape[0]}] (weight's vocabulary), got shape {list(bias.shape)}")
    if target.dtype != torch.int64:
        _fail(op, f"target must hold int64 class indices, got {target.dtype}")
    if target.device != hidden.device:
        _fail(op, f"target is on {target.device} but hidden is on {hidden.device}")
    if target.dim() != 1 or target.shape[0] != hidden.shape[0]:
        _fail(op, f"target must be [{hidden.shape[0]}] (one per token of hidden), got shape "
                  f"{list(target.shape)}")
    if not (math.isfinite(label_smoothing) and 0.0 <= label_smoothing <= 1.0):
        _fail(op, f"label_smoothing must be in [0, 1], got {label_smoothing:g}")
    if not (math.isfinite(softcap) and softcap >= 0.0):
        _fail(op, f"softcap must be a finite number > 0 (0: no cap), got {softcap:g}")
    if not (math.isfinite(z_loss) and z_loss >= 0.0):
        _fail(op, f"z_loss must be a finite number >= 0, got {z_loss:g}")
    vocab = weight.shape[0]
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if not target.is_cuda and bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        _fail(op, f"target[{first}] = {int(target[first])} is not a class index in [0, {vocab}) "
                  f"nor ignore_index ({ignore_index})")


def check_moe_route(op, router_logits, top_k, scoring, normalize, correction_bias, num_groups,
                    top_groups, scaling):
    _check_float(op, "router_logits", router_logits)
    if router_logits.dim() != 2 or router_logits.shape[1] < 1:
        _fail(op, f"router_logits must be [tokens, num_experts], got shape {list(router_logits.shape)}")
    experts = router_logits.shape[1]
    if not 1 <= top_k <= experts:
        _fail(op, f"top_k must be in [1, num_experts = {experts}], got {top_k}")
    if scoring not in MOE_SCORINGS:
        _fail(op, f"scoring must be 'softmax' or 'sigmoid', got '{scoring}'")
    if correction_bias is not None:
        _check_float(op, "correction_bias", correction_bias)
        if correction_bias.device != router_logits.device:
            _fail(op, f"correction_bias is on {correction_bias.device} but router_logits is on "
                      f"{router_logits.device}")
        if correction_bias.dim() != 1 or correction_bias.shape[0] != experts:
            _fail(op, f"correction_bias must be [{experts}] (one per expert), got shape "
                      f"{list(correction_bias.shape)}")
    if num_groups < 1 or experts % num_groups:
        _fail(op, f"num_groups must be a positive divisor of num_experts = {experts}, got {num_groups}")
    if not 1 <= top_groups <= num_groups:
        _fail(op, f"top_groups must be in [1, num_groups = {num_groups}], got {top_groups}")
    if top_k > top_groups * (experts // num_groups):
        _fail(op, f"top_k = {top_k} is more than the {top_groups * (experts // num_groups)} experts of "
                  f"the top_groups = {top_groups} groups kept")
    if not math.isfinite(scaling):
        _fail(op, f"scaling must be finite, got {scaling:g}")


def check_moe_experts(op, hidden, indices, weights, gate_up_proj, down_proj, activation,
                      gate_up_bias=None, down_bias=None, transposed=False, alpha=GPT_OSS_ALPHA, limit=GPT_OSS_LIMIT):
    _check_float(op, "hidden", hidden)
    if hidden.dim() != 2:
        _fail(op, f"hidden must be [tokens, hidden_size], got shape {list(hidden.shape)}")
    tokens, hidden_size = hidden.shape
    if indices.dtype != torch.int64:
        _fail(op, f"indices must hold int64 expert indices, got {indices.dtype}")
    if indices.device != hidden.device:
        _fail(op, f"indices is on {indices.device} but hidden is on {hidden.device}")
    if indices.dim() != 2 or indices.shape[0] != tokens or indices.shape[1] < 1:
        _fail(op, f"indices must be [{tokens}, top_k] (hidden's tokens), got shape {list(indices.shape)}")
    if weights.dtype not in (hidden.dtype, accumulation_dtype(hidden)):
        widened = "" if accumulation_dtype(hidden) == hidden.dtype else f" or {accumulation_dtype(hidden)}"
        _fail(op, f"weights must have hidden's dtype {hidden.dtype}{widened}, got {weights.dtype}")
    if weights.device != hidden.device:
        _fail(op, f"weights is on {weights.device} but hidden is on {hidden.device}")
    if weights.shape != indices.shape:
        _fail(op, f"weights must have indices' shape {list(indices.shape)}, got {list(weights.shape)}")
    _check_same(op, "hidden", hidden, "gate_up_proj", gate_up_proj)
    _check_same(op, "hidden", hidden, "down_proj", down_proj)
    gu_in, gu_out = (1, 2) if transposed else (2, 1)
    if (gate_up_proj.dim() != 3 or gate_up_proj.shape[0] < 1 or gate_up_proj.shape[gu_out] % 2
            or gate_up_proj.shape[gu_in] != hidden_size):
        expected = (f"[num_experts, {hidden_size}, 2 * intermediate]" if transposed
                    else f"[num_experts, 2 * intermediate, {hidden_size}]")
        _fail(op, f"gate_up_proj must be {expected} (hidden's last dim{'; transposed=True' if transposed else ''}), "
                  f"got shape {list(gate_up_proj.shape)}")
    experts, inter = gate_up_proj.shape[0], gate_up_proj.shape[gu_out] // 2
    if transposed:
        if list(down_proj.shape) != [experts, inter, hidden_size]:
            _fail(op, f"down_proj must be [{experts}, {inter}, {hidden_size}] (num_experts, intermediate, "
                      f"hidden_size; transposed=True), got shape {list(down_proj.shape)}")
    elif list(down_proj.shape) != [experts, hidden_size, inter]:
        _fail(op, f"down_proj must be [{experts}, {hidden_size}, {inter}] (num_experts, hidden_size, "
                  f"intermediate), got shape {list(down_proj.shape)}")
    if gate_up_bias is not None:
        _check_same(op, "hidden", hidden, "gate_up_bias", gate_up_bias)
        if list(gate_up_bias.shape) != [experts, 2 * inter]:
            _fail(op, f"gate_up_bias must be [{experts}, {2 * inter}] (num_experts, 2 * intermediate), got shape "
                      f"{list(gate_up_bias.shape)}")
    if down_bias is not None:
        _check_same(op, "hidden", hidden, "down_bias", down_bias)
        if list(down_bias.shape) != [experts, hidden_size]:
            _fail(op, f"down_bias must be [{experts}, {hidden_size}] (num_experts, hidden_size), got shape "
                      f"{list(down_bias.shape)}")
    if activation not in MOE_ACTIVATIONS:
        _fail(op, f"activation must be 'silu', 'gelu_tanh' or 'gpt_oss', got '{activation}'")
    if not math.isfinite(alpha):
        _fail(op, f"alpha must be finite, got {alpha:g}")
    if not limit > 0:
        _fail(op, f"limit must be positive (inf: no clamp), got {limit:g}")
    bad = (indices < 0) | (indices >= experts)
    if not indices.is_cuda and bool(bad.any()):
        t, j = (int(i) for i in bad.nonzero()[0])
        _fail(op, f"indices[{t}, {j}] = {int(indices[t, j])} is not an expert index in [0, {experts})")
