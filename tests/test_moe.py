"""Mixture-of-experts ops: moe_route (the router), moe_experts (tokens grouped
by expert through their gated MLPs and summed back) and the auxiliary loss,
against token-by-token references in float64."""

import re

import pytest
import torch

import fusedllm
from checks import FORWARD_TOL, GRAD_TOL, assert_close, emulated, results_across_thread_counts
from reference import moe_experts as ref_experts
from reference import moe_route as ref_route

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
ops = torch.ops.fusedllm


def make_experts(tokens, hidden, inter, experts, top_k, dtype, device, seed=0, weights_dtype=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    logits = torch.randn(tokens, experts, generator=g)
    indices = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]) \
        if tokens else torch.zeros(0, top_k, dtype=torch.int64)
    weights = torch.rand(tokens, top_k, generator=g)
    cast = lambda t: t.to(dtype=dtype, device=device)  # noqa: E731
    w_dtype = weights_dtype or dtype
    return (cast(x), indices.to(device), weights.to(dtype=w_dtype, device=device), cast(gate_up),
            cast(down), cast(logits))


def experts_and_grads(fn, x, indices, weights, gate_up, down, grad_out, activation="silu", gate_up_bias=None,
                      down_bias=None, **flags):
    """out and the gradients of hidden, weights, gate_up, down and the biases given."""
    tensors = [x, weights, gate_up, down] + [b for b in (gate_up_bias, down_bias) if b is not None]
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    biases = iter(leaves[4:])
    kw = dict(flags)
    if gate_up_bias is not None:
        kw["gate_up_bias"] = next(biases)
    if down_bias is not None:
        kw["down_bias"] = next(biases)
    out = fn(leaves[0], indices, leaves[1], leaves[2], leaves[3], activation, **kw)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves]


def check_experts(x, indices, weights, gate_up, down, activation="silu", **options):
    """Forward (with and without grad) and every gradient against the float64 reference;
    options: the biases, transposed, interleaved, alpha, limit."""
    dtype = x.dtype
    biases = [options.get(name) for name in ("gate_up_bias", "down_bias")]
    tensors = [x, weights, gate_up, down] + [b for b in biases if b is not None]
    names = ["hidden", "weights", "gate_up_proj", "down_proj"] + [
        name for name, b in zip(("gate_up_bias", "down_bias"), biases) if b is not None]
    before = [t.clone() for t in (*tensors, indices)]
    grad_out = torch.randn(x.shape, dtype=dtype, device=x.device)
    out, grads = experts_and_grads(fusedllm.moe_experts, x, indices, weights, gate_up, down, grad_out,
                                   activation, **options)
    wide = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in options.items()}
    ref, ref_grads = experts_and_grads(ref_experts, x.double(), indices, weights.double(),
                                       gate_up.double(), down.double(), grad_out.double(), activation, **wide)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, ref, FORWARD_TOL[dtype], "out", upcast=True)
    with torch.no_grad():  # inference: no rows kept for backward, summed in another order
        inference = fusedllm.moe_experts(x, indices, weights, gate_up, down, activation, **options)
    assert_close(inference, ref, FORWARD_TOL[dtype], "out without grad", upcast=True)
    for name, g, r, t in zip(names, grads, ref_grads, tensors):
        assert g.dtype == t.dtype and g.shape == t.shape, name
        assert_close(g, r, GRAD_TOL[dtype], f"grad {name}", upcast=True)
    after = (*tensors, indices)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "an input was modified"


# --- moe_experts -----------------------------------------------------------------------------


