"""attention's options (softcap, sinks, ALiBi slopes, (left, right) windows) and
attention_varlen: values and gradients against tests/reference.py, the per-sequence
equivalence of packed calls, the operator contract (opcheck, gradcheck,
torch.compile), determinism and errors."""

import functools
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import checks
import fusedllm
from checks import FORWARD_TOL, GRAD_TOL, emulated, results_across_thread_counts
from conftest import cpu_variants
from reference import attention as ref_attention
from reference import attention_varlen as ref_attention_varlen
from reference import window_bounds
from test_attention import _masks, make_qkv

ops = torch.ops.fusedllm
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]

# Against float64 references, compared unrounded.
assert_close = functools.partial(checks.assert_close, upcast=True)

# (batch, q_heads, kv_heads, q_len, kv_len, head_dim): group ratios 1, 2 and 4;
# prefill, chunked prefill (q_len < kv_len), more queries than keys (the first
# rows see nothing under causal), and decoding over a long cache.
SHAPES = [
    (2, 4, 4, 17, 17, 32),
    (1, 4, 2, 23, 61, 16),
    (2, 8, 2, 40, 19, 8),
    (1, 8, 2, 1, 300, 64),
]


def alibi_slopes(q_heads, batch=None, device="cpu", dtype=torch.float32):
    """The ALiBi paper's geometric slopes 2^(-8 (h + 1) / q_heads); with a batch
    size, [batch, q_heads] rows scaled differently so that a kernel reading the
    wrong row differs."""
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / q_heads) for h in range(q_heads)], dtype=dtype)
    if batch is not None:
        slopes = slopes * torch.linspace(2.0, 0.5, batch, dtype=dtype).unsqueeze(1)
    return slopes.to(device)


def make_sinks(q_heads, device, dtype=torch.float32):
    # Around e^2 against row sums of a few e^s: large enough that the sink
    # takes a visible share of every row.
    return (2.0 + torch.randn(q_heads, dtype=dtype)).to(device).requires_grad_()


def make_options(name, batch, q_heads, device):
    """Keyword arguments of fusedllm.attention for an option case (without causal)."""
    softcap = dict(softcap=1.5, scale=0.3)  # scores of a few units, where tanh bends
    if name == "softcap":
        return softcap
    if name == "sinks":
        return dict(sinks=make_sinks(q_heads, device))
    if name == "alibi":
        return dict(alibi_slopes=alibi_slopes(q_heads, device=device))
    if name == "alibi_per_batch":
        return dict(alibi_slopes=alibi_slopes(q_heads, batch, device=device))
    if name == "window_left_right":
        return dict(window=(6, 2))
    if name == "window_right_only":
        return dict(window=(-1, 3))
    if name == "window_diagonal":
        return dict(window=(0, 0))
    if name == "window_left_only":
        return dict(window=(5, -1))
    if name == "all":
        return dict(**softcap, sinks=make_sinks(q_heads, device),
                    alibi_slopes=alibi_slopes(q_heads, batch, device=device), window=(9, 3))
    raise AssertionError(name)


# (option, causal)
OPTION_CASES = [
    ("softcap", False), ("softcap", True),
    ("sinks", False), ("sinks", True),
    ("alibi", False), ("alibi", True), ("alibi_per_batch", True),
    ("window_left_right", False), ("window_right_only", False), ("window_diagonal", False),
    ("window_left_only", True),
    ("all", False), ("all", True),
]


def _differentiable(q, k, v, options):
    sinks = options.get("sinks")
    return [q, k, v] + ([sinks] if sinks is not None and sinks.requires_grad else [])


def reference_results(q, k, v, grad_out, **options):
    """float64 reference output, lse and gradients of q, k, v (and of sinks when
    they require grad), no intermediate rounding."""
    leaves = [t.detach().double().requires_grad_() for t in _differentiable(q, k, v, options)]
    options = dict(options)
    if options.get("sinks") is not None:
        options["sinks"] = leaves[3] if len(leaves) == 4 else options["sinks"].double()
    out, lse = ref_attention(*leaves[:3], **options)
    grads = torch.autograd.grad(out, leaves, grad_out.double())
    return out.detach(), lse.detach(), grads


def grad_tolerances(dtype, options):
    """q, k, v's gradient tolerance by their dtype; the sinks' by the looser of
    theirs and q's (their gradient is rounded to their dtype)."""
    sinks = options.get("sinks")
    tol = [GRAD_TOL[dtype]] * 3
    if sinks is not None:
        tol.append(max(GRAD_TOL[dtype], GRAD_TOL[sinks.dtype]))
    return tol


def check_against_reference(q, k, v, out, grad_out, grads, dtype, what="", **options):
    ref_out, _, ref_grads = reference_results(q, k, v, grad_out, **options)
    assert_close(out, ref_out, FORWARD_TOL[dtype], f"{what}out")
    for name, got, ref, tol in zip(("q", "k", "v", "sinks"), grads, ref_grads, grad_tolerances(dtype, options)):
        assert_close(got, ref, tol, f"{what}grad_{name}")


@pytest.mark.cpu_variants(shape=[(2, 4, 4, 17, 17, 32), (1, 8, 2, 1, 300, 64)], dtype=[torch.float32])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("option,causal", OPTION_CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_option_matches_reference(device, shape, option, causal, dtype):
    b, hq, hkv, sq, sk, d = shape
    q, k, v = make_qkv(*shape, dtype, device, requires_grad=True)
    options = make_options(option, b, hq, device)
    kept = {name: t.detach().clone() for name, t in options.items() if isinstance(t, torch.Tensor)}
    out = fusedllm.attention(q, k, v, causal=causal, **options)
    assert out.shape == q.shape and out.dtype == dtype
    grad_out = torch.randn_like(out)
    leaves = _differentiable(q, k, v, options)
    grads = torch.autograd.grad(out, leaves, grad_out)
    if "sinks" in options:
        assert grads[3].dtype == options["sinks"].dtype and grads[3].shape == (hq,)
    check_against_reference(q, k, v, out, grad_out, grads, dtype, causal=causal, **options)
    for name, before in kept.items():
        assert torch.equal(options[name].detach(), before), f"{name} was modified"


@pytest.mark.parametrize("option", ["softcap", "sinks", "alibi", "alibi_per_batch", "window_left_right",
                                    "window_right_only", "window_diagonal", "window_left_only"])
def test_each_option_changes_the_result(device, option):
    """Guards the reference comparisons above: on this shape every option moves
    the output and the gradients well past the float32 tolerance, so a kernel
    that ignored one would fail them."""
    shape = (2, 4, 2, 20, 24, 16)
    q, k, v = make_qkv(*shape, torch.float32, device, requires_grad=True)
    options = make_options(option, 2, 4, device)
    scale = options.get("scale")
    plain = fusedllm.attention(q, k, v, scale=scale)
    with_option = fusedllm.attention(q, k, v, **options)
    assert (with_option - plain).abs().max() > 1e-2
    grad_out = torch.randn_like(plain)
    plain_grads = torch.autograd.grad(plain, (q, k, v), grad_out)
    option_grads = torch.autograd.grad(with_option, (q, k, v), grad_out)
    for a, b in zip(plain_grads, option_grads):
        assert (a - b).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", cpu_variants([torch.float32, torch.float64, torch.bfloat16], torch.float32),
                         ids=str)
