"""fusedllm.patch / unpatch on notebook-style models (testkit/notebook_models.py)
and on tiny Hugging Face models built from configs."""

import copy
import re

import pytest
import torch
from torch import nn

import fusedllm
from fusedllm.compat import nb000 as c000, nb003 as c003
from fusedllm.nn import PackedGatedMLP

from testkit import notebook_models as plain
from checks import FORWARD_TOL, GRAD_TOL, assert_close


def _perturb(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


# (id, builder, inputs builder, expected number of replacements)
NOTEBOOK_MODELS = [
    ("nb000-ModernTransformer", lambda: plain.nb000.ModernTransformer(50, 16, 2, 2, 32, 32),
     lambda: (torch.randint(0, 50, (2, 7)),), 9),
    ("nb000-PreNorm-rmsnorm", lambda: plain.nb000.PreNormTransformerBlock(16, 2, 32, norm_type="rmsnorm"),
     lambda: (torch.randn(2, 6, 16), torch.ones(6, 6).tril()), 4),
    ("nb001-OriginalBlock", lambda: plain.nb001.OriginalTransformerBlock(16, 4, 32),
     lambda: (torch.randn(2, 6, 16),), 1),
    ("nb001-ModernBlock", lambda: plain.nb001.ModernTransformerBlock(16, 4, 32),
     lambda: (torch.randn(2, 6, 16), torch.ones(6, 6).tril()), 1),
    ("nb002-Blocks", lambda: nn.Sequential(plain.nb002.PreNormBlock(16), plain.nb002.PostNormBlock(16)),
     lambda: (torch.randn(2, 6, 16),), 6),
    ("nb003-LLaMAModel", lambda: plain.nb003.LLaMAModel(plain.tiny_llama_config(plain.nb003.LLaMAConfig)),
     lambda: (torch.randint(0, 61, (2, 7)),), 9),
]


def _forward_backward(model, inputs, grad=None):
    out = model(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    grad = torch.randn_like(out) if grad is None else grad
    model.zero_grad(set_to_none=True)
    (out * grad).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, grad


@pytest.mark.parametrize("case", NOTEBOOK_MODELS, ids=[c[0] for c in NOTEBOOK_MODELS])
def test_notebook_model_patched_equals_unpatched(case):
    _, build, make_inputs, expected = case
    model = _perturb(build()).eval()
    inputs = make_inputs()
    ref_out, ref_grads, grad = _forward_backward(model, inputs)
    params_before = list(model.parameters())
    state_keys = list(model.state_dict())

    report = fusedllm.patch(model)
    assert len(report.replaced) == expected, str(report)
    assert all(a is b for a, b in zip(model.parameters(), params_before))
    assert len(list(model.parameters())) == len(params_before)
    assert list(model.state_dict()) == state_keys
    out, grads, _ = _forward_backward(model, inputs, grad)
    assert_close(out, ref_out, FORWARD_TOL[torch.float32])
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert_close(grads[name], ref_grads[name], GRAD_TOL[torch.float32])

    assert fusedllm.unpatch(model) == expected
    assert not any(type(m).__module__.startswith("fusedllm") for m in model.modules())
    out, _, _ = _forward_backward(model, inputs, grad)
    assert_close(out, ref_out, FORWARD_TOL[torch.float32])


def test_report_names_each_replacement():
    model = plain.nb003.LLaMAModel(plain.tiny_llama_config(plain.nb003.LLaMAConfig))
    report = fusedllm.patch(model, verify=True)
    by_path = {r.path: r for r in report.replaced}
    assert by_path["layers.0.attention"].original == "LLaMAGroupQueryAttention"
    assert by_path["layers.0.attention"].replacement == "fusedllm.compat.nb003.LLaMAGroupQueryAttention"
    assert by_path["layers.1.feed_forward"].replacement == "fusedllm.compat.nb003.LLaMASwiGLU"
    assert by_path["norm"].replacement == "fusedllm.nn.RMSNorm" and by_path["norm"].verified
    assert all(r.verified for r in report.replaced)
    assert isinstance(model.layers[0].attention, c003.LLaMAGroupQueryAttention)
    assert model.layers[0].attention.q_proj.weight is model.layers[0].attention.q_proj.weight
    text = str(report)
    assert "9 module(s) replaced" in text and "layers.0.ffn_norm" in text


def test_flags_choose_families_and_report_what_is_left():
    model = plain.nb000.ModernTransformer(50, 16, 1, 2, 32, 32)
    report = fusedllm.patch(model, rms_norm=False, attention=False)
    replaced = {r.path for r in report.replaced}
    # the rotary module inside the attention is replaced on its own when attention is not
    assert replaced == {"layers.0.attention.rope", "layers.0.feed_forward.ffn"}
    left = {item.path: item.reason for item in report.left}
    assert left["final_norm"] == "rms_norm=False" and left["layers.0.attention"] == "attention=False"
    assert isinstance(model.layers[0].attention.rope, c000.RotaryPositionalEmbedding)
    assert model.layers[0].attention.rope.cos_cached.data_ptr() != 0


def test_same_name_other_structure_is_left_alone():
    class RMSNorm(nn.Module):  # a norm with a bias: not the notebooks' RMSNorm
        def __init__(self, d):
            super().__init__()
            self.eps = 1e-6
            self.weight = nn.Parameter(torch.ones(d))
            self.bias = nn.Parameter(torch.zeros(d))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight + self.bias

    model = nn.Sequential(nn.Linear(8, 8), RMSNorm(8))
    report = fusedllm.patch(model)
    assert not report.replaced and type(model[1]) is RMSNorm
    assert "different structure" in report.left[0].reason


def test_verify_keeps_the_original_when_outputs_differ():
    class RMSNorm(nn.Module):  # right structure, different function (centres first)
        def __init__(self, d):
            super().__init__()
            self.eps = 1e-6
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            x = x - x.mean(-1, keepdim=True)
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    model = nn.Sequential(RMSNorm(8), plain.nb000.RMSNorm(8))
    report = fusedllm.patch(copy.deepcopy(model))
    assert len(report.replaced) == 2  # without verification the name and structure decide
    report = fusedllm.patch(model, verify=True)
    assert [r.path for r in report.replaced] == ["1"] and report.replaced[0].verified
    assert type(model[0]) is RMSNorm
    assert report.left[0].path == "0" and report.left[0].reason.startswith("verify: outputs differ")


def test_optimizer_built_before_patching_keeps_training():
    torch.manual_seed(0)
    eager = plain.nb003.LLaMAModel(plain.tiny_llama_config(plain.nb003.LLaMAConfig))
    patched = copy.deepcopy(eager)
    opt_eager = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt_patched = torch.optim.AdamW(patched.parameters(), lr=1e-2)
    fusedllm.patch(patched)
    ids = torch.randint(0, 61, (2, 8))
    for _ in range(3):
        for model, opt in ((eager, opt_eager), (patched, opt_patched)):
            opt.zero_grad()
            logits = model(ids[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
            opt.step()
    for (name, a), b in zip(eager.named_parameters(), patched.parameters()):
        assert_close(b.detach(), a.detach(), GRAD_TOL[torch.float32])
    # the trained weights are the originals' weights: unpatch keeps them
    trained = patched.norm.weight.detach().clone()
    fusedllm.unpatch(patched)
    assert torch.equal(patched.norm.weight, trained) and type(patched.norm).__name__ == "RMSNorm"


def test_patch_twice_and_root_module():
    model = plain.nb000.ModernTransformer(50, 16, 1, 2, 32, 32)
    first = fusedllm.patch(model)
    second = fusedllm.patch(model)
    assert first.replaced and not second.replaced
    assert fusedllm.unpatch(model) == len(first.replaced)
    norm = plain.nb000.RMSNorm(8)
    report = fusedllm.patch(norm)
    assert not report.replaced and "itself" in report.left[0].reason
    with pytest.raises(TypeError, match="^" + re.escape("fusedllm.patch: model must be an nn.Module, got str") + "$"):
        fusedllm.patch("not a model")


def test_unpatch_hands_back_moved_buffers():
    model = plain.nb000.ModernTransformer(50, 16, 1, 2, 32, 32)
    fusedllm.patch(model)
    model.to(torch.float64)
    fusedllm.unpatch(model)
    rope = model.layers[0].attention.rope
    # the fused tables stay float32 while patched; the original gets them back
    assert rope.cos_cached.dtype == torch.float32 and model.layers[0].attention.w_q.weight.dtype == torch.float64
    assert model(torch.randint(0, 50, (1, 4))).dtype == torch.float64


# --- Hugging Face -------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")

_COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _hf(kind):
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_COMMON))
    if kind == "gemma":
        return transformers.GemmaForCausalLM(transformers.GemmaConfig(**_COMMON, head_dim=8))
    if kind == "phi3":
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(**_COMMON))
    if kind == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**_COMMON))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_COMMON))


