"""fusedllm.hf: the "fusedllm" attention backend inside transformers' Llama,
Mistral (sliding window) and Qwen2 (qkv bias) models, against their "eager"
attention: logits, gradients, padding, cached greedy generation; and the
attention function itself against F.scaled_dot_product_attention."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import fusedllm.hf  # noqa: E402  (registers "fusedllm")
from fusedllm.hf import attention_forward  # noqa: E402
from testkit.hf import cache_keyword  # noqa: E402

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)


def llama():
    return transformers.LlamaForCausalLM, transformers.LlamaConfig(**SMALL)


def mistral(window=4):
    return transformers.MistralForCausalLM, transformers.MistralConfig(**SMALL, sliding_window=window)


def qwen2():
    return transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**SMALL)


MODELS = {"llama": llama, "mistral_window4": mistral, "qwen2_bias": qwen2}


def set_attention(model, name):
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # releases before set_attn_implementation read the config at call time
        model.config._attn_implementation = name
    assert model.config._attn_implementation == name


def build(kind, device):
    cls, config = MODELS[kind]()
    torch.manual_seed(0)
    model = cls(config).to(device).eval()
    if kind == "qwen2_bias":
        # HF initializes biases to zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model


def left_padded(device, batch=3, seq=14, pads=(0, 5, 9)):
    torch.manual_seed(1)
    ids = torch.randint(3, SMALL["vocab_size"], (batch, seq), device=device)
    mask = torch.ones(batch, seq, dtype=torch.long, device=device)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids, mask


@pytest.mark.parametrize("kind", MODELS)
def test_logits_and_gradients_match_eager(device, kind):
    model = build(kind, device)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 16), device=device)  # longer than the window
    results = {}
    for name in ("eager", "fusedllm"):
        set_attention(model, name)
        model.zero_grad()
        out = model(ids, labels=ids)
        out.loss.backward()
        results[name] = (out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (logits_e, grads_e), (logits_f, grads_f) = results["eager"], results["fusedllm"]
    torch.testing.assert_close(logits_f, logits_e, atol=1e-5, rtol=1e-5)
    for name, grad in grads_e.items():
        torch.testing.assert_close(grads_f[name], grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_sliding_window_changes_the_result_and_matches_eager(device):
    windowed = build("mistral_window4", device)
    cls, config = mistral(window=None)
    full = cls(config).to(device).eval()
    full.load_state_dict(windowed.state_dict())
    ids = torch.randint(0, SMALL["vocab_size"], (1, 12), device=device)
    with torch.no_grad():
        outs = {}
        for model, tag in ((windowed, "w"), (full, "full")):
            for name in ("eager", "fusedllm"):
                set_attention(model, name)
                outs[tag, name] = model(ids).logits
    torch.testing.assert_close(outs["w", "fusedllm"], outs["w", "eager"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs["full", "fusedllm"], outs["full", "eager"], atol=1e-5, rtol=1e-5)
    # positions within the window agree; past it the window must change the logits
    torch.testing.assert_close(outs["w", "fusedllm"][:, :4], outs["full", "fusedllm"][:, :4])
    assert (outs["w", "fusedllm"][:, 4:] - outs["full", "fusedllm"][:, 4:]).abs().max() > 1e-3


@pytest.mark.parametrize("kind", MODELS)
def test_left_padded_batch_matches_eager_on_real_tokens(device, kind):
    model = build(kind, device)
    ids, mask = left_padded(device)
    with torch.no_grad():
        logits = {}
        for name in ("eager", "fusedllm"):
            set_attention(model, name)
            logits[name] = model(ids, attention_mask=mask).logits
        # the same sample alone, without padding: RoPE is relative, so equal logits
        alone = model(ids[2:, 9:]).logits
    real = mask.bool()
    torch.testing.assert_close(logits["fusedllm"][real], logits["eager"][real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits["fusedllm"][2, 9:], alone[0], atol=1e-4, rtol=1e-4)
    assert torch.isfinite(logits["fusedllm"]).all()


@pytest.mark.parametrize("kind", MODELS)
def test_greedy_generate_with_cache_matches_eager(device, kind):
    model = build(kind, device)
    ids, mask = left_padded(device)
    outputs = {}
    for name in ("eager", "fusedllm"):
        set_attention(model, name)
        outputs[name] = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                       pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(outputs["fusedllm"].sequences, outputs["eager"].sequences)
    for a, b in zip(outputs["fusedllm"].logits, outputs["eager"].logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "mistral_window4"])
def test_decoding_with_cache_matches_full_forward(device, kind):
    model = build(kind, device)
    set_attention(model, "fusedllm")
    ids = torch.randint(0, SMALL["vocab_size"], (2, 11), device=device)
    keyword = cache_keyword(model)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :6], use_cache=True)
        steps, past = [out.logits], getattr(out, keyword)
        for i in range(6, 11):
            out = model(ids[:, i:i + 1], use_cache=True, **{keyword: past})
            steps.append(out.logits)
            past = getattr(out, keyword)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_attn_implementation_at_from_config(device):
    cls, config = llama()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="fusedllm").to(device)
    assert model.config._attn_implementation == "fusedllm"
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return attention_forward(*args, **kwargs)

    transformers.AttentionInterface.register("fusedllm", spy)
    try:
        with torch.no_grad():
            fused = model(torch.randint(0, 128, (1, 7), device=device)).logits
    finally:
        fusedllm.hf.register()
    assert len(calls) == SMALL["num_hidden_layers"]
    assert transformers.AttentionInterface._global_mapping["fusedllm"] is attention_forward
    assert fused.shape == (1, 7, 128)


@pytest.mark.skipif(not hasattr(transformers.PreTrainedModel, "set_attn_implementation"),
                    reason="this transformers has no set_attn_implementation")
def test_set_attn_implementation_switches_an_existing_model():
    model = build("llama", "cpu")
    model.set_attn_implementation("fusedllm")
    assert model.config._attn_implementation == "fusedllm"
    assert all(layer.self_attn.config._attn_implementation == "fusedllm" for layer in model.model.layers)


def test_dropout_in_training_only():
    cls, config = llama()
    config.attention_dropout = 0.5
    torch.manual_seed(0)
    model = cls(config)
    set_attention(model, "fusedllm")
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        model.eval()
        a, b = model(ids).logits, model(ids).logits
        model.train()
        torch.manual_seed(5)
        c = model(ids).logits
        torch.manual_seed(5)
        d = model(ids).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(c, d, rtol=0, atol=0)
    assert (c - a).abs().max() > 1e-3


def test_register_is_idempotent_and_registers_a_mask_builder():
    fusedllm.hf.register()
    fusedllm.hf.register()
    assert transformers.AttentionInterface._global_mapping["fusedllm"] is attention_forward
    masking = pytest.importorskip("transformers.masking_utils")
    assert (masking.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["fusedllm"]
            is masking.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["sdpa"])


def test_import_fusedllm_does_not_import_transformers():
    code = "import sys, fusedllm; assert 'transformers' not in sys.modules, 'imported'"
    env = dict(os.environ)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# `import fusedllm` alone (never fusedllm.hf) in a fresh interpreter, transformers imported
# after it or before it: a Llama built with attn_implementation="fusedllm" runs fusedllm's
# attention with transformers' masks, and a left-padded batch matches the eager model on
# the real tokens (without the registered mask builder the padding would be ignored).
PLAIN_IMPORT_FIRST = "import sys, fusedllm; assert 'transformers' not in sys.modules\nimport transformers"
PLAIN_IMPORT_LAST = ("import sys, transformers, transformers.modeling_utils, fusedllm\n"
                     "assert 'fusedllm.hf' in sys.modules")
PLAIN_IMPORT_MODEL = """
    import copy, sys, torch
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      attn_implementation="fusedllm")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert model.config._attn_implementation == "fusedllm"
    assert transformers.AttentionInterface._global_mapping["fusedllm"] is sys.modules["fusedllm.hf"].attention_forward
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    ids = torch.randint(3, 128, (2, 11))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :4] = 0
    with torch.no_grad():
        fused, reference = (m(ids, attention_mask=mask).logits for m in (model, eager))
    real = mask.bool()
    torch.testing.assert_close(fused[real], reference[real], rtol=1e-4, atol=1e-4)
    print("max diff", (fused[real] - reference[real]).abs().max().item())
