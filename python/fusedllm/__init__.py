"""fusedllm: fused CPU and CUDA kernels for transformer building blocks."""

from ._extension import backend, build_info
from . import _fake  # noqa: F401  (registers the fake kernels)
from . import _autocast  # noqa: F401  (registers the ops' autocast rules)
from . import _sharding
from .functional import (apply_rope, attention, attention_varlen, fused_add_rms_norm, linear_cross_entropy,
                         moe_experts, moe_load_balancing_loss, moe_route, quantize_kv, rms_norm, swiglu)
from .rope_scaling import rope_tables
from . import nn
from .patch import patch, unpatch
from . import _transformers_hook

# attn_implementation="fusedllm" in transformers without importing it here
# (importing transformers takes seconds): registered when its modeling code loads.
_transformers_hook.install()
_sharding.register_if_imported()  # else on the first op called with a DTensor

__version__ = "0.1.0"

__all__ = ["backend", "build_info", "rms_norm", "fused_add_rms_norm", "swiglu", "apply_rope", "rope_tables", "attention", "attention_varlen", "linear_cross_entropy", "moe_route", "moe_experts", "moe_load_balancing_loss", "quantize_kv", "nn", "patch", "unpatch", "__version__"]
