"""The limits of the ops' arguments, for the Python side: the plain path's
checks, the modules' constructors and the reading of rope tables. The C++
checks (``csrc/include/fusedllm/*_op.h``, ``checks.h``) enforce the same;
``tests/test_limits.py`` calls both at the boundaries and compares."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
CASTINGS = ("llama", "gemma")
ACTIVATIONS = ("silu", "gelu_tanh")
REDUCTIONS = ("mean", "sum", "none")
MAX_HEAD_DIM = 256  # the attention kernels' largest head dim
KV_CODES = (torch.int8, torch.float8_e4m3fn)  # what a quantized KV cache stores (kv_code)


def accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    """What the ops compute in and return their statistics in (rstd, lse,
    losses, router weights): float64 for float64 tensors, float32 for the rest."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def check_positive_int(owner: str, name: str, value) -> int:
    """value, an int (not a bool) of at least 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")
    return value


def check_reduction(op: str, reduction) -> str:
    """One of REDUCTIONS (the C++ parse_reduction's words; a non-str value
    never reaches it: the schema's str refuses it first, less clearly)."""
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    return reduction


def check_rotary_dim(op: str, rotary_dim, head_dim: int) -> int:
    """None means the whole head, else a positive even int at most head_dim."""
    if rotary_dim is None:
        rotary_dim = head_dim
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
        raise ValueError(f"{op}: rotary_dim must be an int, got {rotary_dim!r}")
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"{op}: rotary_dim must be a positive even number at most the head dim "
                         f"{head_dim}, got {rotary_dim}")
    return rotary_dim

MOE_SCORINGS = ("softmax", "sigmoid")
MOE_ACTIVATIONS = ("silu", "gelu_tanh", "gpt_oss")  # the experts' (moe_experts)
# gpt-oss's clamped SwiGLU: moe_experts' default alpha and limit (the schemas' are
# FUSEDLLM_GPT_OSS_ALPHA / _LIMIT of csrc/include/fusedllm/macros.h)
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0