@pytest.mark.parametrize("kind", cpu_variants(["padding_bool", "additive_float32", "additive_bfloat16_4d",
                                               "additive_neg_inf_heads"], "additive_float32"))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_options_with_masks(device, kind, causal, dtype):
    """softcap, sinks, ALiBi and a (left, right) window on top of a caller's mask:
    the mask is added after softcap and ALiBi."""
    shape = (2, 8, 2, 21, 30, 16)
    q, k, v = make_qkv(*shape, dtype, device, requires_grad=True)
    options = make_options("all", 2, 8, device)
    mask = _masks(kind, 2, 8, 21, 30, device)
    out = fusedllm.attention(q, k, v, causal=causal, mask=mask, **options)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, _differentiable(q, k, v, options), grad_out)
    check_against_reference(q, k, v, out, grad_out, grads, dtype, causal=causal, mask=mask, **options)


def _op_window(window):
    """fusedllm.attention's window argument as the op takes it: (left + 1, right), -1 for none."""
    left, right = window_bounds(window)
    return (-1 if left < 0 else left + 1), right


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(2, 4, 2, 33, 33, 32), (1, 8, 2, 1, 700, 64), (1, 2, 2, 20, 9, 7)],
                         ids=["prefill", "decode_split_keys", "q_longer"])
def test_dropout_with_options_matches_reference_pattern(device, shape, dtype):
    """Dense calls draw the same dropout pattern with the options as without; the
    sink's probability is never dropped (it multiplies no value)."""
    from fusedllm import _philox

    p, seed = 0.3, 987654321987
    b, hq, _, sq, sk, _ = shape
    q, k, v = make_qkv(*shape, dtype, device, requires_grad=True)
    sinks = make_sinks(hq, device)
    slopes = alibi_slopes(hq, b, device=device)
    window = (sk // 2, 4)
    bias = torch.randn(sq, sk, device=device)
    left, right = _op_window(window)
    out, _ = ops.attention(q, k, v, bias, 0.5, False, left, p, torch.tensor([seed]), right, 2.0, sinks,
                           slopes, None, None, 0, 0)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sinks), grad_out)
    keep = _philox.dropout_keep(seed, (b, hq, sq, sk), p, q.device)
    check_against_reference(q, k, v, out, grad_out, grads, dtype, scale=0.5, window=window, mask=bias,
                            keep=keep, dropout_p=p, softcap=2.0, sinks=sinks, alibi_slopes=slopes)


# --- windows ----------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", [(24, 24), (8, 40), (40, 8)], ids=["same", "q_shorter", "q_longer"])
@pytest.mark.parametrize("window", [(0, 0), (3, 5), (-1, 0), (-1, 6), (4, -1), (0, -1), (30, 30), (-1, -1)],
                         ids=lambda w: f"{w[0]}_{w[1]}")
def test_local_windows_match_reference(device, window, sq, sk, causal):
    """FlashAttention's local windows (left, right) with bottom-right alignment,
    with and without causal, as many queries as keys or not."""
    q, k, v = make_qkv(2, 4, 2, sq, sk, 16, torch.float32, device, requires_grad=True)
    out = fusedllm.attention(q, k, v, causal=causal, window=window)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    check_against_reference(q, k, v, out, grad_out, grads, torch.float32, causal=causal, window=window)


@pytest.mark.parametrize("option", ["softcap", "sinks", "alibi_per_batch", "window_left_right", "all"])
def test_op_lse_matches_reference(device, option):
    """The op's log-sum-exp [B, Hq, Sq] is the log of each row's softmax
    denominator, the sink's term included (a row that sees no key then has
    lse = its sink, not -inf); backward reads it."""
    b, hq, sq, sk = 2, 4, 30, 12
    q, k, v = make_qkv(b, hq, 2, sq, sk, 16, torch.float32, device)
    options = make_options(option, b, hq, device)
    left, right = _op_window(options.get("window"))
    scale = options.get("scale", 0.25)
    out, lse = ops.attention(q, k, v, None, scale, True, left, 0.0, None, right, options.get("softcap", 0.0),
                             options.get("sinks"), options.get("alibi_slopes"), None, None, 0, 0)
    ref_out, ref_lse = ref_attention(q.double(), k.double(), v.double(), causal=True,
                                     **dict(options, scale=scale))
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "rows without keys differ"
    assert_close(out, ref_out, FORWARD_TOL[torch.float32], "out")
    assert_close(lse, ref_lse.detach(), FORWARD_TOL[torch.float32], "lse")


def test_window_pairs_equal_their_int_and_mask_forms(device):
    """An int window w is the pair (w - 1, -1); (-1, -1) is no window; any pair
    equals the bool band mask p - left <= j <= p + right."""
    q, k, v = make_qkv(2, 4, 2, 13, 29, 16, torch.float64, device)
    for causal in (False, True):
        for w in (1, 4, 40):
            torch.testing.assert_close(fusedllm.attention(q, k, v, causal=causal, window=(w - 1, -1)),
                                       fusedllm.attention(q, k, v, causal=causal, window=w))
        torch.testing.assert_close(fusedllm.attention(q, k, v, causal=causal, window=(-1, -1)),
                                   fusedllm.attention(q, k, v, causal=causal))
    position = torch.arange(13, device=device).unsqueeze(1) + 29 - 13
    key = torch.arange(29, device=device).unsqueeze(0)
    for left, right in [(2, 3), (0, 7), (-1, 1), (5, -1)]:
        band = torch.ones(13, 29, dtype=torch.bool, device=device)
        if left >= 0:
            band &= key >= position - left
        if right >= 0:
            band &= key <= position + right
        torch.testing.assert_close(fusedllm.attention(q, k, v, window=(left, right)),
                                   fusedllm.attention(q, k, v, mask=band))


def test_right_bound_without_causal_sees_future_keys(device):
    """(0, r) without causal: each query sees itself and the next r keys only."""
    q, k, v = make_qkv(1, 2, 1, 10, 10, 8, torch.float32, device, requires_grad=True)
    out = fusedllm.attention(q, k, v, window=(0, 2))
    gq, gk, gv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    # the last query sees only its own key: the output is that key's value
    assert_close(out[:, :, -1], v[:, :, -1].detach().double().expand(1, 2, 8), FORWARD_TOL[torch.float32])
    # changing keys before a query's window leaves its output alone
    k2 = k.detach().clone()
    k2[:, :, :5] += 3.0
    out2 = fusedllm.attention(q, k2, v, window=(0, 2))
    torch.testing.assert_close(out2[:, :, 5:], out[:, :, 5:].detach())
    assert not torch.allclose(out2[:, :, :5], out[:, :, :5].detach())


def test_empty_window_rows_are_zero(device):
    """More queries than keys and (0, 0): queries at negative positions see no key."""
    q, k, v = make_qkv(1, 4, 2, 12, 5, 16, torch.float32, device, requires_grad=True)
    out = fusedllm.attention(q, k, v, window=(0, 0))
    assert torch.equal(out[:, :, :7], torch.zeros_like(out[:, :, :7]))
    gq, gk, gv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert torch.equal(gq[:, :, :7], torch.zeros_like(gq[:, :, :7]))
    assert all(torch.isfinite(g).all() for g in (gq, gk, gv))


# --- sinks, softcap, ALiBi: properties ---------------------------------------------------


def test_rows_without_keys_and_sinks_are_zero_with_finite_gradients(device):
    """A row that sees no key puts all its probability on the sink: output 0,
    and it adds nothing to any gradient (dO . O = 0 for the sink's)."""
    q, k, v = make_qkv(1, 4, 2, 40, 16, 32, torch.float32, device, requires_grad=True)
    sinks = make_sinks(4, device)
    out = fusedllm.attention(q, k, v, causal=True, sinks=sinks)
    assert torch.equal(out[:, :, :24], torch.zeros_like(out[:, :, :24]))
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sinks), grad_out)
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(grads[0][:, :, :24], torch.zeros_like(grads[0][:, :, :24]))
    check_against_reference(q, k, v, out, grad_out, grads, torch.float32, causal=True, sinks=sinks)
    # the rows that see keys alone give the same sink gradient
    tail = fusedllm.attention(q[:, :, 24:], k, v, causal=True, sinks=sinks)
    (tail_grad,) = torch.autograd.grad(tail, sinks, grad_out[:, :, 24:])
    assert_close(grads[3], tail_grad.double(), GRAD_TOL[torch.float32])


