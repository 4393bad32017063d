"""Tensors on a device fusedllm has no kernels for (MPS, XPU, a ROCm GPU, CUDA
in a build without its CUDA kernels) run the plain-PyTorch path, with one
warning per device type; ``patch()`` says so in its report.

This machine has none of those devices, so the behaviour is shown two ways:

- The per-call decision (``fusedllm._devices.ops_for``) reads nothing but the
  tensor's device type and the set of device types with kernels, taken from
  torch's dispatcher at import. Taking "cpu" out of that set makes CPU a
  device without kernels to every layer above (functional, nn, patch): what
  runs then is exactly what runs on MPS or XPU. A dispatch mode that sees
  every ``fusedllm::`` operator call proves no kernel was reached, and the
  results are compared with the kernels' on the same inputs.
- A device torch itself knows as a backend with no fusedllm kernels:
  PrivateUse1, set up in Python (``_setup_privateuseone_for_python_backend``),
  its aten ops served by a fallback that runs them on CPU copies, as MPS
  serves them on the GPU. The dispatcher has no fusedllm kernel for it (the
  raw operator fails, where MPS said "Could not run 'fusedllm::...'"); the
  functional calls now give the CPU kernels' results on that device.

ROCm (``torch.version.hip`` set, tensors of type "cuda") and a CUDA torch
with a fusedllm built without CUDA kernels are the dispatcher reporting no
CUDA kernel: simulated at the dispatcher query, checked at the decision.
"""

import types
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusedllm
from fusedllm import _devices, _plain
from fusedllm import nn as fnn

from checks import FORWARD_TOL, GRAD_TOL, assert_close
from testkit import notebook_models as plain_models


