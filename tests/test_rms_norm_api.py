"""rms_norm as an operator and a module: opcheck, torch.compile, errors, state dicts."""

import pytest
import torch
from torch import nn

import fusedllm
from checks import FORWARD_TOL
from reference import rms_norm as ref_rms_norm
from testkit.notebook_models import NotebookRMSNorm

ops = torch.ops.fusedllm


# --- operator registration ------------------------------------------------------

@pytest.mark.parametrize("frozen", ["input", "weight", "residual"])
def test_gradients_only_where_asked(device, frozen):
    # The autograd kernels skip the weight's gradient when it is not wanted and
    # give each input that asks exactly the reference's gradient.
    from reference import fused_add_rms_norm as ref_fused_add

    torch.manual_seed(0)
    x, r = torch.randn(2, 7, 33, device=device), torch.randn(2, 7, 33, device=device)
    w = torch.randn(33, device=device)
    g = torch.randn_like(x)
    leaves = {"input": x, "weight": w, "residual": r}
    ours = {n: t.clone().requires_grad_(n != frozen) for n, t in leaves.items()}
    refs = {n: t.clone().requires_grad_(n != frozen) for n, t in leaves.items()}
    out, h = fusedllm.fused_add_rms_norm(ours["input"], ours["residual"], ours["weight"])
    (out * g).sum().add_((h * g).sum()).backward()
    ref_out, ref_h = ref_fused_add(refs["input"], refs["residual"], refs["weight"])
    (ref_out * g).sum().add_((ref_h * g).sum()).backward()
    for name in leaves:
        if name == frozen:
            assert ours[name].grad is None
        else:
            torch.testing.assert_close(ours[name].grad, refs[name].grad, atol=1e-5, rtol=1e-4)
    assert fusedllm.rms_norm(ours["input"], ours["weight"]).requires_grad  # one of them asks
    with torch.no_grad():
        assert not fusedllm.rms_norm(ours["input"], ours["weight"]).requires_grad


def test_build_info_reports_the_build():
    info = fusedllm.build_info()
    assert fusedllm.backend() == "extension"
    assert info["torch_version"].split("+")[0] == torch.__version__.split("+")[0]
    assert "DEFAULT" in info["cpu_isas"]
    assert info["cpu_isa_active"] in info["cpu_isas"]
    if info["cuda"]:
        assert info["cuda_archs"], "CUDA kernels compiled without architectures"


class PreNormBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm1 = fusedllm.nn.RMSNorm(dim)
        self.norm2 = fusedllm.nn.RMSNorm(dim, offset=1.0, casting="gemma")
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, residual):
        h, residual = self.norm1(x, residual)
        return self.norm2(self.proj(h)) + residual


@pytest.mark.slow
def test_torch_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()
    block = PreNormBlock(96).to(device)
    x = torch.randn(4, 9, 96, device=device, requires_grad=True)
    r = torch.randn(4, 9, 96, device=device)
    compiled = torch.compile(block, fullgraph=True)
    out_c = compiled(x, r)
    out_c.square().sum().backward()
    grads_c = [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]
    x.grad = None
    block.zero_grad()
    out_e = block(x, r)
    out_e.square().sum().backward()
    grads_e = [x.grad] + [p.grad for p in block.parameters()]
    torch.testing.assert_close(out_c, out_e)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b)


# --- bad input --------------------------------------------------------------------

BAD_CALLS = [
    ("weight must have shape \\[16\\]", lambda: fusedllm.rms_norm(torch.randn(4, 16), torch.randn(15))),
    ("weight has dtype torch.float16 but input has dtype torch.float32",
     lambda: fusedllm.rms_norm(torch.randn(4, 16), torch.randn(16).half())),
    ("weight is on meta but input is on cpu",
     lambda: fusedllm.rms_norm(torch.randn(4, 16), torch.randn(16, device="meta"))),
    ("input must be float32, float64, bfloat16 or float16, got torch.int64",
     lambda: fusedllm.rms_norm(torch.ones(4, 16, dtype=torch.long))),
    ("eps must be a finite number >= 0, got -1e-06", lambda: fusedllm.rms_norm(torch.randn(4, 16), eps=-1e-6)),
    ("eps must be a finite number", lambda: fusedllm.rms_norm(torch.randn(4, 16), eps=float("nan"))),
    ("residual must have the shape of input",
     lambda: fusedllm.fused_add_rms_norm(torch.randn(4, 16), torch.randn(4, 8))),
    ("residual has dtype", lambda: fusedllm.fused_add_rms_norm(torch.randn(4, 16), torch.randn(4, 16).double())),
    ("casting must be 'llama' or 'gemma'", lambda: fusedllm.rms_norm(torch.randn(4, 16), casting="t5")),
    ("offset=1 needs a weight", lambda: fusedllm.rms_norm(torch.randn(4, 16), offset=1.0)),
    ("at least one dimension", lambda: fusedllm.rms_norm(torch.tensor(1.0))),
]


@pytest.mark.parametrize("message,call", BAD_CALLS, ids=[m for m, _ in BAD_CALLS])
def test_bad_input_is_a_clear_error(message, call):
    with pytest.raises(ValueError, match=message):
        call()


