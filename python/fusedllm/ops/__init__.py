"""The ops, one module each: an op's public functions, its plain-PyTorch twin
and that twin's checks, its fake kernel, and its autocast and DTensor rules
(its C++ and CUDA kernels are in csrc/). Every module here is an op module:
importing this package imports them all and registers what they declare.
fusedllm.functional exports their public functions."""

from __future__ import annotations

import importlib
import pkgutil

from .. import _autocast, _fake
from .._extension import has_extension

MODULES = tuple(importlib.import_module(f"{__name__}.{info.name}") for info in pkgutil.iter_modules(__path__))

if has_extension():
    _fake.register_fakes("fusedllm")
    _autocast.register("fusedllm")