class _FusedOpCalls(TorchDispatchMode):
    """Records the ``fusedllm::`` operators that reach the dispatcher."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        if func.namespace == "fusedllm":
            self.names.append(func.name())
        return func(*args, **(kwargs or {}))


@pytest.fixture
def cpu_without_kernels(monkeypatch):
    """CPU counted as a device without fusedllm kernels, no device warned of yet."""
    monkeypatch.setattr(_devices, "KERNEL_DEVICES", _devices.KERNEL_DEVICES - {"cpu"})
    monkeypatch.setattr(_devices, "_warned", set())


def _no_kernels_warnings(record, device_type):
    return [w for w in record if issubclass(w.category, RuntimeWarning)
            and f"fusedllm's ops on {device_type} tensors run its plain-PyTorch path" in str(w.message)]


def _calls():
    """One call of each functional entry point, on CPU tensors that need gradients where the op has them."""
    g = torch.Generator().manual_seed(1)

    def r(*shape, grad=True):
        return torch.randn(*shape, generator=g).requires_grad_(grad)

    x, w, res = r(3, 5, 16), r(16), r(3, 5, 16)
    q, k, v = r(2, 4, 6, 8), r(2, 2, 6, 8), r(2, 2, 6, 8)
    cos, sin = fusedllm.rope_tables(8, 6)
    hidden, head, target = r(10, 16), r(24, 16), torch.randint(0, 24, (10,), generator=g)
    logits = r(10, 4)
    indices = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(10)])
    weights, gate_up, down = r(10, 2), r(4, 12, 16) * 0.2, r(4, 16, 6) * 0.2
    return {
        "rms_norm": lambda: fusedllm.rms_norm(x, w),
        "fused_add_rms_norm": lambda: fusedllm.fused_add_rms_norm(x, res, w),
        "swiglu": lambda: fusedllm.swiglu(x, res),
        "swiglu_packed": lambda: fusedllm.swiglu(x),
        "apply_rope": lambda: fusedllm.apply_rope(q, k, cos, sin),
        "attention": lambda: fusedllm.attention(q, k, v, causal=True),
        "attention_varlen": lambda: fusedllm.attention_varlen(
            q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
            torch.tensor([0, 2, 6], dtype=torch.int32), torch.tensor([0, 3, 6], dtype=torch.int32),
            causal=True),
        "linear_cross_entropy": lambda: fusedllm.linear_cross_entropy(hidden, head, target),
        "moe_route": lambda: fusedllm.moe_route(logits, 2),
        "moe_experts": lambda: fusedllm.moe_experts(hidden, indices, weights, gate_up, down),
        "quantize_kv": lambda: fusedllm.quantize_kv(x.detach()),
    }


def _flat(out):
    return [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]


def _grads(out, leaves):
    floats = [t for t in _flat(out) if t.requires_grad]
    if not floats:
        return []
    total = sum((t.float() * (i + 1)).sum() for i, t in enumerate(floats))
    return torch.autograd.grad(total, [t for t in leaves if t.requires_grad], allow_unused=True)


def test_kernel_devices_are_what_the_build_has():
    assert {"cpu", "meta"} <= _devices.KERNEL_DEVICES
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("fusedllm::")]
    has_cuda = all(torch._C._dispatch_has_kernel_for_dispatch_key(n, "CUDA") for n in names)
    assert ("cuda" in _devices.KERNEL_DEVICES) == has_cuda == fusedllm.build_info()["cuda"]
    assert _devices.supported() == ("CPU and CUDA" if has_cuda else "CPU")
    # what the dispatcher answers is what runs: tensors of these types take the kernels
    assert _devices.ops_for(torch.zeros(1)) is torch.ops.fusedllm
    assert _devices.ops_for(torch.zeros(1, device="meta")) is torch.ops.fusedllm


def test_every_entry_point_runs_the_plain_path_with_one_warning(monkeypatch):
    expected = {}
    for name, call in _calls().items():
        torch.manual_seed(0)
        expected[name] = _flat(call())
    monkeypatch.setattr(_devices, "KERNEL_DEVICES", _devices.KERNEL_DEVICES - {"cpu"})
    monkeypatch.setattr(_devices, "_warned", set())
    with warnings.catch_warnings(record=True) as record, _FusedOpCalls() as seen:
        warnings.simplefilter("always")
        for name, call in _calls().items():
            torch.manual_seed(0)
            for got, want in zip(_flat(call()), expected[name]):
                if got.dtype.is_floating_point:
                    assert_close(got.detach(), want.detach(), FORWARD_TOL[torch.float32], what=name)
                else:
                    assert torch.equal(got, want), name
    assert seen.names == [], "a fusedllm kernel ran on a device counted as having none"
    found = _no_kernels_warnings(record, "cpu")
    assert len(found) == 1, [str(w.message) for w in record]
    message = str(found[0].message)
    assert "fusedllm has no kernels for cpu tensors" in message
    assert f"its kernels run on {_devices.supported()}" in message
    assert found[0].filename == __file__  # points at the caller's line


def test_plain_path_gradients_equal_the_kernels(cpu_without_kernels):
    x, w = torch.randn(4, 16, requires_grad=True), torch.randn(16, requires_grad=True)
    gate, up = torch.randn(4, 16, requires_grad=True), torch.randn(4, 16, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="no kernels for cpu"):
        plain = (fusedllm.rms_norm(x, w), fusedllm.swiglu(gate, up))
    plain_grads = _grads(plain, [x, w, gate, up])
    _devices.KERNEL_DEVICES = _devices.KERNEL_DEVICES | {"cpu"}
    fused = (fusedllm.rms_norm(x, w), fusedllm.swiglu(gate, up))
    for got, want in zip(plain_grads, _grads(fused, [x, w, gate, up])):
        assert_close(got, want, GRAD_TOL[torch.float32])


def test_nn_modules_run_the_plain_path(cpu_without_kernels):
    torch.manual_seed(0)
    norm, mlp = fnn.RMSNorm(16), fnn.SwiGLU(16, 32)
    attn = fnn.GQAttention(16, 4, n_kv_heads=2)
    x = torch.randn(2, 5, 16)
    with warnings.catch_warnings(record=True) as record, _FusedOpCalls() as seen:
        warnings.simplefilter("always")
        got = attn(mlp(norm(x)))
    assert seen.names == []
    found = _no_kernels_warnings(record, "cpu")
    assert len(found) == 1 and found[0].filename == __file__  # the user's line, not nn.Module's
    _devices.KERNEL_DEVICES = _devices.KERNEL_DEVICES | {"cpu"}
    assert_close(got.detach(), attn(mlp(norm(x))).detach(), FORWARD_TOL[torch.float32])


def test_patch_report_names_the_device_and_the_model_runs(cpu_without_kernels):
    torch.manual_seed(0)
    config = plain_models.tiny_llama_config(plain_models.nb003.LLaMAConfig)
    model = plain_models.nb003.LLaMAModel(config).eval()
    tokens = torch.randint(0, 61, (2, 7))
    with torch.no_grad():
        want = model(tokens)
    report = fusedllm.patch(model)
    assert report.count() == 9  # the same replacements as on a device with kernels
    assert report.device.startswith("model on cpu: fusedllm has no kernels for cpu tensors")
    assert "the replaced modules run fusedllm's plain-PyTorch path there" in report.device
    assert str(report).splitlines()[1] == f"  device: {report.device}"
    with pytest.warns(RuntimeWarning, match="no kernels for cpu"), torch.no_grad():
        got = model(tokens)
    assert_close(got, want, FORWARD_TOL[torch.float32])


def test_patch_report_is_silent_where_kernels_exist():
    model = plain_models.nb003.LLaMAModel(plain_models.tiny_llama_config(plain_models.nb003.LLaMAConfig))
    report = fusedllm.patch(model)
    assert report.device == "" and "device:" not in str(report)


def test_cuda_without_cuda_kernels(monkeypatch):
    """ROCm torch (torch.version.hip set; its GPU tensors have type "cuda") with
    fusedllm built for the CPU, and a CUDA torch with fusedllm built without
    CUDA kernels: the dispatcher has no fusedllm kernel for the CUDA key, so
    "cuda" is not a kernel device and such tensors take the plain path. The
    decision reads only ``t.device.type``; a stand-in carries that device."""
    real = torch._C._dispatch_has_kernel_for_dispatch_key
    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key",
                        lambda name, key: key != "CUDA" and real(name, key))
    kernel_devices = _devices._with_kernels()
    assert "cuda" not in kernel_devices and "cpu" in kernel_devices
    monkeypatch.setattr(_devices, "KERNEL_DEVICES", kernel_devices)
    gpu_tensor = types.SimpleNamespace(device=torch.device("cuda", 0))
    for hip, words in (("6.2.41133", "this is a ROCm build of torch (HIP 6.2.41133)"),
                       (None, "this fusedllm was built without its CUDA kernels")):
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(_devices, "_warned", set())
        with pytest.warns(RuntimeWarning) as record:
            assert _devices.ops_for(gpu_tensor) is _plain
            assert _devices.ops_for(gpu_tensor) is _plain
        assert len(record) == 1
        assert words in str(record[0].message) and "its kernels run on CPU" in str(record[0].message)


def test_without_the_extension_nothing_more_is_said(monkeypatch):
    """The import already warned that everything runs the plain path."""
    monkeypatch.setattr(_devices, "_OPS", None)
    monkeypatch.setattr(_devices, "KERNEL_DEVICES", frozenset())
    monkeypatch.setattr(_devices, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _devices.ops_for(torch.zeros(1)) is _plain
    assert _devices.without_kernels(["cpu", "mps"]) == []


def test_device_choice_does_not_break_the_graph():
    """torch.compile(fullgraph=True) raises on a graph break; the eager backend keeps it fast."""
    x, w = torch.randn(3, 16), torch.randn(16)
    compiled = torch.compile(lambda a, b: fusedllm.swiglu(fusedllm.rms_norm(a, b), a), fullgraph=True,
                             backend="eager")
    assert_close(compiled(x, w), fusedllm.swiglu(fusedllm.rms_norm(x, w), x), FORWARD_TOL[torch.float32])


# --- a device type torch knows, with no fusedllm kernels -------------------------------------

_P1 = {}


def _setup_privateuse1():
    """PrivateUse1 as a Python backend whose tensors live in CPU tensors (keyed
    by storage, so torch's generic views of them read the right elements);
    every aten op runs on those, and ops returning views of an input return
    copies (enough for out-of-place code such as the plain path)."""
    if _P1:
        return _P1["device"]
    setup = getattr(torch.utils.backend_registration, "_setup_privateuseone_for_python_backend", None)
    if setup is None or not hasattr(torch._C, "_acc"):
        pytest.skip("this torch cannot set up a Python PrivateUse1 backend")
    try:
        setup()
    except RuntimeError as exc:  # PrivateUse1 already taken in this process
        pytest.skip(f"PrivateUse1 cannot be set up here: {exc}")
    device = torch.device(torch._C._get_privateuse1_backend_name(), 0)
    data = {}

    def key(t):
        return t.untyped_storage()._cdata

    def wrap(c):
        out = torch._C._acc.create_empty_tensor(tuple(c.shape), c.dtype)
        data[key(out)] = c.contiguous()
        return out

    def to_cpu(a):
        if isinstance(a, torch.Tensor) and a.device.type == device.type:
            return data[key(a)].as_strided(a.shape, a.stride(), a.storage_offset())
        if isinstance(a, torch.device) and a.type == device.type:
            return torch.device("cpu")
        return a

    def fallback(op, *args, **kwargs):
        if op.namespace != "aten":  # where torch would say "Could not run"
            raise NotImplementedError(f"no kernel for {op.name()} on the test backend")
        if op in (torch.ops.aten._copy_from.default, torch.ops.aten._copy_from_and_resize.default):
            to_cpu(args[1]).copy_(to_cpu(args[0]))
            return args[1]
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        target = kwargs.get("device")
        onto_device = (torch.device(target).type == device.type if target is not None
                       else any(isinstance(a, torch.Tensor) and a.device.type == device.type for a in leaves))
        out = op(*torch.utils._pytree.tree_map(to_cpu, args), **torch.utils._pytree.tree_map(to_cpu, kwargs))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        results = []
        for r, ret in zip(outs, op._schema.returns):
            if ret.alias_info is not None and ret.alias_info.is_write:  # in place: the input itself
                j = next(i for i, a in enumerate(op._schema.arguments)
                         if a.alias_info is not None and a.alias_info.before_set == ret.alias_info.before_set)
                results.append(args[j] if j < len(args) else kwargs[op._schema.arguments[j].name])
            elif isinstance(r, torch.Tensor) and onto_device:
                results.append(wrap(r.clone() if ret.alias_info is not None else r))
            else:
                results.append(r)
        return type(out)(results) if isinstance(out, (tuple, list)) else results[0]

    lib = torch.library.Library("_", "IMPL")
    lib.fallback(fallback, "PrivateUse1")
    _P1.update(device=device, lib=lib)
    return device


def test_a_registered_device_without_kernels_takes_the_plain_path(monkeypatch):
    device = _setup_privateuse1()
    monkeypatch.setattr(_devices, "_warned", set())
    x, w, up = torch.randn(3, 16), torch.randn(16), torch.randn(3, 16)
    dx, dw, dup = x.to(device), w.to(device), up.to(device)
    assert dx.device.type not in _devices.KERNEL_DEVICES
    # what users got before: the operator has no kernel for this backend
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("fusedllm::rms_norm", "PrivateUse1")
    with pytest.raises(NotImplementedError, match="^no kernel for fusedllm::rms_norm on the test backend$"):
        torch.ops.fusedllm.rms_norm(dx, dw, 1e-6, 0.0, "llama")
    with pytest.warns(RuntimeWarning, match=f"no kernels for {device.type} tensors") as record:
        normed = fusedllm.rms_norm(dx, dw)
        gated = fusedllm.swiglu(normed, dup)
    assert len(_no_kernels_warnings(record, device.type)) == 1
    assert normed.device == device and gated.device == device
    assert_close(normed.cpu(), fusedllm.rms_norm(x, w), FORWARD_TOL[torch.float32])
    assert_close(gated.cpu(), fusedllm.swiglu(fusedllm.rms_norm(x, w), up), FORWARD_TOL[torch.float32])
