"""Drop-in ``nn.Module``s built on the fused ops. Parameter names match the
modules they replace, so their state dicts load unchanged."""

from __future__ import annotations

import math

import torch
from torch import nn

import torch.nn.functional as F

from . import functional as FF
from ._limits import ACTIVATIONS, CASTINGS, check_rotary_dim
from .paged_cache import PagedKVCache  # noqa: F401  (fusedllm.nn.PagedKVCache)
from .rope_scaling import rope_tables

# Hugging Face `hidden_act` names and the gated activation they mean.
_HF_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}


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
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"fusedllm.nn.RMSNorm: dim must be a positive int, got {dim!r}")
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


class GatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` with the names of Hugging
    Face's ``LlamaMLP`` (``gate_proj``, ``up_proj``, ``down_proj``).

    Forward runs one matrix multiply for gate and up (their weights are
    concatenated at call time, so the parameters stay separate ``nn.Linear``
    modules that optimizers, state dicts and patching see unchanged), then the
    fused activation on the packed result, then ``down_proj``. For backward it
    keeps the packed projection and the gated product, less than the eager
    module, which also keeps the activation output.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 activation: str = "silu", device=None, dtype=None):
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"fusedllm.nn.{type(self).__name__}: {name} must be a positive int, got {value!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"fusedllm.nn.{type(self).__name__}: activation must be one of {ACTIVATIONS}, got {activation!r}")
        factory = {"device": device, "dtype": dtype}
        self.activation = activation
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **factory)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **factory)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, **factory)

    @classmethod
    def from_config(cls, config, device=None, dtype=None) -> "GatedMLP":
        """From a Hugging Face config (``hidden_size``, ``intermediate_size``,
        ``hidden_act`` or ``hidden_activation``, ``mlp_bias``)."""
        act_name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if act_name not in _HF_ACTIVATIONS:
            raise ValueError(
                f"fusedllm.nn.GatedMLP.from_config: activation {act_name!r} has no fused kernel; "
                f"supported: {sorted(_HF_ACTIVATIONS)}")
        return cls(config.hidden_size, config.intermediate_size,
                   bias=bool(getattr(config, "mlp_bias", False)),
                   activation=_HF_ACTIVATIONS[act_name], device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_projection(x, self.gate_proj, self.up_proj, self.activation))


class PackedGatedMLP(nn.Module):
    """``down_proj(act(gate) * up)`` where ``gate_up_proj`` produces the packed
    ``[gate | up]`` (Phi-3's MLP): the fused op reads the packed projection as
    it is, with no chunk and no copies."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu",
                 bias: bool = False, device=None, dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"fusedllm.nn.PackedGatedMLP: activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.activation = activation
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias, device=device, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(FF.swiglu(self.gate_up_proj(x), activation=self.activation))


# Below this many tokens the gate and up projections run as two matrix
# multiplies: concatenating their weights would copy more bytes than the
# products read from the activations (a decoding step), so it cannot pay off.
_PACKED_MIN_TOKENS = 32


def _own_weights(linear: nn.Linear) -> bool:
    """Whether ``linear`` is plain enough to bypass its call: no hooks (tensor
    parallelism, adapters and quantizers work through them) and plain tensors
    for parameters (not DTensors, whose shards a concatenation would mix)."""
    if linear._forward_pre_hooks or linear._forward_hooks:
        return False
    return all(type(p) in (nn.Parameter, torch.Tensor) for p in (linear.weight, linear.bias) if p is not None)


def gated_projection(x: torch.Tensor, gate: nn.Linear, up: nn.Linear, activation: str = "silu"):
    """``act(gate(x)) * up(x)`` with the fused gating. From ``_PACKED_MIN_TOKENS``
    tokens on, gate and up run as one matrix multiply on weights concatenated
    at call time (the parameters stay separate ``nn.Linear`` objects)."""
    tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if tokens < _PACKED_MIN_TOKENS or not (_own_weights(gate) and _own_weights(up)):
        return FF.swiglu(gate(x), up(x), activation=activation)
    weight = torch.cat([gate.weight, up.weight], dim=0)
    bias = None if gate.bias is None else torch.cat([gate.bias, up.bias], dim=0)
    return FF.swiglu(F.linear(x, weight, bias), activation=activation)


class SwiGLU(GatedMLP):
    """Drop-in for the SwiGLU feed-forward of the modern-transformer notebook:
    same constructor ``(input_dim, hidden_dim, bias=True)``, same parameters
    (``gate_proj``, ``up_proj``, ``down_proj``) and the same function,
    ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, input_dim: int, hidden_dim: int, bias: bool = True, device=None, dtype=None):
        super().__init__(input_dim, hidden_dim, bias=bias, activation="silu", device=device, dtype=dtype)


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


class KVCache:
    """Keys and values of one attention layer, kept across decoding steps.

    Storage is preallocated ``[batch, kv_heads, capacity, head_dim]`` for keys
    and values; ``append(k, v)`` writes the new positions after the ones held
    and returns views ``[batch, kv_heads, length, head_dim]`` of everything
    held so far, so a decoding step copies only its own keys and values
    (no concatenation of the whole past). When the storage is full it grows
    to at least twice its capacity, copying the past once.

    Batch size, kv heads, head dim, dtype and device come from the first
    ``append`` (after creation or ``reset()``); later appends must match.
    ``len(cache)`` / ``cache.length`` is the number of positions held.

    The cache is for inference: it stores values without autograd history, so
    appending tensors that require grad (decoding without ``torch.no_grad()``
    while parameters require grad) is an error rather than silently cutting
    gradients. Make one cache per layer, e.g. ``KVCache.layers(n_layers)``.

    **Sliding window.** ``KVCache(window=W, sink=s)`` keeps only what a sliding
    window of ``W`` positions needs (Mistral, the local layers of Gemma 2/3):
    the last ``W`` positions in a ring buffer, plus the first ``s`` positions
    kept for good (StreamingLLM's attention sinks), so its memory is
    ``W + s`` positions for any generation length; ``length`` still counts
    every position appended (the next position's RoPE offset). Each query at
    position ``p`` attends to keys ``j`` with ``p - W < j <= p``, and to the
    first ``s`` positions. The attention modules call :meth:`attend`, which
    runs attention over the ring where it lies (the sink positions, the
    ring's two contiguous parts and the new keys, merged by their
    log-sum-exp), then stores the new keys. ``keys`` / ``values`` and
    ``append``'s result are then the held positions in order, copied when
    the ring has wrapped.

    **int8 storage.** ``KVCache(dtype=torch.int8)`` stores keys and values as
    int8 with one float32 scale per position and kv head, quantized as they
    are stored (:func:`fusedllm.quantize_kv`, after RoPE): half the bytes of
    bfloat16, a quarter of float32. :meth:`attend` (which the attention
    modules call) runs attention on the int8 storage itself, the kernel
    reading the int8 rows tile by tile, so no float copy of the cache exists; the output
    stays within the bound :func:`fusedllm.attention` states. ``keys`` /
    ``values`` and ``append``'s result are then the int8 rows, and
    ``key_scales`` / ``value_scales`` their scales ``[batch, kv_heads, held]``.
    The new keys and values must be float32, bfloat16 or float16.
    ``dtype=torch.float8_e4m3fn`` stores float8 codes the same way (the same
    bytes as int8; see :func:`fusedllm.quantize_kv` for how their error
    differs).
    """

    def __init__(self, capacity: int = 256, window: int | None = None, sink: int = 0,
                 dtype: torch.dtype | None = None):
        owner = "fusedllm.nn.KVCache"
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"{owner}: capacity must be a positive int, got {capacity!r}")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"{owner}: window must be None or a positive int, got {window!r}")
        if isinstance(sink, bool) or not isinstance(sink, int) or sink < 0:
            raise ValueError(f"{owner}: sink must be an int >= 0, got {sink!r}")
        if sink and window is None:
            raise ValueError(f"{owner}: sink={sink} needs a window: without one every position is kept anyway")
        if dtype not in (None, torch.int8, torch.float8_e4m3fn):
            raise ValueError(f"{owner}: dtype must be None (store keys and values as given), torch.int8 or "
                             f"torch.float8_e4m3fn, got {dtype!r}")
        self._initial_capacity = capacity
        self.window, self.sink = window, sink
        self.code = dtype  # what quantized storage holds (None: keys and values as given)
        self.quantized = dtype is not None
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._k_scale: torch.Tensor | None = None  # int8 storage: [batch, kv_heads, capacity]
        self._v_scale: torch.Tensor | None = None
        self.length = 0

    @classmethod
    def layers(cls, n_layers: int, capacity: int = 256, window: int | None = None,
               sink: int = 0, dtype: torch.dtype | None = None) -> list["KVCache"]:
        """One empty cache per layer."""
        if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 0:
            raise ValueError(f"fusedllm.nn.KVCache.layers: n_layers must be an int >= 0, got {n_layers!r}")
        return [cls(capacity, window, sink, dtype) for _ in range(n_layers)]

    def __len__(self) -> int:
        return self.length

    @property
    def capacity(self) -> int:
        """Positions the current storage holds before it must grow (0 before the first append)."""
        return 0 if self._k is None else self._k.shape[2]

    @property
    def keys(self) -> torch.Tensor | None:
        """The keys held, ``[batch, kv_heads, held, head_dim]`` in position order
        (None before any append): a view, or with a window a copy once the ring
        has wrapped."""
        return None if self._k is None else self._held(self._k)

    @property
    def values(self) -> torch.Tensor | None:
        """The values held, like :attr:`keys`."""
        return None if self._v is None else self._held(self._v)

    @property
    def key_scales(self) -> torch.Tensor | None:
        """int8 storage: the scales of :attr:`keys`, ``[batch, kv_heads, held]`` (else None)."""
        return None if self._k_scale is None else self._held(self._k_scale)

    @property
    def value_scales(self) -> torch.Tensor | None:
        """int8 storage: the scales of :attr:`values` (else None)."""
        return None if self._v_scale is None else self._held(self._v_scale)

    @property
    def positions(self) -> list[int]:
        """The positions held, in the order of :attr:`keys`."""
        return [p for a, b in self._ring_parts() for p in range(a, b)]

    def _slot(self, position: int) -> int:
        """Where a held position lies in the storage."""
        if self.window is None or position < self.sink:
            return position
        return self.sink + (position - self.sink) % self.window

    def _ring_parts(self) -> list[tuple[int, int]]:
        """The held positions as contiguous runs ``(first, stop)`` whose slots are
        contiguous too: the sink positions, then the ring in at most two parts."""
        if self.window is None:
            return [(0, self.length)] if self.length else []
        sink = min(self.sink, self.length)
        parts = [(0, sink)] if sink else []
        return parts + [(p, p + n) for p, _, n in self._ring_runs(max(sink, self.length - self.window),
                                                                  self.length)]

    def _ring_runs(self, first: int, stop: int):
        """Ring positions [first, stop) (none a sink) as runs ``(position, slot,
        count)`` of contiguous slots: at most two, split where the ring wraps."""
        while first < stop:
            slot = self._slot(first)
            count = min(stop - first, self.sink + self.window - slot)
            yield first, slot, count
            first += count

    def _held(self, storage: torch.Tensor) -> torch.Tensor:
        parts = [storage[:, :, self._slot(a):self._slot(a) + (b - a)] for a, b in self._ring_parts()]
        if len(parts) == 1:
            return parts[0]
        return storage[:, :, :0] if not parts else torch.cat(parts, dim=2)

    def reset(self) -> None:
        """Forget every position. The storage is kept and reused when the next
        append has the same batch, heads, head dim, dtype and device."""
        self.length = 0

    def _check(self, k: torch.Tensor, v: torch.Tensor) -> None:
        op = "fusedllm.nn.KVCache.append"
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4:
                raise ValueError(f"{op}: {name} must be 4-D [batch, kv_heads, new_len, head_dim], "
                                 f"got shape {list(t.shape)}")
        if k.shape != v.shape:
            raise ValueError(f"{op}: k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
        if k.dtype != v.dtype or k.device != v.device:
            raise ValueError(f"{op}: k and v must share dtype and device, got {k.dtype} on {k.device} "
                             f"and {v.dtype} on {v.device}")
        if self.quantized and k.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"{op}: a {self.code} cache stores float32, bfloat16 or float16 keys and values, "
                             f"got {k.dtype}")
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            raise RuntimeError(f"{op}: k/v require grad, but the cache keeps no autograd history; "
                               f"decode under torch.no_grad() or torch.inference_mode()")
        if self.length == 0:
            return
        held = self._k
        for i, what in ((0, "batch size"), (1, "number of kv heads"), (3, "head_dim")):
            if k.shape[i] != held.shape[i]:
                raise ValueError(f"{op}: the cache holds {what} {held.shape[i]} but k has {k.shape[i]} "
                                 f"(shape {list(k.shape)}); reset() the cache to start another sequence")
        if k.dtype != held.dtype and not self.quantized:
            raise ValueError(f"{op}: the cache holds {held.dtype} but k is {k.dtype}")
        if k.device != held.device:
            raise ValueError(f"{op}: the cache is on {held.device} but k is on {k.device}")

    def _reserve(self, k: torch.Tensor, needed: int) -> None:
        if self.window is not None:  # a fixed storage: the sink positions, then the ring
            needed = self.sink + self.window
        dtype = self.code if self.quantized else k.dtype
        same = (self._k is not None and self._k.dtype == dtype and self._k.device == k.device
                and self._k.shape[0] == k.shape[0] and self._k.shape[1] == k.shape[1]
                and self._k.shape[3] == k.shape[3])
        # storage made under inference_mode cannot be written outside it: copied then
        writable = same and (torch.is_inference_mode_enabled() or not self._k.is_inference())
        if writable and needed <= self.capacity:
            return
        if self.window is not None or (same and needed <= self.capacity):
            capacity = max(needed, self.capacity if same else 0)
        elif not same:  # first append, or a reset cache reused for another shape
            capacity = max(needed, self._initial_capacity)
        else:
            capacity = max(needed, 2 * self.capacity)
        batch, heads, _, head_dim = k.shape
        kept = self.capacity if self.window is not None else self.length  # a ring: every slot
        kept = kept if same else 0

        def grown(old, shape, dtype):
            new = k.new_empty(shape, dtype=dtype)
            if kept:
                new[:, :, :kept].copy_(old[:, :, :kept])
            return new

        self._k = grown(self._k, (batch, heads, capacity, head_dim), dtype)
        self._v = grown(self._v, (batch, heads, capacity, head_dim), dtype)
        if self.quantized:
            self._k_scale = grown(self._k_scale, (batch, heads, capacity), torch.float32)
            self._v_scale = grown(self._v_scale, (batch, heads, capacity), torch.float32)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v [batch, kv_heads, new_len, head_dim]`` after the positions
        held; return all held keys and values (views, valid until the next
        append that grows the storage; see the class notes for windows)."""
        self._check(k, v)
        self._store(k, v)
        return self.keys, self.values

    def _store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        new = k.shape[2]
        end = self.length + new
        self._reserve(k, end)
        if self.window is None:
            runs = [(self.length, self.length, new)]
        else:
            # only the sink positions and the last `window` ones are kept: slice copies
            # of at most three runs (the sinks' slots are their positions)
            sinks = max(0, min(end, self.sink) - self.length)
            runs = [(self.length, self.length, sinks)] if sinks else []
            runs += self._ring_runs(max(self.length, self.sink, end - self.window), end)
        for position, slot, count in runs:
            rows = slice(position - self.length, position - self.length + count)
            slots = slice(slot, slot + count)
            if self.quantized:
                FF.quantize_kv(k[:, :, rows], self._k[:, :, slots], self._k_scale[:, :, slots])
                FF.quantize_kv(v[:, :, rows], self._v[:, :, slots], self._v_scale[:, :, slots])
            else:
                self._k[:, :, slots].copy_(k[:, :, rows])
                self._v[:, :, slots].copy_(v[:, :, rows])
        self.length = end

    def _scales(self, slots: slice | None = None) -> dict:
        """The k_scale / v_scale arguments of attention over storage slots (int8 storage)."""
        if not self.quantized:
            return {}
        if slots is None:
            return dict(k_scale=self.key_scales, v_scale=self.value_scales)
        return dict(k_scale=self._k_scale[:, :, slots], v_scale=self._v_scale[:, :, slots])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
               dropout_p: float = 0.0, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of ``q [batch, q_heads, new_len, head_dim]`` (positions
        ``length .. length + new_len - 1``) over the held keys and the new ``k, v``,
        then ``k, v`` stored: what :class:`GQAttention` and :class:`ParallelBlock`
        run with a cache. ``window`` (the module's sliding window) may be at most
        the cache's. Without a cache window this is ``append`` then attention
        (over the int8 storage itself with ``dtype=torch.int8``), with ``mask``
        over ``[new_len, length]`` if given; a cache window takes no mask."""
        op = "fusedllm.nn.KVCache.attend"
        self._check(k, v)
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
            raise ValueError(f"{op}: q must be [batch, q_heads, new_len, head_dim] with k's batch and new_len "
                             f"(the queries are the new positions), got q {list(getattr(q, 'shape', []))} "
                             f"and k {list(k.shape)}")
        if window is not None and self.window is not None and window > self.window:
            raise ValueError(f"{op}: the layer's window ({window}) is wider than the cache's "
                             f"({self.window}), which does not keep the keys it needs")
        if self.window is None:
            self._store(k, v)
            return FF.attention(q, self.keys, self.values, causal=True, window=window, mask=mask,
                                dropout_p=dropout_p, **self._scales())
        if mask is not None:
            raise ValueError(f"{op}: mask cannot be combined with a KVCache with a window (its keys are a "
                             f"ring, not the sequence the mask would index)")
        w = self.window if window is None else window
        start, new = self.length, k.shape[2]
        if new == 1 and w == self.window:
            # One token: it lands in the slot of the one position leaving the
            # window, after which the storage holds exactly what it sees, in
            # some order; softmax does not care, so one call, no mask.
            self._store(k, v)
            held = min(self.length, self.sink + self.window)
            return FF.attention(q, self._k[:, :, :held], self._v[:, :, :held], dropout_p=dropout_p,
                                **self._scales(slice(0, held)))
        dev = q.device
        q_pos = torch.arange(start, start + new, device=dev)[:, None]
        pieces = []  # (out, lse) of each key set
        for a, b in self._ring_parts():
            if a >= self.sink:  # ring keys: visible within the window only
                first = max(a, start - w + 1) if new == 1 else a
                if first >= b:
                    continue
            else:
                first = a
            slots = slice(self._slot(first), self._slot(first) + (b - first))
            mask = None
            if a >= self.sink and new > 1 and first <= start + new - 1 - w:
                mask = torch.arange(first, b, device=dev)[None, :] > q_pos - w
            pieces.append(FF._attention_with_lse(q, self._k[:, :, slots], self._v[:, :, slots], mask=mask,
                                                 dropout_p=dropout_p, **self._scales(slots)))
        new_kv = dict(k=k, v=v)
        if self.quantized:  # the new keys as they will be stored
            (k8, k_scale), (v8, v_scale) = FF.quantize_kv(k, dtype=self.code), FF.quantize_kv(v, dtype=self.code)
            new_kv = dict(k=k8, v=v8, k_scale=k_scale, v_scale=v_scale)
        if start < self.sink and new > w:
            # sink positions among the new keys stay visible past the window
            k_pos = torch.arange(start, start + new, device=dev)[None, :]
            mask = (k_pos <= q_pos) & ((k_pos > q_pos - w) | (k_pos < self.sink))
            pieces.append(FF._attention_with_lse(q, mask=mask, dropout_p=dropout_p, **new_kv))
        else:
            pieces.append(FF._attention_with_lse(q, causal=True, window=w, dropout_p=dropout_p, **new_kv))
        self._store(k, v)
        return FF._merge_attention(pieces, q.dtype)

    def __repr__(self) -> str:
        bounds = "" if self.window is None else f", window={self.window}, sink={self.sink}"
        bounds += f", quantized to {self.code}" if self.quantized else ""
        if self._k is None:
            return f"KVCache(length=0, capacity=0{bounds})"
        b, h, _, d = self._k.shape
        return (f"KVCache(length={self.length}, capacity={self.capacity}{bounds}, batch={b}, kv_heads={h}, "
                f"head_dim={d}, dtype={self._k.dtype}, device={self._k.device})")


def _positive_int(owner: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")
    return value


def _head_layout(owner: str, d_model, n_heads, n_kv_heads, head_dim) -> tuple[int, int]:
    """Checked ``(n_kv_heads, head_dim)``; by default ``n_heads`` and ``d_model // n_heads``."""
    _positive_int(owner, "d_model", d_model)
    _positive_int(owner, "n_heads", n_heads)
    n_kv_heads = n_heads if n_kv_heads is None else _positive_int(owner, "n_kv_heads", n_kv_heads)
    if n_heads % n_kv_heads:
        raise ValueError(f"{owner}: n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
    if head_dim is None:
        if d_model % n_heads:
            raise ValueError(f"{owner}: d_model ({d_model}) must be divisible by n_heads ({n_heads}), "
                             f"or pass head_dim")
        head_dim = d_model // n_heads
    _positive_int(owner, "head_dim", head_dim)
    return n_kv_heads, head_dim


def _attention_options(owner: str, dropout, window) -> float:
    """Checks the attention dropout probability and window; returns the dropout as a float."""
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"{owner}: dropout must be a number in [0, 1), got {dropout!r}")
    if window is not None:
        _positive_int(owner, "window", window)
    return float(dropout)


def _attention_repr(m, middle: str = "") -> str:
    """extra_repr of an attention module: heads, ``middle``, then window and dropout if set."""
    text = f"d_model={m.d_model}, n_heads={m.n_heads}, n_kv_heads={m.n_kv_heads}, head_dim={m.head_dim}"
    if middle:
        text += ", " + middle
    if m.window is not None:
        text += f", window={m.window}"
    if m.dropout:
        text += f", dropout={m.dropout}"
    return text


def _attends_in_cache(owner: str, cache, return_weights: bool) -> bool:
    """Whether a module runs attention through ``cache.attend`` (which refuses
    a mask with a window): a cache with a window (a ring, not one [kv_len]
    sequence the weights could index) or with int8 storage (read by the
    kernel, never as float weights)."""
    if cache is None or (cache.window is None and not cache.quantized):
        return False
    if return_weights:
        raise ValueError(f"{owner}: return_weights=True needs a KVCache without a window or int8 storage")
    return True


def _sequence_input(owner: str, x, d_model: int, cache, position_offset) -> int:
    """Checks ``x [batch, seq, d_model]``, the cache and ``position_offset``;
    returns the offset (by default the cache's length, else 0)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != d_model:
        shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{owner}: x must be [batch, seq, d_model={d_model}], got {shape}")
    if cache is not None and not isinstance(cache, KVCache):
        raise ValueError(f"{owner}: cache must be a fusedllm.nn.KVCache, got {type(cache).__name__}")
    if position_offset is None:
        return cache.length if cache is not None else 0
    if isinstance(position_offset, bool) or not isinstance(position_offset, int) or position_offset < 0:
        raise ValueError(f"{owner}: position_offset must be an int >= 0, got {position_offset!r}")
    return position_offset


class GQAttention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings, on the fused
    ``rope`` and ``attention`` ops.

    Parameters ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (``nn.Linear``,
    named as in Hugging Face's ``LlamaAttention``); ``n_kv_heads`` (default
    ``n_heads``) must divide ``n_heads``; ``head_dim`` defaults to
    ``d_model // n_heads``. ``rope=True`` rotates q and k with a
    :class:`RotaryEmbedding` (``rotary``, base ``rope_base``, tables for
    ``max_positions`` that grow on demand). ``window=w`` is a sliding window
    (Mistral / HF ``sliding_window``: a query sees its last ``w`` keys, itself
    included). ``dropout`` drops attention probabilities in training mode only.

    ``forward(x, mask=None, position_offset=None, cache=None, return_weights=False)``:

    - ``x`` is ``[batch, seq, d_model]``; the result has the same shape.
    - Attention is always causal. ``mask`` adds to that: a bool keep-mask (True
      attends) or an additive float mask, broadcastable to
      ``[batch, n_heads, seq, kv_len]`` (e.g. a padding mask ``[batch, 1, 1, kv_len]``).
    - With ``cache`` (a :class:`KVCache`), the new keys and values are appended
      to it and the queries attend to every cached position; the queries are
      the last ``seq`` positions (causality is aligned bottom-right), and RoPE
      positions start at ``position_offset``, by default the cache's length
      before the call (0 without a cache).
    - ``return_weights=True`` returns ``(out, weights)`` with the attention
      probabilities ``[batch, n_heads, seq, kv_len]`` (after dropout in
      training mode: what multiplied the values) from
      :func:`fusedllm.functional.attention_with_weights`, a plain PyTorch path
      that builds the whole score matrix: slow and memory hungry, for
      inspection and plots. Queries that see no key have zero weights and
      outputs, as in the fused op.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None,
                 head_dim: int | None = None, bias: bool = False, rope: bool = True,
                 rope_base: float = 10000.0, max_positions: int = 8192, dropout: float = 0.0,
                 window: int | None = None, device=None, dtype=None):
        super().__init__()
        owner = "fusedllm.nn.GQAttention"
        n_kv_heads, head_dim = _head_layout(owner, d_model, n_heads, n_kv_heads, head_dim)
        if rope and head_dim % 2:
            raise ValueError(f"{owner}: rope=True needs an even head_dim, got {head_dim}")
        self.dropout = _attention_options(owner, dropout, window)
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = d_model, n_heads, n_kv_heads, head_dim
        self.window = window
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias, **factory)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=bias, **factory)
        self.rotary = (RotaryEmbedding(head_dim, max_positions=max_positions, base=rope_base, device=device)
                       if rope else None)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, position_offset: int | None = None,
                cache: KVCache | None = None, return_weights: bool = False):
        position_offset = _sequence_input("fusedllm.nn.GQAttention", x, self.d_model, cache, position_offset)
        batch, seq, _ = x.shape
        # [B, S, H*D] -> [B, H, S, D] as strided views: rope and attention read strides
        q = self.q_proj(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.rotary is not None:
            q, k = self.rotary(q, k, position_offset=position_offset)
        dropout_p = self.dropout if self.training else 0.0
        weights = None
        if _attends_in_cache("fusedllm.nn.GQAttention", cache, return_weights):
            out = cache.attend(q, k, v, window=self.window, dropout_p=dropout_p, mask=mask)
            return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim))
        if cache is not None:
            k, v = cache.append(k, v)
        if return_weights:
            out, weights = FF.attention_with_weights(q, k, v, causal=True, window=self.window, mask=mask,
                                                    dropout_p=dropout_p)
        else:
            out = FF.attention(q, k, v, causal=True, window=self.window, mask=mask, dropout_p=dropout_p)
        out = self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim))
        return (out, weights) if return_weights else out

    def extra_repr(self) -> str:
        return _attention_repr(self)


# --- parallel attention + feed-forward block ------------------------------------------------

_PARALLEL_NORMS = ("rms", "layer")
# the separate projections a ParallelBlock's two weights hold, in their order
_IN_PARTS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_OUT_PARTS = ("o_proj", "down_proj")


class ParallelBlock(nn.Module):
    """A pre-norm decoder block with attention and the gated feed-forward in
    parallel (PaLM, GPT-J): ``x + attn(norm(x)) + mlp(norm(x))``, fused.

    One matrix multiply produces q, k, v, gate and up together from the
    normalized input (``in_proj_weight`` is the row concatenation of the five
    projections' weights); q and k are rotated and attention runs on the
    fused ops, reading q, k and v as strided views of that product; the gated
    activation reads the ``[gate | up]`` slice in place. The output
    projection is one weight, ``out_proj_weight``, the column concatenation
    ``[o_proj | down_proj]``, applied to ``[attention output | gated hidden]``
    with the residual added in the same call (``addmm``), split along its
    inner dimension into two accumulating ``addmm`` calls so the two inputs
    are never copied into one tensor (at 4096 tokens, d_model 1024, that copy
    took the forward's peak memory from 172 to 268 MiB). Forward and backward.

    ``norm="rms"`` is :class:`RMSNorm`; ``norm="layer"`` is torch's
    ``nn.LayerNorm`` (with a bias when ``bias=True``). ``activation`` is
    ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU). ``n_kv_heads`` (default
    ``n_heads``) must divide ``n_heads``; ``head_dim`` defaults to
    ``d_model // n_heads``. ``rope=True`` rotates q and k with a
    :class:`RotaryEmbedding` (``rope_base``, ``rope_scaling``,
    ``rope_interleaved`` for GPT-J's pairing, ``rotary_dim`` for a partial
    rotation); ``window`` is a sliding window and ``dropout`` drops attention
    probabilities in training mode, as in :class:`GQAttention`.

    The state dict holds the separate projections, ``q_proj.weight``,
    ``k_proj.weight``, ``v_proj.weight``, ``gate_proj.weight``,
    ``up_proj.weight``, ``o_proj.weight``, ``down_proj.weight`` (and
    ``.bias`` with ``bias=True``) beside ``norm.weight``, so it loads from and
    into models that store them apart; ``load_state_dict`` also takes the
    fused names (``in_proj_weight`` ...). :meth:`from_sequential` builds one
    from a :class:`GQAttention` and a :class:`GatedMLP`. :meth:`projections`
    gives the five input and two output weights as views.

    ``forward(x, mask=None, position_offset=None, cache=None)`` takes and
    returns ``[batch, seq, d_model]``; ``mask``, ``cache`` (a
    :class:`KVCache`) and ``position_offset`` mean what they mean in
    :meth:`GQAttention.forward`.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None,
                 intermediate_size: int | None = None, norm: str = "rms", activation: str = "silu",
                 bias: bool = False, rope: bool = True, window: int | None = None, *,
                 head_dim: int | None = None, eps: float = 1e-6, dropout: float = 0.0,
                 rope_base: float = 10000.0, rope_scaling: dict | None = None,
                 rope_interleaved: bool = False, rotary_dim: int | None = None,
                 max_positions: int = 8192, device=None, dtype=None):
        super().__init__()
        owner = "fusedllm.nn.ParallelBlock"
        n_kv_heads, head_dim = _head_layout(owner, d_model, n_heads, n_kv_heads, head_dim)
        if intermediate_size is None:
            raise ValueError(f"{owner}: intermediate_size must be given (the gated hidden width)")
        _positive_int(owner, "intermediate_size", intermediate_size)
        if norm not in _PARALLEL_NORMS:
            raise ValueError(f"{owner}: norm must be one of {_PARALLEL_NORMS}, got {norm!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"{owner}: activation must be one of {ACTIVATIONS}, got {activation!r}")
        if not isinstance(bias, bool):
            raise ValueError(f"{owner}: bias must be True or False, got {bias!r}")
        if not isinstance(rope, bool):
            raise ValueError(f"{owner}: rope must be True or False, got {rope!r}")
        if rope:
            if rotary_dim is None and head_dim % 2:
                raise ValueError(f"{owner}: rope=True needs an even head_dim, got {head_dim}")
            check_rotary_dim(owner, rotary_dim, head_dim)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
            raise ValueError(f"{owner}: eps must be a number >= 0, got {eps!r}")
        dropout = _attention_options(owner, dropout, window)
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = d_model, n_heads, n_kv_heads, head_dim
        self.intermediate_size = intermediate_size
        self.norm_kind, self.activation, self.window, self.dropout = norm, activation, window, dropout
        self.eps = float(eps)
        q_dim, kv_dim, f = n_heads * head_dim, n_kv_heads * head_dim, intermediate_size
        # rows of in_proj_weight, columns of out_proj_weight, per separate projection
        self._in_sizes = (q_dim, kv_dim, kv_dim, f, f)
        self._out_sizes = (q_dim, f)
        factory = {"device": device, "dtype": dtype}
        if norm == "rms":
            self.norm = RMSNorm(d_model, eps=self.eps, **factory)
        else:
            self.norm = nn.LayerNorm(d_model, eps=self.eps, bias=bias, **factory)
        self.in_proj_weight = nn.Parameter(torch.empty(sum(self._in_sizes), d_model, **factory))
        self.out_proj_weight = nn.Parameter(torch.empty(d_model, sum(self._out_sizes), **factory))
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(sum(self._in_sizes), **factory))
            # one row per output projection: o_proj's bias and down_proj's
            self.out_proj_bias = nn.Parameter(torch.empty(2, d_model, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
            self.register_parameter("out_proj_bias", None)
        self.rotary = (RotaryEmbedding(head_dim, max_positions=max_positions, base=rope_base,
                                       scaling=rope_scaling, interleaved=rope_interleaved,
                                       rotary_dim=rotary_dim, device=device) if rope else None)
        self.reset_parameters()
        self.register_state_dict_post_hook(ParallelBlock._split_state_dict)
        self.register_load_state_dict_pre_hook(ParallelBlock._join_state_dict)

    def reset_parameters(self) -> None:
        """Each slice initialised as the ``nn.Linear`` it stands for."""
        if self.in_proj_weight.is_meta:
            return
        with torch.no_grad():
            views = self.projections()
            for name in (*_IN_PARTS, *_OUT_PARTS):
                weight = views[name + ".weight"]
                bound = 1.0 / weight.shape[1] ** 0.5  # kaiming_uniform(a=sqrt(5)) of nn.Linear
                weight.uniform_(-bound, bound)
                if name + ".bias" in views:
                    views[name + ".bias"].uniform_(-bound, bound)

    # --- the separate projections -------------------------------------------------------

    def projections(self) -> dict:
        """Views of ``in_proj_weight`` / ``out_proj_weight`` (and the biases) as
        the separate projections: ``{"q_proj.weight": ..., "down_proj.bias": ...}``.
        Writing into a view writes the block's parameter."""
        views = {}
        for name, part in zip(_IN_PARTS, self.in_proj_weight.split(self._in_sizes, 0)):
            views[name + ".weight"] = part
        for name, part in zip(_OUT_PARTS, self.out_proj_weight.split(self._out_sizes, 1)):
            views[name + ".weight"] = part
        if self.in_proj_bias is not None:
            for name, part in zip(_IN_PARTS, self.in_proj_bias.split(self._in_sizes, 0)):
                views[name + ".bias"] = part
            views["o_proj.bias"], views["down_proj.bias"] = self.out_proj_bias.unbind(0)
        return views

    @staticmethod
    def _split_state_dict(module, state_dict, prefix, local_metadata):
        for fused in ("in_proj_weight", "out_proj_weight", "in_proj_bias", "out_proj_bias"):
            state_dict.pop(prefix + fused, None)
        for name, view in module.projections().items():
            # separate tensors (a checkpoint of them loads anywhere, safetensors included)
            state_dict[prefix + name] = view.detach().clone(memory_format=torch.contiguous_format)

    @staticmethod
    def _join_state_dict(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                         error_msgs):
        """Separate projections in ``state_dict`` become the fused entries."""
        has_bias = module.in_proj_bias is not None
        groups = [("in_proj_weight", _IN_PARTS, "weight", 0), ("out_proj_weight", _OUT_PARTS, "weight", 1)]
        if has_bias:
            groups += [("in_proj_bias", _IN_PARTS, "bias", 0), ("out_proj_bias", _OUT_PARTS, "bias", None)]
        for fused, parts, kind, dim in groups:
            keys = [f"{prefix}{name}.{kind}" for name in parts]
            present = [k for k in keys if k in state_dict]
            if not present or prefix + fused in state_dict:
                continue  # the fused name is used, or nothing is there: load_state_dict reports it
            if len(present) != len(keys):
                error_msgs.append(f"fusedllm.nn.ParallelBlock: {fused} needs all of "
                                  f"{[k[len(prefix):] for k in keys]}; missing "
                                  f"{[k[len(prefix):] for k in keys if k not in state_dict]}")
                for k in present:
                    state_dict.pop(k)
                continue
            tensors = [state_dict.pop(k) for k in keys]
            expected = module.projections()
            for key, tensor in zip(keys, tensors):
                want = expected[key[len(prefix):]].shape
                if tuple(tensor.shape) != tuple(want):
                    error_msgs.append(f"fusedllm.nn.ParallelBlock: {key} has shape {list(tensor.shape)}, "
                                      f"this block needs {list(want)}")
                    break
            else:
                state_dict[prefix + fused] = torch.stack(tensors) if dim is None else torch.cat(tensors, dim)
        if not has_bias:
            stray = [f"{prefix}{name}.bias" for name in (*_IN_PARTS, *_OUT_PARTS) if f"{prefix}{name}.bias" in state_dict]
            if stray:
                error_msgs.append(f"fusedllm.nn.ParallelBlock: the state dict has biases ({stray[0][len(prefix):]}, ...) "
                                  f"but this block was built with bias=False")
                for k in stray:
                    state_dict.pop(k)

    @classmethod
    def from_sequential(cls, attention: "GQAttention", mlp: "GatedMLP", norm: nn.Module | None = None,
                        **kwargs) -> "ParallelBlock":
        """A block computing ``x + attention(norm(x)) + mlp(norm(x))`` with copies
        of the weights of a :class:`GQAttention`, a :class:`GatedMLP` and a norm
        (:class:`RMSNorm` or ``nn.LayerNorm``; default a new RMSNorm). Options
        not taken from the modules (``rope_base`` ...) go in ``kwargs``."""
        owner = "fusedllm.nn.ParallelBlock.from_sequential"
        if not isinstance(attention, GQAttention):
            raise ValueError(f"{owner}: attention must be a fusedllm.nn.GQAttention, got {type(attention).__name__}")
        if not isinstance(mlp, GatedMLP):
            raise ValueError(f"{owner}: mlp must be a fusedllm.nn.GatedMLP, got {type(mlp).__name__}")
        if mlp.gate_proj.in_features != attention.d_model:
            raise ValueError(f"{owner}: mlp takes {mlp.gate_proj.in_features} features but attention's "
                             f"d_model is {attention.d_model}")
        bias = attention.q_proj.bias is not None
        if (mlp.gate_proj.bias is not None) != bias:
            raise ValueError(f"{owner}: attention and mlp must both have biases or both have none")
        if norm is not None and not isinstance(norm, (RMSNorm, nn.LayerNorm)):
            raise ValueError(f"{owner}: norm must be a fusedllm.nn.RMSNorm or nn.LayerNorm, got {type(norm).__name__}")
        if isinstance(norm, RMSNorm) and (norm.offset or norm.casting != "llama" or norm.weight is None):
            raise ValueError(f"{owner}: norm must be a plain RMSNorm (offset 0, llama casting, with a weight)")
        kind = "layer" if isinstance(norm, nn.LayerNorm) else "rms"
        if norm is not None:
            kwargs.setdefault("eps", norm.eps)
        rotary = attention.rotary
        if rotary is not None:
            kwargs.setdefault("rope_base", rotary.base)
            kwargs.setdefault("rope_scaling", rotary.scaling)
            kwargs.setdefault("rope_interleaved", rotary.interleaved)
            kwargs.setdefault("rotary_dim", rotary.rotary_dim)
        weight = attention.q_proj.weight
        block = cls(attention.d_model, attention.n_heads, attention.n_kv_heads, mlp.gate_proj.out_features,
                    norm=kind, activation=mlp.activation, bias=bias, rope=rotary is not None,
                    window=attention.window, head_dim=attention.head_dim, dropout=attention.dropout,
                    device=weight.device, dtype=weight.dtype, **kwargs)
        state = {f"{name}.{kind_}": getattr(getattr(module, name), kind_)
                 for module, names in ((attention, ("q_proj", "k_proj", "v_proj", "o_proj")),
                                       (mlp, ("gate_proj", "up_proj", "down_proj")))
                 for name in names for kind_ in (("weight", "bias") if bias else ("weight",))}
        state.update({f"norm.{k}": v for k, v in (norm or block.norm).state_dict().items()})
        block.load_state_dict({k: v.detach() for k, v in state.items()})
        return block

    # --- forward ---------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, position_offset: int | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        owner = "fusedllm.nn.ParallelBlock"
        position_offset = _sequence_input(owner, x, self.d_model, cache, position_offset)
        weight = self.in_proj_weight
        if x.dtype != weight.dtype or x.device != weight.device:
            raise ValueError(f"{owner}: x is {x.dtype} on {x.device} but the block's parameters are "
                             f"{weight.dtype} on {weight.device}; move one to the other (block.to(...))")
        if mask is not None and not isinstance(mask, torch.Tensor):
            raise ValueError(f"{owner}: mask must be a torch.Tensor or None, got {type(mask).__name__}")
        batch, seq, _ = x.shape
        heads, kv_heads, d = self.n_heads, self.n_kv_heads, self.head_dim
        q_dim, kv_dim, _, f, _ = self._in_sizes
        # one GEMM: [q | k | v | gate | up]; every piece below is a strided view of it.
        # split (not four slices): its backward writes the four gradients into one
        # tensor with one cat, where slices would each fill a zero tensor of the
        # whole projection's size and add them up.
        proj = F.linear(self.norm(x), self.in_proj_weight, self.in_proj_bias)
        q, k, v, gate_up = proj.split((q_dim, kv_dim, kv_dim, 2 * f), dim=-1)
        q = q.view(batch, seq, heads, d).transpose(1, 2)
        k = k.view(batch, seq, kv_heads, d).transpose(1, 2)
        v = v.view(batch, seq, kv_heads, d).transpose(1, 2)
        if self.rotary is not None:
            q, k = self.rotary(q, k, position_offset=position_offset)
        dropout_p = self.dropout if self.training else 0.0
        if _attends_in_cache(owner, cache, False):
            attn = cache.attend(q, k, v, window=self.window, dropout_p=dropout_p, mask=mask)
        else:
            if cache is not None:
                k, v = cache.append(k, v)
            attn = FF.attention(q, k, v, causal=True, window=self.window, mask=mask, dropout_p=dropout_p)
        del q, k, v
        hidden = FF.swiglu(gate_up, activation=self.activation)
        del gate_up, proj  # without autograd the projection's memory is free from here
        # The output projection [o_proj | down_proj] as one addmm over the K split:
        # attention's columns, then the hidden's accumulated onto them, the
        # residual added by the first. The same products as one GEMM over
        # [attention | hidden], without copying the two into one tensor.
        residual = x.reshape(batch * seq, self.d_model)
        if self.out_proj_bias is not None:
            residual = residual + self.out_proj_bias.sum(0)
        w_o, w_down = self.out_proj_weight.split(self._out_sizes, dim=1)
        out = torch.addmm(residual, attn.transpose(1, 2).reshape(batch * seq, q_dim), w_o.t())
        out = torch.addmm(out, hidden.view(batch * seq, f), w_down.t())
        return out.view(batch, seq, self.d_model)

    def extra_repr(self) -> str:
        return _attention_repr(self, f"intermediate_size={self.intermediate_size}, norm='{self.norm_kind}', "
                                     f"activation='{self.activation}', bias={self.in_proj_bias is not None}")


_MOE_SCORINGS = ("softmax", "sigmoid")


class MoERouter(nn.Module):
    """The router of :class:`MoE`: ``weight [num_experts, hidden_size]`` (and the
    ``e_score_correction_bias`` buffer with ``correction_bias=True``), named as
    in transformers' router modules. ``forward(x)`` gives the router logits."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        if correction_bias:
            self.e_score_correction_bias = nn.Buffer(torch.zeros(num_experts, device=device, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MoEExperts(nn.Module):
    """The routed experts of :class:`MoE` as transformers stores them:
    ``gate_up_proj [num_experts, 2 * intermediate, hidden]`` (rows ``[gate |
    up]``) and ``down_proj [num_experts, hidden, intermediate]``.
    ``forward(x, indices, weights)`` is :func:`fusedllm.moe_experts`."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, activation: str = "silu",
                 device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.activation = activation
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, **factory))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **factory))

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return FF.moe_experts(x, indices, weights, self.gate_up_proj, self.down_proj, self.activation)


class MoE(nn.Module):
    """A sparse mixture-of-experts feed-forward layer (Mixtral, Qwen2/3-MoE,
    OLMoE, DeepSeek-V3) on :func:`fusedllm.moe_route` and
    :func:`fusedllm.moe_experts`.

    Each token's router logits ``gate(x)`` choose ``top_k`` of ``num_experts``
    gated MLPs (``act(gate) * up``, ``activation`` ``"silu"`` or
    ``"gelu_tanh"``); the output is their sum weighted by the router's
    scores. ``scoring`` ``"softmax"`` (over all experts) or ``"sigmoid"``
    (DeepSeek-V3); ``normalize`` divides the chosen scores by their sum
    (Mixtral always, ``norm_topk_prob`` elsewhere); ``scaling`` multiplies
    them (``routed_scaling_factor``); ``num_groups`` / ``top_groups`` restrict
    the choice to the best groups of experts and ``correction_bias=True`` adds
    the ``gate.e_score_correction_bias`` buffer to the scores for choosing
    only (both DeepSeek-V3). The routing weights stay float32 (float64 for
    float64 inputs) into the experts, as Mixtral's do; Qwen's and OLMoE's
    routers round them to the model dtype first, which only matters in half
    precision.

    ``shared_intermediate_size`` adds a shared expert every token goes
    through (a :class:`GatedMLP` of that width, stored as ``shared_name``:
    ``"shared_expert"`` as in Qwen2-MoE, ``"shared_experts"`` as in
    DeepSeek-V3); ``shared_gate=True`` scales it per token by
    ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE).

    Parameters are named as transformers 5 names them, so the state dict of
    a Hugging Face sparse MoE block loads unchanged: ``gate.weight``
    ``[num_experts, hidden]``, ``experts.gate_up_proj``
    ``[num_experts, 2 * intermediate, hidden]``, ``experts.down_proj``
    ``[num_experts, hidden, intermediate]`` (and ``gate.e_score_correction_bias``,
    ``shared_expert.*``, ``shared_expert_gate.weight``). :meth:`from_config`
    builds the layer a Hugging Face config describes.

    ``forward(x)`` takes ``[..., hidden_size]`` and returns the same shape.
    ``forward(x, return_router_logits=True)`` returns ``(out, router_logits,
    indices)``, the logits ``[tokens, num_experts]`` and chosen experts
    ``[tokens, top_k]`` (tokens = x's leading dims flattened), which is what
    :func:`fusedllm.moe_load_balancing_loss` takes for the auxiliary loss.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 activation: str = "silu", normalize: bool = True, scoring: str = "softmax",
                 num_groups: int = 1, top_groups: int | None = None, scaling: float = 1.0,
                 correction_bias: bool = False, *, shared_intermediate_size: int | None = None,
                 shared_gate: bool = False, shared_name: str = "shared_expert", device=None, dtype=None):
        super().__init__()
        owner = "fusedllm.nn.MoE"
        _positive_int(owner, "hidden_size", hidden_size)
        _positive_int(owner, "intermediate_size", intermediate_size)
        _positive_int(owner, "num_experts", num_experts)
        _positive_int(owner, "top_k", top_k)
        if top_k > num_experts:
            raise ValueError(f"{owner}: top_k ({top_k}) must be at most num_experts ({num_experts})")
        if activation not in ACTIVATIONS:
            raise ValueError(f"{owner}: activation must be one of {ACTIVATIONS}, got {activation!r}")
        if scoring not in _MOE_SCORINGS:
            raise ValueError(f"{owner}: scoring must be one of {_MOE_SCORINGS}, got {scoring!r}")
        for name, value in (("normalize", normalize), ("correction_bias", correction_bias),
                            ("shared_gate", shared_gate)):
            if not isinstance(value, bool):
                raise ValueError(f"{owner}: {name} must be True or False, got {value!r}")
        _positive_int(owner, "num_groups", num_groups)
        if num_experts % num_groups:
            raise ValueError(f"{owner}: num_groups ({num_groups}) must divide num_experts ({num_experts})")
        top_groups = num_groups if top_groups is None else _positive_int(owner, "top_groups", top_groups)
        if top_groups > num_groups:
            raise ValueError(f"{owner}: top_groups ({top_groups}) must be at most num_groups ({num_groups})")
        if top_k > top_groups * (num_experts // num_groups):
            raise ValueError(f"{owner}: top_k ({top_k}) is more than the {top_groups * (num_experts // num_groups)} "
                             f"experts of the top_groups={top_groups} groups kept")
        if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling):
            raise ValueError(f"{owner}: scaling must be a finite number, got {scaling!r}")
        if shared_intermediate_size is not None:
            _positive_int(owner, "shared_intermediate_size", shared_intermediate_size)
        elif shared_gate:
            raise ValueError(f"{owner}: shared_gate=True needs a shared expert (shared_intermediate_size)")
        if not isinstance(shared_name, str) or not shared_name.isidentifier() or \
                shared_name in ("gate", "experts", "shared_expert_gate"):
            raise ValueError(f"{owner}: shared_name must be an identifier other than gate, experts and "
                             f"shared_expert_gate, got {shared_name!r}")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.activation, self.normalize, self.scoring = activation, normalize, scoring
        self.num_groups, self.top_groups, self.scaling = num_groups, top_groups, float(scaling)
        self.shared_intermediate_size, self.shared_name = shared_intermediate_size, shared_name
        factory = {"device": device, "dtype": dtype}
        self.gate = MoERouter(hidden_size, num_experts, correction_bias, **factory)
        self.experts = MoEExperts(hidden_size, intermediate_size, num_experts, activation, **factory)
        self.shared_expert_gate = None
        if shared_intermediate_size is not None:
            setattr(self, shared_name, GatedMLP(hidden_size, shared_intermediate_size, activation=activation,
                                                **factory))
            if shared_gate:
                self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False, **factory)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Router and expert weights uniform in ``±1/sqrt(fan_in)``, as
        ``nn.Linear`` starts its weights; the correction bias at zero."""
        bound_h, bound_i = self.hidden_size ** -0.5, self.intermediate_size ** -0.5
        with torch.no_grad():
            self.gate.weight.uniform_(-bound_h, bound_h)
            self.experts.gate_up_proj.uniform_(-bound_h, bound_h)
            self.experts.down_proj.uniform_(-bound_i, bound_i)
            if self.gate.e_score_correction_bias is not None:
                self.gate.e_score_correction_bias.zero_()
        shared = self.shared
        if shared is not None:
            for lin in (shared.gate_proj, shared.up_proj, shared.down_proj):
                lin.reset_parameters()
        if self.shared_expert_gate is not None:
            self.shared_expert_gate.reset_parameters()

    @property
    def shared(self) -> "GatedMLP | None":
        """The shared expert, or None."""
        return None if self.shared_intermediate_size is None else getattr(self, self.shared_name)

    @classmethod
    def from_config(cls, config, device=None, dtype=None) -> "MoE":
        """The sparse MoE block a Hugging Face config describes: Mixtral
        (``num_local_experts``, ``intermediate_size``, always normalized),
        Qwen2-MoE (``moe_intermediate_size``, ``norm_topk_prob``, the shared
        expert of ``shared_expert_intermediate_size`` and its sigmoid gate),
        Qwen3-MoE (``moe_intermediate_size``), OLMoE (``intermediate_size``),
        DeepSeek-V3 (sigmoid scores, ``n_group`` / ``topk_group``,
        ``routed_scaling_factor``, the correction bias, ``n_shared_experts``
        shared experts). Other model types, and settings these layers have
        no kernel for, are a ValueError."""
        owner = "fusedllm.nn.MoE.from_config"
        model_type = getattr(config, "model_type", None)
        if model_type not in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"):
            raise ValueError(f"{owner}: model type {model_type!r} is not one of mixtral, qwen2_moe, qwen3_moe, "
                             f"olmoe, deepseek_v3")
        act_name = getattr(config, "hidden_act", "silu")
        if act_name not in _HF_ACTIVATIONS:
            raise ValueError(f"{owner}: activation {act_name!r} has no fused kernel; supported: "
                             f"{sorted(_HF_ACTIVATIONS)}")
        common = {"activation": _HF_ACTIVATIONS[act_name], "device": device, "dtype": dtype}
        top_k = config.num_experts_per_tok
        if model_type == "mixtral":
            return cls(config.hidden_size, config.intermediate_size, config.num_local_experts, top_k,
                       normalize=True, **common)
        if model_type in ("qwen2_moe", "qwen3_moe", "olmoe"):  # OLMoE's experts are intermediate_size wide
            inter = config.intermediate_size if model_type == "olmoe" else config.moe_intermediate_size
            shared = {}
            if model_type == "qwen2_moe":
                size = getattr(config, "shared_expert_intermediate_size", 0) or 0
                if size <= 0:
                    raise ValueError(f"{owner}: a Qwen2-MoE block always has a shared expert; "
                                     f"shared_expert_intermediate_size is {size!r}")
                shared = {"shared_intermediate_size": size, "shared_gate": True}
            return cls(config.hidden_size, inter, config.num_experts, top_k,
                       normalize=bool(config.norm_topk_prob), **shared, **common)
        if model_type == "deepseek_v3":
            n_shared = getattr(config, "n_shared_experts", 0) or 0
            shared = {"shared_intermediate_size": config.moe_intermediate_size * n_shared,
                      "shared_name": "shared_experts"} if n_shared else {}
            if getattr(config, "topk_method", "noaux_tc") not in ("noaux_tc", None):
                raise ValueError(f"{owner}: topk_method {config.topk_method!r} is not DeepSeek-V3's noaux_tc")
            return cls(config.hidden_size, config.moe_intermediate_size, config.n_routed_experts, top_k,
                       normalize=bool(config.norm_topk_prob), scoring="sigmoid",
                       num_groups=config.n_group or 1, top_groups=config.topk_group or None,
                       scaling=float(config.routed_scaling_factor), correction_bias=True, **shared, **common)
        raise AssertionError(model_type)

    def route(self, x: torch.Tensor):
        """``(router_logits [tokens, num_experts], weights, indices [tokens, top_k])`` for ``x [..., hidden]``."""
        logits = self.gate(x.reshape(-1, self.hidden_size))
        weights, indices = FF.moe_route(logits, self.top_k, self.scoring, self.normalize,
                                        self.gate.e_score_correction_bias, self.num_groups, self.top_groups,
                                        self.scaling)
        return logits, weights, indices

    def forward(self, x: torch.Tensor, return_router_logits: bool = False):
        owner = "fusedllm.nn.MoE"
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.hidden_size:
            shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{owner}: x must be [..., hidden_size={self.hidden_size}], got {shape}")
        weight = self.gate.weight
        if x.dtype != weight.dtype or x.device != weight.device:
            raise ValueError(f"{owner}: x is {x.dtype} on {x.device} but the layer is {weight.dtype} on "
                             f"{weight.device}")
        flat = x.reshape(-1, self.hidden_size)
        logits, weights, indices = self.route(flat)
        out = self.experts(flat, indices, weights)
        shared = self.shared
        if shared is not None:
            extra = shared(flat)
            if self.shared_expert_gate is not None:
                extra = torch.sigmoid(self.shared_expert_gate(flat)) * extra
            out = out + extra
        out = out.view(x.shape)
        return (out, logits, indices) if return_router_logits else out

    def extra_repr(self) -> str:
        text = (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, activation='{self.activation}', "
                f"scoring='{self.scoring}', normalize={self.normalize}")
        if self.num_groups > 1:
            text += f", num_groups={self.num_groups}, top_groups={self.top_groups}"
        if self.scaling != 1.0:
            text += f", scaling={self.scaling}"
        if self.gate.e_score_correction_bias is not None:
            text += ", correction_bias=True"
        return text
