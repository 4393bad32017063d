"""The tensor-core attention kernels (bfloat16 / float16 on sm_80+, float16 on
sm_75, csrc/cuda/attention_mma*.cu, and the Hopper kernels of attention_hopper*.cu):
which kernel dispatch picks; values, log-sum-exp and gradients against the
float64 reference over group ratios, lengths, head dims, masks and every
option; the dropout pattern; packed sequences; and no shared-memory bank
conflicts. They run under the emulator ("simt", "simt-warp") and on a GPU
("cuda"), never on the CPU kernels: with the mma.sync kernels
(FUSEDLLM_CUDA_ATTENTION=mma), and again with the Hopper forward and backward
(=hopper; the default on an sm_90 GPU) wherever they serve the call and can
run. On an sm_75 device (a T4, or the emulator under FUSEDLLM_SIMT_SM=75,
which test_turing.py runs this file as) bfloat16 and head dims past
128 take the SIMT kernels, and decoding the SIMT decoding kernel."""

import contextlib
import functools
import os
import sys

import pytest
import torch

import checks
import fusedllm
from checks import FORWARD_TOL, GRAD_TOL
from conftest import DEVICES
from reference import attention as ref_attention
import test_attention
from test_attention import make_qkv
from test_attention_options import (_differentiable, _op_window, alibi_slopes, check_against_reference,
                                    check_varlen, make_options, make_sinks, mixed_lengths, pack,
                                    reference_results, varlen_options)

ops = torch.ops.fusedllm
pytestmark = pytest.mark.parametrize("device", [d for d in DEVICES if not isinstance(d, str)], indirect=True)

assert_close = functools.partial(checks.assert_close, upcast=True)

FORWARD = "attention_mma_forward_kernel"
HOPPER_FORWARD = "attention_hopper_forward_kernel"  # sm_90a: wgmma, TMA, warp-specialized
SIMT_FORWARD = "attention_forward_kernel"
DECODE = "attention_decode_kernel"  # SIMT: up to 16 rows a kv head, bfloat16 / float16
DECODE_MMA = "attention_decode_mma_kernel"  # its tensor-core form, for a cache of the query's dtype
DELTA, SIMT_DELTA = "attention_mma_delta_kernel", "attention_delta_kernel"
DQ, SIMT_DQ = "attention_mma_dq_kernel", "attention_dq_kernel"
DKDV, SIMT_DKDV = "attention_mma_dkdv_kernel", "attention_dkdv_kernel"
HOPPER_DQ, HOPPER_DKDV = "attention_hopper_dq_kernel", "attention_hopper_dkdv_kernel"  # sm_90a
HOPPER_BACKWARD_TILE = 64  # query rows of a Hopper dK/dV tile: the group must divide them


def _emulator():
    simt = sys.modules.get("fusedllm.simt")
    return simt if simt is not None and simt.active() else None


def _capability():
    """This run's device's compute capability (the emulator's included)."""
    simt = _emulator()
    if simt is not None:
        props = simt._simt.device_properties()
        return props["major"], props["minor"]
    return torch.cuda.get_device_capability()


def _turing():
    """Whether this run's device is an sm_75 one (a T4, or the emulator as one)."""
    return _capability() == (7, 5)


def _tensor_cores_serve(dtype, head_dim):
    """sm_80+: bfloat16 and float16 at every head dim; sm_75: float16 up to
    128; older GPUs: none."""
    return _capability() >= (8, 0) or (_turing() and dtype == torch.float16 and head_dim <= 128)


def decode_kernel():
    """The decoding kernel of a call of up to 16 rows a kv head (a cache of the
    query's dtype): the tensor-core one from sm_80 on."""
    return DECODE_MMA if _capability() >= (8, 0) else DECODE