def assert_compiled_matches_eager(fn, tensors):
    """torch.compile(fn, fullgraph=True) gives fn's output and gradients for every tensor."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    eager_leaves = [t.clone().requires_grad_() for t in tensors]
    out = torch.compile(fn, fullgraph=True)(*leaves)
    ref = fn(*eager_leaves)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref)
    for a, b in zip(leaves, eager_leaves):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.cpu_variants
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 8, 6, 4, 1), (37, 16, 12, 8, 2), (19, 24, 20, 16, 8)],
                         ids=lambda s: "T{}xH{}xI{}xE{}k{}".format(*s))
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_experts_match_reference(device, dtype, shape, activation):
    check_experts(*make_experts(*shape, dtype, device)[:5], activation=activation)


@pytest.mark.cpu_variants
@pytest.mark.parametrize("chunk", [1, 7, 32])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_chunks_of_rows(device, chunk, grad, monkeypatch):
    """The CUDA kernels' products a chunk of expert-ordered rows at a time,
    the chunks crossing the experts' bounds (the CPU works in blocks of its
    own whatever the chunk); with and without a gradient to feed."""
    monkeypatch.setenv("FUSEDLLM_MOE_CHUNK_ROWS", str(chunk))
    x, indices, weights, gate_up, down, _ = make_experts(37, 16, 12, 8, 2, torch.float32, device)
    if grad:
        check_experts(x, indices, weights, gate_up, down)
    else:
        with torch.no_grad():
            out = fusedllm.moe_experts(x, indices, weights, gate_up, down)
        assert_close(out, ref_experts(x, indices, weights, gate_up, down), FORWARD_TOL[torch.float32],
                     upcast=True)


@pytest.mark.cpu_variants
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_float32_weights_with_half_hidden(device, dtype):
    """Mixtral's routing weights stay float32 while the model runs in a half type."""
    check_experts(*make_experts(21, 16, 8, 6, 2, dtype, device, weights_dtype=torch.float32)[:5])


@pytest.mark.parametrize("experts", [8, 64, 128])
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_expert_counts_and_top_k(device, experts, top_k):
    tokens = 9 if emulated() else 40
    check_experts(*make_experts(tokens, 8, 4, experts, top_k, torch.float32, device)[:5])


def test_every_token_to_one_expert_and_experts_without_tokens(device):
    x, indices, weights, gate_up, down, _ = make_experts(30, 16, 8, 8, 2, torch.float32, device)
    indices = torch.tensor([[5, 2]] * 30, device=device)  # experts 0, 1, 3, 4, 6, 7 get nothing
    check_experts(x, indices, weights, gate_up, down)
    check_experts(x, torch.full((30, 1), 7, device=device), weights[:, :1], gate_up, down)


def test_single_token_and_no_tokens(device):
    check_experts(*make_experts(1, 16, 8, 8, 2, torch.float32, device)[:5])
    x, indices, weights, gate_up, down, _ = make_experts(0, 16, 8, 8, 2, torch.float32, device)
    out, grads = experts_and_grads(fusedllm.moe_experts, x, indices, weights, gate_up, down,
                                   torch.zeros(0, 16, device=device))
    assert out.shape == (0, 16)
    assert not grads[2].any() and not grads[3].any()


def test_leading_shape_and_strided_inputs(device):
    x, indices, weights, gate_up, down, _ = make_experts(24, 16, 8, 6, 2, torch.float32, device)
    x3 = x.reshape(4, 6, 16).transpose(0, 1)  # [6, 4, 16], not contiguous
    i3 = indices.reshape(4, 6, 2).transpose(0, 1)
    w3 = weights.reshape(4, 6, 2).transpose(0, 1)
    gate_up_t = gate_up.transpose(1, 2).contiguous().transpose(1, 2)  # unit stride along experts' rows
    out = fusedllm.moe_experts(x3, i3, w3, gate_up_t, down[:, :, :])
    ref = ref_experts(x3.reshape(-1, 16), i3.reshape(-1, 2), w3.reshape(-1, 2), gate_up, down)
    assert out.shape == (6, 4, 16)
    assert_close(out.reshape(-1, 16), ref, FORWARD_TOL[torch.float32], upcast=True)


def test_only_the_gradients_asked_for(device):
    x, indices, weights, gate_up, down, _ = make_experts(12, 8, 6, 4, 2, torch.float32, device)
    w = weights.clone().requires_grad_()
    out = fusedllm.moe_experts(x, indices, w, gate_up, down)
    g = torch.autograd.grad(out.square().sum(), w)[0]
    wr = weights.double().requires_grad_()
    r = torch.autograd.grad(ref_experts(x, indices, wr, gate_up, down).square().sum(), wr)[0]
    assert_close(g, r, GRAD_TOL[torch.float32], upcast=True)
    with torch.no_grad():
        assert not fusedllm.moe_experts(x.requires_grad_(), indices, w, gate_up, down).requires_grad


