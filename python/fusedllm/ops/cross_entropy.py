"""The fused LM head and loss: ``linear_cross_entropy``.

Here: the functions, each operator's plain-PyTorch twin with its checks, the
autocast rules, the fake kernels and the DTensor rules."""

from __future__ import annotations

import math
from numbers import Integral

import torch

from .. import _autocast, _fake, _plain, _sharding
from .._checks import _check_float, _check_same, _fail, _require_tensors, _number
from .._devices import ops_for
from .._limits import accumulation_dtype, check_reduction
from .._sharding import _on, partial, replicate, shard

__all__ = ["linear_cross_entropy"]

_OPERANDS = (_autocast.LOWER, ("hidden", "weight", "bias"))
_autocast.rule("linear_cross_entropy", cpu=_OPERANDS, cuda=_OPERANDS)


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


# --- the plain path: twins of the compiled operator's checks and results ---------------------------


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


@_plain.op("linear_cross_entropy")
def _plain_linear_cross_entropy(hidden, weight, bias, target, ignore_index, reduction, label_smoothing,
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


# --- fake kernels ----------------------------------------------------------------------------------


@_fake.fake("linear_cross_entropy")
def _linear_cross_entropy_fake(hidden, weight, bias, target, ignore_index, reduction,
                               label_smoothing, softcap, z_loss):
    shape = (hidden.shape[0],) if reduction == "none" else ()
    return hidden.new_empty(shape, dtype=accumulation_dtype(hidden))


@_fake.fake("linear_cross_entropy_pass")
def _linear_cross_entropy_pass_fake(hidden, weight, bias, target, grad_scale, ignore_index,
                                    label_smoothing, softcap, z_loss, output_mask):
    want_hidden, want_weight, want_bias = output_mask
    return (
        hidden.new_empty((hidden.shape[0],), dtype=accumulation_dtype(hidden)),
        hidden.new_empty(hidden.shape if want_hidden else (0,)),
        hidden.new_empty(weight.shape if want_weight else (0,)),
        hidden.new_empty((weight.shape[0],) if want_bias and bias is not None else (0,)),
    )


# --- on DTensors -----------------------------------------------------------------------------------


@_sharding.rule("linear_cross_entropy")
def _shard_linear_cross_entropy(hidden, weight, bias, target, ignore_index, reduction, label_smoothing,
                                softcap, z_loss):
    # Sharded over tokens, each rank its tokens' losses: a sum over ranks for
    # "sum"; the mean divides by a count of tokens over all ranks, so it takes
    # whole inputs. A vocabulary-sharded weight needs the whole vocabulary's
    # log-sum-exp per token: all-gathered.
    rules = [([replicate()], [replicate(), replicate(), _on(bias, replicate()), replicate()])]
    by_tokens = {"none": shard(0), "sum": partial()}.get(reduction)
    if by_tokens is not None:
        rules.append(([by_tokens], [shard(0), replicate(), _on(bias, replicate()), shard(0)]))
    return [(out, inputs + [None] * 5) for out, inputs in rules]


@_sharding.rule("linear_cross_entropy_pass")
def _shard_linear_cross_entropy_pass(hidden, weight, bias, target, grad_scale, ignore_index,
                                     label_smoothing, softcap, z_loss, output_mask):
    # loss, grad_hidden, grad_weight, grad_bias (empty where output_mask leaves them out)
    _, want_weight, want_bias = output_mask
    rules = [([replicate()] * 4,
              [replicate(), replicate(), _on(bias, replicate()), replicate(), _on(grad_scale, replicate())]
              + [None] * 5)]
    weight_grad = partial() if want_weight else replicate()
    bias_grad = partial() if want_bias and bias is not None else replicate()
    scale = None if grad_scale is None else (shard(0) if len(grad_scale.shape) else replicate())
    rules.append(([shard(0), shard(0), weight_grad, bias_grad],
                  [shard(0), replicate(), _on(bias, replicate()), shard(0), _on(grad_scale, scale)]
                  + [None] * 5))
    return rules
