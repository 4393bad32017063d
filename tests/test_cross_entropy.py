"""linear_cross_entropy: the LM head and the loss without the [tokens, vocab] logits."""

import pytest
import torch
import torch.nn.functional as F

import fusedllm
from checks import FORWARD_TOL, GRAD_TOL, assert_close, results_across_thread_counts
from conftest import cpu_variants
from reference import linear_cross_entropy as ref_lce
from testkit.memory import peak_memory_bytes

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
REDUCTIONS = ["mean", "sum", "none"]
ops = torch.ops.fusedllm


def make_inputs(tokens, hidden, vocab, dtype, device, bias=True, ignored=0.25, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g)
    # logits of a few units, as a trained head gives
    w = torch.randn(vocab, hidden, generator=g) * (2.0 / hidden ** 0.5)
    b = torch.randn(vocab, generator=g) if bias else None
    t = torch.randint(0, vocab, (tokens,), generator=g)
    t[torch.rand(tokens, generator=g) < ignored] = -100
    cast = lambda x: None if x is None else x.to(dtype=dtype, device=device)  # noqa: E731
    return cast(h), cast(w), cast(b), t.to(device)


def loss_and_grads(fn, h, w, b, t, grad_out=None, **kw):
    """fn's loss and the gradients of sum(grad_out * loss) for h, w (and b)."""
    leaves = [x.detach().clone().requires_grad_() for x in (h, w, b) if x is not None]
    loss = fn(leaves[0], leaves[1], t, bias=leaves[2] if b is not None else None, **kw)
    if grad_out is None:
        grad_out = torch.ones_like(loss)
    loss.backward(grad_out)
    return loss.detach(), [x.grad for x in leaves]


def reference(h, w, b, t, grad_out=None, **kw):
    """The reference in float64 from the same (rounded) inputs."""
    up = lambda x: None if x is None else x.double()  # noqa: E731
    return loss_and_grads(ref_lce, up(h), up(w), up(b), t,
                          None if grad_out is None else grad_out.double(), **kw)


def check_against_reference(h, w, b, t, dtype, **kw):
    before = [x.clone() for x in (h, w, b, t) if x is not None]
    reduction = kw.get("reduction", "mean")
    grad_out = torch.randn(t.shape, dtype=dtype, device=t.device) if reduction == "none" else None
    loss, grads = loss_and_grads(fusedllm.linear_cross_entropy, h, w, b, t, grad_out, **kw)
    ref_loss, ref_grads = reference(h, w, b, t, grad_out, **kw)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert loss.shape == ref_loss.shape
    # half-precision inputs: the logits may be rounded to the inputs' dtype (on
    # CPU, as an eager linear layer rounds them)
    assert_close(loss, ref_loss, FORWARD_TOL[dtype], "loss", upcast=True)
    for name, g, r in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert g.dtype == dtype and g.shape == r.shape
        assert_close(g, r, GRAD_TOL[dtype], f"grad {name}", upcast=True)
    after = [x for x in (h, w, b, t) if x is not None]
    assert all(torch.equal(x, y) for x, y in zip(before, after)), "an input was modified"