def test_deterministic(device):
    x, indices, weights, gate_up, down, _ = make_experts(64, 32, 16, 8, 2, torch.float32, device)
    grad_out = torch.randn(64, 32).to(device)

    def run():
        out, grads = experts_and_grads(fusedllm.moe_experts, x, indices, weights, gate_up, down,
                                       grad_out)
        return [out, *grads]

    first, *others = results_across_thread_counts(device, run)
    for other in others:
        assert all(torch.equal(a, b) for a, b in zip(first, other))


# --- gpt-oss's experts: biases, transposed weights, interleaved gate/up, clamped activation ----------

def pre_activations(x, indices, gate_up, gate_up_bias=None, transposed=False, interleaved=False):
    """The gate and up values the experts compute (float64), [T * k, I] each."""
    gu = gate_up.double()[indices.reshape(-1)]                       # [T * k, ., .]
    rows = x.double().repeat_interleave(indices.shape[1], 0)
    v = torch.einsum("ph,phn->pn", rows, gu) if transposed else torch.einsum("ph,pnh->pn", rows, gu)
    if gate_up_bias is not None:
        v = v + gate_up_bias.double()[indices.reshape(-1)]
    return (v[:, 0::2], v[:, 1::2]) if interleaved else v.chunk(2, dim=-1)


def limit_between(gate, up):
    """A clamp limit that some gate and up values exceed and most do not, in the widest
    gap between the values (so that rounding in any dtype, bfloat16 by up to 0.4%, clamps the same values
    the float64 reference does); with the margin to the nearest value."""
    values = torch.cat([gate.flatten(), up.flatten().abs()]).sort().values
    lo, hi = int(0.6 * len(values)), int(0.95 * len(values))
    window = values[lo:hi + 1]
    gaps = window[1:] - window[:-1]
    i = int(gaps.argmax())
    return float((window[i] + window[i + 1]) / 2), float(gaps[i] / 2)


def make_gpt_oss(tokens, hidden, inter, experts, top_k, dtype, device, seed=0, biases=True, transposed=True,
                 interleaved=True, activation="gpt_oss"):
    """Inputs and options of moe_experts in gpt-oss's layout (or the variant asked for),
    with a limit that clamps some gate and up values."""
    x, indices, weights, gate_up, down, _ = make_experts(tokens, hidden, inter, experts, top_k, dtype, device,
                                                         seed)
    g = torch.Generator().manual_seed(seed + 1)
    options = dict(transposed=transposed, interleaved=interleaved)
    if transposed:
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    if biases:
        options["gate_up_bias"] = (torch.randn(experts, 2 * inter, generator=g) * 0.5).to(dtype=dtype, device=device)
        options["down_bias"] = (torch.randn(experts, hidden, generator=g) * 0.5).to(dtype=dtype, device=device)
    if activation == "gpt_oss":
        gate, up = pre_activations(x, indices, gate_up, options.get("gate_up_bias"), transposed, interleaved)
        limit, margin = limit_between(gate, up)
        assert margin > 0.005 * limit, f"no clean limit in these values (margin {margin:g} at {limit:g})"
        assert (gate > limit).any() and (up.abs() > limit).any() and (gate < limit).any()
        options.update(alpha=1.702, limit=limit)
    return (x, indices, weights, gate_up, down), activation, options


# (biases, transposed, interleaved, activation): gpt-oss's, and each difference from Mixtral's alone
GPT_OSS_VARIANTS = {
    "gpt_oss": (True, True, True, "gpt_oss"),
    "biases": (True, False, False, "silu"),
    "transposed": (False, True, False, "gelu_tanh"),
    "interleaved": (False, False, True, "silu"),
    "clamped": (False, False, False, "gpt_oss"),
}


