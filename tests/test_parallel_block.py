"""nn.ParallelBlock: against the parallel block written out in plain PyTorch
with separate projections (outputs and every gradient), state dicts of
separate projections, from_sequential, KV-cache decoding against the full
forward, dropout, torch.compile and bad arguments."""

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusedllm
from fusedllm.nn import GatedMLP, GQAttention, KVCache, ParallelBlock, RMSNorm

from checks import FORWARD_TOL, GRAD_TOL, assert_close, whole
from reference import attention as ref_attention


class PlainParallelBlock(nn.Module):
    """``x + attn(norm(x)) + mlp(norm(x))`` in plain PyTorch, each projection its
    own nn.Linear (the names ParallelBlock's state dict uses): RMSNorm or
    LayerNorm, rotate-half (or interleaved, partial) RoPE from float64
    angles, repeated kv heads, the full float32 score matrix, act(gate) * up."""

    def __init__(self, d_model, n_heads, n_kv_heads, intermediate, head_dim=None, norm="rms", activation="silu",
                 bias=False, rope=True, window=None, eps=1e-6, base=10000.0, interleaved=False, rotary_dim=None):
        super().__init__()
        head_dim = head_dim or d_model // n_heads
        self.n_heads, self.n_kv_heads, self.head_dim, self.window = n_heads, n_kv_heads, head_dim, window
        self.activation, self.rope, self.base, self.interleaved = activation, rope, base, interleaved
        self.rotary_dim = rotary_dim or head_dim
        self.norm_kind, self.eps = norm, eps
        if norm == "rms":
            self.norm = nn.Module()
            self.norm.weight = nn.Parameter(torch.ones(d_model))
        else:
            self.norm = nn.LayerNorm(d_model, eps=eps, bias=bias)
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.gate_proj = nn.Linear(d_model, intermediate, bias=bias)
        self.up_proj = nn.Linear(d_model, intermediate, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=bias)
        self.down_proj = nn.Linear(intermediate, d_model, bias=bias)

    def normed(self, x):
        if self.norm_kind == "layer":
            return self.norm(x)
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return y * self.norm.weight

    def rotate(self, x, positions):
        r = self.rotary_dim
        exponents = torch.arange(0, r, 2, dtype=torch.float64) / r
        angles = positions.double()[:, None] / self.base ** exponents[None]
        cos, sin = angles.cos(), angles.sin()
        xd, rest = x[..., :r].double(), x[..., r:]
        if self.interleaved:
            a, b = xd[..., 0::2], xd[..., 1::2]
            rotated = torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
        else:
            a, b = xd[..., :r // 2], xd[..., r // 2:]
            rotated = torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
        return torch.cat([rotated.to(x.dtype), rest], -1)

    def forward(self, x, mask=None, past=None):
        b, s, _ = x.shape
        h = self.normed(x)
        q = self.q_proj(h).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        start = 0 if past is None else past[0].shape[2]
        if self.rope:
            positions = torch.arange(start, start + s)
            q, k = self.rotate(q, positions), self.rotate(k, positions)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        attn, _ = ref_attention(q, k, v, causal=True, window=self.window, mask=mask)
        attn = attn.transpose(1, 2).reshape(b, s, -1)
        gate = self.gate_proj(h)
        act = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        mlp = self.down_proj(act * self.up_proj(h))
        return x + self.o_proj(attn) + mlp, (k, v)


def _perturbed(block):
    with torch.no_grad():
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return block


def make_pair(d_model=48, n_heads=6, n_kv_heads=2, intermediate=80, **options):
    plain_options = {k: options[k] for k in ("head_dim", "norm", "activation", "bias", "rope", "window", "eps")
                     if k in options}
    if "rope_interleaved" in options:
        plain_options["interleaved"] = options["rope_interleaved"]
    if "rotary_dim" in options:
        plain_options["rotary_dim"] = options["rotary_dim"]
    fused = _perturbed(ParallelBlock(d_model, n_heads, n_kv_heads, intermediate, **options))
    plain = PlainParallelBlock(d_model, n_heads, n_kv_heads, intermediate, **plain_options)
    plain.load_state_dict(fused.state_dict())
    return fused, plain


def _grads(module, x, out, grad):
    module.zero_grad(set_to_none=True)
    x.grad = None
    (out * grad).sum().backward()
    grads = {"x": x.grad.clone()}
    grads.update({n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None})
    return grads


def _fused_grads_by_part(fused, grads):
    """The fused block's gradients cut into the separate projections' names."""
    out = {"x": grads["x"]}
    if "norm.weight" in grads:
        out["norm.weight"] = grads["norm.weight"]
    if "norm.bias" in grads:
        out["norm.bias"] = grads["norm.bias"]
    saved = {n: p.data for n, p in fused.named_parameters()}
    try:
        for name in ("in_proj_weight", "out_proj_weight", "in_proj_bias", "out_proj_bias"):
            if name in grads:
                getattr(fused, name).data = grads[name]
        out.update({k: v.clone() for k, v in fused.projections().items()})
    finally:
        for n, p in fused.named_parameters():
            p.data = saved[n]
    return out


CASES = [
    ("gqa", {}),
    ("mha-bias", dict(n_kv_heads=6, bias=True)),
    ("layernorm-gelu", dict(norm="layer", activation="gelu_tanh", bias=True)),
    ("window", dict(window=3)),
    ("interleaved-partial", dict(rope_interleaved=True, rotary_dim=4)),
    ("no-rope-headdim", dict(rope=False, head_dim=12)),
]


@pytest.mark.parametrize("name, options", CASES, ids=[c[0] for c in CASES])
def test_equals_the_eager_parallel_formula(name, options):
    fused, plain = make_pair(**options)
    x = torch.randn(2, 11, 48, requires_grad=True)
    out = fused(x)
    ref, _ = plain(x)
    assert_close(out, ref, FORWARD_TOL[torch.float32], "output")
    grad = torch.randn_like(ref)
    fused_grads = _fused_grads_by_part(fused, _grads(fused, x, out, grad))
    ref_grads = _grads(plain, x, ref, grad)
    assert fused_grads.keys() == ref_grads.keys()
    for key in ref_grads:
        assert_close(fused_grads[key], ref_grads[key], GRAD_TOL[torch.float32], key)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks(kind):
    fused, plain = make_pair()
    x = torch.randn(2, 9, 48)
    if kind == "bool":
        mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
        mask[1, ..., :3] = False  # left padding in the second sequence
    else:
        mask = torch.randn(2, 6, 9, 9)
    out = fused(x, mask=mask)
    ref, _ = plain(x, mask=mask)
    if kind == "bool":
        # the padded queries see no key: zeros from attention here, NaN in the plain softmax
        assert_close(out[1, :3], x[1, :3] + plain.down_proj(
            F.silu(plain.gate_proj(plain.normed(x[1, :3]))) * plain.up_proj(plain.normed(x[1, :3]))),
            FORWARD_TOL[torch.float32])
        out, ref = out[:, 3:], ref[:, 3:]
    assert_close(out, ref, FORWARD_TOL[torch.float32])


def test_bfloat16_close_to_float32_formula():
    fused, plain = make_pair()
    x = torch.randn(2, 13, 48)
    ref, _ = plain(x)
    out = fused.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    assert_close(out.float(), ref, (5e-2, 5e-2))


def test_state_dict_names_and_round_trip():
    block = _perturbed(ParallelBlock(32, 4, 2, 40, bias=True))
    state = block.state_dict()
    assert list(state) == ["norm.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                           "up_proj.weight", "o_proj.weight", "down_proj.weight", "q_proj.bias", "k_proj.bias",
                           "v_proj.bias", "gate_proj.bias", "up_proj.bias", "o_proj.bias", "down_proj.bias"]
    assert state["q_proj.weight"].shape == (32, 32) and state["k_proj.weight"].shape == (16, 32)
    assert state["down_proj.weight"].shape == (32, 40) and state["down_proj.weight"].is_contiguous()
    # separate tensors, not views of the parameters
    assert state["q_proj.weight"].data_ptr() != block.in_proj_weight.data_ptr()
    other = ParallelBlock(32, 4, 2, 40, bias=True)
    other.load_state_dict(state)
    for name, p in block.named_parameters():
        assert torch.equal(p, other.get_parameter(name)), name
    # the fused names load too
    fused_names = {n: p.detach() for n, p in block.named_parameters()}
    third = ParallelBlock(32, 4, 2, 40, bias=True)
    third.load_state_dict(fused_names)
    assert torch.equal(third.out_proj_bias, block.out_proj_bias)
    # nested inside a model, with a prefix
    model = nn.Sequential(ParallelBlock(32, 4, 2, 40), ParallelBlock(32, 4, 2, 40))
    keys = list(model.state_dict())
    assert "0.q_proj.weight" in keys and "1.down_proj.weight" in keys
    copy_ = nn.Sequential(ParallelBlock(32, 4, 2, 40), ParallelBlock(32, 4, 2, 40))
    copy_.load_state_dict(model.state_dict())
    x = torch.randn(1, 5, 32)
    assert torch.equal(copy_(x), model(x))


def test_loads_separate_projections_from_a_sequential_model():
    """Weights stored apart (a Llama-style sequential block) load by name and give the parallel function."""
    torch.manual_seed(1)
    attention = GQAttention(48, 6, 2)
    mlp = GatedMLP(48, 80)
    norm = RMSNorm(48)
    with torch.no_grad():
        norm.weight.add_(torch.randn(48) * 0.1)
    state = {"norm.weight": norm.weight}
    state.update({f"{n}.weight": getattr(attention, n).weight for n in ("q_proj", "k_proj", "v_proj", "o_proj")})
    state.update({f"{n}.weight": getattr(mlp, n).weight for n in ("gate_proj", "up_proj", "down_proj")})
    block = ParallelBlock(48, 6, 2, 80)
    block.load_state_dict(state)
    x = torch.randn(2, 7, 48)
    h = norm(x)
    expected = x + attention(h) + mlp(h)
    assert_close(block(x), expected, FORWARD_TOL[torch.float32])
    built = ParallelBlock.from_sequential(attention, mlp, norm)
    assert_close(built(x), expected, FORWARD_TOL[torch.float32])
    assert sum(p.numel() for p in built.parameters()) == sum(
        p.numel() for m in (attention, mlp, norm) for p in m.parameters())


def test_state_dict_errors():
    block = ParallelBlock(32, 4, 2, 40)
    state = block.state_dict()
    del state["v_proj.weight"]
    with pytest.raises(RuntimeError, match="v_proj.weight"):
        block.load_state_dict(state)
    state = ParallelBlock(32, 4, 2, 48).state_dict()
    with pytest.raises(RuntimeError, match="gate_proj.weight has shape"):
        block.load_state_dict(state)
    with pytest.raises(RuntimeError, match="bias=False"):
        block.load_state_dict(ParallelBlock(32, 4, 2, 40, bias=True).state_dict())


def test_projections_are_views():
    block = ParallelBlock(32, 4, 2, 40)
    views = block.projections()
    with torch.no_grad():
        views["up_proj.weight"].fill_(0.5)
    assert torch.all(block.in_proj_weight[32 + 16 + 16 + 40:] == 0.5)
    assert views["o_proj.weight"].shape == (32, 32) and views["down_proj.weight"].shape == (32, 40)


@pytest.mark.parametrize("ring", [False, True], ids=["whole cache", "window ring"])
@pytest.mark.parametrize("chunks", [[7, 1, 1, 1], [4, 3, 2, 1]])
def test_kv_cache_decoding_equals_full_forward(chunks, ring):
    fused, plain = make_pair(window=5)
    fused.eval()
    x = torch.randn(2, sum(chunks), 48)
    with torch.no_grad():
        full = fused(x)
        ref, _ = plain(x)
        cache = KVCache(window=5) if ring else KVCache(capacity=2)
        pieces, start = [], 0
        for n in chunks:
            pieces.append(fused(x[:, start:start + n], cache=cache))
            start += n
    assert len(cache) == sum(chunks)
    assert_close(torch.cat(pieces, 1), full, FORWARD_TOL[torch.float32])
    assert_close(full, ref, FORWARD_TOL[torch.float32])


def test_dropout_matches_the_sequential_modules_under_the_same_seed():
    torch.manual_seed(3)
    attention = GQAttention(48, 6, 2, dropout=0.3)
    mlp = GatedMLP(48, 80)
    norm = RMSNorm(48)
    block = ParallelBlock.from_sequential(attention, mlp, norm)
    assert block.dropout == 0.3 and block.training
    x = torch.randn(2, 9, 48)
    torch.manual_seed(10)
    out = block(x)
    torch.manual_seed(10)
    h = norm(x)
    expected = x + attention(h) + mlp(h)
    assert_close(out, expected, FORWARD_TOL[torch.float32])
    torch.manual_seed(11)
    assert not torch.allclose(block(x), out)
    block.eval()
    attention.eval()
    assert_close(block(x), x + attention(h) + mlp(h), FORWARD_TOL[torch.float32])


@pytest.mark.slow
def test_torch_compile_fullgraph():
    fused, _ = make_pair(bias=True)
    compiled = torch.compile(copy.deepcopy(fused), fullgraph=True)
    x = torch.randn(2, 11, 48, requires_grad=True)
    grad = torch.randn(2, 11, 48)
    out = fused(x)
    eager_grads = _grads(fused, x, out, grad)
    compiled_out = compiled(x)
    compiled_grads = _grads(compiled, x, compiled_out, grad)
    assert_close(compiled_out, out, FORWARD_TOL[torch.float32])
    for key, value in eager_grads.items():
        key = key if key == "x" else f"_orig_mod.{key}"
        assert_close(compiled_grads[key], value, GRAD_TOL[torch.float32], key)


def test_empty_inputs():
    block = ParallelBlock(32, 4, 2, 40)
    for shape in ((0, 5, 32), (2, 0, 32)):
        x = torch.randn(*shape, requires_grad=True)
        out = block(x)
        assert out.shape == shape
        out.sum().backward()
        assert x.grad.shape == shape


def test_meta_device_and_repr():
    block = ParallelBlock(32, 4, 2, 40, device="meta")
    assert block.in_proj_weight.is_meta and block.in_proj_weight.shape == (32 + 16 + 16 + 80, 32)
    assert block.out_proj_weight.shape == (32, 72)
    text = repr(ParallelBlock(32, 4, 2, 40, window=8))
    assert "intermediate_size=40" in text and "window=8" in text



# (kwargs, the argument a row is about, the whole message)
BAD_CONSTRUCTOR_ARGUMENTS = [
    (dict(d_model=0), "d_model", "fusedllm.nn.ParallelBlock: d_model must be a positive int, got 0"),
    (dict(n_heads=3), "n_heads", "fusedllm.nn.ParallelBlock: n_heads (3) must be a multiple of n_kv_heads (2)"),
    (dict(n_kv_heads=3), "n_kv_heads",
     "fusedllm.nn.ParallelBlock: n_heads (4) must be a multiple of n_kv_heads (3)"),
    (dict(n_kv_heads=0), "n_kv_heads", "fusedllm.nn.ParallelBlock: n_kv_heads must be a positive int, got 0"),
    (dict(intermediate_size=None), "intermediate_size",
     "fusedllm.nn.ParallelBlock: intermediate_size must be given (the gated hidden width)"),
    (dict(intermediate_size=-4), "intermediate_size",
     "fusedllm.nn.ParallelBlock: intermediate_size must be a positive int, got -4"),
    (dict(norm="batch"), "norm", "fusedllm.nn.ParallelBlock: norm must be one of ('rms', 'layer'), got 'batch'"),
    (dict(activation="relu"), "activation",
     "fusedllm.nn.ParallelBlock: activation must be one of ('silu', 'gelu_tanh'), got 'relu'"),
    (dict(bias=1), "bias", "fusedllm.nn.ParallelBlock: bias must be True or False, got 1"),
    (dict(rope="yes"), "rope", "fusedllm.nn.ParallelBlock: rope must be True or False, got 'yes'"),
    (dict(window=0), "window", "fusedllm.nn.ParallelBlock: window must be a positive int, got 0"),
    (dict(dropout=1.0), "dropout", "fusedllm.nn.ParallelBlock: dropout must be a number in [0, 1), got 1.0"),
    (dict(eps=-1.0), "eps", "fusedllm.nn.ParallelBlock: eps must be a number >= 0, got -1.0"),
    (dict(rotary_dim=5), "rotary_dim",
     "fusedllm.nn.ParallelBlock: rotary_dim must be a positive even number at most the head dim 8, got 5"),
    (dict(head_dim=7), "head_dim", "fusedllm.nn.ParallelBlock: rope=True needs an even head_dim, got 7"),
    (dict(head_dim=0), "head_dim", "fusedllm.nn.ParallelBlock: head_dim must be a positive int, got 0"),
]


@pytest.mark.parametrize("kwargs, message", [pytest.param(kwargs, message, id=f"kwargs{i}-{name}")
                                             for i, (kwargs, name, message) in enumerate(BAD_CONSTRUCTOR_ARGUMENTS)])
def test_bad_constructor_arguments(kwargs, message):
    args = dict(d_model=32, n_heads=4, n_kv_heads=2, intermediate_size=40)
    args.update(kwargs)
    with pytest.raises(ValueError, match=whole(message)):
        ParallelBlock(**args)


def test_bad_forward_arguments():
    block = ParallelBlock(32, 4, 2, 40)
    with pytest.raises(ValueError, match=whole(
            "fusedllm.nn.ParallelBlock: x must be [batch, seq, d_model=32], got [2, 5, 16]")):
        block(torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match=whole(
            "fusedllm.nn.ParallelBlock: x must be [batch, seq, d_model=32], got [5, 32]")):
        block(torch.randn(5, 32))
    with pytest.raises(ValueError, match="x is torch.float64"):
        block(torch.randn(1, 5, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"mask of shape \[3, 3, 7, 7\] does not broadcast to \[batch, q_heads, q_len, "
                                         r"kv_len\] = \[1, 4, 5, 5\]$"):
        block(torch.randn(1, 5, 32), mask=torch.ones(3, 3, 7, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match=whole(
            "fusedllm.nn.ParallelBlock: cache must be a fusedllm.nn.KVCache, got list")):
        block(torch.randn(1, 5, 32), cache=[])
    with pytest.raises(ValueError, match=whole(
            "fusedllm.nn.ParallelBlock: mask must be a torch.Tensor or None, got list")):
        block(torch.randn(1, 5, 32), mask=[[True]])
    with pytest.raises(ValueError, match=whole(
            "fusedllm.nn.ParallelBlock: position_offset must be an int >= 0, got -1")):
        block(torch.randn(1, 5, 32), position_offset=-1)
    with pytest.raises(ValueError, match=whole(
            "fusedllm.nn.ParallelBlock.from_sequential: attention must be a fusedllm.nn.GQAttention, got Linear")):
        ParallelBlock.from_sequential(nn.Linear(2, 2), GatedMLP(32, 40))
    with pytest.raises(ValueError, match=whole(
            "fusedllm.nn.ParallelBlock.from_sequential: mlp must be a fusedllm.nn.GatedMLP, got Linear")):
        ParallelBlock.from_sequential(GQAttention(32, 4), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=whole(
            "fusedllm.nn.ParallelBlock.from_sequential: norm must be a fusedllm.nn.RMSNorm or nn.LayerNorm, "
            "got Identity")):
        ParallelBlock.from_sequential(GQAttention(32, 4), GatedMLP(32, 40), nn.Identity())


# --- fusedllm.patch on Hugging Face parallel-residual decoders -----------------------------------

transformers = pytest.importorskip("transformers")


def _hf_parallel(kind):
    common = dict(vocab_size=64, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "gptj":
        return transformers.GPTJForCausalLM(transformers.GPTJConfig(
            vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, bos_token_id=1,
            eos_token_id=2, pad_token_id=0))
    if kind in ("neox", "neox-sequential"):
        return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
            **common, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            use_parallel_residual=kind == "neox",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}))
    if kind == "cohere":
        return transformers.CohereForCausalLM(transformers.CohereConfig(
            **common, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, logit_scale=0.5))
    if kind == "falcon":
        return transformers.FalconForCausalLM(transformers.FalconConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, parallel_attn=True,
            bos_token_id=1, eos_token_id=2, pad_token_id=0))
    raise AssertionError(kind)


