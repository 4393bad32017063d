"""swiglu (SwiGLU / GeGLU gating) and the gated MLP modules."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fusedllm
from checks import FORWARD_TOL, GRAD_TOL, assert_close
from reference import swiglu as ref_swiglu
from testkit.notebook_models import NotebookSwiGLU

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
ACTIVATIONS = ["silu", "gelu_tanh"]
ops = torch.ops.fusedllm


def reference_grads(gate, up, grad_out, activation):
    """Exact gradients in float64 of sum(grad_out * act(gate) * up)."""
    g = gate.detach().double().requires_grad_()
    u = up.detach().double().requires_grad_()
    h = ref_swiglu(g, u, activation)
    return torch.autograd.grad(h, (g, u), grad_out.double())


@pytest.mark.cpu_variants
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("features", [1, 7, 4097])
@pytest.mark.parametrize("rows", [0, 1, 37])
@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_swiglu_matches_reference(device, dtype, activation, features, rows, packed):
    gate_up = (2 * torch.randn(rows, 2 * features)).to(dtype=dtype, device=device)
    before = gate_up.clone()
    if packed:
        x = gate_up.clone().requires_grad_()
        h = fusedllm.swiglu(x, activation=activation)
        gate, up = x.detach().chunk(2, dim=-1)
    else:
        gate = gate_up[:, :features].clone().requires_grad_()
        up = gate_up[:, features:].clone().requires_grad_()
        h = fusedllm.swiglu(gate, up, activation)
    assert h.shape == (rows, features) and h.dtype == dtype
    assert_close(h, ref_swiglu(gate.detach(), up.detach(), activation), FORWARD_TOL[dtype])

    dh = torch.randn_like(h)
    h.backward(dh)
    ref_dg, ref_du = reference_grads(gate, up, dh, activation)
    if packed:
        grad_gate, grad_up = x.grad.chunk(2, dim=-1)
    else:
        grad_gate, grad_up = gate.grad, up.grad
    assert_close(grad_gate, ref_dg, GRAD_TOL[dtype])
    assert_close(grad_up, ref_du, GRAD_TOL[dtype])
    assert torch.equal(gate_up, before), "input was modified"


@pytest.mark.cpu_variants
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_packed_and_split_forms_agree_exactly(device, dtype, activation):
    gate_up = torch.randn(3, 5, 2 * 131, dtype=dtype, device=device)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(fusedllm.swiglu(gate_up, activation=activation),
                       fusedllm.swiglu(gate.contiguous(), up.contiguous(), activation))
    dh = torch.randn(3, 5, 131, dtype=dtype, device=device)
    packed_grad = ops.swiglu_packed_backward(dh, gate_up, activation)
    split_grads = ops.swiglu_backward(dh, gate.contiguous(), up.contiguous(), activation)
    assert torch.equal(packed_grad, torch.cat(split_grads, dim=-1))


@pytest.mark.cpu_variants
@pytest.mark.parametrize("layout", ["halves_of_a_projection", "transposed", "strided_columns"])
def test_strided_inputs(device, layout):
    base = torch.randn(40, 2 * 96, device=device)
    if layout == "halves_of_a_projection":
        gate, up = base[:, :96], base[:, 96:]  # unit column stride, row stride 192: no copy
    elif layout == "transposed":
        gate, up = base[:, :96].t(), base[:, 96:].t()
    else:
        gate, up = base[:, ::2], base[:, 1::2]
    gate = gate.detach().requires_grad_()
    up = up.detach().requires_grad_()
    h = fusedllm.swiglu(gate, up)
    assert_close(h, ref_swiglu(gate.detach(), up.detach()), FORWARD_TOL[torch.float32])
    dh = torch.randn(h.shape[::-1], device=device).t()  # non-contiguous incoming gradient
    h.backward(dh)
    ref_dg, ref_du = reference_grads(gate, up, dh, "silu")
    assert_close(gate.grad, ref_dg, GRAD_TOL[torch.float32])
    assert_close(up.grad, ref_du, GRAD_TOL[torch.float32])


@settings(max_examples=60, deadline=None)
@given(
    lead=st.lists(st.integers(0, 4), min_size=0, max_size=3),
    features=st.integers(1, 300),
    dtype=st.sampled_from(DTYPES),
    activation=st.sampled_from(ACTIVATIONS),
)
def test_hypothesis_shapes(lead, features, dtype, activation):
    gate_up = (3 * torch.randn(*lead, 2 * features)).to(dtype)
    expected = ref_swiglu(gate_up, activation=activation)
    assert_close(fusedllm.swiglu(gate_up, activation=activation), expected, FORWARD_TOL[dtype])
    gate, up = gate_up.chunk(2, dim=-1)
    assert_close(fusedllm.swiglu(gate, up, activation), expected, FORWARD_TOL[dtype])


def test_extreme_inputs_stay_finite():
    gate = torch.tensor([-1e4, -100.0, -20.0, 0.0, 20.0, 100.0, 1e4])
    up = torch.ones_like(gate)
    for activation in ACTIVATIONS:
        h = fusedllm.swiglu(gate, up, activation)
        torch.testing.assert_close(h, ref_swiglu(gate.double(), up.double(), activation).float())
        dg, du = ops.swiglu_backward(torch.ones_like(gate), gate, up, activation)
        assert torch.isfinite(dg).all() and torch.isfinite(du).all()


# --- bad input ----------------------------------------------------------------------

BAD_CALLS = [
    ("gate and up must have the same shape", lambda: fusedllm.swiglu(torch.randn(4, 8), torch.randn(4, 9))),
    ("gate_up must be packed \\[..., 2 \\* F\\] as \\[gate \\| up\\]; its last dim 7 is odd",
     lambda: fusedllm.swiglu(torch.randn(4, 7))),
    ("activation must be 'silu' or 'gelu_tanh'",
     lambda: fusedllm.swiglu(torch.randn(4, 8), torch.randn(4, 8), activation="relu")),
    ("up has dtype torch.float16 but gate has dtype torch.float32",
     lambda: fusedllm.swiglu(torch.randn(4, 8), torch.randn(4, 8).half())),
    ("up is on meta but gate is on cpu",
     lambda: fusedllm.swiglu(torch.randn(4, 8), torch.randn(4, 8, device="meta"))),
    ("gate_up must be float32, float64, bfloat16 or float16, got torch.int32",
     lambda: fusedllm.swiglu(torch.ones(4, 8, dtype=torch.int32))),
    ("gate must be float32, float64, bfloat16 or float16, got torch.int32",
     lambda: fusedllm.swiglu(torch.ones(4, 8, dtype=torch.int32), torch.ones(4, 8, dtype=torch.int32))),
]


@pytest.mark.parametrize("message,call", BAD_CALLS, ids=[m for m, _ in BAD_CALLS])
def test_bad_input_is_a_clear_error(message, call):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("error,message,call", [
    pytest.param(ValueError, r"gate and up must have the same shape, got \[4, 8\] and \[4, 9\]",
                 lambda: ops.swiglu(torch.randn(4, 8), torch.randn(4, 9), "silu"),
                 id="gate_up_shape_mismatch"),
    pytest.param(ValueError, r"activation must be 'silu' or 'gelu_tanh', got 'tanh'",
                 lambda: ops.swiglu(torch.randn(4, 8), torch.randn(4, 8), "tanh"),
                 id="activation"),
    pytest.param(ValueError, r"swiglu_packed: gate_up must be packed .* its last dim 7 is odd",
                 lambda: ops.swiglu_packed(torch.randn(4, 7), "silu"),
                 id="packed_odd_last_dim"),
    pytest.param(ValueError, r"swiglu_packed: gate_up must be float32, float64, bfloat16 or float16, "
                             r"got torch\.int64",
                 lambda: ops.swiglu_packed(torch.ones(4, 8, dtype=torch.long), "silu"),
                 id="packed_dtype"),
    pytest.param(ValueError, r"swiglu_backward: grad_out must have the shape of gate \[4, 8\], got \[4, 3\]",
                 lambda: ops.swiglu_backward(torch.randn(4, 3), torch.randn(4, 8), torch.randn(4, 8), "silu"),
                 id="backward_grad_out_shape"),
    pytest.param(ValueError, r"swiglu_packed_backward: grad_out must have the shape of gate_up with half its last "
                             r"dim, got \[4, 8\]",
                 lambda: ops.swiglu_packed_backward(torch.randn(4, 8), torch.randn(4, 8), "silu"),
                 id="packed_backward_grad_out_shape"),
])
def test_operator_rejects_bad_input_without_crashing(error, message, call):
    with pytest.raises(error, match=message):
        call()


# --- modules --------------------------------------------------------------------------

def _compare_modules(original, fused, x, tol):
    fused.load_state_dict(original.state_dict())
    assert set(fused.state_dict()) == set(original.state_dict())
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = original(x1), fused(x2)
    torch.testing.assert_close(y2, y1, atol=tol, rtol=tol)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    torch.testing.assert_close(x2.grad, x1.grad, atol=tol, rtol=tol)
    params1 = dict(original.named_parameters())
    for name, p in fused.named_parameters():
        torch.testing.assert_close(p.grad, params1[name].grad, atol=tol * 10, rtol=tol, msg=name)
    original.load_state_dict(fused.state_dict())  # and back


@pytest.mark.parametrize("tokens", [(1, 1), (3, 11), (4, 40)], ids=["decode_split", "split", "packed"])
@pytest.mark.parametrize("bias", [True, False])
def test_swiglu_module_matches_the_notebook_module(bias, tokens):
    """Few tokens run gate and up separately, many as one packed product: same function."""
    original = NotebookSwiGLU(48, 136, bias=bias)
    _compare_modules(original, fusedllm.nn.SwiGLU(48, 136, bias=bias), torch.randn(*tokens, 48), 1e-5)


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_gated_mlp_matches_hugging_face(kind):
    if kind == "llama":
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaMLP
        config = LlamaConfig(hidden_size=64, intermediate_size=176, mlp_bias=True)
        original = LlamaMLP(config)
    else:
        from transformers import GemmaConfig
        from transformers.models.gemma.modeling_gemma import GemmaMLP
        config = GemmaConfig(hidden_size=64, intermediate_size=176, hidden_activation="gelu_pytorch_tanh")
        original = GemmaMLP(config)
    fused = fusedllm.nn.GatedMLP.from_config(config)
    assert fused.activation == ("silu" if kind == "llama" else "gelu_tanh")
    _compare_modules(original, fused, torch.randn(2, 9, 64), 1e-5)


def test_gated_mlp_rejects_unknown_hf_activation():
    from transformers import LlamaConfig
    with pytest.raises(ValueError, match="activation 'relu' has no fused kernel"):
        fusedllm.nn.GatedMLP.from_config(LlamaConfig(hidden_size=64, intermediate_size=16, num_attention_heads=4, hidden_act="relu"))
    with pytest.raises(ValueError, match="intermediate_size must be a positive int"):
        fusedllm.nn.GatedMLP(8, 0)


def _saved_activation_bytes(module, x):
    """Bytes of the tensors autograd keeps for backward, parameters excluded."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_ptrs:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(storages.values())


