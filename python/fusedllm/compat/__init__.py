"""Notebook-compatible modules: one submodule per notebook fusedllm grew from, exposing that
notebook's classes with the same constructors, forward signatures, return
values and parameter / buffer names, built on the fused ops.

    from fusedllm.compat.nb003 import LLaMAConfig, LLaMAModel
    model = LLaMAModel(config)
    model.load_state_dict(torch.load("from_the_notebook.pt"))  # loads unchanged

- ``nb000``: modern components (RMSNorm, SwiGLU, RoPE, pre/post-norm blocks,
  a full decoder)
- ``nb001``: original (post-norm, ReLU) vs modern (pre-norm, GELU, fused QKV)
  blocks
- ``nb002``: normalization lab (RMSNorm, single-head attention, pre/post-norm)
- ``nb003``: GPT-2 to LLaMA (GQA, RoPE, RMSNorm, SwiGLU, block and model)

``hf_parallel`` builds, for :func:`fusedllm.patch`, fused twins of Hugging
Face parallel-residual decoder layers (GPT-J, GPT-NeoX, Cohere).

Each submodule's docstring lists where it deliberately differs from the
notebook (fixed defects, fully masked rows, dropout random stream).
"""

from . import nb000, nb001, nb002, nb003

__all__ = ["nb000", "nb001", "nb002", "nb003"]
