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
"""

from __future__ import annotations

import functools

import torch

try:
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
except ImportError as exc:  # transformers 4.x: caches without per-layer classes
    raise ImportError("fusedllm.hf.FusedCache needs transformers >= 5 (its per-layer caches); "
                      f"upgrade it: pip install -U transformers ({exc})") from exc

OWNER = "fusedllm.hf.FusedCache"


def _check_new(name: str, new: torch.Tensor, store: torch.Tensor, same_place: bool = True) -> None:
    """New keys or values must be [batch, heads, n, head_dim] like the storage:
    a copy into a slice would broadcast a batch of 1 or cast a dtype silently.
    (Positions transformers moved, as offloading does, may come from another
    device: same_place=False.)"""
    if new.dim() != 4 or new.shape[:2] != store.shape[:2] or new.shape[3] != store.shape[3]:
        raise ValueError(f"{OWNER}: new {name} must be [batch, heads, n, head_dim] = "
                         f"[{store.shape[0]}, {store.shape[1]}, n, {store.shape[3]}] as held, "
                         f"got shape {list(new.shape)}")
    if same_place and (new.dtype != store.dtype or new.device != store.device):
        raise ValueError(f"{OWNER}: new {name} are {new.dtype} on {new.device}, "
                         f"the held ones {store.dtype} on {store.device}")


class GrowingLayer(DynamicLayer):
    """A full-attention layer: ``DynamicLayer``'s contract on storage that
    grows by half when full (copying the past once), so a step copies only
    its own positions. The first storage holds ``capacity`` positions, or the
    first update's if more: a capacity of prompt plus new tokens never grows.
    ``keys`` / ``values`` are views of the storage; where transformers
    replaces them (``crop``, beam reordering, batch selection), the next
    ``update`` adopts what it left."""

    def __init__(self, capacity: int = 256, **kwargs):
        super().__init__(**kwargs)
        self.capacity = capacity
        self._k = self._v = None

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
            old_k, old_v = (self.keys, self.values) if held else (None, None)
            size = max(self.capacity, held + n, 3 * self._k.shape[2] // 2 if views else 0)
            shape = (key_states.shape[0], key_states.shape[1], size, key_states.shape[3])
            self._k = key_states.new_empty(shape)
            self._v = value_states.new_empty(shape[:3] + (value_states.shape[3],))
            if held:
                _check_new("keys", old_k, self._k, same_place=False)
                self._k[:, :, :held].copy_(old_k)
                self._v[:, :, :held].copy_(old_v)
        _check_new("keys", key_states, self._k)
        _check_new("values", value_states, self._v)
        self._k[:, :, held:held + n].copy_(key_states)
        self._v[:, :, held:held + n].copy_(value_states)
        self.keys, self.values = self._k[:, :, :held + n], self._v[:, :, :held + n]
        return self.keys, self.values

    def reset(self) -> None:
        self._k = self._v = None
        super().reset()


class RingLayer(DynamicSlidingWindowLayer):
    """A sliding-window layer: ``DynamicSlidingWindowLayer``'s contract (the
    last ``W - 1`` positions plus the new ones are returned, the mask sizes
    are its own) on a ring of ``W`` slots, each position written at slot
    ``p mod W`` and at that slot plus ``W``. ``keys`` / ``values`` are the
    held positions in order (views)."""

    def __init__(self, sliding_window: int, **kwargs):
        super().__init__(sliding_window, **kwargs)
        self._k = self._v = None

    def _view(self, store: torch.Tensor, count: int) -> torch.Tensor:
        """The last `count` positions (count <= W), in order: one slice."""
        end = (self.cumulative_length - 1) % self.sliding_window + 1 + self.sliding_window
        return store[:, :, end - count:end]

    def _write(self, key_states: torch.Tensor, value_states: torch.Tensor, first: int) -> None:
        """Positions first, first + 1, ... (the last W of them) into both their
        slots: slice copies, the run up to the ring's end and the rest from its start."""
        window, n = self.sliding_window, key_states.shape[-2]
        skip = max(0, n - window)
        start, count = (first + skip) % window, n - skip
        head = min(count, window - start)
        for store, new in ((self._k, key_states), (self._v, value_states)):
            for slot, src, length in ((start, skip, head), (0, skip + head, count - head)):
                if length:
                    part = new[:, :, src:src + length]
                    store[:, :, slot:slot + length].copy_(part)
                    store[:, :, slot + window:slot + window + length].copy_(part)

    def activate_past_recording(self):
        raise ValueError(f"{OWNER}: its sliding-window layers keep no positions beyond the window, so they "
                         "cannot record the past for cropping (assisted decoding); use DynamicCache")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._k is None:
            shape = (key_states.shape[0], key_states.shape[1], 2 * self.sliding_window, key_states.shape[3])
            self._k = key_states.new_empty(shape)
            self._v = value_states.new_empty(shape[:3] + (value_states.shape[3],))
        _check_new("keys", key_states, self._k)
        _check_new("values", value_states, self._v)
        n, held = key_states.shape[-2], self.cumulative_length
        past = min(held, self.sliding_window - 1)
        if n == 1:
            self._write(key_states, value_states, held)
            self.cumulative_length += 1
            out = self._view(self._k, past + 1), self._view(self._v, past + 1)
        else:
            # a chunk sees the past and itself: one concatenation, as transformers does
            out = (torch.cat([self._view(self._k, past), key_states], dim=2) if past else key_states,
                   torch.cat([self._view(self._v, past), value_states], dim=2) if past else value_states)
            self._write(key_states, value_states, held)
            self.cumulative_length += n
        kept = min(self.cumulative_length, self.sliding_window)
        self.keys, self.values = self._view(self._k, kept), self._view(self._v, kept)
        return out

    def _rebuild(self, fn) -> None:
        """Apply a batch operation (beam reordering, selection, repetition) to the storage."""
        if self._k is not None and self.cumulative_length:
            self._k, self._v = fn(self._k), fn(self._v)
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
        self._k = self._v = None
        super().reset()


class FusedCache(DynamicCache):
    """``DynamicCache`` with :class:`GrowingLayer` for full-attention layers and
    :class:`RingLayer` for sliding-window ones, chosen per layer from
    ``config`` as ``DynamicCache(config=config)`` chooses (Mistral, Gemma 2/3,
    gpt-oss and Qwen's mixed layers each get the right kind). Without a config
    every layer is a :class:`GrowingLayer`. ``capacity``: positions each full
    layer allocates first (prompt plus new tokens: the storage never grows).

    ``model.generate(input_ids, past_key_values=FusedCache(model.config))``
    """

    def __init__(self, config=None, capacity: int = 256):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"{OWNER}: capacity must be a positive int, got {capacity!r}")
        super().__init__(config=config)
        self.layers = [self._fused(layer, capacity) for layer in self.layers]
        if self.layer_class_to_replicate is not None:
            self.layer_class_to_replicate = functools.partial(GrowingLayer, capacity)

    @staticmethod
    def _fused(layer, capacity: int):
        if type(layer) is DynamicLayer:
            return GrowingLayer(capacity)
        if type(layer) is DynamicSlidingWindowLayer:
            return RingLayer(layer.sliding_window)
        return layer  # other kinds (linear attention, shared layers) keep transformers' own
