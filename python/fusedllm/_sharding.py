"""How fusedllm's ops run on DTensors (``torch.distributed.tensor``): for each
op, the placements of its inputs under which every rank computes on its own
shard, and the placements of its outputs then. DTensor redistributes an
input placed otherwise to the cheapest of these (an all-gather, say) before
the op runs; what no redistribution can make right is refused with an error
that names the placement. docs/distributed.md has the table.

Registered with DTensor when fusedllm is imported after
``torch.distributed.tensor``, or else by the first op called on a DTensor
(importing DTensor costs a second, which plain users should not pay).
Placements are written for one mesh dimension; DTensor expands them to every
dimension of the mesh.
"""

from __future__ import annotations

import sys

import torch

from ._extension import has_extension
from ._limits import GPT_OSS_ALPHA, GPT_OSS_LIMIT

_registered = False

# Filled by register(): DTensor's placement and spec types.
Replicate = Shard = Partial = DTensorSpec = None


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor, without importing DTensor (which costs a second)."""
    return type(t).__name__ == "DTensor"


def needs_registering(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor and the rules are not yet registered."""
    return not _registered and is_dtensor(t)


def register() -> None:
    global _registered, Replicate, Shard, Partial, DTensorSpec
    if _registered or not torch.distributed.is_available() or not has_extension():
        return  # without the extension the plain path runs, on DTensor's own rules
    from torch.distributed.tensor import Partial, Replicate, Shard  # noqa: F811
    from torch.distributed.tensor._dtensor_spec import DTensorSpec  # noqa: F811
    from torch.distributed.tensor.experimental import register_sharding

    ops = torch.ops.fusedllm
    for names, rule in _RULES:
        register_sharding([getattr(ops, name).default for name in names])(rule)
    _registered = True


def register_if_imported() -> None:
    if "torch.distributed.tensor" in sys.modules:
        register()


# --- helpers ---------------------------------------------------------------------------------


def _on(spec, placement):
    """``placement`` for a DTensor argument, None for anything else (None, a number)."""
    return placement if isinstance(spec, DTensorSpec) else None


def _rows(spec, keep_last: int = 1) -> range:
    """The dims of ``spec`` one may shard without splitting what the op reduces
    over or pairs up (its last ``keep_last`` dims)."""
    return range(max(0, len(spec.shape) - keep_last))


def _placement_on(spec, dim: int, size: int):
    """Shard(dim) where ``spec`` holds ``size`` entries along ``dim``; Replicate
    where that dim is broadcast (size 1) or absent (dim < 0)."""
    if dim < 0 or spec.shape[dim] == 1 and size != 1:
        return Replicate()
    return Shard(dim)


def _mesh_size(spec) -> int:
    return spec.mesh.size()


def _refuse(op: str, what: str) -> None:
    # DTensor reports it as a RuntimeError that quotes this message first
    raise ValueError(f"fusedllm.{op} on DTensors: {what}")


def _pinned(op: str, names: tuple[str, ...], specs: tuple, strategies: list) -> list:
    """Of ``strategies``, those that leave the tensors an in-place op writes
    (``specs``, at input positions named by ``names``) where they are: DTensor
    would otherwise write a redistributed copy and leave the caller's tensor as
    it was. Refused when none does."""
    current = [s.placements for s in specs]
    offered = {tuple(strategy[i] for i in positions) for strategy, positions in strategies}
    for mesh_dim in range(len(current[0])):
        if tuple(c[mesh_dim] for c in current) not in offered:
            placed = ", ".join(f"{n} {c}" for n, c in zip(names, current))
            _refuse(op, f"writes its arguments in place, and cannot on these placements ({placed}); "
                        f"each must be replicated or sharded alike over a dim the op does not "
                        f"reduce over")
    return [strategy for strategy, positions in strategies
            if any(tuple(strategy[i] for i in positions) == tuple(c[d] for c in current)
                   for d in range(len(current[0])))]


# --- RMSNorm ---------------------------------------------------------------------------------


def _rms_norm(input, weight, eps, offset, casting):
    # out, rstd | input, weight
    rules = [([Replicate(), Replicate()], [Replicate(), _on(weight, Replicate())])]
    rules += [([Shard(d), Shard(d)], [Shard(d), _on(weight, Replicate())]) for d in _rows(input)]
    return rules


def _fused_add_rms_norm(input, residual, weight, eps, offset, casting):
    rules = [([Replicate()] * 3, [Replicate(), Replicate(), _on(weight, Replicate())])]
    rules += [([Shard(d)] * 3, [Shard(d), Shard(d), _on(weight, Replicate())]) for d in _rows(input)]
    return rules


