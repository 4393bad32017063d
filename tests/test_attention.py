"""attention: values, log-sum-exp and gradients against tests/reference.py; the
operator contract (opcheck, gradcheck, torch.compile), masks, memory and errors."""

import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import checks
import fusedllm
from checks import FORWARD_TOL, GRAD_TOL, results_across_thread_counts
from conftest import cpu_variants
from testkit.memory import peak_memory_bytes
from reference import attention as ref_attention

ops = torch.ops.fusedllm
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]

# (batch, q_heads, kv_heads, q_len, kv_len, head_dim): every group ratio
# (1, 2, 4, 8 and MQA), prefill (q_len == kv_len), decoding (q_len 1), chunked
# prefill (q_len < kv_len), lengths that are not tile multiples, every head_dim
# class (1, 16, 64, 80, 128, 256), and an odd head_dim with up to 8 rows per kv
# head (the bfloat16 kernel's decoding path); head dim 96 over several key
# tiles and an odd last one (the AMX tiles' 32-term steps, their key tails);
# a group of 5 over 420 keys (query tiles of 19 positions: key tiles of
# whole 32s starting at odd and even keys, where the AMX kernels read K and V
# packed once a call or pack them per tile).
SHAPES = [
    (2, 4, 4, 17, 17, 64),
    (1, 4, 2, 257, 257, 16),
    (1, 8, 2, 1, 2100, 128),
    (1, 8, 1, 100, 257, 80),
    (1, 4, 1, 33, 33, 1),
    (1, 2, 1, 64, 64, 256),
    (1, 4, 1, 2, 300, 33),
    (1, 4, 2, 150, 301, 96),
    (1, 10, 2, 100, 420, 64),
]
# (causal, window)
MASKS = [(False, None), (True, None), (True, 7), (False, 33)]


# Against float64 references, compared unrounded.
assert_close = functools.partial(checks.assert_close, upcast=True)


def make_qkv(b, hq, hkv, sq, sk, d, dtype, device, requires_grad=False):
    q = torch.randn(b, hq, sq, d, dtype=dtype, device=device)
    k = torch.randn(b, hkv, sk, d, dtype=dtype, device=device)
    v = torch.randn(b, hkv, sk, d, dtype=dtype, device=device)
    if requires_grad:
        for t in (q, k, v):
            t.requires_grad_()
    return q, k, v


def reference_results(q, k, v, grad_out, causal, window, scale=None):
    """float64 reference output, lse and gradients (no intermediate rounding)."""
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = ref_attention(qd, kd, vd, causal=causal, scale=scale, window=window)
    grads = torch.autograd.grad(out, (qd, kd, vd), grad_out.double())
    return out.detach(), lse.detach(), grads


