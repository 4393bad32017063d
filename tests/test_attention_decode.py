"""The CUDA decoding kernels (csrc/cuda/attention_decode.cu): bfloat16 / float16
queries, at most 16 query rows a kv head, head dims up to 128, over a cache
of their dtype or of int8 / float8 codes (the tensor-core kernel on sm_80+,
the SIMT one with FUSEDLLM_CUDA_ATTENTION=simt: both run here), dense or
paged, with per-sequence lengths and every option of the decoding path. Values, lse and (through the SIMT backward) gradients against
the float64 reference, and which kernel served each call: the calls they do
not serve (float32, wider heads, more rows, dropout, rows not in 16-byte
pieces) go to the general SIMT kernel."""

import contextlib
import os

import pytest
import torch

import fusedllm
from checks import FORWARD_TOL, assert_close
from conftest import DEVICES
from reference import attention as ref_attention
from reference import dequantize_kv
from test_attention import make_qkv
from test_attention_key_slices import check_option_case
from test_attention_options import make_options
from test_attention_tensor_core import check_ran, launches, op_lse
from test_kv_paged import paged_pool
from test_kv_quant import check_every_key_code, check_every_value_code, check_float8_nan_codes

pytestmark = pytest.mark.parametrize("device", [d for d in DEVICES if not isinstance(d, str)], indirect=True)

DECODE, GENERAL, MERGE = "attention_decode_kernel", "attention_forward_kernel", "attention_merge_kernel"
DECODE_MMA = "attention_decode_mma_kernel"
HALF = [torch.bfloat16, torch.float16]


@contextlib.contextmanager
def kernel_choice(which):
    """FUSEDLLM_CUDA_ATTENTION for "tensor_cores" (auto) or "simt" inside the block
    (the emulated suite keeps it at "simt" elsewhere); yields the decoding
    kernel a call then takes."""
    saved = os.environ.get("FUSEDLLM_CUDA_ATTENTION")
    os.environ["FUSEDLLM_CUDA_ATTENTION"] = "auto" if which == "tensor_cores" else "simt"
    try:
        yield DECODE_MMA if which == "tensor_cores" else DECODE
    finally:
        if saved is None:
            os.environ.pop("FUSEDLLM_CUDA_ATTENTION", None)
        else:
            os.environ["FUSEDLLM_CUDA_ATTENTION"] = saved


@pytest.fixture(params=["tensor_cores", "simt"])
def decode_kernel(request, device):
    with kernel_choice(request.param) as kernel:
        yield kernel