# kind -> (fused layer class name, number of kept norm / activation entries per layer)
HF_PARALLEL = {
    "gptj": ("FusedGPTJBlock", 2),
    "neox": ("FusedGPTNeoXLayer", 3),
    "cohere": ("FusedCohereDecoderLayer", 1),
}


def _logits_and_grads(model, ids, mask, grad=None):
    out = model(input_ids=ids, attention_mask=mask).logits
    grad = torch.randn_like(out) if grad is None else grad
    model.zero_grad(set_to_none=True)
    (out * grad).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, grad


@pytest.mark.parametrize("seq", [9, 40])  # below and above the joint-GEMM threshold (32 tokens)
@pytest.mark.parametrize("kind", list(HF_PARALLEL))
def test_hf_parallel_patched_equals_unpatched(kind, seq):
    torch.manual_seed(0)
    model = _perturbed(_hf_parallel(kind)).eval()
    ids = torch.randint(3, 64, (2, seq))
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, -3:] = 0  # right padding in the second sequence
    ref_out, ref_grads, grad = _logits_and_grads(model, ids, mask)
    params_before = list(model.parameters())
    state_keys = list(model.state_dict())
    report = fusedllm.patch(model, verify=True)
    fused_name, kept = HF_PARALLEL[kind]
    layers = [r for r in report.replaced if r.replacement.endswith(fused_name)]
    assert len(layers) == 2, str(report)
    assert all("not compared" in r.note and "output GEMM" in r.note for r in layers)
    assert len([item for item in report.left if item.reason.startswith("kept")]) == 2 * kept, str(report)
    assert "LayerNorm" in str(report)
    assert all(a is b for a, b in zip(model.parameters(), params_before))
    assert list(model.state_dict()) == state_keys
    out, grads, _ = _logits_and_grads(model, ids, mask, grad)
    keep = mask.bool()  # padded positions are not compared (eager averages them, fused gives zeros)
    assert_close(out[keep], ref_out[keep], (2e-5, 2e-5))
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert_close(grads[name], ref_grads[name], GRAD_TOL[torch.float32], name)
    # greedy decoding through the model's KV cache
    prompt = torch.randint(3, 64, (1, 6))
    with torch.no_grad():
        fused_tokens = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert fusedllm.unpatch(model) == len(report.replaced)
    assert not any(type(m).__module__.startswith("fusedllm") for m in model.modules())
    with torch.no_grad():
        ref_tokens = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(fused_tokens, ref_tokens)
    out, _, _ = _logits_and_grads(model, ids, mask, grad)
    assert_close(out, ref_out, FORWARD_TOL[torch.float32])