def _rms_norm_backward(grad_out, input, rstd, weight, offset, casting, grad_residual,
                       compute_weight_grad):
    # grad_input, grad_weight | grad_out, input, rstd, weight, grad_residual.
    # A shard's rows give part of the weight's gradient: a sum over ranks (Partial).
    rules = [([Replicate(), Replicate()],
              [Replicate(), Replicate(), Replicate(), _on(weight, Replicate()), None, None,
               _on(grad_residual, Replicate())])]
    grad_weight = Partial() if weight is not None else Replicate()  # else an empty tensor
    rules += [([Shard(d), grad_weight],
               [Shard(d), Shard(d), Shard(d), _on(weight, Replicate()), None, None,
                _on(grad_residual, Shard(d))]) for d in _rows(input)]
    return rules


# --- SwiGLU ----------------------------------------------------------------------------------


def _swiglu(gate, up, activation):
    rules = [([Replicate()], [Replicate(), Replicate()])]
    return rules + [([Shard(d)], [Shard(d), Shard(d)]) for d in _rows(gate, 0)]


def _swiglu_backward(grad_out, gate, up, activation):
    rules = [([Replicate()] * 2, [Replicate()] * 3)]
    return rules + [([Shard(d)] * 2, [Shard(d)] * 3) for d in _rows(gate, 0)]


def _swiglu_packed(gate_up, activation):
    # [gate | up] along the last dim: a shard of it is not a gate and its up.
    rules = [([Replicate()], [Replicate()])]
    return rules + [([Shard(d)], [Shard(d)]) for d in _rows(gate_up)]


def _swiglu_packed_backward(grad_out, gate_up, activation):
    rules = [([Replicate()], [Replicate(), Replicate()])]
    return rules + [([Shard(d)], [Shard(d), Shard(d)]) for d in _rows(gate_up)]


# --- RoPE ------------------------------------------------------------------------------------


def _rope_inputs(q, cos, position_ids, dim):
    """Placements of (q, k, cos, sin, position_ids) sharding q and k along
    ``dim`` of [B, H, S, D], or None where a shard cannot find its positions."""
    batch = q.shape[0]
    per_token = len(cos.shape) == 3  # [B or 1, S, rotary_dim / 2], already indexed by position
    if dim == 1:  # heads: every head rotates alike
        tables, pos = Replicate(), Replicate()
    elif dim == 0:
        tables = _placement_on(cos, 0, batch) if per_token else Replicate()
        pos = None if position_ids is None else _placement_on(position_ids, len(position_ids.shape) - 2, batch)
    elif dim == 2:  # a shard of the sequence must know its positions
        if per_token:
            tables, pos = Shard(1), None
        elif position_ids is not None:
            tables, pos = Replicate(), Shard(len(position_ids.shape) - 1)
        else:
            return None
    else:
        return None
    return [Shard(dim), Shard(dim), tables, tables, _on(position_ids, pos)]


def _rope_rules(q, k, cos, sin, position_ids):
    """(outputs' placement, inputs' placements) pairs; inputs q, k, cos, sin, position_ids."""
    rules = [(Replicate(), [Replicate()] * 4 + [_on(position_ids, Replicate())])]
    for dim in (0, 1, 2):
        inputs = _rope_inputs(q, cos, position_ids, dim)
        if inputs is not None:
            rules.append((Shard(dim), inputs))
    return rules


def _rope(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse):
    return [([out, out], inputs + [None] * 4) for out, inputs in _rope_rules(q, k, cos, sin, position_ids)]


def _rope_inplace(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse):
    rules = [(inputs + [None] * 4, (0, 1)) for _, inputs in _rope_rules(q, k, cos, sin, position_ids)]
    return [([], inputs) for inputs in _pinned("rope_", ("q", "k"), (q, k), rules)]


