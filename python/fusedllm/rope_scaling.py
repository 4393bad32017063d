"""cos/sin tables for rotary embeddings, with the context-extension scalings.

The kernels only rotate; the angles are built here. Inverse frequencies follow
the definitions Hugging Face transformers uses for the same ``rope_type``
(default, linear, dynamic NTK, llama3, YaRN), computed the same way in float32,
so a model's tables come out equal to its own.
"""

from __future__ import annotations

import math
from numbers import Real

import torch

from ._limits import check_positive_int

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def _param(scaling: dict, key: str, rope_type: str, default=None, required=False):
    value = scaling.get(key, default)
    if value is None and required:
        raise ValueError(f"fusedllm.rope_tables: rope_type {rope_type!r} needs scaling[{key!r}]")
    if value is not None and (isinstance(value, bool) or not isinstance(value, Real)):
        raise ValueError(f"fusedllm.rope_tables: scaling[{key!r}] must be a number, got {value!r}")
    return value


def _base_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inverse_frequencies(dim: int, max_positions: int, base: float = 10000.0,
                        scaling: dict | None = None) -> tuple[torch.Tensor, float]:
    """The float32 inverse frequencies ``[dim / 2]`` and the attention scaling factor
    that multiplies cos and sin (1 except for YaRN).

    ``scaling`` is a Hugging Face style dict: ``{"rope_type": ..., "factor": ...}``
    plus, by type, ``original_max_position_embeddings`` (dynamic, llama3, yarn),
    ``low_freq_factor`` and ``high_freq_factor`` (llama3), ``beta_fast``,
    ``beta_slow``, ``mscale``, ``mscale_all_dim``, ``attention_factor`` and
    ``truncate`` (yarn). The older key ``"type"`` is accepted for ``"rope_type"``.
    Dynamic NTK tables are those for a sequence of ``max_positions`` tokens.
    """
    scaling = dict(scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"fusedllm.rope_tables: rope_type must be one of {ROPE_TYPES}, got {rope_type!r}")
    if rope_type == "default":
        return _base_inv_freq(dim, base), 1.0
    factor = _param(scaling, "factor", rope_type, required=rope_type != "yarn")
    if factor is not None and factor <= 0:
        raise ValueError(f"fusedllm.rope_tables: scaling['factor'] must be > 0, got {factor!r}")

    if rope_type == "linear":
        return _base_inv_freq(dim, base) / factor, 1.0

    original = _param(scaling, "original_max_position_embeddings", rope_type, required=True)
    if rope_type == "dynamic":
        if dim <= 2:
            raise ValueError("fusedllm.rope_tables: dynamic NTK scaling needs dim > 2")
        seq_len = max(max_positions, original)
        scaled_base = base * ((factor * seq_len / original) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(dim, scaled_base), 1.0

    if rope_type == "llama3":
        low = _param(scaling, "low_freq_factor", rope_type, required=True)
        high = _param(scaling, "high_freq_factor", rope_type, required=True)
        inv_freq = _base_inv_freq(dim, base)
        wavelength = 2 * math.pi / inv_freq
        low_wavelength, high_wavelength = original / low, original / high
        # long wavelengths are interpolated by `factor`, short ones kept, and
        # the band between blended smoothly
        scaled = torch.where(wavelength > low_wavelength, inv_freq / factor, inv_freq)
        smooth = (original / wavelength - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = ~(wavelength < high_wavelength) * ~(wavelength > low_wavelength)
        return torch.where(in_band, blended, scaled), 1.0

    # yarn
    if factor is None:
        raise ValueError("fusedllm.rope_tables: rope_type 'yarn' needs scaling['factor']")
    attention_factor = _param(scaling, "attention_factor", rope_type)
    mscale = _param(scaling, "mscale", rope_type)
    mscale_all_dim = _param(scaling, "mscale_all_dim", rope_type)
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = _param(scaling, "beta_fast", rope_type) or 32
    beta_slow = _param(scaling, "beta_slow", rope_type) or 1

    def correction_dim(rotations):
        # the feature index whose wavelength makes `rotations` turns over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1 keeps the original frequency, 0 interpolates it
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_tables(dim: int, max_positions: int, base: float = 10000.0, scaling: dict | None = None,
                device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos`` and ``sin`` tables ``[max_positions, dim / 2]``: row ``p``
    holds the angles of position ``p`` for each rotated pair, already multiplied
    by the scaling's attention factor (as transformers does)."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2:
        raise ValueError(f"fusedllm.rope_tables: dim must be a positive even int, got {dim!r}")
    check_positive_int("fusedllm.rope_tables", "max_positions", max_positions)
    if isinstance(base, bool) or not isinstance(base, Real) or not base > 1:
        raise ValueError(f"fusedllm.rope_tables: base must be a number > 1, got {base!r}")
    inv_freq, attention_scaling = inverse_frequencies(dim, max_positions, float(base), scaling)
    angles = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()
    if attention_scaling != 1.0:
        cos, sin = cos * attention_scaling, sin * attention_scaling
    return cos.to(device), sin.to(device)
