"""Argument checks every op uses: the plain path's (twins of the C++ operators'
checks, same words) and the functions' own (Python types, devices, numbers)."""

from __future__ import annotations

from numbers import Integral, Real

import torch

from ._limits import FLOAT_DTYPES

# --- the plain path's: the words of csrc/include/fusedllm/*_op.h, numbers printed as C++ does


def _fail(op: str, message: str):
    raise ValueError(f"{op}: {message}")


def _check_float(op, name, t):
    if t.dtype not in FLOAT_DTYPES:
        _fail(op, f"{name} must be float32, float64, bfloat16 or float16, got {t.dtype}")


def _check_same(op, ref_name, ref, name, t):
    if t.dtype != ref.dtype:
        _fail(op, f"{name} has dtype {t.dtype} but {ref_name} has dtype {ref.dtype}")
    if t.device != ref.device:
        _fail(op, f"{name} is on {t.device} but {ref_name} is on {ref.device}")


# --- the functions': what the ops cannot say (a Python type, a device the dispatcher picks by)


def _require_tensor(op: str, name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")


def _require_tensors(op: str, ref_name: str, ref, **others) -> None:
    """Tensors (None allowed among ``others``) on the device of ``ref``."""
    _require_tensor(op, ref_name, ref)
    for name, t in others.items():
        if t is None:
            continue
        _require_tensor(op, name, t)
        if t.device != ref.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}")


def _number(op: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{op}: {name} must be a number, got {value!r}")
    return float(value)


def _int(op: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{op}: {name} must be an int, got {value!r}")
    return int(value)
