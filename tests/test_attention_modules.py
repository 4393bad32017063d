"""nn.KVCache and nn.GQAttention: cache growth and views, decoding with a cache
against the full forward, the module against a plain PyTorch attention module
with the same weights (masks, window, GQA), weights, dropout, state dicts,
errors and torch.compile."""

import pytest
import torch
from torch import nn

import fusedllm
from fusedllm.nn import GQAttention, KVCache


class PlainGQAttention(nn.Module):
    """Causal grouped-query attention written out in plain PyTorch: Llama's
    rotate_half RoPE from its own tables, repeated kv heads, the full score
    matrix, float32 softmax. Same parameter names as GQAttention."""

    def __init__(self, d_model, n_heads, n_kv_heads, head_dim, bias=False, base=10000.0, window=None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.window = n_heads, n_kv_heads, head_dim, window
        self.base = base
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=bias)

    def rotate(self, x, positions):
        half = self.head_dim // 2
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=positions.device) / self.head_dim
        inv_freq = 1.0 / self.base ** exponents
        angles = positions.double()[:, None] * inv_freq[None]
        cos = torch.cat([angles.cos(), angles.cos()], -1)
        sin = torch.cat([angles.sin(), angles.sin()], -1)
        xd = x.double()
        rotated_half = torch.cat([-xd[..., half:], xd[..., :half]], -1)
        return (xd * cos + rotated_half * sin).to(x.dtype)

    def forward(self, x, mask=None, past=None, rope=True):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        start = 0 if past is None else past[0].shape[2]
        if rope:
            positions = torch.arange(start, start + s, device=x.device)
            q, k = self.rotate(q, positions), self.rotate(k, positions)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        group = self.n_heads // self.n_kv_heads
        kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = (q.float() @ kr.float().transpose(-1, -2)) / self.head_dim ** 0.5
        query_pos = torch.arange(start, start + s, device=x.device)[:, None]
        key_pos = torch.arange(k.shape[2], device=x.device)[None]
        keep = key_pos <= query_pos
        if self.window is not None:
            keep = keep & (key_pos > query_pos - self.window)
        if mask is not None and mask.dtype == torch.bool:
            keep = keep & mask
        elif mask is not None:
            scores = scores + mask.float()
        scores = scores.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(scores, -1)
        out = (probs @ vr.float()).to(x.dtype).transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out), probs, (k, v)


def make_pair(device, d_model=48, n_heads=6, n_kv_heads=2, head_dim=None, bias=False, window=None,
              rope=True, dropout=0.0):
    fused = GQAttention(d_model, n_heads, n_kv_heads, head_dim=head_dim, bias=bias, window=window,
                        rope=rope, dropout=dropout).to(device)
    plain = PlainGQAttention(d_model, n_heads, n_kv_heads, fused.head_dim, bias=bias, window=window).to(device)
    plain.load_state_dict(fused.state_dict())
    return fused, plain


# --- KVCache ---------------------------------------------------------------------------------

def test_cache_grows_by_doubling_and_copies_the_past_only_when_it_grows():
    cache = KVCache(capacity=4)
    assert len(cache) == 0 and cache.capacity == 0 and cache.keys is None
    written_k, written_v, storages, capacities = [], [], [], []
    for step in range(11):
        k, v = torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8)
        written_k.append(k)
        written_v.append(v)
        k_all, v_all = cache.append(k, v)
        storages.append(k_all.data_ptr())
        capacities.append(cache.capacity)
        assert k_all.shape == (2, 3, step + 1, 8) and len(cache) == cache.length == step + 1
        torch.testing.assert_close(k_all, torch.cat(written_k, 2), rtol=0, atol=0)
        torch.testing.assert_close(v_all, torch.cat(written_v, 2), rtol=0, atol=0)
    assert capacities == [4] * 4 + [8] * 4 + [16] * 3
    # the storage moves exactly when the capacity changes: steps that fit write in place
    moved = [i for i in range(1, 11) if storages[i] != storages[i - 1]]
    assert moved == [4, 8]


def test_cache_views_are_views_not_copies():
    cache = KVCache(capacity=8)
    k_all, _ = cache.append(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    k_more, _ = cache.append(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))
    assert k_all._base is not None and k_more._base is k_all._base
    assert k_more.data_ptr() == k_all.data_ptr()
    # a chunk larger than double the capacity grows straight to what is needed
    cache.append(torch.randn(1, 2, 40, 4), torch.randn(1, 2, 40, 4))
    assert len(cache) == 45 and cache.capacity == 45


