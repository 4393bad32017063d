"""Hugging Face transformers backend: ``attn_implementation="fusedllm"`` (and
``experts_implementation="fusedllm"``, from :mod:`fusedllm.hf_moe`).

Importing this module registers :func:`attention_forward` with transformers'
``AttentionInterface`` under the name ``"fusedllm"``, and the mask builder
that transformers' SDPA backend uses with its ``AttentionMaskInterface``
(without a registered mask builder, transformers passes no mask at all to a
custom backend, so padding would be ignored)::

    import fusedllm.hf
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fusedllm")
    model.set_attn_implementation("fusedllm")      # or switch an existing model

Works with decoders that go through ``AttentionInterface``: Llama, Mistral,
Qwen2/3, Phi-3, Gemma, Cohere, GPT-NeoX, and

- Gemma 2 and Gemma 3 (text): global and sliding-window layers, Gemma 2's
  attention-logit soft-capping (``softcap``, passed to the kernel's
  ``softcap``);
- OLMo 2 (its q/k norms run before the attention function);
- gpt-oss: the learned attention sinks (``s_aux``, passed as ``sinks``),
  sliding-window layers, projection biases;

with padding masks, sliding windows, KV caches and dropout in training.
``fusedllm.hf.FusedCache`` (:mod:`fusedllm.hf_cache`) is a transformers
``Cache`` whose decoding steps write only the new positions.

Packed sequences (padding-free training): several sequences concatenated in
one row, as ``DataCollatorWithFlattening`` makes them, run on
:func:`fusedllm.attention_varlen`, each sequence attending only to itself:

- with ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (and optionally
  ``max_length_q`` / ``max_length_k``), as that collator gives with
  ``return_flash_attn_kwargs=True``: those boundaries, over the batch's
  rows flattened, are used;
- otherwise, in causal attention over one row whose keys are its own
  queries (no earlier tokens cached), outside ``torch.compile``, when
  ``position_ids`` do not step by one (they restart, e.g. at 0, where a
  sequence begins): a new sequence starts wherever they do not, the rule
  transformers' mask builders use for packed rows.

Either way the row must hold no padding (a mask that hides some token from
itself); explicit ``cu_seq_lens`` with padding are an error, restarting
positions with padding run densely under the mask. As in transformers'
flash-attention path, restarting positions are honoured even where
transformers' own masks do not separate the sequences (a model whose mask
builders are not given ``position_ids``, such as gpt-oss, or a run with a KV
cache or an all-ones ``attention_mask``).

``import fusedllm`` itself never imports transformers, but it imports this
module as soon as transformers' modeling code is imported
(``fusedllm._transformers_hook``), so after a plain ``import fusedllm`` the
name works too.
"""

from __future__ import annotations

from numbers import Integral

import torch

from . import functional as FF
from .ops.attention import attention_with_lse, merge_attention

NAME = "fusedllm"

# Keyword arguments some models pass that change the attention itself; this
# backend has no kernel for them, so they are refused instead of ignored.
_UNSUPPORTED = ("position_bias",)


def _sees_itself(mask: torch.Tensor, q_len: int, kv_len: int) -> bool:
    """Whether every query of a 4-D mask sees its own key. transformers masks
    a padding token's key for every query, its own included, while causal,
    sliding and packed-sequence masks always keep it: so this reads "no
    padding" off the mask's diagonal, O(q_len) of it."""
    mask = mask.expand(*mask.shape[:-2], q_len, kv_len)
    own = mask.diagonal(offset=kv_len - q_len, dim1=-2, dim2=-1)
    if own.dtype != torch.bool:
        own = own > torch.finfo(own.dtype).min
    return bool(own.all())


def _boundaries(name: str, value, total: int, device) -> torch.Tensor:
    """A ``cu_seq_lens_*`` argument as the int32 tensor the varlen op takes."""
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.numel() < 2 \
            or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        shown = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"fusedllm.hf: {name} must be a 1-D integer tensor [num_seqs + 1] of cumulative "
                         f"sequence lengths, got {shown}")
    value = value.to(device=device, dtype=torch.int32)
    first, last = int(value[0]), int(value[-1])
    if first != 0 or last != total:
        raise ValueError(f"fusedllm.hf: {name} must run from 0 to the {total} flattened tokens "
                         f"(batch * length), got {first} ... {last}")
    return value


def _max_length(name: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_floating_point:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"fusedllm.hf: {name} must be an int (the longest sequence), got {value!r}")
    return int(value)


