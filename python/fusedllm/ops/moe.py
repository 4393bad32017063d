"""Mixture of experts: ``moe_route``, ``moe_experts`` and ``moe_load_balancing_loss``.

Here: the functions, each operator's plain-PyTorch twin with its checks, the
autocast rules, the fake kernels and the DTensor rules."""

from __future__ import annotations

import math

import torch

from .. import _autocast, _fake, _plain, _sharding
from .._checks import _check_float, _check_same, _fail, _require_tensors, _number, _int
from .._devices import ops_for
from .._limits import GPT_OSS_ALPHA, GPT_OSS_LIMIT, MOE_ACTIVATIONS, MOE_SCORINGS, accumulation_dtype
from .._sharding import _on, partial, replicate, shard
from .swiglu import _activation

__all__ = ["moe_route", "moe_experts", "moe_load_balancing_loss"]

_OPERANDS = (_autocast.LOWER, ("hidden", "gate_up_proj", "down_proj", "gate_up_bias", "down_bias"))
_autocast.rule("moe_experts", cpu=_OPERANDS, cuda=_OPERANDS)


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


# --- the plain path: twins of the compiled operator's checks and results ---------------------------


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


@_plain.op("moe_route")
def _plain_moe_route(router_logits, top_k, scoring, normalize, correction_bias, num_groups, top_groups,
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


@_plain.op("moe_experts")
def _plain_moe_experts(hidden, indices, weights, gate_up_proj, down_proj, activation, save_for_backward,
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


# --- fake kernels ----------------------------------------------------------------------------------


@_fake.fake("moe_route")
def _moe_route_fake(router_logits, top_k, scoring, normalize, correction_bias, num_groups,
                    top_groups, scaling):
    shape = (router_logits.shape[0], top_k)
    return (router_logits.new_empty(shape, dtype=accumulation_dtype(router_logits)),
            router_logits.new_empty(shape, dtype=torch.int64))


@_fake.fake("moe_route_backward")
def _moe_route_backward_fake(grad_weights, router_logits, indices, scoring, normalize, scaling):
    return router_logits.new_empty(router_logits.shape)


@_fake.fake("moe_experts")
def _moe_experts_fake(hidden, indices, weights, gate_up_proj, down_proj, activation,
                      save_for_backward, gate_up_bias=None, down_bias=None, transposed=False,
                      interleaved=False, alpha=GPT_OSS_ALPHA, limit=GPT_OSS_LIMIT):
    pairs = indices.shape[0] * indices.shape[1]
    two_inter = gate_up_proj.shape[2] if transposed else gate_up_proj.shape[1]
    return (
        hidden.new_empty(hidden.shape),
        indices.new_empty((pairs,)),
        indices.new_empty((pairs,)),
        indices.new_empty((gate_up_proj.shape[0] + 1,)),
        hidden.new_empty((pairs if save_for_backward else 0, two_inter)),
        hidden.new_empty((pairs if save_for_backward else 0, hidden.shape[1])),
    )


@_fake.fake("moe_experts_backward")
def _moe_experts_backward_fake(grad_out, hidden, indices, weights, gate_up_proj, down_proj, order,
                               position, offsets, gate_up, expert_out, activation, output_mask,
                               gate_up_bias=None, down_bias=None, transposed=False,
                               interleaved=False, alpha=GPT_OSS_ALPHA, limit=GPT_OSS_LIMIT,
                               bias_mask=(False, False)):
    biases = (gate_up_bias, down_bias)
    shapes = (hidden.shape, weights.shape, gate_up_proj.shape, down_proj.shape,
              *(b.shape if b is not None else (0,) for b in biases))
    dtypes = (hidden.dtype, weights.dtype, hidden.dtype, hidden.dtype, hidden.dtype, hidden.dtype)
    wanted = (*output_mask, *(want and b is not None for want, b in zip(bias_mask, biases)))
    return tuple(hidden.new_empty(shape if want else (0,), dtype=dtype)
                 for shape, dtype, want in zip(shapes, dtypes, wanted))


# --- on DTensors -----------------------------------------------------------------------------------


@_sharding.rule("moe_route")
def _shard_moe_route(router_logits, top_k, scoring, normalize, correction_bias, num_groups, top_groups,
                     scaling):
    rules = []
    for p in (replicate(), shard(0)):
        rules.append(([p, p], [p, None, None, None, _on(correction_bias, replicate()), None, None, None]))
    return rules


@_sharding.rule("moe_route_backward")
def _shard_moe_route_backward(grad_weights, router_logits, indices, scoring, normalize, scaling):
    return [([p], [p, p, p, None, None, None]) for p in (replicate(), shard(0))]


@_sharding.rule("moe_experts")
def _shard_moe_experts(hidden, indices, weights, gate_up_proj, down_proj, activation, save_for_backward,
                       gate_up_bias=None, down_bias=None, transposed=False, interleaved=False, alpha=GPT_OSS_ALPHA,
                       limit=GPT_OSS_LIMIT):
    # Sharded over tokens with every expert on every rank. What is saved for
    # backward (the pairs in expert order, each expert's row offsets) is each
    # rank's own: the offsets of all ranks add up to those of the whole batch.
    rules = []
    for p, offsets in ((replicate(), replicate()), (shard(0), partial())):
        rules.append(([p, p, p, offsets, p, p],
                      [p, p, p, replicate(), replicate(), None, None, _on(gate_up_bias, replicate()),
                       _on(down_bias, replicate())] + [None] * 4))
    return rules


@_sharding.rule("moe_experts_backward")
def _shard_moe_experts_backward(grad_out, hidden, indices, weights, gate_up_proj, down_proj, order, position,
                                offsets, gate_up, expert_out, activation, output_mask, gate_up_bias=None,
                                down_bias=None, transposed=False, interleaved=False, alpha=GPT_OSS_ALPHA,
                                limit=GPT_OSS_LIMIT, bias_mask=(False, False)):
    rules = []
    for p, summed in ((replicate(), replicate()), (shard(0), partial())):
        rules.append(([p, p, summed, summed, summed, summed],
                      [p, p, p, p, replicate(), replicate(), p, p, summed, p, p, None, None,
                       _on(gate_up_bias, replicate()), _on(down_bias, replicate())] + [None] * 5))
    return rules