@pytest.mark.parametrize("sinks_dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sinks_in_any_float_dtype(device, dtype, sinks_dtype):
    """sinks may have a dtype other than q's; their gradient comes in theirs."""
    q, k, v = make_qkv(1, 4, 2, 9, 14, 16, dtype, device, requires_grad=True)
    sinks = make_sinks(4, device, sinks_dtype)
    out = fusedllm.attention(q, k, v, causal=True, sinks=sinks)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sinks), grad_out)
    assert grads[3].dtype == sinks_dtype
    check_against_reference(q, k, v, out, grad_out, grads, dtype, causal=True, sinks=sinks)


def test_sinks_without_grad_and_gradients_only_where_asked(device):
    q, k, v = make_qkv(1, 4, 2, 9, 14, 16, torch.float32, device)
    sinks = make_sinks(4, device).detach()
    grad_out = torch.randn_like(q)
    # sinks without grad: q, k, v still get theirs
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fusedllm.attention(*leaves, sinks=sinks).backward(grad_out)
    _, _, ref_grads = reference_results(q, k, v, grad_out, sinks=sinks)
    for t, ref in zip(leaves, ref_grads):
        assert_close(t.grad, ref, GRAD_TOL[torch.float32])
    # only sinks ask for a gradient
    wanted = sinks.clone().requires_grad_()
    fusedllm.attention(q, k, v, sinks=wanted).backward(grad_out)
    _, _, ref_grads = reference_results(q, k, v, grad_out, sinks=wanted)
    assert_close(wanted.grad, ref_grads[3], GRAD_TOL[torch.float32])


def test_neutral_option_values(device):
    """Zero slopes are no ALiBi; a softcap far above the scores and sinks far
    below them change nothing measurable."""
    q, k, v = make_qkv(2, 4, 2, 11, 16, 16, torch.float64, device)
    plain = fusedllm.attention(q, k, v, causal=True)
    zeros = torch.zeros(4, dtype=torch.float64, device=device)
    torch.testing.assert_close(fusedllm.attention(q, k, v, causal=True, alibi_slopes=zeros), plain)
    torch.testing.assert_close(fusedllm.attention(q, k, v, causal=True, softcap=1e7), plain,
                               atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(fusedllm.attention(q, k, v, causal=True, sinks=zeros - 200.0), plain)


def test_alibi_with_causal_is_a_linear_bias_on_visible_keys(device):
    """With causal, -slope |p - j| equals slope (j - p): the same as that additive mask."""
    b, hq = 2, 8
    q, k, v = make_qkv(b, hq, 2, 15, 15, 16, torch.float64, device)
    slopes = alibi_slopes(hq, b, device=device, dtype=torch.float64)
    position = torch.arange(15, device=device).unsqueeze(1)
    key = torch.arange(15, device=device).unsqueeze(0)
    bias = slopes.view(b, hq, 1, 1) * (key - position).to(torch.float64)
    torch.testing.assert_close(fusedllm.attention(q, k, v, causal=True, alibi_slopes=slopes),
                               fusedllm.attention(q, k, v, causal=True, mask=bias))
    # without causal the future keys are penalized too, by their distance
    torch.testing.assert_close(fusedllm.attention(q, k, v, alibi_slopes=slopes),
                               fusedllm.attention(q, k, v, mask=-bias.abs()))


def test_softcap_is_applied_before_the_mask_and_alibi(device):
    """A float mask of +20 on one key is added after the cap: a cap of 1 cannot
    hold it back (capping after the mask would)."""
    q, k, v = make_qkv(1, 2, 2, 4, 6, 8, torch.float64, device)
    mask = torch.zeros(4, 6, dtype=torch.float64, device=device)
    mask[:, 2] = 20.0
    out = fusedllm.attention(q, k, v, softcap=1.0, mask=mask)
    ref, _ = ref_attention(q, k, v, softcap=1.0, mask=mask)
    torch.testing.assert_close(out, ref)
    # nearly all the weight is on key 2
    assert_close(out, v[:, :, 2:3].expand_as(out), (1e-3, 1e-3))


@pytest.mark.parametrize("pairs", [1, 8], ids=["few_pairs_split_keys", "one_task_per_pair"])
def test_backward_with_options_is_deterministic(device, pairs):
    """Same bits run to run (on CPU also for any thread count), the sinks'
    gradient included, which sums over every row of a head."""
    b, hkv = (1, 1) if pairs == 1 else (2, 4)
    q, k, v = make_qkv(b, 4 * hkv, hkv, 200, 500, 32, torch.float32, device)
    sinks = make_sinks(4 * hkv, device)
    slopes = alibi_slopes(4 * hkv, b, device=device)
    grad_out = torch.randn_like(q)

    def run():
        qr, kr, vr, sr = (t.detach().clone().requires_grad_() for t in (q, k, v, sinks))
        out = fusedllm.attention(qr, kr, vr, causal=True, window=(100, 0), softcap=5.0, sinks=sr,
                                 alibi_slopes=slopes)
        out.backward(grad_out)
        return out.detach(), qr.grad, kr.grad, vr.grad, sr.grad

    results = results_across_thread_counts(device, run)
    for res in results[1:]:
        for got, first in zip(res, results[0]):
            assert torch.equal(got, first)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [1, 80, 128, 256])
def test_all_options_for_every_head_dim_class(device, head_dim, causal, dtype):
    q, k, v = make_qkv(2, 4, 2, 19, 45, head_dim, dtype, device, requires_grad=True)
    options = make_options("all", 2, 4, device)
    out = fusedllm.attention(q, k, v, causal=causal, **options)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, _differentiable(q, k, v, options), grad_out)
    check_against_reference(q, k, v, out, grad_out, grads, dtype, causal=causal, **options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_long_prefill_with_all_options(device, dtype):
    """Past several key and query tiles: 700 positions, GQA 6:2, two batches."""
    seq = 300 if emulated() else 700
    q, k, v = make_qkv(2, 6, 2, seq, seq, 64, dtype, device, requires_grad=True)
    options = dict(make_options("all", 2, 6, device), window=(250, 40))
    out = fusedllm.attention(q, k, v, **options)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, _differentiable(q, k, v, options), grad_out)
    check_against_reference(q, k, v, out, grad_out, grads, dtype, **options)


def test_strided_sinks_and_slopes(device):
    """sinks and slopes as views with strides other than 1 (a column of a
    matrix, an expanded row, a transposed matrix) read like their copies."""
    b, hq = 2, 4
    q, k, v = make_qkv(b, hq, 2, 11, 16, 16, torch.float32, device, requires_grad=True)
    sinks_table = torch.randn(hq, 3, device=device, requires_grad=True)
    sinks = sinks_table[:, 1]  # stride 3
    slopes = alibi_slopes(hq, b, device=device).t().contiguous().t()  # [B, Hq] with strides (1, B)
    expanded = alibi_slopes(hq, device=device)[None].expand(b, hq)  # stride 0 over the batch
    for slope_view in (slopes, expanded):
        out = fusedllm.attention(q, k, v, causal=True, sinks=sinks, alibi_slopes=slope_view)
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v, sinks_table), grad_out)
        # only the column the sinks are read from gets a gradient
        assert torch.equal(grads[3][:, [0, 2]], torch.zeros_like(grads[3][:, [0, 2]]))
        grads = (*grads[:3], grads[3][:, 1])
        ref_options = dict(causal=True, sinks=sinks.detach().clone().requires_grad_(),
                           alibi_slopes=slope_view.contiguous())
        check_against_reference(q, k, v, out, grad_out, grads, torch.float32, **ref_options)


