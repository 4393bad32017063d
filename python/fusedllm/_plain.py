"""The plain-PyTorch implementation of the ops: what runs when the compiled
extension is not loaded (see ``fusedllm.backend()``), and the attention that
also returns its probabilities. Same signatures, checks and results as the
``torch.ops.fusedllm`` operators; autograd comes from PyTorch itself.
Their argument checks are in :mod:`fusedllm._checks`, the dropout's
generator in :mod:`fusedllm._philox`."""

from __future__ import annotations

import math

import torch

from ._autocast import plain as _autocast_rule
from ._checks import (_check_activation, _check_float, _check_rms_norm, _check_rope, _check_same,
                      _fail, check_attention_call, check_cross_entropy, check_moe_experts, check_moe_route)
from ._limits import GPT_OSS_ALPHA, GPT_OSS_LIMIT, KV_CODES, accumulation_dtype
from ._philox import dropout_keep

# --- the ops --------------------------------------------------------------------------


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
    acc = accumulation_dtype(gate)
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


@_autocast_rule('rope')
def rope(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse):
    rotary_dim = _check_rope("fusedllm.rope", q, k, cos, sin, position_ids, offset, rotary_dim)
    return _rope(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse)


@_autocast_rule('rope_')
def rope_(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse):
    rotary_dim = _check_rope("fusedllm.rope_", q, k, cos, sin, position_ids, offset, rotary_dim, in_place=True)
    rq, rk = _rope(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse)
    q.copy_(rq)
    k.copy_(rk)


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


@_autocast_rule('attention')
def attention(q, k, v, mask, scale, causal, window, dropout_p, seed, window_right=-1, softcap=0.0,
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


@_autocast_rule('linear_cross_entropy')
def linear_cross_entropy(hidden, weight, bias, target, ignore_index, reduction, label_smoothing,
                         softcap, z_loss):
    """The linear cross-entropy op, through the whole [tokens, vocab] logits
    (in float32, float64 for float64 inputs): a reference, not a fast path."""
    check_cross_entropy("fusedllm.linear_cross_entropy", hidden, weight, bias, target, ignore_index,
                        reduction, label_smoothing, softcap, z_loss)
    acc = accumulation_dtype(hidden)
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


@_autocast_rule('moe_route')
def moe_route(router_logits, top_k, scoring, normalize, correction_bias, num_groups, top_groups,
              scaling):
    """Top-k experts per token and their weights (float32, float64 for float64
    logits); ties go to the lower expert index."""
    check_moe_route("fusedllm.moe_route", router_logits, top_k, scoring, normalize, correction_bias,
                    num_groups, top_groups, scaling)
    acc = accumulation_dtype(router_logits)
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


def _expert_gated(gate_up, activation, interleaved, alpha, limit):
    """The experts' gated activation of gate/up rows, in float32 (float64)."""
    acc = accumulation_dtype(gate_up)
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
                gate_up_bias=None, down_bias=None, transposed=False, interleaved=False, alpha=GPT_OSS_ALPHA,
                limit=GPT_OSS_LIMIT):
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
    acc = accumulation_dtype(hidden)
    picked = expert_out[position].view(tokens, top_k, hidden.shape[1]).to(acc)
    out = (picked * weights.to(acc).unsqueeze(-1)).sum(1).to(hidden.dtype)
    if not save_for_backward:
        gate_up, expert_out = gate_up[:0], expert_out[:0]
    return out, order, position, offsets, gate_up, expert_out
