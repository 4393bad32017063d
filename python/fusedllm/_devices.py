"""Which implementation runs an op, by the device of its tensors: the compiled
operators on a device type the extension has kernels for, the plain-PyTorch
twins (:mod:`fusedllm._plain`, same names, signatures, checks and results)
on any other.

torch's dispatcher picks a kernel by device, so without this a tensor on a
device fusedllm has no kernels for fails with "Could not run
'fusedllm::...' with arguments from the '...' backend": Apple's MPS, Intel's
XPU, a ROCm GPU (torch names it "cuda", but fusedllm's CUDA kernels are not
built for HIP), a CUDA GPU when fusedllm was built without its CUDA kernels.
Those run the plain path instead, with one warning per device type: the
user's code works everywhere and says once where it is not fused.

The device types with kernels are read from the dispatcher once, at import,
into a frozenset: the per-call check is a device-type lookup in a constant,
which torch.compile traces without a guard failure or a graph break.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

from . import _plain, _sharding
from ._extension import has_extension

# the device types fusedllm compiles kernels for, and their dispatch keys
_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}

_OPS = torch.ops.fusedllm if has_extension() else None


def _with_kernels() -> frozenset:
    if _OPS is None:
        return frozenset()
    names = [name for name in torch._C._dispatch_get_all_op_names() if name.startswith("fusedllm::")]
    found = {device_type for device_type, key in _DISPATCH_KEYS.items()
             if names and all(torch._C._dispatch_has_kernel_for_dispatch_key(name, key) for name in names)}
    return frozenset(found | {"meta"})  # meta tensors: the fake kernels (fusedllm/ops/*.py)


KERNEL_DEVICES = _with_kernels()
_warned: set[str] = set()


def supported() -> str:
    """The device types fusedllm's kernels run on, in words ("CPU and CUDA")."""
    names = [name for name, t in (("CPU", "cpu"), ("CUDA", "cuda")) if t in KERNEL_DEVICES]
    return " and ".join(names) or "none"


def without_kernels(device_types) -> list[str]:
    """Those of ``device_types`` whose tensors take the plain path although the
    extension is loaded (none without it: then every device does, as its import said)."""
    return [] if _OPS is None else sorted(set(device_types) - KERNEL_DEVICES)


def no_kernels_reason(device_type: str) -> str:
    """Why ``device_type`` has no fusedllm kernels, naming what has them."""
    where = f"its kernels run on {supported()}"
    if device_type == "cuda" and torch.version.hip:
        return (f"this is a ROCm build of torch (HIP {torch.version.hip}), whose 'cuda' tensors live on AMD "
                f"GPUs: fusedllm has no kernels for them ({where})")
    if device_type == "cuda":
        return (f"this fusedllm was built without its CUDA kernels ({where}; FUSEDLLM_CUDA=1 with nvcc "
                f"builds them)")
    return f"fusedllm has no kernels for {device_type} tensors ({where})"


_OWN_DIRS = (os.path.dirname(__file__), os.path.dirname(torch.__file__))


def _warn(device_type: str) -> None:
    # attributed to the user's line: the first frame outside fusedllm and torch (nn.Module's call)
    frame, level = sys._getframe(0), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_OWN_DIRS):
        frame, level = frame.f_back, level + 1
    _warned.add(device_type)
    warnings.warn(f"{no_kernels_reason(device_type)}; fusedllm's ops on {device_type} tensors run its "
                  f"plain-PyTorch path instead: same results and gradients, not fused (warned once per "
                  f"device type)",
                  RuntimeWarning, stacklevel=level)


def ops_for(t: torch.Tensor):
    """``torch.ops.fusedllm`` where ``t``'s device type has kernels, else :mod:`fusedllm._plain`
    (warning once for each such device type; silent when the extension is not loaded at all,
    which its import already said)."""
    if _sharding.needs_registering(t):
        _sharding.register()
    device_type = t.device.type
    if device_type in KERNEL_DEVICES:
        return _OPS
    if _OPS is not None and device_type not in _warned:
        _warn(device_type)
    return _plain