def test_hf_fused_layers_keep_transformers_classes_and_hooks():
    model = _hf_parallel("cohere").eval()
    fusedllm.patch(model)
    layer = model.model.layers[0]
    assert isinstance(layer, transformers.models.cohere.modeling_cohere.CohereDecoderLayer)
    assert type(layer).__module__ == "fusedllm.compat.hf_parallel"
    ids = torch.randint(3, 64, (1, 7))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    assert len(out.hidden_states) == 3  # embeddings + one per (fused) layer


def test_hf_neox_sequential_and_falcon_are_reported_as_left():
    neox = _hf_parallel("neox-sequential")
    report = fusedllm.patch(neox)
    assert not report.replaced
    reasons = {item.path: item.reason for item in report.left}
    assert "use_parallel_residual=False" in reasons["gpt_neox.layers.0"]
    assert "fusedllm" in report.attention  # its attention still switches to the fused backend
    falcon = _hf_parallel("falcon")
    report = fusedllm.patch(falcon)
    assert not report.replaced
    reasons = {item.path: item.reason for item in report.left}
    assert "AttentionInterface" in reasons["transformer.h.0"]
    assert "Falcon computes attention itself" in report.attention


def test_hf_parallel_flag_and_training_dropout_fallback():
    model = _hf_parallel("gptj")
    report = fusedllm.patch(model, parallel=False)
    assert not report.replaced and {item.reason for item in report.left} == {"parallel=False"}
    # residual dropout in training: the fused layer runs the original code
    config = transformers.GPTJConfig(vocab_size=64, n_positions=64, n_embd=32, n_layer=1, n_head=4, rotary_dim=4,
                                     resid_pdrop=0.5)
    model = transformers.GPTJForCausalLM(config).train()
    fusedllm.patch(model)
    ids = torch.randint(3, 64, (1, 5))
    torch.manual_seed(0)
    out = model(input_ids=ids).logits
    fusedllm.unpatch(model)
    torch.manual_seed(0)
    assert torch.equal(model(input_ids=ids).logits, out)