# --- attention -------------------------------------------------------------------------------


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
        kv = Replicate() if paged else Shard(0)  # pages are found through each sequence's table
        alibi = None
        if alibi_slopes is not None:
            alibi = _placement_on(alibi_slopes, 0, batch) if len(alibi_slopes.shape) == 2 else Replicate()
        return dict(q=Shard(0), kv=kv, out=Shard(0), lse=Shard(0), mask=m, sinks=Replicate(),
                    alibi=alibi, seq=Shard(0), scales=kv)
    # heads: the query heads of a group must land with their key/value head,
    # which uneven shards (torch.chunk's) would break
    hq, hkv = q.shape[heads_dim], k.shape[heads_dim]
    if hq != hkv and hkv % _mesh_size(q):
        return None
    m = None if mask is None else _placement_on(mask, len(mask.shape) - 3, hq)
    alibi = None if alibi_slopes is None else Shard(len(alibi_slopes.shape) - 1)
    return dict(q=Shard(1), kv=Shard(1), out=Shard(1), lse=Shard(0) if packed else Shard(1), mask=m,
                sinks=Shard(0), alibi=alibi, seq=Replicate(), scales=Shard(1))


def _attention_rules(op, q, k, mask, dropout_p, sinks, alibi_slopes, cu_seqlens_q, k_scale, kv_lens,
                     block_table):
    if dropout_p > 0:
        _refuse(op, f"dropout_p={dropout_p} would drop the same pattern on every rank's shard (the "
                    f"seed is not split by shard); use dropout_p=0, or call it on local tensors")
    splits = [dict(q=Replicate(), kv=Replicate(), out=Replicate(), lse=Replicate(), mask=Replicate(),
                   sinks=Replicate(), alibi=Replicate(), seq=Replicate(), scales=Replicate())]
    for dim in (0, 1):
        p = _attention_placements(q, k, mask, sinks, alibi_slopes, cu_seqlens_q, k_scale, kv_lens,
                                  block_table, dim)
        if p is not None:
            splits.append(p)
    return splits


def _attention(q, k, v, mask, scale, causal, window, dropout_p, seed, window_right=-1, softcap=0.0,
               sinks=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
               max_seqlen_k=0, k_scale=None, v_scale=None, kv_lens=None, block_table=None):
    rules = []
    for p in _attention_rules("attention", q, k, mask, dropout_p, sinks, alibi_slopes, cu_seqlens_q,
                              k_scale, kv_lens, block_table):
        rules.append(([p["out"], p["lse"]],
                      [p["q"], p["kv"], p["kv"], _on(mask, p["mask"]), None, None, None, None,
                       _on(seed, Replicate()), None, None, _on(sinks, p["sinks"]),
                       _on(alibi_slopes, p["alibi"]), _on(cu_seqlens_q, p["seq"]),
                       _on(cu_seqlens_k, p["seq"]), None, None, _on(k_scale, p["scales"]),
                       _on(v_scale, p["scales"]), _on(kv_lens, p["seq"]), _on(block_table, p["seq"])]))
    return rules


def _attention_backward(grad_out, q, k, v, out, lse, mask, scale, causal, window, dropout_p, seed,
                        window_right=-1, softcap=0.0, sinks=None, alibi_slopes=None, cu_seqlens_q=None,
                        cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0):
    rules = []
    for p in _attention_rules("attention_backward", q, k, mask, dropout_p, sinks, alibi_slopes,
                              cu_seqlens_q, None, None, None):
        # a batch shard gives part of the sinks' gradient (a sum over ranks); without sinks it is empty
        grad_sinks = (Partial() if p["q"] == Shard(0) else p["sinks"]) if sinks is not None else Replicate()
        rules.append(([p["out"], p["kv"], p["kv"], grad_sinks],
                      [p["out"], p["q"], p["kv"], p["kv"], p["out"], p["lse"], _on(mask, p["mask"]),
                       None, None, None, None, _on(seed, Replicate()), None, None,
                       _on(sinks, p["sinks"]), _on(alibi_slopes, p["alibi"]),
                       _on(cu_seqlens_q, p["seq"]), _on(cu_seqlens_k, p["seq"]), None, None]))
    return rules


# --- KV cache --------------------------------------------------------------------------------


def _quantize_kv(x, values, scales):
    # rows of the last dim are quantized one by one: any other dim may be sharded
    rules = [([Replicate()] * 3, (1, 2))] + [([Shard(d)] * 3, (1, 2)) for d in _rows(x)]
    return [([], inputs) for inputs in _pinned("quantize_kv", ("values", "scales"),
                                              (values, scales), rules)]


# --- linear cross-entropy --------------------------------------------------------------------


