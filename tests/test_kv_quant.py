"""int8 and float8 (e4m3) keys and values: quantize_kv against
tests/reference.py, and attention over quantized K/V (dequantized as its
kernels load each tile) against attention over the dequantized rows, and
within the stated bound of attention over the float rows the cache was made
from; errors, opcheck and torch.compile."""

import math

import pytest
import torch

import checks
import fusedllm
from checks import FORWARD_TOL
from conftest import cpu_variants
from reference import attention as ref_attention
from reference import attention_varlen as ref_attention_varlen
from reference import dequantize_kv, quantized_attention_error_bound, streaming_attention
from reference import quantize_kv as ref_quantize_kv

ops = torch.ops.fusedllm
FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
Q_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CODES = [torch.int8, torch.float8_e4m3fn]


def quantized(k, v, code=torch.int8):
    k8, k_scale = fusedllm.quantize_kv(k, dtype=code)
    v8, v_scale = fusedllm.quantize_kv(v, dtype=code)
    return k8, k_scale, v8, v_scale


# --- quantize_kv -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 64), (2, 3, 5, 128), (1, 2, 4, 130), (2, 1, 0, 16)])
def test_quantize_kv_matches_reference(device, dtype, shape):
    x = (torch.randn(shape, device=device) * 3).to(dtype)
    values, scales = fusedllm.quantize_kv(x)
    want_values, want_scales = ref_quantize_kv(x)
    assert values.dtype == torch.int8 and scales.dtype == torch.float32
    assert values.shape == x.shape and scales.shape == x.shape[:-1]
    torch.testing.assert_close(scales, want_scales, atol=0, rtol=0)
    torch.testing.assert_close(values, want_values, atol=0, rtol=0)
    # every entry within half a step of x (float rounding of the step aside)
    error = (dequantize_kv(values, scales) - x.float()).abs()
    assert (error <= scales.unsqueeze(-1) * (0.5 + 1e-5)).all()


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 64), (2, 3, 5, 128), (1, 2, 4, 130), (2, 1, 0, 16)])
def test_quantize_kv_float8_matches_reference(device, dtype, shape):
    """float8 e4m3 codes: torch's rounding, bit for bit; each entry within 2^-4
    of itself (2^-10 scales below 2^-6 scales: the subnormal codes)."""
    x = (torch.randn(shape, device=device) * torch.exp(torch.randn(shape, device=device) * 2)).to(dtype)
    values, scales = fusedllm.quantize_kv(x, dtype=torch.float8_e4m3fn)
    want_values, want_scales = ref_quantize_kv(x, torch.float8_e4m3fn)
    assert values.dtype == torch.float8_e4m3fn and values.shape == x.shape
    torch.testing.assert_close(scales, want_scales, atol=0, rtol=0)
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    error = (dequantize_kv(values, scales) - x.float()).abs()
    s = scales.unsqueeze(-1)
    assert (error <= torch.maximum(x.float().abs() * 2**-4, s * 2**-10) * (1 + 1e-5)).all()


