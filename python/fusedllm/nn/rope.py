"""RotaryEmbedding, the rotary position embedding module and its cos / sin tables."""

from __future__ import annotations

import torch
from torch import nn

from .. import functional as FF
from .._limits import check_rotary_dim
from ..rope_scaling import rope_tables


class RotaryEmbedding(nn.Module):
    """Rotary position embedding applied to ``q [B, Hq, S, D]`` and ``k [B, Hkv, S, D]``.

    Holds float32 ``cos_cached`` / ``sin_cached`` tables ``[positions, rotary_dim / 2]``
    (kept in float32 when the module is moved to another dtype) built by
    :func:`fusedllm.rope_tables` with ``base`` and ``scaling`` (Hugging Face style
    dict: linear, dynamic, llama3, yarn). ``forward(q, k, position_offset=0,
    position_ids=None)`` rotates positions ``position_offset + s`` (a KV cache's
    length) or ``position_ids``; asked for positions past the tables, it rebuilds
    them at least twice as long instead of failing (dynamic NTK frequencies are
    then those of the longer context, as in transformers). ``position_ids`` on
    a GPU are not read on the host (that would wait for the GPU), so there
    they must lie within ``max_positions``: the kernel asserts it.
    """

    def __init__(self, dim: int, max_positions: int = 8192, base: float = 10000.0,
                 scaling: dict | None = None, interleaved: bool = False, rotary_dim: int | None = None,
                 device=None):
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2:
            raise ValueError(f"fusedllm.nn.RotaryEmbedding: dim must be an int >= 2, got {dim!r}")
        rotary_dim = check_rotary_dim("fusedllm.nn.RotaryEmbedding", rotary_dim, dim)
        self.dim = dim
        self.rotary_dim = rotary_dim
        self.base = float(base)
        self.scaling = dict(scaling) if scaling else None
        self.interleaved = bool(interleaved)
        cos, sin = rope_tables(rotary_dim, max_positions, self.base, self.scaling, device=device)
        self.register_buffer("cos_cached", cos, persistent=False)
        self.register_buffer("sin_cached", sin, persistent=False)

    @property
    def max_positions(self) -> int:
        return self.cos_cached.shape[0]

    _TABLES = ("cos_cached", "sin_cached")

    def _apply(self, fn, *args, **kwargs):
        # The tables follow device moves but not dtype casts: cast there and back,
        # the angles would come back rounded to the cast dtype.
        tables = {name: self._buffers[name] for name in self._TABLES}
        for name in self._TABLES:
            self._buffers[name] = None  # nn.Module._apply skips None buffers
        try:
            super()._apply(fn, *args, **kwargs)
        finally:
            self._buffers.update(tables)
        for name, table in tables.items():
            moved = fn(table)
            if moved.dtype != table.dtype:  # a cast: take only its device, from the unrounded table
                moved = table.to(moved.device)
            self._buffers[name] = moved
        if tables["cos_cached"].is_meta and not self.cos_cached.is_meta:
            # materialised from the meta device (to_empty): the tables hold no angles yet
            self.cos_cached, self.sin_cached = rope_tables(
                self.rotary_dim, self.max_positions, self.base, self.scaling, device=self.cos_cached.device)
        return self

    def _grow(self, positions_needed: int) -> None:
        length = max(positions_needed, 2 * self.max_positions)
        self.cos_cached, self.sin_cached = rope_tables(
            self.rotary_dim, length, self.base, self.scaling, device=self.cos_cached.device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, position_offset: int = 0,
                position_ids: torch.Tensor | None = None):
        if not torch.compiler.is_compiling():
            if position_ids is None:
                needed = position_offset + q.shape[2]
            elif position_ids.device.type == "cpu" and position_ids.numel():
                needed = int(position_ids.max()) + 1
            else:  # reading a GPU tensor's values would wait for the GPU: the kernel checks them
                needed = 0
            if needed > self.max_positions:
                self._grow(needed)
        return FF.apply_rope(q, k, self.cos_cached, self.sin_cached, position_ids, position_offset,
                            self.interleaved, self.rotary_dim)

    def extra_repr(self) -> str:
        text = f"dim={self.dim}, max_positions={self.max_positions}, base={self.base}"
        if self.rotary_dim != self.dim:
            text += f", rotary_dim={self.rotary_dim}"
        if self.scaling:
            text += f", scaling={self.scaling}"
        if self.interleaved:
            text += ", interleaved=True"
        return text
