"""A paged KV cache: the keys and values of many sequences in one pool of
fixed-size pages, read by attention through a block table."""

from __future__ import annotations

import torch

from . import functional as FF
from ._limits import check_positive_int

_OWNER = "fusedllm.nn.PagedKVCache"
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_CODES = (torch.int8, torch.float8_e4m3fn)  # quantized storage


class PagedKVCache:
    """Keys and values of many sequences in one pool of pages, as served
    decoding keeps them (vLLM's paged attention).

    Storage is ``num_pages`` pages of ``page_size`` positions per layer:
    ``key_pages`` / ``value_pages`` are ``[num_layers, num_pages, kv_heads,
    page_size, head_dim]``, allocated once. A sequence owns a list of pages,
    its block table: position ``p`` lies in row ``p % page_size`` of page
    ``pages(seq)[p // page_size]``. Pages are taken from the pool as a
    sequence grows and given back by :meth:`free`, so sequences of any lengths
    share the pool without copying or fragmentation. The layers share the
    block tables: a page number means the same positions in every layer.

    - :meth:`new_sequence` starts an empty sequence and returns its id.
    - :meth:`fork` starts a sequence that shares all pages of another (a
      prompt's prefix, beams, parallel samples). A shared page is copied
      when a sequence first writes into it (copy on write); full pages stay
      shared for good.
    - :meth:`append` writes the next positions of a batch of sequences
      (``[batch, kv_heads, new_len, head_dim]``; decoding: ``new_len = 1``)
      into one layer; whichever layer first reaches a new page takes it.
    - :meth:`attend` runs :func:`fusedllm.attention` for a batch of sequences
      of different lengths in one call, reading the pages through their block
      tables (the queries are the last ``q_len`` positions of each sequence).
    - :meth:`free` ends a sequence and returns the pages no other sequence
      holds.

    ``dtype=torch.int8`` (or ``torch.float8_e4m3fn``) stores codes with one
    float32 scale per position and kv head (``key_scales`` / ``value_scales``
    ``[num_layers, num_pages, kv_heads, page_size]``), quantized as they are
    stored (:func:`fusedllm.quantize_kv`) and read as such by the kernels,
    within the bound :func:`fusedllm.attention` states. For inference:
    appended tensors must not require grad.
    """

    def __init__(self, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device=None, num_layers: int = 1):
        self.num_pages = check_positive_int(_OWNER, "num_pages", num_pages)
        self.page_size = check_positive_int(_OWNER, "page_size", page_size)
        self.kv_heads = check_positive_int(_OWNER, "kv_heads", kv_heads)
        self.head_dim = check_positive_int(_OWNER, "head_dim", head_dim)
        self.num_layers = check_positive_int(_OWNER, "num_layers", num_layers)
        if dtype not in _FLOATS + _CODES:
            raise ValueError(f"{_OWNER}: dtype must be float32, float64, bfloat16, float16, int8 or "
                             f"float8_e4m3fn, got {dtype!r}")
        self.dtype = dtype
        self.quantized = dtype in _CODES
        shape = (num_layers, num_pages, kv_heads, page_size, head_dim)
        self.key_pages = torch.zeros(shape, dtype=dtype, device=device)
        self.value_pages = torch.zeros(shape, dtype=dtype, device=device)
        self.key_scales = self.value_scales = None
        if self.quantized:
            self.key_scales = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
            self.value_scales = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
        self.device = self.key_pages.device
        self._free = list(range(num_pages - 1, -1, -1))  # popped from the end: page 0 first
        self._refs = [0] * num_pages
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, list[int]] = {}  # per sequence, the positions written in each layer
        self._next_id = 0

    # --- bookkeeping ------------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        """Pages no sequence holds."""
        return len(self._free)

    @property
    def sequences(self) -> list[int]:
        """Ids of the live sequences."""
        return list(self._tables)

    def _seq(self, op: str, seq) -> int:
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise TypeError(f"{op}: a sequence id is an int from new_sequence() or fork(), got {seq!r}")
        if seq not in self._tables:
            raise ValueError(f"{op}: sequence {seq} is not live (never made, or freed); live: "
                             f"{self.sequences}")
        return seq

    def _seqs(self, op: str, seqs) -> list[int]:
        seqs = [seqs] if isinstance(seqs, int) and not isinstance(seqs, bool) else list(seqs)
        seqs = [self._seq(op, s) for s in seqs]
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"{op}: a sequence appears twice in {seqs}")
        return seqs

    def _layer(self, op: str, layer) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"{op}: layer must be an int in [0, {self.num_layers}), got {layer!r}")
        return layer

    def pages(self, seq: int) -> list[int]:
        """The pages of a sequence, in position order (its block table)."""
        return list(self._tables[self._seq(f"{_OWNER}.pages", seq)])

    def length(self, seq: int, layer: int = 0) -> int:
        """The positions a sequence holds in a layer."""
        op = f"{_OWNER}.length"
        return self._lengths[self._seq(op, seq)][self._layer(op, layer)]

    def new_sequence(self) -> int:
        """Starts an empty sequence (no page yet); returns its id."""
        seq = self._next_id
        self._next_id += 1
        self._tables[seq] = []
        self._lengths[seq] = [0] * self.num_layers
        return seq

    def fork(self, seq: int) -> int:
        """Starts a sequence holding what ``seq`` holds, sharing its pages."""
        seq = self._seq(f"{_OWNER}.fork", seq)
        child = self.new_sequence()
        self._tables[child] = list(self._tables[seq])
        self._lengths[child] = list(self._lengths[seq])
        for page in self._tables[seq]:
            self._refs[page] += 1
        return child

    def free(self, seq: int) -> None:
        """Ends a sequence: its pages that no other sequence holds return to the pool."""
        seq = self._seq(f"{_OWNER}.free", seq)
        for page in self._tables.pop(seq):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)
        del self._lengths[seq]

    def block_table(self, seqs, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block_table, kv_lens)`` of ``seqs`` in ``layer``, as :func:`fusedllm.attention`
        takes them (int32 on the cache's device; unused entries are 0)."""
        op = f"{_OWNER}.block_table"
        return self._table_of(self._seqs(op, seqs), self._layer(op, layer))

    def _table_of(self, seqs: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        width = max([len(self._tables[s]) for s in seqs] + [1])
        rows = [self._tables[s] + [0] * (width - len(self._tables[s])) for s in seqs]
        table = torch.tensor(rows, dtype=torch.int32).view(len(seqs), width).to(self.device)
        lens = torch.tensor([self._lengths[s][layer] for s in seqs], dtype=torch.int32).to(self.device)
        return table, lens

    # --- writing ------------------------------------------------------------------------------

    def _check_rows(self, op: str, seqs: list[int], k, v) -> None:
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
            want = [len(seqs), self.kv_heads, "new_len", self.head_dim]
            if t.dim() != 4 or t.shape[0] != len(seqs) or t.shape[1] != self.kv_heads \
                    or t.shape[3] != self.head_dim:
                raise ValueError(f"{op}: {name} must be [len(seqs), kv_heads, new_len, head_dim] = {want}, "
                                 f"got shape {list(t.shape)}")
            if t.device != self.device:
                raise ValueError(f"{op}: the cache is on {self.device} but {name} is on {t.device}")
            if self.quantized and t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"{op}: a {self.dtype} cache stores float32, bfloat16 or float16 keys and "
                                 f"values, got {name} {t.dtype}")
            if not self.quantized and t.dtype != self.dtype:
                raise ValueError(f"{op}: the cache holds {self.dtype} but {name} is {t.dtype}")
        if k.shape != v.shape:
            raise ValueError(f"{op}: k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            raise RuntimeError(f"{op}: k/v require grad, but the cache keeps no autograd history; "
                               f"decode under torch.no_grad() or torch.inference_mode()")

    def _make_room(self, op: str, seqs: list[int], layer: int, new: int) -> None:
        """Gives each sequence the pages its next ``new`` positions in ``layer`` fall on,
        each held by it alone: fresh pages past its table, copies of shared ones
        (copy on write). Takes nothing unless the pool has every page needed."""
        plans, refs = [], list(self._refs)  # refs: as they will be when each sequence's turn comes
        for s in seqs:
            start = self._lengths[s][layer]
            first, last = start // self.page_size, (start + new - 1) // self.page_size
            table = self._tables[s]
            # the last holder of a page the others copied away writes it in place
            shared = [i for i in range(first, min(last + 1, len(table))) if refs[table[i]] > 1]
            for i in shared:
                refs[table[i]] -= 1
            plans.append((s, shared, max(0, last + 1 - len(table))))
        needed = sum(len(shared) + grow for _, shared, grow in plans)
        if needed > len(self._free):
            raise RuntimeError(f"{op}: the pool has {len(self._free)} free pages of {self.num_pages} but "
                               f"this append needs {needed}; free() finished sequences or make "
                               f"num_pages larger")
        copies = []
        for s, shared, grow in plans:
            table = self._tables[s]
            for i in shared:
                page = self._free.pop()
                copies.append((table[i], page))
                self._refs[table[i]] -= 1
                self._refs[page] = 1
                table[i] = page
            for _ in range(grow):
                page = self._free.pop()
                self._refs[page] = 1
                table.append(page)
        if copies:
            src = torch.tensor([a for a, _ in copies], device=self.device)
            dst = torch.tensor([b for _, b in copies], device=self.device)
            for t in (self.key_pages, self.value_pages, self.key_scales, self.value_scales):
                if t is not None:
                    t[:, dst] = t[:, src]

    def append(self, seqs, k: torch.Tensor, v: torch.Tensor, layer: int = 0) -> None:
        """Writes ``k, v [len(seqs), kv_heads, new_len, head_dim]`` as the next
        ``new_len`` positions of each sequence in ``seqs`` (ids, or one id) in
        ``layer``. A full pool is an error and changes nothing."""
        op = f"{_OWNER}.append"
        seqs = self._seqs(op, seqs)
        layer = self._layer(op, layer)
        self._check_rows(op, seqs, k, v)
        new = k.shape[2]
        if new == 0 or not seqs:
            return
        self._make_room(op, seqs, layer, new)
        pages, rows = [], []
        for s in seqs:
            table, start = self._tables[s], self._lengths[s][layer]
            for p in range(start, start + new):
                pages.append(table[p // self.page_size])
                rows.append(p % self.page_size)
        pages = torch.tensor(pages, device=self.device)
        rows = torch.tensor(rows, device=self.device)

        def rows_of(t):  # [batch, kv_heads, new, ...] -> [batch * new, kv_heads, ...]
            return t.transpose(1, 2).flatten(0, 1)

        for pool, scales, x in ((self.key_pages, self.key_scales, k), (self.value_pages, self.value_scales, v)):
            if self.quantized:
                values, x_scales = FF.quantize_kv(x, dtype=self.dtype)
                scales[layer].transpose(1, 2)[pages, rows] = rows_of(x_scales)
                x = values
            pool[layer].transpose(1, 2)[pages, rows] = rows_of(x)
        for s in seqs:
            self._lengths[s][layer] += new

    # --- reading ------------------------------------------------------------------------------

    def attend(self, q: torch.Tensor, seqs, layer: int = 0, causal: bool = True, scale: float | None = None,
               window: int | tuple[int, int] | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of ``q [len(seqs), q_heads, q_len, head_dim]`` over each
        sequence's positions in ``layer``, read through the block tables in one
        call; the queries are the last ``q_len`` positions of each sequence (append
        them first). Options as in :func:`fusedllm.attention`."""
        op = f"{_OWNER}.attend"
        seqs = self._seqs(op, seqs)
        layer = self._layer(op, layer)
        if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[0] != len(seqs):
            raise ValueError(f"{op}: q must be [len(seqs), q_heads, q_len, head_dim] with len(seqs) = "
                             f"{len(seqs)}, got shape {list(q.shape)}")
        table, lens = self._table_of(seqs, layer)
        scales = {}
        if self.quantized:
            scales = dict(k_scale=self.key_scales[layer], v_scale=self.value_scales[layer])
        return FF.attention(q, self.key_pages[layer], self.value_pages[layer], causal=causal, scale=scale,
                            window=window, softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes,
                            kv_lens=lens, block_table=table, **scales)

    def __repr__(self) -> str:
        return (f"PagedKVCache(num_pages={self.num_pages}, page_size={self.page_size}, "
                f"kv_heads={self.kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, "
                f"num_layers={self.num_layers}, sequences={len(self._tables)}, free_pages={self.free_pages})")
