"""rope (rotary position embedding): kernels, tables, the module, Hugging Face parity."""

import copy
import re

import pytest
import torch
from torch import nn
from hypothesis import given, settings
from hypothesis import strategies as st

import fusedllm
import fusedllm.compat.nb000  # noqa: F401
from checks import FORWARD_TOL, GRAD_TOL, assert_close, run_python
from reference import rope as ref_rope
from testkit.notebook_models import NotebookRotaryEmbedding

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
ops = torch.ops.fusedllm


def make_qk(batch, hq, hkv, seq, dim, dtype, device):
    q = torch.randn(batch, hq, seq, dim, dtype=dtype, device=device)
    k = torch.randn(batch, hkv, seq, dim, dtype=dtype, device=device)
    return q, k


def reference_grads(x, cos, sin, positions, grad, interleaved, rotary_dim):
    xd = x.detach().double().requires_grad_()
    y = ref_rope(xd, cos.double(), sin.double(), positions, interleaved, rotary_dim)
    (g,) = torch.autograd.grad(y, xd, grad.double())
    return g


# The CPU-variant runs take the short cases only.
CASES = [pytest.param(d, s, marks=pytest.mark.cpu_variants) for d in (2, 64, 80, 128, 256) for s in (1, 17)]
CASES += [(128, 2048), (80, 2048)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim,seq", CASES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_rope_matches_reference(device, dtype, dim, seq, interleaved, partial):
    rotary_dim = dim // 2 if partial and (dim // 2) % 2 == 0 else dim
    q, k = make_qk(2, 4, 2, seq, dim, dtype, device)
    before = (q.clone(), k.clone())
    cos, sin = fusedllm.rope_tables(rotary_dim, seq + 7, device=device)
    positions = (torch.arange(seq, device=device) + 7).expand(2, seq)
    q.requires_grad_()
    k.requires_grad_()
    qo, ko = fusedllm.apply_rope(q, k, cos, sin, offset=7, interleaved=interleaved, rotary_dim=rotary_dim)
    assert qo.dtype == dtype and qo.shape == q.shape and ko.shape == k.shape
    assert_close(qo, ref_rope(q.detach(), cos, sin, positions, interleaved, rotary_dim), FORWARD_TOL[dtype])
    assert_close(ko, ref_rope(k.detach(), cos, sin, positions, interleaved, rotary_dim), FORWARD_TOL[dtype])
    if rotary_dim < dim:
        assert torch.equal(qo[..., rotary_dim:], q.detach()[..., rotary_dim:])  # passed through untouched

    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    torch.autograd.backward([qo, ko], [gq, gk])
    assert_close(q.grad, reference_grads(q, cos, sin, positions, gq, interleaved, rotary_dim), GRAD_TOL[dtype])
    assert_close(k.grad, reference_grads(k, cos, sin, positions, gk, interleaved, rotary_dim), GRAD_TOL[dtype])
    assert torch.equal(q.detach(), before[0]) and torch.equal(k.detach(), before[1]), "inputs modified"


@pytest.mark.cpu_variants
@pytest.mark.parametrize("interleaved", [False, True])
def test_position_ids_and_offset_agree(device, interleaved):
    q, k = make_qk(3, 4, 1, 9, 64, torch.float32, device)
    cos, sin = fusedllm.rope_tables(64, 64, device=device)
    by_offset = fusedllm.apply_rope(q, k, cos, sin, offset=11, interleaved=interleaved)
    ids = torch.arange(11, 20, device=device)
    for position_ids in (ids, ids[None], ids.expand(3, 9), ids.int()):
        by_ids = fusedllm.apply_rope(q, k, cos, sin, position_ids=position_ids, interleaved=interleaved)
        assert torch.equal(by_ids[0], by_offset[0]) and torch.equal(by_ids[1], by_offset[1])
    # different positions per batch row (left padding)
    per_row = torch.stack([ids, ids - 3, ids + 20])
    out_q, _ = fusedllm.apply_rope(q, k, cos, sin, position_ids=per_row, interleaved=interleaved)
    assert_close(out_q, ref_rope(q, cos, sin, per_row, interleaved), FORWARD_TOL[torch.float32])


def test_relative_position_property(device):
    """<rope(q, m), rope(k, n)> depends only on m - n."""
    q, k = make_qk(1, 1, 1, 1, 128, torch.float64, device)
    cos, sin = fusedllm.rope_tables(128, 512, device=device)
    dots = []
    for m, n in [(5, 2), (103, 100), (403, 400)]:
        qm, _ = fusedllm.apply_rope(q, k, cos, sin, offset=m)
        _, kn = fusedllm.apply_rope(q, k, cos, sin, offset=n)
        dots.append((qm * kn).sum().item())
    # tables are float32 (like transformers'), so angles carry float32 rounding
    assert dots[1] == pytest.approx(dots[0], rel=1e-4, abs=1e-4)
    assert dots[2] == pytest.approx(dots[0], rel=1e-4, abs=1e-4)


@pytest.mark.cpu_variants
def test_in_place_variant_matches_out_of_place(device):
    q, k = make_qk(2, 4, 2, 13, 80, torch.bfloat16, device)
    cos, sin = fusedllm.rope_tables(64, 32, device=device)
    expected = fusedllm.apply_rope(q, k, cos, sin, offset=3, rotary_dim=64)
    q2, k2 = q.clone(), k.clone()
    out = fusedllm.apply_rope(q2, k2, cos, sin, offset=3, rotary_dim=64, inplace=True)
    assert out[0] is q2 and out[1] is k2
    assert torch.equal(q2, expected[0]) and torch.equal(k2, expected[1])


@pytest.mark.cpu_variants
def test_strided_views_of_a_fused_qkv_projection(device):
    batch, seq, hq, hkv, dim = 2, 11, 4, 2, 64
    qkv = torch.randn(batch, seq, (hq + 2 * hkv) * dim, device=device)
    q = qkv[..., : hq * dim].view(batch, seq, hq, dim).transpose(1, 2)  # [B, H, S, D] view
    k = qkv[..., hq * dim:(hq + hkv) * dim].view(batch, seq, hkv, dim).transpose(1, 2)
    assert not q.is_contiguous()
    cos, sin = fusedllm.rope_tables(dim, seq, device=device)
    qo, ko = fusedllm.apply_rope(q, k, cos, sin)
    positions = torch.arange(seq, device=device).expand(batch, seq)
    assert_close(qo, ref_rope(q, cos, sin, positions), FORWARD_TOL[torch.float32])
    assert_close(ko, ref_rope(k, cos, sin, positions), FORWARD_TOL[torch.float32])
    # in place on the views rotates inside the projection buffer
    fusedllm.apply_rope(q, k, cos, sin, inplace=True)
    assert torch.equal(q, qo) and torch.equal(k, ko)


@settings(max_examples=50, deadline=None)
@given(
    batch=st.integers(1, 3), hq=st.integers(1, 4), hkv=st.integers(1, 3), seq=st.integers(1, 40),
    half_dim=st.integers(1, 72), rotary_frac=st.sampled_from([1.0, 0.5, 0.25]),
    interleaved=st.booleans(), dtype=st.sampled_from(DTYPES), offset=st.integers(0, 50),
)
def test_hypothesis_shapes(batch, hq, hkv, seq, half_dim, rotary_frac, interleaved, dtype, offset):
    dim = 2 * half_dim
    rotary_dim = max(2, int(dim * rotary_frac) // 2 * 2)
    q, k = make_qk(batch, hq, hkv, seq, dim, dtype, "cpu")
    cos, sin = fusedllm.rope_tables(rotary_dim, offset + seq)
    qo, ko = fusedllm.apply_rope(q, k, cos, sin, offset=offset, interleaved=interleaved, rotary_dim=rotary_dim)
    positions = (torch.arange(seq) + offset).expand(batch, seq)
    assert_close(qo, ref_rope(q, cos, sin, positions, interleaved, rotary_dim), FORWARD_TOL[dtype])
    assert_close(ko, ref_rope(k, cos, sin, positions, interleaved, rotary_dim), FORWARD_TOL[dtype])


# --- Hugging Face and notebook parity -----------------------------------------------------

def _llama_rotary(rope_parameters, head_dim=64, max_positions=128):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4,
                         max_position_embeddings=max_positions, rope_parameters=rope_parameters)
    return LlamaRotaryEmbedding(config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_stands_in_for_hf_apply_rotary_pos_emb(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    hf_rotary = _llama_rotary({"rope_type": "default", "rope_theta": 10000.0})
    q, k = make_qk(2, 4, 2, 19, 64, dtype, "cpu")
    position_ids = torch.stack([torch.arange(19), torch.arange(19) + 5])
    cos, sin = hf_rotary(q, position_ids)  # [B, S, D], duplicated halves, in q's dtype
    expected = apply_rotary_pos_emb(q, k, cos, sin)
    got = fusedllm.apply_rope(q, k, cos, sin)
    # transformers rounds cos/sin and each product to bfloat16; fusedllm keeps float32 inside
    tol = FORWARD_TOL[dtype] if dtype == torch.float32 else (3e-2, 3e-2)
    assert_close(got[0], expected[0], tol)
    assert_close(got[1], expected[1], tol)


SCALINGS = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64, "rope_theta": 500000.0},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0,
     "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5},
]


@pytest.mark.parametrize("rope_parameters", SCALINGS, ids=lambda p: p["rope_type"])
def test_tables_equal_transformers(rope_parameters):
    hf_rotary = _llama_rotary(rope_parameters, head_dim=64, max_positions=128)
    positions = 300 if rope_parameters["rope_type"] == "dynamic" else 128  # dynamic: past the original
    x = torch.randn(1, positions, 64)
    hf_cos, hf_sin = hf_rotary(x, torch.arange(positions)[None])
    scaling = {key: v for key, v in rope_parameters.items() if key != "rope_theta"}
    if rope_parameters["rope_type"] == "dynamic":
        scaling["original_max_position_embeddings"] = 128
    cos, sin = fusedllm.rope_tables(64, positions, rope_parameters["rope_theta"], scaling)
    # transformers computes dynamic NTK's base with float32 tensors, we in Python floats
    tol = 1e-5 if rope_parameters["rope_type"] == "dynamic" else 0.0
    torch.testing.assert_close(cos, hf_cos[0, :, :32], atol=tol, rtol=0)
    torch.testing.assert_close(sin, hf_sin[0, :, :32], atol=tol, rtol=0)
    torch.testing.assert_close(hf_cos[0, :, 32:], hf_cos[0, :, :32])  # HF duplicates the halves


def test_module_matches_the_notebook_rotary_embedding():
    original = NotebookRotaryEmbedding(64, max_len=256)
    fused = fusedllm.nn.RotaryEmbedding(64, max_positions=256)
    torch.testing.assert_close(fused.cos_cached, original.cos_cached)
    q, k = make_qk(2, 4, 4, 21, 64, torch.float32, "cpu")
    for offset in (0, 9):
        expected = original(q, k, position_offset=offset)
        got = fused(q, k, position_offset=offset)
        assert_close(got[0], expected[0], FORWARD_TOL[torch.float32])
        assert_close(got[1], expected[1], FORWARD_TOL[torch.float32])


def test_module_built_on_meta_gets_its_tables_when_materialised():
    with torch.device("meta"):
        attention = fusedllm.nn.GQAttention(64, 2, max_positions=64)
    attention.to_empty(device="cpu")
    fresh_cos, fresh_sin = fusedllm.rope_tables(32, 64)
    assert torch.equal(attention.rotary.cos_cached, fresh_cos)
    assert torch.equal(attention.rotary.sin_cached, fresh_sin)


def test_module_tables_grow_instead_of_failing():
    small = fusedllm.nn.RotaryEmbedding(32, max_positions=16)
    big = fusedllm.nn.RotaryEmbedding(32, max_positions=64)
    q, k = make_qk(1, 2, 1, 10, 32, torch.float32, "cpu")
    got = small(q, k, position_offset=30)
    assert small.max_positions >= 40
    expected = big(q, k, position_offset=30)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    small(q, k, position_ids=torch.tensor([0, 5, 900, 3, 4, 5, 6, 7, 8, 9]))
    assert small.max_positions > 900


# Modules holding rope tables, and how to reach the RotaryEmbedding inside.
ROPE_MODULES = {
    "RotaryEmbedding": (lambda: fusedllm.nn.RotaryEmbedding(32, max_positions=64), lambda m: m),
    "GQAttention": (lambda: fusedllm.nn.GQAttention(64, 2, max_positions=64), lambda m: m.rotary),
    "nb000.RotaryPositionalEmbedding": (
        lambda: fusedllm.compat.nb000.RotaryPositionalEmbedding(32, max_len=64), lambda m: m),
}
CASTS = {
    "to(bfloat16)": lambda m: m.to(torch.bfloat16),
    "half()": lambda m: m.half(),
    "bfloat16()": lambda m: m.bfloat16(),
    "to(float64)": lambda m: m.to(torch.float64),
    "double()": lambda m: m.double(),
    "to(cpu, float16)": lambda m: m.to("cpu", torch.float16),
    "to(device=cpu, dtype=bfloat16)": lambda m: m.to(device="cpu", dtype=torch.bfloat16),
    "to(cpu)": lambda m: m.to("cpu"),
    "to(bfloat16).float()": lambda m: m.to(torch.bfloat16).float(),
}


@pytest.mark.parametrize("cast", list(CASTS))
@pytest.mark.parametrize("module", list(ROPE_MODULES))
def test_module_casts_keep_the_tables_exact(module, cast):
    make, rotary_of = ROPE_MODULES[module]
    fresh_cos, fresh_sin = fusedllm.rope_tables(32, 64)
    m = CASTS[cast](make())
    rotary = rotary_of(m)
    for got in (rotary, copy.deepcopy(rotary)):
        assert got.cos_cached.dtype == torch.float32 and got.sin_cached.dtype == torch.float32
        assert torch.equal(got.cos_cached, fresh_cos), (got.cos_cached - fresh_cos).abs().max()
        assert torch.equal(got.sin_cached, fresh_sin), (got.sin_cached - fresh_sin).abs().max()
    m.load_state_dict(make().state_dict())  # nb000 saves its tables
    assert torch.equal(rotary.cos_cached, fresh_cos) and rotary.cos_cached.dtype == torch.float32
    dtype = CASTS[cast](nn.Linear(1, 1)).weight.dtype
    assert all(p.dtype == dtype for p in m.parameters())  # the rest did follow the cast
    q, k = make_qk(1, 2, 1, 4, 32, dtype, "cpu")
    got = rotary(q, k)
    expected = fusedllm.apply_rope(q, k, fresh_cos, fresh_sin)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.slow
def test_torch_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()
    rotary = fusedllm.nn.RotaryEmbedding(64, max_positions=64, interleaved=True).to(device)

    def step(q, k):
        qo, ko = rotary(q, k, position_offset=3)
        return (qo * 2).sum() + ko.square().sum()

    q, k = make_qk(2, 4, 2, 9, 64, torch.float32, device)
    q.requires_grad_()
    compiled = torch.compile(step, fullgraph=True)
    out_c = compiled(q, k)
    (grad_c,) = torch.autograd.grad(out_c, q)
    out_e = step(q, k)
    (grad_e,) = torch.autograd.grad(out_e, q)
    torch.testing.assert_close(out_c, out_e)
    torch.testing.assert_close(grad_c, grad_e)


# --- bad input ------------------------------------------------------------------------------

def _bad(**overrides):
    q, k = make_qk(2, 4, 2, 5, 16, torch.float32, "cpu")
    cos, sin = fusedllm.rope_tables(16, 8)
    args = dict(q=q, k=k, cos=cos, sin=sin)
    args.update(overrides)
    return lambda: fusedllm.apply_rope(**args)


BAD_CALLS = [
    ("rotary_dim must be a positive even number at most the head dim 16, got 7", _bad(rotary_dim=7)),
    ("rotary_dim must be a positive even number at most the head dim 16, got 32", _bad(rotary_dim=32)),
    ("rotary_dim must be a positive even number at most the head dim 16, got 0", _bad(rotary_dim=0)),
    ("q and k must have the same head dim", _bad(k=torch.randn(2, 2, 5, 8))),
    ("position_ids must be \\[S\\] or \\[B, S\\]", _bad(position_ids=torch.zeros(3, 5, dtype=torch.long))),
    ("position 8 is outside the cos/sin table of 8 positions",
     _bad(position_ids=torch.tensor([0, 1, 2, 3, 8]))),
    ("position -1 is outside the cos/sin table of 8 positions",
     _bad(position_ids=torch.tensor([[0, 1, 2, 3, 4], [0, 1, -1, 3, 4]]))),
    ("positions 6..10 are past the cos/sin table of 8 positions", _bad(offset=6)),
    ("q and k must be \\[B, H, S, D\\]", _bad(q=torch.randn(2, 5, 16))),
    ("cos and sin do not fit rotary_dim=16", _bad(cos=torch.randn(8, 5), sin=torch.randn(8, 5))),
    # a 2-D table of width rotary_dim: ours built for twice the dim, or a full-width one?
    ("cos and sin do not fit rotary_dim=16", _bad(cos=torch.randn(8, 16), sin=torch.randn(8, 16))),
    ("per-token cos and sin are ambiguous",
     _bad(cos=torch.randn(2, 5, 8), sin=torch.randn(2, 5, 8))),
    ("k has dtype", _bad(k=torch.randn(2, 2, 5, 16).double())),
    ("position_ids must be int64 or int32", _bad(position_ids=torch.zeros(5))),
    ("offset must be >= 0, got -1", _bad(offset=-1)),
    ("offset must be an int, got 1.5", _bad(offset=1.5)),
]


@pytest.mark.parametrize("message,call", BAD_CALLS, ids=[m for m, _ in BAD_CALLS])
def test_bad_input_is_a_clear_error(message, call):
    with pytest.raises(ValueError, match=message):
        call()


def test_a_table_for_another_head_dim_is_refused_not_misread():
    q, k = make_qk(1, 2, 5, 5, 32, torch.float32, "cpu")
    cos, sin = fusedllm.rope_tables(64, 64)  # [64, 32]: half-width tables for head dim 64
    with pytest.raises(ValueError) as error:
        fusedllm.apply_rope(q, k, cos, sin)
    message = str(error.value)
    for part in ("cos and sin", "[64, 32]", "[1, 2, 5, 32]", "rotary_dim=32",
                 "half-width table [positions, rotary_dim / 2]", "need last dim 16",
                 "Hugging Face's full-width duplicated-halves layout [B, S, rotary_dim]"):
        assert part in message, message


def _hf_layout(table, interleaved):
    """Our half-width table as Hugging Face's per-token full-width one [1, S, R]."""
    full = table.repeat_interleave(2, dim=-1) if interleaved else torch.cat([table, table], dim=-1)
    return full[None]


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_every_table_layout_reads_the_same_angles(interleaved):
    q, k = make_qk(2, 2, 1, 5, 16, torch.float32, "cpu")
    positions = torch.arange(5).expand(2, 5)
    for rotary_dim in (16, 8):
        cos, sin = fusedllm.rope_tables(rotary_dim, 5)
        expected = ref_rope(q, cos, sin, positions, interleaved, rotary_dim)
        layouts = {"table": (cos, sin), "ours per token": (cos[None].expand(2, 5, -1), sin[None]),
                   "Hugging Face per token": (_hf_layout(cos, interleaved), _hf_layout(sin, interleaved))}
        for name, (c, s) in layouts.items():
            if name == "ours per token":
                s = s.expand(2, 5, -1)
            got, _ = fusedllm.apply_rope(q, k, c, s, interleaved=interleaved, rotary_dim=rotary_dim)
            assert_close(got, expected, FORWARD_TOL[torch.float32], what=f"{name}, rotary_dim {rotary_dim}")
    # without rotary_dim: a table or Hugging Face's tables for the whole head
    cos, sin = fusedllm.rope_tables(16, 5)
    expected = ref_rope(q, cos, sin, positions, interleaved)
    for c, s in ((cos, sin), (_hf_layout(cos, interleaved), _hf_layout(sin, interleaved))):
        assert_close(fusedllm.apply_rope(q, k, c, s, interleaved=interleaved)[0], expected,
                     FORWARD_TOL[torch.float32])


def test_rotary_dim_rule_is_the_same_on_every_path():
    """The op (C++), apply_rope on it, and apply_rope on the plain path refuse
    the same values with the same words."""
    rule = "rotary_dim must be a positive even number at most the head dim 8, got {}"
    bad = (0, -2, 7, 10)
    code = f"""
        import torch, fusedllm
        assert fusedllm.backend() == "reference"
        q = torch.randn(1, 1, 4, 8); cos, sin = fusedllm.rope_tables(8, 4)
        for rotary_dim in {bad!r}:
            try:
                fusedllm.apply_rope(q, q, cos, sin, rotary_dim=rotary_dim)
            except ValueError as error:
                print("ERROR", error)
    """
    res = run_python(code, FUSEDLLM_DISABLE_EXTENSION="1")
    plain = [line[len("ERROR "):] for line in res.stdout.splitlines() if line.startswith("ERROR ")]
    assert res.returncode == 0 and len(plain) == len(bad), res.stdout + res.stderr
    q = torch.randn(1, 1, 4, 8)
    cos, sin = fusedllm.rope_tables(8, 4)
    for rotary_dim, plain_error in zip(bad, plain):
        expected = rule.format(rotary_dim)
        assert plain_error == "fusedllm.apply_rope: " + expected
        with pytest.raises(ValueError) as error:
            fusedllm.apply_rope(q, q, cos, sin, rotary_dim=rotary_dim)
        assert str(error.value) == plain_error
        # the op itself, with tables that fit any rotary_dim the check would let through
        width = max(rotary_dim, 0) // 2
        with pytest.raises(ValueError, match="^" + re.escape("fusedllm.rope: " + expected) + "$"):
            ops.rope(q, q, cos[:, :width], sin[:, :width], None, 0, False, rotary_dim, False)
    with pytest.raises(ValueError, match="^fusedllm.nn.RotaryEmbedding: rotary_dim must be a positive even"):
        fusedllm.nn.RotaryEmbedding(8, rotary_dim=0)


def test_in_place_refuses_autograd():
    q, k = make_qk(1, 1, 1, 3, 8, torch.float32, "cpu")
    cos, sin = fusedllm.rope_tables(8, 4)
    with pytest.raises(ValueError, match="inplace=True has no autograd"):
        fusedllm.apply_rope(q.requires_grad_(), k, cos, sin, inplace=True)


def _op_rope(k_dim=8, table_width=4, positions=None, offset=0, rotary_dim=-1):
    """torch.ops.fusedllm.rope on q [1, 1, 4, 8], k [1, 1, 4, k_dim] and cos / sin
    tables of 8 positions."""
    return ops.rope(torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, k_dim), torch.randn(8, table_width),
                    torch.randn(8, table_width), positions, offset, False, rotary_dim, False)