def test_quantize_kv_float8_rounds_every_code_and_tie():
    """Every code's value, the midpoints between neighbours (ties to the even
    code) and points just off them, in a row whose max makes the scale 1."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[codes.isfinite()].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    points = torch.cat([finite, mids, mids.nextafter(torch.tensor(math.inf)), mids.nextafter(torch.tensor(-math.inf))])
    x = torch.cat([torch.tensor([448.0]), points])  # max|x| = 448: scale 1
    values, scales = fusedllm.quantize_kv(x, dtype=torch.float8_e4m3fn)
    assert scales.item() == 1.0
    assert torch.equal(values.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))


def test_quantize_kv_writes_into_cache_slots(device):
    cache = torch.full((2, 3, 10, 32), 99, dtype=torch.int8, device=device)
    cache_scales = torch.full((2, 3, 10), -1.0, device=device)
    x = torch.randn(2, 4, 3, 32, device=device).transpose(1, 2)  # [2, 3, 4, 32], not contiguous
    values, scales = fusedllm.quantize_kv(x, cache[:, :, 3:7], cache_scales[:, :, 3:7])
    assert values.data_ptr() == cache[:, :, 3:7].data_ptr()
    want_values, want_scales = ref_quantize_kv(x)
    torch.testing.assert_close(cache[:, :, 3:7], want_values, atol=0, rtol=0)
    torch.testing.assert_close(cache_scales[:, :, 3:7], want_scales, atol=0, rtol=0)
    untouched = torch.ones(10, dtype=torch.bool)
    untouched[3:7] = False
    assert (cache[:, :, untouched] == 99).all() and (cache_scales[:, :, untouched] == -1).all()


@pytest.mark.parametrize("code", CODES, ids=str)
def test_quantize_kv_zero_and_non_finite_rows(device, code):
    x = torch.randn(5, 40, device=device)
    x[1] = 0
    x[2, 7] = float("inf")
    x[3, 0] = float("nan")
    x[4, 39] = float("-inf")
    values, scales = fusedllm.quantize_kv(x, dtype=code)
    assert scales[1] == 0 and (values[1].float() == 0).all()
    assert torch.isnan(scales[2:]).all()
    want_values, want_scales = ref_quantize_kv(x[:1], code)
    assert torch.equal(values[:1].view(torch.uint8), want_values.view(torch.uint8))
    torch.testing.assert_close(scales[:1], want_scales, atol=0, rtol=0)
    # attention over a row whose scale is NaN gives NaN, as over the float row
    k8 = values[None, None, 2:3].contiguous()
    k_scale = scales[None, None, 2:3].contiguous()
    q = torch.randn(1, 1, 1, 40, device=device)
    with torch.no_grad():
        out = fusedllm.attention(q, k8, k8, k_scale=k_scale, v_scale=k_scale)
    assert torch.isnan(out).all()


QUANTIZE_ERRORS = [
    (lambda d: (torch.randn(4, 8, device=d).long(),), "x must be float32, float64, bfloat16 or float16"),
    (lambda d: (torch.randn(1, 2, 3, 4, 5, device=d),), "x must have 1 to 4 dims"),
    (lambda d: (torch.randn(4, 8, device=d), torch.empty(4, 8, device=d), torch.empty(4, device=d)),
     "values must be int8 or float8_e4m3fn"),
    (lambda d: (torch.randn(4, 8, device=d), torch.empty(4, 8, dtype=torch.int8, device=d),
                torch.empty(4, dtype=torch.float16, device=d)), "scales must be float32"),
    (lambda d: (torch.randn(4, 8, device=d), torch.empty(4, 7, dtype=torch.int8, device=d),
                torch.empty(4, device=d)), r"values must have x's shape \[4, 8\]"),
    (lambda d: (torch.randn(4, 8, device=d), torch.empty(4, 8, dtype=torch.int8, device=d),
                torch.empty(4, 1, device=d)), r"scales must be x's shape without its last dim \[4\]"),
    (lambda d: (torch.randn(4, 8, device=d), torch.empty(1, 8, dtype=torch.int8, device=d).expand(4, 8),
                torch.empty(4, device=d)), "values has elements that share memory"),
]


@pytest.mark.parametrize("index", range(len(QUANTIZE_ERRORS)))
def test_quantize_kv_errors(device, index):
    make, message = QUANTIZE_ERRORS[index]
    with pytest.raises(ValueError, match=message):
        fusedllm.quantize_kv(*make(device))


def test_quantize_kv_takes_values_and_scales_together():
    with pytest.raises(ValueError, match="values and scales go together"):
        fusedllm.quantize_kv(torch.randn(4, 8), torch.empty(4, 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="dtype=torch.float8_e4m3fn but values is torch.int8"):
        fusedllm.quantize_kv(torch.randn(4, 8), torch.empty(4, 8, dtype=torch.int8), torch.empty(4),
                             dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="dtype must be None, torch.int8 or torch.float8_e4m3fn"):
        fusedllm.quantize_kv(torch.randn(4, 8), dtype=torch.uint8)


# --- attention over int8 K/V -------------------------------------------------------------

# (batch, q_heads, kv_heads, q_len, kv_len, head_dim): prefill, decoding over a
# long cache (the keys split across threads), chunks, small, large and odd head dims;
# decoding steps of 8 query rows (the most the CPU decoding products take) with
# head dim 256 and with 2 positions.
SHAPES = [
    (2, 4, 2, 17, 17, 64),
    (1, 8, 2, 1, 2100, 128),
    (1, 4, 1, 33, 300, 80),
    (2, 2, 2, 1, 5, 16),
    (1, 2, 1, 40, 40, 256),
    (1, 4, 2, 5, 40, 33),
    (1, 4, 2, 1, 70, 33),
    (1, 8, 1, 1, 300, 256),
    (1, 8, 2, 2, 200, 64),
]
MASKS = [(False, None), (True, None), (True, 7)]


@pytest.mark.parametrize("code", CODES, ids=str)
@pytest.mark.parametrize("dtype", Q_DTYPES)
@pytest.mark.parametrize("shape", cpu_variants(SHAPES, (1, 8, 2, 1, 2100, 128), (1, 2, 1, 40, 40, 256)),
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal,window", MASKS)
def test_int8_attention_matches_dequantized(device, dtype, shape, causal, window, code):
    b, hq, hkv, sq, sk, d = shape
    q = torch.randn(b, hq, sq, d, device=device).to(dtype)
    k8, k_scale, v8, v_scale = quantized(torch.randn(b, hkv, sk, d, device=device),
                                         torch.randn(b, hkv, sk, d, device=device), code)
    with torch.no_grad():
        out = fusedllm.attention(q, k8, v8, causal=causal, window=window, k_scale=k_scale, v_scale=v_scale)
    assert out.dtype == dtype and out.shape == q.shape
    # what the kernels read: the dequantized rows, in float32
    want, _ = ref_attention(q.double(), dequantize_kv(k8, k_scale).double(),
                            dequantize_kv(v8, v_scale).double(), causal=causal, window=window)
    checks.assert_close(out, want, FORWARD_TOL[dtype], "int8 attention", upcast=True)


@pytest.mark.parametrize("code", CODES, ids=str)
@pytest.mark.parametrize("shape,window", [((1, 8, 2, 1, 2100, 128), 700), ((2, 4, 1, 2, 1000, 64), 333),
                                          ((1, 4, 2, 1, 530, 32), 1)])
def test_int8_decoding_over_partly_and_fully_visible_tiles(device, shape, window, code):
    """A decoding step whose window starts inside a key tile: that tile is masked,
    the following ones are whole (the CPU runs the two kinds differently)."""
    b, hq, hkv, sq, sk, d = shape
    q = torch.randn(b, hq, sq, d, device=device).bfloat16()
    k8, k_scale, v8, v_scale = quantized(torch.randn(b, hkv, sk, d, device=device),
                                         torch.randn(b, hkv, sk, d, device=device), code)
    with torch.no_grad():
        out = fusedllm.attention(q, k8, v8, causal=True, window=window, k_scale=k_scale, v_scale=v_scale)
    want, _ = ref_attention(q.double(), dequantize_kv(k8, k_scale).double(),
                            dequantize_kv(v8, v_scale).double(), causal=True, window=window)
    checks.assert_close(out, want, FORWARD_TOL[torch.bfloat16], "int8 decoding", upcast=True)


@pytest.mark.parametrize("code", CODES, ids=str)
@pytest.mark.parametrize("where", ["q", "k_scale", "v_scale", "inf_q"])
def test_int8_decoding_non_finite_rows(device, where, code):
    """A NaN (or an infinite query) reaches exactly the output rows it feeds."""
    b, hq, hkv, sk, d = 1, 8, 2, 1200, 64
    q = torch.randn(b, hq, 1, d, device=device).bfloat16()
    k8, k_scale, v8, v_scale = quantized(torch.randn(b, hkv, sk, d, device=device),
                                         torch.randn(b, hkv, sk, d, device=device), code)
    poisoned = torch.zeros(hq, dtype=torch.bool)
    if where in ("q", "inf_q"):
        q[0, 5, 0, 3] = float("nan") if where == "q" else float("inf")
        poisoned[5] = True
    else:
        (k_scale if where == "k_scale" else v_scale)[0, 1, 700] = float("nan")
        poisoned[4:] = True  # the query heads of kv head 1
    with torch.no_grad():
        out = fusedllm.attention(q, k8, v8, k_scale=k_scale, v_scale=v_scale)
    want, _ = ref_attention(q.double(), dequantize_kv(k8, k_scale).double(), dequantize_kv(v8, v_scale).double())
    per_head = out[0, :, 0]
    assert torch.isnan(per_head[poisoned]).all()
    checks.assert_close(out[:, ~poisoned], want[:, ~poisoned], FORWARD_TOL[torch.bfloat16], "other heads",
                        upcast=True)


@pytest.mark.cpu_variants
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("sq", [1, 40])
@pytest.mark.parametrize("dtype", Q_DTYPES, ids=str)
def test_float8_nan_code_reads_as_nan(device, which, sq, dtype):
    check_float8_nan_codes(device, which, sq, dtype)


def check_float8_nan_codes(device, which, sq, dtype):
    """float8's NaN codes (0x7F, 0xFF) read as NaN under a finite scale, as
    torch's conversion reads them: NaN reaches exactly the outputs it feeds (a
    key: its kv head's every output; a value: that column of them)."""
    b, hq, hkv, sk, d = 1, 4, 2, 300, 64
    q = torch.randn(b, hq, sq, d, device=device).to(dtype)
    k8, k_scale, v8, v_scale = quantized(torch.randn(b, hkv, sk, d, device=device),
                                         torch.randn(b, hkv, sk, d, device=device), torch.float8_e4m3fn)
    codes = (k8 if which == "k" else v8).view(torch.uint8)
    codes[0, 1, 7, 5] = 0xFF
    codes[0, 1, 200, 9] = 0x7F
    with torch.no_grad():
        out = fusedllm.attention(q, k8, v8, k_scale=k_scale, v_scale=v_scale)
    want, _ = ref_attention(q.double(), dequantize_kv(k8, k_scale).double(), dequantize_kv(v8, v_scale).double())
    nan = torch.isnan(want)
    assert nan.any() and torch.equal(torch.isnan(out).cpu(), nan.cpu())
    checks.assert_close(out.masked_fill(nan, 0), want.masked_fill(nan, 0), FORWARD_TOL[torch.bfloat16],
                        "finite outputs", upcast=True)


