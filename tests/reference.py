"""Plain-PyTorch formulas the fused ops are tested against, written to be read.

Each follows the op's contract as README.md states it ("Using it") step by step, in float32
(float64 for float64 inputs), with the casts where the contract puts them.
"""

import math

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x, weight=None, eps=1e-6, offset=0.0, casting="llama"):
    """y = x / sqrt(mean(x^2) + eps) * (offset + weight).

    llama: the normalized value is cast to x.dtype, then multiplied by the weight.
    gemma: the weight multiply happens in float32; one cast at the end.
    """
    acc = accumulation_dtype(x.dtype)
    xs = x.to(acc)
    mean_square = (xs * xs).sum(dim=-1, keepdim=True) / x.shape[-1]
    normalized = xs / torch.sqrt(mean_square + eps)
    if weight is None:
        return normalized.to(x.dtype)
    scale = offset + weight.to(acc)
    if casting == "llama":
        return (normalized.to(x.dtype).to(acc) * scale).to(x.dtype)
    return (normalized * scale).to(x.dtype)


def fused_add_rms_norm(x, residual, weight=None, eps=1e-6, offset=0.0, casting="llama"):
    """h = x + residual (stored in x.dtype); returns (rms_norm(h), h)."""
    acc = accumulation_dtype(x.dtype)
    h = (x.to(acc) + residual.to(acc)).to(x.dtype)
    return rms_norm(h, weight, eps, offset, casting), h


def silu(x):
    """x * sigmoid(x)."""
    return x / (1 + torch.exp(-x))