"""


@pytest.mark.parametrize("imports", [PLAIN_IMPORT_FIRST, PLAIN_IMPORT_LAST], ids=["transformers_after",
                                                                                 "transformers_before"])
def test_plain_import_fusedllm_registers_the_backend(imports):
    from checks import run_python

    res = run_python(imports, PLAIN_IMPORT_MODEL, FUSEDLLM_REQUIRE_EXTENSION="1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "max diff" in res.stdout


# --- the attention function against SDPA ------------------------------------------------------

class Module(torch.nn.Module):
    def __init__(self, is_causal=True):
        super().__init__()
        self.is_causal = is_causal


def qkv(q_len=6, kv_len=6, batch=2, hq=4, hkv=2, d=8, device="cpu"):
    return (torch.randn(batch, hq, q_len, d, device=device), torch.randn(batch, hkv, kv_len, d, device=device),
            torch.randn(batch, hkv, kv_len, d, device=device))


def sdpa(q, k, v, **kwargs):
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), **kwargs)
    return out.transpose(1, 2)


def test_function_without_mask_is_causal_by_module_or_argument(device):
    q, k, v = qkv(device=device)
    out, weights = attention_forward(Module(), q, k, v, None, scaling=0.3)
    assert weights is None and out.shape == (2, 6, 4, 8) and out.is_contiguous()
    torch.testing.assert_close(out, sdpa(q, k, v, is_causal=True, scale=0.3))
    out, _ = attention_forward(Module(is_causal=False), q, k, v, None)
    torch.testing.assert_close(out, sdpa(q, k, v))
    out, _ = attention_forward(Module(), q, k, v, None, is_causal=False)
    torch.testing.assert_close(out, sdpa(q, k, v))


def test_function_without_mask_and_more_keys_aligns_like_sdpa(device):
    # the mask builders leave the mask out for a prefill into an empty static cache only
    q, k, v = qkv(q_len=4, kv_len=9, device=device)
    out, _ = attention_forward(Module(), q, k, v, None)
    torch.testing.assert_close(out, sdpa(q, k, v, is_causal=True))
    q1 = q[:, :, :1]  # one decoded token sees every key
    out, _ = attention_forward(Module(), q1, k, v, None)
    torch.testing.assert_close(out, sdpa(q1, k, v))


def test_function_with_masks_matches_sdpa(device):
    q, k, v = qkv(q_len=5, kv_len=8, device=device)
    keep = torch.rand(2, 1, 5, 8, device=device) > 0.3
    keep[..., -1] = True  # no empty rows, where SDPA gives NaN
    bias = torch.randn(2, 1, 5, 8, device=device).masked_fill(~keep, torch.finfo(torch.float32).min)
    for mask in (keep, bias):
        # the mask alone decides, whatever module.is_causal says
        out, _ = attention_forward(Module(), q, k, v, mask, scaling=0.5)
        torch.testing.assert_close(out, sdpa(q, k, v, attn_mask=mask, scale=0.5))
    # a mask longer than the keys (static cache) is cut to them
    longer = torch.cat([keep, torch.ones(2, 1, 5, 3, dtype=torch.bool, device=device)], -1)
    out, _ = attention_forward(Module(), q, k, v, longer)
    torch.testing.assert_close(out, sdpa(q, k, v, attn_mask=keep))


def test_function_sliding_window_without_mask_matches_hf_mask(device):
    q, k, v = qkv(q_len=7, kv_len=7, device=device)
    pos = torch.arange(7, device=device)
    window_mask = (pos[None] <= pos[:, None]) & (pos[None] > pos[:, None] - 3)
    out, _ = attention_forward(Module(), q, k, v, None, sliding_window=3)
    torch.testing.assert_close(out, sdpa(q, k, v, attn_mask=window_mask))
    # with a mask, the window is already in it: sliding_window is not applied twice
    out, _ = attention_forward(Module(), q, k, v, window_mask[None, None].expand(2, 1, 7, 7), sliding_window=3)
    torch.testing.assert_close(out, sdpa(q, k, v, attn_mask=window_mask))


def test_function_rows_without_keys_are_zero():
    q, k, v = qkv()
    keep = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    keep[1, :, :, :2] = False  # sample 1: two pad tokens on the left
    out, _ = attention_forward(Module(), q, k, v, keep)
    assert torch.isfinite(out).all() and torch.all(out[1, :2] == 0)


def test_function_refuses_what_it_cannot_do():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="does not support position_bias"):
        attention_forward(Module(), q, k, v, None, position_bias=torch.zeros(1))


def test_function_rejects_a_2d_mask():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="attention_mask must be 4-D"):
        attention_forward(Module(), q, k, v, torch.ones(2, 6, dtype=torch.bool))
