"""One function per fused op (each written in its module, fusedllm/ops/<op>.py).

The ops check their own arguments (the C++ operators, or the plain path's twins
of those checks) and their messages name the argument; the functions check only
what the ops cannot say: Python types, devices (the dispatcher picks a kernel by
device before any check runs), the arguments they add (``None`` defaults, rope
table layouts, the dropout seed). Each call takes its implementation from
``ops_for(first tensor)``: the compiled operators on CPU (and CUDA when built
with its kernels), the plain path (same names and signatures) on other devices
or without the extension."""

from .ops.attention import attention, attention_varlen, attention_with_weights
from .ops.cross_entropy import linear_cross_entropy
from .ops.kv_quant import quantize_kv
from .ops.moe import moe_experts, moe_load_balancing_loss, moe_route
from .ops.rms_norm import fused_add_rms_norm, rms_norm
from .ops.rope import apply_rope
from .ops.swiglu import swiglu

# the top level's (attention_with_weights is not: fusedllm.functional.attention_with_weights);
# tests/test_op_table.py checks that each op module's __all__ is here
__all__ = ["rms_norm", "fused_add_rms_norm", "swiglu", "apply_rope", "attention", "attention_varlen",
           "linear_cross_entropy", "moe_route", "moe_experts", "moe_load_balancing_loss", "quantize_kv"]