def every_code(code):
    """Each of the code's 256 byte values once (float8's two NaN bytes as 0), as a [256] tensor."""
    bytes_ = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if code == torch.float8_e4m3fn:
        bytes_[(bytes_ & 0x7F) == 0x7F] = 0
    return bytes_.view(code)


@pytest.mark.parametrize("code", CODES, ids=str)
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d", [256, 128])
def test_every_key_code_read_exactly(device, code, q_len, dtype, d):
    check_every_key_code(device, code, q_len, dtype, d)


def check_every_key_code(device, code, q_len, dtype, d):
    """Keys holding every code, d of them a key: a one-hot query's log-sum-exp
    is that code's value times the softmax scale, exactly (decoding and
    prefill tiles; the decoding kernels take head dims up to 128)."""
    codes = every_code(code)
    want = dequantize_kv(codes.view(1, 256), torch.ones(1)).view(256).double() / 16
    ones = torch.ones(1, 1, 1, device=device)
    v8 = torch.zeros(1, 1, 1, d, dtype=code, device=device)
    for first in range(0, 256, d):
        k8 = codes[first:first + d].reshape(1, 1, 1, d).to(device)
        for dims in torch.arange(d).view(-1, 8):
            q = torch.zeros(1, 8, q_len, d, device=device)
            q[0, torch.arange(8), :, dims] = 1.0
            with torch.no_grad():
                _, lse = fusedllm.ops.attention.attention_with_lse(q.to(dtype), k8, v8, k_scale=ones, v_scale=ones,
                                                                   scale=1 / 16)
            got = lse[0, :, 0].double().cpu()
            assert torch.equal(got, want[first + dims]), \
                f"codes {(first + dims).tolist()}: {got.tolist()} != {want[first + dims].tolist()}"