@pytest.mark.parametrize("dtype", cpu_variants(DTYPES, torch.float32, torch.float64), ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", [(1, 8, 5), (37, 16, 1000), (70, 24, 67)], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("chunk", [None, 16], ids=["onechunk", "chunks16"])
def test_matches_cross_entropy(device, dtype, reduction, shape, bias, chunk, monkeypatch):
    if chunk is not None:
        monkeypatch.setenv("FUSEDLLM_CE_CHUNK_ROWS", str(chunk))
    h, w, b, t = make_inputs(*shape, dtype, device, bias=bias)
    check_against_reference(h, w, b, t, dtype, reduction=reduction)


@pytest.mark.cpu_variants
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", [(37, 16, 1000), (70, 24, 67)], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_half_weight_gradient_by_vocabulary_slabs(device, dtype, reduction, shape, bias, monkeypatch):
    """A half-precision weight over several token chunks gets its gradient a
    slab of the vocabulary at a time: slabs of 32 columns (the last one
    partial) with targets in every slab."""
    monkeypatch.setenv("FUSEDLLM_CE_CHUNK_ROWS", "16")
    monkeypatch.setenv("FUSEDLLM_CE_SLAB_COLUMNS", "32")
    h, w, b, t = make_inputs(*shape, dtype, device, bias=bias)
    check_against_reference(h, w, b, t, dtype, reduction=reduction)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("vocab", [96, 67], ids=["packs", "scalars"])
def test_half_weight_gradient_over_chunks_of_512_rows(device, dtype, vocab, monkeypatch):
    """Chunks of 512 rows or more: on CUDA a half-precision weight's gradient is
    summed over them in its own dtype (one rounding a chunk), on the CPU made by
    slabs; rows of 96 logits take the row kernel's 16-byte packs, rows of 67 its
    one-value loads."""
    monkeypatch.setenv("FUSEDLLM_CE_CHUNK_ROWS", "512")
    h, w, b, t = make_inputs(1100, 16, vocab, dtype, device)
    check_against_reference(h, w, b, t, dtype)


def test_logits_buffer_is_about_the_hidden_states_size():
    """A chunk's logits hold about as many values as the hidden states (rows =
    tokens / ceil(vocab / hidden), rounded up to a power of two): the pass's
    memory is its two gradients and that one buffer. Here 512 rows of 8192
    float32 logits, 16 MiB, as large as the hidden states (float32: torch's
    own multiply on every CPU, which takes no buffers of ours)."""
    tokens, hidden, vocab = 8192, 512, 8192
    h, w, _, t = make_inputs(tokens, hidden, vocab, torch.float32, "cpu", bias=False)

    def run():
        ops.linear_cross_entropy_pass(h, w, None, t, None, -100, 0.0, 0.0, 0.0, [True, True, False])

    gradients = (tokens + vocab) * hidden * 4
    buffer = 512 * vocab * 4
    assert peak_memory_bytes(run, "cpu") <= gradients + buffer + (1 << 20)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("chunk", [None, 512], ids=["onechunk", "chunks512"])
def test_half_products_past_a_thousand_in_every_dimension(dtype, chunk, monkeypatch):
    """Products of more than 1024 rows, columns and summed terms: float16 products,
    and bfloat16 ones on a CPU without AVX-512, are made from float32 blocks of 1024."""
    if chunk is not None:
        monkeypatch.setenv("FUSEDLLM_CE_CHUNK_ROWS", str(chunk))
        monkeypatch.setenv("FUSEDLLM_CE_SLAB_COLUMNS", "1100")
    h, w, b, t = make_inputs(1100, 1030, 2200, dtype, "cpu", bias=True)
    check_against_reference(h, w, b, t, dtype)


@pytest.mark.cpu_variants
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("options", [
    dict(label_smoothing=0.1),
    dict(softcap=3.0),
    dict(z_loss=1e-3),
    dict(label_smoothing=0.2, softcap=5.0, z_loss=1e-2, ignore_index=3),
    dict(label_smoothing=1.0),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_options_match_reference(device, dtype, reduction, options, monkeypatch):
    monkeypatch.setenv("FUSEDLLM_CE_CHUNK_ROWS", "8")
    monkeypatch.setenv("FUSEDLLM_CE_SLAB_COLUMNS", "64")  # bfloat16: the weight by slabs
    h, w, b, t = make_inputs(29, 12, 300, dtype, device)
    if "ignore_index" in options:
        t = torch.where(t == -100, torch.full_like(t, options["ignore_index"]), t)
    check_against_reference(h, w, b, t, dtype, reduction=reduction, **options)


def test_leading_shape_and_strided_inputs(device):
    h, w, b, t = make_inputs(24, 16, 50, torch.float32, device)
    h3 = h.reshape(4, 6, 16).transpose(0, 1)  # [6, 4, 16], not contiguous
    t3 = t.reshape(4, 6).t()
    w_strided = w.t().contiguous().t()  # [V, H] with unit stride along V
    for reduction in REDUCTIONS:
        loss = fusedllm.linear_cross_entropy(h3, w_strided, t3, bias=b, reduction=reduction)
        assert_close(loss, ref_lce(h3.double(), w.double(), t3, bias=b.double(), reduction=reduction),
                     FORWARD_TOL[torch.float32], upcast=True)
    assert fusedllm.linear_cross_entropy(h3, w, t3, reduction="none").shape == (6, 4)


def assert_gives_what_torch_gives(h, w, b, t, reduction):
    """Loss and gradients equal to F.cross_entropy(F.linear(...)), NaN where it gives NaN."""
    loss, grads = loss_and_grads(fusedllm.linear_cross_entropy, h, w, b, t, reduction=reduction)
    ref_loss, ref_grads = loss_and_grads(
        lambda h_, w_, t_, bias: F.cross_entropy(F.linear(h_, w_, bias), t_, reduction=reduction),
        h, w, b, t)
    torch.testing.assert_close(loss, ref_loss, equal_nan=True)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, equal_nan=True)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_every_target_ignored_gives_what_cross_entropy_gives(device, reduction):
    assert_gives_what_torch_gives(*make_inputs(9, 8, 20, torch.float32, device, ignored=1.0), reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_zero_tokens(device, reduction):
    assert_gives_what_torch_gives(*make_inputs(0, 8, 20, torch.float32, device), reduction)


def test_only_the_gradients_asked_for(device):
    h, w, b, t = make_inputs(10, 8, 30, torch.float32, device)
    for reduction in REDUCTIONS:
        hh = h.clone().requires_grad_()
        loss = fusedllm.linear_cross_entropy(hh, w, t, bias=b, reduction=reduction)
        loss.sum().backward()
        ref = torch.autograd.grad(ref_lce(hh.double(), w.double(), t, bias=b.double(),
                                          reduction=reduction).sum(), hh)[0]
        assert_close(hh.grad, ref, GRAD_TOL[torch.float32], upcast=False)
    with torch.no_grad():
        loss = fusedllm.linear_cross_entropy(h.requires_grad_(), w, t, bias=b)
    assert not loss.requires_grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_weight_gradient_takes_no_float32_sum(dtype, monkeypatch):
    """A bfloat16 / float16 weight's gradient is never summed in a float32
    buffer the weight's size: over several chunks the pass's peak stays within
    a quarter of such a buffer of the single-chunk pass's (which makes it in
    one multiply into its own dtype)."""
    tokens, hidden, vocab = 32, 256, 4096
    h, w, _, t = make_inputs(tokens, hidden, vocab, dtype, "cpu", bias=False)
    float32_sum = vocab * hidden * 4

    def run():
        ops.linear_cross_entropy_pass(h, w, None, t, None, -100, 0.0, 0.0, 0.0, [True, True, False])

    one = peak_memory_bytes(run, "cpu")
    monkeypatch.setenv("FUSEDLLM_CE_CHUNK_ROWS", "8")
    chunked = peak_memory_bytes(run, "cpu")
    assert chunked - one < float32_sum // 4, (one, float32_sum, chunked)
    check_against_reference(h, w, None, t, dtype)


@pytest.mark.slow
def test_more_logits_than_int32_can_index():
    """tokens x vocab past 2^31: the last tokens' losses and the gradient rows."""
    tokens, vocab = 66_000, 33_000
    assert tokens * vocab > 2**31
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, 2, generator=g)
    w = torch.randn(vocab, 2, generator=g)
    t = torch.randint(0, vocab, (tokens,), generator=g)
    loss = fusedllm.linear_cross_entropy(h, w, t, reduction="none")
    tail = slice(tokens - 50, tokens)
    ref = ref_lce(h[tail].double(), w.double(), t[tail], reduction="none")
    assert_close(loss[tail], ref, FORWARD_TOL[torch.float32], upcast=True)
    hh = h.clone().requires_grad_()
    fusedllm.linear_cross_entropy(hh, w, t, reduction="sum").backward()
    hd = h[tail].double().requires_grad_()
    ref_lce(hd, w.double(), t[tail], reduction="sum").backward()
    assert_close(hh.grad[tail], hd.grad, GRAD_TOL[torch.float32], upcast=True)


BAD = [
    (dict(target="float"), "target must hold int64 class indices"),
    (dict(target="short"), "target must have hidden's leading shape"),
    (dict(target="out_of_range"), r"target\[2\] = 50 is not a class index in \[0, 50\)"),
    (dict(target="negative"), r"target\[1\] = -3 is not a class index"),
    (dict(weight="wrong_width"), r"weight must be \[vocab, 8\]"),
    (dict(weight="half"), "weight has dtype torch.float16 but hidden has dtype torch.float32"),
    (dict(weight="empty_vocab"), "empty vocabulary"),
    (dict(bias="wrong"), r"bias must be \[50\]"),
    (dict(hidden="int"), "hidden must be float32, float64, bfloat16 or float16"),
    (dict(reduction="avg"), "reduction must be 'mean', 'sum' or 'none'"),
    (dict(label_smoothing=1.5), r"label_smoothing must be in \[0, 1\]"),
    (dict(softcap=0.0), "softcap must be > 0"),
    (dict(softcap=-1.0), "softcap must be > 0"),
    (dict(z_loss=-0.1), "z_loss must be a finite number >= 0"),
    (dict(z_loss=float("nan")), "z_loss must be a finite number >= 0"),
    (dict(ignore_index=1.5), "ignore_index must be an int"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[m for _, m in BAD])
def test_bad_inputs_name_the_argument(change, message):
    h, w, b, t = make_inputs(5, 8, 50, torch.float32, "cpu")
    kw = {}
    for key, value in change.items():
        if key == "target":
            t = {"float": t.float(), "short": t[:3], "out_of_range": t.clone().index_fill_(0, torch.tensor([2]), 50),
                 "negative": t.clone().index_fill_(0, torch.tensor([1]), -3)}[value]
        elif key == "weight":
            w = {"wrong_width": w[:, :5], "half": w.half(), "empty_vocab": w[:0]}[value]
        elif key == "bias":
            b = b[:7]
        elif key == "hidden":
            h = h.to(torch.int32)
        else:
            kw[key] = value
    with pytest.raises(ValueError, match=message):
        fusedllm.linear_cross_entropy(h, w, t, bias=b, **kw)


def test_notebook_llama_model_computes_its_loss_without_logits():
    from fusedllm.compat import nb003

    torch.manual_seed(0)
    config = nb003.LLaMAConfig(vocab_size=61, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2)
    model = nb003.LLaMAModel(config)
    ids = torch.randint(0, 61, (2, 9))
    labels = ids.clone()
    labels[1, :4] = -100
    loss = model(ids, labels=labels)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    logits = model(ids)
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, 61), labels[:, 1:].reshape(-1))
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    assert_close(loss, ref, FORWARD_TOL[torch.float32])
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, GRAD_TOL[torch.float32])
    with pytest.raises(ValueError, match="labels must have the shape of input_ids"):
        model(ids, labels=labels[:, 1:])


