"""Fake (meta) kernels: the shapes and dtypes torch.compile traces the
``torch.ops.fusedllm`` operators (and their ``fusedllm_simt`` twins) with.
Each op module (fusedllm/ops/*.py) writes its own with :func:`fake`;
:func:`register_fakes` registers them for a library. The schemas are in
``csrc/include/fusedllm/<op>_op.h``."""

from __future__ import annotations

import torch

FAKES = {}  # op name -> fake kernel


def fake(name: str):
    """Decorator: the fake kernel of op ``name``."""

    def add(fn):
        FAKES[name] = fn
        return fn

    return add


def register_fakes(ns: str) -> None:
    """Registers every fake kernel for library `ns`: "fusedllm", or
    "fusedllm_simt" (the emulated CUDA kernels, same schemas)."""
    for name, fn in FAKES.items():
        torch.library.register_fake(f"{ns}::{name}")(fn)
