"""fusedllm.hf with the attention options: Gemma 2 (soft-capped logits,
sliding layers), Gemma 3 text (global and sliding layers, q/k norms), OLMo 2
(q/k norms over all heads) and gpt-oss (attention sinks, sliding layers,
biases) against their "eager" attention, patched and unpatched; packed
sequences (DataCollatorWithFlattening) on attention_varlen against padded
batches; the packed-sequence arguments' checks."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fusedllm  # noqa: E402
import fusedllm.functional  # noqa: E402
import fusedllm.hf  # noqa: E402  (registers "fusedllm")
from fusedllm.hf import attention_forward  # noqa: E402

from checks import GRAD_TOL, assert_close  # noqa: E402
from test_hf_attention import SMALL, Module, left_padded, qkv, set_attention  # noqa: E402
from test_patch import _forward_backward_logits, _perturb  # noqa: E402

TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
SLIDING = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2)
LAYERS = dict(SMALL, num_hidden_layers=4, head_dim=16, **TOKENS)


def gemma2():
    config = transformers.Gemma2Config(**LAYERS, **SLIDING, attn_logit_softcapping=1.0,
                                       final_logit_softcapping=5.0, query_pre_attn_scalar=16)
    return transformers.Gemma2ForCausalLM, config


def gemma3():
    return transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(**LAYERS, **SLIDING)


def olmo2():
    return transformers.Olmo2ForCausalLM, transformers.Olmo2Config(**LAYERS)


def gpt_oss():
    config = transformers.GptOssConfig(**LAYERS, **SLIDING, num_local_experts=4, num_experts_per_tok=2,
                                       attention_bias=True)
    return transformers.GptOssForCausalLM, config


MODELS = {"gemma2_softcap": gemma2, "gemma3_text": gemma3, "olmo2": olmo2, "gpt_oss_sinks": gpt_oss}


def build(kind, device="cpu"):
    cls, config = MODELS[kind]()
    torch.manual_seed(0)
    model = _perturb(cls(config)).to(device).eval()
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "q_proj"):
                # larger scores, so soft-capping and the sinks change the result
                module.q_proj.weight.mul_(8.0)
                if getattr(module, "sinks", None) is not None:
                    module.sinks.normal_(0.0, 1.0)
    return model


def logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(actual, expected):
    assert actual.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(actual[name], grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", MODELS)
def test_logits_and_gradients_match_eager(device, kind):
    model = build(kind, device)
    ids = torch.randint(3, SMALL["vocab_size"], (2, 13), device=device)  # longer than the window
    results = {}
    for name in ("eager", "fusedllm"):
        set_attention(model, name)
        results[name] = logits_and_grads(model, ids)
    torch.testing.assert_close(results["fusedllm"][0], results["eager"][0], atol=1e-5, rtol=1e-5)
    assert_grads_close(results["fusedllm"][1], results["eager"][1])


@pytest.mark.parametrize("kind", MODELS)
def test_left_padded_batch_and_greedy_generate_match_eager(kind):
    model = build(kind)
    ids, mask = left_padded("cpu")
    outputs, logits = {}, {}
    for name in ("eager", "fusedllm"):
        set_attention(model, name)
        with torch.no_grad():
            logits[name] = model(ids, attention_mask=mask).logits
        outputs[name] = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                       pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    real = mask.bool()
    torch.testing.assert_close(logits["fusedllm"][real], logits["eager"][real], atol=1e-5, rtol=1e-5)
    assert torch.equal(outputs["fusedllm"].sequences, outputs["eager"].sequences)
    for a, b in zip(outputs["fusedllm"].logits, outputs["eager"].logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_softcap_and_sinks_change_the_result():
    ids = torch.randint(3, SMALL["vocab_size"], (1, 10))
    with torch.no_grad():
        capped, uncapped = build("gemma2_softcap"), build("gemma2_softcap")
        for module in uncapped.modules():
            if hasattr(module, "attn_logit_softcapping"):
                module.attn_logit_softcapping = None
        gpt, no_sinks = build("gpt_oss_sinks"), build("gpt_oss_sinks")
        for module in no_sinks.modules():
            if getattr(module, "sinks", None) is not None:
                module.sinks.fill_(-1e4)  # a sink that never takes probability
        out = {}
        for tag, model in (("capped", capped), ("uncapped", uncapped), ("sinks", gpt), ("no_sinks", no_sinks)):
            set_attention(model, "fusedllm")
            out[tag] = model(ids).logits
    assert (out["capped"] - out["uncapped"]).abs().max() > 1e-3
    assert (out["sinks"] - out["no_sinks"]).abs().max() > 1e-3


# what patch() replaces in each model (4 layers), and what it leaves
EXPECTED_PATCH = {
    # 4 norms a layer (input, post-attention, pre- and post-feedforward), the final norm, the MLPs
    "gemma2_softcap": {"fusedllm.nn.RMSNorm": 17, "fusedllm.nn.GatedMLP": 4},
    # and the q/k norms (over head_dim)
    "gemma3_text": {"fusedllm.nn.RMSNorm": 25, "fusedllm.nn.GatedMLP": 4},
    # post-attention, post-feedforward, q and k norms (over all heads' projections), the final norm
    "olmo2": {"fusedllm.nn.RMSNorm": 17, "fusedllm.nn.GatedMLP": 4},
    # input and post-attention norms, the final norm, the MoE MLPs
    "gpt_oss_sinks": {"fusedllm.nn.RMSNorm": 9, "fusedllm.hf_moe.FusedGptOssMLP": 4},
}


@pytest.mark.parametrize("kind", MODELS)
def test_patched_equals_unpatched_eager(kind):
    model = build(kind)
    set_attention(model, "eager")
    ids, mask = left_padded("cpu")
    keep = mask.bool()

    # left-padded queries see no key: fused gives zeros where eager averages, so no gradient from them
    grad = torch.randn(*ids.shape, SMALL["vocab_size"]) * keep[..., None]

    def run():
        return _forward_backward_logits(model, model(ids, attention_mask=mask).logits, grad)

    def greedy():
        return model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)

    ref_out, ref_grads, _ = run()
    ref_tokens = greedy()
    params_before = list(model.parameters())
    report = fusedllm.patch(model, verify=True)
    expected = EXPECTED_PATCH[kind]
    assert report.count() == sum(expected.values()), str(report)
    for replacement, count in expected.items():
        assert report.count(replacement) == count, str(report)
    assert all(r.verified for r in report.replaced), str(report)
    assert model.config._attn_implementation == "fusedllm" and report.attention == "'eager' -> 'fusedllm'"
    assert not report.left, str(report)
    assert all(a is b for a, b in zip(model.parameters(), params_before))
    out, grads, _ = run()
    assert_close(out[keep], ref_out[keep], (2e-5, 2e-5))
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert_close(grads[name], ref_grads[name], GRAD_TOL[torch.float32], what=name)
    assert torch.equal(greedy(), ref_tokens)

    fusedllm.unpatch(model)
    assert model.config._attn_implementation == "eager"
    assert not any(type(m).__module__.startswith("fusedllm") for m in model.modules())


def test_olmo2_qk_norms_are_fused_over_all_heads():
    model = build("olmo2")
    report = fusedllm.patch(model)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_norm, fusedllm.nn.RMSNorm) and isinstance(attn.k_norm, fusedllm.nn.RMSNorm)
    assert attn.q_norm.dim == 4 * 16 and attn.k_norm.dim == 2 * 16 and attn.q_norm.casting == "gemma"
    assert attn.q_norm.offset == 0.0 and "fusedllm" in report.attention


def test_norm_weights_of_another_dtype_are_left():
    # gpt-oss loaded in float16 keeps these norms in float32 (_keep_in_fp32_modules)
    model = build("gpt_oss_sinks").to(torch.float16)
    for layer in model.model.layers:
        layer.input_layernorm.float()
    report = fusedllm.patch(model)
    left = {item.path: item.reason for item in report.left}
    assert "torch.float32 but the model computes in torch.float16" in left["model.layers.0.input_layernorm"]
    assert type(model.model.layers[0].input_layernorm).__name__ == "GptOssRMSNorm"
    assert isinstance(model.model.layers[0].post_attention_layernorm, fusedllm.nn.RMSNorm)


# --- packed sequences -------------------------------------------------------------------------

LENGTHS = (5, 9, 4)


def sequences(lengths=LENGTHS):
    torch.manual_seed(3)
    return [torch.randint(3, SMALL["vocab_size"], (n,)) for n in lengths]


def padded_batch(seqs, device):
    """The sequences right-padded, their labels -100 on the padding."""
    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(seqs):
        ids[row, :len(s)], mask[row, :len(s)] = s, 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def packed_batch(seqs, device, flash_kwargs=False):
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    batch = collator([{"input_ids": s.tolist()} for s in seqs])
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@pytest.fixture
def varlen_calls(monkeypatch):
    calls = []
    varlen = fusedllm.functional.attention_varlen

    def spy(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, **kwargs):
        calls.append(cu_seqlens_q.tolist())
        return varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, **kwargs)

    monkeypatch.setattr(fusedllm.functional, "attention_varlen", spy)
    return calls


def llama(device):
    cls, config = transformers.LlamaForCausalLM, transformers.LlamaConfig(**SMALL, **TOKENS)
    torch.manual_seed(0)
    return _perturb(cls(config)).to(device).train()


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_packed_training_equals_padded_and_runs_varlen(device, varlen_calls, flash_kwargs):
    model = llama(device)
    set_attention(model, "fusedllm")
    seqs = sequences()
    batch = packed_batch(seqs, device, flash_kwargs)
    assert batch["input_ids"].shape == (1, sum(LENGTHS))
    assert batch["position_ids"][0].tolist() == [i for n in LENGTHS for i in range(n)]
    if flash_kwargs:
        assert batch["cu_seq_lens_q"].tolist() == [0, 5, 14, 18] and batch["max_length_q"] == 9

    model.zero_grad(set_to_none=True)
    packed = model(**batch)
    packed.loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert varlen_calls == [[0, 5, 14, 18]] * SMALL["num_hidden_layers"]

    model.zero_grad(set_to_none=True)
    padded = model(**padded_batch(seqs, device))
    padded.loss.backward()
    assert len(varlen_calls) == SMALL["num_hidden_layers"]  # the padded batch runs dense
    torch.testing.assert_close(packed.loss, padded.loss, atol=1e-5, rtol=1e-5)
    assert_grads_close(packed_grads, {n: p.grad for n, p in model.named_parameters()})
    # and the logits of each sequence are those of the padded row
    starts = [0, 5, 14]
    for row, (start, n) in enumerate(zip(starts, LENGTHS)):
        torch.testing.assert_close(packed.logits[0, start:start + n], padded.logits[row, :n], atol=1e-5, rtol=1e-5)


def test_packed_training_equals_eager_packed(varlen_calls):
    # eager separates packed sequences through transformers' block-diagonal
    # mask (built only without a cache); fusedllm runs the varlen kernel
    model = llama("cpu")
    batch = packed_batch(sequences(), "cpu")
    results = {}
    for name in ("eager", "fusedllm"):
        set_attention(model, name)
        model.zero_grad(set_to_none=True)
        out = model(**batch, use_cache=False)
        out.loss.backward()
        results[name] = out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    assert len(varlen_calls) == SMALL["num_hidden_layers"]
    torch.testing.assert_close(results["fusedllm"][0], results["eager"][0], atol=1e-5, rtol=1e-5)
    assert_grads_close(results["fusedllm"][1], results["eager"][1])


def test_packed_dropout_in_training_only(varlen_calls):
    model = llama("cpu")
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    set_attention(model, "fusedllm")
    batch = packed_batch(sequences(), "cpu")
    batch.pop("labels")
    with torch.no_grad():
        torch.manual_seed(5)
        a = model(**batch).logits
        torch.manual_seed(5)
        b = model(**batch).logits
        model.eval()
        c = model(**batch).logits
    assert len(varlen_calls) == 3 * SMALL["num_hidden_layers"]
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (a - c).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["gemma2_softcap", "gpt_oss_sinks"])
def test_packed_rows_with_windows_softcap_and_sinks_equal_each_sequence_alone(kind, varlen_calls):
    # sequences longer than the sliding window; gpt-oss's mask builders never
    # see position ids, so there eager would attend across the sequences
    model = build(kind)
    set_attention(model, "fusedllm")
    seqs = sequences((7, 3, 10))
    batch = packed_batch(seqs, "cpu")
    with torch.no_grad():
        packed = model(batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        set_attention(model, "eager")
        alone = [model(s[None]).logits[0] for s in seqs]
    assert len(varlen_calls) == 4
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=1e-5)


def test_packed_row_with_padding_runs_dense_under_the_mask(varlen_calls):
    # restarting positions in a row that also holds padding: transformers'
    # mask (causal over the whole row, padding hidden) decides, as in eager
    model = llama("cpu").eval()
    ids = torch.randint(3, SMALL["vocab_size"], (1, 12))
    mask = torch.ones(1, 12, dtype=torch.long)
    mask[0, -3:] = 0
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 0, 0]])
    with torch.no_grad():
        logits = {}
        for name in ("eager", "fusedllm"):
            set_attention(model, name)
            logits[name] = model(ids, attention_mask=mask, position_ids=positions).logits
    assert not varlen_calls
    torch.testing.assert_close(logits["fusedllm"][0, :9], logits["eager"][0, :9], atol=1e-5, rtol=1e-5)


# --- the function's packed-sequence arguments ---------------------------------------------------

def test_function_explicit_cu_seq_lens_equal_each_sequence_alone(device):
    q, k, v = qkv(q_len=11, kv_len=11, batch=1, device=device)
    cu = torch.tensor([0, 4, 11], dtype=torch.int32, device=device)
    sinks = torch.randn(4, device=device)
    out, weights = attention_forward(Module(), q, k, v, None, scaling=0.4, sliding_window=3, softcap=2.0,
                                     s_aux=sinks, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7,
                                     max_length_k=7)
    assert weights is None and out.shape == (1, 11, 4, 8) and out.is_contiguous()
    for start, end in ((0, 4), (4, 11)):
        alone, _ = attention_forward(Module(), q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], None,
                                     scaling=0.4, sliding_window=3, softcap=2.0, s_aux=sinks)
        torch.testing.assert_close(out[:, start:end], alone)


@pytest.mark.parametrize("kwargs,message", [
    ({"cu_seq_lens_q": torch.tensor([0, 6], dtype=torch.int32)}, "cu_seq_lens_k is missing"),
    ({"cu_seq_lens_q": torch.tensor([0, 5], dtype=torch.int32), "cu_seq_lens_k": torch.tensor([0, 5])},
     "cu_seq_lens_q must run from 0 to the 6 flattened tokens"),
    ({"cu_seq_lens_q": torch.tensor([[0, 6]]), "cu_seq_lens_k": torch.tensor([0, 6])},
     "cu_seq_lens_q must be a 1-D integer tensor"),
    ({"cu_seq_lens_q": [0, 6], "cu_seq_lens_k": torch.tensor([0, 6])}, "cu_seq_lens_q must be a 1-D integer"),
    ({"cu_seq_lens_q": torch.tensor([0, 2, 6]), "cu_seq_lens_k": torch.tensor([0, 6])},
     "same number of sequences"),
    ({"max_length_q": 6}, "without cu_seq_lens_q and cu_seq_lens_k"),
    ({"cu_seq_lens_q": torch.tensor([0, 6]), "cu_seq_lens_k": torch.tensor([0, 6]), "max_length_k": 2.5},
     "max_length_k must be an int"),
    ({"position_bias": torch.zeros(1)}, "does not support position_bias"),
])
def test_function_refuses_bad_packed_arguments(kwargs, message):
    q, k, v = qkv(batch=1)
    with pytest.raises(ValueError, match=message):
        attention_forward(Module(), q, k, v, None, **kwargs)


def test_function_refuses_cu_seq_lens_with_padding():
    q, k, v = qkv(batch=1)
    keep = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    keep[..., :2] = False  # two padding tokens
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="attention mask hides padding tokens"):
        attention_forward(Module(), q, k, v, keep, cu_seq_lens_q=cu, cu_seq_lens_k=cu)


def packed_positions_and_mask():
    """Positions of two sequences (3 and 4 tokens) in one row, and their
    block-diagonal causal keep-mask [1, 1, 7, 7]."""
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    same = torch.zeros(7, 7, dtype=torch.bool)
    same[:3, :3] = same[3:, 3:] = True
    return positions, (same & torch.ones(7, 7, dtype=torch.bool).tril())[None, None]


def test_function_restarting_positions_without_padding_run_varlen(varlen_calls):
    q, k, v = qkv(q_len=7, kv_len=7, batch=1)
    positions, block = packed_positions_and_mask()
    dense, _ = attention_forward(Module(), q, k, v, block)
    assert not varlen_calls  # no positions: the mask alone
    for mask in (None, block):
        out, _ = attention_forward(Module(), q, k, v, mask, position_ids=positions)
        torch.testing.assert_close(out, dense)
    assert varlen_calls == [[0, 3, 7]] * 2
    # non-causal attention, a batch of two, or a decoding step never read positions as packing
    attention_forward(Module(is_causal=False), q, k, v, None, position_ids=positions)
    q2, k2, v2 = qkv(q_len=7, kv_len=7, batch=2)
    attention_forward(Module(), q2, k2, v2, None, position_ids=positions.expand(2, -1))
    attention_forward(Module(), q[:, :, -1:], k, v, None, position_ids=positions[:, -1:])
    assert len(varlen_calls) == 2



@pytest.mark.slow
def test_compiled_function_with_positions_runs_dense_fullgraph(varlen_calls):
    # positions are not read under torch.compile: the mask (here the packed
    # rows' block-diagonal one) decides, with no graph break
    q, k, v = qkv(q_len=7, kv_len=7, batch=1)
    positions, block = packed_positions_and_mask()
    compiled = torch.compile(lambda *args: attention_forward(Module(), *args, position_ids=positions)[0],
                             fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, block), attention_forward(Module(), q, k, v, block)[0])
    assert not varlen_calls
