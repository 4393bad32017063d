"""The plain-PyTorch implementation of the ops: what runs when the compiled
extension is not loaded (see ``fusedllm.backend()``), and the attention that
also returns its probabilities. Same signatures, checks and results as the
``torch.ops.fusedllm`` operators; autograd comes from PyTorch itself."""

from __future__ import annotations

import math

import torch

from ._autocast import plain as _autocast_rule
from ._limits import (ACTIVATIONS, CASTINGS, FLOAT_DTYPES, MAX_HEAD_DIM, MOE_ACTIVATIONS, MOE_SCORINGS,
                      REDUCTIONS, check_rotary_dim)

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


def _check_rope(op, q, k, cos, sin, position_ids, offset, rotary_dim):
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
    if cos.shape != sin.shape:
        _fail(op, f"cos and sin must have the same shape, got {list(cos.shape)} and {list(sin.shape)}")
    _check_float(op, "cos", cos)
    if cos.device != q.device or sin.device != q.device:
        _fail(op, f"cos and sin must be on {q.device} like q")
    if cos.dim() not in (2, 3):
        _fail(op, f"cos and sin must be [positions, rotary_dim / 2] or [B, S, rotary_dim / 2], got "
                  f"{list(cos.shape)}")
    if cos.shape[-1] != rotary_dim // 2:
        _fail(op, f"cos and sin must have last dim {rotary_dim // 2} (rotary_dim / 2), got {cos.shape[-1]}")
    if cos.dim() == 3:
        if cos.shape[0] not in (1, batch) or cos.shape[1] != seq:
            _fail(op, f"per-token cos/sin must be [{batch} or 1, {seq}, rotary_dim / 2], got {list(cos.shape)}")
        if position_ids is not None or offset:
            _fail(op, "per-token cos/sin [B, S, rotary_dim / 2] are already indexed by position; pass "
                      "position_ids or offset only with a [positions, rotary_dim / 2] table")
        return rotary_dim
    rows = cos.shape[0]
    if position_ids is None:
        if offset + seq > rows:
            _fail(op, f"positions {offset}..{offset + seq - 1} are past the cos/sin table of {rows} positions")
        return rotary_dim
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


def check_attention(op, q, k, v, mask, scale, window, dropout_p, max_head_dim=MAX_HEAD_DIM,
                    window_right=-1, softcap=0.0, sinks=None, alibi_slopes=None, cu_seqlens_q=None,
                    cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0):
    """The attention op's checks; ``max_head_dim=None`` lifts the kernels' head_dim limit.
    Returns (number of sequences, longest query length, longest key length)."""
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
    _check_same(op, "q", q, "k", k)
    _check_same(op, "q", q, "v", v)
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
        if k.shape[0] != batch:
            _fail(op, f"q and k/v must have the same batch size, got {batch} and {k.shape[0]}")
        if max_seqlen_q or max_seqlen_k:
            _fail(op, "max_seqlen_q / max_seqlen_k are for packed sequences (cu_seqlens) only")
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
    if sinks is not None:
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
    if mask is not None:
        if mask.device != q.device:
            _fail(op, f"mask is on {mask.device} but q is on {q.device}")
        if mask.dtype != torch.bool and mask.dtype not in FLOAT_DTYPES:
            _fail(op, f"mask must be a bool keep-mask or a float32, float64, bfloat16 or float16 additive "
                      f"mask, got {mask.dtype}")
        target = [q.shape[0], q_heads, q.shape[2], k.shape[2]]
        if mask.dim() > 4 or any(m not in (1, t) for m, t in zip(reversed(mask.shape), reversed(target))):
            _fail(op, f"mask of shape {list(mask.shape)} does not broadcast to [batch, q_heads, q_len, "
                      f"kv_len] = {target}")
    if not 0.0 <= dropout_p < 1.0:
        _fail(op, f"dropout_p must be in [0, 1), got {dropout_p:g}")
    return batch, sq, sk


# --- the ops --------------------------------------------------------------------------


def _rms_scale(h: torch.Tensor, weight, eps: float, offset: float, casting: str):
    acc = torch.float64 if h.dtype == torch.float64 else torch.float32
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


@_autocast_rule('rms_norm')
def rms_norm(input, weight, eps, offset, casting):
    _check_rms_norm("fusedllm.rms_norm", input, None, weight, eps, offset, casting)
    return _rms_scale(input, weight, eps, offset, casting)


@_autocast_rule('fused_add_rms_norm')
def fused_add_rms_norm(input, residual, weight, eps, offset, casting):
    _check_rms_norm("fusedllm.fused_add_rms_norm", input, residual, weight, eps, offset, casting)
    h = input + residual
    out, rstd = _rms_scale(h, weight, eps, offset, casting)
    return out, h, rstd