# gpt-oss's layout in every dtype, the variants in float32 and bfloat16
@pytest.mark.cpu_variants
@pytest.mark.parametrize("variant,dtype", [("gpt_oss", d) for d in DTYPES] + [
    (v, d) for v in list(GPT_OSS_VARIANTS)[1:] for d in (torch.float32, torch.bfloat16)], ids=str)
def test_gpt_oss_experts_match_reference(device, dtype, variant):
    biases, transposed, interleaved, activation = GPT_OSS_VARIANTS[variant]
    args, activation, options = make_gpt_oss(29, 16, 12, 6, 2, dtype, device, biases=biases,
                                             transposed=transposed, interleaved=interleaved, activation=activation)
    check_experts(*args, activation, **options)


@pytest.mark.cpu_variants
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_gpt_oss_chunks_of_rows(device, grad, monkeypatch):
    """The biases of each expert where the CUDA kernels' chunks of rows cut the experts' groups."""
    monkeypatch.setenv("FUSEDLLM_MOE_CHUNK_ROWS", "7")
    args, activation, options = make_gpt_oss(23, 16, 8, 4, 2, torch.float32, device)
    if grad:
        check_experts(*args, activation, **options)
    else:
        with torch.no_grad():
            out = fusedllm.moe_experts(*args, activation, **options)
        assert_close(out, ref_experts(*args, activation, **options), FORWARD_TOL[torch.float32], upcast=True)


def test_gpt_oss_gradients_of_some_inputs(device):
    """One bias given (the other None), gradients asked of some inputs only."""
    args, activation, options = make_gpt_oss(13, 8, 6, 4, 2, torch.float32, device)
    x, indices, weights, gate_up, down = args
    down_bias = options.pop("down_bias").clone().requires_grad_()
    w = weights.clone().requires_grad_()
    out = fusedllm.moe_experts(x, indices, w, gate_up, down, activation, down_bias=down_bias, **options)
    g_w, g_b = torch.autograd.grad(out.square().sum(), (w, down_bias))
    wr, br = weights.double().requires_grad_(), down_bias.detach().double().requires_grad_()
    wide = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in options.items()}
    ref = ref_experts(x, indices, wr, gate_up, down, activation, down_bias=br, **wide)
    r_w, r_b = torch.autograd.grad(ref.square().sum(), (wr, br))
    assert_close(g_w, r_w, GRAD_TOL[torch.float32], "grad weights", upcast=True)
    assert_close(g_b, r_b, GRAD_TOL[torch.float32], "grad down_bias", upcast=True)
    # a bias alone asking for its gradient
    gu_bias = options["gate_up_bias"].clone().requires_grad_()
    out = fusedllm.moe_experts(x, indices, weights, gate_up, down, activation,
                               **{**options, "gate_up_bias": gu_bias})
    (g,) = torch.autograd.grad(out.sum(), gu_bias)
    br = options["gate_up_bias"].double().requires_grad_()
    (r,) = torch.autograd.grad(ref_experts(x, indices, weights, gate_up, down, activation,
                                           **{**wide, "gate_up_bias": br}).sum(), br)
    assert_close(g, r, GRAD_TOL[torch.float32], "grad gate_up_bias", upcast=True)


def test_gpt_oss_gradcheck_float64(device):
    args, activation, options = make_gpt_oss(6, 5, 3, 4, 2, torch.float64, device)
    x, indices, weights, gate_up, down = args
    inputs = tuple(t.requires_grad_() for t in (x, weights, gate_up, down, options.pop("gate_up_bias"),
                                                 options.pop("down_bias")))
    assert torch.autograd.gradcheck(
        lambda x_, w_, gu_, dn_, b1, b2: fusedllm.moe_experts(x_, indices, w_, gu_, dn_, activation,
                                                             gate_up_bias=b1, down_bias=b2, **options), inputs)


