"""Plain-PyTorch versions of the ops, run when the compiled extension is not
loaded (see ``fusedllm.backend()``). Same signatures and results as the
``torch.ops.fusedllm`` operators; autograd comes from PyTorch itself."""

from __future__ import annotations

import torch


def _rms_scale(h: torch.Tensor, weight, eps: float, offset: float, casting: str):
    acc = torch.float64 if h.dtype == torch.float64 else torch.float32
    hf = h.to(acc)
    rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    normed = hf * rstd
    if weight is None:
        out = normed.to(h.dtype)
    elif casting == "llama":
        out = (normed.to(h.dtype).to(acc) * (weight.to(acc) + offset)).to(h.dtype)
    else:
        out = (normed * (weight.to(acc) + offset)).to(h.dtype)
    return out, rstd.squeeze(-1).detach()


def rms_norm(input, weight, eps, offset, casting):
    return _rms_scale(input, weight, eps, offset, casting)


def fused_add_rms_norm(input, residual, weight, eps, offset, casting):
    h = input + residual
    out, rstd = _rms_scale(h, weight, eps, offset, casting)
    return out, h, rstd


def _activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return torch.nn.functional.silu(x)
    return torch.nn.functional.gelu(x, approximate="tanh")


def swiglu(gate, up, activation):
    acc = torch.float64 if gate.dtype == torch.float64 else torch.float32
    return (_activation(gate.to(acc), activation) * up.to(acc)).to(gate.dtype)


def swiglu_packed(gate_up, activation):
    gate, up = gate_up.chunk(2, dim=-1)
    return swiglu(gate, up, activation)
