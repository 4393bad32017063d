"""The checks every op owes, run over tests/op_table.py's samples: opcheck of
every operator a sample reaches (forward and backward), float64 gradcheck,
torch.compile(fullgraph=True) against eager, and the second-derivative
contract. Each case's id is <op>-<sample>-<device>."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import fusedllm

import checks
from conftest import DEVICES
from op_table import COMPILE, GRADCHECK, OPCHECK, TABLE

SECOND_DERIVATIVE_REFUSED = (r"fusedllm::\w+ has no derivative: a second derivative \(create_graph=True, "
                             r"double backward\) through fusedllm's ops is not supported")


def _device_params():
    """{table device name: [(device fixture value, its marks)]}."""
    out = {}
    for p in DEVICES:
        value, marks = (p.values[0], list(p.marks)) if hasattr(p, "values") else (p, [])
        out.setdefault("simt" if value.startswith("simt") else value, []).append((value, marks))
    return out


def _cases(check, *, emulated=("simt", "simt-warp")):
    """pytest params (entry, sample, device) of the samples that take `check`,
    on the emulator's `emulated` schedules."""
    devices = _device_params()
    params = []
    for entry in TABLE:
        for sample in entry.samples:
            if check not in sample.checks:
                continue
            for place in sample.devices:
                for value, marks in devices[place]:
                    if value.startswith("simt") and value not in emulated:
                        continue
                    extra = []
                    if check == GRADCHECK and sample.variants and value == "cpu":
                        extra = [pytest.mark.cpu_variants, pytest.mark.op(name=entry.name)]
                    params.append(pytest.param(entry, sample, value, marks=marks + extra,
                                               id=f"{entry.name}-{sample.id}-{value}"))
    return params


def _opcheck_cases():
    """_cases(OPCHECK), each with requires_grad False and, for samples with
    differentiable inputs, True."""
    return [pytest.param(*p.values, requires_grad, marks=p.marks, id=p.id + ("-requires_grad" if requires_grad else ""))
            for p in _cases(OPCHECK) for requires_grad in (False, True) if not requires_grad or p.values[1].grad]


def _with_env(sample, monkeypatch):
    for name, value in sample.env:
        monkeypatch.setenv(name, value)


def _leaves(tensors, positions, requires_grad=True):
    return tuple(t.detach().clone().requires_grad_(requires_grad and i in positions) if isinstance(t, torch.Tensor)
                 else t for i, t in enumerate(tensors))


def _outputs(out):
    return [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]


def _backward(out, leaves, positions):
    """Gradients of sum(out * g) with g random, for the leaves at `positions`."""
    outs = [o for o in _outputs(out) if o.requires_grad]
    return torch.autograd.grad(outs, [leaves[i] for i in positions], [torch.randn_like(o) for o in outs])


def _copy(a, requires_grad):
    """A tensor argument as it was at the call (an in-place op changes it)."""
    if not isinstance(a, torch.Tensor):
        return a
    return a.detach().clone().requires_grad_(requires_grad and a.requires_grad and a.is_floating_point())


def _fusedllm_op(func):
    """The OpOverload of a torch.ops.fusedllm callable, else None."""
    if isinstance(func, torch._ops.OpOverloadPacket):
        func = func.default
    return func if isinstance(func, torch._ops.OpOverload) and func.namespace == "fusedllm" else None


class _Calls(TorchFunctionMode):
    """The torch.ops.fusedllm calls made from Python (what the public functions
    call, differentiable tensors as they passed them)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = _fusedllm_op(func)
        if op is not None:
            self.calls.append((op, tuple(_copy(a, True) for a in args), {n: _copy(a, True) for n, a in kwargs.items()}))
        return func(*args, **kwargs)


class _KernelCalls(TorchDispatchMode):
    """Every torch.ops.fusedllm call below autograd, forward and backward
    (the backward ops included), tensors detached."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "fusedllm":
            self.calls.append((func, tuple(_copy(a, False) for a in args),
                               {n: _copy(a, False) for n, a in kwargs.items()}))
        return func(*args, **kwargs)


def _record(sample, device):
    """(the fusedllm calls made from Python, every fusedllm call below
    autograd) in the sample's forward and, where it has one, its backward."""
    leaves = _leaves(sample.build(sample.dtype, device), sample.grad)
    with _Calls() as python, _KernelCalls() as kernels:
        out = sample.run(*leaves)
        if sample.grad:
            _backward(out, leaves, sample.grad)
    return python.calls, kernels.calls


@pytest.mark.parametrize("entry,sample,device,requires_grad", _opcheck_cases(), indirect=["device"])
def test_opcheck(entry, sample, device, requires_grad, monkeypatch):
    """Schema, fake kernel, autograd registration and AOT dispatch of each
    operator the sample reaches, forward and backward; with requires_grad,
    the calls the public function makes, differentiable tensors as it
    passed them."""
    _with_env(sample, monkeypatch)
    python, kernels = _record(sample, device)
    if requires_grad:
        calls = python
    else:  # what Python called, detached, and what autograd called below it (the backward ops)
        called = {func for func, _, _ in python}
        calls = [(func, tuple(_copy(a, False) for a in args), {n: _copy(a, False) for n, a in kwargs.items()})
                 for func, args, kwargs in python] + [c for c in kernels if c[0] not in called]
    assert calls, "the sample reached no fusedllm operator"
    for func, args, kwargs in calls:
        torch.library.opcheck(func, args, kwargs)