@pytest.mark.parametrize("code", CODES, ids=str)
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_every_value_code_read_exactly(device, code, q_len, dtype):
    check_every_value_code(device, code, q_len, dtype)


def check_every_value_code(device, code, q_len, dtype):
    """Value rows holding every code, and keys that put all of each query's
    weight on one row: the output is that row's values, exactly."""
    codes = every_code(code).view(16, 16)
    v8 = codes.view(1, 1, 16, 16).to(device)
    # key j: 448 in dim j (float8's largest; int8: 127), so query e_j scores it far above the rest
    top = 127 if code == torch.int8 else 448.0
    k = torch.zeros(16, 16)
    k[torch.arange(16), torch.arange(16)] = top
    k8 = k.to(code).view(1, 1, 16, 16).to(device)
    ones = torch.ones(1, 1, 16, device=device)
    want = dequantize_kv(codes, torch.ones(16)).to(dtype)
    for rows in torch.arange(16).view(2, 8):
        q = torch.zeros(1, 8, q_len, 16, device=device)
        q[0, torch.arange(8), :, rows] = 4.0
        with torch.no_grad():
            out = fusedllm.attention(q.to(dtype), k8, v8, k_scale=ones, v_scale=ones)
        assert torch.equal(out[0, :, 0].cpu(), want[rows]), f"rows {rows.tolist()}"


