"""The Python layers never wait for the GPU: no argument check reads a CUDA
tensor's values on the host (the kernels check positions themselves), so a
forward and backward pass queues its work without a device-to-host sync."""

import pytest
import torch

import fusedllm
from fusedllm.nn import GQAttention, KVCache, RotaryEmbedding

from conftest import HAS_CUDA

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")]


def test_ops_and_modules_do_not_sync():
    dev = "cuda"
    x = torch.randn(2, 5, 64, device=dev, requires_grad=True)
    weight = torch.ones(64, device=dev, requires_grad=True)
    q = torch.randn(2, 4, 5, 16, device=dev, requires_grad=True)
    k = torch.randn(2, 2, 5, 16, device=dev, requires_grad=True)
    cos, sin = fusedllm.rope_tables(16, 32, device=dev)
    position_ids = torch.arange(5, device=dev).expand(2, 5)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool, device=dev)
    rotary = RotaryEmbedding(16, max_positions=32).to(dev)
    attn = GQAttention(64, 4, 2, window=3).to(dev)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        normed, residual = fusedllm.fused_add_rms_norm(x, x, weight)
        h = fusedllm.swiglu(fusedllm.rms_norm(normed, weight)) + residual[..., :32]
        rq, rk = fusedllm.apply_rope(q, k, cos, sin, position_ids=position_ids)
        rq, rk = rotary(rq, rk, position_ids=position_ids)
        o = fusedllm.attention(rq, rk, rk, causal=True, mask=mask, dropout_p=0.1)
        (h.sum() + o.sum() + attn(x, mask=mask).sum()).backward()
        with torch.no_grad():
            cache = KVCache()
            attn(x[:1], cache=cache)
            attn(x[:1, :1], cache=cache)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