def _activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return torch.nn.functional.silu(x)
    return torch.nn.functional.gelu(x, approximate="tanh")


def _gated(gate, up, activation):
    acc = torch.float64 if gate.dtype == torch.float64 else torch.float32
    return (_activation(gate.to(acc), activation) * up.to(acc)).to(gate.dtype)


@_autocast_rule('swiglu')
def swiglu(gate, up, activation):
    op = "fusedllm.swiglu"
    _check_float(op, "gate", gate)
    _check_same(op, "gate", gate, "up", up)
    if gate.shape != up.shape:
        _fail(op, f"gate and up must have the same shape, got {list(gate.shape)} and {list(up.shape)}")
    if gate.dim() < 1:
        _fail(op, "gate must have at least one dimension")
    _check_activation(op, activation)
    return _gated(gate, up, activation)


@_autocast_rule('swiglu_packed')
def swiglu_packed(gate_up, activation):
    op = "fusedllm.swiglu_packed"
    _check_float(op, "gate_up", gate_up)
    if gate_up.dim() < 1:
        _fail(op, "gate_up must have at least one dimension")
    if gate_up.shape[-1] % 2:
        _fail(op, f"gate_up must be packed [..., 2 * F] as [gate | up]; its last dim {gate_up.shape[-1]} is odd")
    _check_activation(op, activation)
    gate, up = gate_up.chunk(2, dim=-1)
    return _gated(gate, up, activation)


def _rotate(x, cos, sin, interleaved, rotary_dim, inverse):
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
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


@_autocast_rule('rope')
def rope(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse):
    rotary_dim = _check_rope("fusedllm.rope", q, k, cos, sin, position_ids, offset, rotary_dim)
    return _rope(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse)


@_autocast_rule('rope_')
def rope_(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse):
    rotary_dim = _check_rope("fusedllm.rope_", q, k, cos, sin, position_ids, offset, rotary_dim)
    rq, rk = _rope(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse)
    q.copy_(rq)
    k.copy_(rk)

# Philox-4x32-10, the counter-based generator of fusedllm/dropout.h, on int64
# tensors holding 32-bit words (products split in 16-bit halves: no overflow).
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_U32 = 0xFFFFFFFF


def _mulhilo(a: int, b: torch.Tensor):
    low, high = a * (b & 0xFFFF), a * (b >> 16)
    return (high + (low >> 16)) >> 16, ((high << 16) + low) & _U32