@pytest.mark.parametrize("code", CODES, ids=str)
@pytest.mark.parametrize("dtype", Q_DTYPES)
@pytest.mark.parametrize("outliers", [False, True])
def test_int8_attention_within_stated_bound(device, dtype, outliers, code):
    """Against attention over the float rows themselves (a float cache)."""
    for b, hq, hkv, sq, sk, d in [(1, 8, 2, 1, 1500, 128), (2, 4, 2, 33, 33, 64)]:
        q = torch.randn(b, hq, sq, d, device=device)
        k = torch.randn(b, hkv, sk, d, device=device)
        v = torch.randn(b, hkv, sk, d, device=device)
        if outliers:  # a few large channels, as keys after RoPE often have
            k[..., :3] *= 12
            v[..., 5] *= 8
        q = q.to(dtype)
        k8, k_scale, v8, v_scale = quantized(k, v, code)
        with torch.no_grad():
            out = fusedllm.attention(q, k8, v8, causal=True, k_scale=k_scale, v_scale=v_scale)
        exact, _ = ref_attention(q.double(), k.double(), v.double(), causal=True)
        rounding = {torch.float32: 1e-5, torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
        bound = (quantized_attention_error_bound(q, v, k_scale, v_scale, code=code)
                 + rounding * exact.abs().max().item())
        error = (out.double() - exact).abs().max().item()
        assert error <= bound, f"{(b, hq, hkv, sq, sk, d)}: error {error:.3g} above the bound {bound:.3g}"


@pytest.mark.cpu_variants
@pytest.mark.parametrize("code", CODES, ids=str)
@pytest.mark.parametrize("option", ["softcap", "sinks", "alibi", "bool_mask", "float_mask", "strided"])
def test_int8_attention_options(device, option, code):
    """The options run as over float K/V: equal to the same op over the dequantized rows."""
    b, hq, hkv, sq, sk, d = 2, 4, 2, 9, 70, 32
    q = torch.randn(b, hq, sq, d, device=device)
    k = torch.randn(b, hkv, sk, d, device=device)
    v = torch.randn(b, hkv, sk, d, device=device)
    k8, k_scale, v8, v_scale = quantized(k, v, code)
    kwargs = dict(causal=True)
    if option == "softcap":
        kwargs["softcap"] = 5.0
    elif option == "sinks":
        kwargs["sinks"] = torch.randn(hq, device=device)
    elif option == "alibi":
        kwargs["alibi_slopes"] = torch.rand(hq, device=device)
    elif option == "bool_mask":
        kwargs["mask"] = torch.rand(b, 1, sq, sk, device=device) > 0.3
    elif option == "float_mask":
        kwargs["mask"] = torch.randn(1, hq, sq, sk, device=device)
    elif option == "strided":
        # slots of a larger cache: every tensor a strided view
        big_k = torch.zeros(b, hkv, sk + 30, d + 8, dtype=code, device=device)
        big_s = torch.zeros(b, hkv, sk + 30, device=device)
        big_k[:, :, 10:10 + sk, :d] = k8
        big_s[:, :, 10:10 + sk] = k_scale
        k8, k_scale = big_k[:, :, 10:10 + sk, :d], big_s[:, :, 10:10 + sk]
    with torch.no_grad():
        out = fusedllm.attention(q, k8, v8, k_scale=k_scale, v_scale=v_scale, **kwargs)
        want = fusedllm.attention(q, dequantize_kv(k8, k_scale), dequantize_kv(v8, v_scale), **kwargs)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=2e-6)