def run_op(q, k, v, causal, window, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return ops.attention(q, k, v, None, scale, causal, -1 if window is None else window, 0.0, None)


@pytest.mark.cpu_variants
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal,window", MASKS, ids=lambda x: str(x))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(device, shape, causal, window, dtype):
    q, k, v = make_qkv(*shape, dtype, device, requires_grad=True)
    before = [t.detach().clone() for t in (q, k, v)]
    out, lse = run_op(q, k, v, causal, window)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == q.shape[:-1]
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_out, ref_lse, ref_grads = reference_results(q, k, v, grad_out, causal, window)
    assert_close(out, ref_out, FORWARD_TOL[dtype], "out")
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "rows without keys differ"
    assert_close(lse, ref_lse, FORWARD_TOL[dtype], "lse")
    for name, t, ref in zip("qkv", (q, k, v), ref_grads):
        assert_close(t.grad, ref, GRAD_TOL[dtype], f"grad_{name}")
    for t, b in zip((q, k, v), before):
        assert torch.equal(t.detach(), b), "an input was modified"


def _float16_misses(x, ref, floor):
    """|x - ref rounded to float16| over one float16 unit of that value plus
    `floor` (sums that cancel to near zero), elementwise."""
    magnitude = ref.abs().half()
    unit = (magnitude.view(torch.int16) + 1).view(torch.float16).float() - magnitude.float()
    return (x.float() - ref.half().float()).abs() / (unit + floor)


# A last query tile of 8 rows (2 positions of a group of 4): on the float32
# lanes inside a call whose other tiles run on the AMX tiles.
@pytest.mark.cpu_variants
@pytest.mark.parametrize("causal,window", MASKS[:2], ids=lambda x: str(x))
@pytest.mark.parametrize("shape", SHAPES + [(1, 8, 2, 98, 98, 64), (1, 4, 2, 257, 257, 32)],
                         ids=lambda s: "x".join(map(str, s)))
def test_float16_within_units(device, shape, causal, window):
    """float16 results near the float64 reference's rounded to float16: the
    output within one unit plus 2^-13 of V's largest magnitude, each gradient
    within three units plus 2^-13 of its largest: the products keep float16's
    every bit. The AMX variant splits each operand into two bfloat16 parts
    (measured: output at most 0.65 of its bound, gradients 1.9, the float32
    path's 0.33 and 1.9); operands rounded to bfloat16 miss by 3-15 times the
    output's bound, 11-29 times the gradients'."""
    q, k, v = make_qkv(*shape, torch.float16, device, requires_grad=True)
    out, _ = run_op(q, k, v, causal, window)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_out, _, ref_grads = reference_results(q, k, v, grad_out, causal, window)
    miss = _float16_misses(out, ref_out, 2**-13 * v.detach().abs().max().float())
    assert miss.max().item() <= 1, f"out: {miss.max().item():.2f} of the bound"
    for name, t, ref in zip("qkv", (q, k, v), ref_grads):
        miss = _float16_misses(t.grad, ref, 2**-13 * ref.abs().max().float())
        assert miss.max().item() <= 3, f"grad_{name}: {miss.max().item():.2f} of the bound"


# Decoding tiles (at most 8 query rows per kv head, which the CPU kernels
# score with the keys along the vector lanes): every group ratio, head dims
# below, at and past a vector (with tails), key counts around the 16-key
# blocks, one key, and K / V laid out as transformers keeps them.
DECODING_SHAPES = [
    (2, 8, 8, 1, 40, 16),
    (1, 4, 2, 1, 17, 33),
    (1, 8, 1, 1, 97, 128),
    (1, 16, 2, 1, 65, 256),
    (1, 8, 1, 1, 50, 1),
    (1, 4, 4, 1, 31, 8),
    (1, 2, 1, 3, 70, 100),
    (1, 4, 1, 1, 1, 64),
]


@pytest.mark.cpu_variants
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal,window", MASKS, ids=lambda x: str(x))
@pytest.mark.parametrize("shape", DECODING_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_decoding_tiles_match_reference(device, shape, causal, window, dtype, layout):
    b, hq, hkv, sq, sk, d = shape
    q = torch.randn(b, hq, sq, d, dtype=dtype, device=device)
    if layout == "bhsd":
        k, v = (torch.randn(b, hkv, sk, d, dtype=dtype, device=device) for _ in range(2))
    else:  # [batch, kv_len, kv_heads, head_dim] storage seen as [batch, kv_heads, kv_len, head_dim]
        k, v = (torch.randn(b, sk, hkv, d, dtype=dtype, device=device).transpose(1, 2) for _ in range(2))
    out, lse = run_op(q, k, v, causal, window)
    ref_out, ref_lse = ref_attention(q.double(), k.double(), v.double(), causal=causal, window=window)
    assert_close(out, ref_out, FORWARD_TOL[dtype], "out")
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "rows without keys differ"
    assert_close(lse, ref_lse, FORWARD_TOL[dtype], "lse")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_decoding_nan_reaches_exactly_its_rows(device, where, dtype):
    """A NaN reaches the output rows it feeds and no other, also when a
    decoding step's keys are split across tasks and merged."""
    q, k, v = make_qkv(1, 8, 2, 1, 1200, 64, dtype, device)
    poisoned = torch.zeros(8, dtype=torch.bool)
    if where == "q":
        q[0, 5, 0, 3] = float("nan")
        poisoned[5] = True
    else:
        (k if where == "k" else v)[0, 1, 700, 3] = float("nan")
        poisoned[4:] = True  # the query heads of kv head 1
    out, _ = run_op(q, k, v, False, None)
    # a NaN in v reaches its own column of the output; in q or k, the whole row
    assert torch.isnan(out[0, poisoned, 0, 3 if where == "v" else slice(None)]).all()
    ref_out, _ = ref_attention(q.double(), k.double(), v.double())
    assert_close(out[:, ~poisoned], ref_out[:, ~poisoned], FORWARD_TOL[dtype], "other heads")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_long_prefill_with_window(device, dtype):
    """1000 positions, causal + sliding window, GQA 6:2, two batches."""
    q, k, v = make_qkv(2, 6, 2, 1000, 1000, 64, dtype, device, requires_grad=True)
    out = fusedllm.attention(q, k, v, causal=True, window=300)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_out, _, ref_grads = reference_results(q, k, v, grad_out, True, 300)
    assert_close(out, ref_out, FORWARD_TOL[dtype], "out")
    for name, t, ref in zip("qkv", (q, k, v), ref_grads):
        assert_close(t.grad, ref, GRAD_TOL[dtype], f"grad_{name}")


def test_functional_defaults_and_scale(device):
    q, k, v = make_qkv(1, 4, 2, 9, 12, 24, torch.float64, device)
    ref_out, _ = ref_attention(q, k, v)
    torch.testing.assert_close(fusedllm.attention(q, k, v), ref_out)
    ref_out, _ = ref_attention(q, k, v, causal=True, scale=0.3, window=4)
    torch.testing.assert_close(fusedllm.attention(q, k, v, causal=True, scale=0.3, window=4), ref_out)


def test_rows_that_see_no_key_are_zero(device):
    """q_len > kv_len with a causal mask: the first queries precede every key."""
    q, k, v = make_qkv(1, 4, 2, 40, 16, 32, torch.float32, device, requires_grad=True)
    out, lse = run_op(q, k, v, True, None)
    assert torch.equal(out[:, :, :24], torch.zeros_like(out[:, :, :24]))
    assert torch.isneginf(lse[:, :, :24]).all() and torch.isfinite(lse[:, :, 24:]).all()
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :, :24], torch.zeros_like(q.grad[:, :, :24]))
    _, _, ref_grads = reference_results(q, k, v, grad_out, True, None)
    for t, ref in zip((q, k, v), ref_grads):
        assert_close(t.grad, ref, GRAD_TOL[torch.float32])


@pytest.mark.parametrize("asks", ["q", "kv", "v"])
def test_gradients_only_where_asked(device, asks):
    """Inputs that ask for a gradient get the reference's; the others get none."""
    q, k, v = make_qkv(1, 4, 2, 33, 33, 16, torch.float32, device)
    grad_out = torch.randn_like(q)
    leaves = [t.clone().requires_grad_(name in asks) for name, t in zip("qkv", (q, k, v))]
    fusedllm.attention(*leaves, causal=True).backward(grad_out)
    _, _, ref_grads = reference_results(q, k, v, grad_out, True, None)
    for name, t, ref in zip("qkv", leaves, ref_grads):
        if name in asks:
            assert_close(t.grad, ref, GRAD_TOL[torch.float32])
        else:
            assert t.grad is None


def test_window_smaller_than_the_gap_leaves_keys_unseen(device):
    """Keys no query sees get zero gradients; non-causal windows bound only the left side."""
    q, k, v = make_qkv(1, 2, 1, 8, 64, 16, torch.float32, device, requires_grad=True)
    for causal in (True, False):
        out = fusedllm.attention(q, k, v, causal=causal, window=3)
        grad_out = torch.randn_like(out)
        (gq, gk, gv) = torch.autograd.grad(out, (q, k, v), grad_out)
        ref_out, _, ref_grads = reference_results(q, k, v, grad_out, causal, 3)
        assert_close(out, ref_out, FORWARD_TOL[torch.float32])
        for got, ref in zip((gq, gk, gv), ref_grads):
            assert_close(got, ref, GRAD_TOL[torch.float32])
        assert torch.equal(gk[:, :, :54], torch.zeros_like(gk[:, :, :54]))