def test_cache_reset_reuses_storage_and_accepts_a_new_shape():
    cache = KVCache(capacity=8)
    k_all, _ = cache.append(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    pointer = k_all.data_ptr()
    cache.reset()
    assert len(cache) == 0 and cache.keys.shape == (1, 2, 0, 4)
    k_again, _ = cache.append(torch.ones(1, 2, 2, 4), torch.ones(1, 2, 2, 4))
    assert k_again.data_ptr() == pointer and torch.equal(k_again, torch.ones(1, 2, 2, 4))
    cache.reset()
    k_new, _ = cache.append(torch.ones(3, 1, 1, 16, dtype=torch.float64), torch.ones(3, 1, 1, 16, dtype=torch.float64))
    assert k_new.shape == (3, 1, 1, 16) and k_new.dtype == torch.float64


def test_cache_layers_are_independent():
    caches = KVCache.layers(3, capacity=2)
    assert len(caches) == 3 and len({id(c) for c in caches}) == 3
    caches[0].append(torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2))
    assert [len(c) for c in caches] == [1, 0, 0]


CACHE_BAD = [
    ("batch size", lambda c: c.append(torch.randn(3, 2, 1, 8), torch.randn(3, 2, 1, 8))),
    ("number of kv heads", lambda c: c.append(torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8))),
    ("head_dim", lambda c: c.append(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4))),
    ("holds torch.float32 but k is torch.float64",
     lambda c: c.append(torch.randn(2, 2, 1, 8).double(), torch.randn(2, 2, 1, 8).double())),
    ("same shape", lambda c: c.append(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 2, 8))),
    ("4-D", lambda c: c.append(torch.randn(2, 1, 8), torch.randn(2, 1, 8))),
    ("must be a torch.Tensor", lambda c: c.append([1.0], torch.randn(2, 2, 1, 8))),
    ("no_grad", lambda c: c.append(torch.randn(2, 2, 1, 8, requires_grad=True), torch.randn(2, 2, 1, 8))),
]


@pytest.mark.parametrize("message,call", CACHE_BAD, ids=[m for m, _ in CACHE_BAD])
def test_cache_rejects_mismatched_appends(message, call):
    cache = KVCache()
    cache.append(torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8))
    with pytest.raises((ValueError, TypeError, RuntimeError), match=message):
        call(cache)
    assert len(cache) == 3  # a refused append leaves the cache as it was


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_cache_rejects_another_device():
    cache = KVCache()
    cache.append(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
    with pytest.raises(ValueError, match="cache is on cpu"):
        cache.append(torch.randn(1, 1, 1, 4, device="cuda"), torch.randn(1, 1, 1, 4, device="cuda"))


# --- GQAttention against the plain module ------------------------------------------------------

@pytest.mark.parametrize("n_heads,n_kv_heads,window,bias", [(6, 2, None, False), (4, 4, None, True),
                                                           (6, 1, 5, False), (6, 3, 1, True)])
def test_matches_plain_module_forward_and_gradients(device, n_heads, n_kv_heads, window, bias):
    fused, plain = make_pair(device, n_heads=n_heads, n_kv_heads=n_kv_heads, window=window, bias=bias)
    x = torch.randn(2, 13, 48, device=device, requires_grad=True)
    out = fused(x)
    expected, _, _ = plain(x)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [x] + list(fused.parameters()), grad)
    want = torch.autograd.grad(expected, [x] + list(plain.parameters()), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4)


def test_masks_bool_and_float_match_plain_module(device):
    fused, plain = make_pair(device, window=6)
    x = torch.randn(2, 9, 48, device=device)
    lengths = torch.tensor([9, 5], device=device)
    # left padding for sample 1: its first 4 keys are masked
    pad = torch.arange(9, device=device)[None] >= (9 - lengths)[:, None]
    bool_mask = pad[:, None, None, :]
    float_mask = torch.zeros(2, 1, 9, 9, device=device).masked_fill(~bool_mask, float("-inf"))
    float_mask += 0.1 * torch.randn(2, 1, 9, 9, device=device)  # a bias, not only -inf
    for mask in (bool_mask, float_mask):
        with torch.no_grad():
            out = fused(x, mask=mask)
            expected, _, _ = plain(x, mask=mask)
        # rows whose keys are all masked: zeros in fusedllm, NaN from plain softmax
        real = pad  # queries of real tokens see at least themselves
        torch.testing.assert_close(out[real], expected[real], atol=2e-5, rtol=1e-5)
        assert torch.isfinite(out).all()


