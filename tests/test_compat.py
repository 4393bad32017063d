"""fusedllm.compat: each notebook class against a plain re-implementation of it
(testkit/notebook_models.py). A state dict saved from the plain class loads into
ours unchanged, and in eval mode outputs and gradients agree in float32."""


import pytest
import torch

from fusedllm.compat import nb000, nb001, nb002, nb003

from testkit import notebook_models as plain
from checks import FORWARD_TOL, GRAD_TOL, assert_close, whole

F32 = (FORWARD_TOL[torch.float32], GRAD_TOL[torch.float32])



def _x(*shape):
    return torch.randn(*shape)


def _ids(vocab, batch=2, seq=7):
    return lambda: (torch.randint(0, vocab, (batch, seq)),)


def _causal(seq):
    return torch.ones(seq, seq).tril()[None, None]


def _llama_cfg(cls, **kw):
    return plain.tiny_llama_config(cls, **kw)


def _padding_keep(batch=2, seq=7):
    keep = torch.ones(batch, 1, 1, seq, dtype=torch.bool)
    keep[0, ..., -2:] = False  # the first sequence ends with two padding tokens
    return keep


# (id, plain class, our class, constructor args, inputs builder, forward kwargs builder)
CASES = [
    ("000-RMSNorm", plain.nb000.RMSNorm, nb000.RMSNorm, (16,), lambda: (_x(2, 5, 16),), dict),
    ("000-RMSNorm-eps", plain.nb000.RMSNorm, nb000.RMSNorm, (16, 1e-3), lambda: (_x(3, 16) * 1e-2,), dict),
    ("000-SwiGLU", plain.nb000.SwiGLU, nb000.SwiGLU, (16, 24), lambda: (_x(2, 5, 16),), dict),
    ("000-SwiGLU-nobias", plain.nb000.SwiGLU, nb000.SwiGLU, (16, 24, False), lambda: (_x(2, 5, 16),), dict),
    ("000-FFN-swiglu", plain.nb000.ModernFeedForward, nb000.ModernFeedForward, (16, 48), lambda: (_x(2, 5, 16),), dict),
    ("000-FFN-gelu", plain.nb000.ModernFeedForward, nb000.ModernFeedForward, (16, 48, "gelu"),
     lambda: (_x(2, 5, 16),), dict),
    ("000-RoPE", plain.nb000.RotaryPositionalEmbedding, nb000.RotaryPositionalEmbedding, (8, 32),
     lambda: (_x(2, 3, 6, 8), _x(2, 3, 6, 8)), lambda: dict(position_offset=5)),
    ("000-RoPEAttention", plain.nb000.RoPEAttention, nb000.RoPEAttention, (16, 2, 32),
     lambda: (_x(2, 7, 16),), lambda: dict(mask=_causal(7), position_offset=3)),
    ("000-RoPEAttention-padding", plain.nb000.RoPEAttention, nb000.RoPEAttention, (16, 4, 32),
     lambda: (_x(2, 7, 16),), lambda: dict(mask=_padding_keep().float())),
    ("000-PreNorm-layernorm", plain.nb000.PreNormTransformerBlock, nb000.PreNormTransformerBlock, (16, 2, 32),
     lambda: (_x(2, 6, 16),), lambda: dict(mask=_causal(6))),
    ("000-PreNorm-rmsnorm", plain.nb000.PreNormTransformerBlock, nb000.PreNormTransformerBlock,
     (16, 2, 32, 0.1, "rmsnorm"), lambda: (_x(2, 6, 16),), dict),
    ("000-PostNorm-layernorm", plain.nb000.PostNormTransformerBlock, nb000.PostNormTransformerBlock,
     (16, 2, 32), lambda: (_x(2, 6, 16),), lambda: dict(mask=_causal(6))),
    ("000-PostNorm-rmsnorm", plain.nb000.PostNormTransformerBlock, nb000.PostNormTransformerBlock,
     (16, 2, 32, 0.1, "rmsnorm"), lambda: (_x(2, 6, 16),), lambda: dict(mask=_causal(6))),
    ("000-ModernBlock", plain.nb000.ModernTransformerBlock, nb000.ModernTransformerBlock, (16, 2, 32, 40),
     lambda: (_x(2, 6, 16),), lambda: dict(mask=_causal(6), position_offset=4)),
    ("000-ModernTransformer", plain.nb000.ModernTransformer, nb000.ModernTransformer, (50, 16, 2, 2, 32, 32),
     _ids(50), dict),
    ("000-ModernTransformer-untied-mask", plain.nb000.ModernTransformer, nb000.ModernTransformer,
     (50, 16, 2, 2, 32, 32, 0.1, False), _ids(50),
     lambda: dict(attention_mask=_padding_keep().float() * _causal(7), position_offset=2)),
    ("001-OriginalMHA", plain.nb001.OriginalMultiHeadAttention, nb001.OriginalMultiHeadAttention, (16, 4),
     lambda: (_x(2, 5, 16), _x(2, 9, 16), _x(2, 9, 16)),
     lambda: dict(mask=torch.rand(2, 1, 5, 9) > 0.3)),
    ("001-ModernMHA", plain.nb001.ModernMultiHeadAttention, nb001.ModernMultiHeadAttention, (16, 4),
     lambda: (_x(2, 6, 16),), lambda: dict(mask=_causal(6))),
    ("001-OriginalBlock", plain.nb001.OriginalTransformerBlock, nb001.OriginalTransformerBlock, (16, 4, 32),
     lambda: (_x(2, 6, 16),), dict),
    ("001-ModernBlock-nobias", plain.nb001.ModernTransformerBlock, nb001.ModernTransformerBlock,
     (16, 4, 32, 0.1, False), lambda: (_x(2, 6, 16),), lambda: dict(mask=_causal(6))),
    ("002-RMSNorm", plain.nb002.RMSNorm, nb002.RMSNorm, (16,), lambda: (_x(2, 5, 16),), dict),
    ("002-SimpleAttention", plain.nb002.SimpleAttention, nb002.SimpleAttention, (16,),
     lambda: (_x(2, 6, 16),), dict),
    ("002-SimpleAttention-wide", plain.nb002.SimpleAttention, nb002.SimpleAttention, (264,),
     lambda: (_x(1, 4, 264),), dict),
    ("002-PostNormBlock", plain.nb002.PostNormBlock, nb002.PostNormBlock, (16,), lambda: (_x(2, 6, 16),), dict),
    ("002-PreNormBlock", plain.nb002.PreNormBlock, nb002.PreNormBlock, (16,), lambda: (_x(2, 6, 16),), dict),
    ("003-RMSNorm", plain.nb003.RMSNorm, nb003.RMSNorm, (16,), lambda: (_x(2, 5, 16),), dict),
    ("003-GQA", plain.nb003.LLaMAGroupQueryAttention, nb003.LLaMAGroupQueryAttention,
     (_llama_cfg(nb003.LLaMAConfig),), lambda: (_x(2, 7, 32),), dict),
    ("003-GQA-mask", plain.nb003.LLaMAGroupQueryAttention, nb003.LLaMAGroupQueryAttention,
     (_llama_cfg(nb003.LLaMAConfig, n_kv_heads=1),), lambda: (_x(2, 7, 32),),
     lambda: dict(attention_mask=_padding_keep())),
    ("003-SwiGLU", plain.nb003.LLaMASwiGLU, nb003.LLaMASwiGLU, (_llama_cfg(nb003.LLaMAConfig),),
     lambda: (_x(2, 5, 32),), dict),
    ("003-Block", plain.nb003.LLaMABlock, nb003.LLaMABlock, (_llama_cfg(nb003.LLaMAConfig),),
     lambda: (_x(2, 7, 32),), dict),
    ("003-Model", plain.nb003.LLaMAModel, nb003.LLaMAModel, (_llama_cfg(nb003.LLaMAConfig),), _ids(61), dict),
]