@pytest.mark.cpu_variants
def test_int8_attention_varlen(device):
    hq, hkv, d = 4, 2, 64
    cu_q = torch.tensor([0, 1, 4, 5], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 300, 304, 404], dtype=torch.int32, device=device)
    q = torch.randn(5, hq, d, device=device).bfloat16()
    k8, k_scale, v8, v_scale = quantized(torch.randn(404, hkv, d, device=device),
                                         torch.randn(404, hkv, d, device=device))
    assert k_scale.shape == (404, hkv)
    with torch.no_grad():
        out = fusedllm.attention_varlen(q, k8, v8, cu_q, cu_k, causal=True, k_scale=k_scale, v_scale=v_scale)
    want, _ = ref_attention_varlen(q.double(), dequantize_kv(k8, k_scale).double(),
                                   dequantize_kv(v8, v_scale).double(), cu_q, cu_k, causal=True)
    checks.assert_close(out, want, FORWARD_TOL[torch.bfloat16], upcast=True)


def _int8_args(device, q_dtype=torch.float32, b=1, hkv=2, sk=6, d=16, code=torch.int8):
    q = torch.randn(b, 2 * hkv, 3, d, device=device, dtype=q_dtype)
    k8, k_scale, v8, v_scale = quantized(torch.randn(b, hkv, sk, d, device=device),
                                         torch.randn(b, hkv, sk, d, device=device), code)
    return q, k8, v8, k_scale, v_scale


def _call(q, k, v, k_scale=None, v_scale=None):
    with torch.no_grad():
        return fusedllm.attention(q, k, v, k_scale=k_scale, v_scale=v_scale)


ATTENTION_ERRORS = [
    (lambda q, k, v, ks, vs: (q, k, v.float(), ks, vs), r"k and v are int8 \(or float8_e4m3fn\) together or not"),
    (lambda q, k, v, ks, vs: (q, k, v.float().to(torch.float8_e4m3fn), ks, vs),
     r"together or not at all, got k torch.int8 and v torch.float8_e4m3fn"),
    (lambda q, k, v, ks, vs: (q, k.float(), v.float(), ks, vs), r"are the scales of int8 \(or float8_e4m3fn\) k"),
    (lambda q, k, v, ks, vs: (q, k, v, None, None), "torch.int8 k and v need k_scale and v_scale"),
    (lambda q, k, v, ks, vs: (q, k, v, ks, None), "torch.int8 k and v need k_scale and v_scale"),
    (lambda q, k, v, ks, vs: (q.double(), k, v, ks, vs), "q must be float32, bfloat16 or float16"),
    (lambda q, k, v, ks, vs: (q, k, v, ks[:, :, :-1], vs),
     r"k_scale must be \[batch, kv_heads, kv_len\] = \[1, 2, 6\]"),
    (lambda q, k, v, ks, vs: (q, k, v, ks, vs.half()), "v_scale must be float32"),
]