def test_backward_twice_through_a_kept_graph():
    """The gradients formed in the forward pass are scaled in place only when
    the graph is not kept for another backward."""
    h, w, b, t = make_inputs(6, 4, 9, torch.float32, "cpu")
    h.requires_grad_()
    for reduction in REDUCTIONS:
        h.grad = None
        loss = fusedllm.linear_cross_entropy(h, w, t, reduction=reduction).sum()
        loss.backward(retain_graph=True)
        first = h.grad.clone()
        loss.backward()
        assert_close(h.grad, 2 * first, GRAD_TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_deterministic(device, dtype, monkeypatch):
    """Same bits on every run: no atomics, the chunks' weight gradients added
    in order. (Across thread counts the row kernel gives the same bits; the
    BLAS multiplies need not, so each count is compared with itself.)"""
    monkeypatch.setenv("FUSEDLLM_CE_CHUNK_ROWS", "16")
    h, w, b, t = make_inputs(70, 24, 300, dtype, device)

    def run():
        loss, grads = loss_and_grads(fusedllm.linear_cross_entropy, h, w, b, t, label_smoothing=0.1)
        return [loss, *grads]

    results = results_across_thread_counts(device, run)
    pairs = [(0, 3), (1, 2)] if len(results) == 4 else [(0, 1)]
    for i, j in pairs:
        for x, y in zip(results[i], results[j]):
            assert torch.equal(x, y)


def test_softcap_rounds_the_capped_logits_once(device):
    """bfloat16 logits near 1: the cap's correction (about 4e-4) is below
    bfloat16's resolution there, so rounding the capped logits to bfloat16
    again would give the uncapped loss. The cap is taken in float32."""
    h = torch.tensor([[1.0, 0.0]], dtype=torch.bfloat16, device=device)
    w = torch.eye(2, dtype=torch.bfloat16, device=device)
    t = torch.tensor([1], device=device)
    z = h.float() @ w.float().T  # exact
    want = F.cross_entropy(30.0 * torch.tanh(z / 30.0), t)
    uncapped = F.cross_entropy(z, t)
    got = fusedllm.linear_cross_entropy(h, w, t, softcap=30.0)
    assert abs(want.item() - uncapped.item()) > 2e-4
    assert abs(got.item() - want.item()) < 1e-6, (got.item(), want.item(), uncapped.item())


@pytest.mark.cpu_variants
@pytest.mark.parametrize("options", [dict(label_smoothing=0.1), dict(softcap=2.3), dict(z_loss=0.1)],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_float64_options_stay_double(device, options):
    """0.1 in float32 is 0.1 + 1.5e-9: options carried as float32 put errors of
    about 1e-10 into a float64 loss, where float64 promises about 1e-16."""
    h = torch.randn(9, 16, dtype=torch.float64, device=device)
    w = torch.randn(50, 16, dtype=torch.float64, device=device)
    t = torch.randint(0, 50, (9,), device=device)
    got = fusedllm.linear_cross_entropy(h, w, t, reduction="none", **options)
    want = ref_lce(h, w, t, reduction="none", **options)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