def test_bfloat16_beside_torchs_own_cpu_kernels():
    """bfloat16 attention between calls of torch's own bfloat16 kernels on
    the same threads (SDPA and matmul, which run on the AMX tiles where the
    CPU has them, as fusedllm's AMX variant does): each gives the result it
    gives alone, whatever tile configuration the other left behind. Under the
    best variant only: torch's bfloat16 SDPA refuses to run under
    ATEN_CPU_CAPABILITY=default or avx2 on a CPU with AVX-512 (pack_vnni2)."""
    torch.manual_seed(0)
    q, k, v = make_qkv(1, 8, 2, 200, 200, 64, torch.bfloat16, "cpu")
    x, w = torch.randn(256, 512).bfloat16(), torch.randn(512, 512).bfloat16()

    def torch_ops():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), x @ w

    sdpa_alone, mm_alone = torch_ops()
    ours_alone = fusedllm.attention(q, k, v, causal=True)
    for _ in range(3):
        ours = fusedllm.attention(q, k, v, causal=True)
        sdpa, mm = torch_ops()
        assert torch.equal(ours, ours_alone)
        assert torch.equal(sdpa, sdpa_alone)
        assert torch.equal(mm, mm_alone)


@pytest.mark.cpu_variants
@pytest.mark.parametrize("layout", ["bshd_transposed", "strided_head_dim", "sliced_sequence"])
def test_strided_inputs(device, layout):
    b, hq, hkv, s, d = 2, 4, 2, 37, 32
    if layout == "bshd_transposed":
        # The layout projections produce: [B, S, H, D] viewed as [B, H, S, D].
        q = torch.randn(b, s, hq, d, device=device).transpose(1, 2)
        k = torch.randn(b, s, hkv, d, device=device).transpose(1, 2)
        v = torch.randn(b, s, hkv, d, device=device).transpose(1, 2)
    elif layout == "strided_head_dim":
        q = torch.randn(b, hq, s, 2 * d, device=device)[..., ::2]
        k = torch.randn(b, hkv, s, 2 * d, device=device)[..., ::2]
        v = torch.randn(b, hkv, s, 2 * d, device=device)[..., 1::2]
    else:
        q = torch.randn(b, hq, s + 5, d, device=device)[:, :, 5:]
        k = torch.randn(b, hkv, s + 9, d, device=device)[:, :, :s]
        v = torch.randn(b, hkv, s + 9, d, device=device)[:, :, 9:]
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fusedllm.attention(q, k, v, causal=True)
    # non-contiguous incoming gradient
    grad_out = torch.randn(b, s, hq, d, device=device).transpose(1, 2)
    out.backward(grad_out)
    ref_out, _, ref_grads = reference_results(q, k, v, grad_out, True, None)
    assert_close(out, ref_out, FORWARD_TOL[torch.float32])
    for t, ref in zip((q, k, v), ref_grads):
        assert_close(t.grad, ref, GRAD_TOL[torch.float32])


def test_zero_size(device):
    # no batch / no queries: empty outputs, zero gradients for k and v
    for shape in [(0, 4, 2, 5, 7, 16), (2, 4, 2, 0, 7, 16)]:
        q, k, v = make_qkv(*shape, torch.float32, device, requires_grad=True)
        out, lse = run_op(q, k, v, True, None)
        assert out.shape == q.shape and lse.shape == q.shape[:-1]
        out.sum().backward()
        assert torch.equal(k.grad, torch.zeros_like(k)) and torch.equal(v.grad, torch.zeros_like(v))
    # no keys: every query sees nothing
    q, k, v = make_qkv(2, 4, 2, 5, 0, 16, torch.float32, device, requires_grad=True)
    out, lse = run_op(q, k, v, False, None)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


def test_matches_sdpa_where_conventions_agree(device):
    q, k, v = make_qkv(2, 8, 2, 70, 70, 64, torch.float32, device)
    for causal in (False, True):
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        assert_close(fusedllm.attention(q, k, v, causal=causal), expected, FORWARD_TOL[torch.float32])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 200, 256])
def test_float32_error_is_no_worse_than_sdpa(device, head_dim, causal):
    """float32 output and gradients against a float64 reference: fusedllm's
    error within 1.25x SDPA's (same inputs, same reference), as an RMS over two
    seeds (a maximum of one element is too noisy for a ratio), plus a maximum
    error within 1.5x. GQA 8:2, where dK/dV sum over the most rows."""
    seq = 160
    errors = {name: {"fused": [], "sdpa": [], "ref": []} for name in ("out", "dq", "dk", "dv")}
    for seed in range(2):
        torch.manual_seed(seed)
        q, k, v = make_qkv(1, 8, 2, seq, seq, head_dim, torch.float32, device)
        grad_out = torch.randn_like(q)
        ref = reference_results(q, k, v, grad_out, causal, None)
        ref = (ref[0], *ref[2])
        results = {}
        for name, fn in (("fused", lambda q, k, v: fusedllm.attention(q, k, v, causal=causal)),
                         ("sdpa", lambda q, k, v: F.scaled_dot_product_attention(
                             q, k, v, is_causal=causal, enable_gqa=True))):
            results[name] = _grads(fn, q, k, v, grad_out)
        for i, name in enumerate(errors):
            errors[name]["ref"].append(ref[i])
            for who in ("fused", "sdpa"):
                errors[name][who].append(results[who][i].double() - ref[i])
    for name, e in errors.items():
        ref_norm = torch.cat([r.flatten() for r in e["ref"]]).norm().item()
        rms = {who: torch.cat([x.flatten() for x in e[who]]).norm().item() for who in ("fused", "sdpa")}
        worst = {who: max(x.abs().max().item() for x in e[who]) for who in ("fused", "sdpa")}
        floor = 1e-8 * ref_norm
        assert rms["fused"] <= 1.25 * rms["sdpa"] + floor, (
            f"{name}: RMS error {rms['fused'] / ref_norm:.3g} (relative) against SDPA's "
            f"{rms['sdpa'] / ref_norm:.3g}")
        assert worst["fused"] <= 1.5 * worst["sdpa"] + floor, (
            f"{name}: max error {worst['fused']:.3g} against SDPA's {worst['sdpa']:.3g}")


