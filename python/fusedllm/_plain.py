"""The plain-PyTorch path: what runs when the compiled extension is not
loaded (see ``fusedllm.backend()``) or a device has no kernels. Each op
module (fusedllm/ops/*.py) writes its op's twin with :func:`op`: the same
name, signature, checks and results as the ``torch.ops.fusedllm`` operator
(autograd comes from PyTorch itself). The twins are this module's
attributes, so ``fusedllm._devices.ops_for`` hands out this module or
``torch.ops.fusedllm`` alike."""

from __future__ import annotations

from ._autocast import plain as _under_autocast

OPS = {}  # op name -> its plain twin


def op(name: str):
    """Decorator: the plain twin of operator ``name`` (applying its autocast rule)."""

    def add(fn):
        twin = _under_autocast(name)(fn)
        OPS[name] = twin
        globals()[name] = twin
        return twin

    return add