def test_gpt_oss_activation_is_transformers_formula():
    """activation="gpt_oss" with interleaved=True is GptOssExperts._apply_gate as written
    in transformers (gate = gate_up[..., ::2], up = gate_up[..., 1::2]), limit 7 and alpha 1.702
    by default; with the limit crossed both ways."""
    from fusedllm.ops import moe as moe_ops

    gate_up = torch.randn(40, 32, dtype=torch.float64) * 6
    gate, up = gate_up[..., ::2].clamp(max=7.0), gate_up[..., 1::2].clamp(-7.0, 7.0)
    expected = (up + 1) * (gate * torch.sigmoid(gate * 1.702))
    assert (gate_up.abs() > 7).any()
    torch.testing.assert_close(moe_ops._expert_gated(gate_up, "gpt_oss", True, 1.702, 7.0), expected)
    # and the op's default alpha and limit are those: one expert, identity-like weights
    x = torch.randn(5, 4, dtype=torch.float64) * 6
    eye = torch.eye(4, dtype=torch.float64)
    gu = torch.stack([eye, eye], -1).reshape(4, 8)[None]             # [1, H, 2I]: gate = up = x
    dn = torch.eye(4, dtype=torch.float64)[None]                     # [1, I, H]
    out = fusedllm.moe_experts(x, torch.zeros(5, 1, dtype=torch.long), torch.ones(5, 1, dtype=torch.float64),
                               gu, dn, "gpt_oss", transposed=True, interleaved=True)
    g, u = x.clamp(max=7.0), x.clamp(-7.0, 7.0)
    torch.testing.assert_close(out, (u + 1) * g * torch.sigmoid(1.702 * g))


@pytest.mark.slow
def test_gpt_oss_compiles_fullgraph():
    """gpt-oss's MLP as transformers writes it (router linear with a bias, top-k, softmax of the
    chosen) on moe_route and moe_experts, compiled whole, forward and backward."""
    args, activation, options = make_gpt_oss(33, 16, 8, 8, 2, torch.float32, "cpu")
    x, _, _, gate_up, down = args
    router_w = torch.randn(8, 16) * 0.3
    router_b = torch.randn(8) * 0.1
    b1, b2 = options.pop("gate_up_bias"), options.pop("down_bias")

    def mlp(x_, rw, rb, gu, dn, b1_, b2_):
        w, idx = fusedllm.moe_route(torch.nn.functional.linear(x_, rw, rb), 2)
        return fusedllm.moe_experts(x_, idx, w, gu, dn, activation, gate_up_bias=b1_, down_bias=b2_, **options)

    assert_compiled_matches_eager(mlp, (x, router_w, router_b, gate_up, down, b1, b2))


def test_gpt_oss_router_is_moe_route():
    """GptOssTopKRouter: softmax over the top-k logits (with the router's bias in them) equals
    moe_route's softmax over all experts renormalized over the chosen ones."""
    logits = torch.randn(64, 16)
    top, idx = torch.topk(logits, 4, dim=-1)
    weights, indices = fusedllm.moe_route(logits, 4, "softmax", True)
    assert torch.equal(indices, idx)
    torch.testing.assert_close(weights, top.softmax(-1))
    z = logits.clone().requires_grad_()
    zr = logits.clone().requires_grad_()
    g = torch.randn(64, 4)
    (fusedllm.moe_route(z, 4)[0] * g).sum().backward()
    (torch.topk(zr, 4, dim=-1).values.softmax(-1) * g).sum().backward()
    torch.testing.assert_close(z.grad, zr.grad)


# --- moe_route -------------------------------------------------------------------------------

ROUTINGS = {
    "mixtral": dict(),
    "qwen-unnormalized": dict(normalize=False),
    "deepseek-v3": dict(scoring="sigmoid", correction_bias=True, num_groups=4, top_groups=2,
                        scaling=2.5),
    "sigmoid-plain": dict(scoring="sigmoid", normalize=False),
}