def backward_kernels(head_dim, group, plain=True, dtype=torch.bfloat16):
    """The backward kernels this run launches, and those it must not (each dP
    kernel has its delta, summed as it sums dP): the Hopper ones where this
    run requests them and they serve (head dims up to 64, 128 in plain calls;
    a group that divides their tiles), else the mma.sync ones; the SIMT ones
    where the tensor cores do not serve the call."""
    hopper = (HOPPER_DQ, HOPPER_DKDV)
    if not _tensor_cores_serve(dtype, head_dim):
        return (SIMT_DELTA, SIMT_DQ, SIMT_DKDV), (*hopper, DELTA, DQ, DKDV)
    if (_forward["kernel"] == "hopper" and (head_dim <= 64 or (head_dim <= 128 and plain))
            and HOPPER_BACKWARD_TILE % group == 0):
        return hopper, (DELTA, DQ, DKDV, SIMT_DELTA, SIMT_DQ, SIMT_DKDV)  # delta: in the Hopper dQ kernel
    return (DELTA, DQ, DKDV), (*hopper, SIMT_DELTA, SIMT_DQ, SIMT_DKDV)


_forward = {"kernel": "mma"}


def _hopper_runs_here():
    """Under the emulator (not as an sm_75 device); on a GPU, an sm_90 one with
    this build's sm_90a machine code."""
    if _emulator() is not None:
        return not _turing()
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
            and "90a-real" in fusedllm.build_info().get("cuda_archs", []))


@pytest.fixture(autouse=True, params=["mma", "hopper"])
def forward_kernel(request, device):
    """The grid runs with the mma.sync kernels (FUSEDLLM_CUDA_ATTENTION=mma) and
    again with the Hopper forward and backward (=hopper) wherever they can run."""
    if request.param == "hopper" and not _hopper_runs_here():
        pytest.skip("the Hopper kernels need the emulator or an sm_90 GPU with sm_90a machine code")
    saved = os.environ.get("FUSEDLLM_CUDA_ATTENTION")
    os.environ["FUSEDLLM_CUDA_ATTENTION"] = request.param
    _forward["kernel"] = request.param
    yield request.param
    _forward["kernel"] = "mma"
    if saved is None:
        os.environ.pop("FUSEDLLM_CUDA_ATTENTION", None)
    else:
        os.environ["FUSEDLLM_CUDA_ATTENTION"] = saved


HOPPER_SMEM_256 = 197704  # the Hopper forward's shared memory at head dim 256 (hk::Layout<256>::smem())


def _smem_optin():
    simt = _emulator()
    if simt is not None:
        return simt._simt.device_properties()["shared_mem_per_block_optin"]
    return torch.cuda.get_device_properties(torch.cuda.current_device()).shared_memory_per_block_optin


def tc_forward(head_dim, group, plain=True, dtype=torch.bfloat16):
    """The forward this run takes for a call of more than 16 rows a kv head:
    the Hopper one where it serves (a group that divides its 128 rows; head dim
    256 in plain calls where its shared memory fits: not the emulated
    sm_80-class device), else the mma.sync one; the SIMT one where the tensor
    cores do not serve the call."""
    if not _tensor_cores_serve(dtype, head_dim):
        return SIMT_FORWARD
    fits = head_dim <= 128 or (plain and _smem_optin() >= HOPPER_SMEM_256)
    if _forward["kernel"] == "hopper" and fits and 128 % group == 0:
        return HOPPER_FORWARD
    return FORWARD


@contextlib.contextmanager
def launches():
    """The emulated kernels launched inside the block, by name, with their
    counts, and the emulator's other counters' increments; None on a GPU,
    where nothing counts them."""
    simt = _emulator()
    if simt is None:
        yield None
        return
    before = simt.stats()
    got = {}
    yield got
    after = simt.stats()
    got["kernels"] = {name: n - before["kernel_launches"].get(name, 0)
                      for name, n in after["kernel_launches"].items()
                      if n > before["kernel_launches"].get(name, 0)}
    for key in ("ldmatrix", "ldmatrix_conflicts", "cp_async", "cp_async_conflicts"):
        got[key] = after[key] - before[key]


def check_ran(counts, *kernels, absent=()):
    if counts is None:
        return
    for name in kernels:
        assert name in counts["kernels"], f"{name} did not run: {counts['kernels']}"
    for name in absent:
        assert name not in counts["kernels"], f"{name} ran: {counts['kernels']}"


def op_lse(q, k, v, causal=False, window=None, mask=None, scale=None, softcap=None, sinks=None,
           alibi_slopes=None):
    """The op's log-sum-exp for fusedllm.attention's keyword arguments."""
    left, right = _op_window(window)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return ops.attention(q, k, v, mask, scale, causal, left, 0.0, None, right, softcap or 0.0, sinks,
                         alibi_slopes, None, None, 0, 0)[1]


