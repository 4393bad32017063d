"""Fake (meta) kernels for the ``torch.ops.fusedllm`` operators: the shapes and
dtypes torch.compile traces with. The only module that calls
``torch.library.register_fake``; the schemas are in ``csrc/ops.cpp``, autograd in
``csrc/autograd.cpp``.
"""

from __future__ import annotations

import torch

from ._extension import has_extension


def rstd_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _register_rms_norm() -> None:
    @torch.library.register_fake("fusedllm::rms_norm")
    def _rms_norm_fake(input, weight, eps, offset, casting):
        return input.new_empty(input.shape), input.new_empty(input.shape[:-1], dtype=rstd_dtype(input))

    @torch.library.register_fake("fusedllm::fused_add_rms_norm")
    def _fused_add_rms_norm_fake(input, residual, weight, eps, offset, casting):
        return (
            input.new_empty(input.shape),
            input.new_empty(input.shape),
            input.new_empty(input.shape[:-1], dtype=rstd_dtype(input)),
        )

    @torch.library.register_fake("fusedllm::rms_norm_backward")
    def _rms_norm_backward_fake(grad_out, input, rstd, weight, offset, casting, grad_residual,
                                compute_weight_grad):
        n = input.shape[-1] if (weight is not None and compute_weight_grad) else 0
        return input.new_empty(input.shape), input.new_empty((n,))


def _register_swiglu() -> None:
    @torch.library.register_fake("fusedllm::swiglu")
    def _swiglu_fake(gate, up, activation):
        return gate.new_empty(gate.shape)

    @torch.library.register_fake("fusedllm::swiglu_packed")
    def _swiglu_packed_fake(gate_up, activation):
        return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))

    @torch.library.register_fake("fusedllm::swiglu_backward")
    def _swiglu_backward_fake(grad_out, gate, up, activation):
        return gate.new_empty(gate.shape), gate.new_empty(gate.shape)

    @torch.library.register_fake("fusedllm::swiglu_packed_backward")
    def _swiglu_packed_backward_fake(grad_out, gate_up, activation):
        return gate_up.new_empty(gate_up.shape)


def _register_rope() -> None:
    @torch.library.register_fake("fusedllm::rope")
    def _rope_fake(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse):
        return q.new_empty(q.shape), k.new_empty(k.shape)

    @torch.library.register_fake("fusedllm::rope_")
    def _rope_inplace_fake(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse):
        return None


def _register_attention() -> None:
    @torch.library.register_fake("fusedllm::attention")
    def _attention_fake(q, k, v, mask, scale, causal, window, dropout_p, seed):
        return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=rstd_dtype(q))

    @torch.library.register_fake("fusedllm::attention_backward")
    def _attention_backward_fake(grad_out, q, k, v, out, lse, mask, scale, causal, window,
                                 dropout_p, seed):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


if has_extension():
    _register_rms_norm()
    _register_swiglu()
    _register_rope()
    _register_attention()