def test_decoding_with_cache_matches_full_forward(device):
    fused, plain = make_pair(device, window=4)
    x = torch.randn(2, 12, 48, device=device)
    with torch.no_grad():
        full = fused(x)
        cache = KVCache(capacity=2)
        steps = [fused(x[:, :5], cache=cache)]  # prefill a chunk, then one token at a time
        steps += [fused(x[:, i:i + 1], cache=cache) for i in range(5, 12)]
        decoded = torch.cat(steps, 1)
        expected, _, _ = plain(x)
    assert len(cache) == 12 and cache.capacity >= 12
    torch.testing.assert_close(decoded, full, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(decoded, expected, atol=2e-5, rtol=1e-5)


def test_chunked_decoding_with_padding_mask_matches_plain_cache(device):
    fused, plain = make_pair(device)
    x = torch.randn(2, 10, 48, device=device)
    keep = torch.ones(2, 10, dtype=torch.bool, device=device)
    keep[1, :3] = False
    with torch.no_grad():
        cache, past, outs, refs = KVCache(), None, [], []
        for start, stop in ((0, 4), (4, 7), (7, 10)):
            mask = keep[:, None, None, :stop]
            outs.append(fused(x[:, start:stop], mask=mask, cache=cache))
            ref, _, past = plain(x[:, start:stop], mask=mask, past=past)
            refs.append(ref)
    out, ref = torch.cat(outs, 1), torch.cat(refs, 1)
    torch.testing.assert_close(out[keep], ref[keep], atol=2e-5, rtol=1e-5)


def test_position_offset_shifts_rope_only(device):
    fused, plain = make_pair(device)
    x = torch.randn(1, 6, 48, device=device)
    with torch.no_grad():
        # RoPE is relative: the same offset for every token leaves the output unchanged
        torch.testing.assert_close(fused(x, position_offset=100), fused(x), atol=1e-4, rtol=1e-4)
        cache = KVCache()
        fused(x[:, :3], cache=cache)
        explicit = fused(x[:, 3:], cache=cache, position_offset=3)
        cache.reset()
        fused(x[:, :3], cache=cache)
        implicit = fused(x[:, 3:], cache=cache)
    torch.testing.assert_close(explicit, implicit, rtol=0, atol=0)


def test_without_rope_matches_plain_module(device):
    fused, plain = make_pair(device, rope=False)
    assert fused.rotary is None
    x = torch.randn(2, 7, 48, device=device)
    with torch.no_grad():
        expected, _, _ = plain(x, rope=False)
        torch.testing.assert_close(fused(x), expected, atol=2e-5, rtol=1e-5)


def test_return_weights(device):
    fused, plain = make_pair(device, window=5)
    x = torch.randn(2, 8, 48, device=device)
    mask = torch.ones(2, 1, 1, 8, dtype=torch.bool, device=device)
    mask[0, ..., :2] = False
    with torch.no_grad():
        out, weights = fused(x, mask=mask, return_weights=True)
        _, expected_weights, _ = plain(x, mask=mask)
        fast = fused(x, mask=mask)
    assert weights.shape == (2, 6, 8, 8)
    real = torch.ones(2, 8, dtype=torch.bool, device=device)
    real[0, :2] = False
    torch.testing.assert_close(weights[real[:, None].expand(2, 6, 8)],
                               expected_weights[real[:, None].expand(2, 6, 8)], atol=1e-6, rtol=1e-5)
    # queries that see nothing have zero weights and zero attention output, like the fused op
    assert torch.all(weights[0, :, :2] == 0)
    torch.testing.assert_close(out, fast, atol=2e-5, rtol=1e-5)
    assert torch.allclose(weights.sum(-1)[real[:, None].expand(2, 6, 8)], torch.ones(()), atol=1e-5)


def test_dropout_only_in_training(device):
    fused, _ = make_pair(device, dropout=0.5)
    x = torch.randn(2, 9, 48, device=device)
    with torch.no_grad():
        fused.eval()
        a, b = fused(x), fused(x)
        fused.dropout = 0.0
        no_dropout = fused(x)
        fused.dropout = 0.5
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, no_dropout, rtol=0, atol=0)
        fused.train()
        torch.manual_seed(3)
        c = fused(x)
        torch.manual_seed(3)
        d = fused(x)
        e = fused(x)
    assert not torch.allclose(c, no_dropout, atol=1e-3)
    torch.testing.assert_close(c, d, rtol=0, atol=0)  # torch.manual_seed repeats the pattern
    assert not torch.allclose(d, e, atol=1e-3)
    # the module hands its dropout to the op, with the same draw from the generator
    with torch.no_grad():
        b_, s_ = x.shape[:2]
        q = fused.q_proj(x).view(b_, s_, 6, 8).transpose(1, 2)
        k = fused.k_proj(x).view(b_, s_, 2, 8).transpose(1, 2)
        v = fused.v_proj(x).view(b_, s_, 2, 8).transpose(1, 2)
        q, k = fused.rotary(q, k)
        torch.manual_seed(3)
        core = fusedllm.attention(q, k, v, causal=True, dropout_p=0.5)
        manual = fused.o_proj(core.transpose(1, 2).reshape(b_, s_, -1))
    torch.testing.assert_close(c, manual, atol=1e-5, rtol=1e-5)


