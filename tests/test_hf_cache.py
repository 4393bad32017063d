"""fusedllm.hf.FusedCache against transformers' DynamicCache: the same
tensors from every layer update (any chunk sizes, ring wrap-around at every
offset, beam and batch operations), the same generated tokens and logits
under every attention backend, storage written in place, and its errors."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
cache_utils = pytest.importorskip("transformers.cache_utils")
if not hasattr(cache_utils, "DynamicSlidingWindowLayer"):
    pytest.skip("FusedCache needs transformers 5's cache layers", allow_module_level=True)

import fusedllm.hf  # noqa: E402
from fusedllm.hf import FusedCache  # noqa: E402
from fusedllm.hf_cache import GrowingLayer, RingLayer, SinkLayer  # noqa: E402
from testkit.hf import cache_keyword  # noqa: E402

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)


def kv(n, batch=2, heads=2, dim=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, n, dim, generator=g), torch.randn(batch, heads, n, dim, generator=g)


def same_updates(ours, theirs, chunks):
    """Feed both layers the same chunks; every returned tensor, mask size and
    length must be equal."""
    for step, n in enumerate(chunks):
        assert ours.get_mask_sizes(n) == theirs.get_mask_sizes(n), step
        k, v = kv(n, seed=step)
        got, want = ours.update(k, v), theirs.update(k.clone(), v.clone())
        for a, b in zip(got, want):
            assert torch.equal(a, b), (step, chunks)
        assert ours.get_seq_length() == theirs.get_seq_length()


@pytest.mark.parametrize("window", [2, 3, 5])
@pytest.mark.parametrize("prefill", range(0, 12))
def test_ring_returns_what_the_sliding_layer_returns(window, prefill):
    """Every prefill length against windows of 2, 3 and 5 (so the ring has
    wrapped at every offset), then one-token steps and mixed chunks. (A
    window of 1 is left out: transformers' layer then keeps every position,
    its slice [-0:] being the whole.)"""
    chunks = ([prefill] if prefill else []) + [1] * 13 + [3, 1, 1, 7, 1, 2, 1]
    ring = RingLayer(window)
    same_updates(ring, cache_utils.DynamicSlidingWindowLayer(window), chunks)
    assert ring._k.shape[2] == 2 * window  # storage bounded by the window


def test_growing_layer_returns_what_the_dynamic_layer_returns():
    same_updates(GrowingLayer(capacity=3), cache_utils.DynamicLayer(), [5, 1, 1, 1, 4, 1, 9, 1, 1])


def test_steps_write_in_place_and_storage_grows_geometrically():
    layer = GrowingLayer(capacity=4)
    moves, sizes, last = 0, set(), None
    for step in range(100):
        keys, _ = layer.update(*kv(1, seed=step))
        moves += keys.data_ptr() != last
        last = keys.data_ptr()
        sizes.add(layer._k.shape[2])
    assert keys.shape[2] == 100
    assert sorted(sizes) == [4, 6, 9, 13, 19, 28, 42, 63, 94, 141]  # one copy of the past per growth
    assert moves <= len(sizes)  # (an address can come back from the allocator)
    exact = GrowingLayer(capacity=1)
    exact.update(*kv(50))
    assert exact._k.shape[2] == 50  # a first chunk larger than the capacity: no more than it needs
    ring = RingLayer(4)
    storages = {ring.update(*kv(1, seed=step))[0].untyped_storage().data_ptr() for step in range(30)}
    assert len(storages) == 1


@pytest.mark.parametrize("operation", ["crop", "reorder", "select", "repeat", "reset"])
def test_growing_layer_after_transformers_replaces_its_tensors(operation):
    """crop, beam reordering, batch selection and repetition replace keys and
    values; the next update must carry on from what they left."""
    ours, theirs = GrowingLayer(capacity=2), cache_utils.DynamicLayer()
    same_updates(ours, theirs, [3, 1, 1])
    for layer in (ours, theirs):
        if operation == "crop":
            layer.crop(-2)
        elif operation == "reorder":
            layer.reorder_cache(torch.tensor([1, 0]))
        elif operation == "select":
            layer.batch_select_indices(torch.tensor([1, 1]))
        elif operation == "repeat":
            layer.batch_repeat_interleave(1)
        else:
            layer.reset()
    same_updates(ours, theirs, [1, 2, 1])


@pytest.mark.parametrize("operation", ["reorder", "select"])
def test_ring_after_beam_and_batch_operations(operation):
    ours, theirs = RingLayer(3), cache_utils.DynamicSlidingWindowLayer(3)
    same_updates(ours, theirs, [4, 1, 1])
    index = torch.tensor([1, 0])
    for layer in (ours, theirs):
        (layer.reorder_cache if operation == "reorder" else layer.batch_select_indices)(index)
    same_updates(ours, theirs, [1, 1, 2, 1])


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))


def mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=5))


def gemma2():
    """Sliding and full layers in one model, and Gemma 2's soft-capping."""
    config = transformers.Gemma2Config(**{**SMALL, "num_hidden_layers": 4}, head_dim=16, sliding_window=4,
                                       query_pre_attn_scalar=16)
    return transformers.Gemma2ForCausalLM(config)


