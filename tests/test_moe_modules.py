"""fusedllm.nn.MoE: against a plain loop over tokens and experts (float64),
gradients of every parameter and the input, state dicts of Hugging Face's
sparse MoE blocks, from_config, torch.compile and bad arguments."""

import copy

import pytest
import torch
import torch.nn.functional as F

import fusedllm
from fusedllm.nn import MoE
from checks import whole


def plain_moe(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer written out: per token, score every expert, take the top k
    (ties to the lower index), weight, and run each chosen expert alone."""
    flat = x.reshape(-1, m.hidden_size)
    out = torch.zeros_like(flat)
    experts = m.num_experts
    act = F.silu if m.activation == "silu" else (lambda t: F.gelu(t, approximate="tanh"))
    inter = m.intermediate_size
    for t in range(flat.shape[0]):
        h = flat[t]
        logits = m.gate.weight @ h
        scores = logits.softmax(-1) if m.scoring == "softmax" else logits.sigmoid()
        choice = scores.detach().clone()
        if m.gate.e_score_correction_bias is not None:
            choice = choice + m.gate.e_score_correction_bias.to(choice.dtype)
        if m.num_groups > 1:
            size = experts // m.num_groups
            groups = [sorted(choice[g * size:(g + 1) * size].tolist(), reverse=True) for g in range(m.num_groups)]
            group_score = [sum(g[:2]) for g in groups]
            kept = sorted(range(m.num_groups), key=lambda g: (-group_score[g], g))[:m.top_groups]
            for g in range(m.num_groups):
                if g not in kept:
                    choice[g * size:(g + 1) * size] = -float("inf")
        chosen = sorted(range(experts), key=lambda e: (-choice[e].item(), e))[:m.top_k]
        weights = torch.stack([scores[e] for e in chosen])
        if m.normalize:
            weights = weights / weights.sum()
        weights = weights * m.scaling
        for w, e in zip(weights, chosen):
            gate_up = m.experts.gate_up_proj[e] @ h
            hidden = act(gate_up[:inter]) * gate_up[inter:]
            out[t] = out[t] + w * (m.experts.down_proj[e] @ hidden)
    shared = m.shared
    if shared is not None:
        s = shared.down_proj(act(shared.gate_proj(flat)) * shared.up_proj(flat))
        if m.shared_expert_gate is not None:
            s = torch.sigmoid(m.shared_expert_gate(flat)) * s
        out = out + s
    return out.view(x.shape)


CASES = {
    "mixtral": dict(num_experts=4, top_k=2),
    "unnormalized": dict(num_experts=6, top_k=3, normalize=False),
    "gelu_top1": dict(num_experts=5, top_k=1, activation="gelu_tanh"),
    "qwen2_shared": dict(num_experts=8, top_k=2, normalize=False, shared_intermediate_size=12, shared_gate=True),
    "deepseek": dict(num_experts=8, top_k=2, scoring="sigmoid", num_groups=4, top_groups=2, scaling=2.5,
                     correction_bias=True, shared_intermediate_size=10, shared_name="shared_experts"),
}


def _layer(case, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    m = MoE(16, 12, **CASES[case], dtype=dtype)
    if m.gate.e_score_correction_bias is not None:
        with torch.no_grad():
            m.gate.e_score_correction_bias.normal_(0.0, 0.2)
    return m


def _grads(module, x, out, grad):
    module.zero_grad(set_to_none=True)
    x.grad = None
    out.backward(grad)
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    grads["x"] = x.grad.clone()
    return grads


@pytest.mark.parametrize("case", list(CASES))
def test_equals_plain_loop_with_gradients(case):
    m = _layer(case)
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(3, 5, 16, dtype=torch.float64)
    out = m(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    fused = _grads(m, x, out, grad)
    ref_out = plain_moe(m, x)
    ref = _grads(m, x, ref_out, grad)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    assert fused.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(fused[name], ref[name], atol=1e-9, rtol=1e-9, msg=name)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_lower_precision_close_to_float64(dtype, tol):
    m64 = _layer("mixtral")
    m = copy.deepcopy(m64).to(dtype)
    x = torch.randn(40, 16, dtype=torch.float64)
    ref = m64(x)
    # route on the rounded layer: compare the experts' sums, not a flipped choice
    out = m(x.to(dtype))
    assert out.dtype == dtype
    chosen64, chosen = m64.route(x)[2], m.route(x.to(dtype))[2]
    same = (chosen64.sort(-1).values == chosen.sort(-1).values).all(-1)
    assert same.float().mean() > 0.8
    torch.testing.assert_close(out[same].double(), ref[same], atol=tol * 10, rtol=tol * 10)


def test_router_logits_and_aux_loss():
    m = _layer("mixtral", dtype=torch.float32)
    x = torch.randn(2, 7, 16, requires_grad=True)
    out, logits, indices = m(x, return_router_logits=True)
    assert logits.shape == (14, 4) and indices.shape == (14, 2) and indices.dtype == torch.int64
    torch.testing.assert_close(out, m(x))
    torch.testing.assert_close(logits, F.linear(x.reshape(-1, 16), m.gate.weight))
    loss = fusedllm.moe_load_balancing_loss(logits, indices)
    loss.backward()
    assert m.gate.weight.grad is not None and torch.isfinite(loss)


def test_empty_input():
    m = _layer("mixtral", dtype=torch.float32)
    x = torch.randn(0, 3, 16, requires_grad=True)
    out = m(x)
    assert out.shape == (0, 3, 16)
    out.sum().backward()
    assert x.grad.shape == x.shape


transformers = None


def _hf():
    global transformers
    transformers = pytest.importorskip("transformers")
    return transformers


def _hf_config(model_type):
    t = _hf()
    common = dict(hidden_size=32, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2)
    if model_type == "mixtral":
        return t.MixtralConfig(intermediate_size=24, num_local_experts=4, **common)
    if model_type == "qwen2_moe":
        return t.Qwen2MoeConfig(moe_intermediate_size=20, shared_expert_intermediate_size=28, num_experts=6,
                                norm_topk_prob=False, **common)
    if model_type == "qwen3_moe":
        return t.Qwen3MoeConfig(moe_intermediate_size=20, intermediate_size=64, num_experts=6, norm_topk_prob=True,
                                **common)
    if model_type == "olmoe":
        return t.OlmoeConfig(intermediate_size=20, num_experts=6, norm_topk_prob=False, **common)
    if model_type == "deepseek_v3":
        return t.DeepseekV3Config(moe_intermediate_size=20, n_routed_experts=8, n_group=4, topk_group=2,
                                  n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True, **common)
    raise AssertionError(model_type)


def _hf_block(model_type):
    t = _hf()
    config = _hf_config(model_type)
    module = {
        "mixtral": "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
        "qwen2_moe": "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
        "qwen3_moe": "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
        "olmoe": "transformers.models.olmoe.modeling_olmoe.OlmoeSparseMoeBlock",
        "deepseek_v3": "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE",
    }[model_type]
    path, _, name = module.rpartition(".")
    import importlib

    cls = getattr(importlib.import_module(path), name)
    config._experts_implementation = "eager"
    torch.manual_seed(3)
    block = cls(config).float()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
        for name_, b in block.named_buffers():
            if name_.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return config, block.eval()


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"])
def test_from_config_and_state_dict_round_trip(model_type):
    config, block = _hf_block(model_type)
    m = MoE.from_config(config)
    hf_state = block.state_dict()
    assert set(m.state_dict()) == set(hf_state)
    m.load_state_dict(hf_state)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        expected = block(x)
        if isinstance(expected, tuple):
            expected = expected[0]
        torch.testing.assert_close(m(x), expected, atol=1e-5, rtol=1e-5)
    # and back: the HF block loads ours
    block2 = copy.deepcopy(block)
    for p in block2.parameters():
        p.data.zero_()
    block2.load_state_dict(m.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(block2(x), expected)


def test_from_config_settings():
    m = MoE.from_config(_hf_config("deepseek_v3"))
    assert (m.scoring, m.num_groups, m.top_groups, m.scaling, m.normalize) == ("sigmoid", 4, 2, 2.5, True)
    assert m.shared_name == "shared_experts" and m.shared.gate_proj.out_features == 40
    m = MoE.from_config(_hf_config("mixtral"))
    assert (m.num_experts, m.top_k, m.intermediate_size, m.normalize) == (4, 2, 24, True)
    m = MoE.from_config(_hf_config("olmoe"))
    assert (m.intermediate_size, m.normalize) == (20, False)
    m = MoE.from_config(_hf_config("qwen3_moe"))
    assert (m.intermediate_size, m.normalize) == (20, True)


def test_from_config_refusals():
    t = _hf()
    with pytest.raises(ValueError, match=whole(
            "fusedllm.nn.MoE.from_config: model type 'llama' is not one of mixtral, qwen2_moe, qwen3_moe, olmoe, "
            "deepseek_v3")):
        MoE.from_config(t.LlamaConfig(hidden_size=32))
    with pytest.raises(ValueError, match=whole(
            "fusedllm.nn.MoE.from_config: activation 'relu' has no fused kernel; supported: ['gelu_new', "
            "'gelu_pytorch_tanh', 'gelu_tanh', 'silu', 'swish']")):
        MoE.from_config(t.MixtralConfig(hidden_size=32, hidden_act="relu"))
    with pytest.raises(ValueError, match=whole(
            "fusedllm.nn.MoE.from_config: a Qwen2-MoE block always has a shared expert; "
            "shared_expert_intermediate_size is 0")):
        MoE.from_config(t.Qwen2MoeConfig(hidden_size=32, shared_expert_intermediate_size=0))


@pytest.mark.skipif(fusedllm.backend() != "extension", reason="the plain path checks indices on the host")
def test_torch_compile_fullgraph():
    m = _layer("qwen2_shared", dtype=torch.float32)
    compiled = torch.compile(copy.deepcopy(m), fullgraph=True)
    x = torch.randn(2, 9, 16, requires_grad=True)
    grad = torch.randn(2, 9, 16)
    eager = _grads(m, x, m(x), grad)
    out = compiled(x)
    got = _grads(compiled, x, out, grad)
    torch.testing.assert_close(out, m(x), atol=1e-5, rtol=1e-5)
    for name, value in eager.items():
        key = name if name == "x" else f"_orig_mod.{name}"
        torch.testing.assert_close(got[key], value, atol=1e-5, rtol=1e-5, msg=name)


def test_meta_device_and_repr():
    m = MoE(32, 16, 8, 2, scoring="sigmoid", num_groups=4, top_groups=2, scaling=2.5, correction_bias=True,
            device="meta")
    assert m.experts.gate_up_proj.shape == (8, 32, 32) and m.experts.down_proj.shape == (8, 32, 16)
    assert m.gate.weight.is_meta
    text = repr(m)
    for words in ("num_experts=8", "top_k=2", "scoring='sigmoid'", "num_groups=4, top_groups=2", "scaling=2.5",
                  "correction_bias=True"):
        assert words in text



# (kwargs, the argument a row is about, the whole message)
BAD_CONSTRUCTOR_ARGUMENTS = [
    (dict(hidden_size=0), "hidden_size", "fusedllm.nn.MoE: hidden_size must be a positive int, got 0"),
    (dict(intermediate_size=2.5), "intermediate_size",
     "fusedllm.nn.MoE: intermediate_size must be a positive int, got 2.5"),
    (dict(num_experts=True), "num_experts", "fusedllm.nn.MoE: num_experts must be a positive int, got True"),
    (dict(top_k=0), "top_k", "fusedllm.nn.MoE: top_k must be a positive int, got 0"),
    (dict(top_k=9), "top_k", "fusedllm.nn.MoE: top_k (9) must be at most num_experts (8)"),
    (dict(activation="relu"), "activation",
     "fusedllm.nn.MoE: activation must be one of ('silu', 'gelu_tanh'), got 'relu'"),
    (dict(scoring="tanh"), "scoring", "fusedllm.nn.MoE: scoring must be one of ('softmax', 'sigmoid'), got 'tanh'"),
    (dict(normalize=1), "normalize", "fusedllm.nn.MoE: normalize must be True or False, got 1"),
    (dict(num_groups=3), "num_groups", "fusedllm.nn.MoE: num_groups (3) must divide num_experts (8)"),
    (dict(num_groups=4, top_groups=5), "top_groups", "fusedllm.nn.MoE: top_groups (5) must be at most num_groups (4)"),
    (dict(num_groups=4, top_groups=1, top_k=3), "top_k",
     "fusedllm.nn.MoE: top_k (3) is more than the 2 experts of the top_groups=1 groups kept"),
    (dict(scaling=float("inf")), "scaling", "fusedllm.nn.MoE: scaling must be a finite number, got inf"),
    (dict(scaling="2"), "scaling", "fusedllm.nn.MoE: scaling must be a finite number, got '2'"),
    (dict(correction_bias=None), "correction_bias", "fusedllm.nn.MoE: correction_bias must be True or False, got None"),
    (dict(shared_intermediate_size=-1), "shared_intermediate_size",
     "fusedllm.nn.MoE: shared_intermediate_size must be a positive int, got -1"),
    (dict(shared_gate=True), "shared_gate",
     "fusedllm.nn.MoE: shared_gate=True needs a shared expert (shared_intermediate_size)"),
    (dict(shared_intermediate_size=8, shared_name="experts"), "shared_name",
     "fusedllm.nn.MoE: shared_name must be an identifier other than gate, experts and shared_expert_gate, "
     "got 'experts'"),
]


@pytest.mark.parametrize("kwargs, message", [pytest.param(kwargs, message, id=f"kwargs{i}-{name}")
                                             for i, (kwargs, name, message) in enumerate(BAD_CONSTRUCTOR_ARGUMENTS)])
def test_bad_constructor_arguments(kwargs, message):
    args = dict(hidden_size=16, intermediate_size=8, num_experts=8, top_k=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=whole(message)):
        MoE(**args)


def test_bad_forward_arguments():
    m = _layer("mixtral", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., hidden_size=16\]"):
        m(torch.randn(3, 15))
    with pytest.raises(ValueError, match=whole("fusedllm.nn.MoE: x must be [..., hidden_size=16], got list")):
        m([1.0] * 16)
    with pytest.raises(ValueError, match="x is torch.float64"):
        m(torch.randn(3, 16, dtype=torch.float64))