def test_state_dict_names_and_round_trip():
    fused = GQAttention(64, 8, 2, bias=True)
    assert sorted(fused.state_dict()) == sorted(
        f"{p}_proj.{t}" for p in "qkvo" for t in ("weight", "bias"))
    assert fused.q_proj.weight.shape == (64, 64) and fused.k_proj.weight.shape == (16, 64)
    other = GQAttention(64, 8, 2, bias=True)
    other.load_state_dict(fused.state_dict())
    x = torch.randn(1, 5, 64)
    with torch.no_grad():
        torch.testing.assert_close(other(x), fused(x))
    custom = GQAttention(32, 4, 1, head_dim=16)
    assert custom.q_proj.weight.shape == (64, 32) and custom.o_proj.weight.shape == (32, 64)
    assert custom(torch.randn(2, 3, 32)).shape == (2, 3, 32)


def test_bfloat16_module_runs_close_to_float32():
    fused = GQAttention(64, 4, 2)
    x = torch.randn(2, 6, 64)
    with torch.no_grad():
        ref = fused(x)
        low = fused.to(torch.bfloat16)(x.bfloat16())
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), ref, atol=5e-2, rtol=5e-2)


MODULE_BAD = [
    ("d_model \\(50\\) must be divisible by n_heads \\(4\\)", lambda: GQAttention(50, 4)),
    ("n_heads \\(6\\) must be a multiple of n_kv_heads \\(4\\)", lambda: GQAttention(48, 6, 4)),
    ("n_heads must be a positive int", lambda: GQAttention(48, 0)),
    ("n_kv_heads must be a positive int", lambda: GQAttention(48, 4, 0)),
    ("d_model must be a positive int", lambda: GQAttention(48.0, 4)),
    ("even head_dim", lambda: GQAttention(45, 3, head_dim=15)),
    ("dropout must be a number in \\[0, 1\\)", lambda: GQAttention(48, 4, dropout=1.0)),
    ("window must be a positive int", lambda: GQAttention(48, 4, window=0)),
    ("x must be \\[batch, seq, d_model=48\\]", lambda: GQAttention(48, 4)(torch.randn(2, 5, 40))),
    ("x must be \\[batch, seq, d_model=48\\]", lambda: GQAttention(48, 4)(torch.randn(5, 48))),
    ("cache must be a fusedllm.nn.KVCache", lambda: GQAttention(48, 4)(torch.randn(1, 2, 48), cache=[])),
    ("position_offset must be an int >= 0", lambda: GQAttention(48, 4)(torch.randn(1, 2, 48), position_offset=-1)),
    ("mask of shape \\[3, 3\\] does not broadcast",
     lambda: GQAttention(48, 4)(torch.randn(1, 2, 48), mask=torch.ones(3, 3, dtype=torch.bool))),
    ("mask of shape \\[3, 3\\] does not broadcast",
     lambda: GQAttention(48, 4)(torch.randn(1, 2, 48), mask=torch.ones(3, 3, dtype=torch.bool),
                                return_weights=True)),
]


@pytest.mark.parametrize("message,call", MODULE_BAD, ids=[m for m, _ in MODULE_BAD])
def test_bad_arguments_are_clear_errors(message, call):
    with pytest.raises((ValueError, TypeError), match=message):
        call()


def test_decoding_with_grad_enabled_is_an_error_that_says_what_to_do():
    fused = GQAttention(48, 4)
    with pytest.raises(RuntimeError, match="torch.no_grad"):
        fused(torch.randn(1, 2, 48), cache=KVCache())


@pytest.mark.slow
def test_torch_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()
    fused = GQAttention(48, 6, 2, window=5).to(device)
    x = torch.randn(2, 11, 48, device=device, requires_grad=True)
    mask = torch.ones(2, 1, 1, 11, dtype=torch.bool, device=device)
    mask[1, ..., :3] = False
    compiled = torch.compile(fused, fullgraph=True)
    out_c = compiled(x, mask=mask)
    out_c.square().sum().backward()
    grads_c = [x.grad.clone()] + [p.grad.clone() for p in fused.parameters()]
    x.grad = None
    fused.zero_grad()
    out_e = fused(x, mask=mask)
    out_e.square().sum().backward()
    grads_e = [x.grad] + [p.grad for p in fused.parameters()]
    torch.testing.assert_close(out_c, out_e)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b)
