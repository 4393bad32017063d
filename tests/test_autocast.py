"""Mixed precision (docs/mixed-precision.md): each op under torch.autocast against
the torch code it replaces under the same autocast, the float32-weight / half-
activation pairs outside autocast, modules and patched Hugging Face models
training under autocast, opcheck of the autocast kernels, torch.compile."""

import copy

import pytest
import torch
import torch.nn.functional as F

import fusedllm
import reference
from checks import FORWARD_TOL, GRAD_TOL, assert_close

HALF = [torch.bfloat16, torch.float16]


def _autocast(device, dtype):
    return torch.autocast(torch.device(device).type, dtype=dtype)


def _on_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def _hf_rms_norm(x, weight, eps=1e-6, offset=0.0, casting="llama"):
    """Hugging Face's LlamaRMSNorm (weight * normalized.to(x.dtype)) and GemmaRMSNorm
    (float32 multiply, cast last): what patch() replaces, dtype promotion included."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "llama":
        return (weight + offset) * normed.to(x.dtype)
    return (normed * (offset + weight.float())).type_as(x)


# --- ops under autocast against their twins -----------------------------------------------


@pytest.mark.parametrize("dtype", HALF)
def test_attention_casts_like_sdpa(device, dtype):
    # float32 q (a rotated q comes out float32 in Hugging Face's models) with half k and v
    q = torch.randn(2, 4, 9, 16, device=device, requires_grad=True)
    k = torch.randn(2, 2, 9, 16, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 2, 9, 16, device=device, dtype=dtype, requires_grad=True)
    with _autocast(device, dtype):
        out = fusedllm.attention(q, k, v, causal=True)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.dtype == want.dtype == dtype
    assert_close(out, want, FORWARD_TOL[dtype])
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(want, (q, k, v), grad)
    for name, a, b in zip("qkv", got, expected):
        assert a.dtype == b.dtype, name  # gradients come back in each input's dtype
        assert_close(a, b, GRAD_TOL[dtype], what=f"grad {name}")


@pytest.mark.parametrize("casting", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", HALF)
def test_rms_norm_after_a_linear(device, dtype, casting):
    lin = torch.nn.Linear(32, 32, device=device)
    weight = (1 + 0.1 * torch.randn(32, device=device)).requires_grad_()
    offset = 1.0 if casting == "gemma" else 0.0
    x = torch.randn(3, 5, 32, device=device)
    with _autocast(device, dtype):
        h = lin(x)
        out = fusedllm.rms_norm(h, weight, offset=offset, casting=casting)
        twin = _hf_rms_norm(h, weight, offset=offset, casting=casting)
        module = fusedllm.nn.RMSNorm(32, offset=offset, casting=casting).to(device)(h)
    # like F.rms_norm on CUDA (float32); on the CPU autocast has no rule, so the
    # mixed pair is taken as Hugging Face's norms take it
    expected = torch.float32 if _on_cuda(device) or casting == "llama" else dtype
    assert out.dtype == module.dtype == expected
    assert_close(out.float(), twin.float(), FORWARD_TOL[dtype])
    gw, gx = torch.autograd.grad(out.float().sum(), (weight, lin.weight), retain_graph=True)
    tw, tx = torch.autograd.grad(twin.float().sum(), (weight, lin.weight))
    assert gw.dtype == torch.float32 and gx.dtype == torch.float32
    assert_close(gw, tw, GRAD_TOL[dtype], what="grad weight")
    assert_close(gx, tx, GRAD_TOL[dtype], what="grad linear")


@pytest.mark.parametrize("dtype", HALF)
def test_fused_add_rms_norm_with_a_float32_residual_stream(device, dtype):
    lin = torch.nn.Linear(32, 32, device=device)
    weight = (1 + 0.1 * torch.randn(32, device=device)).requires_grad_()
    residual = torch.randn(3, 5, 32, device=device)  # float32, as an embedding gives under autocast
    with _autocast(device, dtype):
        x = lin(torch.randn(3, 5, 32, device=device))
        out, h = fusedllm.fused_add_rms_norm(x, residual, weight)
        want_h = residual + x
        want = _hf_rms_norm(want_h, weight)
    assert h.dtype == want_h.dtype == torch.float32
    assert out.dtype == want.dtype == torch.float32
    assert_close(h, want_h, FORWARD_TOL[torch.float32])
    assert_close(out, want, FORWARD_TOL[torch.float32])


@pytest.mark.parametrize("dtype", HALF)
def test_elementwise_ops_keep_their_inputs_dtype(device, dtype):
    lin = torch.nn.Linear(16, 64, device=device)
    x = torch.randn(2, 5, 16, device=device)
    with _autocast(device, dtype):
        gate_up = lin(x)
        gate, up = gate_up.chunk(2, dim=-1)
        out = fusedllm.swiglu(gate, up)
        packed = fusedllm.swiglu(gate_up)
        twin = F.silu(gate) * up
        q, k = lin(x).view(2, 5, 4, 16).transpose(1, 2), lin(x).view(2, 5, 4, 16).transpose(1, 2)
        cos, sin = fusedllm.rope_tables(16, 8, device=device)  # float32 tables
        rq, rk = fusedllm.apply_rope(q, k, cos, sin)
    assert out.dtype == packed.dtype == twin.dtype == dtype
    assert_close(out, twin, FORWARD_TOL[dtype])
    assert torch.equal(out, packed)
    assert rq.dtype == rk.dtype == dtype
    positions = torch.arange(5, device=device).expand(2, 5)
    assert_close(rq, reference.rope(q, cos, sin, positions), FORWARD_TOL[dtype])


@pytest.mark.parametrize("dtype", HALF)
def test_linear_cross_entropy_like_linear_then_cross_entropy(device, dtype):
    hidden = torch.randn(12, 32, device=device, requires_grad=True)
    weight = (0.2 * torch.randn(50, 32, device=device)).requires_grad_()
    target = torch.randint(0, 50, (12,), device=device)
    with _autocast(device, dtype):
        loss = fusedllm.linear_cross_entropy(hidden, weight, target)
        want = F.cross_entropy(F.linear(hidden, weight), target)
    assert loss.dtype == want.dtype == torch.float32
    assert_close(loss, want, FORWARD_TOL[dtype])
    got = torch.autograd.grad(loss, (hidden, weight))
    expected = torch.autograd.grad(want, (hidden, weight))
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype == torch.float32
        assert_close(a, b, GRAD_TOL[dtype])


@pytest.mark.parametrize("dtype", HALF)
def test_moe_like_linear(device, dtype):
    experts, hidden_size, inter = 4, 16, 24
    hidden = torch.randn(6, hidden_size, device=device, requires_grad=True)
    gate_up = (0.3 * torch.randn(experts, 2 * inter, hidden_size, device=device)).requires_grad_()
    down = (0.3 * torch.randn(experts, hidden_size, inter, device=device)).requires_grad_()
    router = torch.nn.Linear(hidden_size, experts, device=device)
    with _autocast(device, dtype):
        logits = router(hidden)  # half
        weights, indices = fusedllm.moe_route(logits, 2)
        out = fusedllm.moe_experts(hidden, indices, weights, gate_up, down)
        # the twin: F.linear per expert and choice, under the same autocast
        want = torch.zeros(6, hidden_size, device=device)
        for t in range(6):
            for j in range(2):
                e = int(indices[t, j])
                g, u = F.linear(hidden[t], gate_up[e]).chunk(2)
                want[t] += weights[t, j] * F.linear(F.silu(g) * u, down[e])
    assert weights.dtype == torch.float32 and out.dtype == dtype
    assert_close(out, want.to(dtype), FORWARD_TOL[dtype])
    grads = torch.autograd.grad(out.float().sum(), (hidden, gate_up, down))
    assert [g.dtype for g in grads] == [torch.float32] * 3


def test_quantized_kv_cache_is_not_cast(device):
    q = torch.randn(1, 4, 3, 16, device=device)
    k, v = torch.randn(1, 2, 7, 16, device=device), torch.randn(1, 2, 7, 16, device=device)
    (k8, ks), (v8, vs) = fusedllm.quantize_kv(k), fusedllm.quantize_kv(v)
    with _autocast(device, torch.bfloat16):
        out = fusedllm.attention(q, k8, v8, k_scale=ks, v_scale=vs)
    assert out.dtype == torch.bfloat16 and k8.dtype == torch.int8 and ks.dtype == torch.float32
    want = fusedllm.attention(q.bfloat16(), k8, v8, k_scale=ks, v_scale=vs)
    assert torch.equal(out, want)


# --- mixed pairs outside autocast -----------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF)
def test_float32_norm_weight_with_half_activations(device, dtype):
    x = torch.randn(4, 40, device=device, dtype=dtype)
    weight = 1 + 0.1 * torch.randn(40, device=device)
    x_before, w_before = x.clone(), weight.clone()
    for casting, offset in (("llama", 0.0), ("gemma", 1.0)):
        out = fusedllm.rms_norm(x, weight, offset=offset, casting=casting)
        want = _hf_rms_norm(x, weight, offset=offset, casting=casting)
        assert out.dtype == want.dtype
        assert_close(out, want, FORWARD_TOL[dtype])
    out, h = fusedllm.fused_add_rms_norm(x, x, weight)
    assert h.dtype == dtype and out.dtype == torch.float32
    # nothing the caller passed is changed
    assert torch.equal(x, x_before) and torch.equal(weight, w_before) and x.dtype == dtype


def test_mistaken_pairs_stay_errors(device):
    x = torch.randn(4, 8, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight has dtype torch.float16"):
        fusedllm.rms_norm(x, torch.ones(8, device=device, dtype=torch.float16))
    with pytest.raises(ValueError, match="weight has dtype torch.bfloat16"):
        fusedllm.rms_norm(x.float(), torch.ones(8, device=device, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="residual has dtype torch.float16"):
        fusedllm.fused_add_rms_norm(x, x.half())
    q = torch.randn(1, 2, 3, 8, device=device)
    with pytest.raises(ValueError, match="v has dtype torch.bfloat16"):
        fusedllm.attention(q, q, q.bfloat16())  # outside autocast, as SDPA
    with pytest.raises(ValueError, match="up has dtype torch.bfloat16"):
        fusedllm.swiglu(x.float(), x)


# --- training under autocast ----------------------------------------------------------------


def _train(model, batches, steps, autocast_dtype=torch.bfloat16):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        ids = batches[step % len(batches)]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=autocast_dtype):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


_COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)


def _hf_model(kind):
    c = transformers = pytest.importorskip("transformers")
    if kind == "llama":
        config = c.LlamaConfig(**_COMMON)
    elif kind == "qwen2":
        config = c.Qwen2Config(**_COMMON)
    elif kind == "gemma2":
        config = c.Gemma2Config(**_COMMON, head_dim=8, attn_logit_softcapping=20.0, final_logit_softcapping=5.0,
                                sliding_window=4)
    else:
        config = c.MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).train()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2", "mixtral"])
def test_patched_hf_model_trains_under_cpu_autocast(kind):
    eager = _hf_model(kind)
    patched = copy.deepcopy(eager)
    report = fusedllm.patch(patched, cross_entropy=True)
    assert report.replaced, str(report)
    if kind != "mixtral":  # patch() leaves Mixtral's attention (and loss) as they are
        assert "fusedllm" in report.attention and "left" not in report.loss, str(report)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(1, 64, (2, 12), generator=g) for _ in range(3)]
    want = _train(eager, batches, 10)
    got = _train(patched, batches, 10)
    # bfloat16's rounding, compounded over ten steps of training
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=0.05, rtol=0.02)
    assert got[-1] < got[0]


def test_notebook_model_trains_under_cpu_autocast():
    from testkit import notebook_models as plain  # the notebooks' classes, unpatched

    torch.manual_seed(0)
    eager = plain.nb003.LLaMAModel(plain.tiny_llama_config(plain.nb003.LLaMAConfig))
    patched = copy.deepcopy(eager)
    assert fusedllm.patch(patched).replaced
    ids = torch.randint(0, 61, (2, 9))
    losses = []
    for model in (eager, patched):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        curve = []
        for _ in range(4):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(ids[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
            loss.backward()
            opt.step()
            curve.append(loss.item())
        losses.append(curve)
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), atol=0.05, rtol=0.02)


# --- operator contract ----------------------------------------------------------------------


def test_opcheck_under_autocast(device):
    q = torch.randn(1, 4, 5, 8, device=device, requires_grad=True)
    kv = torch.randn(1, 2, 5, 8, device=device, dtype=torch.bfloat16, requires_grad=True)
    hidden = torch.randn(6, 8, device=device, requires_grad=True)
    target = torch.randint(0, 10, (6,), device=device)
    lm_head = torch.randn(10, 8, device=device, requires_grad=True)
    x = torch.randn(3, 8, device=device, dtype=torch.bfloat16, requires_grad=True)
    ops = torch.ops.fusedllm
    cases = [
        (ops.attention.default, (q, kv, kv, None, 0.35, True, -1, 0.0, None)),
        (ops.linear_cross_entropy.default, (hidden, lm_head, None, target, -100, "mean", 0.0, 0.0, 0.0)),
        (ops.rms_norm.default, (x, torch.ones(8, device=device), 1e-6, 0.0, "llama")),
        (ops.fused_add_rms_norm.default, (x, x.detach().float(), None, 1e-6, 0.0, "llama")),
    ]
    if not _on_cuda(device):
        cases = cases[:2]  # the norms have no CPU autocast rule
    with _autocast(device, torch.bfloat16):
        for op, args in cases:
            torch.library.opcheck(op, args)


@pytest.mark.slow
def test_torch_compile_autocast_region_without_graph_breaks(device):
    torch._dynamo.reset()
    emb = torch.nn.Embedding(40, 32).to(device)
    norm = fusedllm.nn.RMSNorm(32).to(device)
    qkv = torch.nn.Linear(32, 96).to(device)
    mlp = fusedllm.nn.GatedMLP(32, 48).to(device)
    head = torch.nn.Linear(32, 40, bias=False).to(device)
    cos, sin = fusedllm.rope_tables(8, 16, device=device)

    def step(ids):
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            x = emb(ids)
            q, k, v = qkv(norm(x)).view(2, 7, 3, 4, 8).permute(2, 0, 3, 1, 4)
            q, k = fusedllm.apply_rope(q, k, cos, sin)
            a = fusedllm.attention(q, k, v, causal=True).transpose(1, 2).reshape(2, 7, 32)
            normed, x = norm(a, x)
            x = x + mlp(normed)
            return fusedllm.linear_cross_entropy(norm(x), head.weight, ids)

    ids = torch.randint(0, 40, (2, 7), device=device)
    compiled = torch.compile(step, fullgraph=True)
    got = compiled(ids)
    got.backward()
    grads = [p.grad.clone() for p in (emb.weight, head.weight, norm.weight)]
    for p in (emb.weight, head.weight, norm.weight):
        p.grad = None
    want = step(ids)
    want.backward()
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    for a, p in zip(grads, (emb.weight, head.weight, norm.weight)):
        torch.testing.assert_close(a, p.grad, atol=2e-2, rtol=2e-2)


# --- float16 with a GradScaler, on a GPU ----------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_patched_hf_model_trains_with_grad_scaler_float16(kind):
    model = _hf_model(kind).cuda()
    eager = copy.deepcopy(model)
    fusedllm.patch(model, cross_entropy=True)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(1, 64, (2, 12), generator=g).cuda() for _ in range(3)]
    curves = []
    for m in (eager, model):
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        scaler = torch.amp.GradScaler("cuda")
        curve = []
        for step in range(10):
            ids = batches[step % 3]
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = m(input_ids=ids, labels=ids).loss
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            curve.append(loss.item())
        curves.append(curve)
    assert all(torch.isfinite(torch.tensor(c)).all() for c in curves)
    torch.testing.assert_close(torch.tensor(curves[1]), torch.tensor(curves[0]), atol=0.05, rtol=0.02)


# The other families patch() covers: their tiny models, ten steps under CPU
# autocast bfloat16, patched against unpatched (the MoE ones as tests/test_hf_moe.py builds them).
_MORE_DENSE = {
    "mistral": dict(),
    "qwen3": dict(head_dim=8),
    "phi3": dict(),
    "gemma": dict(head_dim=8),
    "gemma3_text": dict(head_dim=8, sliding_window=4),
    "olmo2": dict(),
    "cohere": dict(),
    "gpt_neox": dict(rotary_pct=0.5),
    "gptj": dict(rotary_dim=4),
}


def _more_model(kind):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind in _MORE_DENSE:
        config = transformers.AutoConfig.for_model(kind, **_COMMON, **_MORE_DENSE[kind])
        config._attn_implementation = "eager"
        return transformers.AutoModelForCausalLM.from_config(config).train()
    from test_hf_moe import _model as moe_model
    return moe_model(kind).train()


@pytest.mark.parametrize("kind", [*_MORE_DENSE, "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"])
def test_every_patched_family_trains_under_cpu_autocast(kind):
    eager = _more_model(kind)
    patched = copy.deepcopy(eager)
    report = fusedllm.patch(patched)
    assert report.replaced, str(report)
    vocab = eager.config.vocab_size
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(1, vocab, (2, 12), generator=g) for _ in range(3)]
    want = _train(eager, batches, 10)
    got = _train(patched, batches, 10)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=0.05, rtol=0.02)
