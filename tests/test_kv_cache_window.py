"""nn.KVCache(window=W, sink=s): the ring buffer of a sliding-window layer with
StreamingLLM's sink positions. Decoding in steps of every size (one token,
chunks shorter and longer than the window) against attention over the whole
sequence with the same visibility; the ring's storage, order and wrap-around;
the modules over it; errors."""

import pytest
import torch

from fusedllm.nn import GQAttention, KVCache

from checks import FORWARD_TOL, assert_close
from reference import streaming_attention


def decode(cache, q, k, v, steps, window=None):
    outs, start = [], 0
    for n in steps:
        outs.append(cache.attend(q[:, :, start:start + n], k[:, :, start:start + n], v[:, :, start:start + n],
                                 window=window))
        start += n
    return torch.cat(outs, dim=2)


STEPS = {
    "tokens": [1] * 29,
    "prefill then tokens": [5] + [1] * 24,
    "chunks": [3, 2, 7, 1, 4, 1, 1, 6, 4],
    "chunks past the window": [11, 1, 13, 4],
}


@pytest.mark.parametrize("sink", [0, 2])
@pytest.mark.parametrize("steps", list(STEPS), ids=list(STEPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ring_decoding_matches_the_whole_sequence(device, dtype, steps, sink):
    torch.manual_seed(0)
    window, total = 6, sum(STEPS[steps])
    q = torch.randn(2, 4, total, 16, device=device, dtype=dtype)
    k = torch.randn(2, 2, total, 16, device=device, dtype=dtype)
    v = torch.randn(2, 2, total, 16, device=device, dtype=dtype)
    cache = KVCache(window=window, sink=sink)
    with torch.no_grad():
        out = decode(cache, q, k, v, STEPS[steps])
    assert_close(out, streaming_attention(q, k, v, window, sink), FORWARD_TOL[dtype], "ring decode", upcast=True)
    # memory: the sink positions and the ring, whatever the length
    assert cache.capacity == sink + window and len(cache) == total


@pytest.mark.parametrize("sink", [0, 3])
def test_ring_holds_the_last_positions_in_order_at_every_offset(sink):
    window = 5
    cache = KVCache(window=window, sink=sink)
    for step in range(23):  # every wrap-around offset, several times
        k = torch.full((1, 1, 1, 2), float(step))
        cache.append(k, -k)
        expected = sorted(set(range(min(sink, step + 1))) | set(range(max(0, step + 1 - window), step + 1)))
        assert cache.positions == expected
        assert cache.keys[0, 0, :, 0].tolist() == [float(p) for p in expected]
        assert cache.values[0, 0, :, 0].tolist() == [-float(p) for p in expected]
    cache.reset()
    assert len(cache) == 0 and cache.positions == [] and cache.keys.shape[2] == 0


@pytest.mark.parametrize("window", [None, 3])
def test_cache_filled_under_inference_mode_keeps_its_positions(window):
    """Storage made under torch.inference_mode() cannot be written outside it:
    the cache copies it then, keeping every position held."""
    cache = KVCache(capacity=8, window=window)
    with torch.inference_mode():
        for step in range(5):
            cache.append(*(torch.full((1, 1, 1, 2), float(step)),) * 2)
    with torch.no_grad():
        cache.append(*(torch.full((1, 1, 1, 2), 5.0),) * 2)
    expected = list(range(6)) if window is None else [3, 4, 5]
    assert cache.positions == expected
    assert cache.keys[0, 0, :, 0].tolist() == [float(p) for p in expected]


def test_narrower_layer_window_and_module_decoding(device):
    torch.manual_seed(0)
    layer = GQAttention(48, 4, n_kv_heads=2, window=4).to(device).eval()
    x = torch.randn(2, 20, 48, device=device)
    with torch.no_grad():
        full = layer(x)  # the whole sequence, window 4
        for cache in (KVCache(window=4), KVCache(window=9)):  # the cache may keep more than needed
            steps = [layer(x[:, :7], cache=cache)] + [layer(x[:, i:i + 1], cache=cache) for i in range(7, 20)]
            torch.testing.assert_close(torch.cat(steps, 1), full, atol=2e-5, rtol=1e-5)


def test_window_cache_module_without_its_own_window_is_streaming(device):
    """A layer without a window over a window cache attends to the sink
    positions and the last `window` ones (StreamingLLM)."""
    torch.manual_seed(0)
    layer = GQAttention(32, 2, rope=False).to(device).eval()
    x = torch.randn(1, 15, 32, device=device)
    cache = KVCache(window=4, sink=1)
    with torch.no_grad():
        out = torch.cat([layer(x[:, i:i + 1], cache=cache) for i in range(15)], 1)
        q = layer.q_proj(x).view(1, 15, 2, 16).transpose(1, 2)
        k = layer.k_proj(x).view(1, 15, 2, 16).transpose(1, 2)
        v = layer.v_proj(x).view(1, 15, 2, 16).transpose(1, 2)
        ref = layer.o_proj(streaming_attention(q, k, v, 4, 1).float().transpose(1, 2).reshape(1, 15, 32))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("make, message", [
    (lambda: KVCache(window=0), "window must be None or a positive int"),
    (lambda: KVCache(window=4, sink=-1), "sink must be an int >= 0"),
    (lambda: KVCache(sink=2), "sink=2 needs a window"),
    (lambda: KVCache(window=3).attend(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4),
                                      window=4),
     "the layer's window \\(4\\) is wider than the cache's \\(3\\)"),
    (lambda: KVCache(window=3).attend(torch.randn(1, 1, 2, 4), torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4)),
     "q must be \\[batch, q_heads, new_len, head_dim\\] with k's batch and new_len"),
    (lambda: GQAttention(16, 2)(torch.randn(1, 2, 16), mask=torch.ones(1, 1, 2, 2, dtype=torch.bool),
                                cache=KVCache(window=4)),
     "mask cannot be combined with a KVCache with a window"),
    (lambda: GQAttention(16, 2)(torch.randn(1, 2, 16), return_weights=True, cache=KVCache(window=4)),
     "return_weights=True needs a KVCache without a window or int8 storage"),
])
def test_window_cache_errors(make, message):
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        make()
