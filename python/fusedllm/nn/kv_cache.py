"""KVCache, the keys and values of one attention layer kept across decoding steps."""

from __future__ import annotations

import torch

from .. import functional as FF
from ..ops.attention import attention_with_lse, merge_attention
from .._limits import check_positive_int


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
        check_positive_int(owner, "capacity", capacity)
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
            pieces.append(attention_with_lse(q, self._k[:, :, slots], self._v[:, :, slots], mask=mask,
                                                 dropout_p=dropout_p, **self._scales(slots)))
        new_kv = dict(k=k, v=v)
        if self.quantized:  # the new keys as they will be stored
            (k8, k_scale), (v8, v_scale) = FF.quantize_kv(k, dtype=self.code), FF.quantize_kv(v, dtype=self.code)
            new_kv = dict(k=k8, v=v8, k_scale=k_scale, v_scale=v_scale)
        if start < self.sink and new > w:
            # sink positions among the new keys stay visible past the window
            k_pos = torch.arange(start, start + new, device=dev)[None, :]
            mask = (k_pos <= q_pos) & ((k_pos > q_pos - w) | (k_pos < self.sink))
            pieces.append(attention_with_lse(q, mask=mask, dropout_p=dropout_p, **new_kv))
        else:
            pieces.append(attention_with_lse(q, causal=True, window=w, dropout_p=dropout_p, **new_kv))
        self._store(k, v)
        return merge_attention(pieces, q.dtype)

    def __repr__(self) -> str:
        bounds = "" if self.window is None else f", window={self.window}, sink={self.sink}"
        bounds += f", quantized to {self.code}" if self.quantized else ""
        if self._k is None:
            return f"KVCache(length=0, capacity=0{bounds})"
        b, h, _, d = self._k.shape
        return (f"KVCache(length={self.length}, capacity={self.capacity}{bounds}, batch={b}, kv_heads={h}, "
                f"head_dim={d}, dtype={self._k.dtype}, device={self._k.device})")