EXPECTED_HF = {
    "llama": ("fusedllm.nn.GatedMLP", "silu", None),
    "gemma": ("fusedllm.nn.GatedMLP", "gelu_tanh", "gemma"),
    "phi3": ("fusedllm.nn.PackedGatedMLP", "silu", None),
    "mistral": ("fusedllm.nn.GatedMLP", "silu", None),
    "qwen2": ("fusedllm.nn.GatedMLP", "silu", None),
}


@pytest.mark.parametrize("kind", list(EXPECTED_HF))
def test_hf_patched_equals_unpatched(kind):
    torch.manual_seed(0)
    model = _perturb(_hf(kind)).eval()
    ids = torch.randint(3, 64, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, -3:] = 0  # right padding in the second sequence

    def run(grad=None):
        out = model(input_ids=ids, attention_mask=mask).logits
        return _forward_backward_logits(model, out, grad)

    ref_out, ref_grads, grad = run()
    params_before = list(model.parameters())
    previous = model.config._attn_implementation
    report = fusedllm.patch(model, verify=True)
    mlp_cls, activation, casting = EXPECTED_HF[kind]
    assert report.count() == 7 and report.count(mlp_cls) == 2, str(report)
    assert all(r.verified for r in report.replaced) and not report.left
    assert model.config._attn_implementation == "fusedllm" and "fusedllm" in report.attention
    layer = model.model.layers[0]
    assert layer.mlp.activation == activation
    if casting:
        assert layer.input_layernorm.casting == "gemma" and layer.input_layernorm.offset == 1.0
    assert all(a is b for a, b in zip(model.parameters(), params_before))
    out, grads, _ = run(grad)
    keep = mask.bool()  # padded positions are not compared (eager averages them, fused gives zeros)
    assert_close(out[keep], ref_out[keep], (2e-5, 2e-5))
    for name in grads:
        assert_close(grads[name], ref_grads[name], GRAD_TOL[torch.float32])

    fusedllm.unpatch(model)
    assert model.config._attn_implementation == previous
    assert not any(type(m).__module__.startswith("fusedllm") for m in model.modules())
    out, _, _ = run(grad)
    assert_close(out, ref_out, FORWARD_TOL[torch.float32])