MODELS = {"llama": llama, "mistral_window5": mistral, "gemma2_mixed": gemma2}


def left_padded(device, batch=2, seq=9, pad=3):
    ids = torch.randint(3, SMALL["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, :pad] = 0
    ids[1, :pad] = 0
    return ids.to(device), mask.to(device)


def generate(model, ids, mask, cache, **kw):
    return model.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True, **{cache_keyword(model): cache}, **kw)


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("attention", ["eager", "sdpa", "fusedllm"])
def test_generate_equals_dynamic_cache(kind, attention):
    """Left-padded greedy generation, the prompt longer than the window and
    the generation wrapping the ring twice: the same tokens and logits."""
    torch.manual_seed(0)
    model = MODELS[kind]().eval()
    if attention == "sdpa" and not model._supports_sdpa:
        pytest.skip(f"transformers has no sdpa attention for {type(model).__name__}")
    model.set_attn_implementation(attention)
    ids, mask = left_padded("cpu")
    cache = FusedCache(model.config, capacity=4)
    ours = generate(model, ids, mask, cache)
    theirs = generate(model, ids, mask, transformers.DynamicCache(config=model.config))
    assert torch.equal(ours.sequences, theirs.sequences)
    for a, b in zip(ours.logits, theirs.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds == {"llama": ["GrowingLayer"] * 2, "mistral_window5": ["RingLayer"] * 2,
                     "gemma2_mixed": ["RingLayer", "GrowingLayer"] * 2}[kind]


def test_beam_search_equals_dynamic_cache():
    torch.manual_seed(0)
    model = gemma2().eval()
    model.set_attn_implementation("fusedllm")
    ids, mask = left_padded("cpu")
    ours = generate(model, ids, mask, FusedCache(model.config), num_beams=3)
    theirs = generate(model, ids, mask, transformers.DynamicCache(config=model.config), num_beams=3)
    assert torch.equal(ours.sequences, theirs.sequences)


def test_generate_on_the_kernels_of_every_device(device):
    """The fusedllm backend over FusedCache's views, on CPU, the emulated CUDA
    kernels and a GPU where there is one."""
    torch.manual_seed(0)
    model = mistral().to(device).eval()
    model.set_attn_implementation("fusedllm")
    ids, mask = left_padded(device)
    ours = generate(model, ids, mask, FusedCache(model.config))
    model.set_attn_implementation("eager")
    theirs = generate(model, ids, mask, transformers.DynamicCache(config=model.config))
    assert torch.equal(ours.sequences, theirs.sequences)


def test_without_config_every_layer_grows():
    model = llama().eval()
    ids = torch.randint(3, 128, (1, 5))
    cache = FusedCache()
    model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0, **{cache_keyword(model): cache})
    assert [type(layer).__name__ for layer in cache.layers] == ["GrowingLayer"] * 2
    assert cache.get_seq_length() == 7


def test_errors_name_what_was_wrong():
    with pytest.raises(ValueError, match="capacity must be a positive int, got 0"):
        FusedCache(capacity=0)
    for layer in (GrowingLayer(), RingLayer(3)):
        layer.update(*kv(2))
        with pytest.raises(ValueError, match=r"new keys must be \[batch, heads, n, head_dim\] = \[2, 2, n, 4\]"):
            layer.update(*kv(1, batch=1))
        k, v = kv(1)
        with pytest.raises(ValueError, match="new keys are torch.float64 on cpu, the held ones torch.float32"):
            layer.update(k.double(), v.double())
    for layer in (RingLayer(3), SinkLayer(3, 1)):
        with pytest.raises(ValueError, match="cannot be cropped"):
            layer.crop(-1)
        with pytest.raises(ValueError, match="cannot record the past"):
            layer.activate_past_recording()


def test_sampling_and_continuing_with_the_same_cache():
    """Sampling with several sequences per prompt, then a second generate call
    on the grown sequence with the same cache (a chat's next turn)."""
    torch.manual_seed(0)
    model = mistral().eval()
    model.set_attn_implementation("fusedllm")
    ids, _ = left_padded("cpu", pad=0)
    results = []
    for cache in (FusedCache(model.config), transformers.DynamicCache(config=model.config)):
        torch.manual_seed(5)
        first = model.generate(ids, max_new_tokens=8, do_sample=True, top_k=5, pad_token_id=0,
                               **{cache_keyword(model): cache})
        turn = torch.cat([first, torch.randint(3, SMALL["vocab_size"], (first.shape[0], 3),
                                               generator=torch.Generator().manual_seed(2))], 1)
        second = model.generate(turn, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                **{cache_keyword(model): cache})
        results.append(second)
    assert torch.equal(results[0], results[1])


# --- int8 storage ------------------------------------------------------------------------

def dequantized(t, code=torch.int8):
    """What int8 (or float8) storage holds of float rows t, as float32 rows."""
    values, scales = fusedllm.quantize_kv(t, dtype=code)
    return values.float() * scales.unsqueeze(-1)


def same_int8_updates(ours, theirs, chunks, operation=None, code=torch.int8):
    """ours (int8) returns the int8 rows and scales of what theirs (a float
    layer fed the dequantized rows) returns, after every chunk."""
    for step, n in enumerate(chunks):
        if operation is not None and step == len(chunks) // 2:
            operation(ours)
            operation(theirs)
        assert ours.get_mask_sizes(n) == theirs.get_mask_sizes(n), step
        k, v = kv(n, seed=step)
        got, want = ours.update(k, v), theirs.update(dequantized(k, code), dequantized(v, code))
        for t, expected in zip(got, want):
            assert t.dtype == code
            assert torch.equal(t.float() * t.fusedllm_scale.unsqueeze(-1), expected), (step, chunks)
        assert ours.get_seq_length() == theirs.get_seq_length()


OPERATIONS = {
    "none": None,
    "crop": lambda layer: layer.crop(-2),
    "reorder": lambda layer: layer.reorder_cache(torch.tensor([1, 0])),
    "select": lambda layer: layer.batch_select_indices(torch.tensor([1, 1])),
    "repeat": lambda layer: layer.batch_repeat_interleave(1),
    "reset": lambda layer: layer.reset(),
}


@pytest.mark.parametrize("code", [torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_int8_growing_layer(operation, code):
    same_int8_updates(GrowingLayer(capacity=3, code=code), cache_utils.DynamicLayer(),
                      [5, 1, 1, 1, 4, 1, 9, 1, 1], OPERATIONS[operation], code)


@pytest.mark.parametrize("code", [torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("window", [2, 3, 5])
@pytest.mark.parametrize("prefill", [0, 1, 4, 7])
def test_int8_ring_layer(window, prefill, code):
    chunks = ([prefill] if prefill else []) + [1] * 11 + [3, 1, 7, 1, 2]
    same_int8_updates(RingLayer(window, code=code), cache_utils.DynamicSlidingWindowLayer(window), chunks,
                      OPERATIONS["reorder"], code)


def fake_int8_cache(config, code=torch.int8):
    """transformers' DynamicCache holding the dequantized rows int8 (or
    float8) storage keeps: attention over it sees the values
    FusedCache(dtype=code) holds."""
    cache = transformers.DynamicCache(config=config)

    def quantizing(update):
        return lambda k, v, *args, **kwargs: update(dequantized(k, code), dequantized(v, code), *args, **kwargs)

    for layer in cache.layers:
        layer.update = quantizing(layer.update)
    return cache


@pytest.mark.parametrize("code", [torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("kind", MODELS)
def test_int8_generate_reads_the_int8_rows(kind, code):
    """Greedy generation over int8 storage equals generation over a float
    cache of the same dequantized rows (the kernels read the int8 rows
    exactly), and stays near the unquantized cache."""
    torch.manual_seed(0)
    model = MODELS[kind]().eval()
    model.set_attn_implementation("fusedllm")
    ids, mask = left_padded("cpu")
    cache = FusedCache(model.config, capacity=4, dtype=code)
    ours = generate(model, ids, mask, cache)
    theirs = generate(model, ids, mask, fake_int8_cache(model.config, code))
    assert torch.equal(ours.sequences, theirs.sequences)
    for a, b in zip(ours.logits, theirs.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert all(layer._k.dtype == code for layer in cache.layers)
    unquantized = generate(model, ids, mask, transformers.DynamicCache(config=model.config))
    first = (ours.logits[0] - unquantized.logits[0]).abs().max().item()
    assert 0 < first < 0.05 * unquantized.logits[0].abs().max().item()


def test_int8_beam_search_and_every_device(device):
    torch.manual_seed(0)
    model = gemma2().to(device).eval()
    model.set_attn_implementation("fusedllm")
    ids, mask = left_padded(device)
    ours = generate(model, ids, mask, FusedCache(model.config, dtype=torch.int8), num_beams=3)
    theirs = generate(model, ids, mask, fake_int8_cache(model.config), num_beams=3)
    assert torch.equal(ours.sequences, theirs.sequences)


def test_int8_errors():
    with pytest.raises(ValueError, match="dtype must be None .* torch.int8 or torch.float8_e4m3fn"):
        FusedCache(dtype=torch.float16)
    model = llama()
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="read by the 'fusedllm' attention only, but the model uses 'sdpa'"):
        FusedCache(model.config, dtype=torch.int8)
    q = torch.randn(1, 4, 1, 16)
    k8 = torch.zeros(1, 2, 3, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="torch.int8 keys and values need the scales"):
        fusedllm.hf.attention_forward(torch.nn.Module(), q, k8, k8, None)


# --- window and sinks (StreamingLLM) on full-attention layers -----------------------------

def streaming_masks(model, n, window, sink, pad=None):
    """Keep-masks of the whole sequence: full-attention layers see the first
    `sink` positions and the last `window` up to their own, the model's
    sliding layers their own window; `pad` [batch, n] hides padding keys."""
    q, p = torch.arange(n)[:, None], torch.arange(n)[None, :]
    full = (p <= q) & ((p > q - window) | (p < sink))
    masks = {"full_attention": full}
    if getattr(model.config, "sliding_window", None):
        masks["sliding_attention"] = (p <= q) & (p > q - model.config.sliding_window)
    pad = torch.ones(1, n, dtype=torch.bool) if pad is None else pad.bool()
    return {kind: torch.where(m[None, None] & pad[:, None, None, :], 0.0, torch.finfo(torch.float32).min)
            for kind, m in masks.items()}


def streaming_reference(model, ids, steps, window, sink):
    """Greedy decoding that recomputes the whole sequence under the masks of
    streaming_masks, with eager attention: the tokens and each step's logits."""
    model.set_attn_implementation("eager")
    logits = []
    for _ in range(steps):
        masks = streaming_masks(model, ids.shape[1], window, sink)
        masks = {kind: m.expand(ids.shape[0], -1, -1, -1) for kind, m in masks.items()}
        last = model(ids, attention_mask=masks if len(masks) > 1 else masks["full_attention"]).logits[:, -1]
        logits.append(last)
        ids = torch.cat([ids, last.argmax(-1, keepdim=True)], 1)
    model.set_attn_implementation("fusedllm")
    return ids, logits


def gpt_oss():
    """Sliding and full layers with gpt-oss's learned sinks (s_aux), drawn at random."""
    config = transformers.GptOssConfig(**{**SMALL, "num_hidden_layers": 4}, head_dim=16, sliding_window=4,
                                       num_local_experts=4, num_experts_per_tok=2)
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()
    return model


STREAMING_MODELS = {"llama": llama, "gemma2_mixed": gemma2, "gpt_oss_learned_sinks": gpt_oss}


@pytest.mark.parametrize("kind", STREAMING_MODELS)
@pytest.mark.parametrize("window, sink", [(4, 2), (5, 0), (3, 1), (1, 3), (30, 2)])
def test_window_and_sinks_generate_as_streaming_attention(kind, window, sink):
    """Greedy generation with FusedCache(window, sink), the prompt longer than
    the window and the ring wrapped several times, equals recomputing the
    whole sequence under StreamingLLM's mask; memory stays sink + window."""
    torch.manual_seed(0)
    model = STREAMING_MODELS[kind]().eval()
    model.set_attn_implementation("fusedllm")
    model.generation_config.eos_token_id = None  # the reference runs every step
    ids, _ = left_padded("cpu", pad=0)
    cache = FusedCache(model.config, window=window, sink=sink)
    ours = generate(model, ids, None, cache)
    want, logits = streaming_reference(model, ids, 14, window, sink)
    assert torch.equal(ours.sequences, want)
    for a, b in zip(ours.logits, logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    sinks = [layer for layer in cache.layers if isinstance(layer, SinkLayer)]
    assert len(sinks) == 2
    assert all(layer._k.shape[2] == sink + window for layer in sinks)
    assert cache.get_seq_length() == ids.shape[1] + 13  # the last token is not fed back


@pytest.mark.parametrize("kind", ["llama", "gpt_oss_learned_sinks"])
@pytest.mark.parametrize("chunks", [[5, 1, 3, 1, 7, 2], [1] * 6 + [9], [2, 2, 2, 2, 2, 2, 2]])
def test_window_and_sinks_in_chunks(kind, chunks, device):
    """A sequence fed in chunks of any size (each chunk's queries see the
    sinks, the window's past and each other; learned sinks join the merged
    softmax once): every position's logits as recomputing the whole sequence
    under the mask; on every device."""
    torch.manual_seed(0)
    model = STREAMING_MODELS[kind]().to(device).eval()
    ids = torch.randint(3, SMALL["vocab_size"], (2, sum(chunks)), generator=torch.Generator().manual_seed(3))
    model.set_attn_implementation("eager")
    masks = {name: m.expand(2, -1, -1, -1).to(device)
             for name, m in streaming_masks(model, ids.shape[1], 4, 2).items()}
    want = model(ids.to(device), attention_mask=masks if len(masks) > 1 else masks["full_attention"]).logits
    model.set_attn_implementation("fusedllm")
    cache, start = FusedCache(model.config, window=4, sink=2), 0
    for n in chunks:
        got = model(ids[:, start:start + n].to(device), use_cache=True, **{cache_keyword(model): cache}).logits
        torch.testing.assert_close(got, want[:, start:start + n], rtol=1e-5, atol=1e-5)
        start += n


def test_window_with_left_padding_equals_each_row_alone():
    """Without sinks, a left-padded batch decodes each row as it decodes alone
    (the window counts positions, as the padding shifts them all alike)."""
    torch.manual_seed(0)
    model = llama().eval()
    model.set_attn_implementation("fusedllm")
    ids, mask = left_padded("cpu")
    batch = generate(model, ids, mask, FusedCache(model.config, window=4))
    alone = generate(model, ids[1:, 3:], mask[1:, 3:], FusedCache(model.config, window=4))
    assert torch.equal(batch.sequences[1, 3:], alone.sequences[0])
    for a, b in zip(batch.logits, alone.logits):
        torch.testing.assert_close(a[1], b[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("code", [torch.int8, torch.float8_e4m3fn], ids=str)
def test_window_and_sinks_quantized(code):
    """Quantized sink layers: generation equals a float FusedCache(window,
    sink) fed the dequantized rows, with beam search reordering the storage."""
    torch.manual_seed(0)
    model = llama().eval()
    model.set_attn_implementation("fusedllm")
    ids, _ = left_padded("cpu", pad=0)
    cache = FusedCache(model.config, window=3, sink=2, dtype=code)
    fake = FusedCache(model.config, window=3, sink=2)
    for layer in fake.layers:
        update = layer.update
        layer.update = (lambda update: lambda k, v, *a, **kw: update(dequantized(k, code), dequantized(v, code),
                                                                     *a, **kw))(update)
    ours = generate(model, ids, None, cache, num_beams=3)
    theirs = generate(model, ids, None, fake, num_beams=3)
    assert torch.equal(ours.sequences, theirs.sequences)
    for a, b in zip(ours.logits, theirs.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert all(layer._k.dtype == code and layer._k.shape[2] == 5 for layer in cache.layers)


@pytest.mark.parametrize("operation", ["reorder", "select", "repeat", "reset"])
@pytest.mark.parametrize("window, sink", [(3, 2), (4, 0)])
def test_sink_layer_holds_the_positions_it_says(operation, window, sink):
    """Step by step (chunks and single tokens, wrapping at every offset, a
    batch operation midway): the keys returned are the rows of the positions
    their layout names, and those are exactly the positions some query of
    the step sees; storage stays sink + window slots."""
    layer, history = SinkLayer(window, sink), None
    chunks = [3, 1, 1, 1, 1, 1, 1, 4, 1, 1, 2, 1, 1, 1, 6, 1]
    for step, n in enumerate(chunks):
        if step == len(chunks) // 2:
            index = torch.tensor([1, 0])
            OPERATIONS[operation](layer)
            history = {"reorder": history[index], "select": history[torch.tensor([1, 1])],
                       "repeat": history, "reset": history[:, :, :0]}[operation]
        k, v = kv(n, seed=step)
        history = k if history is None else torch.cat([history, k], dim=2)
        keys, values = layer.update(k, v)
        layout = keys.fusedllm_layout
        positions = layout.positions("cpu")
        assert torch.equal(keys, history[:, :, positions]), step
        seen = layout.visible("cpu").any(0)
        assert bool(seen.all()), step  # nothing returned that no query sees
        end = history.shape[2]
        q, p = torch.arange(end - n, end)[:, None], torch.arange(end)[None, :]
        wanted = ((p <= q) & ((p > q - window) | (p < sink))).any(0).nonzero().flatten()
        assert sorted(positions.tolist()) == wanted.tolist(), step
        assert layer._k.shape[2] == sink + window
        assert layer.get_seq_length() == end and layer.get_mask_sizes(1) == (end + 1, 0)


def test_window_and_sinks_errors():
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="window must be None or a positive int"):
            FusedCache(window=bad)
    with pytest.raises(ValueError, match="sink must be an int >= 0, got -1"):
        FusedCache(window=4, sink=-1)
    with pytest.raises(ValueError, match="sink=2 needs a window"):
        FusedCache(sink=2)
    model = llama()
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="window is read by the 'fusedllm' attention only, but the model uses 'sdpa'"):
        FusedCache(model.config, window=4)
    model.set_attn_implementation("fusedllm")
    ids, mask = left_padded("cpu")
    with pytest.raises(ValueError, match=r"sink=2\) the first 2 positions of every row are its sinks, but some "
                                         r"row's are padding"):
        generate(model, ids, mask, FusedCache(model.config, window=4, sink=2))
    layer = SinkLayer(4, 1)
    keys, values = layer.update(*kv(3))
    q = torch.randn(2, 4, 3, 4)
    biased = torch.zeros(2, 1, 3, 3)
    biased[..., 0] = -0.5
    with pytest.raises(ValueError, match="reads the attention mask as keep / hide only, but this additive mask "
                                         "holds other values"):
        fusedllm.hf.attention_forward(torch.nn.Module(), q, keys, values, biased)