@pytest.mark.parametrize("error,message,call", [
    pytest.param(ValueError, r"position 99 is outside the cos/sin table of 8 positions",
                 lambda: _op_rope(positions=torch.tensor([0, 1, 2, 99])),
                 id="position_outside_table"),
    pytest.param(ValueError, r"cos and sin must have last dim 4 \(rotary_dim / 2\), got 3",
                 lambda: _op_rope(table_width=3),
                 id="table_width"),
    pytest.param(ValueError, r"positions 6\.\.9 are past the cos/sin table of 8 positions",
                 lambda: _op_rope(offset=6),
                 id="offset_past_table"),
    pytest.param(ValueError, r"q and k must have the same head dim, got 8 and 6",
                 lambda: _op_rope(k_dim=6),
                 id="head_dim_mismatch"),
    pytest.param(ValueError, r"rotary_dim must be a positive even number at most the head dim 8, got 5",
                 lambda: _op_rope(rotary_dim=5),
                 id="odd_rotary_dim"),
])
def test_operator_rejects_bad_input_without_crashing(error, message, call):
    with pytest.raises(error, match=message):
        call()


def test_in_place_refuses_a_bad_position_before_writing_a_row():
    """rope_ reads every position before it rotates a row: a refusal leaves q
    and k as they were, and names rope_."""
    q, k = torch.randn(2, 2, 5, 8), torch.randn(2, 1, 5, 8)
    q0, k0 = q.clone(), k.clone()
    positions = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 3, 8]])
    with pytest.raises(ValueError, match=r"^fusedllm\.rope_: position 8 is outside the cos/sin table of 8 positions$"):
        ops.rope_(q, k, torch.randn(8, 4), torch.randn(8, 4), positions, 0, False, -1, False)
    assert torch.equal(q, q0) and torch.equal(k, k0)


