"""rms_norm and fused_add_rms_norm: values and gradients against tests/reference.py."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fusedllm
from checks import FORWARD_TOL, GRAD_TOL, assert_close, results_across_thread_counts
from conftest import cpu_variants
from reference import fused_add_rms_norm as ref_fused_add
from reference import rms_norm as ref_rms_norm

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
HIDDEN = [1, 7, 127, 4096, 4097]
ROWS = [0, 1, 37]
# (casting, offset, with_weight): without a weight the casting makes no difference.
VARIANTS = [("llama", 0.0, True), ("gemma", 0.0, True), ("llama", 1.0, True),
            ("gemma", 1.0, True), ("llama", 0.0, False)]


def reference_grads(x, weight, grad_out, eps, offset, residual=None):
    """Exact gradients in float64 (no intermediate rounding) of sum(grad_out * y)."""
    xd = x.detach().double().requires_grad_()
    wd = None if weight is None else weight.detach().double().requires_grad_()
    rd = None if residual is None else residual.detach().double().requires_grad_()
    h = xd if rd is None else xd + rd
    y = ref_rms_norm(h, wd, eps, offset, "gemma")
    inputs = [t for t in (xd, wd, rd) if t is not None]
    grads = torch.autograd.grad(y, inputs, grad_out.double(), allow_unused=True)
    it = iter(grads)
    gx = next(it)
    gw = next(it) if wd is not None else None
    gr = next(it) if rd is not None else None
    return gx, gw, gr


def make_inputs(rows, hidden, dtype, device, with_weight, offset):
    x = torch.randn(rows, hidden, dtype=dtype, device=device)
    w = None
    if with_weight:
        # Around 1 - offset so offset + w stays near 1, as in trained models.
        w = (1.0 - offset + 0.3 * torch.randn(hidden)).to(dtype=dtype, device=device)
    return x, w


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("casting,offset,with_weight", VARIANTS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("rows", cpu_variants(ROWS, 37))
def test_rms_norm_matches_reference(device, dtype, casting, offset, with_weight, hidden, rows):
    x, w = make_inputs(rows, hidden, dtype, device, with_weight, offset)
    x_before = x.clone()
    x.requires_grad_()
    if w is not None:
        w.requires_grad_()
    y = fusedllm.rms_norm(x, w, eps=1e-5, offset=offset, casting=casting)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, ref_rms_norm(x.detach(), None if w is None else w.detach(), 1e-5, offset, casting),
                 FORWARD_TOL[dtype])

    g = torch.randn_like(y)
    y.backward(g)
    gx, gw, _ = reference_grads(x, w, g, 1e-5, offset)
    assert_close(x.grad, gx, GRAD_TOL[dtype])
    if w is not None:
        assert_close(w.grad, gw, GRAD_TOL[dtype])
    assert torch.equal(x.detach(), x_before), "input was modified"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("casting,offset,with_weight", VARIANTS)
@pytest.mark.parametrize("hidden", cpu_variants([1, 127, 4097], 127, 4097))
def test_fused_add_rms_norm_matches_reference(device, dtype, casting, offset, with_weight, hidden):
    x, w = make_inputs(19, hidden, dtype, device, with_weight, offset)
    r = torch.randn_like(x)
    x.requires_grad_()
    r.requires_grad_()
    if w is not None:
        w.requires_grad_()
    y, h = fusedllm.fused_add_rms_norm(x, r, w, eps=1e-6, offset=offset, casting=casting)
    ref_y, ref_h = ref_fused_add(x.detach(), r.detach(), None if w is None else w.detach(), 1e-6,
                                 offset, casting)
    torch.testing.assert_close(h, ref_h, atol=0, rtol=0)  # one rounding of x + r: exact
    assert_close(y, ref_y, FORWARD_TOL[dtype])

    gy, gh = torch.randn_like(y), torch.randn_like(h)
    torch.autograd.backward([y, h], [gy, gh])
    gx, gw, _ = reference_grads(h, w, gy, 1e-6, offset)
    assert_close(x.grad, gx + gh.double(), GRAD_TOL[dtype])
    assert_close(r.grad, gx + gh.double(), GRAD_TOL[dtype])
    if w is not None:
        assert_close(w.grad, gw, GRAD_TOL[dtype])


@pytest.mark.cpu_variants
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["transposed", "every_other_column", "row_slice", "expanded"])
def test_strided_inputs(device, dtype, layout):
    base = torch.randn(24, 64, 80, dtype=dtype, device=device)
    if layout == "transposed":
        x = base.transpose(0, 1)  # rows not contiguous with each other
    elif layout == "every_other_column":
        x = base[..., ::2]  # last-dim stride 2
    elif layout == "row_slice":
        x = base[:, :, :48]  # unit stride, row stride 80: used without a copy
    else:
        x = base[:1, :1].expand(5, 3, 80)  # stride-0 rows
    w_base = torch.randn(2 * x.shape[-1], dtype=dtype, device=device)
    w = w_base[::2]  # non-contiguous weight
    x = x.requires_grad_() if x.is_leaf else x.detach().requires_grad_()
    y = fusedllm.rms_norm(x, w)
    assert_close(y, ref_rms_norm(x.detach(), w, 1e-6), FORWARD_TOL[dtype])
    g = torch.randn(y.shape[::-1], dtype=dtype, device=device).permute(*reversed(range(y.dim())))
    y.backward(g)  # non-contiguous incoming gradient
    gx, _, _ = reference_grads(x, w, g, 1e-6, 0.0)
    assert_close(x.grad, gx, GRAD_TOL[dtype])


@pytest.mark.cpu_variants
def test_leading_shapes_and_zero_size(device):
    for shape in [(64,), (2, 3, 4, 64), (0, 64), (3, 0, 64)]:
        x = torch.randn(shape, device=device)
        w = torch.randn(64, device=device)
        y = fusedllm.rms_norm(x, w)
        assert y.shape == x.shape
        assert_close(y, ref_rms_norm(x, w), FORWARD_TOL[torch.float32])
    x = torch.randn(0, 5, device=device, requires_grad=True)
    w = torch.randn(5, device=device, requires_grad=True)
    fusedllm.rms_norm(x, w).sum().backward()
    assert x.grad.shape == (0, 5) and torch.equal(w.grad, torch.zeros(5, device=device))
    # hidden size 0: empty output of the same shape
    assert fusedllm.rms_norm(torch.randn(3, 0, device=device)).shape == (3, 0)


def test_weight_grad_is_deterministic(device):
    """Same bits run to run; on CPU also for any thread count."""
    x = torch.randn(4099, 515, device=device)
    w = torch.randn(515, device=device)
    g = torch.randn(4099, 515, device=device)

    def run():
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        fusedllm.rms_norm(xr, wr).backward(g)
        return xr.grad, wr.grad

    results = results_across_thread_counts(device, run)
    for gx, gw in results[1:]:
        assert torch.equal(gw, results[0][1])
        assert torch.equal(gx, results[0][0])


@settings(max_examples=60, deadline=None)
@given(
    lead=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    hidden=st.integers(1, 300),
    dtype=st.sampled_from(DTYPES),
    variant=st.sampled_from(VARIANTS),
    eps=st.sampled_from([0.0, 1e-6, 1e-2]),
)
def test_hypothesis_shapes(lead, hidden, dtype, variant, eps):
    casting, offset, with_weight = variant
    x = torch.randn(*lead, hidden, dtype=dtype) + 0.1  # avoid all-zero rows with eps = 0
    w = (1.0 - offset + torch.randn(hidden)).to(dtype) if with_weight else None
    y = fusedllm.rms_norm(x, w, eps, offset, casting)
    assert_close(y, ref_rms_norm(x, w, eps, offset, casting), FORWARD_TOL[dtype])
    r = torch.randn_like(x)
    y2, h2 = fusedllm.fused_add_rms_norm(x, r, w, eps, offset, casting)
    ref_y2, ref_h2 = ref_fused_add(x, r, w, eps, offset, casting)
    assert torch.equal(h2, ref_h2)
    assert_close(y2, ref_y2, FORWARD_TOL[dtype])


def test_large_outputs():
    # Outputs of 16-32 MiB, as in a model: many kernel chunks per thread.
    x = torch.randn(1024, 4100)
    w = torch.randn(4100)
    r = torch.randn_like(x)
    y, h = fusedllm.fused_add_rms_norm(x, r, w)
    ref_y, ref_h = ref_fused_add(x, r, w)
    assert torch.equal(h, ref_h)
    assert_close(y, ref_y, FORWARD_TOL[torch.float32])
    gate_up = torch.randn(1024, 2 * 4100)
    from reference import swiglu as ref_swiglu
    assert_close(fusedllm.swiglu(gate_up), ref_swiglu(gate_up), FORWARD_TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hidden", [64, 4096, 16384, 40000])
def test_row_widths_of_the_cuda_kernels(device, dtype, hidden):
    """On CUDA, rows of 1, 2 and (forward only) 4 16-byte packs a thread
    (hidden 64, 4096 and 16384 take the register-row kernels in one dtype or
    the other), and past them the two-pass kernels (40000, and the 16384-wide
    backward); more rows than blocks, so that blocks carry weight-gradient sums
    over several rows; the fused add's gradients."""
    rows = 300 if hidden <= 4096 else 40
    x, w = make_inputs(rows, hidden, dtype, device, True, 0.0)
    r = torch.randn_like(x)
    x.requires_grad_()
    r.requires_grad_()
    w.requires_grad_()
    y, h = fusedllm.fused_add_rms_norm(x, r, w, eps=1e-6)
    ref_y, ref_h = ref_fused_add(x.detach(), r.detach(), w.detach(), 1e-6)
    assert torch.equal(h, ref_h)
    assert_close(y, ref_y, FORWARD_TOL[dtype])
    g = torch.randn_like(y)
    y.backward(g)
    gx, gw, gr = reference_grads(x, w, g, 1e-6, 0.0, residual=r)
    assert_close(x.grad, gx, GRAD_TOL[dtype])
    assert_close(r.grad, gr, GRAD_TOL[dtype])
    assert_close(w.grad, gw, GRAD_TOL[dtype])