# (batch, q heads, kv heads, q len, k len, head dim): 4 rows a kv head; 8;
# 16 (two tiles of 8); 1 row at head dim 80; 10 rows at head dim 32 (tiles of
# 8, the second partial). Every k len leaves a partial last tile.
SHAPES = [(2, 8, 2, 1, 300, 128), (1, 8, 1, 1, 700, 64), (1, 8, 2, 4, 500, 128), (3, 4, 4, 1, 130, 80),
          (1, 2, 1, 5, 257, 32)]


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("option", ["none", "causal", "sinks", "all"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_decode_matches_reference(device, decode_kernel, shape, option, dtype):
    check_option_case(device, shape, option, dtype, [decode_kernel],
                      absent=[GENERAL, DECODE_MMA if decode_kernel == DECODE else DECODE])


@pytest.mark.parametrize("option", ["none", "all"])
def test_decode_over_key_slices(device, decode_kernel, option):
    """One kv head and sequence over 1100 keys: on the emulator's 4
    multiprocessors, slices of whole key tiles (the last one short), merged."""
    check_option_case(device, (1, 4, 1, 1, 1100, 128), option, torch.bfloat16, [decode_kernel, MERGE],
                      absent=[GENERAL])


@pytest.mark.parametrize("option", ["mask", "window", "softcap", "alibi"])
def test_decode_options(device, decode_kernel, option):
    """A bool mask (one key hidden from each row, a row's keys all hidden in
    one sequence), a window, soft-capping and ALiBi, over key slices."""
    b, hq, hkv, sq, sk, d = 2, 8, 2, 2, 600, 64
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, torch.bfloat16, device)
    options = {"mask": lambda: dict(mask=_mask(b, hq, sq, sk, device)), "window": lambda: dict(window=(40, 0)),
               "softcap": lambda: make_options("softcap", b, hq, device),
               "alibi": lambda: make_options("alibi_per_batch", b, hq, device)}[option]()
    with launches() as counts:
        out = fusedllm.attention(q, k, v, **options)
    check_ran(counts, decode_kernel, absent=(GENERAL,))
    want, ref_lse = ref_attention(q.double(), k.double(), v.double(), **options)
    assert_close(out, want, FORWARD_TOL[torch.bfloat16], "out", upcast=True)
    assert_close(op_lse(q, k, v, **options), ref_lse, FORWARD_TOL[torch.float32], "lse", upcast=True)


def _mask(b, hq, sq, sk, device):
    keep = torch.rand(b, hq, sq, sk, device=device) > 0.3
    keep[0, 1, 0] = False  # a row that sees no key: out 0, lse -inf
    return keep


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("code", [torch.int8, torch.float8_e4m3fn], ids=["int8", "float8"])
@pytest.mark.parametrize("shape", [(2, 8, 2, 1, 333, 128), (1, 16, 2, 1, 1000, 64), (1, 8, 2, 3, 200, 32)],
                         ids=lambda s: "x".join(map(str, s)))
def test_decode_over_quantized_cache(device, decode_kernel, shape, dtype, code):
    q, k, v = make_qkv(*shape, dtype, device)
    (k8, k_scale), (v8, v_scale) = (fusedllm.quantize_kv(t, dtype=code) for t in (k, v))
    with launches() as counts:
        out = fusedllm.attention(q, k8, v8, causal=True, k_scale=k_scale, v_scale=v_scale)
    check_ran(counts, decode_kernel, absent=(GENERAL, DECODE_MMA if decode_kernel == DECODE else DECODE))
    kd, vd = dequantize_kv(k8, k_scale), dequantize_kv(v8, v_scale)
    want, _ = ref_attention(q.double(), kd.double(), vd.double(), causal=True)
    assert_close(out, want, FORWARD_TOL[dtype], "out", upcast=True)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("code", [torch.int8, torch.float8_e4m3fn], ids=["int8", "float8"])
def test_decode_reads_every_code_exactly(device, decode_kernel, dtype, code):
    """Every code as a key and as a value, and float8's NaN codes, through each decoding kernel."""
    with launches() as counts:
        check_every_key_code(device, code, 1, dtype, 128)
        check_every_value_code(device, code, 1, dtype)
        if code == torch.float8_e4m3fn:
            for which in ("k", "v"):
                check_float8_nan_codes(device, which, 1, dtype)
    check_ran(counts, decode_kernel, absent=(GENERAL, DECODE_MMA if decode_kernel == DECODE else DECODE))


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("code", [None, torch.int8, torch.float8_e4m3fn], ids=["plain", "int8", "float8"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_decode_over_pages(device, decode_kernel, dtype, code, q_len):
    """Pages of 16 rows in shuffled order, two sequences sharing a first page,
    rows no sequence reads holding NaN; sequence b reads kv_lens[b] keys."""
    lens, page_size, hq, hkv, d = [37, 100, 16], 16, 8, 2, 64
    k, v, table, kv_lens, rows = paged_pool(lens, page_size, hkv, d, dtype, device, shared_prefix=1)
    kwargs = {}
    if code is not None:
        (k, kwargs["k_scale"]), (v, kwargs["v_scale"]) = (fusedllm.quantize_kv(t, dtype=code) for t in (k, v))
    q = torch.randn(len(lens), hq, q_len, d, device=device).to(dtype)
    with launches() as counts:
        got = fusedllm.attention(q, k, v, causal=True, kv_lens=kv_lens, block_table=table, **kwargs)
    check_ran(counts, decode_kernel, absent=(GENERAL,))
    for b, (kb, vb) in enumerate(rows):
        if code is not None:  # the rows as the codes hold them
            pages = table[b, : -(-lens[b] // page_size)].long()
            kb = dequantize_kv(k[pages], kwargs["k_scale"][pages])
            vb = dequantize_kv(v[pages], kwargs["v_scale"][pages])
            kb, vb = (t.transpose(0, 1).reshape(hkv, -1, d)[:, : lens[b]][None] for t in (kb, vb))
        want, _ = ref_attention(q[b: b + 1].double(), kb.double(), vb.double(), causal=True)
        assert_close(got[b: b + 1], want, FORWARD_TOL[dtype], f"sequence {b}", upcast=True)


CASES_FOR_THE_GENERAL_KERNEL = {
    "float32": dict(dtype=torch.float32),
    "head_dim_256": dict(d=256),
    "20_rows": dict(sq=5),
    "dropout": dict(dropout_p=0.3),
    "unaligned_rows": dict(unaligned=True),
}


@pytest.mark.parametrize("case", CASES_FOR_THE_GENERAL_KERNEL)
def test_other_calls_take_the_general_kernel(device, case, monkeypatch):
    monkeypatch.setenv("FUSEDLLM_CUDA_ATTENTION", "simt")  # 20 rows: not the tensor cores
    c = dict(dtype=torch.bfloat16, d=64, sq=1, dropout_p=0.0, unaligned=False) | CASES_FOR_THE_GENERAL_KERNEL[case]
    q, k, v = make_qkv(1, 8, 2, c["sq"], 300, c["d"], c["dtype"], device)
    if c["unaligned"]:
        k = torch.zeros(*k.shape[:-1], c["d"] + 1, dtype=k.dtype, device=device)[..., : c["d"]].copy_(k)
    with launches() as counts:
        out = fusedllm.attention(q, k, v, dropout_p=c["dropout_p"])
    check_ran(counts, GENERAL, absent=(DECODE,))
    if c["dropout_p"] == 0:
        want, _ = ref_attention(q.double(), k.double(), v.double())
        assert_close(out, want, FORWARD_TOL[c["dtype"]], "out", upcast=True)