@pytest.mark.parametrize("index", range(len(ATTENTION_ERRORS)))
def test_int8_attention_errors(device, index):
    make, message = ATTENTION_ERRORS[index]
    args = make(*_int8_args(device))
    with pytest.raises(ValueError, match=message):
        _call(*args)


def test_int8_attention_has_no_backward(device):
    q, k8, v8, k_scale, v_scale = _int8_args(device)
    q.requires_grad_()
    with pytest.raises(ValueError, match="for inference and have no backward"):
        fusedllm.attention(q, k8, v8, k_scale=k_scale, v_scale=v_scale)
    with torch.no_grad():  # the same call for inference
        fusedllm.attention(q, k8, v8, k_scale=k_scale, v_scale=v_scale)


# --- nn.KVCache(dtype=torch.int8) --------------------------------------------------------

CACHE_STEPS = {"tokens": [1] * 21, "prefill then tokens": [9] + [1] * 12, "chunks": [3, 7, 1, 4, 1, 5]}


@pytest.mark.parametrize("window,sink", [(None, 0), (6, 0), (6, 2)])
@pytest.mark.parametrize("steps", list(CACHE_STEPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("code", CODES, ids=str)
def test_int8_cache_decoding_equals_attention_over_its_rows(device, dtype, steps, window, sink, code):
    """Step by step over an int8 cache (capacity 4: it grows) equals attention
    over the whole sequence of the dequantized rows, and stays within the
    stated bound of attention over the float rows."""
    from fusedllm.nn import KVCache

    total = sum(CACHE_STEPS[steps])
    q = torch.randn(2, 4, total, 32, device=device, dtype=dtype)
    k = torch.randn(2, 2, total, 32, device=device, dtype=dtype)
    v = torch.randn(2, 2, total, 32, device=device, dtype=dtype)
    cache = KVCache(capacity=4, window=window, sink=sink, dtype=code)
    outs, start = [], 0
    with torch.no_grad():
        for n in CACHE_STEPS[steps]:
            outs.append(cache.attend(q[:, :, start:start + n], k[:, :, start:start + n], v[:, :, start:start + n]))
            start += n
    out = torch.cat(outs, dim=2)
    k8, k_scale = ref_quantize_kv(k, code)
    v8, v_scale = ref_quantize_kv(v, code)
    want = streaming_attention(q, dequantize_kv(k8, k_scale), dequantize_kv(v8, v_scale), window, sink)
    checks.assert_close(out, want, FORWARD_TOL[dtype], "int8 cache decoding", upcast=True)
    exact = streaming_attention(q, k, v, window, sink)
    rounding = {torch.float32: 1e-5, torch.bfloat16: 2**-8}[dtype] * exact.abs().max().item()
    bound = quantized_attention_error_bound(q, v, k_scale, v_scale, code=code)
    assert (out.double() - exact).abs().max().item() <= bound + rounding
    # what is held: the codes and their scales, in position order
    assert cache.keys.dtype == code and cache.key_scales.dtype == torch.float32
    held = cache.positions
    assert torch.equal(cache.keys.view(torch.uint8), k8[:, :, held].view(torch.uint8))
    torch.testing.assert_close(cache.value_scales, v_scale[:, :, held], atol=0, rtol=0)


def test_int8_cache_takes_half_the_bytes_of_bfloat16():
    from fusedllm.nn import KVCache

    caches = {dtype: KVCache(capacity=64, dtype=dtype) for dtype in (None, torch.int8)}
    k = torch.randn(1, 8, 64, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        for cache in caches.values():
            cache.append(k, k)

    def stored(cache):
        tensors = (cache._k, cache._v, cache._k_scale, cache._v_scale)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    # 128 int8 entries and one float32 scale per row against 128 bfloat16 entries
    assert stored(caches[torch.int8]) / stored(caches[None]) == (128 + 4) / 256
    assert "int8" in repr(caches[torch.int8])


@pytest.mark.parametrize("window", [None, 5])
def test_int8_cache_in_the_attention_module(device, window):
    from fusedllm.nn import GQAttention, KVCache

    layer = GQAttention(64, 4, n_kv_heads=2).to(device).eval()
    x = torch.randn(2, 14, 64, device=device)
    with torch.no_grad():
        outs = {}
        for dtype in (None, torch.int8):
            cache = KVCache(window=window, dtype=dtype)
            steps = [layer(x[:, :6], cache=cache)] + [layer(x[:, i:i + 1], cache=cache) for i in range(6, 14)]
            outs[dtype] = torch.cat(steps, 1)
    # within int8's error of the float cache (the bound scaled by the output projection)
    torch.testing.assert_close(outs[torch.int8], outs[None], atol=3e-2, rtol=0)
    assert not torch.equal(outs[torch.int8], outs[None])  # the int8 rows were read


def test_int8_cache_errors():
    from fusedllm.nn import GQAttention, KVCache

    with pytest.raises(ValueError, match="dtype must be None .* torch.int8 or torch.float8_e4m3fn"):
        KVCache(dtype=torch.float16)
    cache = KVCache(dtype=torch.int8)
    with pytest.raises(ValueError, match="a torch.int8 cache stores float32, bfloat16 or float16"):
        cache.append(torch.randn(1, 1, 2, 4, dtype=torch.float64), torch.randn(1, 1, 2, 4, dtype=torch.float64))
    layer = GQAttention(16, 2).eval()
    with torch.no_grad(), pytest.raises(ValueError, match="return_weights=True needs a KVCache without a window "
                                                          "or int8 storage"):
        layer(torch.randn(1, 3, 16), cache=cache, return_weights=True)


# --- the plain path (no extension) -------------------------------------------------------

@pytest.mark.parametrize("code", CODES, ids=str)
def test_plain_path_matches_the_kernels(code):
    from fusedllm import _plain

    x = torch.randn(3, 2, 7, 40) * 4
    x[0, 0, 1] = 0
    x[1, 1, 2, 5] = float("inf")
    x[2, 0, 3, 0] = float("nan")
    got = [torch.empty(x.shape, dtype=code), torch.empty(x.shape[:-1])]
    _plain.quantize_kv(x, *got)
    want = fusedllm.quantize_kv(x, dtype=code)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    torch.testing.assert_close(got[1], want[1], atol=0, rtol=0, equal_nan=True)
    q, k8, v8, k_scale, v_scale = _int8_args("cpu", torch.bfloat16, sk=50, code=code)
    args = (q, k8, v8, None, 0.25, True, -1, 0.0, None)
    with torch.no_grad():
        out_plain, lse_plain = _plain.attention(*args, k_scale=k_scale, v_scale=v_scale)
        out, lse = ops.attention(*args, k_scale=k_scale, v_scale=v_scale)
    checks.assert_close(out_plain, out, FORWARD_TOL[torch.bfloat16])
    torch.testing.assert_close(lse_plain, lse)


@pytest.mark.parametrize("index", range(len(ATTENTION_ERRORS)))
def test_plain_path_refuses_as_the_kernels(index):
    from fusedllm import _plain

    make, message = ATTENTION_ERRORS[index]
    q, k, v, k_scale, v_scale = make(*_int8_args("cpu"))
    for impl in (ops, _plain):
        with pytest.raises(ValueError, match=message):
            impl.attention(q, k, v, None, 0.25, False, -1, 0.0, None, k_scale=k_scale, v_scale=v_scale)