def route_args(name, experts, device="cpu", seed=1):
    kw = dict(ROUTINGS[name])
    if kw.pop("correction_bias", False):
        kw["correction_bias"] = (torch.randn(experts, generator=torch.Generator().manual_seed(seed)) * 0.1).to(device)
    return kw


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("experts,top_k", [(8, 1), (8, 2), (16, 8), (64, 6)], ids=str)
def test_route_matches_reference(device, dtype, routing, experts, top_k):
    kw = route_args(routing, experts, device)
    logits = torch.randn(23, experts).to(dtype=dtype, device=device).requires_grad_()
    weights, indices = fusedllm.moe_route(logits, top_k, **kw)
    ref_w, ref_i = ref_route(logits.detach().double(), top_k, **kw)
    assert indices.dtype == torch.int64 and weights.dtype == (
        torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(indices, ref_i)
    assert_close(weights, ref_w, FORWARD_TOL[torch.float32 if dtype != torch.float64 else dtype],
                 upcast=True)
    grad = torch.randn(weights.shape, dtype=weights.dtype, device=weights.device)
    (g,) = torch.autograd.grad((weights * grad).sum(), logits)
    z = logits.detach().double().requires_grad_()
    (r,) = torch.autograd.grad((ref_route(z, top_k, **kw)[0] * grad.double()).sum(), z)
    assert g.dtype == dtype
    assert_close(g, r, GRAD_TOL[dtype], upcast=True)


def test_route_is_what_transformers_routers_compute():
    """Mixtral (softmax, top-k, renormalize) and Qwen/OLMoE without norm_topk_prob."""
    logits = torch.randn(50, 8)
    probs = logits.softmax(-1)
    top, idx = probs.topk(2, dim=-1)
    weights, indices = fusedllm.moe_route(logits, 2)
    assert torch.equal(indices, idx)
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True))
    weights, indices = fusedllm.moe_route(logits, 2, normalize=False)
    torch.testing.assert_close(weights, top)


def test_route_ties_go_to_the_lower_index(device):
    logits = torch.zeros(3, 8, device=device)
    logits[1, 5] = logits[1, 6] = 1.0
    _, indices = fusedllm.moe_route(logits, 3)
    assert indices.tolist() == [[0, 1, 2], [5, 6, 0], [0, 1, 2]]
    nan_row = torch.tensor([[float("nan"), 0.0, 1.0, 0.0]], device=device)
    _, indices = fusedllm.moe_route(nan_row, 2, scoring="sigmoid")
    assert indices.tolist() == [[2, 1]]


def test_route_leading_shape_and_no_tokens(device):
    logits = torch.randn(3, 5, 8, device=device)
    weights, indices = fusedllm.moe_route(logits, 2)
    assert weights.shape == indices.shape == (15, 2)
    weights, indices = fusedllm.moe_route(torch.zeros(0, 8, device=device), 2)
    assert weights.shape == indices.shape == (0, 2)


def test_route_then_experts_end_to_end(device):
    x, _, _, gate_up, down, logits = make_experts(17, 16, 8, 8, 2, torch.float32, device)
    leaves = [t.clone().requires_grad_() for t in (x, logits, gate_up, down)]
    w, idx = fusedllm.moe_route(leaves[1], 2)
    fusedllm.moe_experts(leaves[0], idx, w, leaves[2], leaves[3]).square().sum().backward()
    ref_leaves = [t.double().requires_grad_() for t in (x, logits, gate_up, down)]
    rw, ri = ref_route(ref_leaves[1], 2)
    assert torch.equal(ri, idx)
    ref_experts(ref_leaves[0], ri, rw, ref_leaves[2], ref_leaves[3]).square().sum().backward()
    for a, b in zip(leaves, ref_leaves):
        assert_close(a.grad, b.grad, GRAD_TOL[torch.float32], upcast=True)


# --- the auxiliary loss ---------------------------------------------------------------------