def test_non_tensor_input_is_a_type_error():
    with pytest.raises(TypeError, match="input must be a torch.Tensor, got list"):
        fusedllm.rms_norm([1.0, 2.0])


OP_BAD_CALLS = [
    pytest.param(ValueError, r"weight must have shape \[16\] \(the last dim of input\), got \[15\]",
                 lambda: ops.rms_norm(torch.randn(4, 16), torch.randn(15), 1e-6, 0.0, "llama"),
                 id="weight_shape"),
    pytest.param(ValueError, r"input must be float32, float64, bfloat16 or float16, got torch\.int32",
                 lambda: ops.rms_norm(torch.ones(4, 16, dtype=torch.int32), None, 1e-6, 0.0, "llama"),
                 id="input_dtype"),
    pytest.param(ValueError, r"weight has dtype torch\.float64 but input has dtype torch\.float32",
                 lambda: ops.rms_norm(torch.randn(4, 16), torch.randn(16).double(), 1e-6, 0.0, "llama"),
                 id="weight_dtype"),
    pytest.param(ValueError, r"eps must be a finite number >= 0, got -1",
                 lambda: ops.rms_norm(torch.randn(4, 16), None, -1.0, 0.0, "llama"),
                 id="negative_eps"),
    pytest.param(ValueError, r"casting must be 'llama' or 'gemma', got 'rms'",
                 lambda: ops.rms_norm(torch.randn(4, 16), None, 1e-6, 0.0, "rms"),
                 id="casting"),
    pytest.param(ValueError, r"fused_add_rms_norm: residual must have the shape of input \[4, 16\], got \[16\]",
                 lambda: ops.fused_add_rms_norm(torch.randn(4, 16), torch.randn(16), None, 1e-6, 0.0, "llama"),
                 id="residual_shape"),
    pytest.param(ValueError, r"rms_norm_backward: rstd must be the per-row statistic",
                 lambda: ops.rms_norm_backward(torch.randn(4, 16), torch.randn(4, 16), torch.randn(3), None, 0.0,
                                               "llama", None, False),
                 id="backward_rstd_shape"),
    pytest.param(ValueError, r"rms_norm_backward: grad_out must have the shape of input",
                 lambda: ops.rms_norm_backward(torch.randn(4, 8), torch.randn(4, 16), torch.randn(4), None, 0.0,
                                               "llama", None, False),
                 id="backward_grad_out_shape"),
]


@pytest.mark.parametrize("error,message,call", OP_BAD_CALLS)
def test_operator_rejects_bad_input_without_crashing(error, message, call):
    # Direct torch.ops callers skip the Python checks; the C++ ones still apply.
    with pytest.raises(error, match=message):
        call()


# --- modules and state dicts ----------------------------------------------------------

def _hf_norm(kind, dim):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    return LlamaRMSNorm(dim, eps=1e-6) if kind == "llama" else GemmaRMSNorm(dim, eps=1e-6)


@pytest.mark.parametrize("source", ["notebook", "llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_module_state_dict_round_trip(source, dtype):
    dim = 48
    if source == "notebook":
        original = NotebookRMSNorm(dim)
        fused = fusedllm.nn.RMSNorm(dim)
    else:
        original = _hf_norm(source, dim)
        fused = (fusedllm.nn.RMSNorm(dim) if source == "llama"
                 else fusedllm.nn.RMSNorm(dim, offset=1.0, casting="gemma"))
    with torch.no_grad():
        original.weight.add_(0.2 * torch.randn(dim))
    original.to(dtype)
    fused.to(dtype)
    fused.load_state_dict(original.state_dict())
    assert set(fused.state_dict()) == set(original.state_dict()) == {"weight"}

    x = torch.randn(3, 7, dim, dtype=dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_orig, y_fused = original(x1), fused(x2)
    atol, rtol = FORWARD_TOL[dtype]
    torch.testing.assert_close(y_fused, y_orig, atol=atol, rtol=rtol)
    g = torch.randn_like(y_orig)
    y_orig.backward(g)
    y_fused.backward(g)
    grad_tol = 1e-5 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(x2.grad, x1.grad, atol=grad_tol, rtol=grad_tol)
    torch.testing.assert_close(fused.weight.grad.float(), original.weight.grad.float(),
                               atol=grad_tol * 10, rtol=grad_tol)

    # and back: the original loads the fused module's state dict
    original.load_state_dict(fused.state_dict())


def test_module_options_and_residual_form():
    norm = fusedllm.nn.RMSNorm(32, eps=1e-5, offset=1.0, casting="gemma")
    assert torch.equal(norm.weight, torch.zeros(32))  # offset + weight starts at 1
    x, r = torch.randn(2, 32), torch.randn(2, 32)
    y, h = norm(x, r)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, ref_rms_norm(x + r, norm.weight.detach(), 1e-5, 1.0, "gemma"))
    plain = fusedllm.nn.RMSNorm(32, elementwise_affine=False)
    assert plain.weight is None and len(list(plain.parameters())) == 0
    torch.testing.assert_close(plain(x), ref_rms_norm(x, None))
    assert "offset=1.0" in repr(norm)
    with pytest.raises(ValueError, match="dim must be a positive int"):
        fusedllm.nn.RMSNorm(0)
    with pytest.raises(ValueError, match="casting must be"):
        fusedllm.nn.RMSNorm(8, casting="fp32")
