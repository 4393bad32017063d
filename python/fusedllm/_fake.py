"""Fake (meta) kernels for the ``torch.ops.fusedllm`` operators (and their
``fusedllm_simt`` twins): the shapes and dtypes torch.compile traces with. The
only module that calls ``torch.library.register_fake``; the schemas are in
``csrc/include/fusedllm/schemas.h``, autograd in ``csrc/autograd.cpp``.
"""

from __future__ import annotations

import torch

from ._extension import has_extension
from ._limits import GPT_OSS_ALPHA, GPT_OSS_LIMIT, accumulation_dtype


def _register_rms_norm(ns: str) -> None:
    @torch.library.register_fake(f"{ns}::rms_norm")
    def _rms_norm_fake(input, weight, eps, offset, casting):
        return input.new_empty(input.shape), input.new_empty(input.shape[:-1], dtype=accumulation_dtype(input))

    @torch.library.register_fake(f"{ns}::fused_add_rms_norm")
    def _fused_add_rms_norm_fake(input, residual, weight, eps, offset, casting):
        return (
            input.new_empty(input.shape),
            input.new_empty(input.shape),
            input.new_empty(input.shape[:-1], dtype=accumulation_dtype(input)),
        )

    @torch.library.register_fake(f"{ns}::rms_norm_backward")
    def _rms_norm_backward_fake(grad_out, input, rstd, weight, offset, casting, grad_residual,
                                compute_weight_grad):
        n = input.shape[-1] if (weight is not None and compute_weight_grad) else 0
        return input.new_empty(input.shape), input.new_empty((n,))


def _register_swiglu(ns: str) -> None:
    @torch.library.register_fake(f"{ns}::swiglu")
    def _swiglu_fake(gate, up, activation):
        return gate.new_empty(gate.shape)

    @torch.library.register_fake(f"{ns}::swiglu_packed")
    def _swiglu_packed_fake(gate_up, activation):
        return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))

    @torch.library.register_fake(f"{ns}::swiglu_backward")
    def _swiglu_backward_fake(grad_out, gate, up, activation):
        return gate.new_empty(gate.shape), gate.new_empty(gate.shape)

    @torch.library.register_fake(f"{ns}::swiglu_packed_backward")
    def _swiglu_packed_backward_fake(grad_out, gate_up, activation):
        return gate_up.new_empty(gate_up.shape)


def _register_rope(ns: str) -> None:
    @torch.library.register_fake(f"{ns}::rope")
    def _rope_fake(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse):
        return q.new_empty(q.shape), k.new_empty(k.shape)

    @torch.library.register_fake(f"{ns}::rope_")
    def _rope_inplace_fake(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse):
        return None


def _attention_rows(t, heads_dim_first):
    """A fresh tensor shaped like q / k in the kernels' row order: contiguous
    dense [B, H, S, D], or packed [total, H, D] over [H, total, D] storage."""
    if heads_dim_first:
        return t.new_empty(t.shape[1], t.shape[0], t.shape[2]).permute(1, 0, 2)
    return t.new_empty(t.shape)


def _register_attention(ns: str) -> None:
    @torch.library.register_fake(f"{ns}::attention")
    def _attention_fake(q, k, v, mask, scale, causal, window, dropout_p, seed, window_right=-1,
                        softcap=0.0, sinks=None, alibi_slopes=None, cu_seqlens_q=None,
                        cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, k_scale=None, v_scale=None,
                        kv_lens=None, block_table=None):
        packed = cu_seqlens_q is not None
        lse_shape = (q.shape[1], q.shape[0]) if packed else q.shape[:-1]
        return _attention_rows(q, packed), q.new_empty(lse_shape, dtype=accumulation_dtype(q))

    @torch.library.register_fake(f"{ns}::attention_backward")
    def _attention_backward_fake(grad_out, q, k, v, out, lse, mask, scale, causal, window,
                                 dropout_p, seed, window_right=-1, softcap=0.0, sinks=None,
                                 alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None,
                                 max_seqlen_q=0, max_seqlen_k=0):
        packed = cu_seqlens_q is not None
        grad_sinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty(0)
        return (_attention_rows(q, packed), _attention_rows(k, packed), _attention_rows(v, packed),
                grad_sinks)


def _register_cross_entropy(ns: str) -> None:
    @torch.library.register_fake(f"{ns}::linear_cross_entropy")
    def _linear_cross_entropy_fake(hidden, weight, bias, target, ignore_index, reduction,
                                   label_smoothing, softcap, z_loss):
        shape = (hidden.shape[0],) if reduction == "none" else ()
        return hidden.new_empty(shape, dtype=accumulation_dtype(hidden))

    @torch.library.register_fake(f"{ns}::linear_cross_entropy_pass")
    def _linear_cross_entropy_pass_fake(hidden, weight, bias, target, grad_scale, ignore_index,
                                        label_smoothing, softcap, z_loss, output_mask):
        want_hidden, want_weight, want_bias = output_mask
        return (
            hidden.new_empty((hidden.shape[0],), dtype=accumulation_dtype(hidden)),
            hidden.new_empty(hidden.shape if want_hidden else (0,)),
            hidden.new_empty(weight.shape if want_weight else (0,)),
            hidden.new_empty((weight.shape[0],) if want_bias and bias is not None else (0,)),
        )


def _register_moe(ns: str) -> None:
    @torch.library.register_fake(f"{ns}::moe_route")
    def _moe_route_fake(router_logits, top_k, scoring, normalize, correction_bias, num_groups,
                        top_groups, scaling):
        shape = (router_logits.shape[0], top_k)
        return (router_logits.new_empty(shape, dtype=accumulation_dtype(router_logits)),
                router_logits.new_empty(shape, dtype=torch.int64))

    @torch.library.register_fake(f"{ns}::moe_route_backward")
    def _moe_route_backward_fake(grad_weights, router_logits, indices, scoring, normalize, scaling):
        return router_logits.new_empty(router_logits.shape)

    @torch.library.register_fake(f"{ns}::moe_experts")
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

    @torch.library.register_fake(f"{ns}::moe_experts_backward")
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


def _register_kv_cache(ns: str) -> None:
    @torch.library.register_fake(f"{ns}::quantize_kv")
    def _quantize_kv_fake(x, values, scales):
        return None


def register_fakes(ns: str) -> None:
    """Fake kernels for every op of library `ns`: "fusedllm", or "fusedllm_simt"
    (the emulated CUDA kernels, same schemas; fusedllm.simt registers those)."""
    _register_rms_norm(ns)
    _register_swiglu(ns)
    _register_rope(ns)
    _register_attention(ns)
    _register_cross_entropy(ns)
    _register_moe(ns)
    _register_kv_cache(ns)


if has_extension():
    register_fakes("fusedllm")
