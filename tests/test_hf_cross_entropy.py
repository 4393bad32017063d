"""patch(model, cross_entropy=True): Hugging Face causal LMs compute their
training loss with fusedllm.linear_cross_entropy, without the logits."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fusedllm  # noqa: E402
from fusedllm import hf_loss  # noqa: E402

VOCAB = 97
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _config(model_type):
    c = transformers
    if model_type == "llama":
        return c.LlamaConfig(**COMMON)
    if model_type == "mistral":
        return c.MistralConfig(**COMMON)
    if model_type == "qwen2":
        return c.Qwen2Config(**COMMON)
    if model_type == "qwen3":
        return c.Qwen3Config(**COMMON, head_dim=8)
    if model_type == "gemma2":
        return c.Gemma2Config(**COMMON, head_dim=8, final_logit_softcapping=5.0)
    if model_type == "gemma3_text":
        return c.Gemma3TextConfig(**COMMON, head_dim=8, final_logit_softcapping=5.0)
    if model_type == "phi3":
        return c.Phi3Config(**COMMON, pad_token_id=0)
    raise AssertionError(model_type)


MODEL_TYPES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"]


def make_model(model_type):
    torch.manual_seed(0)
    config = _config(model_type)
    config._attn_implementation = "eager"
    return transformers.AutoModelForCausalLM.from_config(config).train()


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 11), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def loss_and_grads(model, ids, labels, **kwargs):
    model.zero_grad()
    out = model(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_patched_loss_and_gradients_equal_unpatched(model_type):
    model = make_model(model_type)
    fused = copy.deepcopy(model)
    assert fusedllm.patch(fused, cross_entropy=True, rms_norm=False, swiglu=False, rope=False,
                          attention=False, parallel=False).loss.startswith("fused")
    ids, labels = batch()
    ref, ref_grads = loss_and_grads(model, ids, labels)
    out, grads = loss_and_grads(fused, ids, labels)
    assert out.logits is None, "training with labels builds no logits"
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_loss_keywords_and_kept_logits():
    model = make_model("gemma2")
    fused = copy.deepcopy(model)
    fusedllm.patch(fused, cross_entropy=True)
    ids, labels = batch(1)
    shift = torch.roll(labels, -1, dims=1)
    shift[:, -1] = -100
    for kwargs in (dict(num_items_in_batch=torch.tensor(7)), dict(shift_labels=shift),
                   dict(logits_to_keep=4)):
        # with logits_to_keep, transformers takes the labels of the kept positions
        lab = labels[:, -4:] if "logits_to_keep" in kwargs else labels
        ref, ref_grads = loss_and_grads(model, ids, lab, **kwargs)
        out, grads = loss_and_grads(fused, ids, lab, **kwargs)
        torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5, msg=str(kwargs))
        for name in grads:
            torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-4)
        if "logits_to_keep" in kwargs:
            torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)


def test_eval_and_generation_keep_the_models_own_forward():
    model = make_model("llama")
    fused = copy.deepcopy(model)
    fusedllm.patch(fused, cross_entropy=True)
    ids, labels = batch()
    model.eval()
    fused.eval()
    with torch.no_grad():
        ref, out = model(input_ids=ids, labels=labels), fused(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.logits, ref.logits)
    torch.testing.assert_close(out.loss, ref.loss)
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False),
                       fused.generate(ids, max_new_tokens=5, do_sample=False))


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("how", ["keyword", "positional"])
def test_cache_passed_as_the_models_forward_names_it(training, how):
    """The cache goes on under the model's own name for it (`past_key_values`
    before transformers 5.24, `cache` from it on), keyword or positional, and
    the patched forward names no cache the caller did not pass: transformers
    5.24 warns at every call where both names are set."""
    import inspect
    import warnings

    model = make_model("llama").train(training)
    fused = copy.deepcopy(model)
    fusedllm.patch(fused, cross_entropy=True)
    name = list(inspect.signature(type(model).forward).parameters)[4]
    assert name in ("past_key_values", "cache")
    ids, labels = batch()
    outs = []
    for m in (model, fused):
        cache = transformers.DynamicCache(config=m.config)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if how == "keyword":
                out = m(input_ids=ids, labels=labels, use_cache=True, **{name: cache})
            else:
                out = m(ids, None, None, cache, None, labels, True)
        assert not [w for w in caught if "cache" in str(w.message) or "past_key_values" in str(w.message)], \
            [str(w.message) for w in caught]
        assert cache.get_seq_length() == ids.shape[1], "the cache passed is the one filled"
        assert out["cache" if "cache" in out else "past_key_values"] is cache
        outs.append(out)
    torch.testing.assert_close(outs[1].loss, outs[0].loss, atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="positional arguments"):
        fused(ids, None, None, None, None, labels, True, 0, "one too many")
    with pytest.raises(TypeError, match=f"multiple values for argument '{name}'"):
        fused(ids, None, None, None, **{name: None})


def test_training_thirty_steps_follows_unpatched():
    model = make_model("qwen2")
    fused = copy.deepcopy(model)
    fusedllm.patch(fused, cross_entropy=True)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (model, fused)]
    for step in range(30):
        ids, labels = batch(step)
        losses = []
        for m, opt in zip((model, fused), opts):
            opt.zero_grad()
            loss = m(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-4, abs=1e-5), step


def test_unpatch_restores_and_unsupported_models_are_left():
    model = make_model("llama")
    report = fusedllm.patch(model, cross_entropy=True)
    assert report.loss.startswith("fused")
    assert "cross-entropy" in str(report)
    fusedllm.unpatch(model)
    ids, labels = batch()
    assert model(input_ids=ids, labels=labels).logits is not None

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2,
                                                               vocab_size=VOCAB))
    report = fusedllm.patch(gpt2, cross_entropy=True)
    assert report.loss.startswith("left") and "gpt2" in report.loss
    assert "forward" not in gpt2.__dict__
    assert hf_loss.supported(gpt2) is not None
