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

Works with Llama-family decoders that go through ``AttentionInterface``
(Llama, Mistral, Qwen2, ...): padding masks, sliding windows, KV caches,
dropout in training. ``import fusedllm`` itself never imports transformers,
but it imports this module as soon as transformers' modeling code is
imported (``fusedllm._transformers_hook``), so after a plain
``import fusedllm`` the name works too.
"""

from __future__ import annotations

import torch

from .functional import attention

NAME = "fusedllm"

# Keyword arguments some models pass that change the attention itself; this
# backend has no kernel for them, so they are refused instead of ignored.
_UNSUPPORTED = ("softcap", "position_bias", "s_aux")


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = None, is_causal: bool | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract on :func:`fusedllm.attention`.

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
    """
    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(f"fusedllm.hf: the '{NAME}' attention does not support {name}; "
                             f"use attn_implementation='eager' for this model")
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is not None:
        if attention_mask.dim() != 4:
            raise ValueError(f"fusedllm.hf: attention_mask must be 4-D [batch, heads or 1, q_len, kv_len] "
                             f"as transformers' mask functions build it, got shape {list(attention_mask.shape)}")
        # masks built for a static cache can be longer than the keys passed
        mask = attention_mask[..., :kv_len]
        causal, window = False, None
    else:
        mask = None
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        window = sliding_window if causal else None
        if causal and 1 < q_len < kv_len:
            # transformers drops the mask with more keys than queries only when
            # the queries are the first positions (prefill into an empty static
            # cache): causality aligned top-left, so the keys past q_len are unseen.
            key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = attention(query, key, value, causal=causal, scale=scaling, window=window, mask=mask,
                    dropout_p=float(dropout or 0.0))
    return out.transpose(1, 2).contiguous(), None


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
    # or None where plain causal attention is exact.
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


register()
