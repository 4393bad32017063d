"""Loads the compiled extension ``fusedllm._C`` and decides which path is live.

Order of checks, before any native code is loaded:
1. ``_build_config.py`` (written by the build) names the torch release the
   extension was compiled against and, when it has CUDA kernels, torch's CUDA
   version; a running torch that differs is an ImportError that says what to
   do, because loading would fail or misbehave.
2. If the extension is missing or cannot load, fusedllm warns once and runs the
   plain-PyTorch reference path, unless ``FUSEDLLM_REQUIRE_EXTENSION=1``.
``FUSEDLLM_DISABLE_EXTENSION=1`` selects the reference path on purpose.
"""

from __future__ import annotations

import os
import warnings

import torch

REBUILD_COMMAND = (
    "`make build` in a fusedllm checkout, or pip install --no-build-isolation --force-reinstall "
    "<fusedllm checkout or sdist>"
)

_C = None
_build_config = None
_load_error: str | None = None


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _torch_release(version: str) -> str:
    # "2.14.1+cu130" and "2.14.1" are the same release for ABI purposes.
    return version.split("+")[0]


def _torch_mismatch(config) -> str | None:
    built, running = config.TORCH_VERSION, torch.__version__
    if _torch_release(built) != _torch_release(running):
        return f"fusedllm was built against torch {built} but torch {running} is running"
    # CUDA kernels link the CUDA runtime torch was built with (same major version).
    running_cuda = torch.version.cuda or ""
    if config.CUDA_KERNELS and running_cuda.split(".")[0] != config.TORCH_CUDA.split(".")[0]:
        return (f"fusedllm's CUDA kernels were built against torch {built} with CUDA "
                f"{config.TORCH_CUDA} but the running torch {running} has "
                f"{'CUDA ' + running_cuda if running_cuda else 'no CUDA'}")
    return None


def _load() -> None:
    global _C, _build_config, _load_error
    if _env_flag("FUSEDLLM_DISABLE_EXTENSION"):
        _load_error = "FUSEDLLM_DISABLE_EXTENSION is set"
        return
    try:
        from . import _build_config as config
    except ImportError as exc:
        _load_error = f"fusedllm was not built ({exc})"
        return
    _build_config = config
    mismatch = _torch_mismatch(config)
    if mismatch:
        raise ImportError(
            f"{mismatch}. Either install the torch fusedllm was built against "
            f"(pip install torch=={_torch_release(config.TORCH_VERSION)}"
            f"{f', a build for CUDA {config.TORCH_CUDA}' if config.CUDA_KERNELS else ''}), "
            f"or rebuild fusedllm against the running torch: "
            f"{REBUILD_COMMAND}. FUSEDLLM_DISABLE_EXTENSION=1 imports fusedllm without its "
            f"kernels (the plain-PyTorch path)."
        )
    try:
        from . import _C as ext
    except ImportError as exc:
        _load_error = f"the compiled extension could not be loaded ({exc})"
        return
    _C = ext


_load()

if _C is None:
    if _env_flag("FUSEDLLM_REQUIRE_EXTENSION"):
        raise ImportError(
            f"FUSEDLLM_REQUIRE_EXTENSION is set but {_load_error}. Build it with: {REBUILD_COMMAND}"
        )
    if not _env_flag("FUSEDLLM_DISABLE_EXTENSION"):
        warnings.warn(
            f"fusedllm: {_load_error}; running the plain-PyTorch reference path (slow). "
            f"Build the kernels with: {REBUILD_COMMAND}",
            RuntimeWarning,
            stacklevel=2,
        )


def has_extension() -> bool:
    return _C is not None


def backend() -> str:
    """``"extension"`` when the compiled kernels run, ``"reference"`` otherwise."""
    return "extension" if _C is not None else "reference"


def build_info() -> dict:
    """How the extension was built; ``{"backend": "reference", ...}`` when it is not loaded."""
    if _C is None:
        return {"backend": "reference", "reason": _load_error}
    info = dict(_C.build_info())
    info["backend"] = "extension"
    return info
