"""One function per fused op: checks arguments (errors name the argument),
then calls ``torch.ops.fusedllm`` or, without the extension, the plain path."""

from __future__ import annotations

import math
from numbers import Integral, Real

import torch

from . import _fallback
from ._extension import has_extension

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_CASTINGS = ("llama", "gemma")


def _require_tensor(op: str, name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")


def _require_float(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"{op}: {name} must be float32, float64, bfloat16 or float16, got {t.dtype}")


def _require_like(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(
            f"{op}: {name} has dtype {t.dtype} but {ref_name} has dtype {ref.dtype}; "
            f"cast one of them (e.g. {name}.to({ref_name}.dtype))")
    if t.device != ref.device:
        raise ValueError(f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}")


def _require_number(op: str, name: str, value, minimum=None) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        raise ValueError(f"{op}: {name} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{op}: {name} must be >= {minimum}, got {value!r}")
    return float(value)


def _check_rms_norm(op, x, weight, eps, offset, casting):
    _require_tensor(op, "input", x)
    _require_float(op, "input", x)
    if x.dim() < 1:
        raise ValueError(f"{op}: input must have at least one dimension, got a 0-d tensor")
    if weight is not None:
        _require_tensor(op, "weight", weight)
        _require_like(op, "weight", weight, "input", x)
        if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
            raise ValueError(
                f"{op}: weight must have shape [{x.shape[-1]}] (the last dim of input "
                f"{list(x.shape)}), got {list(weight.shape)}")
    eps = _require_number(op, "eps", eps, minimum=0.0)
    offset = _require_number(op, "offset", offset)
    if weight is None and offset != 0.0:
        raise ValueError(f"{op}: offset={offset} needs a weight (y = x * rstd * (offset + weight))")
    if casting not in _CASTINGS:
        raise ValueError(f"{op}: casting must be 'llama' or 'gemma', got {casting!r}")
    return eps, offset


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
             offset: float = 0.0, casting: str = "llama") -> torch.Tensor:
    """RMSNorm over the last dim: ``x * rsqrt(mean(x**2) + eps) * (offset + weight)``.

    Statistics are computed in float32 (float64 for float64 input); the result
    has the dtype of ``x``. ``casting="llama"`` casts the normalized value to
    ``x.dtype`` before multiplying by the weight (Llama, Mistral, Qwen);
    ``"gemma"`` multiplies in float32 and casts last (Gemma, with ``offset=1``).
    """
    op = "fusedllm.rms_norm"
    eps, offset = _check_rms_norm(op, x, weight, eps, offset, casting)
    impl = torch.ops.fusedllm.rms_norm if has_extension() else _fallback.rms_norm
    out, _rstd = impl(x, weight, eps, offset, casting)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None,
                       eps: float = 1e-6, offset: float = 0.0, casting: str = "llama"):
    """``h = x + residual; return rms_norm(h), h`` in one pass over memory.

    ``h`` (rounded to ``x.dtype``) is the new residual stream of a pre-norm block.
    """
    op = "fusedllm.fused_add_rms_norm"
    eps, offset = _check_rms_norm(op, x, weight, eps, offset, casting)
    _require_tensor(op, "residual", residual)
    _require_like(op, "residual", residual, "input", x)
    if residual.shape != x.shape:
        raise ValueError(
            f"{op}: residual must have the shape of input {list(x.shape)}, got {list(residual.shape)}")
    impl = torch.ops.fusedllm.fused_add_rms_norm if has_extension() else _fallback.fused_add_rms_norm
    out, residual_out, _rstd = impl(x, residual, weight, eps, offset, casting)
    return out, residual_out


_ACTIVATIONS = ("silu", "gelu_tanh")


