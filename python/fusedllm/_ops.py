"""Fake (meta) kernels and autograd for the ``torch.ops.fusedllm`` operators.

This is the only module that calls ``torch.library.register_fake`` and
``torch.library.register_autograd``. The schemas are in ``csrc/ops.cpp``.
"""

from __future__ import annotations

import torch

from ._extension import has_extension


def rstd_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _register_rms_norm() -> None:
    ops = torch.ops.fusedllm

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

    def _backward(ctx, grad_out, x, weight, rstd, grad_residual):
        want_dw = weight is not None and ctx.needs_input_grad[ctx.weight_index]
        grad_input, grad_weight = ops.rms_norm_backward(
            grad_out, x, rstd, weight, ctx.offset, ctx.casting, grad_residual, want_dw)
        return grad_input, (grad_weight if want_dw else None)

    def _rms_norm_setup(ctx, inputs, output):
        x, weight, _eps, offset, casting = inputs
        _out, rstd = output
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset, ctx.casting, ctx.weight_index = offset, casting, 1

    def _rms_norm_grad(ctx, grad_out, _grad_rstd):
        x, weight, rstd = ctx.saved_tensors
        grad_input, grad_weight = _backward(ctx, grad_out, x, weight, rstd, None)
        return grad_input, grad_weight, None, None, None

    torch.library.register_autograd(
        "fusedllm::rms_norm", _rms_norm_grad, setup_context=_rms_norm_setup)

    def _fused_add_setup(ctx, inputs, output):
        _x, _residual, weight, _eps, offset, casting = inputs
        _out, residual_out, rstd = output
        ctx.save_for_backward(residual_out, weight, rstd)
        ctx.offset, ctx.casting, ctx.weight_index = offset, casting, 2

    def _fused_add_grad(ctx, grad_out, grad_residual_out, _grad_rstd):
        h, weight, rstd = ctx.saved_tensors
        # h = input + residual, so both receive the gradient that reaches h.
        grad_h, grad_weight = _backward(ctx, grad_out, h, weight, rstd, grad_residual_out)
        return grad_h, grad_h, grad_weight, None, None, None

    torch.library.register_autograd(
        "fusedllm::fused_add_rms_norm", _fused_add_grad, setup_context=_fused_add_setup)


def _register_swiglu() -> None:
    ops = torch.ops.fusedllm

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

    # Only the inputs are saved: backward recomputes the activation.
    def _swiglu_setup(ctx, inputs, output):
        gate, up, activation = inputs
        ctx.save_for_backward(gate, up)
        ctx.activation = activation

    def _swiglu_grad(ctx, grad_out):
        gate, up = ctx.saved_tensors
        grad_gate, grad_up = ops.swiglu_backward(grad_out, gate, up, ctx.activation)
        return grad_gate, grad_up, None

    torch.library.register_autograd("fusedllm::swiglu", _swiglu_grad, setup_context=_swiglu_setup)

    def _swiglu_packed_setup(ctx, inputs, output):
        gate_up, activation = inputs
        ctx.save_for_backward(gate_up)
        ctx.activation = activation

    def _swiglu_packed_grad(ctx, grad_out):
        (gate_up,) = ctx.saved_tensors
        return ops.swiglu_packed_backward(grad_out, gate_up, ctx.activation), None

    torch.library.register_autograd(
        "fusedllm::swiglu_packed", _swiglu_packed_grad, setup_context=_swiglu_packed_setup)


def _register_rope() -> None:
    ops = torch.ops.fusedllm

    @torch.library.register_fake("fusedllm::rope")
    def _rope_fake(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse):
        return q.new_empty(q.shape), k.new_empty(k.shape)

    @torch.library.register_fake("fusedllm::rope_")
    def _rope_inplace_fake(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse):
        return None

    def _rope_setup(ctx, inputs, output):
        _q, _k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse = inputs
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.args = (offset, interleaved, rotary_dim, inverse)

    # The tables are constants: the gradient of a rotation is the inverse rotation.
    def _rope_grad(ctx, grad_q, grad_k):
        cos, sin, position_ids = ctx.saved_tensors
        offset, interleaved, rotary_dim, inverse = ctx.args
        grad_q, grad_k = ops.rope(grad_q, grad_k, cos, sin, position_ids, offset, interleaved,
                                  rotary_dim, not inverse)
        return grad_q, grad_k, None, None, None, None, None, None, None

    torch.library.register_autograd("fusedllm::rope", _rope_grad, setup_context=_rope_setup)

def _register_attention() -> None:
    ops = torch.ops.fusedllm

    @torch.library.register_fake("fusedllm::attention")
    def _attention_fake(q, k, v, mask, scale, causal, window, dropout_p, seed):
        return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=rstd_dtype(q))

    @torch.library.register_fake("fusedllm::attention_backward")
    def _attention_backward_fake(grad_out, q, k, v, out, lse, mask, scale, causal, window,
                                 dropout_p, seed):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def _attention_setup(ctx, inputs, output):
        q, k, v, mask, scale, causal, window, dropout_p, seed = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, mask, seed)
        ctx.scale, ctx.causal, ctx.window, ctx.dropout_p = scale, causal, window, dropout_p

    def _attention_grad(ctx, grad_out, _grad_lse):
        # lse is returned for the backward op (and for inspection); it carries no
        # gradient, nor do the mask and the seed.
        q, k, v, out, lse, mask, seed = ctx.saved_tensors
        grad_q, grad_k, grad_v = ops.attention_backward(
            grad_out, q, k, v, out, lse, mask, ctx.scale, ctx.causal, ctx.window, ctx.dropout_p,
            seed)
        needs = ctx.needs_input_grad
        return (grad_q if needs[0] else None, grad_k if needs[1] else None,
                grad_v if needs[2] else None) + (None,) * 6

    torch.library.register_autograd(
        "fusedllm::attention", _attention_grad, setup_context=_attention_setup)


if has_extension():
    _register_rms_norm()
    _register_swiglu()
    _register_rope()
    _register_attention()