def philox_words(seed: int, counter: torch.Tensor) -> torch.Tensor:
    """The four 32-bit outputs (last dim) of Philox-4x32-10 for 64-bit counters
    (int64 tensor, high words zero) under a 64-bit key."""
    k0, k1 = seed & _U32, (seed >> 32) & _U32
    c0, c1 = counter & _U32, (counter >> 32) & _U32
    c2, c3 = torch.zeros_like(c0), torch.zeros_like(c0)
    for r in range(10):
        hi0, lo0 = _mulhilo(_PHILOX_M[0], c0)
        hi1, lo1 = _mulhilo(_PHILOX_M[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX_W[0]) & _U32, (k1 + _PHILOX_W[1]) & _U32
    return torch.stack((c0, c1, c2, c3), dim=-1)


def dropout_keep(seed: int, shape, dropout_p: float, device=None, counter=None) -> torch.Tensor:
    """Boolean [B, Hq, Sq, Sk] mask of the attention probabilities the kernels
    keep: element n (row-major index, or ``counter``'s entry) draws word n % 4
    of Philox(n // 4)."""
    n = torch.arange(math.prod(shape), dtype=torch.int64, device=device) if counter is None \
        else counter.reshape(-1)
    words = philox_words(seed, n >> 2).gather(-1, (n & 3).unsqueeze(-1)).squeeze(-1)
    return ((words >> 8) >= dropout_threshold(dropout_p)).reshape(shape)


def dropout_threshold(dropout_p: float) -> int:
    """A 24-bit draw is kept when it is >= this (so P(drop) = dropout_p to 2^-24)."""
    return math.ceil(dropout_p * (1 << 24))


def attention_with_probs(q, k, v, mask, scale, causal, window, dropout_p, seed, window_right=-1,
                         softcap=0.0, sinks=None, alibi_slopes=None, dropout_counter=None):
    """softmax(q k^T * scale + mask) v with K/V repeated per query group, in
    float32 (float64 for float64 inputs), dropout as the kernels draw it;
    returns (out, lse, probabilities after dropout). Builds the whole [Sq, Sk]
    score matrix: a reference, not a fast path. Scores are soft-capped, then
    get the ALiBi bias and the masks; sinks join each row's denominator."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
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


KV_CODES = (torch.int8, torch.float8_e4m3fn)  # what a quantized cache stores


def _dequantized_kv(op, q, k, v, k_scale, v_scale, packed):
    """int8 / float8 k and v with their scales (the op's checks), as float32 k * k_scale, v * v_scale."""
    k8, v8 = k.dtype in KV_CODES, v.dtype in KV_CODES
    if not (k8 or v8):
        _fail(op, f"k_scale / v_scale are the scales of int8 (or float8_e4m3fn) k and v, but k and v are "
                  f"{k.dtype}")
    if not (k8 and v8 and k.dtype == v.dtype):
        _fail(op, f"k and v are int8 (or float8_e4m3fn) together or not at all, got k {k.dtype} and v {v.dtype}")
    if k_scale is None or v_scale is None:
        _fail(op, f"{k.dtype} k and v need k_scale and v_scale (float32, one scale per position and kv head)")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        _fail(op, f"with {k.dtype} k and v, q must be float32, bfloat16 or float16, got {q.dtype}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k_scale, v_scale)):
        _fail(op, "quantized k and v (k_scale / v_scale) read a KV cache for inference and have no backward; "
                  "run under torch.no_grad() or torch.inference_mode(), or detach q, k and v")
    for name, t in (("k", k), ("v", v), ("k_scale", k_scale), ("v_scale", v_scale)):
        if t.device != q.device:
            _fail(op, f"{name} is on {t.device} but q is on {q.device}")
    want = [k.shape[0], k.shape[1]] if packed else [k.shape[0], k.shape[1], k.shape[2]]
    if k.dim() != (3 if packed else 4):
        return k.float(), v.float()  # the shape checks that follow name the problem
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t.dtype != torch.float32:
            _fail(op, f"{name} must be float32, got {t.dtype}")
        if list(t.shape) != want:
            layout = "[total_k, kv_heads]" if packed else "[batch, kv_heads, kv_len]"
            _fail(op, f"{name} must be {layout} = {want}, got shape {list(t.shape)}")
    return k.float() * k_scale.unsqueeze(-1), v.float() * v_scale.unsqueeze(-1)


def _check_kv_lens(op, q, k, kv_lens, block_table, mask, dropout_p, cu_seqlens_q):
    """The op's checks of kv_lens / block_table; returns the lengths as a list."""
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
    batch = q.shape[0]
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
    return lens


def _cache_rows(t, b, n, block_table):
    """The first n rows of sequence b of a dense or paged k / v / scale, as [1, heads, n, ...]."""
    if block_table is None:
        return t[b:b + 1, :, :n]
    page_size = t.shape[2]
    pages = block_table[b, :-(-n // page_size)].long()
    rows = t[pages].transpose(0, 1).flatten(1, 2)  # [heads, pages * page_size, ...]
    return rows[:, :n].unsqueeze(0)


@_autocast_rule('attention')
def attention(q, k, v, mask, scale, causal, window, dropout_p, seed, window_right=-1, softcap=0.0,
              sinks=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
              max_seqlen_k=0, k_scale=None, v_scale=None, kv_lens=None, block_table=None):
    """The attention op: (out, lse). Packed sequences run one by one. int8 k and
    v run dequantized to float32, with q in float32 and the output cast back.
    Caches of several lengths (kv_lens, block_table) run one sequence at a time
    over its gathered rows."""
    if kv_lens is not None or block_table is not None:
        op = "fusedllm.attention"
        lens = _check_kv_lens(op, q, k, kv_lens, block_table, mask, dropout_p, cu_seqlens_q)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks)):
            kind = "quantized k and v (k_scale / v_scale)" if k_scale is not None else "kv_lens / block_table"
            _fail(op, f"{kind} read a KV cache for inference and have no backward; run under "
                      f"torch.no_grad() or torch.inference_mode(), or detach q, k and v")
        if block_table is None and k.shape[0] != q.shape[0]:
            _fail(op, f"q and k/v must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
        if k_scale is not None and v_scale is not None and k.dim() == 4:
            for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
                if t.dtype == torch.float32 and list(t.shape) != list(k.shape[:3]):
                    layout = ("[num_pages, kv_heads, page_size]" if block_table is not None
                              else "[batch, kv_heads, kv_len]")
                    _fail(op, f"{name} must be {layout} = {list(k.shape[:3])}, got shape {list(t.shape)}")
        outs, lses = [], []
        for b, n in enumerate(lens):
            rows = [None if t is None else _cache_rows(t, b, n, block_table) for t in (k, v, k_scale, v_scale)]
            slopes = None if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b:b + 1]
            if n == 0:  # no keys: zeros, and the sink's logit (or -inf) as lse
                ob = q.new_zeros(q[b:b + 1].shape)
                lb = q.new_full(q.shape[1:-1], float("-inf"), dtype=lse_dtype(q)).unsqueeze(0)
                if sinks is not None:
                    lb = lb.logaddexp(sinks.to(lb.dtype).view(1, -1, 1))
            else:
                ob, lb = attention(q[b:b + 1], rows[0], rows[1], None, scale, causal, window, 0.0, None,
                                   window_right, softcap, sinks, alibi_slopes if slopes is None else slopes,
                                   k_scale=rows[2], v_scale=rows[3])
            outs.append(ob)
            lses.append(lb)
        if not lens:
            return q.new_zeros(q.shape), q.new_empty(q.shape[:-1], dtype=lse_dtype(q))
        return torch.cat(outs), torch.cat(lses)
    if k_scale is not None or v_scale is not None or k.dtype in KV_CODES or v.dtype in KV_CODES:
        op = "fusedllm.attention"
        _check_float(op, "q", q)
        k, v = _dequantized_kv(op, q, k, v, k_scale, v_scale, cu_seqlens_q is not None)
        out, lse = attention(q.float(), k, v, mask, scale, causal, window, dropout_p, seed, window_right,
                             softcap, sinks, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                             max_seqlen_k)
        return out.to(q.dtype), lse
    _, _, max_k = check_attention("fusedllm.attention", q, k, v, mask, scale, window, dropout_p,
                                  window_right=window_right, softcap=softcap, sinks=sinks,
                                  alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                                  cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                  max_seqlen_k=max_seqlen_k)
    opts = dict(window_right=window_right, softcap=softcap, sinks=sinks)
    if cu_seqlens_q is None:
        out, lse, _ = attention_with_probs(q, k, v, mask, scale, causal, window, dropout_p, seed,
                                           alibi_slopes=alibi_slopes, **opts)
        return out, lse
    total_q, heads = q.shape[0], q.shape[1]
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(cq) == 1:  # no sequence at all
        return _zeros_of(q, k, v), q.new_empty((heads, 0), dtype=lse_dtype(q))
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
            lb = qb.new_full((1, heads, qb.shape[2]), float("-inf"), dtype=lse_dtype(q))
            if sinks is not None:
                lb = lb.logaddexp(sinks.to(lb.dtype).view(1, -1, 1)).detach()
        else:
            ob, lb, _ = attention_with_probs(qb, kb, vb, None, scale, causal, window, dropout_p, seed,
                                             alibi_slopes=slopes, dropout_counter=counter, **opts)
        outs.append(ob[0].transpose(0, 1))
        lses.append(lb[0])
    return torch.cat(outs, 0), torch.cat(lses, 1)


@_autocast_rule('quantize_kv')
def quantize_kv(x, values, scales):
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


def _zeros_of(q, k, v):
    """Zeros of q's shape that autograd sees as a function of q, k and v (zero
    gradients), as the op's outputs are, even where no key exists."""
    never = torch.zeros((), dtype=torch.bool, device=q.device)
    return torch.where(never, q, 0.0) + torch.where(never, k.sum() + v.sum(), 0.0).to(q.dtype)


def lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def check_cross_entropy(op, hidden, weight, bias, target, ignore_index, reduction, label_smoothing,
                        softcap, z_loss):
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
    if reduction not in REDUCTIONS:
        _fail(op, f"reduction must be 'mean', 'sum' or 'none', got '{reduction}'")
    vocab = weight.shape[0]
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if not target.is_cuda and bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        _fail(op, f"target[{first}] = {int(target[first])} is not a class index in [0, {vocab}) "
                  f"nor ignore_index ({ignore_index})")


@_autocast_rule('linear_cross_entropy')
def linear_cross_entropy(hidden, weight, bias, target, ignore_index, reduction, label_smoothing,
                         softcap, z_loss):
    """The linear cross-entropy op, through the whole [tokens, vocab] logits
    (in float32, float64 for float64 inputs): a reference, not a fast path."""
    check_cross_entropy("fusedllm.linear_cross_entropy", hidden, weight, bias, target, ignore_index,
                        reduction, label_smoothing, softcap, z_loss)
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    z = torch.nn.functional.linear(hidden.to(acc), weight.to(acc), None if bias is None else bias.to(acc))
    if softcap > 0:
        z = softcap * torch.tanh(z / softcap)
    lse = torch.logsumexp(z, dim=-1)
    keep = target != ignore_index
    s_t = z.gather(-1, torch.where(keep, target, 0).unsqueeze(-1)).squeeze(-1)
    loss = (lse - (1 - label_smoothing) * s_t - label_smoothing / z.shape[-1] * z.sum(-1)
            + z_loss * lse * lse)
    loss = torch.where(keep, loss, torch.zeros_like(loss))
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        loss = loss.sum() / keep.sum()
    return loss


def _accumulation(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


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


@_autocast_rule('moe_route')
def moe_route(router_logits, top_k, scoring, normalize, correction_bias, num_groups, top_groups,
              scaling):
    """Top-k experts per token and their weights (float32, float64 for float64
    logits); ties go to the lower expert index."""
    check_moe_route("fusedllm.moe_route", router_logits, top_k, scoring, normalize, correction_bias,
                    num_groups, top_groups, scaling)
    acc = _accumulation(router_logits)
    z = router_logits.to(acc)
    scores = z.softmax(-1) if scoring == "softmax" else z.sigmoid()
    # A NaN is chosen only when no number is left, as the kernels choose.
    choice = scores.detach().nan_to_num(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    if correction_bias is not None:
        choice = choice + correction_bias.to(acc)
    tokens, experts = z.shape
    if num_groups > 1:
        grouped = choice.view(tokens, num_groups, experts // num_groups)
        best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        kept = _stable_topk(best, top_groups)
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~keep.repeat_interleave(experts // num_groups, dim=1), -math.inf)
    indices = _stable_topk(choice, top_k)
    weights = scores.gather(1, indices)
    if normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if scoring == "sigmoid" else 0.0))
    return weights * scaling, indices


def _stable_topk(x, k):
    """Indices of the k largest of each row, larger first, the lower index first among equals."""
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices
    return order[:, :k].contiguous()


def check_moe_experts(op, hidden, indices, weights, gate_up_proj, down_proj, activation,
                      gate_up_bias=None, down_bias=None, transposed=False, alpha=1.702, limit=7.0):
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
    if weights.dtype not in (hidden.dtype, _accumulation(hidden)):
        widened = "" if _accumulation(hidden) == hidden.dtype else f" or {_accumulation(hidden)}"
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


def _expert_gated(gate_up, activation, interleaved, alpha, limit):
    """The experts' gated activation of gate/up rows, in float32 (float64)."""
    acc = _accumulation(gate_up)
    x = gate_up.to(acc)
    gate, up = (x[:, 0::2], x[:, 1::2]) if interleaved else x.chunk(2, dim=-1)
    if activation == "gpt_oss":
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
        out = (up + 1) * gate * torch.sigmoid(gate * alpha)
    else:
        out = _activation(gate, activation) * up
    return out.to(gate_up.dtype)


@_autocast_rule('moe_experts')
def moe_experts(hidden, indices, weights, gate_up_proj, down_proj, activation, save_for_backward,
                gate_up_bias=None, down_bias=None, transposed=False, interleaved=False, alpha=1.702,
                limit=7.0):
    """The experts op, one expert at a time: a reference, not a fast path.
    Returns (out, order, position, offsets, gate_up, expert_out) as the op does."""
    check_moe_experts("fusedllm.moe_experts", hidden, indices, weights, gate_up_proj, down_proj,
                      activation, gate_up_bias, down_bias, transposed, alpha, limit)
    tokens, top_k = indices.shape
    experts = gate_up_proj.shape[0]
    flat = indices.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.bincount(flat, minlength=experts)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    rows = hidden[order // top_k]

    def product(x, w, bias, e):
        y = x @ (w[e] if transposed else w[e].T)
        return y if bias is None else y + bias[e]

    bounds = offsets.tolist()
    gate_up = torch.cat([product(rows[bounds[e]:bounds[e + 1]], gate_up_proj, gate_up_bias, e)
                         for e in range(experts)])
    acted = _expert_gated(gate_up, activation, interleaved, alpha, limit)
    expert_out = torch.cat([product(acted[bounds[e]:bounds[e + 1]], down_proj, down_bias, e)
                            for e in range(experts)])
    acc = _accumulation(hidden)
    picked = expert_out[position].view(tokens, top_k, hidden.shape[1]).to(acc)
    out = (picked * weights.to(acc).unsqueeze(-1)).sum(1).to(hidden.dtype)
    if not save_for_backward:
        gate_up, expert_out = gate_up[:0], expert_out[:0]
    return out, order, position, offsets, gate_up, expert_out