def swiglu(gate: torch.Tensor, up: torch.Tensor | None = None, activation: str = "silu") -> torch.Tensor:
    """Gated activation ``act(gate) * up``, computed in float32 (float64 for float64).

    ``activation`` is ``"silu"`` (SwiGLU: Llama, Mistral, Qwen) or ``"gelu_tanh"``
    (GeGLU with the tanh approximation: Gemma). With ``up=None``, ``gate`` is one
    packed ``[..., 2 * F]`` tensor laid out ``[gate | up]`` (the output of a single
    fused projection) and the result is ``[..., F]``. Backward recomputes the
    activation from the inputs, so nothing else is kept for it.
    """
    op = "fusedllm.swiglu"
    if activation not in _ACTIVATIONS:
        raise ValueError(f"{op}: activation must be 'silu' or 'gelu_tanh', got {activation!r}")
    if up is None:
        _require_tensor(op, "gate", gate)
        _require_float(op, "gate", gate)
        if gate.dim() < 1 or gate.shape[-1] % 2 != 0:
            raise ValueError(
                f"{op}: with up=None, gate must be packed [..., 2 * F] as [gate | up]; "
                f"got shape {list(gate.shape)} whose last dim is not even")
        if has_extension():
            return torch.ops.fusedllm.swiglu_packed(gate, activation)
        return _fallback.swiglu_packed(gate, activation)
    _require_tensor(op, "gate", gate)
    _require_tensor(op, "up", up)
    _require_float(op, "gate", gate)
    _require_like(op, "up", up, "gate", gate)
    if gate.shape != up.shape:
        raise ValueError(
            f"{op}: gate and up must have the same shape, got {list(gate.shape)} and {list(up.shape)}")
    if gate.dim() < 1:
        raise ValueError(f"{op}: gate must have at least one dimension, got a 0-d tensor")
    if has_extension():
        return torch.ops.fusedllm.swiglu(gate, up, activation)
    return _fallback.swiglu(gate, up, activation)