def _forward_backward_logits(model, out, grad):
    grad = torch.randn_like(out) if grad is None else grad
    model.zero_grad(set_to_none=True)
    (out * grad).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, grad


def test_hf_flags_and_unsupported_activation():
    model = _hf("llama")
    model.model.layers[0].mlp.act_fn = nn.ReLU()  # no fused kernel for a ReLU gate
    report = fusedllm.patch(model, attention=False, rms_norm=False)
    assert model.config._attn_implementation != "fusedllm" and not report.attention
    assert [r.path for r in report.replaced] == ["model.layers.1.mlp"]
    reasons = {item.path: item.reason for item in report.left}
    assert "ReLU has no fused kernel" in reasons["model.layers.0.mlp"]
    assert reasons["model.norm"] == "rms_norm=False"


def test_packed_gated_mlp_matches_phi3_layout():
    mlp = PackedGatedMLP(16, 24)
    x = torch.randn(3, 16)
    gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
    assert_close(mlp(x), mlp.down_proj(torch.nn.functional.silu(gate) * up), FORWARD_TOL[torch.float32])
    with pytest.raises(ValueError, match="^" + re.escape(
            "fusedllm.nn.PackedGatedMLP: activation must be one of ('silu', 'gelu_tanh'), got 'relu'") + "$"):
        PackedGatedMLP(16, 24, activation="relu")


def _hf_on(device):
    torch.manual_seed(0)
    with torch.device(device):
        return _hf("llama")


def _patch_off_the_cpu_checks(model, device_type):
    previous = model.config._attn_implementation
    report = fusedllm.patch(model)
    # norms and gated MLPs are fused; attention stays the model's own, and says why
    assert report.count() == 7 and report.count("GatedMLP") == 2, str(report)
    assert model.config._attn_implementation == previous
    assert report.attention.startswith(f"left as {previous!r}: left on {device_type} by default")
    assert "0.10-0.16x SDPA" in report.attention and "attention=True" in report.attention
    fusedllm.unpatch(model)
    report = fusedllm.patch(model, attention=True)
    assert model.config._attn_implementation == "fusedllm", str(report)
    fusedllm.unpatch(model)


def test_patch_leaves_attention_on_other_devices_by_default():
    """Off the CPU (here a model on the meta device) the families fusedllm is not
    yet faster at are left unless asked for; on the CPU they are fused."""
    _patch_off_the_cpu_checks(_hf_on("meta"), "meta")
    model = _hf_on("cpu")
    fusedllm.patch(model)
    assert model.config._attn_implementation == "fusedllm"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_patch_on_a_gpu_keeps_the_models_attention_and_its_outputs():
    model = _hf_on("cuda").eval()
    ids = torch.randint(3, 64, (2, 9), device="cuda")
    with torch.no_grad():
        want = model(input_ids=ids).logits
    _patch_off_the_cpu_checks(model, "cuda")
    fusedllm.patch(model)
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert_close(got, want, (2e-5, 2e-5))
