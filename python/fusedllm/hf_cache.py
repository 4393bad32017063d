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
masks describe) and with ``generate`` (``cache=FusedCache(config)`` from
transformers 5.24 on, ``past_key_values=FusedCache(config)`` before), beam
search included. Built for transformers 5's cache layers.

``FusedCache(config, window=W, sink=s)`` bounds the full-attention layers
(:class:`SinkLayer`): each keeps the first ``s`` positions and the last ``W``
(StreamingLLM), for the "fusedllm" attention, which reads where they lie.

``FusedCache(config, dtype=torch.int8)`` stores both kinds of layer as int8
with one float32 scale per position and kv head (:func:`fusedllm.quantize_kv`):
``update`` returns the int8 views, each carrying its scales, and the
"fusedllm" attention reads them in place (no float copy of the cache).
"""

from __future__ import annotations

import functools

import torch

from . import functional as FF
from ._limits import check_positive_int

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

    def _initialize(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """transformers' lazy initialization at the first update, and the dtype
        new keys and values must keep (the first ones'; not every transformers
        release records it)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.given_dtype = key_states.dtype

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


class _BoundedStorage(_SlotStorage):
    """A layer that keeps only a window of positions (and sinks): batch
    operations rebuild its storage in place (``_rebuild``); cropping, which
    needs the positions it dropped, is refused."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rebuild(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rebuild(lambda t: t[indices, ...])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rebuild(lambda t: t.repeat_interleave(repeats, dim=0))

    def activate_past_recording(self):
        raise ValueError(f"{OWNER}: its layers with a window keep no positions beyond it, so they cannot "
                         "record the past for cropping (assisted decoding); use DynamicCache")

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(f"{OWNER}: its layers with a window cannot be cropped (they keep no positions "
                         "beyond it); use DynamicCache for assisted decoding")

    def reset(self) -> None:
        self._k = self._v = self._ks = self._vs = None
        super().reset()


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
        self._initialize(key_states, value_states)
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
        _check_new("keys", key_states, self._k, dtype=self.given_dtype)
        _check_new("values", value_states, self._v, dtype=self.given_dtype)
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


class RingLayer(_BoundedStorage, DynamicSlidingWindowLayer):
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

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self._initialize(key_states, value_states)
        if self._k is None:
            self._k, self._v, *scales = self._allocate(key_states, value_states, 2 * self.sliding_window)
            self._ks, self._vs = scales or (None, None)
        _check_new("keys", key_states, self._k, dtype=self.given_dtype)
        _check_new("values", value_states, self._v, dtype=self.given_dtype)
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


class WindowLayout:
    """What a :class:`SinkLayer` tells the "fusedllm" attention about the keys
    it returned (carried as ``keys.fusedllm_layout``): which positions they
    hold and who sees them. A query at position ``q`` sees position ``p <= q``
    when ``q - p < window`` or ``p < sink``.

    - one-token step (``ordered`` False): the keys are the filled slots of the
      storage as they lie, every one visible to the query;
    - chunk (``ordered`` True): the ``sink_keys`` sink positions first, then
      the window's positions in order, up to the last query's."""

    def __init__(self, window: int, sink: int, first_query: int, queries: int, keys: int, ordered: bool):
        self.window, self.sink, self.first_query, self.queries = window, sink, first_query, queries
        self.keys, self.ordered = keys, ordered
        self.end = first_query + queries  # one past the last position held
        self.sink_keys = min(sink, self.end) if ordered else 0

    def positions(self, device) -> torch.Tensor:
        """The position of each key, in the order of the keys."""
        if self.ordered:
            ring = torch.arange(self.end - (self.keys - self.sink_keys), self.end, device=device)
            return torch.cat([torch.arange(self.sink_keys, device=device), ring])
        slots = torch.arange(self.keys, device=device)
        if self.end <= self.sink + self.window:  # not wrapped: slot i holds position i
            return slots
        last = self.end - 1  # ring slot sink + r holds the latest position p <= last with p - sink = r mod window
        ring = last - torch.remainder(last - slots[self.sink:], self.window)
        return torch.cat([slots[:self.sink], ring])

    def visible(self, device) -> torch.Tensor:
        """[queries, keys] bool: who sees whom."""
        q = torch.arange(self.first_query, self.end, device=device)[:, None]
        p = self.positions(device)[None, :]
        return (p <= q) & ((p > q - self.window) | (p < self.sink))


class SinkLayer(_BoundedStorage, DynamicLayer):
    """A full-attention layer bounded as StreamingLLM bounds it: the first
    ``sink`` positions are kept for good and the last ``window`` ones in a ring
    (``sink + window`` slots, position ``p >= sink`` at slot ``sink + (p -
    sink) mod window``), so memory stays flat for any length. A query sees the
    sink positions and the last ``window`` positions up to its own. Positions
    keep their place in the text (rotary angles are not changed), and the
    sinks are the first positions of every row of the batch.

    To transformers it is a full-attention layer (its masks span every
    position seen; :meth:`get_mask_sizes`); the keys it returns carry a
    :class:`WindowLayout`, which only the "fusedllm" attention reads. A
    one-token step returns the filled slots as they lie (no copy; softmax
    does not mind their order), a chunk the sink and window positions in
    order (one concatenation). ``code``: quantized storage, as for
    :class:`GrowingLayer`."""

    is_sliding = False

    def __init__(self, window: int, sink: int = 0, code: torch.dtype | None = None, **kwargs):
        super().__init__(**kwargs)
        self.window, self.sink, self.code = window, sink, code
        self.cumulative_length = 0
        self._k = self._v = self._ks = self._vs = None

    def _slot(self, position: int) -> int:
        return position if position < self.sink else self.sink + (position - self.sink) % self.window

    def _runs(self, first: int, stop: int):
        """Positions [first, stop), all sinks or none, as ``(position, slot,
        count)`` runs of contiguous slots (the ring splits one where it wraps)."""
        while first < stop:
            slot = self._slot(first)
            count = min(stop - first, (self.sink if first < self.sink else self.sink + self.window) - slot)
            yield first, slot, count
            first += count

    def _held(self, first: int, stop: int) -> list:
        """Held positions [first, stop) (all sinks or none) in order, as lists of
        storage slices, one list per stored tensor."""
        runs = list(self._runs(first, stop))
        return [[t[:, :, slot:slot + count] for _, slot, count in runs] for t in self._tensors()]

    def _write(self, new: tuple, first: int) -> None:
        """New positions first, first + 1, ... into their slots: the sinks among
        them and the last ``window`` others."""
        end = first + new[0].shape[2]
        kept = [(first, min(end, self.sink)), (max(first, self.sink, end - self.window), end)]
        for a, b in kept:
            for p, slot, count in self._runs(a, b):
                self._put(self._tensors(), slice(slot, slot + count),
                          tuple(t[:, :, p - first:p - first + count] for t in new))

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # every position seen: the attention picks the columns of the keys it holds
        return self.cumulative_length + query_length, 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self._initialize(key_states, value_states)
        if self._k is None:
            self._k, self._v, *scales = self._allocate(key_states, value_states, self.sink + self.window)
            self._ks, self._vs = scales or (None, None)
        _check_new("keys", key_states, self._k, dtype=self.given_dtype)
        _check_new("values", value_states, self._v, dtype=self.given_dtype)
        new = (key_states, value_states)
        if self.quantized:  # quantized once: what is stored is what this step reads
            (k8, k_scale), (v8, v_scale) = (FF.quantize_kv(t, dtype=self.code) for t in (key_states, value_states))
            new = (k8, v8, k_scale, v_scale)
        n, held = key_states.shape[-2], self.cumulative_length
        if n == 1:
            self._write(new, held)
            filled = min(held + 1, self.sink + self.window)
            out = tuple(t[:, :, :filled] for t in self._tensors())
        else:
            # the sinks held, then the window's past (what the chunk's first query sees) and the chunk
            sinks = self._held(0, min(self.sink, held))
            ring = self._held(max(self.sink, held - self.window + 1), held)
            out = tuple(torch.cat(a + b + [x], dim=2) for a, b, x in zip(sinks, ring, new))
            self._write(new, held)
        self.cumulative_length += n
        self._keep_views()
        out = self._result(out)
        out[0].fusedllm_layout = WindowLayout(self.window, self.sink, held, n, out[0].shape[2], ordered=n > 1)
        return out

    def _keep_views(self) -> None:
        filled = min(self.cumulative_length, self.sink + self.window)
        self.keys, self.values = self._k[:, :, :filled], self._v[:, :, :filled]

    def _rebuild(self, fn) -> None:
        if self._k is not None and self.cumulative_length:
            self._k, self._v, *scales = (fn(t) for t in self._tensors())
            self._ks, self._vs = scales or (None, None)
            self._keep_views()


class FusedCache(DynamicCache):
    """``DynamicCache`` with :class:`GrowingLayer` for full-attention layers and
    :class:`RingLayer` for sliding-window ones, chosen per layer from
    ``config`` as ``DynamicCache(config=config)`` chooses (Mistral, Gemma 2/3,
    gpt-oss and Qwen's mixed layers each get the right kind). Without a config
    every layer is a full-attention one. ``capacity``: positions each full
    layer allocates first (prompt plus new tokens: the storage never grows).

    ``dtype=torch.int8`` (or ``torch.float8_e4m3fn``): quantized storage with
    a scale per position and kv head (:func:`fusedllm.quantize_kv`); generation
    then stays within the codes' error (:func:`fusedllm.attention` states the
    bound per layer).

    ``window=W`` (and ``sink=s``): the full-attention layers become
    :class:`SinkLayer` s, StreamingLLM's bounded attention: each query sees the
    first ``s`` positions and the last ``W`` up to its own, and memory stays
    ``s + W`` positions however long the generation (the model's own
    sliding-window layers keep their window). Batches must not be left-padded
    over the sink positions: the sinks are the first positions of every row.

    Quantized storage and ``window`` are read by the "fusedllm" attention only
    (the model loaded with ``attn_implementation="fusedllm"``).

    ``model.generate(input_ids, cache=FusedCache(model.config))`` (transformers
    5.24 on; ``past_key_values=`` before, which 5.24 still takes with a warning)
    """

    def __init__(self, config=None, capacity: int = 256, dtype: torch.dtype | None = None,
                 window: int | None = None, sink: int = 0):
        check_positive_int(OWNER, "capacity", capacity)
        if dtype not in (None, torch.int8, torch.float8_e4m3fn):
            raise ValueError(f"{OWNER}: dtype must be None (keys and values as the model makes them), "
                             f"torch.int8 or torch.float8_e4m3fn, got {dtype!r}")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"{OWNER}: window must be None or a positive int (positions each full-attention "
                             f"layer keeps), got {window!r}")
        if isinstance(sink, bool) or not isinstance(sink, int) or sink < 0:
            raise ValueError(f"{OWNER}: sink must be an int >= 0, got {sink!r}")
        if sink and window is None:
            raise ValueError(f"{OWNER}: sink={sink} needs a window: without one every position is kept anyway")
        backend = getattr(config, "_attn_implementation", None)
        for asked, what in ((dtype is not None, f"{dtype} storage"), (window is not None, "window")):
            if asked and backend not in (None, "fusedllm"):
                raise ValueError(f"{OWNER}: {what} is read by the 'fusedllm' attention only, but the model "
                                 f"uses '{backend}'; load it with attn_implementation='fusedllm'")
        super().__init__(config=config)
        full = (functools.partial(GrowingLayer, capacity, dtype) if window is None
                else functools.partial(SinkLayer, window, sink, dtype))
        self.layers = [self._fused(layer, full, dtype) for layer in self.layers]
        if self.layer_class_to_replicate is not None:
            self.layer_class_to_replicate = full

    @staticmethod
    def _fused(layer, full, code: torch.dtype | None):
        if type(layer) is DynamicLayer:
            return full()
        if type(layer) is DynamicSlidingWindowLayer:
            return RingLayer(layer.sliding_window, code)
        if code is not None:
            raise ValueError(f"{OWNER}: {code} storage covers full-attention and sliding-window layers; this "
                             f"model also has {type(layer).__name__}")
        return layer  # other kinds (linear attention, shared layers) keep transformers' own