def _perturb(module):
    """Move every parameter away from its initial value (norm gains start at one),
    so a parameter loaded under the wrong name or left unused shows up."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.1)


def _tensors(result):
    return [t for t in (result if isinstance(result, tuple) else (result,)) if t is not None]


def _run(module, inputs, kwargs, grads=None):
    inputs = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    outs = _tensors(module(*inputs, **kwargs))
    if grads is None:
        grads = torch.randn_like(outs[0])
    # gradients through the main output (the second is q or attention weights)
    loss = (outs[0] * grads).sum()
    if len(outs) == 2 and outs[1].shape == outs[0].shape:
        loss = loss + outs[1].pow(2).sum()  # rotary embedding: (q, k)
    loss.backward()
    return outs, [t.grad for t in inputs if t.grad is not None], grads


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_state_dict_outputs_and_gradients(case):
    _, plain_cls, ours_cls, args, make_inputs, make_kwargs = case
    reference = plain_cls(*args).eval()
    _perturb(reference)
    ours = ours_cls(*args).eval()
    state = reference.state_dict()
    assert set(ours.state_dict()) == set(state), "parameter / buffer names differ"
    ours.load_state_dict(state)  # strict: same names and shapes
    inputs, kwargs = make_inputs(), make_kwargs()
    ref_outs, ref_input_grads, grads = _run(reference, inputs, kwargs)
    our_outs, our_input_grads, _ = _run(ours, inputs, kwargs, grads)
    # the notebooks' attention modules return weights; ours return None unless asked
    assert len(our_outs) == len(ref_outs) or (len(our_outs) == 1 and len(ref_outs) == 2)
    fwd, bwd = F32
    for ours_o, ref_o in zip(our_outs, ref_outs):
        assert_close(ours_o, ref_o, fwd)
    for ours_g, ref_g in zip(our_input_grads, ref_input_grads):
        assert_close(ours_g, ref_g, bwd)
    ref_params = dict(reference.named_parameters())
    for name, p in ours.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert_close(p.grad, ref_params[name].grad, bwd)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_our_state_dict_loads_into_the_notebook_class(case):
    _, plain_cls, ours_cls, args, _, _ = case
    plain_cls(*args).load_state_dict(ours_cls(*args).state_dict())


@pytest.mark.parametrize("cls,args", [(nb000.RoPEAttention, (16, 4, 32)),
                                      (nb000.ModernTransformerBlock, (16, 4, 32, 32)),
                                      (nb000.PreNormTransformerBlock, (16, 4, 32)),
                                      (nb000.PostNormTransformerBlock, (16, 4, 32))])
def test_attention_weights_only_when_asked(cls, args):
    reference = getattr(plain.nb000, cls.__name__)(*args).eval()
    ours = cls(*args).eval()
    ours.load_state_dict(reference.state_dict())
    x, mask = _x(2, 6, 16), _causal(6)
    out, weights = ours(x, mask)
    assert weights is None
    ref_out, ref_weights = reference(x, mask)
    out_w, weights = ours(x, mask, need_weights=True)
    assert weights.shape == (2, 4, 6, 6)
    assert_close(weights, ref_weights, FORWARD_TOL[torch.float32])
    assert_close(out_w, ref_out, FORWARD_TOL[torch.float32])
    assert_close(out, out_w, FORWARD_TOL[torch.float32])


def test_need_weights_on_001_attention():
    reference = plain.nb001.OriginalMultiHeadAttention(16, 4).eval()
    ours = nb001.OriginalMultiHeadAttention(16, 4).eval()
    ours.load_state_dict(reference.state_dict())
    x = _x(2, 5, 16)
    out, weights = ours(x, x, x, _causal(5), need_weights=True)
    assert weights.shape == (2, 4, 5, 5) and torch.all(weights[..., 0, 1:] == 0)
    assert_close(out, reference(x, x, x, _causal(5)), FORWARD_TOL[torch.float32])


def test_fully_masked_rows_give_zeros_not_a_uniform_average():
    attn = nb000.RoPEAttention(16, 2, 32).eval()
    mask = torch.ones(1, 1, 5, 5)
    mask[..., 2, :] = 0  # query 2 sees nothing
    out_heads = {}
    attn.w_o.register_forward_hook(lambda m, i, o: out_heads.setdefault("x", i[0]))
    attn(_x(1, 5, 16), mask)
    assert torch.all(out_heads["x"][0, 2] == 0)
    _, weights = attn(_x(1, 5, 16), mask, need_weights=True)
    assert torch.all(weights[..., 2, :] == 0) and torch.isfinite(weights).all()


def test_modern_transformer_default_mask_is_causal():
    model = nb000.ModernTransformer(50, 16, 2, 2, 32, 32).eval()
    ids = torch.randint(0, 50, (2, 7))
    assert_close(model(ids), model(ids, attention_mask=_causal(7)), FORWARD_TOL[torch.float32])
    changed = ids.clone()
    changed[:, -1] = (ids[:, -1] + 1) % 50
    # the last token does not change the logits of earlier positions
    assert_close(model(changed)[:, :-1], model(ids)[:, :-1], FORWARD_TOL[torch.float32])


def test_modern_transformer_ties_weights_and_counts_them_once():
    tied = nb000.ModernTransformer(50, 16, 2, 2, 32, 32)
    assert tied.lm_head.weight is tied.token_embedding.weight
    counts = tied.count_parameters()
    assert counts["lm_head"] == 0
    assert counts["total"] == sum(p.numel() for p in tied.parameters())
    untied = nb000.ModernTransformer(50, 16, 2, 2, 32, 32, tie_weights=False)
    assert untied.count_parameters()["total"] == sum(p.numel() for p in untied.parameters())


def test_gqa_rotates_each_key_head_once():
    cfg = _llama_cfg(nb003.LLaMAConfig)  # two query heads per kv head
    ours = nb003.LLaMAGroupQueryAttention(cfg).eval()
    x = _x(1, 6, 32)
    b, t = 1, 6
    q = ours.q_proj(x).view(b, t, cfg.n_heads, cfg.head_dim).transpose(1, 2)
    k = ours.k_proj(x).view(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
    v = ours.v_proj(x).view(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
    cos, sin = ours.rope.tables(t)

    def output(k_turns):
        qr = plain.rotate_pairs(q, cos, sin)
        kr = k
        for _ in range(k_turns):
            kr = plain.rotate_pairs(kr, cos, sin)
        kr, vr = kr.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
        return ours.o_proj(o.transpose(1, 2).reshape(b, t, -1))

    with torch.no_grad():
        got = ours(x)
        assert_close(got, output(1), FORWARD_TOL[torch.float32])
        assert (got - output(2)).abs().max() > 1e-3  # what rotating per query head would give


def test_apply_rotary_embeddings_rotates_adjacent_pairs():
    rope = nb003.RotaryEmbedding(8, max_position=16)
    q, k = _x(2, 3, 5, 8), _x(2, 1, 5, 8)
    cos, sin = rope(q[:, 0])  # the notebook's [seq, dim] tables
    assert cos.shape == (5, 8) and torch.equal(cos[:, :4], cos[:, 4:])
    rq, rk = nb003.apply_rotary_embeddings(q, k, cos, sin)
    assert_close(rq, plain.rotate_pairs(q, cos[:, :4], sin[:, :4]), FORWARD_TOL[torch.float32])
    assert_close(rk, plain.rotate_pairs(k, cos[:, :4], sin[:, :4]), FORWARD_TOL[torch.float32])
    # rotations keep each pair's length
    assert_close(rq.pow(2).sum(-1), q.pow(2).sum(-1), FORWARD_TOL[torch.float32])
    r3, _ = nb003.apply_rotary_embeddings(q[:, 0], k[:, 0], cos, sin)  # [batch, seq, dim] works too
    assert_close(r3, rq[:, 0], FORWARD_TOL[torch.float32])
    with pytest.raises(ValueError, match=whole(
            "apply_rotary_embeddings: cos and sin must be [seq, 8] or [seq, 4], got [5, 3]")):
        nb003.apply_rotary_embeddings(q, k, cos[:, :3], sin[:, :3])


def test_llama_swiglu_keeps_the_notebook_gate():
    ffn = nb003.LLaMASwiGLU(_llama_cfg(nb003.LLaMAConfig))
    x = _x(3, 32)
    silu = torch.nn.functional.silu
    with torch.no_grad():
        notebook = ffn.w2(ffn.w1(x) * silu(ffn.w3(x)))
        usual = ffn.w2(silu(ffn.w1(x)) * ffn.w3(x))
        assert_close(ffn(x), notebook, FORWARD_TOL[torch.float32])
        assert (ffn(x) - usual).abs().max() > 1e-4


def test_rope_tables_are_saved_and_grow_past_max_len():
    rope = nb000.RotaryPositionalEmbedding(8, max_len=4)
    assert set(rope.state_dict()) == {"cos_cached", "sin_cached"} and rope.max_len == 4
    q = _x(1, 1, 6, 8)
    rq, _ = rope(q, q, position_offset=3)
    assert rope.max_len >= 9 and rq.shape == q.shape


def test_config_keeps_the_notebook_defaults():
    ours, theirs = nb003.LLaMAConfig(), plain.nb003.LLaMAConfig()
    assert vars(ours) == vars(theirs)
    assert nb003.LLaMAConfig(hidden_size=64).hidden_size == 64


def test_dropout_is_applied_in_training_only():
    attn = nb001.ModernMultiHeadAttention(16, 4, dropout=0.5)
    x = _x(2, 6, 16)
    attn.eval()
    assert torch.equal(attn(x), attn(x))
    attn.train()
    torch.manual_seed(1)
    a = attn(x)
    torch.manual_seed(2)
    assert not torch.allclose(a, attn(x))


def test_bfloat16_close_to_float32():
    block = nb000.ModernTransformerBlock(32, 4, 64, 32).eval()
    x = _x(2, 8, 32)
    ref, _ = block(x, is_causal=True)
    low, _ = block.to(torch.bfloat16)(x.bfloat16(), is_causal=True)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), ref, atol=0.1, rtol=0.05)


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match=whole(
            "ModernFeedForward: activation must be 'swiglu' or one of ['gelu', 'mish', 'relu', 'silu'], got 'tanh'")):
        nb000.ModernFeedForward(16, 32, activation="tanh")
    with pytest.raises(ValueError, match=whole(
            "PreNormTransformerBlock: norm_type must be 'layernorm' or 'rmsnorm', got 'batchnorm'")):
        nb000.PreNormTransformerBlock(16, 2, 32, norm_type="batchnorm")
    with pytest.raises(ValueError, match=whole("RoPEAttention: d_model (16) must be a multiple of n_heads (3)")):
        nb000.RoPEAttention(16, 3)
    with pytest.raises(ValueError, match=whole(
            "ModernMultiHeadAttention: d_model (16) must be a multiple of num_heads (5)")):
        nb001.ModernMultiHeadAttention(16, 5)
    with pytest.raises(ValueError, match=whole(
            "LLaMAGroupQueryAttention: config.n_heads (4) must be a multiple of config.n_kv_heads (3)")):
        nb003.LLaMAGroupQueryAttention(_llama_cfg(nb003.LLaMAConfig, n_kv_heads=3))
    with pytest.raises(TypeError, match=whole("RoPEAttention: mask must be a torch.Tensor or None, got list")):
        nb000.RoPEAttention(16, 2, 32)(_x(1, 3, 16), mask=[[1, 0]])
