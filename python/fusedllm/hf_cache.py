"""``fusedllm.hf.FusedCache``: a transformers ``Cache`` whose decoding steps
copy only the new positions.

transformers' ``DynamicCache`` concatenates every layer's whole past with the
new keys and values at each step (``DynamicLayer``), and, for sliding-window
layers, keeps the window by concatenating and slicing again
(``DynamicSlidingWindowLayer``): a step costs a copy of the cache, so decoding
``n`` tokens copies O(n²) positions. ``FusedCache`` keeps the same layers'
contract (what ``update`` returns, the mask sizes, the sequence length) on
storage that is written in place:

- full-attention layers: storage that grows geometrically (by half);
  ``update`` writes the new positions after the held ones and returns views
  of all of them;
- sliding-window layers of window ``W``: a ring of ``W`` slots whose every
  position is written twice, at slot ``p mod W`` and ``W`` slots further, so
  that the last ``W`` positions always lie in one contiguous, chronological
  view of the ``2W``-slot storage. A one-token step writes two slots and
  returns that view; memory stays ``2W`` positions for any length.

It works with every attention backend (the views are what transformers'
masks describe) and with ``generate`` (``past_key_values=FusedCache(config)``),
beam search included. Built for transformers 5's cache layers.

``FusedCache(config, dtype=torch.int8)`` stores both kinds of layer as int8
with one float32 scale per position and kv head (:func:`fusedllm.quantize_kv`):
``update`` returns the int8 views, each carrying its scales, and the
"fusedllm" attention reads them in place (no float copy of the cache).
"""

from __future__ import annotations

import functools

import torch

from . import functional as FF

try:
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
except ImportError as exc:  # transformers 4.x: caches without per-layer classes
    raise ImportError("fusedllm.hf.FusedCache needs transformers >= 5 (its per-layer caches); "
                      f"upgrade it: pip install -U transformers ({exc})") from exc

OWNER = "fusedllm.hf.FusedCache"


def _check_new(name: str, new: torch.Tensor, store: torch.Tensor, same_place: bool = True,
               dtype: torch.dtype | None = None) -> None:
    """New keys or values must be [batch, heads, n, head_dim] like the storage:
    a copy into a slice would broadcast a batch of 1 or cast a dtype silently.
    (Positions transformers moved, as offloading does, may come from another
    device: same_place=False. dtype: what the layer was first given, for int8
    storage.)"""
    if new.dim() != 4 or new.shape[:2] != store.shape[:2] or new.shape[3] != store.shape[3]:
        raise ValueError(f"{OWNER}: new {name} must be [batch, heads, n, head_dim] = "
                         f"[{store.shape[0]}, {store.shape[1]}, n, {store.shape[3]}] as held, "
                         f"got shape {list(new.shape)}")
    held = dtype or store.dtype
    if same_place and (new.dtype != held or new.device != store.device):
        raise ValueError(f"{OWNER}: new {name} are {new.dtype} on {new.device}, "
                         f"the held ones {held} on {store.device}")


def _with_scales(keys: torch.Tensor, values: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor):
    """int8 / float8 keys and values carrying their scales to the "fusedllm" attention
    (transformers passes an update's result on to the attention function)."""
    keys.fusedllm_scale, values.fusedllm_scale = k_scale, v_scale
    return keys, values


class _SlotStorage:
    """The layers' storage [batch, heads, slots, head_dim] of keys and values:
    in the model's dtype, or (quantized) int8 / float8 codes (``code``) with
    scales [batch, heads, slots] written by quantize_kv."""

    code: torch.dtype | None = None

    @property
    def quantized(self) -> bool:
        return self.code is not None

    def _tensors(self) -> tuple:
        return (self._k, self._v, self._ks, self._vs) if self.quantized else (self._k, self._v)

    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, slots: int) -> tuple:
        batch, heads, _, dim = key_states.shape
        dtype = self.code if self.quantized else key_states.dtype
        made = (key_states.new_empty((batch, heads, slots, dim), dtype=dtype),
                value_states.new_empty((batch, heads, slots, value_states.shape[3]), dtype=dtype))
        if self.quantized:
            made += tuple(key_states.new_empty((batch, heads, slots), dtype=torch.float32) for _ in range(2))
        return made

    def _put(self, stores: tuple, slots: slice, new: tuple) -> None:
        """new (float keys, values) into storage slots: copied, or quantized
        (new already quantized: (keys, values, k_scale, v_scale) copied)."""
        if self.quantized and len(new) == 2:
            FF.quantize_kv(new[0], stores[0][:, :, slots], stores[2][:, :, slots])
            FF.quantize_kv(new[1], stores[1][:, :, slots], stores[3][:, :, slots])
            return
        for store, part in zip(stores, new):
            store[:, :, slots].copy_(part)

    def _result(self, tensors: tuple):
        return _with_scales(*tensors) if self.quantized else tuple(tensors)


