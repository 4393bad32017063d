"""Notebook-compatible modules: one submodule per notebook fusedllm grew from, exposing that
notebook's classes with the same constructors, forward signatures, return
values and parameter / buffer names, built on the fused ops.

    from fusedllm.compat.gpt2_to_llama import LLaMAConfig, LLaMAModel
    model = LLaMAModel(config)
    model.load_state_dict(torch.load("from_the_notebook.pt"))  # loads unchanged

Each is named after its notebook in ``notebooks/``; the older names, from the
lessons' original numbering, import the same module objects:

- ``modern_components`` (``nb000``, notebooks/01_modern_components): RMSNorm,
  SwiGLU, RoPE, pre/post-norm blocks, a full decoder
- ``original_vs_modern_block`` (``nb001``, notebooks/04_original_vs_modern_block):
  original (post-norm, ReLU) vs modern (pre-norm, GELU, fused QKV) blocks
- ``normalization_lab`` (``nb002``, notebooks/03_normalization_lab): RMSNorm,
  single-head attention, pre/post-norm
- ``gpt2_to_llama`` (``nb003``, notebooks/02_gpt2_to_llama): GQA, RoPE, RMSNorm,
  SwiGLU, block and model

``hf_parallel`` builds, for :func:`fusedllm.patch`, fused twins of Hugging
Face parallel-residual decoder layers (GPT-J, GPT-NeoX, Cohere).

Each submodule's docstring lists where it deliberately differs from the
notebook (fixed defects, fully masked rows, dropout random stream).
"""

import sys as _sys

from . import nb000, nb001, nb002, nb003

# The notebook names, as modules of their own: ``import fusedllm.compat.gpt2_to_llama`` and
# ``from fusedllm.compat.gpt2_to_llama import LLaMAModel`` give nb003 itself.
modern_components = nb000
original_vs_modern_block = nb001
normalization_lab = nb002
gpt2_to_llama = nb003
for _name, _module in [("modern_components", nb000), ("original_vs_modern_block", nb001),
                       ("normalization_lab", nb002), ("gpt2_to_llama", nb003)]:
    _sys.modules[f"{__name__}.{_name}"] = _module

__all__ = ["modern_components", "original_vs_modern_block", "normalization_lab", "gpt2_to_llama",
           "nb000", "nb001", "nb002", "nb003"]
