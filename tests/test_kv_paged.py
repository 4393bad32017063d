"""Caches of several lengths and paged caches: attention with kv_lens (dense
rows) and block_table (pages read through the table) against attention over
each sequence's own rows; rows and pages a call must not read hold NaN, so
reading one shows. fusedllm.nn.PagedKVCache: decoding step by step equals
attention over each sequence's history; fork shares pages and copies a shared
page at its first write; freeing returns pages; no page leaks or is shared by
mistake under random operations; a full pool changes nothing; errors."""

import random
import re

import pytest
import torch

import checks
import fusedllm
from checks import FORWARD_TOL
from reference import attention as ref_attention
from reference import dequantize_kv, quantized_attention_error_bound

ops = torch.ops.fusedllm
Q_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
PagedKVCache = fusedllm.nn.PagedKVCache


def paged_pool(lens, page_size, kv_heads, d, dtype, device, spare=3, shared_prefix=0):
    """Random rows of each sequence in a pool of shuffled pages (pages and rows no
    sequence reads hold NaN). Sequences 0 and 1 share their first shared_prefix
    full pages when both are that long. Returns (k pages, v pages, block_table,
    kv_lens, each sequence's (k, v) rows [1, kv_heads, len, d])."""
    need = [-(-n // page_size) for n in lens]
    num_pages = sum(need) + spare
    order = torch.randperm(num_pages).tolist()
    width = max(need + [1])
    table = torch.full((len(lens), width), -7, dtype=torch.int32)  # entries past a sequence: never read
    taken = 0
    for b, n in enumerate(need):
        for i in range(n):
            if b == 1 and i < shared_prefix and need[0] > i:
                table[b, i] = table[0, i]
            else:
                table[b, i] = order[taken]
                taken += 1
    pages_k = torch.full((num_pages, kv_heads, page_size, d), float("nan"), dtype=dtype)
    pages_v = torch.full_like(pages_k, float("nan"))
    rows = []
    for b, n in enumerate(lens):
        kb = torch.randn(1, kv_heads, n, d).to(dtype)
        vb = torch.randn(1, kv_heads, n, d).to(dtype)
        if b == 1 and shared_prefix:
            shared = min(shared_prefix * page_size, lens[0], n)
            kb[:, :, :shared] = rows[0][0][:, :, :shared]
            vb[:, :, :shared] = rows[0][1][:, :, :shared]
        for j in range(n):
            page, r = table[b, j // page_size], j % page_size
            pages_k[page, :, r] = kb[0, :, j]
            pages_v[page, :, r] = vb[0, :, j]
        rows.append((kb.to(device), vb.to(device)))
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    return pages_k.to(device), pages_v.to(device), table.to(device), lens_t, rows


def per_sequence(q, rows, **opts):
    """Attention of each sequence's queries over its own rows (zeros for no keys)."""
    outs = []
    for b, (kb, vb) in enumerate(rows):
        if kb.shape[2] == 0:
            outs.append(torch.zeros_like(q[b:b + 1]))
        else:
            outs.append(ref_attention(q[b:b + 1], kb, vb, **opts)[0])
    return torch.cat(outs)


def tolerance(dtype):
    return FORWARD_TOL[dtype] if dtype != torch.float32 else (2e-5, 2e-5)


# --- attention through a block table ------------------------------------------------------

PAGED_SHAPES = [
    # lens, page_size, q_heads, kv_heads, q_len, head_dim
    ([5, 0, 17, 1, 40], 4, 4, 2, 1, 32),       # decoding step, an empty sequence
    ([9, 33, 16], 16, 8, 2, 1, 64),            # the bfloat16 decoding path (group rows <= 8)
    ([12, 30], 3, 8, 2, 5, 33),                # prefill rows past 8, odd page size and head dim
    ([2100], 16, 4, 1, 1, 128),                # one long sequence: keys split across threads
    ([70, 64, 1], 64, 2, 2, 3, 128),           # pages as large as a key tile
    ([3, 8], 1, 4, 4, 2, 16),                  # one position per page
]


@pytest.mark.cpu_variants
@pytest.mark.parametrize("dtype", Q_DTYPES)
@pytest.mark.parametrize("shape", PAGED_SHAPES, ids=lambda s: f"{s[0]}/p{s[1]}/{s[2]}-{s[3]}/q{s[4]}/d{s[5]}")
@pytest.mark.parametrize("causal", [True, False])
def test_paged_attention_matches_each_sequence(device, dtype, shape, causal):
    lens, page_size, hq, hkv, sq, d = shape
    k, v, table, kv_lens, rows = paged_pool(lens, page_size, hkv, d, dtype, device, shared_prefix=1)
    q = torch.randn(len(lens), hq, sq, d, device=device).to(dtype)
    with torch.no_grad():
        got = fusedllm.attention(q, k, v, causal=causal, kv_lens=kv_lens, block_table=table)
    assert not got.isnan().any()
    checks.assert_close(got, per_sequence(q, rows, causal=causal), tolerance(dtype))


@pytest.mark.cpu_variants
@pytest.mark.parametrize("option", ["window", "window pair", "softcap", "sinks", "alibi", "alibi per batch",
                                    "scale", "strided pages"])
def test_paged_attention_options(device, option):
    lens, page_size, hq, hkv, d = [7, 0, 23, 11], 4, 4, 2, 32
    k, v, table, kv_lens, rows = paged_pool(lens, page_size, hkv, d, torch.float32, device)
    q = torch.randn(len(lens), hq, 2, d, device=device)
    opts = {"causal": True}
    if option == "window":
        opts["window"] = 5
    elif option == "window pair":
        opts.update(causal=False, window=(3, 1))
    elif option == "softcap":
        opts["softcap"] = 2.0
    elif option == "sinks":
        opts["sinks"] = torch.randn(hq, device=device)
    elif option == "alibi":
        opts["alibi_slopes"] = torch.rand(hq, device=device)
    elif option == "scale":
        opts["scale"] = 0.3
    elif option == "strided pages":  # pages [num_pages, page_size, kv_heads, d], seen head first
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
        v = v.transpose(1, 2).contiguous().transpose(1, 2)
    ref_opts = dict(opts)
    if option == "alibi per batch":
        slopes = torch.rand(len(lens), hq, device=device)
        opts["alibi_slopes"] = slopes
    with torch.no_grad():
        got = fusedllm.attention(q, k, v, kv_lens=kv_lens, block_table=table, **opts)
    if option == "alibi per batch":
        want = torch.cat([per_sequence(q[b:b + 1], [rows[b]], alibi_slopes=slopes[b:b + 1], **ref_opts)
                          for b in range(len(lens))])
    else:
        want = per_sequence(q, rows, **ref_opts)
    if option == "sinks":  # a sequence without keys: zeros, as without sinks
        assert (got[1] == 0).all()
    checks.assert_close(got, want, tolerance(torch.float32))


@pytest.mark.cpu_variants
@pytest.mark.parametrize("code", [torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("dtype", Q_DTYPES)
@pytest.mark.parametrize("q_len", [1, 6])
def test_paged_int8_attention_matches_dequantized(device, dtype, q_len, code):
    lens, page_size, hq, hkv, d = [9, 40, 0, 16], 8, 8, 2, 64
    k, v, table, kv_lens, rows = paged_pool(lens, page_size, hkv, d, torch.float32, device)
    k8, k_scale = fusedllm.quantize_kv(k.nan_to_num(0.0), dtype=code)
    v8, v_scale = fusedllm.quantize_kv(v.nan_to_num(0.0), dtype=code)
    unread = k.isnan().any(-1)  # scales of rows no sequence reads: NaN
    k_scale[unread] = float("nan")
    v_scale[unread] = float("nan")
    q = torch.randn(len(lens), hq, q_len, d, device=device).to(dtype)
    with torch.no_grad():
        got = fusedllm.attention(q, k8, v8, causal=True, k_scale=k_scale, v_scale=v_scale, kv_lens=kv_lens,
                                 block_table=table)
    assert not got.isnan().any()
    deq_k, deq_v = dequantize_kv(k8, k_scale), dequantize_kv(v8, v_scale)
    want_rows = []
    for b, n in enumerate(lens):
        pages = table[b, :-(-n // page_size)].long()
        gather = lambda t: t[pages].transpose(0, 1).flatten(1, 2)[:, :n].unsqueeze(0)  # noqa: E731
        want_rows.append((gather(deq_k), gather(deq_v)))
    checks.assert_close(got, per_sequence(q, want_rows, causal=True), tolerance(dtype))
    bound_q = q.float()
    for b, (kb, vb) in enumerate(rows):  # and within the stated bound of the float rows
        if lens[b] == 0:
            continue
        kq, ks = fusedllm.quantize_kv(kb, dtype=code)
        vq, vs = fusedllm.quantize_kv(vb, dtype=code)
        bound = quantized_attention_error_bound(bound_q[b:b + 1], vb, ks, vs, code=code)
        error = (got[b:b + 1].float() - ref_attention(bound_q[b:b + 1], kb, vb, causal=True)[0]).abs()
        assert (error <= bound + FORWARD_TOL[dtype][0] * 4).all()


@pytest.mark.cpu_variants
@pytest.mark.parametrize("dtype", Q_DTYPES)
def test_kv_lens_over_dense_rows(device, dtype):
    """kv_lens without a table: sequence b reads the first kv_lens[b] rows of its dense k / v."""
    lens, hq, hkv, d, cap = [6, 0, 31, 1], 8, 2, 48, 32
    k = torch.full((len(lens), hkv, cap, d), float("nan")).to(dtype).to(device)
    v = torch.full_like(k, float("nan"))
    rows = []
    for b, n in enumerate(lens):
        k[b, :, :n] = torch.randn(hkv, n, d).to(dtype)
        v[b, :, :n] = torch.randn(hkv, n, d).to(dtype)
        rows.append((k[b:b + 1, :, :n], v[b:b + 1, :, :n]))
    kv_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), hq, 3, d, device=device).to(dtype)
    with torch.no_grad():
        got = fusedllm.attention(q, k, v, causal=True, kv_lens=kv_lens)
    checks.assert_close(got, per_sequence(q, rows, causal=True), tolerance(dtype))


def _paged_args(device, dtype=torch.float32):
    k, v, table, kv_lens, _ = paged_pool([5, 9], 4, 2, 16, dtype, device)
    q = torch.randn(2, 4, 1, 16, device=device).to(dtype)
    return q, k.nan_to_num(0.0), v.nan_to_num(0.0), table, kv_lens


# Refused on every device.
PAGED_ERRORS = [
    (lambda q, k, v, t, n: (q, k, v, t, None), "block_table needs kv_lens"),
    (lambda q, k, v, t, n: (q, k, v, t, n.long()), "kv_lens must be int32"),
    (lambda q, k, v, t, n: (q, k, v, t.long(), n), "block_table must be int32"),
    (lambda q, k, v, t, n: (q, k, v, t, n[:1]), r"kv_lens must be \[batch\] with batch = 2"),
    (lambda q, k, v, t, n: (q, k, v, t[:, :, None], n), r"block_table must be \[batch, max_pages\]"),
    (lambda q, k, v, t, n: (q, k[:, :, :0], v[:, :, :0], t, n), "page_size >= 1"),
]

# Entries whose values are wrong: the CPU refuses them before its kernels run;
# CUDA kernels (on a GPU or emulated) test each entry they read, without a
# copy to the host, and give the sequences concerned NaN rows. (make, message,
# the sequences with a bad entry)
PAGED_VALUE_ERRORS = [
    (lambda q, k, v, t, n: (q, k, v, t, n + 8), r"kv_lens\[0\] = 13 is not in \[0, 12\]", [0, 1]),
    (lambda q, k, v, t, n: (q, k, v, t, n - 6), r"kv_lens\[0\] = -1 is not in", [0]),
    (lambda q, k, v, t, n: (q, k, v, t.index_fill(1, torch.tensor([1], device=t.device), 99), n),
     r"block_table\[0, 1\] = 99 is not a page of k / v", [0, 1]),
    (lambda q, k, v, t, n: (q, k, v, t.index_fill(1, torch.tensor([2], device=t.device), -1), n),
     r"block_table\[1, 2\] = -1 is not a page", [1]),
    (lambda q, k, v, t, n: (q, k[:2], v[:2], None, n),
     r"kv_lens\[0\] = 5 is not in \[0, 4\] \(k's kv_len\)", [0, 1]),
]


@pytest.mark.parametrize("index", range(len(PAGED_ERRORS)))
def test_paged_attention_errors(device, index):
    make, message = PAGED_ERRORS[index]
    q, k, v, table, kv_lens = make(*_paged_args(device))
    with pytest.raises(ValueError, match=message), torch.no_grad():
        fusedllm.attention(q, k, v, kv_lens=kv_lens, block_table=table)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("index", range(len(PAGED_VALUE_ERRORS)))
def test_paged_attention_bad_entries(device, index, dtype, request):
    make, message, bad = PAGED_VALUE_ERRORS[index]
    q, k, v, table, kv_lens = make(*_paged_args(device, dtype))
    if request.node.callspec.params["device"] == "cpu":
        with pytest.raises(ValueError, match=message), torch.no_grad():
            fusedllm.attention(q, k, v, kv_lens=kv_lens, block_table=table)
        return
    with torch.no_grad():
        out = fusedllm.attention(q, k, v, kv_lens=kv_lens, block_table=table)
    for b in range(2):
        assert torch.isnan(out[b]).all() if b in bad else torch.isfinite(out[b]).all(), (b, out[b])


def test_paged_attention_unread_entries_are_not_checked(device):
    q, k, v, table, kv_lens = _paged_args(device)
    table = torch.cat([table, torch.full_like(table, -1)], 1)  # padding a sequence never reaches
    with torch.no_grad():
        fusedllm.attention(q, k, v, kv_lens=kv_lens, block_table=table)


def test_paged_attention_refuses_what_it_cannot_mean(device):
    q, k, v, table, kv_lens = _paged_args(device)
    with torch.no_grad():
        with pytest.raises(ValueError, match="mask is not supported with kv_lens"):
            fusedllm.attention(q, k, v, mask=torch.ones(1, 1, 1, 12, dtype=torch.bool, device=device),
                               kv_lens=kv_lens, block_table=table)
        with pytest.raises(ValueError, match="dropout_p must be 0"):
            fusedllm.attention(q, k, v, dropout_p=0.1, kv_lens=kv_lens, block_table=table)
        with pytest.raises(ValueError, match="not packed sequences"):
            cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
            ops.attention(q[:, :, 0], k[:2, :, 0], v[:2, :, 0], None, 0.25, False, -1, 0.0, None,
                          cu_seqlens_q=cu, cu_seqlens_k=cu, kv_lens=kv_lens)
    q.requires_grad_()
    with pytest.raises(ValueError, match="for inference and have no backward"):
        fusedllm.attention(q, k, v, kv_lens=kv_lens, block_table=table)


def test_plain_path_matches_the_kernels():
    from fusedllm import _plain

    lens, page_size = [5, 0, 19], 4
    k, v, table, kv_lens, _ = paged_pool(lens, page_size, 2, 24, torch.float32, "cpu")
    k8, k_scale = fusedllm.quantize_kv(k.nan_to_num(0.0))
    v8, v_scale = fusedllm.quantize_kv(v.nan_to_num(0.0))
    q = torch.randn(3, 4, 2, 24)
    sinks = torch.randn(4)
    args = (None, 0.25, True, -1, 0.0, None)
    for kk, vv, scales in ((k, v, {}), (k8, v8, dict(k_scale=k_scale, v_scale=v_scale))):
        with torch.no_grad():
            out_plain, lse_plain = _plain.attention(q, kk, vv, *args, sinks=sinks, kv_lens=kv_lens,
                                                    block_table=table, **scales)
            out, lse = ops.attention(q, kk, vv, *args, sinks=sinks, kv_lens=kv_lens, block_table=table,
                                     **scales)
        checks.assert_close(out_plain, out, (2e-5, 2e-5))
        torch.testing.assert_close(lse_plain, lse)


@pytest.mark.parametrize("index", range(len(PAGED_ERRORS)))
def test_plain_path_refuses_as_the_kernels(index):
    from fusedllm import _plain

    make, message = PAGED_ERRORS[index]
    q, k, v, table, kv_lens = make(*_paged_args("cpu"))
    for impl in (ops, _plain):
        with pytest.raises(ValueError, match=message), torch.no_grad():
            impl.attention(q, k, v, None, 0.25, False, -1, 0.0, None, kv_lens=kv_lens, block_table=table)


# --- fusedllm.nn.PagedKVCache --------------------------------------------------------------

def check_pool(cache):
    """Every page is free or held; a held page's count is the number of tables holding it."""
    held = {}
    for seq in cache.sequences:
        for page in cache.pages(seq):
            held[page] = held.get(page, 0) + 1
    free = set(cache._free)
    assert len(free) == len(cache._free), "a page is free twice"
    assert not free & set(held), "a page is both free and held"
    assert free | set(held) == set(range(cache.num_pages)), "a page leaked"
    for page in range(cache.num_pages):
        assert cache._refs[page] == held.get(page, 0)


def stored_rows(cache, seq, layer=0):
    """A sequence's rows in a layer, gathered from its pages (dequantized when int8)."""
    n = cache.length(seq, layer)
    pages = torch.tensor(cache.pages(seq), dtype=torch.long)
    out = []
    for pool, scales in ((cache.key_pages, cache.key_scales), (cache.value_pages, cache.value_scales)):
        rows = pool[layer][pages] if len(pages) else pool[layer][:0]
        rows = rows.transpose(0, 1).flatten(1, 2)[:, :n]
        if scales is not None:
            s = (scales[layer][pages] if len(pages) else scales[layer][:0]).transpose(0, 1).flatten(1, 2)[:, :n]
            rows = dequantize_kv(rows, s)
        out.append(rows.unsqueeze(0))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_decoding_equals_attention_over_each_history(device, dtype):
    """Three prompts of different lengths prefilled one by one, then decoded
    together one token per step: each step's output equals attention over
    that sequence's whole history."""
    hq, hkv, d, page_size = 4, 2, 32, 4
    cache = PagedKVCache(num_pages=24, page_size=page_size, kv_heads=hkv, head_dim=d, dtype=dtype, device=device)
    seqs = [cache.new_sequence() for _ in range(3)]
    history = {s: (torch.empty(1, hkv, 0, d, dtype=dtype, device=device),) * 2 for s in seqs}

    def add(s, k, v):
        hk, hv = history[s]
        history[s] = (torch.cat([hk, k], 2), torch.cat([hv, v], 2))

    with torch.no_grad():
        for s, n in zip(seqs, [7, 1, 12]):
            k, v = (torch.randn(1, hkv, n, d, device=device).to(dtype) for _ in range(2))
            q = torch.randn(1, hq, n, d, device=device).to(dtype)
            cache.append(s, k, v)
            add(s, k, v)
            got = cache.attend(q, s)
            checks.assert_close(got, ref_attention(q, *history[s], causal=True)[0], tolerance(dtype))
        for _ in range(6):
            k, v = (torch.randn(3, hkv, 1, d, device=device).to(dtype) for _ in range(2))
            q = torch.randn(3, hq, 1, d, device=device).to(dtype)
            cache.append(seqs, k, v)
            for i, s in enumerate(seqs):
                add(s, k[i:i + 1], v[i:i + 1])
            got = cache.attend(q, seqs)
            want = torch.cat([ref_attention(q[i:i + 1], *history[s], causal=True)[0] for i, s in enumerate(seqs)])
            checks.assert_close(got, want, tolerance(dtype))
    for s in seqs:
        assert cache.length(s) == len(history[s][0][0, 0])
        for got, want in zip(stored_rows(cache, s), history[s]):
            torch.testing.assert_close(got, want, atol=0, rtol=0)
    check_pool(cache)
    assert cache.free_pages == 24 - (4 + 2 + 5)  # 13, 7 and 18 positions in pages of 4


def test_fork_shares_pages_and_copies_on_write():
    cache = PagedKVCache(num_pages=8, page_size=4, kv_heads=1, head_dim=8)
    parent = cache.new_sequence()
    prompt = torch.randn(1, 1, 10, 8)
    cache.append(parent, prompt, -prompt)
    a, b = cache.fork(parent), cache.fork(parent)
    assert cache.pages(a) == cache.pages(b) == cache.pages(parent)
    assert cache.free_pages == 5
    check_pool(cache)
    ka, kb = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 3, 8)
    cache.append(a, ka, -ka)           # writes into the shared third page: copied first
    cache.append(b, kb, -kb)           # the same, and grows past it
    pa, pb, pp = cache.pages(a), cache.pages(b), cache.pages(parent)
    assert pa[:2] == pb[:2] == pp[:2]  # full prompt pages stay shared
    assert len({pa[2], pb[2], pp[2]}) == 3 and len(pb) == 4
    check_pool(cache)
    for seq, rows in ((parent, prompt), (a, torch.cat([prompt, ka], 2)), (b, torch.cat([prompt, kb], 2))):
        k, v = stored_rows(cache, seq)
        torch.testing.assert_close(k, rows, atol=0, rtol=0)
        torch.testing.assert_close(v, -rows, atol=0, rtol=0)
    cache.free(parent)                 # the children still hold the shared pages
    assert cache.free_pages == 8 - 5
    check_pool(cache)
    cache.free(a)
    cache.free(b)
    assert cache.free_pages == 8 and cache.sequences == []
    check_pool(cache)


def test_sequences_sharing_a_page_write_it_in_one_append():
    """A parent and its fork append in one call: the first copies the shared
    page, the second (now its only holder) writes it in place; no page is lost."""
    cache = PagedKVCache(num_pages=6, page_size=4, kv_heads=1, head_dim=2)
    parent = cache.new_sequence()
    prompt = torch.randn(1, 1, 6, 2)
    cache.append(parent, prompt, prompt)
    child = cache.fork(parent)
    new = torch.randn(2, 1, 1, 2)
    cache.append([parent, child], new, new)
    assert cache.free_pages == 6 - 3
    assert cache.pages(parent)[0] == cache.pages(child)[0] and cache.pages(parent)[1] != cache.pages(child)[1]
    check_pool(cache)
    for i, seq in enumerate((parent, child)):
        k, _ = stored_rows(cache, seq)
        torch.testing.assert_close(k, torch.cat([prompt, new[i:i + 1]], 2), atol=0, rtol=0)
    cache.free(parent)
    cache.free(child)
    assert cache.free_pages == 6
    check_pool(cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.float8_e4m3fn], ids=str)
def test_random_operations_keep_the_pool_sound(dtype):
    """Random new / fork / append / free on a small pool (two layers): after
    each, every page is free or held by the right count, and every sequence
    reads back exactly its own rows (int8: the quantized rows)."""
    rng = random.Random(3)
    cache = PagedKVCache(num_pages=12, page_size=3, kv_heads=2, head_dim=4, dtype=dtype, num_layers=2)
    shadow = {}
    for step in range(300):
        action = rng.choice(["new", "fork", "fork", "append", "append", "append", "free"])
        live = cache.sequences
        if action == "new" or not live:
            shadow[cache.new_sequence()] = [torch.empty(1, 2, 0, 4)] * 2
        elif action == "fork":
            parent = rng.choice(live)
            shadow[cache.fork(parent)] = list(shadow[parent])
        elif action == "free":
            seq = rng.choice(live)
            cache.free(seq)
            del shadow[seq]
        else:
            seqs = rng.sample(live, rng.randint(1, min(3, len(live))))
            n = rng.randint(1, 4)
            k = torch.randn(len(seqs), 2, n, 4)
            before = (cache.free_pages, {s: cache.pages(s) for s in live})
            for layer in (0, 1):
                try:
                    cache.append(seqs, k + layer, -k, layer=layer)
                except RuntimeError as error:
                    assert "free pages" in str(error) and layer == 0
                    assert before == (cache.free_pages, {s: cache.pages(s) for s in live})
                    break
            else:
                for i, s in enumerate(seqs):
                    shadow[s] = [torch.cat([shadow[s][0], k[i:i + 1]], 2), torch.cat([shadow[s][1], -k[i:i + 1]], 2)]
        check_pool(cache)
        for seq, (k_rows, v_rows) in shadow.items():
            for layer in (0, 1):
                got_k, got_v = stored_rows(cache, seq, layer)
                want_k, want_v = k_rows + layer, v_rows
                if dtype != torch.float32:
                    want_k = dequantize_kv(*fusedllm.quantize_kv(want_k, dtype=dtype))
                    want_v = dequantize_kv(*fusedllm.quantize_kv(want_v, dtype=dtype))
                torch.testing.assert_close(got_k, want_k, atol=0, rtol=0)
                torch.testing.assert_close(got_v, want_v, atol=0, rtol=0)


@pytest.mark.parametrize("code", [torch.int8, torch.float8_e4m3fn], ids=str)
def test_int8_cache_attends_over_its_quantized_rows(device, code):
    hq, hkv, d = 4, 2, 32
    cache = PagedKVCache(num_pages=16, page_size=8, kv_heads=hkv, head_dim=d, dtype=code, device=device)
    seqs = [cache.new_sequence() for _ in range(2)]
    with torch.no_grad():
        cache.append(seqs[0], *(torch.randn(1, hkv, 19, d, device=device) for _ in range(2)))
        cache.append(seqs[1], *(torch.randn(1, hkv, 5, d, device=device) for _ in range(2)))
        q = torch.randn(2, hq, 1, d, device=device, dtype=torch.bfloat16)
        got = cache.attend(q, seqs)
    want = torch.cat([ref_attention(q[i:i + 1].float(), *stored_rows(cache, s), causal=True)[0]
                      for i, s in enumerate(seqs)])
    checks.assert_close(got, want.to(got.dtype), FORWARD_TOL[torch.bfloat16])
    assert cache.key_pages.dtype == code and cache.key_scales.shape == (1, 16, hkv, 8)


def test_attend_over_no_sequence():
    cache = PagedKVCache(num_pages=4, page_size=2, kv_heads=1, head_dim=4)
    with torch.no_grad():
        assert cache.attend(torch.randn(0, 2, 1, 4), []).shape == (0, 2, 1, 4)


def test_full_pool_is_an_error_that_changes_nothing():
    cache = PagedKVCache(num_pages=3, page_size=2, kv_heads=1, head_dim=4)
    a, b = cache.new_sequence(), cache.new_sequence()
    cache.append(a, torch.ones(1, 1, 3, 4), torch.ones(1, 1, 3, 4))
    with pytest.raises(RuntimeError, match="the pool has 1 free pages of 3 but this append needs 2"):
        cache.append([a, b], torch.ones(2, 1, 2, 4), torch.ones(2, 1, 2, 4))
    assert cache.length(a) == 3 and cache.length(b) == 0 and cache.free_pages == 1
    check_pool(cache)
    cache.free(a)
    cache.append(b, torch.ones(1, 1, 6, 4), torch.ones(1, 1, 6, 4))
    assert cache.free_pages == 0


def test_cache_errors():
    with pytest.raises(ValueError, match=checks.whole(
            "fusedllm.nn.PagedKVCache: page_size must be a positive int, got 0")):
        PagedKVCache(num_pages=4, page_size=0, kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match="^" + re.escape(
            "fusedllm.nn.PagedKVCache: dtype must be float32, float64, bfloat16, float16, int8 or float8_e4m3fn, "
            "got torch.int32") + "$"):
        PagedKVCache(num_pages=4, page_size=2, kv_heads=1, head_dim=4, dtype=torch.int32)
    cache = PagedKVCache(num_pages=4, page_size=2, kv_heads=2, head_dim=4)
    a = cache.new_sequence()
    x = torch.randn(1, 2, 1, 4)
    with pytest.raises(ValueError, match=checks.whole(
            "fusedllm.nn.PagedKVCache.append: sequence 7 is not live (never made, or freed); live: [0]")):
        cache.append(7, x, x)
    with pytest.raises(ValueError, match=checks.whole(
            "fusedllm.nn.PagedKVCache.append: a sequence appears twice in [0, 0]")):
        cache.append([a, a], torch.cat([x, x]), torch.cat([x, x]))
    with pytest.raises(ValueError, match=checks.whole(
            "fusedllm.nn.PagedKVCache.append: k must be [len(seqs), kv_heads, new_len, head_dim] = "
            "[1, 2, 'new_len', 4], got shape [1, 3, 1, 4]")):
        cache.append(a, torch.randn(1, 3, 1, 4), x)
    with pytest.raises(ValueError, match=checks.whole(
            "fusedllm.nn.PagedKVCache.append: the cache holds torch.float32 but k is torch.bfloat16")):
        cache.append(a, x.bfloat16(), x.bfloat16())
    with pytest.raises(ValueError, match=checks.whole(
            "fusedllm.nn.PagedKVCache.append: layer must be an int in [0, 1), got 1")):
        cache.append(a, x, x, layer=1)
    with pytest.raises(RuntimeError, match="^" + re.escape(
            "fusedllm.nn.PagedKVCache.append: k/v require grad, but the cache keeps no autograd history; "
            "decode under torch.no_grad() or torch.inference_mode()") + "$"):
        cache.append(a, x.requires_grad_(), x)
    with pytest.raises(ValueError, match=checks.whole(
            "fusedllm.nn.PagedKVCache.attend: q must be [len(seqs), q_heads, q_len, head_dim] with len(seqs) = 1, "
            "got shape [2, 2, 1, 4]")):
        cache.attend(torch.randn(2, 2, 1, 4), a)
    cache.free(a)
    with pytest.raises(ValueError, match="sequence 0 is not live"):
        cache.free(a)
    with pytest.raises(TypeError, match="a sequence id is an int"):
        cache.fork("a")