class GrowingLayer(_SlotStorage, DynamicLayer):
    """A full-attention layer: ``DynamicLayer``'s contract on storage that
    grows by half when full (copying the past once), so a step copies only
    its own positions. The first storage holds ``capacity`` positions, or the
    first update's if more: a capacity of prompt plus new tokens never grows.
    ``keys`` / ``values`` are views of the storage; where transformers
    replaces them (``crop``, beam reordering, batch selection), the next
    ``update`` adopts what it left. ``code`` (torch.int8 / torch.float8_e4m3fn):
    quantized storage, which beam reordering, batch selection and repetition
    rebuild in place instead."""

    def __init__(self, capacity: int = 256, code: torch.dtype | None = None, **kwargs):
        super().__init__(**kwargs)
        self.capacity, self.code = capacity, code
        self._k = self._v = self._ks = self._vs = None

    def _holds_views(self) -> bool:
        return (self._k is not None and self.keys is not None and self.keys.dim() == 4
                and self.keys.data_ptr() == self._k.data_ptr() and self.keys.stride() == self._k.stride()
                and self.values.data_ptr() == self._v.data_ptr() and self.values.stride() == self._v.stride())

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held, n = self.get_seq_length(), key_states.shape[-2]
        views = self._holds_views()
        if not views or held + n > self._k.shape[2]:
            # first step, storage full, or keys replaced by transformers: new storage
            if views:
                old = tuple(t[:, :, :held] for t in self._tensors())
            else:
                old = (self.keys, self.values) if held else None
            size = max(self.capacity, held + n, 3 * self._k.shape[2] // 2 if views else 0)
            self._k, self._v, *scales = self._allocate(key_states, value_states, size)
            self._ks, self._vs = scales or (None, None)
            if held:
                _check_new("keys", old[0], self._k, same_place=False)
                self._put(self._tensors(), slice(0, held), old)
        _check_new("keys", key_states, self._k, dtype=self.dtype)
        _check_new("values", value_states, self._v, dtype=self.dtype)
        self._put(self._tensors(), slice(held, held + n), (key_states, value_states))
        self.keys, self.values = self._k[:, :, :held + n], self._v[:, :, :held + n]
        scales = (self._ks[:, :, :held + n], self._vs[:, :, :held + n]) if self.quantized else ()
        return self._result((self.keys, self.values) + scales)

    def _rebuild(self, fn) -> None:
        """A batch operation (beam reordering, selection, repetition) on int8 storage and its scales."""
        held = self.get_seq_length()
        if self._k is not None and held:
            self._k, self._v, self._ks, self._vs = (fn(t) for t in self._tensors())
            self.keys, self.values = self._k[:, :, :held], self._v[:, :, :held]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if not self.quantized:
            return super().reorder_cache(beam_idx)
        self._rebuild(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.quantized:
            return super().batch_select_indices(indices)
        self._rebuild(lambda t: t[indices, ...])

    def batch_repeat_interleave(self, repeats: int) -> None:
        if not self.quantized:
            return super().batch_repeat_interleave(repeats)
        self._rebuild(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        self._k = self._v = self._ks = self._vs = None
        super().reset()


class RingLayer(_SlotStorage, DynamicSlidingWindowLayer):
    """A sliding-window layer: ``DynamicSlidingWindowLayer``'s contract (the
    last ``W - 1`` positions plus the new ones are returned, the mask sizes
    are its own) on a ring of ``W`` slots, each position written at slot
    ``p mod W`` and at that slot plus ``W``. ``keys`` / ``values`` are the
    held positions in order (views). ``code``: quantized storage, as for
    :class:`GrowingLayer`."""

    def __init__(self, sliding_window: int, code: torch.dtype | None = None, **kwargs):
        super().__init__(sliding_window, **kwargs)
        self.code = code
        self._k = self._v = self._ks = self._vs = None

    def _view(self, store: torch.Tensor, count: int) -> torch.Tensor:
        """The last `count` positions (count <= W), in order: one slice."""
        end = (self.cumulative_length - 1) % self.sliding_window + 1 + self.sliding_window
        return store[:, :, end - count:end]

    def _write(self, new: tuple, first: int) -> None:
        """Positions first, first + 1, ... (the last W of them) of new (keys,
        values and, int8, their scales) into both their slots: slice copies,
        the run up to the ring's end and the rest from its start."""
        window, n = self.sliding_window, new[0].shape[2]
        skip = max(0, n - window)
        start, count = (first + skip) % window, n - skip
        head = min(count, window - start)
        for slot, src, length in ((start, skip, head), (0, skip + head, count - head)):
            if length:
                part = tuple(t[:, :, src:src + length] for t in new)
                self._put(self._tensors(), slice(slot, slot + length), part)
                self._put(self._tensors(), slice(slot + window, slot + window + length), part)

    def activate_past_recording(self):
        raise ValueError(f"{OWNER}: its sliding-window layers keep no positions beyond the window, so they "
                         "cannot record the past for cropping (assisted decoding); use DynamicCache")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._k is None:
            self._k, self._v, *scales = self._allocate(key_states, value_states, 2 * self.sliding_window)
            self._ks, self._vs = scales or (None, None)
        _check_new("keys", key_states, self._k, dtype=self.dtype)
        _check_new("values", value_states, self._v, dtype=self.dtype)
        new = (key_states, value_states)
        if self.quantized:  # quantized once, written to both slots
            (k8, k_scale), (v8, v_scale) = (FF.quantize_kv(t, dtype=self.code) for t in (key_states, value_states))
            new = (k8, v8, k_scale, v_scale)
        n, held = key_states.shape[-2], self.cumulative_length
        past = min(held, self.sliding_window - 1)
        if n == 1:
            self._write(new, held)
            self.cumulative_length += 1
            out = tuple(self._view(t, past + 1) for t in self._tensors())
        else:
            # a chunk sees the past and itself: one concatenation, as transformers does
            out = tuple(torch.cat([self._view(t, past), x], dim=2) if past else x
                        for t, x in zip(self._tensors(), new))
            self._write(new, held)
            self.cumulative_length += n
        kept = min(self.cumulative_length, self.sliding_window)
        self.keys, self.values = self._view(self._k, kept), self._view(self._v, kept)
        return self._result(out)

    def _rebuild(self, fn) -> None:
        """Apply a batch operation (beam reordering, selection, repetition) to the storage."""
        if self._k is not None and self.cumulative_length:
            self._k, self._v, *scales = (fn(t) for t in self._tensors())
            self._ks, self._vs = scales or (None, None)
            kept = min(self.cumulative_length, self.sliding_window)
            self.keys, self.values = self._view(self._k, kept), self._view(self._v, kept)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rebuild(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rebuild(lambda t: t[indices, ...])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rebuild(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(f"{OWNER}: its sliding-window layers cannot be cropped (they keep no positions "
                         "beyond the window); use DynamicCache for assisted decoding")

    def reset(self) -> None:
        self._k = self._v = self._ks = self._vs = None
        super().reset()


class FusedCache(DynamicCache):
    """``DynamicCache`` with :class:`GrowingLayer` for full-attention layers and
    :class:`RingLayer` for sliding-window ones, chosen per layer from
    ``config`` as ``DynamicCache(config=config)`` chooses (Mistral, Gemma 2/3,
    gpt-oss and Qwen's mixed layers each get the right kind). Without a config
    every layer is a :class:`GrowingLayer`. ``capacity``: positions each full
    layer allocates first (prompt plus new tokens: the storage never grows).
    ``dtype=torch.int8`` (or ``torch.float8_e4m3fn``): quantized storage with
    a scale per position and kv head (:func:`fusedllm.quantize_kv`), read by
    the "fusedllm" attention only (the model loaded with
    ``attn_implementation="fusedllm"``); generation then stays within the
    codes' error (:func:`fusedllm.attention` states the bound per layer).

    ``model.generate(input_ids, past_key_values=FusedCache(model.config))``
    """

    def __init__(self, config=None, capacity: int = 256, dtype: torch.dtype | None = None):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"{OWNER}: capacity must be a positive int, got {capacity!r}")
        if dtype not in (None, torch.int8, torch.float8_e4m3fn):
            raise ValueError(f"{OWNER}: dtype must be None (keys and values as the model makes them), "
                             f"torch.int8 or torch.float8_e4m3fn, got {dtype!r}")
        backend = getattr(config, "_attn_implementation", None)
        if dtype is not None and backend not in (None, "fusedllm"):
            raise ValueError(f"{OWNER}: {dtype} storage is read by the 'fusedllm' attention only, but the model "
                             f"uses '{backend}'; load it with attn_implementation='fusedllm'")
        super().__init__(config=config)
        self.layers = [self._fused(layer, capacity, dtype) for layer in self.layers]
        if self.layer_class_to_replicate is not None:
            self.layer_class_to_replicate = functools.partial(GrowingLayer, capacity, dtype)

    @staticmethod
    def _fused(layer, capacity: int, code: torch.dtype | None):
        if type(layer) is DynamicLayer:
            return GrowingLayer(capacity, code)
        if type(layer) is DynamicSlidingWindowLayer:
            return RingLayer(layer.sliding_window, code)
        if code is not None:
            raise ValueError(f"{OWNER}: {code} storage covers full-attention and sliding-window layers; this "
                             f"model also has {type(layer).__name__}")
        return layer  # other kinds (linear attention, shared layers) keep transformers' own