def _linear_cross_entropy(hidden, weight, bias, target, ignore_index, reduction, label_smoothing,
                          softcap, z_loss):
    # Sharded over tokens, each rank its tokens' losses: a sum over ranks for
    # "sum"; the mean divides by a count of tokens over all ranks, so it takes
    # whole inputs. A vocabulary-sharded weight needs the whole vocabulary's
    # log-sum-exp per token: all-gathered.
    rules = [([Replicate()], [Replicate(), Replicate(), _on(bias, Replicate()), Replicate()])]
    by_tokens = {"none": Shard(0), "sum": Partial()}.get(reduction)
    if by_tokens is not None:
        rules.append(([by_tokens], [Shard(0), Replicate(), _on(bias, Replicate()), Shard(0)]))
    return [(out, inputs + [None] * 5) for out, inputs in rules]


def _linear_cross_entropy_pass(hidden, weight, bias, target, grad_scale, ignore_index,
                               label_smoothing, softcap, z_loss, output_mask):
    # loss, grad_hidden, grad_weight, grad_bias (empty where output_mask leaves them out)
    _, want_weight, want_bias = output_mask
    rules = [([Replicate()] * 4,
              [Replicate(), Replicate(), _on(bias, Replicate()), Replicate(), _on(grad_scale, Replicate())]
              + [None] * 5)]
    weight_grad = Partial() if want_weight else Replicate()
    bias_grad = Partial() if want_bias and bias is not None else Replicate()
    scale = None if grad_scale is None else (Shard(0) if len(grad_scale.shape) else Replicate())
    rules.append(([Shard(0), Shard(0), weight_grad, bias_grad],
                  [Shard(0), Replicate(), _on(bias, Replicate()), Shard(0), _on(grad_scale, scale)]
                  + [None] * 5))
    return rules


# --- mixture of experts ----------------------------------------------------------------------


def _moe_route(router_logits, top_k, scoring, normalize, correction_bias, num_groups, top_groups,
               scaling):
    rules = []
    for p in (Replicate(), Shard(0)):
        rules.append(([p, p], [p, None, None, None, _on(correction_bias, Replicate()), None, None, None]))
    return rules


def _moe_route_backward(grad_weights, router_logits, indices, scoring, normalize, scaling):
    return [([p], [p, p, p, None, None, None]) for p in (Replicate(), Shard(0))]


def _moe_experts(hidden, indices, weights, gate_up_proj, down_proj, activation, save_for_backward,
                 gate_up_bias=None, down_bias=None, transposed=False, interleaved=False, alpha=GPT_OSS_ALPHA,
                 limit=GPT_OSS_LIMIT):
    # Sharded over tokens with every expert on every rank. What is saved for
    # backward (the pairs in expert order, each expert's row offsets) is each
    # rank's own: the offsets of all ranks add up to those of the whole batch.
    rules = []
    for p, offsets in ((Replicate(), Replicate()), (Shard(0), Partial())):
        rules.append(([p, p, p, offsets, p, p],
                      [p, p, p, Replicate(), Replicate(), None, None, _on(gate_up_bias, Replicate()),
                       _on(down_bias, Replicate())] + [None] * 4))
    return rules


def _moe_experts_backward(grad_out, hidden, indices, weights, gate_up_proj, down_proj, order, position,
                          offsets, gate_up, expert_out, activation, output_mask, gate_up_bias=None,
                          down_bias=None, transposed=False, interleaved=False, alpha=GPT_OSS_ALPHA, limit=GPT_OSS_LIMIT,
                          bias_mask=(False, False)):
    rules = []
    for p, summed in ((Replicate(), Replicate()), (Shard(0), Partial())):
        rules.append(([p, p, summed, summed, summed, summed],
                      [p, p, p, p, Replicate(), Replicate(), p, p, summed, p, p, None, None,
                       _on(gate_up_bias, Replicate()), _on(down_bias, Replicate())] + [None] * 5))
    return rules


_RULES = (
    (("rms_norm",), _rms_norm),
    (("fused_add_rms_norm",), _fused_add_rms_norm),
    (("rms_norm_backward",), _rms_norm_backward),
    (("swiglu",), _swiglu),
    (("swiglu_backward",), _swiglu_backward),
    (("swiglu_packed",), _swiglu_packed),
    (("swiglu_packed_backward",), _swiglu_packed_backward),
    (("rope",), _rope),
    (("rope_",), _rope_inplace),
    (("attention",), _attention),
    (("attention_backward",), _attention_backward),
    (("quantize_kv",), _quantize_kv),
    (("linear_cross_entropy",), _linear_cross_entropy),
    (("linear_cross_entropy_pass",), _linear_cross_entropy_pass),
    (("moe_route",), _moe_route),
    (("moe_route_backward",), _moe_route_backward),
    (("moe_experts",), _moe_experts),
    (("moe_experts_backward",), _moe_experts_backward),
)