window_pairs = st.tuples(st.integers(-1, 60), st.integers(-1, 60))


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3, 4]),
    q_len=st.integers(1, 90),
    kv_extra=st.integers(-20, 90),
    head_dim=st.integers(1, 72),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 100), window_pairs),
    softcap=st.one_of(st.none(), st.floats(0.3, 30.0)),
    with_sinks=st.booleans(),
    alibi=st.sampled_from([None, "heads", "batch_heads"]),
    dtype=st.sampled_from(DTYPES),
)
def test_hypothesis_options(batch, kv_heads, group, q_len, kv_extra, head_dim, causal, window, softcap,
                            with_sinks, alibi, dtype):
    kv_len = max(1, q_len + kv_extra)
    q_heads = kv_heads * group
    q, k, v = make_qkv(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, "cpu", requires_grad=True)
    options = dict(causal=causal, window=window, softcap=softcap)
    if with_sinks:
        options["sinks"] = make_sinks(q_heads, "cpu")
    if alibi is not None:
        options["alibi_slopes"] = alibi_slopes(q_heads, batch if alibi == "batch_heads" else None)
    out = fusedllm.attention(q, k, v, **options)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, _differentiable(q, k, v, options), grad_out)
    check_against_reference(q, k, v, out, grad_out, grads, dtype, **options)


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 70)), min_size=1, max_size=6),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([8, 16, 40, 64]),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 50), window_pairs),
    softcap=st.one_of(st.none(), st.floats(0.3, 30.0)),
    with_sinks=st.booleans(),
    alibi=st.sampled_from([None, "heads", "sequence_heads"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_hypothesis_varlen(lengths, kv_heads, group, head_dim, causal, window, softcap, with_sinks, alibi,
                           dtype):
    lengths_q, lengths_k = [lq for lq, _ in lengths], [lk for _, lk in lengths]
    q_heads = kv_heads * group
    q, k, v, cu_q, cu_k = pack(lengths_q, lengths_k, q_heads, kv_heads, head_dim, dtype, "cpu",
                               requires_grad=True)
    options = dict(causal=causal, window=window, softcap=softcap)
    if with_sinks:
        options["sinks"] = make_sinks(q_heads, "cpu")
    if alibi is not None:
        options["alibi_slopes"] = alibi_slopes(q_heads, len(lengths) if alibi == "sequence_heads" else None)
    check_varlen(q, k, v, cu_q, cu_k, dtype, **options)


# --- varlen ---------------------------------------------------------------------------


def pack(lengths_q, lengths_k, q_heads, kv_heads, head_dim, dtype, device, requires_grad=False):
    """Packed q [total_q, Hq, D], k, v [total_k, Hkv, D] and their int32 cu_seqlens."""
    q = torch.randn(sum(lengths_q), q_heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(sum(lengths_k), kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn(sum(lengths_k), kv_heads, head_dim, dtype=dtype, device=device)
    if requires_grad:
        for t in (q, k, v):
            t.requires_grad_()
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu_q, cu_k


def per_sequence_attention(q, k, v, cu_q, cu_k, alibi_slopes=None, **options):
    """fusedllm.attention one sequence at a time, concatenated as varlen lays it out."""
    bq, bk = cu_q.tolist(), cu_k.tolist()
    outs = []
    for b in range(len(bq) - 1):
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        q_b = q[bq[b]:bq[b + 1]].transpose(0, 1)[None]
        k_b = k[bk[b]:bk[b + 1]].transpose(0, 1)[None]
        v_b = v[bk[b]:bk[b + 1]].transpose(0, 1)[None]
        outs.append(fusedllm.attention(q_b, k_b, v_b, alibi_slopes=slopes, **options)[0].transpose(0, 1))
    return torch.cat(outs, dim=0)


def reference_varlen_results(q, k, v, cu_q, cu_k, grad_out, **options):
    leaves = [t.detach().double().requires_grad_() for t in _differentiable(q, k, v, options)]
    options = dict(options)
    if options.get("sinks") is not None:
        options["sinks"] = leaves[3] if len(leaves) == 4 else options["sinks"].double()
    out, lse = ref_attention_varlen(*leaves[:3], cu_q, cu_k, **options)
    grads = torch.autograd.grad(out, leaves, grad_out.double(), allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]
    return out.detach(), lse.detach(), grads


def varlen_options(name, num_seqs, q_heads, device):
    if name == "none":
        return {}
    if name == "causal":
        return dict(causal=True)
    if name == "window":
        return dict(window=(7, 2))
    if name == "window_int_causal":
        return dict(causal=True, window=12)
    if name == "alibi_per_sequence":
        return dict(causal=True, alibi_slopes=alibi_slopes(q_heads, num_seqs, device=device))
    if name in ("softcap", "sinks", "alibi"):
        return make_options(name, num_seqs, q_heads, device)
    if name == "all":
        return dict(causal=True, softcap=1.5, scale=0.3, sinks=make_sinks(q_heads, device),
                    alibi_slopes=alibi_slopes(q_heads, num_seqs, device=device), window=(9, 0))
    if name == "all_noncausal":
        return dict(softcap=1.5, scale=0.3, sinks=make_sinks(q_heads, device),
                    alibi_slopes=alibi_slopes(q_heads, device=device), window=(9, 4))
    raise AssertionError(name)


VARLEN_CASES = ["none", "causal", "window", "window_int_causal", "softcap", "sinks", "alibi",
                "alibi_per_sequence", "all", "all_noncausal"]


def check_varlen(q, k, v, cu_q, cu_k, dtype, max_seqlens=(), **options):
    """varlen against the float64 reference (out and gradients) and against
    fusedllm.attention called per sequence (out and gradients)."""
    args = (q, k, v, cu_q, cu_k, *max_seqlens)
    out = fusedllm.attention_varlen(*args, **options)
    assert out.shape == q.shape and out.dtype == dtype
    grad_out = torch.randn_like(out)
    leaves = _differentiable(q, k, v, options)
    grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]
    ref_out, _, ref_grads = reference_varlen_results(q, k, v, cu_q, cu_k, grad_out, **options)
    assert_close(out, ref_out, FORWARD_TOL[dtype], "out")
    tolerances = grad_tolerances(dtype, options)
    for name, got, ref, tol in zip(("q", "k", "v", "sinks"), grads, ref_grads, tolerances):
        assert_close(got, ref, tol, f"grad_{name}")
    per_seq = per_sequence_attention(q, k, v, cu_q, cu_k, **options)
    checks.assert_close(out, per_seq, FORWARD_TOL[dtype], "out against per-sequence calls")
    seq_grads = torch.autograd.grad(per_seq, leaves, grad_out, allow_unused=True)
    seq_grads = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, seq_grads)]
    for name, got, ref, tol in zip(("q", "k", "v", "sinks"), grads, seq_grads, tolerances):
        checks.assert_close(got, ref, tol, f"grad_{name} against per-sequence calls")
    return out


def mixed_lengths(long):
    """Lengths 1, 17 and `long` in one batch, with q_len != kv_len per sequence,
    an empty sequence, one with queries but no keys and one with more queries
    than keys."""
    lengths_q = [1, 17, long, 0, 12, 9, 5]
    lengths_k = [40, 17, long - 3, 6, 0, 5, 33]
    return lengths_q, lengths_k


@pytest.mark.parametrize("dtype", cpu_variants(DTYPES, torch.float32), ids=str)
@pytest.mark.parametrize("case", VARLEN_CASES)
def test_varlen_matches_reference_and_per_sequence_calls(device, case, dtype):
    # a long sequence past several tiles; 1000 tokens in the test below
    lengths_q, lengths_k = mixed_lengths(130 if emulated() else 300)
    q, k, v, cu_q, cu_k = pack(lengths_q, lengths_k, 8, 2, 32, dtype, device, requires_grad=True)
    options = varlen_options(case, len(lengths_q), 8, device)
    cu_before = (cu_q.clone(), cu_k.clone())
    check_varlen(q, k, v, cu_q, cu_k, dtype, **options)
    assert torch.equal(cu_q, cu_before[0]) and torch.equal(cu_k, cu_before[1])


# A head dim that is not a multiple of 32, which the AMX variant takes on
# copies zero-padded to the next one (amx_head_dim).
@pytest.mark.cpu_variants
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_varlen_head_dim_80(device, dtype):
    lengths_q, lengths_k = mixed_lengths(130)
    q, k, v, cu_q, cu_k = pack(lengths_q, lengths_k, 8, 2, 80, dtype, device, requires_grad=True)
    check_varlen(q, k, v, cu_q, cu_k, dtype, **varlen_options("all", len(lengths_q), 8, device))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["causal", "all", "all_noncausal"])
