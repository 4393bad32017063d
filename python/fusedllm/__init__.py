"""fusedllm: fused CPU and CUDA kernels for transformer building blocks."""

from ._extension import backend, build_info
from . import _sharding
from . import functional  # the ops (fusedllm.ops), registering their fake kernels and autocast rules
from .functional import *  # noqa: F401,F403
from .rope_scaling import rope_tables
from . import nn
from .patch import patch, unpatch
from . import _transformers_hook

# attn_implementation="fusedllm" in transformers without importing it here
# (importing transformers takes seconds): registered when its modeling code loads.
_transformers_hook.install()
_sharding.register_if_imported()  # else on the first op called with a DTensor

__version__ = "0.1.0"

__all__ = ["backend", "build_info", *functional.__all__, "rope_tables", "nn", "patch", "unpatch", "__version__"]
