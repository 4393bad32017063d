"""Philox-4x32-10 in PyTorch: the counter-based generator the kernels draw attention dropout from."""

from __future__ import annotations

import math

import torch

# Philox-4x32-10, the counter-based generator of fusedllm/dropout.h, on int64
# tensors holding 32-bit words (products split in 16-bit halves: no overflow).
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_U32 = 0xFFFFFFFF


def _mulhilo(a: int, b: torch.Tensor):
    low, high = a * (b & 0xFFFF), a * (b >> 16)
    return (high + (low >> 16)) >> 16, ((high << 16) + low) & _U32


def philox_words(seed: int, counter: torch.Tensor) -> torch.Tensor:
    """The four 32-bit outputs (last dim) of Philox-4x32-10 for 64-bit counters
    (int64 tensor, high words zero) under a 64-bit key."""
    k0, k1 = seed & _U32, (seed >> 32) & _U32
    c0, c1 = counter & _U32, (counter >> 32) & _U32
    c2, c3 = torch.zeros_like(c0), torch.zeros_like(c0)
    for r in range(10):
        hi0, lo0 = _mulhilo(_PHILOX_M[0], c0)
        hi1, lo1 = _mulhilo(_PHILOX_M[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX_W[0]) & _U32, (k1 + _PHILOX_W[1]) & _U32
    return torch.stack((c0, c1, c2, c3), dim=-1)


def dropout_keep(seed: int, shape, dropout_p: float, device=None, counter=None) -> torch.Tensor:
    """Boolean [B, Hq, Sq, Sk] mask of the attention probabilities the kernels
    keep: element n (row-major index, or ``counter``'s entry) draws word n % 4
    of Philox(n // 4)."""
    n = torch.arange(math.prod(shape), dtype=torch.int64, device=device) if counter is None \
        else counter.reshape(-1)
    words = philox_words(seed, n >> 2).gather(-1, (n & 3).unsqueeze(-1)).squeeze(-1)
    return ((words >> 8) >= dropout_threshold(dropout_p)).reshape(shape)


def dropout_threshold(dropout_p: float) -> int:
    """A 24-bit draw is kept when it is >= this (so P(drop) = dropout_p to 2^-24)."""
    return math.ceil(dropout_p * (1 << 24))