def _packed_from_positions(position_ids, batch: int, q_len: int, kv_len: int):
    """``cu_seqlens`` [num_seqs + 1] (int32) of the sequences packed in one
    row, read from where ``position_ids`` do not step by one; None when the
    row holds a single sequence or the layout is not a packed row."""
    if (not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or batch != 1
            or position_ids.shape[0] != 1 or position_ids.shape[1] != q_len or q_len != kv_len or q_len < 2):
        return None
    row = position_ids[0]
    starts = (torch.diff(row) != 1).nonzero().flatten() + 1
    if starts.numel() == 0:
        return None
    ends = torch.tensor([0, q_len], dtype=starts.dtype, device=row.device)
    return torch.cat([ends[:1], starts, ends[1:]]).to(torch.int32)


def _varlen_layout(attention_mask, position_ids, causal, batch, q_len, kv_len, device, kwargs):
    """``(cu_seqlens_q, cu_seqlens_k, max_q, max_k)`` when this call runs on
    attention_varlen, else None (see the module docstring for when)."""
    cu_q, cu_k = kwargs.pop("cu_seq_lens_q", None), kwargs.pop("cu_seq_lens_k", None)
    max_q = _max_length("max_length_q", kwargs.pop("max_length_q", None))
    max_k = _max_length("max_length_k", kwargs.pop("max_length_k", None))
    if cu_q is None and cu_k is None:
        if max_q is not None or max_k is not None:
            raise ValueError("fusedllm.hf: max_length_q / max_length_k were given without cu_seq_lens_q and "
                             "cu_seq_lens_k, the sequence boundaries they go with")
        # Reading the positions would break a compiled graph; there the dense
        # path runs under transformers' mask, which separates packed rows itself
        # where it is given the positions.
        packed = causal and not torch.compiler.is_compiling()
        cu = _packed_from_positions(position_ids, batch, q_len, kv_len) if packed else None
        if cu is None:
            return None
        if attention_mask is not None and not _sees_itself(attention_mask, q_len, kv_len):
            return None  # padding: the dense path under transformers' mask
        cu = cu.to(device)
        return cu, cu, None, None
    if cu_q is None or cu_k is None:
        missing = "cu_seq_lens_k" if cu_k is None else "cu_seq_lens_q"
        raise ValueError(f"fusedllm.hf: cu_seq_lens_q and cu_seq_lens_k go together; {missing} is missing")
    cu_q = _boundaries("cu_seq_lens_q", cu_q, batch * q_len, device)
    cu_k = _boundaries("cu_seq_lens_k", cu_k, batch * kv_len, device)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"fusedllm.hf: cu_seq_lens_q and cu_seq_lens_k must describe the same number of "
                         f"sequences, got {cu_q.numel() - 1} and {cu_k.numel() - 1}")
    if attention_mask is not None and not _sees_itself(attention_mask, q_len, kv_len):
        raise ValueError("fusedllm.hf: cu_seq_lens_q / cu_seq_lens_k describe packed sequences without padding, "
                         "but the attention mask hides padding tokens; pass the packed sequences without an "
                         "attention_mask, or padded ones without cu_seq_lens")
    return cu_q, cu_k, max_q, max_k