def test_varlen_long_sequence(device, case, dtype):
    """Lengths 1, 17 and 1000 in one batch. The emulator, slow at 1000 tokens,
    runs that length for one case (a shorter one for the others)."""
    long = 130 if emulated() and (case, dtype) != ("all", torch.float32) else 1000
    lengths_q, lengths_k = mixed_lengths(long)
    q, k, v, cu_q, cu_k = pack(lengths_q, lengths_k, 4, 1, 16, dtype, device, requires_grad=True)
    check_varlen(q, k, v, cu_q, cu_k, dtype, **varlen_options(case, len(lengths_q), 4, device))


@pytest.mark.parametrize("group", [1, 2, 4])
def test_varlen_group_ratios(device, group):
    q, k, v, cu_q, cu_k = pack([5, 30, 2], [9, 30, 70], 2 * group, 2, 16, torch.float32, device,
                               requires_grad=True)
    check_varlen(q, k, v, cu_q, cu_k, torch.float32, **varlen_options("all", 3, 2 * group, device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["causal", "window_int_causal", "all"])
def test_varlen_decode(device, case, dtype):
    """Decoding: one query per sequence over its own cache length, each the last
    position of its cache."""
    cache_lengths = [1, 37, 300, 5, 64, 129]
    n = len(cache_lengths)
    q, k, v, cu_q, cu_k = pack([1] * n, cache_lengths, 8, 2, 64, dtype, device, requires_grad=True)
    options = varlen_options(case, n, 8, device)
    out = check_varlen(q, k, v, cu_q, cu_k, dtype, **options)
    # the same as a dense decode step against each cache
    for b, (start, end) in enumerate(zip(cu_k[:-1].tolist(), cu_k[1:].tolist())):
        slopes = options.get("alibi_slopes")
        dense = dict(options, alibi_slopes=slopes[b] if slopes is not None and slopes.dim() == 2 else slopes)
        step = fusedllm.attention(q[b:b + 1].transpose(0, 1)[None], k[start:end].transpose(0, 1)[None],
                                  v[start:end].transpose(0, 1)[None], **dense)
        checks.assert_close(out[b], step[0, :, 0], FORWARD_TOL[dtype], f"sequence {b}")


@pytest.mark.parametrize("lengths_q,lengths_k", [([0, 3, 0], [0, 0, 5]), ([0, 0], [0, 0]), ([2, 0], [0, 4]),
                                                 ([], [])],
                         ids=["mixed", "all_empty", "no_keys_then_no_queries", "no_sequences"])
def test_varlen_zero_length_sequences(device, lengths_q, lengths_k):
    q, k, v, cu_q, cu_k = pack(lengths_q, lengths_k, 4, 2, 16, torch.float32, device, requires_grad=True)
    sinks = make_sinks(4, device)
    out = fusedllm.attention_varlen(q, k, v, cu_q, cu_k, causal=True, sinks=sinks,
                                    alibi_slopes=alibi_slopes(4, device=device))
    assert out.shape == q.shape
    # every query here sees no key
    assert torch.equal(out, torch.zeros_like(out))
    grads = torch.autograd.grad(out.sum(), (q, k, v, sinks), allow_unused=True)
    for g, t in zip(grads, (q, k, v, sinks)):
        assert g is None or torch.equal(g, torch.zeros_like(t))


@pytest.mark.parametrize("head_dim", [1, 80, 128, 256])
def test_varlen_every_head_dim_class(device, head_dim):
    q, k, v, cu_q, cu_k = pack([5, 40, 1, 0], [9, 40, 70, 3], 4, 2, head_dim, torch.float32, device,
                               requires_grad=True)
    check_varlen(q, k, v, cu_q, cu_k, torch.float32, **varlen_options("all", 4, 4, device))


def test_varlen_many_sequences(device):
    """64 sequences of 0 to 40 tokens: more sequences than tiles of any one."""
    generator = torch.Generator().manual_seed(3)
    lengths_q = torch.randint(0, 41, (64,), generator=generator).tolist()
    lengths_k = [n + int(extra) for n, extra in zip(lengths_q, torch.randint(0, 9, (64,), generator=generator))]
    q, k, v, cu_q, cu_k = pack(lengths_q, lengths_k, 4, 2, 16, torch.float32, device, requires_grad=True)
    check_varlen(q, k, v, cu_q, cu_k, torch.float32, **varlen_options("all", 64, 4, device))


def test_varlen_strided_rows_and_offsets(device):
    """q, k, v every other row of larger tensors, cu_seqlens every other entry
    of a longer int32 tensor: read through their strides."""
    lengths_q, lengths_k = [6, 1, 25], [10, 30, 25]
    q, k, v, cu_q, cu_k = pack(lengths_q, lengths_k, 4, 2, 16, torch.float32, device)
    q2, k2, v2 = (torch.randn(2 * t.shape[0], *t.shape[1:], device=device) for t in (q, k, v))
    q2[::2], k2[::2], v2[::2] = q, k, v
    q_rows, k_rows, v_rows = (t[::2] for t in (q2, k2, v2))
    spread = lambda cu: torch.stack((cu, torch.full_like(cu, -7)), dim=1).flatten()[::2]  # noqa: E731
    cu_q_view, cu_k_view = spread(cu_q), spread(cu_k)
    assert cu_q_view.stride() == (2,) and q_rows.stride(0) != q_rows.shape[1] * q_rows.shape[2]
    options = dict(causal=True, window=(8, 0), alibi_slopes=alibi_slopes(4, device=device))
    got = fusedllm.attention_varlen(q_rows, k_rows, v_rows, cu_q_view, cu_k_view, **options)
    expected = fusedllm.attention_varlen(q, k, v, cu_q, cu_k, **options)
    torch.testing.assert_close(got, expected)
    ref, _ = ref_attention_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, **options)
    assert_close(got, ref, FORWARD_TOL[torch.float32])


def test_varlen_dropout_with_all_options_gradcheck(device):
    """Dropout with softcap, sinks, ALiBi and a window: backward follows the
    pattern the seeded forward drew, the sinks' gradient included."""
    q, k, v, cu_q, cu_k = pack([3, 4], [5, 4], 2, 1, 4, torch.float64, device, requires_grad=True)
    sinks = torch.randn(2, dtype=torch.float64, device=device, requires_grad=True)
    slopes = torch.tensor([[0.5, 0.25], [0.1, 0.7]], dtype=torch.float64, device=device)

    def seeded(q_, k_, v_, s_):
        torch.manual_seed(11)
        return fusedllm.attention_varlen(q_, k_, v_, cu_q, cu_k, causal=True, window=(2, 0), softcap=1.3,
                                         sinks=s_, alibi_slopes=slopes, dropout_p=0.4)

    assert torch.autograd.gradcheck(seeded, (q, k, v, sinks), fast_mode=emulated())


