"""RMSNorm, the drop-in norm module on the fused ``rms_norm`` ops."""

from __future__ import annotations

import torch
from torch import nn

from .. import functional as FF
from .._limits import CASTINGS, check_positive_int


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with a learned ``weight``.

    Loads the state dicts of the notebooks' ``RMSNorm`` classes and of
    Hugging Face's ``LlamaRMSNorm`` (``casting="llama"``, the default) or
    ``GemmaRMSNorm`` (``offset=1.0, casting="gemma"``). ``weight`` starts at
    ``1 - offset`` so a new layer scales by one.

    ``forward(x)`` returns the normalized ``x``; ``forward(x, residual)`` adds
    first and returns ``(normed, x + residual)`` from one fused pass.
    """

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0, casting: str = "llama",
                 elementwise_affine: bool = True, device=None, dtype=None):
        super().__init__()
        check_positive_int("fusedllm.nn.RMSNorm", "dim", dim)
        if casting not in CASTINGS:
            raise ValueError(f"fusedllm.nn.RMSNorm: casting must be one of {CASTINGS}, got {casting!r}")
        if offset != 0.0 and not elementwise_affine:
            raise ValueError("fusedllm.nn.RMSNorm: offset needs elementwise_affine=True")
        self.dim = dim
        self.eps = eps
        self.offset = float(offset)
        self.casting = casting
        if elementwise_affine:
            self.weight = nn.Parameter(torch.full((dim,), 1.0 - self.offset, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return FF.rms_norm(x, self.weight, self.eps, self.offset, self.casting)
        return FF.fused_add_rms_norm(x, residual, self.weight, self.eps, self.offset, self.casting)

    def extra_repr(self) -> str:
        text = f"{self.dim}, eps={self.eps}"
        if self.offset:
            text += f", offset={self.offset}"
        if self.casting != "llama":
            text += f", casting='{self.casting}'"
        return text
