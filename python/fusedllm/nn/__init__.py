"""Drop-in ``nn.Module``s built on the fused ops. Parameter names match the
modules they replace, so their state dicts load unchanged.

One module per family: :mod:`.norm` (RMSNorm), :mod:`.mlp` (the gated
feed-forwards), :mod:`.rope` (RotaryEmbedding), :mod:`.kv_cache` (KVCache),
:mod:`.attention` (GQAttention), :mod:`.parallel` (ParallelBlock) and
:mod:`.moe` (the mixture of experts); PagedKVCache lives in
:mod:`fusedllm.paged_cache`."""

from ..paged_cache import PagedKVCache
from .attention import GQAttention
from .kv_cache import KVCache
from .mlp import GatedMLP, PackedGatedMLP, SwiGLU, gated_projection
from .moe import MoE, MoEExperts, MoERouter
from .norm import RMSNorm
from .parallel import ParallelBlock
from .rope import RotaryEmbedding

__all__ = ["GQAttention", "GatedMLP", "KVCache", "MoE", "MoEExperts", "MoERouter", "PackedGatedMLP",
           "PagedKVCache", "ParallelBlock", "RMSNorm", "RotaryEmbedding", "SwiGLU", "gated_projection"]