def test_varlen_max_seqlen_given(device):
    """Explicit max_seqlen_* (exact or larger) give what the defaults give."""
    q, k, v, cu_q, cu_k = pack([3, 40, 1], [50, 40, 7], 4, 2, 16, torch.float32, device)
    options = dict(causal=True, window=(10, 0), softcap=3.0)
    default = fusedllm.attention_varlen(q, k, v, cu_q, cu_k, **options)
    exact = fusedllm.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=40, max_seqlen_k=50, **options)
    larger = fusedllm.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=64, max_seqlen_k=99, **options)
    torch.testing.assert_close(exact, default, atol=0, rtol=0)
    torch.testing.assert_close(larger, default, atol=0, rtol=0)
    ref, _ = ref_attention_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, **options)
    assert_close(default, ref, FORWARD_TOL[torch.float32])


def test_varlen_strided_inputs(device):
    """q, k and v as views of one packed projection [total, Hq + 2 Hkv, D], with
    a non-contiguous incoming gradient."""
    lengths = [4, 19, 1, 30]
    hq, hkv, d = 4, 2, 16
    qkv = torch.randn(sum(lengths), hq + 2 * hkv, d, device=device, requires_grad=True)
    q, k, v = qkv.split([hq, hkv, hkv], dim=1)
    _, _, _, cu, _ = pack(lengths, lengths, hq, hkv, d, torch.float32, device)
    out = fusedllm.attention_varlen(q, k, v, cu, cu, causal=True, alibi_slopes=alibi_slopes(hq, device=device))
    grad_out = torch.randn(d, sum(lengths), hq, device=device).permute(1, 2, 0)
    (grad,) = torch.autograd.grad(out, qkv, grad_out)
    qd = qkv.detach().double().requires_grad_()
    ref, _ = ref_attention_varlen(*qd.split([hq, hkv, hkv], dim=1), cu, cu, causal=True,
                                  alibi_slopes=alibi_slopes(hq, device=device))
    (ref_grad,) = torch.autograd.grad(ref, qd, grad_out.double())
    assert_close(out, ref.detach(), FORWARD_TOL[torch.float32], "out")
    assert_close(grad, ref_grad, GRAD_TOL[torch.float32], "grad")


@pytest.mark.parametrize("with_sinks", [False, True], ids=["no_sinks", "sinks"])
def test_varlen_lse_matches_reference(device, with_sinks):
    """The op's log-sum-exp: [Hq, total_q]; -inf for queries that see no key
    (their sink's value with sinks)."""
    lengths_q, lengths_k = [3, 17, 0, 6], [5, 17, 4, 2]
    q, k, v, cu_q, cu_k = pack(lengths_q, lengths_k, 4, 2, 16, torch.float32, device)
    slopes = alibi_slopes(4, device=device)
    sinks = make_sinks(4, device).detach() if with_sinks else None
    left, right = _op_window((6, 1))
    out, lse = ops.attention(q, k, v, None, 0.3, True, left, 0.0, None, right, 2.5, sinks, slopes, cu_q, cu_k,
                             17, 17)
    ref_out, ref_lse = ref_attention_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, causal=True,
                                            scale=0.3, window=(6, 1), softcap=2.5, alibi_slopes=slopes,
                                            sinks=sinks)
    assert lse.shape == (4, sum(lengths_q)) and lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert_close(out, ref_out, FORWARD_TOL[torch.float32], "out")
    assert_close(lse, ref_lse, FORWARD_TOL[torch.float32], "lse")


def test_varlen_dropout(device):
    """varlen's dropout pattern is its own, but it repeats under manual_seed,
    changes with the seed, keeps the mean (v = 1) and p = 0 is no dropout."""
    q, k, v, cu_q, cu_k = pack([40, 1, 70], [40, 90, 80], 8, 2, 16, torch.float32, device)
    ones = torch.ones_like(v)
    torch.manual_seed(3)
    a = fusedllm.attention_varlen(q, k, ones, cu_q, cu_k, dropout_p=0.25)
    torch.manual_seed(3)
    b = fusedllm.attention_varlen(q, k, ones, cu_q, cu_k, dropout_p=0.25)
    c = fusedllm.attention_varlen(q, k, ones, cu_q, cu_k, dropout_p=0.25)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert abs(a.mean().item() - 1.0) < 0.03
    torch.testing.assert_close(fusedllm.attention_varlen(q, k, v, cu_q, cu_k, dropout_p=0.0),
                               fusedllm.attention_varlen(q, k, v, cu_q, cu_k))


def test_varlen_dropout_gradients_follow_the_forward_pattern(device):
    """Under one seed, backward regenerates the pattern forward drew: the
    gradients match float64 finite differences of the same seeded call."""
    q, k, v, cu_q, cu_k = pack([3, 4], [5, 4], 2, 1, 4, torch.float64, device, requires_grad=True)

    def seeded(*t):
        torch.manual_seed(11)
        return fusedllm.attention_varlen(*t, cu_q, cu_k, causal=True, dropout_p=0.4)

    assert torch.autograd.gradcheck(seeded, (q, k, v))


@pytest.mark.parametrize("case", ["causal", "all"])
def test_varlen_backward_is_deterministic(device, case):
    lengths_q, lengths_k = [1, 200, 17, 90], [300, 200, 40, 90]
    q, k, v, cu_q, cu_k = pack(lengths_q, lengths_k, 8, 2, 32, torch.float32, device)
    options = varlen_options(case, 4, 8, device)
    sinks = options.pop("sinks", None)
    grad_out = torch.randn_like(q)

    def run():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        extra = {}
        if sinks is not None:
            extra["sinks"] = sinks.detach().clone().requires_grad_()
            leaves.append(extra["sinks"])
        out = fusedllm.attention_varlen(*leaves[:3], cu_q, cu_k, **options, **extra)
        out.backward(grad_out)
        return [out.detach()] + [t.grad for t in leaves]

    results = results_across_thread_counts(device, run)
    for res in results[1:]:
        for got, first in zip(res, results[0]):
            assert torch.equal(got, first)


# --- gradcheck, opcheck, torch.compile -----------------------------------------------------


# --- the reference itself ---------------------------------------------------------------