@pytest.mark.parametrize("entry,sample,device", _cases(GRADCHECK, emulated=("simt",)), indirect=["device"])
def test_gradcheck(entry, sample, device, monkeypatch):
    """Float64 gradients against finite differences (under the emulator a
    random projection of the Jacobian: the whole one takes minutes there)."""
    _with_env(sample, monkeypatch)
    leaves = _leaves(sample.build(torch.float64, device), sample.grad)
    assert torch.autograd.gradcheck(sample.run, leaves, fast_mode=checks.emulated())


@pytest.mark.slow
@pytest.mark.parametrize("entry,sample,device", _cases(COMPILE, emulated=()), indirect=["device"])
def test_compiles_fullgraph(entry, sample, device, monkeypatch):
    """torch.compile(fullgraph=True) gives eager's outputs and gradients."""
    _with_env(sample, monkeypatch)
    torch._dynamo.reset()
    tensors = sample.build(sample.dtype, device)
    compiled, eager = _leaves(tensors, sample.grad), _leaves(tensors, sample.grad)
    out_c, out_e = torch.compile(sample.run, fullgraph=True)(*compiled), sample.run(*eager)
    torch.testing.assert_close(out_c, out_e)
    if sample.grad:
        torch.manual_seed(1)
        grads_c = _backward(out_c, compiled, sample.grad)
        torch.manual_seed(1)
        grads_e = _backward(out_e, eager, sample.grad)
        torch.testing.assert_close(grads_c, grads_e)


def _second_derivative_cases():
    params = []
    for entry in TABLE:
        if entry.second is None:
            continue
        sample = next(s for s in entry.samples if s.grad and GRADCHECK in s.checks)
        for p in _cases(GRADCHECK, emulated=("simt",)):
            if p.values[1] is sample:
                marks = [m for m in p.marks if m.name not in ("cpu_variants", "op")]
                params.append(pytest.param(entry, sample, p.values[2], marks=marks,
                                           id=f"{entry.name}-{entry.second}-{p.values[2]}"))
    return params


@pytest.mark.parametrize("entry,sample,device", _second_derivative_cases(), indirect=["device"])
def test_second_derivatives(entry, sample, device, monkeypatch):
    """A graph through a backward op is refused with a clear error, except
    through RoPE, whose backward is RoPE itself: there second derivatives
    are checked against finite differences."""
    _with_env(sample, monkeypatch)
    if entry.second == "through":
        leaves = _leaves(sample.build(torch.float64, device), sample.grad)
        assert torch.autograd.gradgradcheck(sample.run, leaves, fast_mode=checks.emulated())
        return
    leaves = _leaves(sample.build(torch.float32, device), sample.grad)
    out = _outputs(sample.run(*leaves))[0]
    with pytest.raises(RuntimeError, match=SECOND_DERIVATIVE_REFUSED):
        torch.autograd.grad((out * out).sum(), [leaves[i] for i in sample.grad], create_graph=True)


def test_table_reaches_every_operator():
    """Each entry's samples reach the operators it lists, and the table
    reaches every registered fusedllm operator."""
    registered = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("fusedllm::")}
    reached = set()
    for entry in TABLE:
        ops = {func._schema.name.split("::", 1)[1] for sample in entry.samples if OPCHECK in sample.checks
               for calls in _record(sample, "cpu") for func, _, _ in calls}
        assert set(entry.ops) <= ops, f"{entry.name}: its opcheck samples reach {sorted(ops)}"
        reached |= ops
    assert reached == registered, (sorted(registered - reached), sorted(reached - registered))


def test_every_sample_is_checked():
    ids = [f"{entry.name}-{sample.id}" for entry in TABLE for sample in entry.samples]
    assert len(ids) == len(set(ids)), "two samples share an id"
    for entry in TABLE:
        for sample in entry.samples:
            assert sample.checks and sample.checks <= {OPCHECK, GRADCHECK, COMPILE}, sample.id
            assert not (GRADCHECK in sample.checks and not sample.grad), f"{sample.id}: gradcheck of nothing"
            assert not (sample.variants and GRADCHECK not in sample.checks), sample.id
        for check in (OPCHECK, COMPILE) + ((GRADCHECK,) if entry.second else ()):
            assert any(check in sample.checks for sample in entry.samples), f"{entry.name}: no {check} sample"


def test_every_op_module_is_whole():
    """Each module of fusedllm/ops exports its functions through fusedllm.functional and
    fusedllm (the same objects), and every registered operator has a fake kernel and a
    DTensor rule; every plain twin is of a registered operator."""
    from fusedllm import _fake, _plain, _sharding, functional, ops

    registered = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("fusedllm::")}
    for module in ops.MODULES:
        assert module.__all__, module.__name__
        for name in module.__all__:
            assert name in functional.__all__, f"{module.__name__}.{name} is not in fusedllm.functional.__all__"
            assert getattr(functional, name) is getattr(module, name) is getattr(fusedllm, name), name
    assert set(functional.__all__) == {name for module in ops.MODULES for name in module.__all__}
    assert set(_fake.FAKES) == registered == set(_sharding.RULES)
    assert set(_plain.OPS) <= registered