def check_rotary_dim(op: str, rotary_dim, head_dim: int) -> int:
    """The rotary_dim rule, for every path (the rope operators check the same
    in C++): None means the whole head, else a positive even int <= head_dim."""
    if rotary_dim is None:
        rotary_dim = head_dim
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
        raise ValueError(f"{op}: rotary_dim must be an int, got {rotary_dim!r}")
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"{op}: rotary_dim must be a positive even number at most the head dim "
                         f"{head_dim}, got {rotary_dim}")
    return rotary_dim


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
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        _require_tensor(op, name, t)
    _require_float(op, "q", q)
    _require_like(op, "k", k, "q", q)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"{op}: q and k must be [B, H, S, D], got {list(q.shape)} and {list(k.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{op}: q and k must have the same head dim, got {q.shape[-1]} and {k.shape[-1]}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"{op}: q and k must have the same batch and sequence sizes, "
                         f"got {list(q.shape)} and {list(k.shape)}")
    head_dim, batch, seq = q.shape[-1], q.shape[0], q.shape[2]
    rotary_dim_given = rotary_dim is not None
    rotary_dim = check_rotary_dim(op, rotary_dim, head_dim)
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"{op}: offset must be an int >= 0, got {offset!r}")
    if cos.shape != sin.shape:
        raise ValueError(f"{op}: cos and sin must have the same shape, got {list(cos.shape)} and {list(sin.shape)}")
    if cos.device != q.device or sin.device != q.device:
        raise ValueError(f"{op}: cos and sin are on {cos.device} but q is on {q.device}")
    _require_float(op, "cos", cos)
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError(f"{op}: cos and sin are constants here; gradients to them are not computed")
    if cos.dim() not in (2, 3):
        raise ValueError(f"{op}: cos and sin must be [positions, rotary_dim / 2] or per-token "
                         f"[B, S, rotary_dim], got {list(cos.shape)}")
    if _hf_table_layout(op, cos, q, rotary_dim, rotary_dim_given):
        # both members of a pair carry the angle: keep one of each pair
        pick = slice(0, None, 2) if interleaved else slice(0, rotary_dim // 2)
        cos, sin = cos[..., pick], sin[..., pick]
    if cos.dim() == 3:
        if position_ids is not None or offset:
            raise ValueError(f"{op}: per-token cos/sin [B, S, ...] are already indexed by position; "
                             f"pass position_ids or offset only with a [positions, ...] table")
        if cos.shape[0] not in (1, batch) or cos.shape[1] != seq:
            raise ValueError(f"{op}: per-token cos/sin must be [{batch} or 1, {seq}, ...], got {list(cos.shape)}")
    elif position_ids is not None:
        _require_tensor(op, "position_ids", position_ids)
        if position_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{op}: position_ids must be int64 or int32, got {position_ids.dtype}")
        if position_ids.device != q.device:
            raise ValueError(f"{op}: position_ids is on {position_ids.device} but q is on {q.device}")
        if not (tuple(position_ids.shape) == (seq,) or
                (position_ids.dim() == 2 and position_ids.shape[0] in (1, batch) and position_ids.shape[1] == seq)):
            raise ValueError(f"{op}: position_ids must be [S] or [B, S] = [{batch}, {seq}], "
                             f"got {list(position_ids.shape)}")
        if offset:
            raise ValueError(f"{op}: pass either position_ids or offset, not both")
        # Checked here only where it costs no device-to-host sync: on a GPU the
        # kernel's device-side assert catches positions past the table (as
        # torch's own embedding lookup does).
        if (position_ids.numel() and position_ids.device.type == "cpu"
                and not torch.compiler.is_compiling()):
            low, high = int(position_ids.min()), int(position_ids.max())
            if low < 0 or high >= cos.shape[0]:
                raise ValueError(f"{op}: position_ids span {low}..{high} but the cos/sin table has "
                                 f"{cos.shape[0]} positions")
    elif offset + seq > cos.shape[0]:
        raise ValueError(f"{op}: positions {offset}..{offset + seq - 1} are past the cos/sin table "
                         f"of {cos.shape[0]} positions")
    if inplace:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            raise ValueError(f"{op}: inplace=True has no autograd; use inplace=False for training")
        if has_extension():
            torch.ops.fusedllm.rope_(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, False)
        else:
            rq, rk = _fallback.rope(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, False)
            q.copy_(rq)
            k.copy_(rk)
        return q, k
    impl = torch.ops.fusedllm.rope if has_extension() else _fallback.rope
    return impl(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, False)

_MAX_HEAD_DIM = 256


def _check_attention(op, q, k, v, causal, scale, window, kernel=True):
    """Checked (scale, window); `kernel=False` (the plain path) lifts the head_dim limit."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _require_tensor(op, name, t)
    _require_float(op, "q", q)
    _require_like(op, "k", k, "q", q)
    _require_like(op, "v", v, "q", q)
    for name, t, heads, length in (("q", q, "q_heads", "q_len"), ("k", k, "kv_heads", "kv_len"),
                                   ("v", v, "kv_heads", "kv_len")):
        if t.dim() != 4:
            raise ValueError(f"{op}: {name} must be 4-D [batch, {heads}, {length}, head_dim], "
                             f"got shape {list(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"{op}: k and v must have the same shape, got {list(k.shape)} and "
                         f"{list(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"{op}: q and k/v must have the same batch size, got {q.shape[0]} and "
                         f"{k.shape[0]}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"{op}: q and k/v must have the same head_dim, got {q.shape[3]} and "
                         f"{k.shape[3]}")
    q_heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[3]
    if (q_heads % kv_heads != 0) if kv_heads else q_heads != 0:
        raise ValueError(f"{op}: the number of query heads ({q_heads}) must be a multiple of the "
                         f"number of key/value heads ({kv_heads})")
    if head_dim < 1 or (kernel and head_dim > _MAX_HEAD_DIM):
        raise ValueError(f"{op}: head_dim must be between 1 and {_MAX_HEAD_DIM}, got {head_dim}")
    if not isinstance(causal, bool):
        raise ValueError(f"{op}: causal must be True or False, got {causal!r}")
    scale = head_dim ** -0.5 if scale is None else _require_number(op, "scale", scale)
    if window is None:
        window = -1
    elif isinstance(window, bool) or not isinstance(window, Integral) or window < 1:
        raise ValueError(f"{op}: window must be None or an int >= 1 (the number of keys a query "
                         f"sees, itself included), got {window!r}")
    return scale, int(window)


def _check_attention_mask(op, mask, q, k):
    if mask is None:
        return None
    _require_tensor(op, "mask", mask)
    if mask.dtype != torch.bool and mask.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{op}: mask must be a bool keep-mask (True attends) or a float32, "
                         f"float64, bfloat16 or float16 additive mask, got {mask.dtype}")
    if mask.device != q.device:
        raise ValueError(f"{op}: mask is on {mask.device} but q is on {q.device}")
    if mask.requires_grad:
        raise ValueError(f"{op}: mask requires grad, but no gradient flows to the mask; "
                         f"pass mask.detach()")
    target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    try:
        ok = mask.dim() <= 4 and torch.broadcast_shapes(mask.shape, target) == target
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"{op}: mask of shape {list(mask.shape)} does not broadcast to "
                         f"[batch, q_heads, q_len, kv_len] = {list(target)}")
    return mask


def _dropout_seed(op, dropout_p):
    """The dropout probability, checked, and a seed drawn from torch's default
    generator (so torch.manual_seed repeats it); None when there is no dropout."""
    dropout_p = _require_number(op, "dropout_p", dropout_p, minimum=0.0)
    if dropout_p >= 1.0:
        raise ValueError(f"{op}: dropout_p must be in [0, 1), got {dropout_p!r}")
    if dropout_p == 0.0:
        return 0.0, None
    return dropout_p, torch.randint(0, 2**62, (1,), dtype=torch.int64)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: float | None = None, window: int | None = None,
              mask: torch.Tensor | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Grouped-query attention ``softmax(q k^T * scale + mask) v``, flash style.

    ``q`` is ``[batch, q_heads, q_len, head_dim]``, ``k`` and ``v`` are
    ``[batch, kv_heads, kv_len, head_dim]`` with ``q_heads`` a multiple of
    ``kv_heads``: query head ``h`` attends with kv head ``h // (q_heads // kv_heads)``
    (K and V are never repeated in memory). ``scale`` defaults to ``head_dim ** -0.5``.

    Masks are aligned bottom-right: query ``i`` sits at position ``i + kv_len - q_len``
    (the queries are the last ``q_len`` positions, as when decoding with a KV cache).
    ``causal=True`` lets it see keys ``j <= i + kv_len - q_len``. This equals
    ``F.scaled_dot_product_attention(is_causal=True)`` when ``q_len == kv_len``; when
    they differ SDPA aligns top-left (query ``i`` sees keys ``j <= i``) instead.
    ``window=w`` keeps only the last ``w`` keys up to a query's position,
    ``j > i + kv_len - q_len - w`` (itself included): with ``causal=True`` this is
    Mistral's / Hugging Face's ``sliding_window``.

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

    ``dropout_p > 0`` drops attention probabilities with that probability and
    scales the rest by ``1 / (1 - dropout_p)`` (pass 0 in evaluation, as with
    SDPA). The dropout pattern comes from a counter-based generator keyed by a
    seed drawn from torch's default generator, so ``torch.manual_seed`` repeats
    it; backward regenerates it instead of storing it.

    float32, float64, bfloat16 and float16, accumulated in float32 (float64 for
    float64); memory grows linearly with the sequence lengths, never with
    ``q_len * kv_len``. Differentiable in ``q``, ``k`` and ``v``.
    """
    op = "fusedllm.attention"
    scale, window = _check_attention(op, q, k, v, causal, scale, window)
    mask = _check_attention_mask(op, mask, q, k)
    dropout_p, seed = _dropout_seed(op, dropout_p)
    impl = torch.ops.fusedllm.attention if has_extension() else _fallback.attention
    out, _lse = impl(q, k, v, mask, scale, causal, window, dropout_p, seed)
    return out


def attention_with_weights(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                           scale: float | None = None, window: int | None = None,
                           mask: torch.Tensor | None = None,
                           dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention` on a plain PyTorch path that also returns the attention
    probabilities ``[batch, q_heads, q_len, kv_len]`` in q's dtype: those that
    multiplied ``v`` (after dropout, drawn as the fused kernel draws it). It
    builds the whole score matrix, so it is slow and memory hungry: for code
    that inspects or plots the weights. Queries that see no key get zero
    weights and a zero output. Same arguments, checks and conventions as
    :func:`attention`, without its head_dim limit; differentiable in q, k and v."""
    op = "fusedllm.attention_with_weights"
    scale, window = _check_attention(op, q, k, v, causal, scale, window, kernel=False)
    mask = _check_attention_mask(op, mask, q, k)
    dropout_p, seed = _dropout_seed(op, dropout_p)
    out, _lse, probs = _fallback.attention_with_probs(q, k, v, mask, scale, causal, window,
                                                      dropout_p, seed)
    return out, probs.to(q.dtype)