def _row_by_row(q, k, v, causal, scale, window, softcap, sinks, slopes):
    """One query row at a time with Python floats: the reference's formula
    restated without tensors, for a tiny float64 case."""
    import math

    b_, hq, sq, d = q.shape
    sk, group = k.shape[2], hq // k.shape[1]
    left, right = window_bounds(window)
    out = torch.zeros(b_, hq, sq, d, dtype=torch.float64)
    for b in range(b_):
        for h in range(hq):
            for i in range(sq):
                p = i + sk - sq
                logits = {}
                for j in range(sk):
                    if (causal and j > p) or (left >= 0 and j < p - left) or (right >= 0 and j > p + right):
                        continue
                    s = scale * sum(float(q[b, h, i, c]) * float(k[b, h // group, j, c]) for c in range(d))
                    if softcap is not None:
                        s = softcap * math.tanh(s / softcap)
                    if slopes is not None:
                        s -= float(slopes[b, h] if slopes.dim() == 2 else slopes[h]) * abs(p - j)
                    logits[j] = s
                terms = list(logits.values()) + ([float(sinks[h])] if sinks is not None else [])
                if not terms:
                    continue
                top = max(terms)
                denominator = sum(math.exp(t - top) for t in terms)
                for j, s in logits.items():
                    out[b, h, i] += math.exp(s - top) / denominator * v[b, h // group, j].double()
    return out


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (1, 2)), (True, (2, -1)),
                                           (False, 3), (False, (0, 0))])
def test_reference_matches_a_row_by_row_restatement(causal, window):
    q, k, v = make_qkv(2, 4, 2, 5, 7, 3, torch.float64, "cpu")
    sinks = torch.randn(4, dtype=torch.float64)
    for softcap, with_sinks, slopes in [(None, False, None), (0.7, False, None), (None, True, None),
                                        (None, False, alibi_slopes(4, dtype=torch.float64)),
                                        (1.3, True, alibi_slopes(4, 2, dtype=torch.float64))]:
        options = dict(causal=causal, scale=0.8, window=window, softcap=softcap,
                       sinks=sinks if with_sinks else None, alibi_slopes=slopes)
        ref, _ = ref_attention(q, k, v, **options)
        expected = _row_by_row(q, k, v, causal, 0.8, window, softcap, options["sinks"], slopes)
        torch.testing.assert_close(ref, expected)


def test_reference_sink_is_a_zero_value_key_with_that_logit():
    """The reference's sinks equal one more key, of value zero, whose score is
    the sink (an additive mask on a zero key)."""
    q, k, v = make_qkv(2, 4, 2, 6, 9, 8, torch.float64, "cpu")
    sinks = torch.randn(4, dtype=torch.float64)
    with_sinks, _ = ref_attention(q, k, v, sinks=sinks)
    k1 = torch.cat((k, torch.zeros(2, 2, 1, 8, dtype=torch.float64)), dim=2)
    v1 = torch.cat((v, torch.zeros(2, 2, 1, 8, dtype=torch.float64)), dim=2)
    bias = torch.zeros(1, 4, 6, 10, dtype=torch.float64)
    bias[..., -1] = sinks.view(4, 1)
    as_key, _ = ref_attention(q, k1, v1, mask=bias)
    torch.testing.assert_close(with_sinks, as_key)


# --- bad input ------------------------------------------------------------------------


def _t(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


def _dense(**options):
    return lambda: fusedllm.attention(_t(2, 4, 5, 8), _t(2, 2, 5, 8), _t(2, 2, 5, 8), **options)


def _cu(*values, dtype=torch.int32, device="cpu"):
    return torch.tensor(values, dtype=dtype, device=device)


def _varlen(q=None, k=None, cu_q=None, cu_k=None, **options):
    """Three sequences of 2, 3 and 4 tokens (keys 4, 3, 2), with a field replaced."""
    q = _t(9, 4, 8) if q is None else q
    k = _t(9, 2, 8) if k is None else k
    cu_q = _cu(0, 2, 5, 9) if cu_q is None else cu_q
    cu_k = _cu(0, 4, 7, 9) if cu_k is None else cu_k
    return lambda: fusedllm.attention_varlen(q, k, k.clone(), cu_q, cu_k, **options)


# (argument the message names, call, the message after the op's name)
BAD_CALLS = [
    ("softcap", _dense(softcap=0.0),
     "softcap must be None or a positive number, got 0.0"),
    ("softcap", _dense(softcap=-1.0),
     "softcap must be None or a positive number, got -1.0"),
    ("softcap", _dense(softcap=float("nan")),
     "softcap must be None or a positive number, got nan"),
    ("softcap", _dense(softcap="2"),
     "softcap must be None or a positive number, got '2'"),
    ("sinks", _dense(sinks=_t(5)),
     "sinks must be 1-D [q_heads] = [4], got shape [5]"),
    ("sinks", _dense(sinks=_t(1, 4)),
     "sinks must be 1-D [q_heads] = [4], got shape [1, 4]"),
    ("sinks", _dense(sinks=_t(4, device="meta")),
     "sinks is on meta but q is on cpu"),
    ("sinks", _dense(sinks=torch.ones(4, dtype=torch.int64)),
     "sinks must be float32, float64, bfloat16 or float16, got torch.int64"),
    ("alibi_slopes", _dense(alibi_slopes=_t(3)),
     "alibi_slopes must be [q_heads] = [4] or [batch, q_heads] = [2, 4], got shape [3]"),
    ("alibi_slopes", _dense(alibi_slopes=_t(3, 4)),
     "alibi_slopes must be [q_heads] = [4] or [batch, q_heads] = [2, 4], got shape [3, 4]"),
    ("alibi_slopes", _dense(alibi_slopes=_t(2, 4, 1)),
     "alibi_slopes must be [q_heads] = [4] or [batch, q_heads] = [2, 4], got shape [2, 4, 1]"),
    ("alibi_slopes", _dense(alibi_slopes=_t(4, dtype=torch.bfloat16)),
     "alibi_slopes must be float32 or float64, got torch.bfloat16"),
    ("alibi_slopes", _dense(alibi_slopes=_t(4, dtype=torch.float16)),
     "alibi_slopes must be float32 or float64, got torch.float16"),
    ("alibi_slopes", _dense(alibi_slopes=torch.ones(4, dtype=torch.int32)),
     "alibi_slopes must be float32 or float64, got torch.int32"),
    ("alibi_slopes", _dense(alibi_slopes=_t(4, device="meta")),
     "alibi_slopes is on meta but q is on cpu"),
    ("window", _dense(window=(3,)),
     "window as a tuple must be (left, right), each -1 (unbounded) or an int >= 0, got (3,)"),
    ("window", _dense(window=(1, 2, 3)),
     "window as a tuple must be (left, right), each -1 (unbounded) or an int >= 0, got (1, 2, 3)"),
    ("window", _dense(window=(-2, 0)),
     "window as a tuple must be (left, right), each -1 (unbounded) or an int >= 0, got (-2, 0)"),
    ("window", _dense(window=(0, -5)),
     "window as a tuple must be (left, right), each -1 (unbounded) or an int >= 0, got (0, -5)"),
    ("window", _dense(window=(1.5, 2)),
     "window as a tuple must be (left, right), each -1 (unbounded) or an int >= 0, got (1.5, 2)"),
    ("window", _dense(window=(True, 2)),
     "window as a tuple must be (left, right), each -1 (unbounded) or an int >= 0, got (True, 2)"),
    ("window", _dense(window=-1),
     "window must be None, an int >= 1 (the number of keys a query sees, itself included) or a (left, right) "
     "tuple, got -1"),
    ("window", _dense(window="3"),
     "window must be None, an int >= 1 (the number of keys a query sees, itself included) or a (left, right) "
     "tuple, got '3'"),
    ("cu_seqlens_q", _varlen(cu_q=_cu(0, 2, 5, 9, dtype=torch.int64)),
     "cu_seqlens_q must be int32, got torch.int64"),
    ("cu_seqlens_k", _varlen(cu_k=_cu(0, 4, 7, 9, dtype=torch.int64)),
     "cu_seqlens_k must be int32, got torch.int64"),
    ("cu_seqlens_q", _varlen(cu_q=_cu(1, 2, 5, 9)),
     "cu_seqlens_q must start at 0, got 1"),
    ("cu_seqlens_k", _varlen(cu_k=_cu(2, 4, 7, 9)),
     "cu_seqlens_k must start at 0, got 2"),
    ("cu_seqlens_q", _varlen(cu_q=_cu(0, 5, 2, 9)),
     "cu_seqlens_q must be non-decreasing, got 5 then 2 at index 2"),
    ("cu_seqlens_k", _varlen(cu_k=_cu(0, 4, 3, 9)),
     "cu_seqlens_k must be non-decreasing, got 4 then 3 at index 2"),
    ("cu_seqlens_q", _varlen(cu_q=_cu(0, 2, 5, 8)),
     "cu_seqlens_q must end at total_q = 9, got 8"),
    ("cu_seqlens_k", _varlen(cu_k=_cu(0, 4, 7, 10)),
     "cu_seqlens_k must end at total_k = 9, got 10"),
    ("cu_seqlens_q", _varlen(cu_q=_cu(0, 2, 5, 9, device="meta")),
     "cu_seqlens_q is on meta but q is on cpu"),
    ("cu_seqlens_k", _varlen(cu_k=_cu(0, 4, 7, 9, device="meta")),
     "cu_seqlens_k is on meta but q is on cpu"),
    ("cu_seqlens_q", _varlen(cu_q=_cu(0, 2, 5, 9).view(1, 4)),
     "cu_seqlens_q must be 1-D [num_seqs + 1], got shape [1, 4]"),
    ("cu_seqlens", _varlen(cu_q=_cu(0, 5, 9)),  # two sequences of queries, three of keys
     "cu_seqlens_q and cu_seqlens_k must have the same length (num_seqs + 1), got 3 and 4"),
    ("max_seqlen_q", _varlen(max_seqlen_q=3),
     "max_seqlen_q is 3 but cu_seqlens_q has a sequence of length 4"),
    ("max_seqlen_k", _varlen(max_seqlen_k=3),
     "max_seqlen_k is 3 but cu_seqlens_k has a sequence of length 4"),
    ("max_seqlen_q", _varlen(max_seqlen_q=-1),
     "max_seqlen_q must be None or an int >= 1, got -1"),
    (r"\bq\b", _varlen(q=_t(1, 9, 4, 8)),
     "with cu_seqlens, q must be 3-D [total_q, q_heads, head_dim], got shape [1, 9, 4, 8]"),
    (r"\bk\b", _varlen(k=_t(1, 9, 2, 8)),
     "with cu_seqlens, k must be 3-D [total_k, kv_heads, head_dim], got shape [1, 9, 2, 8]"),
    ("alibi_slopes", _varlen(alibi_slopes=_t(2, 4)),  # [num_seqs, Hq] with two rows for three sequences
     "alibi_slopes must be [q_heads] = [4] or [num_seqs, q_heads] = [3, 4], got shape [2, 4]"),
    ("sinks", _varlen(sinks=_t(2)),
     "sinks must be 1-D [q_heads] = [4], got shape [2]"),
    ("softcap", _varlen(softcap=0.0),
     "softcap must be None or a positive number, got 0.0"),
    ("window", _varlen(window=(1, -3)),
     "window as a tuple must be (left, right), each -1 (unbounded) or an int >= 0, got (1, -3)"),
    ("dropout_p", _varlen(dropout_p=1.0),
     "dropout_p must be in [0, 1), got 1.0"),
]


@pytest.mark.parametrize("argument,call,message", BAD_CALLS,
                         ids=[f"{i}-{a}" for i, (a, _, _) in enumerate(BAD_CALLS)])
def test_bad_input_is_a_value_error_naming_the_argument(argument, call, message):
    with pytest.raises(ValueError, match=r"^fusedllm\.attention(_varlen)?: " + re.escape(message) + "$"):
        call()
    assert re.search(argument, message)


def test_attention_rejects_varlen_shapes_and_varlen_rejects_dense_ones():
    """3-D packed tensors belong to attention_varlen, 4-D ones to attention."""
    with pytest.raises(ValueError, match="q must be 4-D"):
        fusedllm.attention(_t(9, 4, 8), _t(9, 2, 8), _t(9, 2, 8))
    with pytest.raises(ValueError, match=r"with cu_seqlens, q must be 3-D \[total_q, q_heads, head_dim\], "
                                         r"got shape \[2, 4, 5, 8\]$"):
        fusedllm.attention_varlen(_t(2, 4, 5, 8), _t(2, 2, 5, 8), _t(2, 2, 5, 8), _cu(0, 5, 10), _cu(0, 5, 10))


def _op_args(q, k, v, **changes):
    base = dict(mask=None, scale=1.0, causal=False, window=-1, dropout_p=0.0, seed=None, window_right=-1,
                softcap=0.0, sinks=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None,
                max_seqlen_q=0, max_seqlen_k=0)
    return (q, k, v, *dict(base, **changes).values())


OP_BAD_CALLS = [
    pytest.param(ValueError, r"cu_seqlens_q and cu_seqlens_k go together",
                 _op_args(_t(9, 4, 8), _t(9, 2, 8), _t(9, 2, 8), cu_seqlens_q=_cu(0, 9), max_seqlen_q=9,
                          max_seqlen_k=9),
                 id="cu_seqlens_q_without_k"),
    pytest.param(ValueError, r"with cu_seqlens, q must be 3-D \[total_q, q_heads, head_dim\], "
                             r"got shape \[1, 4, 9, 8\]",
                 _op_args(_t(1, 4, 9, 8), _t(1, 2, 9, 8), _t(1, 2, 9, 8), cu_seqlens_q=_cu(0, 9),
                          cu_seqlens_k=_cu(0, 9), max_seqlen_q=9, max_seqlen_k=9),
                 id="cu_seqlens_with_4d_q"),
    pytest.param(ValueError, r"mask is not supported with packed sequences",
                 _op_args(_t(9, 4, 8), _t(9, 2, 8), _t(9, 2, 8), mask=_t(9, 9), cu_seqlens_q=_cu(0, 9),
                          cu_seqlens_k=_cu(0, 9), max_seqlen_q=9, max_seqlen_k=9),
                 id="mask_with_cu_seqlens"),
    pytest.param(ValueError, r"window_right must be -1 \(no bound\) or a number of keys >= 0, got -3",
                 _op_args(_t(1, 4, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8), window_right=-3),
                 id="window_right_negative"),
    pytest.param(ValueError, r"sinks must be 1-D \[q_heads\] = \[4\], got shape \[3\]",
                 _op_args(_t(1, 4, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8), sinks=_t(3)),
                 id="sinks_shape"),
    pytest.param(ValueError, r"alibi_slopes must be \[q_heads\] = \[4\] or \[batch, q_heads\] = \[1, 4\], "
                             r"got shape \[2, 4\]",
                 _op_args(_t(1, 4, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8), alibi_slopes=_t(2, 4)),
                 id="alibi_slopes_shape"),
    pytest.param(ValueError, r"alibi_slopes must be float32 or float64, got torch\.bfloat16",
                 _op_args(_t(1, 4, 5, 8), _t(1, 2, 5, 8), _t(1, 2, 5, 8), alibi_slopes=_t(4).bfloat16()),
                 id="alibi_slopes_dtype"),
    pytest.param(ValueError, r"cu_seqlens_q must be int32, got torch\.int64",
                 _op_args(_t(9, 4, 8), _t(9, 2, 8), _t(9, 2, 8), cu_seqlens_q=_cu(0, 9, dtype=torch.int64),
                          cu_seqlens_k=_cu(0, 9), max_seqlen_q=9, max_seqlen_k=9),
                 id="cu_seqlens_q_dtype"),
    pytest.param(ValueError, r"cu_seqlens_q and cu_seqlens_k must have the same length \(num_seqs \+ 1\), "
                             r"got 2 and 3",
                 _op_args(_t(9, 4, 8), _t(9, 2, 8), _t(9, 2, 8), cu_seqlens_q=_cu(0, 9), cu_seqlens_k=_cu(0, 4, 9),
                          max_seqlen_q=9, max_seqlen_k=9),
                 id="cu_seqlens_lengths_differ"),
]


@pytest.mark.parametrize("error,message,args", OP_BAD_CALLS)
def test_operator_rejects_bad_option_input_without_crashing(error, message, args):
    # Direct torch.ops callers skip the Python checks; the C++ ones still apply.
    with pytest.raises(error, match=message):
        ops.attention(*args)