def _grads(call, q, k, v, grad_out):
    """call(q, k, v) on fresh leaves: its output and the gradients of q, k, v for grad_out."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = call(*leaves)
    return (out, *torch.autograd.grad(out, leaves, grad_out))


# (batch, q_heads, kv_heads, q_len, kv_len, head_dim, causal, scale): queries that
# see exactly one key: one query and one key with scores of 4.7 and 50 (scale
# None: chosen for them), GQA decoding rows wide enough for the CUDA tensor-core
# kernels (head dim 256: dK/dV in column halves), and a causal prefill's
# first position, prefill tiles and decoding tiles alike.
ONE_KEY = [
    (1, 1, 1, 1, 1, 256, False, 4.7),
    (1, 1, 1, 1, 1, 256, False, 50.0),
    (1, 4, 4, 1, 1, 64, False, 50.0),
    (2, 16, 1, 1, 1, 64, False, None),
    (2, 16, 1, 1, 1, 256, False, None),
    (2, 8, 2, 48, 48, 64, True, None),
    (1, 8, 2, 5, 5, 128, True, None),
]


@pytest.mark.cpu_variants
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", ONE_KEY, ids=lambda c: "x".join(map(str, c[:6])) + ("-causal" if c[6] else ""))
def test_softmax_recompute_one_visible_key_gives_exact_zero_gradients(device, case, dtype):
    """Softmax over a single key is constant: dQ and dK of such a query are
    exactly 0 (as SDPA's are), and its probability is exactly 1, so dV is dO,
    whatever the score's size: the backward recomputes the forward's scores
    and probabilities, and sums rowsum(dO * O) as it sums dP."""
    b, hq, hkv, sq, sk, d, causal, target = case
    torch.manual_seed(0)
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, dtype, device)
    scale = None
    if target is not None:
        scale = target / (q.double() * k.double()).sum().item()
    grad_out = torch.randn_like(q)
    out, dq, dk, dv = _grads(lambda q, k, v: fusedllm.attention(q, k, v, causal=causal, scale=scale),
                             q, k, v, grad_out)
    one_key = dq[:, :, 0] if causal else dq
    assert torch.count_nonzero(one_key).item() == 0, f"dQ of one-key rows: max {one_key.abs().max().item():.3g}"
    if not causal:
        assert torch.count_nonzero(dk).item() == 0, f"dK: max {dk.abs().max().item():.3g}"
        if hq == hkv:
            assert torch.equal(dv, grad_out), f"dV - dO: max {(dv.double() - grad_out.double()).abs().max():.3g}"
        assert torch.equal(out, v.repeat_interleave(hq // hkv, dim=1))


@pytest.mark.cpu_variants
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_softmax_recompute_varlen_single_key_sequences(device, dtype):
    """8 packed sequences of one query and one key: dQ and dK exactly 0."""
    torch.manual_seed(1)
    n, heads, d = 8, 4, 64
    q, k, v = (torch.randn(n, heads, d, device=device).to(dtype) for _ in range(3))
    cu = torch.arange(n + 1, dtype=torch.int32, device=device)
    call = functools.partial(fusedllm.attention_varlen, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1,
                             max_seqlen_k=1)
    out, dq, dk, dv = _grads(call, q, k, v, torch.randn_like(q))
    assert torch.count_nonzero(dq).item() == 0 and torch.count_nonzero(dk).item() == 0


@pytest.mark.cpu_variants
@pytest.mark.parametrize("size", [5.0, 50.0, 500.0])
@pytest.mark.parametrize("keys", [40, 200])
def test_softmax_recompute_matches_forward_probabilities(device, size, keys):
    """float32: the probabilities the backward recomputes from the lse equal
    the forward's to rounding, whatever the scores' size (|lse| ulps apart
    when the output was normalized by 1 / sum, 3e-5 at scores of 500). One
    query row and V = I make the output the forward's probabilities and, with
    dO = 1, dV's rows the backward's (exact products); scores spread by 2% of
    `size` around it, summed over 64 terms."""
    torch.manual_seed(2)
    d = max(64, keys)
    u = torch.nn.functional.normalize(torch.randn(d, dtype=torch.float64), dim=0)
    k = (u + 0.02 * torch.randn(keys, d, dtype=torch.float64)).float()
    q = (u * size * d ** 0.5).float()
    q, k = q.view(1, 1, 1, d).to(device), k.view(1, 1, keys, d).to(device)
    v = torch.eye(keys, d, device=device).view(1, 1, keys, d)
    out, _, _, dv = _grads(fusedllm.attention, q, k, v, torch.ones(1, 1, 1, d, device=device))
    forward = out[0, 0, 0, :keys].double()
    recomputed = dv[0, 0, :, 0].double()
    # exp(x) in float32 is good to |x| ulps at best (x's own rounding): a few
    # ulps where p is near 1, more for the small ones.
    ulps = (forward - recomputed).abs() / forward / 2**-24
    allowed = 8 + 2 * -forward.log()
    worst = (ulps / allowed).max().item()
    assert worst <= 1, f"backward's probabilities {worst:.3g}x the allowed distance from the forward's"


def test_causal_is_bottom_right_where_sdpa_is_top_left(device):
    """With q_len < kv_len (a KV cache) the queries are the last positions."""
    q, k, v = make_qkv(1, 4, 2, 5, 12, 16, torch.float32, device)
    bottom_right = torch.ones(5, 12, dtype=torch.bool, device=device).tril(diagonal=12 - 5)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=bottom_right, enable_gqa=True)
    assert_close(fusedllm.attention(q, k, v, causal=True), expected, FORWARD_TOL[torch.float32])
    top_left = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert not torch.allclose(fusedllm.attention(q, k, v, causal=True), top_left, atol=1e-3)
    # decoding one token sees the whole cache
    q1 = q[:, :, -1:]
    full = F.scaled_dot_product_attention(q1, k, v, enable_gqa=True)
    assert_close(fusedllm.attention(q1, k, v, causal=True), full, FORWARD_TOL[torch.float32])


def test_window_matches_hugging_face_sliding_window(device):
    masking_utils = pytest.importorskip("transformers.masking_utils")
    window, q_len, kv_len = 5, 6, 20
    mask_fn = masking_utils.sliding_window_causal_mask_function(window)
    # cache positions of the new tokens against every key position
    positions = torch.arange(kv_len - q_len, kv_len, device=device).unsqueeze(1)
    keys = torch.arange(kv_len, device=device).unsqueeze(0)
    zero = torch.zeros((), dtype=torch.long, device=device)
    hf_mask = mask_fn(zero, zero, positions, keys).expand(q_len, kv_len)
    assert hf_mask.sum(-1).eq(window).all()
    q, k, v = make_qkv(1, 4, 2, q_len, kv_len, 16, torch.float32, device)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=hf_mask, enable_gqa=True)
    got = fusedllm.attention(q, k, v, causal=True, window=window)
    assert_close(got, expected, FORWARD_TOL[torch.float32])


def test_decoding_step_by_step_matches_prefill(device):
    """Last rows of a prefill equal decoding those tokens against the cache."""
    q, k, v = make_qkv(1, 8, 2, 50, 50, 64, torch.float32, device)
    full = fusedllm.attention(q, k, v, causal=True, window=16)
    for t in (0, 17, 49):
        step = fusedllm.attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], causal=True,
                                  window=16)
        assert_close(step, full[:, :, t:t + 1], FORWARD_TOL[torch.float32])


@pytest.mark.parametrize("pairs", [1, 8], ids=["few_pairs_split_keys", "one_task_per_pair"])
def test_backward_is_deterministic(device, pairs):
    """Same bits run to run; on CPU also for any thread count."""
    b, hkv = (1, 1) if pairs == 1 else (2, 4)
    # The emulator's schedule is fixed, so a second run there can differ only
    # through memory a kernel reads before writing: shorter sequences, still
    # several tiles with partial ones, show that at a twentieth of the cost.
    q_len, kv_len = (70, 150) if checks.emulated() else (300, 700)
    q, k, v = make_qkv(b, 4 * hkv, hkv, q_len, kv_len, 64, torch.float32, device)
    grad_out = torch.randn_like(q)

    def run():
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        out = fusedllm.attention(qr, kr, vr, causal=True)
        out.backward(grad_out)
        return out.detach(), qr.grad, kr.grad, vr.grad

    results = results_across_thread_counts(device, run)
    for res in results[1:]:
        for got, first in zip(res, results[0]):
            assert torch.equal(got, first)


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3, 4, 8]),
    q_len=st.integers(1, 140),
    kv_extra=st.integers(-20, 140),
    head_dim=st.integers(1, 96),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 150)),
    dtype=st.sampled_from(DTYPES),
)
def test_hypothesis_shapes(batch, kv_heads, group, q_len, kv_extra, head_dim, causal, window, dtype):
    kv_len = max(1, q_len + kv_extra)
    q, k, v = make_qkv(batch, kv_heads * group, kv_heads, q_len, kv_len, head_dim, dtype, "cpu",
                       requires_grad=True)
    out, lse = run_op(q, k, v, causal, window)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_out, ref_lse, ref_grads = reference_results(q, k, v, grad_out, causal, window)
    assert_close(out, ref_out, FORWARD_TOL[dtype], "out")
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert_close(lse, ref_lse, FORWARD_TOL[dtype], "lse")
    for name, t, ref in zip("qkv", (q, k, v), ref_grads):
        assert_close(t.grad, ref, GRAD_TOL[dtype], f"grad_{name}")


# --- caller masks and dropout ---------------------------------------------------------

def _masks(kind, b, hq, sq, sk, device):
    g = torch.Generator().manual_seed(7)
    if kind == "padding_bool":  # [B, 1, 1, Sk], left padding of different lengths
        lengths = torch.tensor([sk, max(1, sk - 5)][:b])
        return (torch.arange(sk) >= (sk - lengths).view(-1, 1)).view(b, 1, 1, sk).to(device)
    if kind == "notebook_causal_int":  # the notebooks' [Sq, Sk] 1/0 causal mask, as bool
        return torch.ones(sq, sk).tril(sk - sq).bool().to(device)
    if kind == "additive_float32":
        return torch.randn(sq, sk, generator=g).to(device)
    if kind == "additive_bfloat16_4d":  # HF style: finfo.min where masked, model dtype
        m = torch.zeros(b, hq, sq, sk)
        m[torch.rand(b, hq, sq, sk, generator=g) < 0.3] = torch.finfo(torch.bfloat16).min
        return m.bfloat16().to(device)
    if kind == "additive_neg_inf_heads":  # per-head rows, -inf entries
        m = torch.randn(1, hq, sq, 1, generator=g).expand(1, hq, sq, sk).clone()
        m[..., ::3] = float("-inf")
        return m.to(device)
    raise AssertionError(kind)


MASK_KINDS = ["padding_bool", "notebook_causal_int", "additive_float32", "additive_bfloat16_4d",
              "additive_neg_inf_heads"]


@pytest.mark.parametrize("dtype", cpu_variants([torch.float32, torch.bfloat16, torch.float64], torch.float32),
                         ids=str)
@pytest.mark.parametrize("kind", cpu_variants(MASK_KINDS, "additive_float32"))
@pytest.mark.parametrize("shape,causal", [((2, 8, 2, 37, 37, 64), True), ((1, 8, 2, 1, 2100, 128), False),
                                          ((1, 6, 2, 40, 150, 80), False)],
                         ids=["prefill_causal", "decode_split_keys", "chunked"])
def test_masks_match_reference(device, shape, causal, kind, dtype):
    b, hq, hkv, sq, sk, d = shape
    q, k, v = make_qkv(*shape, dtype, device, requires_grad=True)
    mask = _masks(kind, b, hq, sq, sk, device)
    mask_before = mask.clone()
    out = fusedllm.attention(q, k, v, causal=causal, mask=mask)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = ref_attention(qd, kd, vd, causal=causal, mask=mask)
    ref.backward(grad_out.double())
    assert_close(out, ref.detach(), FORWARD_TOL[dtype], "out")
    for name, t, r in zip("qkv", (q, k, v), (qd.grad, kd.grad, vd.grad)):
        assert_close(t.grad, r, GRAD_TOL[dtype], f"grad_{name}")
    assert torch.equal(mask, mask_before)


def test_fully_masked_rows_are_zero_not_nan(device):
    q, k, v = make_qkv(2, 4, 2, 6, 9, 16, torch.float32, device, requires_grad=True)
    keep = torch.ones(2, 1, 6, 9, dtype=torch.bool, device=device)
    keep[0, :, 2] = False  # every key masked for query 2 of batch 0
    additive = torch.zeros(2, 1, 6, 9, device=device).masked_fill(~keep, float("-inf"))
    for mask in (keep, additive):
        out = fusedllm.attention(q, k, v, mask=mask)
        assert torch.equal(out[0, :, 2], torch.zeros_like(out[0, :, 2]))
        assert torch.isfinite(out).all()
        gq, gk, gv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        assert torch.equal(gq[0, :, 2], torch.zeros_like(gq[0, :, 2]))
        assert all(torch.isfinite(g).all() for g in (gq, gk, gv))


def test_masks_combine_with_causal_and_window(device):
    q, k, v = make_qkv(2, 4, 2, 30, 30, 32, torch.float64, device)
    pad = _masks("padding_bool", 2, 4, 30, 30, device)
    got = fusedllm.attention(q, k, v, causal=True, window=8, mask=pad)
    ref, _ = ref_attention(q, k, v, causal=True, window=8, mask=pad)
    torch.testing.assert_close(got, ref)
    # a bool mask and the equivalent additive -inf mask give the same result
    additive = torch.zeros(pad.shape, dtype=torch.float64, device=device).masked_fill(~pad, float("-inf"))
    torch.testing.assert_close(fusedllm.attention(q, k, v, causal=True, mask=additive),
                               fusedllm.attention(q, k, v, causal=True, mask=pad))


def _dropout_reference(q, k, v, seed, p, **kw):
    from fusedllm import _philox
    b, hq, sq, _ = q.shape
    keep = _philox.dropout_keep(seed, (b, hq, sq, k.shape[2]), p, q.device)
    return ref_attention(q, k, v, keep=keep, dropout_p=p, **kw)


@pytest.mark.cpu_variants
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(2, 4, 2, 33, 33, 64), (1, 8, 1, 1, 2100, 128), (1, 2, 2, 20, 9, 7)],
                         ids=["prefill", "decode_split_keys", "q_longer"])
def test_dropout_matches_reference_pattern(device, shape, dtype):
    """The kernels draw exactly the pattern the documented generator gives."""
    p, seed = 0.3, 987654321987
    q, k, v = make_qkv(*shape, dtype, device, requires_grad=True)
    bias = torch.randn(shape[3], shape[4], device=device)
    out, _ = ops.attention(q, k, v, bias, 0.5, True, -1, p, torch.tensor([seed]))
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = _dropout_reference(qd, kd, vd, seed, p, causal=True, scale=0.5, mask=bias.double())
    ref.backward(grad_out.double())
    assert_close(out, ref.detach(), FORWARD_TOL[dtype], "out")
    for name, t, r in zip("qkv", (q, k, v), (qd.grad, kd.grad, vd.grad)):
        assert_close(t.grad, r, GRAD_TOL[dtype], f"grad_{name}")


def test_dropout_repeats_under_manual_seed_and_differs_across_seeds(device):
    q, k, v = make_qkv(1, 4, 2, 16, 16, 32, torch.float32, device)
    torch.manual_seed(3)
    a = fusedllm.attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(3)
    b = fusedllm.attention(q, k, v, dropout_p=0.5)
    c = fusedllm.attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.equal(fusedllm.attention(q, k, v, dropout_p=0.0), fusedllm.attention(q, k, v))


def test_dropout_keeps_the_expected_fraction_and_the_mean(device):
    """With v = 1 every output entry is sum_j P_j z_j / (1 - p): mean 1."""
    p = 0.25
    q, k, _ = make_qkv(2, 8, 2, 64, 256, 16, torch.float32, device)
    v = torch.ones_like(k)
    out = fusedllm.attention(q, k, v, dropout_p=p)
    assert abs(out.mean().item() - 1.0) < 0.02
    from fusedllm import _philox
    keep = _philox.dropout_keep(123, (4, 8, 64, 256), p)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.005


def test_dropout_gradcheck_with_fixed_seed(device):
    q, k, v = make_qkv(1, 4, 2, 5, 7, 8, torch.float64, device, requires_grad=True)
    seed = torch.tensor([42])
    bias = torch.randn(5, 7, dtype=torch.float64, device=device)
    assert torch.autograd.gradcheck(
        lambda *t: ops.attention(*t, bias, 0.6, True, -1, 0.4, seed)[0], (q, k, v))


def test_attention_with_weights_is_the_same_attention(device):
    """The plain path that returns the weights computes what the kernel does,
    dropout pattern included (same seed), and its weights are the softmax."""
    from fusedllm.functional import attention_with_weights
    q, k, v = make_qkv(2, 4, 2, 12, 20, 16, torch.float32, device)
    pad = _masks("padding_bool", 2, 4, 12, 20, device)
    for p in (0.0, 0.3):
        torch.manual_seed(5)
        out_w, weights = attention_with_weights(q, k, v, causal=True, window=9, mask=pad, dropout_p=p)
        torch.manual_seed(5)
        out = fusedllm.attention(q, k, v, causal=True, window=9, mask=pad, dropout_p=p)
        assert_close(out_w, out, FORWARD_TOL[torch.float32])
        torch.testing.assert_close(torch.matmul(weights, v.repeat_interleave(2, dim=1)), out_w,
                                   atol=1e-5, rtol=1e-5)
    _, expected_lse = ref_attention(q, k, v, causal=True, window=9, mask=pad)
    _, weights = attention_with_weights(q, k, v, causal=True, window=9, mask=pad)
    assert_close(weights.sum(-1), torch.ones_like(expected_lse), FORWARD_TOL[torch.float32])


# --- memory ------------------------------------------------------------------------


@pytest.mark.slow
def test_long_sequence_memory_stays_linear(device):
    """S = 8192: forward and backward peak memory grows like S, not S^2, and the
    last rows match the reference computed for those rows alone."""
    hq, hkv, d = 8, 2, 64
    peaks = {}
    for s in (2048, 8192):
        q, k, v = make_qkv(1, hq, hkv, s, s, d, torch.float32, device, requires_grad=True)
        grad_out = torch.randn_like(q)
        holder = {}

        def step():
            out = fusedllm.attention(q, k, v, causal=True)
            out.backward(grad_out)
            holder["out"] = out.detach()

        peaks[s] = peak_memory_bytes(step, device)
        if s == 8192:
            out = holder["out"]
            tail = 16  # bottom-right alignment: the last rows alone are a valid call
            ref_out, _ = ref_attention(q[:, :, -tail:].detach().double(), k.detach().double(),
                                       v.detach().double(), causal=True)
            assert_close(out[:, :, -tail:], ref_out, FORWARD_TOL[torch.float32])
            assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    qkv_bytes = lambda s: 4 * s * d * (hq + 2 * hkv)  # noqa: E731
    scores_bytes = 4 * hq * 8192 * 8192  # what one [Sq, Sk] float32 matrix per head would take
    assert peaks[8192] < scores_bytes / 8, peaks
    # everything allocated (outputs, gradients, scratch) is a small multiple of the inputs
    assert peaks[8192] < 6 * qkv_bytes(8192), peaks
    assert peaks[8192] / peaks[2048] < 4 * 1.25, peaks


# --- bad input ------------------------------------------------------------------------

def _t(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


BAD_CALLS = [
    ("number of query heads \\(6\\) must be a multiple of the number of key/value heads \\(4\\)",
     lambda: fusedllm.attention(_t(1, 6, 5, 8), _t(1, 4, 5, 8), _t(1, 4, 5, 8))),
    ("same head_dim", lambda: fusedllm.attention(_t(1, 4, 5, 8), _t(1, 2, 5, 16), _t(1, 2, 5, 16))),
    ("k and v must have the same shape",
     lambda: fusedllm.attention(_t(1, 4, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 6, 8))),
    ("same batch size", lambda: fusedllm.attention(_t(2, 4, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8))),
    ("head_dim must be between 1 and 256, got 320",
     lambda: fusedllm.attention(_t(1, 2, 3, 320), _t(1, 2, 3, 320), _t(1, 2, 3, 320))),
    ("k has dtype torch.float16 but q has dtype torch.float32",
     lambda: fusedllm.attention(_t(1, 2, 3, 8), _t(1, 2, 3, 8, dtype=torch.float16), _t(1, 2, 3, 8))),
    ("v is on meta but q is on cpu",
     lambda: fusedllm.attention(_t(1, 2, 3, 8), _t(1, 2, 3, 8), _t(1, 2, 3, 8, device="meta"))),
    ("q must be float32, float64, bfloat16 or float16, got torch.int64",
     lambda: fusedllm.attention(torch.ones(1, 2, 3, 8, dtype=torch.long),
                                torch.ones(1, 2, 3, 8, dtype=torch.long),
                                torch.ones(1, 2, 3, 8, dtype=torch.long))),
    ("q must be 4-D", lambda: fusedllm.attention(_t(2, 3, 8), _t(1, 2, 3, 8), _t(1, 2, 3, 8))),
    ("window must be None, an int >= 1",
     lambda: fusedllm.attention(_t(1, 2, 3, 8), _t(1, 2, 3, 8), _t(1, 2, 3, 8), window=0)),
    ("scale must be a finite number",
     lambda: fusedllm.attention(_t(1, 2, 3, 8), _t(1, 2, 3, 8), _t(1, 2, 3, 8), scale=float("nan"))),
    ("mask of shape \\[3, 4\\] does not broadcast to \\[batch, q_heads, q_len, kv_len\\] = \\[1, 2, 3, 3\\]",
     lambda: fusedllm.attention(_t(1, 2, 3, 8), _t(1, 2, 3, 8), _t(1, 2, 3, 8), mask=_t(3, 4))),
    ("mask must be a bool keep-mask .* got torch.int64",
     lambda: fusedllm.attention(_t(1, 2, 3, 8), _t(1, 2, 3, 8), _t(1, 2, 3, 8),
                                mask=torch.ones(3, 3, dtype=torch.long))),
    ("mask is on meta but q is on cpu",
     lambda: fusedllm.attention(_t(1, 2, 3, 8), _t(1, 2, 3, 8), _t(1, 2, 3, 8), mask=_t(3, 3, device="meta"))),
    ("mask requires grad",
     lambda: fusedllm.attention(_t(1, 2, 3, 8), _t(1, 2, 3, 8), _t(1, 2, 3, 8),
                                mask=_t(3, 3).requires_grad_())),
    ("dropout_p must be in \\[0, 1\\), got 1.0",
     lambda: fusedllm.attention(_t(1, 2, 3, 8), _t(1, 2, 3, 8), _t(1, 2, 3, 8), dropout_p=1.0)),
    ("dropout_p must be >= 0",
     lambda: fusedllm.attention(_t(1, 2, 3, 8), _t(1, 2, 3, 8), _t(1, 2, 3, 8), dropout_p=-0.1)),
    ("causal must be True or False",
     lambda: fusedllm.attention(_t(1, 2, 3, 8), _t(1, 2, 3, 8), _t(1, 2, 3, 8), causal="yes")),
]


@pytest.mark.parametrize("message,call", BAD_CALLS, ids=[m for m, _ in BAD_CALLS])
def test_bad_input_is_a_clear_error(message, call):
    with pytest.raises(ValueError, match=message):
        call()


def test_non_tensor_input_is_a_type_error():
    with pytest.raises(TypeError, match="k must be a torch.Tensor, got list"):
        fusedllm.attention(_t(1, 2, 3, 8), [1.0], _t(1, 2, 3, 8))


def _op_forward(q=None, k=None, v=None, mask=None, causal=False, window=-1, dropout_p=0.0, seed=None):
    """torch.ops.fusedllm.attention with scale 1 (q, k, v: [1, 2, 3, 8] where not given)."""
    q, k, v = (_t(1, 2, 3, 8) if x is None else x for x in (q, k, v))
    return ops.attention(q, k, v, mask, 1.0, causal, window, dropout_p, seed)


def _op_backward(grad_out, lse):
    """torch.ops.fusedllm.attention_backward of [1, 2, 3, 8] q, k, v and out."""
    x = _t(1, 2, 3, 8)
    return ops.attention_backward(grad_out, x, x, x, x, lse, None, 1.0, False, -1, 0.0, None)


OP_BAD_CALLS = [
    pytest.param(ValueError, r"mask of shape \[2, 1, 3, 3\] does not broadcast",
                 lambda: _op_forward(mask=_t(2, 1, 3, 3)),
                 id="mask_shape"),
    pytest.param(ValueError, r"mask must be a bool keep-mask .* got torch\.int32",
                 lambda: _op_forward(mask=torch.ones(3, 3, dtype=torch.int32)),
                 id="mask_dtype"),
    pytest.param(ValueError, r"dropout_p > 0 needs seed",
                 lambda: _op_forward(dropout_p=0.5),
                 id="dropout_without_seed"),
    pytest.param(ValueError, r"dropout_p must be in \[0, 1\), got 1\.5",
                 lambda: _op_forward(dropout_p=1.5, seed=torch.tensor([1])),
                 id="dropout_p_range"),
    pytest.param(ValueError, r"query heads \(6\) must be a multiple of the number of key/value heads \(4\)",
                 lambda: _op_forward(q=_t(1, 6, 5, 8), k=_t(1, 4, 5, 8), v=_t(1, 4, 5, 8)),
                 id="heads_not_a_multiple"),
    pytest.param(ValueError, r"q and k/v must have the same head_dim, got 8 and 16",
                 lambda: _op_forward(q=_t(1, 4, 5, 8), k=_t(1, 2, 5, 16), v=_t(1, 2, 5, 16)),
                 id="head_dim_mismatch"),
    pytest.param(ValueError, r"k and v must have the same shape, got \[1, 2, 5, 8\] and \[1, 2, 6, 8\]",
                 lambda: _op_forward(q=_t(1, 4, 5, 8), k=_t(1, 2, 5, 8), v=_t(1, 2, 6, 8)),
                 id="k_v_shape_mismatch"),
    pytest.param(ValueError, r"q and k/v must have the same batch size, got 2 and 1",
                 lambda: _op_forward(q=_t(2, 4, 5, 8), k=_t(1, 2, 5, 8), v=_t(1, 2, 5, 8)),
                 id="batch_mismatch"),
    pytest.param(ValueError, r"head_dim must be between 1 and 256, got 300",
                 lambda: _op_forward(q=_t(1, 2, 3, 300), k=_t(1, 2, 3, 300), v=_t(1, 2, 3, 300)),
                 id="head_dim_too_large"),
    pytest.param(ValueError, r"k has dtype torch\.float64 but q has dtype torch\.float32",
                 lambda: _op_forward(k=_t(1, 2, 3, 8).double()),
                 id="k_dtype_mismatch"),
    pytest.param(ValueError, r"window must be -1 \(no window\) or a number of keys >= 1, got 0",
                 lambda: _op_forward(causal=True, window=0),
                 id="window_zero"),
    pytest.param(ValueError, r"query heads \(2\) must be a multiple of the number of key/value heads \(0\)",
                 lambda: _op_forward(k=_t(1, 0, 3, 8), v=_t(1, 0, 3, 8), causal=True),
                 id="zero_kv_heads"),
    pytest.param(ValueError, r"q must be 4-D \[batch, q_heads, q_len, head_dim\], got shape \[2, 3, 8\]",
                 lambda: _op_forward(q=_t(2, 3, 8), causal=True),
                 id="q_not_4d"),
    pytest.param(ValueError, r"attention_backward: lse must be the torch\.float32 \[1, 2, 3\] tensor .* "
                             r"got torch\.float32 \[1, 2, 4\]",
                 lambda: _op_backward(_t(1, 2, 3, 8), _t(1, 2, 4)),
                 id="backward_lse_shape"),
    pytest.param(ValueError, r"attention_backward: grad_out must have the shape of q \[1, 2, 3, 8\], "
                             r"got \[1, 2, 4, 8\]",
                 lambda: _op_backward(_t(1, 2, 4, 8), _t(1, 2, 3)),
                 id="backward_grad_out_shape"),
    pytest.param(ValueError, r"attention_backward: lse must be the torch\.float32 \[1, 2, 3\] tensor .* "
                             r"got torch\.float64 \[1, 2, 3\]",
                 lambda: _op_backward(_t(1, 2, 3, 8), _t(1, 2, 3).double()),
                 id="backward_lse_dtype"),
]


@pytest.mark.parametrize("error,message,call", OP_BAD_CALLS)
def test_operator_rejects_bad_input_without_crashing(error, message, call):
    # Direct torch.ops callers skip the Python checks; the C++ ones still apply.
    with pytest.raises(error, match=message):
        call()


def test_reference_path_matches_reference():
    """The plain-PyTorch path used without the extension computes the same thing."""
    from fusedllm import _plain
    q, k, v = make_qkv(1, 6, 2, 30, 45, 16, torch.float64, "cpu")
    for causal, window in MASKS:
        out, lse = _plain.attention(q, k, v, None, 0.3, causal, -1 if window is None else window,
                                       0.0, None)
        ref_out, ref_lse = ref_attention(q, k, v, causal=causal, scale=0.3, window=window)
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(lse, ref_lse)