def _window_attention(query, key, value, mask, layout, scale, dropout_p, softcap, sinks, scales):
    """Attention over the keys of a ``SinkLayer`` (:class:`fusedllm.hf_cache.WindowLayout`).
    transformers' mask, if any, spans every position seen (padding included):
    its columns at the held positions are read, combined with who sees whom.
    Without one, a one-token step sees every key it is given; a chunk runs as
    two pieces merged by their log-sum-exp, the sinks (a small mask) and the
    window positions (the kernel's causal window), so no [q_len, kv_len]
    mask is built."""
    q_len, n_keys = query.shape[2], key.shape[2]
    args = dict(scale=scale, softcap=softcap, dropout_p=dropout_p)
    if mask is not None:
        if mask.shape[-2] != q_len or mask.shape[-1] < layout.end:
            raise ValueError(f"fusedllm.hf: attention_mask for a FusedCache(window=...) layer must span the "
                             f"{layout.end} positions seen and the {q_len} queries, got shape {list(mask.shape)}")
        positions = layout.positions(query.device)
        if mask.dtype != torch.bool:  # an additive mask: 0 keeps, the dtype's minimum (or -inf) hides
            hidden = mask <= torch.finfo(mask.dtype).min / 2
            if bool(((mask != 0) & ~hidden).any()):
                raise ValueError("fusedllm.hf: a FusedCache(window=...) layer reads the attention mask as keep / "
                                 "hide only, but this additive mask holds other values (a bias); pass a bool mask, "
                                 "or 0 and the dtype's minimum")
            mask = ~hidden
        held = mask.index_select(-1, positions)
        visible = layout.visible(query.device)
        # A row's sink positions must be real tokens: left padding over them would leave the row without sinks.
        q_pos = torch.arange(layout.first_query, layout.end, device=query.device)
        real = mask.gather(-1, q_pos.view(1, 1, -1, 1).expand(*mask.shape[:2], q_len, 1)).squeeze(-1)
        sink_seen = visible & (positions < layout.sink)[None, :]
        if bool((real[..., None] & sink_seen & ~held).any()):
            raise ValueError(f"fusedllm.hf: with FusedCache(window=..., sink={layout.sink}) the first "
                             f"{layout.sink} positions of every row are its sinks, but some row's are padding "
                             f"(left padding); generate such rows with prompts of equal length, or without sinks")
        return FF.attention(query, key, value, mask=held & visible, sinks=sinks, **args, **scales)
    if not layout.ordered:
        return FF.attention(query, key, value, sinks=sinks, **args, **scales)
    # a chunk: the sink keys (positions < sink, first), then the window's, ending at the last query
    cut = layout.sink_keys
    pieces = []
    if cut:
        q_pos = torch.arange(layout.first_query, layout.end, device=query.device)[:, None]
        seen = torch.arange(cut, device=query.device)[None, :] <= q_pos
        part = {name: t[:, :, :cut] for name, t in scales.items()}
        pieces.append(attention_with_lse(query, key[:, :, :cut], value[:, :, :cut], mask=seen, **args, **part))
    if cut < n_keys:
        part = {name: t[:, :, cut:] for name, t in scales.items()}
        pieces.append(attention_with_lse(query, key[:, :, cut:], value[:, :, cut:], causal=True,
                                             window=layout.window, **args, **part))
    return merge_attention(pieces, pieces[0][0].dtype, sinks)  # the output dtype (autocast: not q's)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = None, is_causal: bool | None = None,
                      softcap: float | None = None, s_aux: torch.Tensor | None = None,
                      position_ids: torch.Tensor | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract on :func:`fusedllm.attention`
    (or :func:`fusedllm.attention_varlen` for packed sequences).

    ``query [B, Hq, Sq, D]``, ``key`` / ``value [B, Hkv, Sk, D]`` (not
    repeated: grouped-query attention reads each kv head in place). Returns
    ``(out [B, Sq, Hq, D], None)``: no attention weights (use "eager" for them).

    A 4-D ``attention_mask`` (bool keep-mask or additive float, as transformers
    builds it) already holds causality, padding and the sliding window, so it
    is applied alone. Without one, attention is causal when ``is_causal`` (or
    ``module.is_causal``, default True) says so, with ``sliding_window`` as the
    window. Queries whose mask row is all False (left padding) get zeros where
    eager attention gives an average of the values: such rows are padding and
    never feed a real token.

    ``softcap`` (Gemma 2's ``attn_logit_softcapping``) caps the scaled scores
    at ``softcap * tanh(s / softcap)`` before the mask; ``s_aux`` (gpt-oss's
    ``sinks``, one logit per query head) joins every softmax denominator.
    Packed sequences (``cu_seq_lens_q`` / ``cu_seq_lens_k``, or restarting
    ``position_ids``) run on the varlen kernel, as the module docstring says.
    Keys from a ``FusedCache(window=..., sink=...)`` layer carry the positions
    they hold (:class:`fusedllm.hf_cache.WindowLayout`): who sees whom comes
    from them, and transformers' mask only adds the padding.
    """
    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(f"fusedllm.hf: the '{NAME}' attention does not support {name}; "
                             f"use attn_implementation='eager' for this model")
    batch, q_heads, q_len, head_dim = query.shape
    kv_len = key.shape[2]
    scales = {}
    if key.dtype in (torch.int8, torch.float8_e4m3fn) or value.dtype in (torch.int8, torch.float8_e4m3fn):
        # quantized keys and values from FusedCache(dtype=torch.int8 or float8) carry their scales
        k_scale, v_scale = getattr(key, "fusedllm_scale", None), getattr(value, "fusedllm_scale", None)
        if k_scale is None or v_scale is None:
            raise ValueError(f"fusedllm.hf: {key.dtype} keys and values need the scales fusedllm.hf.FusedCache("
                             f"dtype={key.dtype}) gives them; these came without")
        scales = dict(k_scale=k_scale, v_scale=v_scale)
    if attention_mask is not None:
        if attention_mask.dim() != 4:
            raise ValueError(f"fusedllm.hf: attention_mask must be 4-D [batch, heads or 1, q_len, kv_len] "
                             f"as transformers' mask functions build it, got shape {list(attention_mask.shape)}")
    layout = getattr(key, "fusedllm_layout", None)
    if layout is not None:  # FusedCache(window=...): sink and window positions
        out = _window_attention(query, key, value, attention_mask, layout, scaling, float(dropout or 0.0),
                                softcap, s_aux, scales)
        return out.transpose(1, 2).contiguous(), None
    if attention_mask is not None:
        # masks built for a static cache can be longer than the keys passed
        attention_mask = attention_mask[..., :kv_len]
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    dropout_p = float(dropout or 0.0)
    varlen = _varlen_layout(attention_mask, position_ids, causal, batch, q_len, kv_len, query.device, kwargs)
    if varlen is not None:
        # Beyond its diagonal the mask is not read. Without padding (checked
        # on that diagonal) the mask transformers built for this row is, per
        # sequence, the causal or sliding pattern the varlen kernel applies
        # itself: for restarting positions its packed-sequence mask comes from
        # these same positions by the same rule; explicit cu_seq_lens take
        # precedence over any pattern, as in transformers' flash-attention path.
        cu_q, cu_k, max_q, max_k = varlen
        if sliding_window is None:
            window = None
        elif causal:
            window = sliding_window
        else:  # |i - j| < sliding_window, as transformers' flash-attention path and Gemma 3's mask
            window = (sliding_window - 1, sliding_window - 1)
        q = query.transpose(1, 2).reshape(batch * q_len, q_heads, head_dim)
        k = key.transpose(1, 2).reshape(batch * kv_len, key.shape[1], head_dim)
        v = value.transpose(1, 2).reshape(batch * kv_len, value.shape[1], head_dim)
        scales = {name: t.transpose(1, 2).reshape(batch * kv_len, t.shape[1]) for name, t in scales.items()}
        out = FF.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, causal=causal,
                                  scale=scaling, window=window, softcap=softcap, sinks=s_aux,
                                  dropout_p=dropout_p, **scales)
        return out.reshape(batch, q_len, q_heads, head_dim).contiguous(), None
    if attention_mask is not None:
        mask, causal, window = attention_mask, False, None
    else:
        mask = None
        window = sliding_window if causal else None
        if causal and 1 < q_len < kv_len:
            # transformers drops the mask with more keys than queries only when
            # the queries are the first positions (prefill into an empty static
            # cache): causality aligned top-left, so the keys past q_len are unseen.
            key, value = key[:, :, :q_len], value[:, :, :q_len]
            scales = {name: t[:, :, :q_len] for name, t in scales.items()}
    out = FF.attention(query, key, value, causal=causal, scale=scaling, window=window, mask=mask,
                       dropout_p=dropout_p, softcap=softcap, sinks=s_aux, **scales)
    return out.transpose(1, 2).contiguous(), None


def __getattr__(name: str):
    # FusedCache needs transformers 5's cache layers: imported when asked for
    if name == "FusedCache":
        from .hf_cache import FusedCache

        return FusedCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """Register ``"fusedllm"`` with transformers' attention and mask interfaces.

    Idempotent; ``import fusedllm.hf`` calls it. Needs transformers with
    ``AttentionInterface`` (4.48 and later; masks through
    ``AttentionMaskInterface`` from 4.53 on)."""
    try:
        from transformers import AttentionInterface
    except ImportError as exc:
        raise ImportError("fusedllm.hf needs transformers >= 4.48 (AttentionInterface); "
                          f"install or upgrade it: pip install -U transformers ({exc})") from exc
    AttentionInterface.register(NAME, attention_forward)
    from . import hf_moe

    hf_moe.register()  # experts_implementation="fusedllm" (transformers 5)
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:
        # Older releases build the 4-D masks inside each model and pass them to
        # every backend; nothing to register.
        return
    # The SDPA builder gives bool keep-masks (what the kernel reads directly),
    # or None where plain causal attention is exact. For packed rows it still
    # builds the block-diagonal [1, 1, S, S] mask (once per forward and layer
    # type, shared by the layers), which the varlen path reads only the
    # diagonal of: a mask builder is told neither the position ids nor that
    # the row is packed, only an opaque composed mask function, so it cannot
    # leave that mask out without depending on transformers' internals.
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


register()