def run_and_check(q, k, v, dtype, check_lse=True, **options):
    """attention forward and backward against the float64 reference (the lse
    too, through the op); returns the emulator's counts, checked to show the
    tensor-core kernels ran and the SIMT ones did not (backward_kernels says
    which; the forward of up to 16 rows a kv head: the decoding kernel's)."""
    with launches() as counts:
        out = fusedllm.attention(q, k, v, **options)
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, _differentiable(q, k, v, options), grad_out)
        lse = op_lse(q, k, v, **options) if check_lse else None
    # No score modifier, tensor mask or dropout (sinks change only the finished rows).
    plain = all(options.get(o) is None for o in ("softcap", "alibi_slopes", "mask")) and not options.get("dropout_p")
    ran, absent = backward_kernels(q.shape[-1], q.shape[-3] // k.shape[-3], plain, dtype)
    # Up to 16 rows a kv head the forward is the decoding kernel's (on the tensor cores too).
    rows = q.shape[-2] * q.shape[-3] // k.shape[-3]
    forward = (decode_kernel() if rows <= 16 and q.shape[-1] <= 128 and not options.get("dropout_p") else
               tc_forward(q.shape[-1], q.shape[-3] // k.shape[-3], plain, dtype))
    check_ran(counts, forward, *ran,
              absent=(*({SIMT_FORWARD, DECODE, FORWARD, HOPPER_FORWARD, DECODE_MMA} - {forward}), *absent))
    check_against_reference(q, k, v, out, grad_out, grads, dtype, **options)
    if check_lse:
        _, ref_lse, _ = reference_results(q, k, v, grad_out, **options)
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "rows without keys differ"
        assert_close(lse, ref_lse, FORWARD_TOL[dtype], "lse")
    return counts


# --- dispatch -----------------------------------------------------------------------------

# (dtype, q_heads, kv_heads, q_len, forward kernel): the tensor-core forward
# serves 16-bit types once a kv head's query rows (q_len x group) pass 16; up
# to 16 take the decoding kernel (on the tensor cores too), float32 the general
# SIMT kernel. The backward is the tensor cores' from 16 rows on. FORWARD
# stands for the Hopper forward where this run requests it and it serves (and
# for the SIMT one where the tensor cores do not: bfloat16 on sm_75), DECODE_MMA
# for the SIMT decoding kernel on sm_75.
DISPATCH_CASES = [
    (torch.bfloat16, 2, 2, 17, FORWARD),
    (torch.float16, 4, 1, 8, FORWARD),
    (torch.bfloat16, 6, 2, 17, FORWARD),  # a group of 3 does not divide the Hopper forward's 128 rows
    (torch.bfloat16, 16, 1, 1, DECODE_MMA),
    (torch.bfloat16, 8, 1, 1, DECODE_MMA),
    (torch.float16, 2, 2, 15, DECODE_MMA),
    (torch.float32, 4, 4, 64, SIMT_FORWARD),
]


@pytest.mark.parametrize("dtype,hq,hkv,sq,expected", DISPATCH_CASES, ids=lambda x: str(x))
def test_dispatch_picks_the_kernel(device, dtype, hq, hkv, sq, expected):
    q, k, v = make_qkv(1, hq, hkv, sq, 20, 32, dtype, device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with launches() as counts:
        out = fusedllm.attention(q, k, v)
        out.backward(torch.randn_like(out))
    if counts is None:
        pytest.skip("only the emulator counts launches")
    expected = {FORWARD: tc_forward(32, hq // hkv, dtype=dtype), DECODE_MMA: decode_kernel()}.get(expected, expected)
    tensor_core_backward, other_backward = backward_kernels(32, hq // hkv, dtype=dtype)
    forwards = {FORWARD, HOPPER_FORWARD, SIMT_FORWARD, DECODE, DECODE_MMA}
    if dtype == torch.float32 or sq * hq // hkv < 16:
        tensor_core_backward = (SIMT_DELTA, SIMT_DQ, SIMT_DKDV)
        other_backward = (DELTA, DQ, DKDV, HOPPER_DQ, HOPPER_DKDV)
    check_ran(counts, expected, *tensor_core_backward, absent=(*(forwards - {expected}), *other_backward))
    ref, _ = ref_attention(q.double(), k.double(), v.double())
    assert_close(out, ref, FORWARD_TOL[dtype], "out")


def test_simt_kernel_on_request(device, monkeypatch):
    """FUSEDLLM_CUDA_ATTENTION=simt keeps a call the tensor cores would take on
    a SIMT kernel (at these 16 rows a kv head, the decoding one); another value
    is refused by name."""
    q, k, v = make_qkv(1, 2, 2, 16, 20, 32, torch.bfloat16, device)
    monkeypatch.setenv("FUSEDLLM_CUDA_ATTENTION", "simt")
    with launches() as counts:
        out = fusedllm.attention(q, k, v)
    if counts is None:
        pytest.skip("only the emulator counts launches")
    check_ran(counts, DECODE, absent=(FORWARD, HOPPER_FORWARD, DECODE_MMA))
    ref, _ = ref_attention(q.double(), k.double(), v.double())
    assert_close(out, ref, FORWARD_TOL[torch.bfloat16], "out")
    monkeypatch.setenv("FUSEDLLM_CUDA_ATTENTION", "tensor-cores")
    with pytest.raises(ValueError, match="FUSEDLLM_CUDA_ATTENTION must be 'auto', 'simt', 'mma' or 'hopper'"):
        fusedllm.attention(q, k, v)


def test_build_lists_the_attention_kernels(device):
    fusedllm.attention(*make_qkv(1, 2, 2, 3, 3, 8, torch.float32, device))  # an op for the simt fixture
    simt = _emulator()
    names = simt._simt.attention_kernels() if simt is not None else fusedllm.build_info()["cuda_attention_kernels"]
    for kernel in (FORWARD, HOPPER_FORWARD, SIMT_FORWARD, DECODE, DECODE_MMA, DELTA, SIMT_DELTA, DQ, SIMT_DQ, DKDV,
                   SIMT_DKDV, HOPPER_DQ, HOPPER_DKDV):
        assert any(name.startswith(kernel + " ") for name in names), (kernel, names)


# --- values and gradients -------------------------------------------------------------

# (batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal, window, dtype), pairwise
# over group ratios 1, 2, 4, 8 and MQA; lengths 1, 17 and 257 with q_len == kv_len
# and not (more queries than keys: rows that see nothing under causal); head dims
# 64, 80 (padded to 96), 96, 128, 256; causal, windows and neither; both dtypes.
BF16, FP16 = torch.bfloat16, torch.float16
SHAPES = [
    (2, 2, 2, 17, 17, 64, True, None, BF16),
    (2, 2, 2, 17, 17, 64, True, None, FP16),
    (1, 4, 2, 257, 257, 80, False, 33, FP16),
    (1, 8, 2, 33, 100, 96, True, 7, BF16),
    (1, 16, 1, 1, 257, 128, False, None, BF16),
    (1, 8, 1, 17, 40, 256, True, None, FP16),
    (1, 8, 1, 17, 40, 256, False, None, BF16),
    (1, 16, 2, 17, 17, 128, False, None, FP16),
    (1, 4, 2, 70, 100, 128, True, None, FP16),  # several key and row tiles (sm_75's are half as long)
    (1, 4, 2, 70, 130, 160, True, None, BF16),  # dK/dV's column halves over several key and row tiles
    (1, 4, 4, 40, 17, 64, True, None, FP16),
    (1, 4, 1, 257, 33, 96, False, (5, 9), BF16),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:8])) + f"-{s[8]}")
def test_matches_reference(device, shape):
    b, hq, hkv, sq, sk, d, causal, window, dtype = shape
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, dtype, device, requires_grad=True)
    run_and_check(q, k, v, dtype, causal=causal, window=window)


def test_backward_is_deterministic(device):
    """dK and dV are summed over the query-head group inside one block, without
    atomics: two backward passes give the same bits (under "simt-warp" the
    emulator also reorders the warps between them)."""
    q, k, v = make_qkv(1, 8, 2, 70, 70, 64, torch.bfloat16, device, requires_grad=True)
    grad_out = torch.randn(1, 8, 70, 64, dtype=torch.bfloat16, device=device)
    first, second = (torch.autograd.grad(fusedllm.attention(q, k, v, causal=True), (q, k, v), grad_out)
                     for _ in range(2))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_long_prefill(device):
    """1000 positions, causal + sliding window, GQA 4:2."""
    q, k, v = make_qkv(1, 4, 2, 1000, 1000, 64, torch.bfloat16, device, requires_grad=True)
    run_and_check(q, k, v, torch.bfloat16, check_lse=False, causal=True, window=300)


@pytest.mark.parametrize("layout", ["bshd", "sliced_qkv"])
def test_strided_layouts_match_reference(device, layout):
    """q, k, v as Hugging Face models hand them over: [B, S, H, D] storage seen
    as [B, H, S, D] (heads inside positions), or slices of one fused qkv
    projection; the Hopper forward's tensor maps order heads and positions by
    their strides (both orders load in its Q tile's group-row order)."""
    b, hq, hkv, s, d = 2, 8, 2, 150, 64
    if layout == "bshd":
        q = torch.randn(b, s, hq, d, device=device).to(torch.bfloat16).transpose(1, 2)
        k, v = (torch.randn(b, s, hkv, d, device=device).to(torch.bfloat16).transpose(1, 2) for _ in range(2))
    else:
        qkv = torch.randn(b, s, hq + 2 * hkv, d, device=device).to(torch.bfloat16).transpose(1, 2)
        q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    run_and_check(q, k, v, torch.bfloat16, causal=True)


@pytest.mark.parametrize("q_heads_inner", [True, False], ids=["q_bshd", "q_bhsd"])
def test_grad_out_in_another_layout_matches_reference(device, q_heads_inner):
    """dO whose heads and positions are ordered otherwise than q's: the
    Hopper backward loads the one that differs from its tiles' row order a
    position or a head at a time; the gradients match the reference either way."""
    b, hq, hkv, s, d = 1, 8, 2, 100, 64

    def make(heads):
        x = torch.randn(b, s, heads, d, device=device).to(torch.bfloat16)
        return x.transpose(1, 2) if q_heads_inner else x.transpose(1, 2).contiguous()

    q, k, v = (make(h).requires_grad_() for h in (hq, hkv, hkv))
    out = fusedllm.attention(q, k, v, causal=True)
    like_q = torch.empty_like(q).copy_(torch.randn(b, hq, s, d, device=device).to(torch.bfloat16))
    other = like_q.transpose(1, 2).contiguous().transpose(1, 2) if not q_heads_inner else like_q.contiguous()
    assert other.stride() != like_q.stride() and torch.equal(other, like_q)
    with launches() as counts:
        first = torch.autograd.grad(out, (q, k, v), like_q, retain_graph=True)
        second = torch.autograd.grad(out, (q, k, v), other)
    check_ran(counts, *backward_kernels(d, hq // hkv)[0])
    check_against_reference(q, k, v, out, like_q, first, torch.bfloat16, causal=True)
    check_against_reference(q, k, v, out, other, second, torch.bfloat16, causal=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", [c for c in test_attention.ONE_KEY if c[3] * c[1] // c[2] >= 16],
                         ids=lambda c: "x".join(map(str, c[:6])) + ("-causal" if c[6] else ""))
def test_one_visible_key_gives_exact_zero_gradients(device, case, dtype):
    """test_attention's exact zeros of rows that see one key, on this grid's
    backward kernels (the emulated suite runs that file on the SIMT ones)."""
    with launches() as counts:
        test_attention.test_softmax_recompute_one_visible_key_gives_exact_zero_gradients(device, case, dtype)
    check_ran(counts, *backward_kernels(case[5], case[1] // case[2], dtype=dtype)[0])


# (option, causal, dtype)
OPTION_CASES = [
    ("softcap", True, torch.bfloat16, 64),
    ("sinks", False, torch.float16, 64),
    ("alibi_per_batch", True, torch.float16, 64),
    ("window_left_right", False, torch.bfloat16, 64),
    ("all", True, torch.float16, 64),
    ("all", False, torch.bfloat16, 64),
    ("all", True, torch.bfloat16, 200),  # padded to 256: dK/dV's column halves cut at 200
]


@pytest.mark.parametrize("option,causal,dtype,head_dim", OPTION_CASES, ids=lambda x: str(x))
def test_options_match_reference(device, option, causal, dtype, head_dim):
    q, k, v = make_qkv(2, 4, 2, 40, 70, head_dim, dtype, device, requires_grad=True)
    run_and_check(q, k, v, dtype, causal=causal, **make_options(option, 2, 4, device))


# (mask shape, kind): broadcast over batch, heads, queries; rows masked entirely.
MASK_CASES = [((40, 70), "bool"), ((2, 1, 40, 70), "float"), ((1, 4, 1, 70), "bfloat16"),
              ((40, 1), "bool_rows")]


@pytest.mark.parametrize("shape,kind", MASK_CASES, ids=lambda x: str(x))
def test_masks_match_reference(device, shape, kind):
    dtype = torch.float16 if kind == "float" else torch.bfloat16
    q, k, v = make_qkv(2, 4, 2, 40, 70, 64, dtype, device, requires_grad=True)
    if kind == "bool":
        mask = torch.rand(shape, device=device) > 0.3
        mask[5] = False  # a row that sees nothing: zeros
    elif kind == "bool_rows":
        mask = torch.arange(40, device=device).view(40, 1) % 3 != 0
    else:
        mask = torch.randn(shape, device=device).to(torch.float32 if kind == "float" else torch.bfloat16)
        mask[..., 3] = torch.finfo(mask.dtype).min  # "masked" as Hugging Face writes it
    run_and_check(q, k, v, dtype, mask=mask)
    if kind.startswith("bool"):
        out = fusedllm.attention(q, k, v, mask=mask)
        rows = (~mask.expand(2, 4, 40, 70)).all(-1)
        assert rows.any() and torch.equal(out[rows], torch.zeros_like(out[rows])), "masked rows are not zero"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_dropout_keeps_what_the_cpu_op_keeps(device, dtype):
    """With uniform probabilities (q = 0) and one-hot values, out[..., c] is
    nonzero exactly where probability (row, key c) is kept: the pattern must be
    the CPU op's (fusedllm._philox.dropout_keep), element by element."""
    from fusedllm import _philox

    p, seed = 0.3, 123456789
    b, hq, hkv, sq, sk = 2, 4, 2, 40, 64
    q = torch.zeros(b, hq, sq, 64, dtype=dtype, device=device)
    k = torch.randn(b, hkv, sk, 64, dtype=dtype, device=device)
    v = torch.eye(sk, 64, dtype=dtype, device=device).expand(b, hkv, sk, 64).contiguous()
    with launches() as counts:
        out, _ = ops.attention(q, k, v, None, 0.125, False, -1, p, torch.tensor([seed]), -1, 0.0, None,
                               None, None, None, 0, 0)
    check_ran(counts, tc_forward(64, 2, dtype=dtype))
    keep = _philox.dropout_keep(seed, (b, hq, sq, sk), p, q.device)
    assert torch.equal(out != 0, keep), "dropout kept other probabilities than the CPU op"
    assert_close(out, (keep.double() / sk / (1 - p)), FORWARD_TOL[dtype], "kept values")


@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float16, 64), (torch.bfloat16, 256)],
                         ids=str)
def test_dropout_with_options_matches_reference(device, dtype, head_dim):
    from fusedllm import _philox

    p, seed = 0.2, 55
    b, hq, hkv, sq, sk = 1, 4, 2, 33, 80
    q, k, v = make_qkv(b, hq, hkv, sq, sk, head_dim, dtype, device, requires_grad=True)
    sinks = make_sinks(hq, device)
    slopes = alibi_slopes(hq, b, device=device)
    left, right = _op_window((40, 4))
    with launches() as counts:
        out, _ = ops.attention(q, k, v, None, 0.5, False, left, p, torch.tensor([seed]), right, 2.0, sinks,
                               slopes, None, None, 0, 0)
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v, sinks), grad_out)
    check_ran(counts, tc_forward(head_dim, 2, plain=False, dtype=dtype),
              *backward_kernels(head_dim, 2, plain=False, dtype=dtype)[0])
    keep = _philox.dropout_keep(seed, (b, hq, sq, sk), p, q.device)
    check_against_reference(q, k, v, out, grad_out, grads, dtype, scale=0.5, window=(40, 4), keep=keep,
                            dropout_p=p, softcap=2.0, sinks=sinks, alibi_slopes=slopes)


@pytest.mark.parametrize("case,dtype", [("causal", torch.bfloat16), ("all", torch.float16),
                                        ("all_noncausal", torch.bfloat16)], ids=lambda x: str(x))
def test_varlen_matches_reference(device, case, dtype):
    lengths_q, lengths_k = mixed_lengths(70)
    q, k, v, cu_q, cu_k = pack(lengths_q, lengths_k, 8, 2, 64, dtype, device, requires_grad=True)
    with launches() as counts:
        check_varlen(q, k, v, cu_q, cu_k, dtype, **varlen_options(case, len(lengths_q), 8, device))
    check_ran(counts, tc_forward(64, 4, dtype=dtype), *backward_kernels(64, 4, dtype=dtype)[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_kv_lens_matches_reference(device, dtype):
    """A dense cache of sequences of several lengths (kv_lens): each reads only
    its first kv_lens[b] rows (the rows past it hold NaN)."""
    lens = [70, 0, 33, 1]
    q = torch.randn(4, 8, 24, 64, device=device).to(dtype)
    k = torch.full((4, 2, 80, 64), float("nan"), device=device, dtype=dtype)
    v = torch.full_like(k, float("nan"))
    for b, n in enumerate(lens):
        k[b, :, :n] = torch.randn(2, n, 64, device=device).to(dtype)
        v[b, :, :n] = torch.randn(2, n, 64, device=device).to(dtype)
    kv_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    with launches() as counts, torch.no_grad():
        out = fusedllm.attention(q, k, v, causal=True, kv_lens=kv_lens)
    forward = tc_forward(64, 4, dtype=dtype)
    check_ran(counts, forward, absent=tuple({FORWARD, HOPPER_FORWARD, SIMT_FORWARD} - {forward}))
    for b, n in enumerate(lens):
        want = (torch.zeros_like(q[b:b + 1]) if n == 0 else
                ref_attention(q[b:b + 1].double(), k[b:b + 1, :, :n].double(), v[b:b + 1, :, :n].double(),
                              causal=True)[0])
        assert_close(out[b:b + 1], want, FORWARD_TOL[dtype])


def test_kv_lens_past_the_cache_give_nan_rows(device):
    """The kernels read kv_lens where they lie (no copy to the host): a length
    past the cache's rows, or negative, gives its sequence NaN rows and leaves
    the others as they are."""
    q = torch.randn(3, 8, 24, 64, device=device).bfloat16()
    k = torch.randn(3, 2, 80, 64, device=device).bfloat16()
    v = torch.randn_like(k)
    kv_lens = torch.tensor([81, 40, -1], dtype=torch.int32, device=device)
    with launches() as counts, torch.no_grad():
        out = fusedllm.attention(q, k, v, causal=True, kv_lens=kv_lens)
    forward = tc_forward(64, 4)
    check_ran(counts, forward, absent=tuple({FORWARD, HOPPER_FORWARD, SIMT_FORWARD} - {forward}))
    assert torch.isnan(out[0]).all() and torch.isnan(out[2]).all()
    want, _ = ref_attention(q[1:2].double(), k[1:2, :, :40].double(), v[1:2, :, :40].double(), causal=True)
    assert_close(out[1:2], want, FORWARD_TOL[torch.bfloat16])


# --- shared memory ------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_no_bank_conflicts(device, head_dim):
    """The emulator scores every ldmatrix and cp.async of the portable forms:
    none takes more than one shared-memory wavefront per 8-lane phase (float16
    on sm_75, whose tiles those are)."""
    dtype = torch.float16 if _turing() else torch.bfloat16
    q, k, v = make_qkv(1, 4, 2, 40, 70, head_dim, dtype, device, requires_grad=True)
    with launches() as counts:
        out = fusedllm.attention(q, k, v, causal=True)
        out.backward(torch.randn_like(out))
    if counts is None:
        pytest.skip("only the emulator counts bank conflicts")
    check_ran(counts, tc_forward(head_dim, 2, dtype=dtype), *backward_kernels(head_dim, 2, dtype=dtype)[0])
    if any(name in counts["kernels"] for name in (FORWARD, DELTA, DQ, DKDV)):  # else all on TMA and wgmma
        assert counts["ldmatrix"] > 0 and counts["cp_async"] > 0
    assert counts["ldmatrix_conflicts"] == 0 and counts["cp_async_conflicts"] == 0, counts
