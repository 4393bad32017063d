"""Hugging Face sparse MoE models on the fused MoE ops: experts_implementation="fusedllm"
and fusedllm.patch(model) against the models' eager experts, on tiny float32 models."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")

import fusedllm  # noqa: E402
from fusedllm import hf_moe  # noqa: E402

VOCAB = 97
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, num_experts_per_tok=2)


def _mixtral(**extra):
    cfg = transformers.MixtralConfig(intermediate_size=48, num_local_experts=4, **COMMON, **extra)
    return transformers.MixtralForCausalLM(cfg)


def _qwen2_moe(**extra):
    cfg = transformers.Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=40,
                                      num_experts=8, norm_topk_prob=False, **COMMON, **extra)
    return transformers.Qwen2MoeForCausalLM(cfg)


def _qwen3_moe(**extra):
    cfg = transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                      norm_topk_prob=True, head_dim=16, **COMMON, **extra)
    return transformers.Qwen3MoeForCausalLM(cfg)


def _olmoe(**extra):
    cfg = transformers.OlmoeConfig(intermediate_size=32, num_experts=8, norm_topk_prob=False, **COMMON, **extra)
    return transformers.OlmoeForCausalLM(cfg)


def _deepseek_v3(**extra):
    common = {**COMMON, "num_key_value_heads": 4}
    cfg = transformers.DeepseekV3Config(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_group=4,
                                        topk_group=2, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
                                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, **common, **extra)
    model = transformers.DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # a correction bias that changes the choice
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0.0, 0.1)
    return model


GPT_OSS_LIMIT = 0.3  # swiglu_limit: small enough that the tiny model's gate/up values cross it


def _gpt_oss(**extra):
    cfg = transformers.GptOssConfig(intermediate_size=32, num_local_experts=4, head_dim=16, swiglu_limit=GPT_OSS_LIMIT,
                                    **COMMON, **extra)
    model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():  # biases that matter (the experts' are zeros at init, the router's tiny)
        for m in model.modules():
            if type(m).__name__ == "GptOssExperts":
                m.gate_up_proj_bias.normal_(0.0, 0.2)
                m.down_proj_bias.normal_(0.0, 0.2)
            if type(m).__name__ == "GptOssTopKRouter":
                m.bias.normal_(0.0, 0.5)
    return model


BUILDERS = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe, "olmoe": _olmoe,
            "deepseek_v3": _deepseek_v3, "gpt_oss": _gpt_oss}
SPARSE_BLOCKS = {"mixtral": 2, "qwen2_moe": 2, "qwen3_moe": 2, "olmoe": 2, "deepseek_v3": 1, "gpt_oss": 2}


def _model(family, **extra):
    torch.manual_seed(0)
    model = BUILDERS[family](**extra).float()
    model.set_experts_implementation("eager")
    return model


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 11), generator=g)
    return ids


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def _assert_same(a, b, tol=1e-5):
    logits_a, grads_a = a
    logits_b, grads_b = b
    torch.testing.assert_close(logits_b, logits_a, atol=tol, rtol=tol)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], atol=tol, rtol=tol, msg=name)


def _greedy(model, ids):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("family", list(BUILDERS))
def test_experts_implementation_matches_eager(family):
    eager = _model(family)
    fused = copy.deepcopy(eager)
    fused.set_experts_implementation("fusedllm")
    assert fused.config._experts_implementation == "fusedllm"
    ids = _inputs()
    _assert_same(_step(eager, ids), _step(fused, ids))
    eager.eval(), fused.eval()
    assert torch.equal(_greedy(eager, ids[:, :5]), _greedy(fused, ids[:, :5]))


def test_experts_implementation_from_config():
    model = transformers.AutoModelForCausalLM.from_config(_mixtral().config, experts_implementation="fusedllm")
    assert model.config._experts_implementation == "fusedllm"
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert ALL_EXPERTS_FUNCTIONS["fusedllm"] is hf_moe.experts_forward


@pytest.mark.parametrize("family", list(BUILDERS))
def test_patch_matches_unpatched(family):
    eager = _model(family)
    fused = copy.deepcopy(eager)
    keys = list(fused.state_dict())
    report = fusedllm.patch(fused)
    moe = [r for r in report.replaced if r.replacement.startswith("fusedllm.hf_moe.")]
    assert len(moe) == SPARSE_BLOCKS[family], str(report)
    assert all("moe_route" in r.note and "moe_experts" in r.note for r in moe)
    assert not [item for item in report.left if "moe" in item.reason.lower()], str(report)
    assert list(fused.state_dict()) == keys
    blocks = [m for m in fused.modules() if isinstance(m, hf_moe._FusedBlock)]
    assert len(blocks) == SPARSE_BLOCKS[family]
    for block in blocks:
        router = block.router if family == "gpt_oss" else block.gate
        assert isinstance(router, hf_moe._FusedRouter) and isinstance(block.experts, hf_moe._FusedExperts)
    ids = _inputs()
    _assert_same(_step(eager, ids), _step(fused, ids))
    eager.eval(), fused.eval()
    assert torch.equal(_greedy(eager, ids[:, :5]), _greedy(fused, ids[:, :5]))


def test_patch_keeps_parameters_and_unpatch_restores():
    model = _model("qwen2_moe")
    block = model.model.layers[0].mlp
    params = {name: p for name, p in model.named_parameters()}
    fusedllm.patch(model)
    fused_block = model.model.layers[0].mlp
    assert fused_block is not block and isinstance(fused_block, type(block))
    assert fused_block.gate.weight is block.gate.weight
    assert fused_block.experts.gate_up_proj is block.experts.gate_up_proj
    assert fused_block.shared_expert is block.shared_expert  # the model's own shared expert
    assert all(p is params[name] for name, p in model.named_parameters())
    fusedllm.unpatch(model)
    assert model.model.layers[0].mlp is block
    assert type(block.gate).__module__.startswith("transformers")


def test_router_logits_and_aux_loss():
    eager = _model("mixtral", output_router_logits=True, router_aux_loss_coef=0.02)
    fused = copy.deepcopy(eager)
    fusedllm.patch(fused)
    ids = _inputs()
    a, b = eager(ids, labels=ids), fused(ids, labels=ids)
    assert len(b.router_logits) == 2
    for x, y in zip(a.router_logits, b.router_logits):
        torch.testing.assert_close(y, x, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(b.aux_loss, a.aux_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(b.loss, a.loss, atol=1e-6, rtol=1e-6)
    # our loss function on the fused router's outputs is transformers' aux loss
    block = fused.model.layers[0].mlp
    x = torch.randn(22, 64)
    logits, _, indices = block.gate(x)
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.testing.assert_close(fusedllm.moe_load_balancing_loss(logits, indices),
                               load_balancing_loss_func((logits,), 4, 2), atol=1e-6, rtol=1e-6)


def test_mixtral_router_jitter_in_training():
    eager = _model("mixtral", router_jitter_noise=0.1)
    fused = copy.deepcopy(eager)
    report = fusedllm.patch(fused)
    assert "router_jitter_noise=0.1" in str(report)
    eager.train(), fused.train()
    ids = _inputs()
    torch.manual_seed(5)
    a = _step(eager, ids)
    torch.manual_seed(5)
    b = _step(fused, ids)
    _assert_same(a, b)


def test_patch_moe_false_and_verify():
    model = _model("olmoe")
    report = fusedllm.patch(model, moe=False)
    left = [item for item in report.left if item.module == "OlmoeSparseMoeBlock"]
    assert len(left) == 2 and all(item.reason == "moe=False" for item in left)
    fusedllm.unpatch(model)
    report = fusedllm.patch(model, verify=True)
    moe = [r for r in report.replaced if r.original == "OlmoeSparseMoeBlock"]
    assert len(moe) == 2 and all(r.verified for r in moe), str(report)


def test_patch_leaves_what_it_cannot_run():
    model = _model("qwen3_moe")
    model.model.layers[0].mlp.experts.act_fn = torch.nn.ReLU()
    model.model.layers[1].mlp.experts.has_bias = True
    report = fusedllm.patch(model)
    left = {item.path: item.reason for item in report.left}
    assert "ReLU has no fused kernel" in left["model.layers.0.mlp"]
    assert "has_bias" in left["model.layers.1.mlp"]
    assert not any(r.original == "Qwen3MoeSparseMoeBlock" for r in report.replaced)


def test_unknown_moe_block_is_reported():
    if not hasattr(transformers, "PhimoeConfig"):
        pytest.skip("no Phi-MoE in this transformers")
    cfg = transformers.PhimoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                    max_position_embeddings=64)
    report = fusedllm.patch(transformers.PhimoeForCausalLM(cfg))
    left = [item for item in report.left if item.module == "PhimoeSparseMoeBlock"]
    assert len(left) == 1 and "not one of the sparse MoE blocks fusedllm fuses" in left[0].reason, str(report)


@pytest.mark.parametrize("change, words", [
    (lambda e: setattr(e, "has_bias", True), "has_bias"),
    (lambda e: setattr(e, "is_transposed", True), "is_transposed"),
    (lambda e: setattr(e, "has_gate", False), "has_gate=False"),
    (lambda e: setattr(e, "is_concatenated", False), "is_concatenated=False"),
    (lambda e: setattr(e, "has_post_expert_norm", True), "has_post_expert_norm"),
    (lambda e: setattr(e, "act_fn", torch.nn.GELU()), "GELU has no fused kernel"),
])
def test_experts_forward_refuses(change, words):
    model = _model("mixtral")
    experts = model.model.layers[0].mlp.experts
    change(experts)
    x = torch.randn(3, 64)
    idx = torch.tensor([[0, 1], [2, 3], [1, 0]])
    w = torch.full((3, 2), 0.5)
    with pytest.raises(ValueError, match=words) as info:
        hf_moe.experts_forward(experts, x, idx, w)
    assert "MixtralExperts" in str(info.value) and "eager" in str(info.value)


def test_experts_forward_custom_gate_refused():
    model = _model("mixtral")
    experts = model.model.layers[0].mlp.experts
    cls = type("GatedOwnWay", (type(experts),), {"_apply_gate": lambda self, x: x[..., : x.shape[-1] // 2]})
    experts.__class__ = cls
    with pytest.raises(ValueError, match="_apply_gate"):
        hf_moe.experts_forward(experts, torch.randn(2, 64), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2))


@pytest.mark.parametrize("act, expected", [("silu", "silu"), ("swish", "silu"), ("gelu_pytorch_tanh", "gelu_tanh"),
                                           ("gelu_new", "gelu_tanh"), ("gelu", None), ("relu", None)])
def test_activation_names(act, expected):
    from transformers.activations import ACT2FN

    assert hf_moe.experts_activation(ACT2FN[act]) == expected


def test_bfloat16_weights_dtype_semantics():
    """Mixtral's router hands float32 weights to bf16 experts, Qwen's bf16 ones: both taken as they come."""
    for family in ("mixtral", "qwen3_moe"):
        model = _model(family).to(torch.bfloat16).eval()
        ids = _inputs()
        with torch.no_grad():
            ref = model(ids).logits.float()
            model.set_experts_implementation("fusedllm")
            out = model(ids).logits.float()
        assert out.dtype == ref.dtype
        torch.testing.assert_close(out, ref, atol=0.1, rtol=0.05)


def test_gpt_oss_clamps_and_biases_are_exercised():
    """The gpt-oss model of these tests: its experts' gate/up values cross swiglu_limit both
    ways, so the clamps (and their zero gradients) take part in the comparisons above, and
    patch() keeps the very Parameter objects of router and experts, biases included."""
    model = _model("gpt_oss")
    seen = []
    experts = model.model.layers[0].mlp.experts
    handle = experts.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    with torch.no_grad():
        model(_inputs())
    handle.remove()
    gate_up = torch.einsum("th,ehn->etn", seen[0], experts.gate_up_proj) + experts.gate_up_proj_bias[:, None]
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    for values in (gate, up.abs()):
        crossed = (values > GPT_OSS_LIMIT).float().mean()
        assert 0.02 < crossed < 0.9, crossed
    block = model.model.layers[0].mlp
    params = dict(model.named_parameters())
    report = fusedllm.patch(model)
    fused = model.model.layers[0].mlp
    assert fused is not block and isinstance(fused.router, hf_moe._FusedRouter)
    assert fused.router.bias is block.router.bias and fused.experts.down_proj_bias is block.experts.down_proj_bias
    assert all(p is params[name] for name, p in model.named_parameters())
    note = next(r.note for r in report.replaced if r.path == "model.layers.0.mlp")
    assert "clamped SwiGLU" in note and f"limit={GPT_OSS_LIMIT:g}" in note, note
    assert not [item for item in report.left if "mlp" in item.path], str(report)
    fusedllm.unpatch(model)
    assert model.model.layers[0].mlp is block