def gelu_tanh(x):
    """GELU with the tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def swiglu(gate, up=None, activation="silu"):
    """act(gate) * up in float32 (float64 for float64); up=None: gate is [gate | up]."""
    if up is None:
        gate, up = gate.chunk(2, dim=-1)
    acc = accumulation_dtype(gate.dtype)
    act = silu if activation == "silu" else gelu_tanh
    return (act(gate.to(acc)) * up.to(acc)).to(gate.dtype)


def rope(x, cos, sin, positions, interleaved=False, rotary_dim=None):
    """Rotary embedding as complex multiplication: each rotated pair (x0, x1) is
    the complex number x0 + i x1, multiplied by cos(theta) + i sin(theta).

    x [B, H, S, D]; cos/sin tables [P, R/2]; positions [B, S] (int).
    Pairs are (i, i + R/2) (half-split) or (2i, 2i + 1) (interleaved).
    """
    rotary_dim = rotary_dim or x.shape[-1]
    half = rotary_dim // 2
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xr = x[..., :rotary_dim].to(acc)
    if interleaved:
        pairs = torch.complex(xr[..., 0::2].contiguous(), xr[..., 1::2].contiguous())
    else:
        pairs = torch.complex(xr[..., :half].contiguous(), xr[..., half:].contiguous())
    angle = torch.complex(cos[positions].to(acc), sin[positions].to(acc))[:, None]  # [B, 1, S, R/2]
    turned = pairs * angle
    if interleaved:
        rotated = torch.stack((turned.real, turned.imag), dim=-1).reshape(xr.shape)
    else:
        rotated = torch.cat((turned.real, turned.imag), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


def window_bounds(window):
    """(left, right) key offsets a window allows around a query's position, -1
    where unbounded: an int w keeps the last w keys up to the position and
    bounds nothing on the right, a (left, right) pair is taken as it is."""
    if window is None:
        return -1, -1
    if isinstance(window, tuple):
        return window
    return window - 1, -1


def attention(q, k, v, causal=False, scale=None, window=None, mask=None, keep=None, dropout_p=0.0,
              softcap=None, sinks=None, alibi_slopes=None):
    """Grouped-query attention, the plain way: softmax(q k^T * scale + mask) v.

    q: [B, Hq, Sq, D]; k, v: [B, Hkv, Sk, D]. Query head h uses kv head
    h // (Hq / Hkv), done here by repeating each kv head Hq / Hkv times.
    Masks are aligned bottom-right: query i sits at position p = i + Sk - Sq.
    causal keeps keys j <= p; window w (an int) keeps keys j > p - w, a pair
    (left, right) keeps p - left <= j <= p + right (-1: that side unbounded);
    `mask` is a bool keep-mask or an additive float mask. `keep` (bool,
    [B, Hq, Sq, Sk]) is a dropout pattern: kept probabilities are divided by
    1 - dropout_p, the others zeroed.
    Each score, in order: s = scale * q.k; softcap * tanh(s / softcap) when
    softcap is given; minus alibi_slopes[b, h] * |p - j| (slopes [Hq] or
    [B, Hq]); plus a float mask; -inf where not visible. `sinks` [Hq] adds one
    logit per head to every row's softmax whose probability multiplies no value.
    Returns (out in q.dtype, lse = log of the softmax denominator, the sink
    included, float32 or float64); a query that sees no key gets out = 0 (and
    lse = -inf without sinks).
    """
    acc = accumulation_dtype(q.dtype)
    batch, q_heads = q.shape[0], q.shape[1]
    group = q_heads // k.shape[1]
    keys = k.to(acc).repeat_interleave(group, dim=1)
    values = v.to(acc).repeat_interleave(group, dim=1)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    scores = torch.matmul(q.to(acc), keys.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_len, kv_len = q.shape[2], k.shape[2]
    position = torch.arange(q_len, device=q.device).unsqueeze(1) + (kv_len - q_len)
    key = torch.arange(kv_len, device=q.device).unsqueeze(0)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(acc).expand(batch, q_heads).reshape(batch, q_heads, 1, 1)
        scores = scores - slopes * (position - key).abs().to(acc)
    visible = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device)
    if causal:
        visible = visible & (key <= position)
    left, right = window_bounds(window)
    if left >= 0:
        visible = visible & (key >= position - left)
    if right >= 0:
        visible = visible & (key <= position + right)
    if mask is not None and mask.dtype == torch.bool:
        visible = visible & mask
    elif mask is not None:
        visible = visible & (mask > torch.finfo(mask.dtype).min)  # the dtype's lowest: masked
        scores = scores + mask.to(acc)
    visible = visible.expand(scores.shape)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        lse = torch.logsumexp(scores, dim=-1)
        empty = torch.isneginf(lse).unsqueeze(-1)
        probs = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1)
        probs = torch.where(visible & ~empty, probs, torch.zeros((), dtype=acc, device=q.device))
    else:
        # the sink is one more logit in each row's softmax; its share is dropped
        sink = sinks.to(acc).view(1, q_heads, 1, 1).expand(batch, q_heads, q_len, 1)
        lse = torch.logsumexp(torch.cat((scores, sink), dim=-1), dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1))
    if keep is not None:
        probs = probs * keep / (1.0 - dropout_p)
    out = torch.matmul(probs, values)
    return out.to(q.dtype), lse


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, scale=None, window=None,
                     softcap=None, sinks=None, alibi_slopes=None, keeps=None, dropout_p=0.0):
    """Packed sequences one at a time: q [total_q, Hq, D], k, v [total_k, Hkv, D];
    sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and
    cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k and v, attended with `attention`
    alone (alibi_slopes [Hq] or [num_seqs, Hq]; keeps: one dropout pattern
    [1, Hq, len_q, len_k] per sequence). Returns (out [total_q, Hq, D],
    lse [Hq, total_q])."""
    bounds_q, bounds_k = [int(x) for x in cu_seqlens_q], [int(x) for x in cu_seqlens_k]
    outs, lses = [], []
    for b in range(len(bounds_q) - 1):
        q_b = q[bounds_q[b]:bounds_q[b + 1]].transpose(0, 1).unsqueeze(0)
        k_b = k[bounds_k[b]:bounds_k[b + 1]].transpose(0, 1).unsqueeze(0)
        v_b = v[bounds_k[b]:bounds_k[b + 1]].transpose(0, 1).unsqueeze(0)
        slopes = alibi_slopes
        if alibi_slopes is not None and alibi_slopes.dim() == 2:
            slopes = alibi_slopes[b]
        out, lse = attention(q_b, k_b, v_b, causal=causal, scale=scale, window=window,
                             keep=None if keeps is None else keeps[b], dropout_p=dropout_p,
                             softcap=softcap, sinks=sinks, alibi_slopes=slopes)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    acc = accumulation_dtype(q.dtype)
    if not outs:
        return q.new_zeros(q.shape), q.new_zeros(q.shape[1], 0, dtype=acc)
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def linear_cross_entropy(hidden, weight, target, bias=None, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, softcap=None, z_loss=0.0):
    """The LM head then torch's cross-entropy, whole logits built; softcap and
    z_loss as Gemma 2 and PaLM define them."""
    import torch.nn.functional as F

    logits = F.linear(hidden, weight, bias).reshape(-1, weight.shape[0])
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    target = target.reshape(-1)
    loss = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="none",
                           label_smoothing=label_smoothing)
    keep = target != ignore_index
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(logits, dim=-1).square() * keep
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / keep.sum()
    return loss.reshape(hidden.shape[:-1])


def moe_route(logits, top_k, scoring="softmax", normalize=True, correction_bias=None, num_groups=1,
              top_groups=None, scaling=1.0):
    """Per token: scores, the eligible experts (the best groups by the sum of
    their two best biased scores), the top_k biased scores (lower index first
    among equals), and the chosen scores (renormalized, scaled) as weights."""
    acc = accumulation_dtype(logits.dtype)
    z = logits.to(acc)
    scores = torch.softmax(z, -1) if scoring == "softmax" else torch.sigmoid(z)
    tokens, experts = z.shape
    size = experts // num_groups
    top_groups = num_groups if top_groups is None else top_groups
    weights, indices = [], []
    for t in range(tokens):
        choice = [float(scores[t, e].detach()) + (0.0 if correction_bias is None else float(correction_bias[e]))
                  for e in range(experts)]
        group_score = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:2])
                       for g in range(num_groups)]
        kept = sorted(range(num_groups), key=lambda g: (-group_score[g], g))[:top_groups]
        eligible = [e for e in range(experts) if e // size in kept]
        chosen = sorted(eligible, key=lambda e: (-choice[e], e))[:top_k]
        w = scores[t, chosen]
        if normalize:
            w = w / (w.sum() + (1e-20 if scoring == "sigmoid" else 0.0))
        weights.append(w * scaling)
        indices.append(chosen)
    if tokens == 0:
        return z.new_zeros(0, top_k), torch.zeros(0, top_k, dtype=torch.int64, device=z.device)
    return torch.stack(weights), torch.tensor(indices, dtype=torch.int64, device=z.device)


def gpt_oss_gated(gate, up, alpha=1.702, limit=7.0):
    """gpt-oss's clamped SwiGLU: gate clipped above at limit, up to [-limit, limit],
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def moe_experts(hidden, indices, weights, gate_up_proj, down_proj, activation="silu", gate_up_bias=None,
                down_bias=None, transposed=False, interleaved=False, alpha=1.702, limit=7.0):
    """Token by token, choice by choice: weights[t, j] * (down @ gated(gate_up @ x + b1) + b2)
    of expert e = indices[t, j], in float64. transposed: gate_up_proj [E, H, 2I] and
    down_proj [E, I, H] (x @ W); interleaved: gate = gate_up[0::2], up = gate_up[1::2]
    (else the halves); gated = act(gate) * up, or gpt_oss_gated."""
    h, w = hidden.double(), weights.double()
    gu, dn = gate_up_proj.double(), down_proj.double()
    b1 = None if gate_up_bias is None else gate_up_bias.double()
    b2 = None if down_bias is None else down_bias.double()
    out = []
    for t in range(h.shape[0]):
        row = h.new_zeros(h.shape[1])
        for j in range(indices.shape[1]):
            e = int(indices[t, j])
            gate_up = h[t] @ gu[e] if transposed else gu[e] @ h[t]
            if b1 is not None:
                gate_up = gate_up + b1[e]
            gate, up = (gate_up[0::2], gate_up[1::2]) if interleaved else gate_up.chunk(2)
            if activation == "gpt_oss":
                acted = gpt_oss_gated(gate, up, alpha, limit)
            else:
                acted = (silu if activation == "silu" else gelu_tanh)(gate) * up
            y = acted @ dn[e] if transposed else dn[e] @ acted
            if b2 is not None:
                y = y + b2[e]
            row = row + w[t, j] * y
        out.append(row)
    return torch.stack(out) if out else h.new_zeros(h.shape)