def test_load_balancing_loss_is_transformers_formula():
    logits = torch.randn(40, 8, requires_grad=True)
    _, indices = fusedllm.moe_route(logits, 2)
    loss = fusedllm.moe_load_balancing_loss(logits, indices)
    probs = logits.softmax(-1)
    mask = torch.nn.functional.one_hot(indices, 8).float()       # [T, k, E]
    expected = 8 * (mask.mean(0) * probs.mean(0)).sum()
    torch.testing.assert_close(loss, expected)
    (g,) = torch.autograd.grad(loss, logits)
    (r,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(g, r)


# --- bad inputs -------------------------------------------------------------------------------

def test_bad_inputs_name_the_argument(device):
    x, indices, weights, gate_up, down, logits = make_experts(5, 8, 4, 4, 2, torch.float32, device)
    zeros = lambda *shape: torch.zeros(*shape, device=device)  # noqa: E731
    cases = [
        (lambda: fusedllm.moe_route(logits, 5), "top_k must be in [1, num_experts = 4], got 5"),
        (lambda: fusedllm.moe_route(logits, 0), "top_k must be in [1, num_experts = 4], got 0"),
        (lambda: fusedllm.moe_route(logits, 2, scoring="relu"), "scoring must be 'softmax' or 'sigmoid', got 'relu'"),
        (lambda: fusedllm.moe_route(logits, 2, num_groups=3),
         "num_groups must be a positive divisor of num_experts = 4, got 3"),
        (lambda: fusedllm.moe_route(logits, 2, num_groups=2, top_groups=3),
         "top_groups must be in [1, num_groups = 2], got 3"),
        (lambda: fusedllm.moe_route(logits, 3, num_groups=2, top_groups=1),
         "top_k = 3 is more than the 2 experts of the top_groups = 1 groups kept"),
        (lambda: fusedllm.moe_route(logits, 2, correction_bias=zeros(3)),
         "correction_bias must be [4] (one per expert), got shape [3]"),
        (lambda: fusedllm.moe_route(logits, 2.0), "top_k must be an int, got 2.0"),
        (lambda: fusedllm.moe_route(logits.long(), 2),
         "router_logits must be float32, float64, bfloat16 or float16, got torch.int64"),
        (lambda: fusedllm.moe_experts(x, indices.int(), weights, gate_up, down),
         "indices must hold int64 expert indices, got torch.int32"),
        (lambda: fusedllm.moe_experts(x, indices[:4], weights[:4], gate_up, down),
         "indices must be [..., top_k] with hidden's leading shape [5], got [4, 2]"),
        (lambda: fusedllm.moe_experts(x, indices, weights[:, :1], gate_up, down),
         "weights must have indices' shape [5, 2], got [5, 1]"),
        (lambda: fusedllm.moe_experts(x, indices, weights.half(), gate_up, down),
         "weights must have hidden's dtype torch.float32, got torch.float16"),
        (lambda: fusedllm.moe_experts(x, indices, weights, gate_up[:, :7], down),
         "gate_up_proj must be [num_experts, 2 * intermediate, 8] (hidden's last dim), got shape [4, 7, 8]"),
        (lambda: fusedllm.moe_experts(x, indices, weights, gate_up, down[:, :, :3]),
         "down_proj must be [4, 8, 4] (num_experts, hidden_size, intermediate), got shape [4, 8, 3]"),
        (lambda: fusedllm.moe_experts(x, indices, weights, gate_up.double(), down),
         "gate_up_proj has dtype torch.float64 but hidden has dtype torch.float32"),
        (lambda: fusedllm.moe_experts(x, indices, weights, gate_up, down, "relu"),
         "activation must be 'silu', 'gelu_tanh' or 'gpt_oss', got 'relu'"),
        (lambda: fusedllm.moe_experts(x, indices, weights, gate_up, down, gate_up_bias=zeros(4, 4)),
         "gate_up_bias must be [4, 8] (num_experts, 2 * intermediate), got shape [4, 4]"),
        (lambda: fusedllm.moe_experts(x, indices, weights, gate_up, down, down_bias=zeros(8)),
         "down_bias must be [4, 8] (num_experts, hidden_size), got shape [8]"),
        (lambda: fusedllm.moe_experts(x, indices, weights, gate_up, down, down_bias=zeros(4, 8).double()),
         "down_bias has dtype torch.float64 but hidden has dtype torch.float32"),
        (lambda: fusedllm.moe_experts(x, indices, weights, gate_up, down, gate_up_bias=zeros(4, 8).long()),
         "gate_up_bias has dtype torch.int64 but hidden has dtype torch.float32"),
        (lambda: fusedllm.moe_experts(x, indices, weights, gate_up[:, :6], down, transposed=True),
         "gate_up_proj must be [num_experts, 8, 2 * intermediate] (hidden's last dim; transposed=True), "
         "got shape [4, 6, 8]"),
        (lambda: fusedllm.moe_experts(x, indices, weights, gate_up.transpose(1, 2), down, transposed=True),
         "down_proj must be [4, 4, 8] (num_experts, intermediate, hidden_size; transposed=True), got shape [4, 8, 4]"),
        (lambda: fusedllm.moe_experts(x, indices, weights, gate_up, down, "gpt_oss", limit=0.0),
         "limit must be positive (inf: no clamp), got 0"),
        (lambda: fusedllm.moe_experts(x, indices, weights, gate_up, down, "gpt_oss", alpha=float("nan")),
         "alpha must be finite, got nan"),
        (lambda: fusedllm.moe_experts(x, indices, weights, gate_up, down, "gpt_oss", alpha="1.7"),
         "alpha must be a number, got '1.7'"),
        (lambda: fusedllm.moe_experts(x, indices, weights, gate_up, down, interleaved=1),
         "interleaved must be a bool, got 1"),
        (lambda: fusedllm.moe_load_balancing_loss(logits, indices.int()), "indices must be int64, got torch.int32"),
    ]
    bad = indices.clone()
    bad[0, 0] += 4
    if device == "cuda":
        # Read on the host, the indices would cost a synchronisation: on a GPU the
        # token with an index out of range gets a NaN row instead.
        out = fusedllm.moe_experts(x, bad, weights, gate_up, down)
        assert out[0].isnan().all() and not out[1:].isnan().any()
    else:
        cases.append((lambda: fusedllm.moe_experts(x, bad, weights, gate_up, down),
                      f"indices[0, 0] = {int(bad[0, 0])} is not an expert index in [0, 4)"))
    for call, words in cases:
        with pytest.raises(ValueError, match=": " + re.escape(words) + "$"):
            call()


def test_plain_path_matches_reference():
    """The plain-PyTorch twins that run without the extension compute the same thing."""
    from fusedllm import _plain
    x, indices, weights, gate_up, down, logits = make_experts(13, 8, 6, 8, 2, torch.float64, "cpu")
    for routing in ROUTINGS:
        kw = route_args(routing, 8)
        kw.setdefault("top_groups", kw.get("num_groups", 1))
        args = [kw.get(name, default) for name, default in (
            ("scoring", "softmax"), ("normalize", True), ("correction_bias", None), ("num_groups", 1),
            ("top_groups", 1), ("scaling", 1.0))]
        w, idx = _plain.moe_route(logits, 3, *args)
        ref_w, ref_i = ref_route(logits, 3, **kw)
        assert torch.equal(idx, ref_i)
        torch.testing.assert_close(w, ref_w)
    out = _plain.moe_experts(x, indices, weights, gate_up, down, "gelu_tanh", False)[0]
    torch.testing.assert_close(out, ref_experts(x, indices, weights, gate_up, down, "gelu_tanh"))
    args, activation, options = make_gpt_oss(13, 8, 6, 8, 2, torch.float64, "cpu")
    out = _plain.moe_experts(*args, activation, False, options["gate_up_bias"], options["down_bias"], True, True,
                             options["alpha"], options["limit"])[0]
    torch.testing.assert_close(out, ref_experts(*args, activation, **options))


@pytest.mark.slow
def test_rows_past_int32_indexing():
    """2^21 (token, choice) rows of 1024 values: the expert-ordered buffers hold
    more than 2^31 elements (about 12 GiB in all)."""
    tokens, hidden, experts = 1 << 20, 1024, 4
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.bfloat16)
    gate_up = torch.randn(experts, 2, hidden, generator=g, dtype=torch.bfloat16) / 32
    down = torch.randn(experts, hidden, 1, generator=g, dtype=torch.bfloat16)
    indices = torch.randint(0, experts, (tokens, 2), generator=g)
    weights = torch.rand(tokens, 2, generator=g)
    out = fusedllm.moe_experts(x, indices, weights, gate_up, down)
    rows = torch.tensor([0, 1, tokens // 2, tokens - 2, tokens - 1])
    ref = ref_experts(x[rows], indices[rows], weights[rows], gate_up, down)
    assert_close(out[rows], ref, FORWARD_TOL[torch.bfloat16], upcast=True)