def test_fused_mlp_keeps_less_for_backward_than_eager():
    torch.manual_seed(0)
    eager = NotebookSwiGLU(64, 176, bias=False)
    fused = fusedllm.nn.SwiGLU(64, 176, bias=False)
    fused.load_state_dict(eager.state_dict())
    x = torch.randn(512, 64, requires_grad=True)
    eager_bytes = _saved_activation_bytes(eager, x)
    fused_bytes = _saved_activation_bytes(fused, x)
    # eager keeps gate, silu(gate), up and the product; fused keeps [gate | up]
    # and the product (plus the concatenated weight, small next to activations).
    assert fused_bytes < eager_bytes, (fused_bytes, eager_bytes)


@pytest.mark.slow
def test_torch_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()
    mlp = fusedllm.nn.GatedMLP(64, 160, activation="gelu_tanh").to(device)
    x = torch.randn(2, 7, 64, device=device, requires_grad=True)
    compiled = torch.compile(mlp, fullgraph=True)
    out_c = compiled(x)
    out_c.sum().backward()
    grads_c = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    x.grad = None
    mlp.zero_grad()
    out_e = mlp(x)
    out_e.sum().backward()
    torch.testing.assert_close(out_c, out_e)
    for a, b in zip(grads_c, [x.grad] + [p.grad for p in mlp.parameters()]):
        torch.testing.assert_close(a, b)


