"""The CUDA SIMT forward kernels in decoding's shapes: the decoding kernel
(csrc/cuda/attention_decode.cu) for bfloat16, the general one
(csrc/cuda/attention.cu) for float32 and float64.

Over slices of the keys: when their (row tile, kv head, sequence) blocks would
leave most multiprocessors idle, as in decoding over a long cache, each block
takes one slice of the keys and a merge kernel makes the slices' outputs and
log-sum-exps one. The emulator has 4 multiprocessors, a GPU its own count;
both slice these shapes. Values, lse and gradients against the float64
reference, with every option.

The general kernel's K/V tile loads: 16 bytes at a time where the pointer,
strides and head dim allow, else an element at a time; both give the same
result."""

import pytest
import torch

import fusedllm
from checks import FORWARD_TOL, assert_close
from conftest import DEVICES
from reference import attention as ref_attention
from reference import dequantize_kv
from test_attention import make_qkv
from test_attention_options import _differentiable, check_against_reference, make_options, make_sinks
from test_attention_tensor_core import check_ran, launches, op_lse

pytestmark = pytest.mark.parametrize("device", [d for d in DEVICES if not isinstance(d, str)], indirect=True)

FORWARD, DECODE, MERGE = "attention_forward_kernel", "attention_decode_kernel", "attention_merge_kernel"

# (batch, q heads, kv heads, q len, k len, head dim): one or two kv-head
# blocks, so fewer than the emulator's 4 multiprocessors.
SHAPES = [(1, 8, 2, 1, 700, 64), (1, 4, 2, 3, 1000, 32), (1, 4, 1, 1, 4099, 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("option", ["none", "causal", "sinks", "all"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_key_slices_match_reference(device, shape, option, dtype):
    check_option_case(device, shape, option, dtype, [DECODE if dtype == torch.bfloat16 else FORWARD, MERGE])


def check_option_case(device, shape, option, dtype, ran, absent=()):
    """attention over make_qkv(*shape) with an option case ("none", "causal",
    "sinks", "all"): the kernels `ran` ran and `absent` did not; out,
    gradients and lse against the float64 reference."""
    b, hq = shape[:2]
    q, k, v = make_qkv(*shape, dtype, device, requires_grad=True)
    options = {} if option in ("none", "causal") else make_options(option, b, hq, device)
    causal = option in ("causal", "all")
    with launches() as counts:
        out = fusedllm.attention(q, k, v, causal=causal, **options)
    check_ran(counts, *ran, absent=absent)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, _differentiable(q, k, v, options), grad_out)
    check_against_reference(q, k, v, out, grad_out, grads, dtype, causal=causal, **options)
    _, ref_lse = ref_attention(q.double(), k.double(), v.double(), causal=causal, **options)
    lse = op_lse(q, k, v, causal=causal, **options)
    assert_close(lse, ref_lse.detach(), FORWARD_TOL[torch.float64 if dtype == torch.float64 else torch.float32],
                 "lse", upcast=True)


def test_slices_and_rows_without_keys(device):
    """A window of two keys leaves every slice but the last without a key: they
    weigh nothing. A row the mask hides every key from has out 0 and lse = its
    sink."""
    q, k, v = make_qkv(1, 4, 1, 2, 1000, 32, torch.float32, device)
    sinks = make_sinks(4, device)
    keep = torch.ones(2, 1000, dtype=torch.bool, device=device)
    keep[0] = False
    for options in (dict(window=(1, 0)), dict(mask=keep)):
        with launches() as counts:
            out = fusedllm.attention(q, k, v, sinks=sinks, **options)
        check_ran(counts, MERGE)
        ref_out, ref_lse = ref_attention(q.double(), k.double(), v.double(), sinks=sinks, **options)
        assert_close(out, ref_out, FORWARD_TOL[torch.float32], "out", upcast=True)
        lse = op_lse(q, k, v, sinks=sinks, **options)
        assert_close(lse, ref_lse, FORWARD_TOL[torch.float32], "lse", upcast=True)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    torch.testing.assert_close(lse[0, :, 0], sinks.detach())


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "float64", "int8", "float8"])
@pytest.mark.parametrize("layout", ["offset", "row_stride"])
def test_kv_loads_one_element_at_a_time_equal_wide_loads(device, kind, layout, monkeypatch):
    """Contiguous K/V from torch's allocator are read 16 bytes at a time; the
    same values one element past an aligned address, or in rows whose stride
    is not a multiple of 16 bytes, one element at a time. The arithmetic after
    the loads is the same, so the outputs are equal, bit for bit. (20 query
    rows a kv head: the general kernel, which the unaligned rows take too.)"""
    monkeypatch.setenv("FUSEDLLM_CUDA_ATTENTION", "simt")
    b, hq, hkv, sq, sk, d = 2, 8, 2, 5, 300, 128
    dtype = {"float64": torch.float64, "float32": torch.float32}.get(kind, torch.bfloat16)
    q = torch.randn(b, hq, sq, d, device=device, dtype=dtype)
    k = torch.randn(b, hkv, sk, d, device=device, dtype=dtype)
    v = torch.randn(b, hkv, sk, d, device=device, dtype=dtype)
    kwargs = {}
    if kind in ("int8", "float8"):
        code = torch.int8 if kind == "int8" else torch.float8_e4m3fn
        (k, kwargs["k_scale"]), (v, kwargs["v_scale"]) = (fusedllm.quantize_kv(t, dtype=code) for t in (k, v))

    def unaligned(t):
        if layout == "offset":
            flat = torch.zeros(t.numel() + 1, dtype=t.dtype, device=device)
            moved = flat[1:].view(t.shape)
        else:
            moved = torch.zeros(*t.shape[:-1], d + 1, dtype=t.dtype, device=device)[..., :d]
        moved.copy_(t)
        return moved

    with torch.no_grad(), launches() as counts:
        wide = fusedllm.attention(q, k, v, causal=True, **kwargs)
        narrow = fusedllm.attention(q, unaligned(k), unaligned(v), causal=True, **kwargs)
    check_ran(counts, FORWARD, absent=(DECODE,))
    assert torch.equal(wide, narrow)
    if kind in ("int8", "float8"):
        k, v = dequantize_kv(k, kwargs["k_scale"]), dequantize_kv(v, kwargs["v_scale"])
    want, _ = ref_attention(q.double(), k.double(), v.double(), causal=True)
    assert_close(wide, want, FORWARD_TOL[dtype], "out", upcast=True)