def streaming_attention(q, k, v, window=None, sink=0):
    """Causal attention over a whole sequence where query position p sees keys
    j <= p with j > p - window or j < sink (StreamingLLM's sinks; window None:
    every j <= p), in float64: what decoding through a ring cache must give."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    n = q.shape[2]
    p = torch.arange(n, device=q.device)[:, None]
    j = torch.arange(n, device=q.device)[None, :]
    keep = j <= p
    if window is not None:
        keep &= (j > p - window) | (j < sink)
    scores = ((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5).masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, -1) @ v


KV_LEVELS = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize_kv(x, code=torch.int8):
    """Symmetric rows of the last dim: scale = max|x| / L and values = x * (L / max|x|)
    rounded half to even (0 for an all-zero row): int8 in [-127, 127] (L = 127), or
    float8 e4m3 codes (L = 448, torch's rounding to the nearest code). Both are true
    divisions of two tensors: PyTorch's L / tensor is L * reciprocal, and on CUDA
    tensor / L is tensor * (1 / L), which can round differently. Returns (values,
    float32 scales); for finite x."""
    levels = KV_LEVELS[code]
    xf = x.float()
    amax = xf.abs().amax(-1)
    inverse = torch.where(amax > 0, torch.full_like(amax, levels) / amax, torch.zeros_like(amax))
    y = xf * inverse.unsqueeze(-1)
    if code == torch.int8:
        values = torch.round(y).clamp(-127, 127).to(torch.int8)
    else:
        values = y.clamp(-levels, levels).to(code)
    return values, amax / torch.full_like(amax, levels)


def dequantize_kv(values, scales):
    """The float32 rows int8 values stand for: values * scale, rounded once."""
    return values.float() * scales.unsqueeze(-1)


# The most a stored entry is off, in units of its row's scale: half an int8
# step; for e4m3, 2^-4 of the entry (3 mantissa bits, rounded to nearest) with
# entries up to 448 scales, so 28 (2^-10 below 2^-6 scales, less).
KV_ENTRY_ERROR = {torch.int8: 0.5, torch.float8_e4m3fn: 28.0}


def quantized_attention_error_bound(q, v, k_scale, v_scale, scale=None, code=torch.int8):
    """A bound on each output entry's distance between attention over quantized
    keys and values and attention over the float rows they were made from.
    With e the most an entry is off per unit of its scale (KV_ENTRY_ERROR), a
    key row is off by at most e k_scale per entry, so each score by at most
    eps = scale * max_row sum|q| * e max k_scale; scores that move by at most
    eps move every probability by a factor within exp(+-2 eps), so the
    probability-weighted sum of v moves by at most (exp(2 eps) - 1) * max|v|;
    the values themselves are off by at most e max v_scale."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    e = KV_ENTRY_ERROR[code]
    eps = scale * q.float().abs().sum(-1).max().item() * k_scale.max().item() * e
    return v_scale.max().item() * e + math.expm1(2 * eps) * v.float().abs().max().item()
