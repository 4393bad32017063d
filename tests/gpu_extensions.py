"""The extensions the GPU tests build over fusedllm's device code (small
entry points compiled by torch's cpp_extension), their build arguments in one
place: the tests' fixtures load them, and benchmarks/gpu_check.py builds them
beside fusedllm's own build so that the tests find them built."""

from __future__ import annotations

import glob
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_SOURCES = os.path.join(ROOT, "csrc", "cuda")
INCLUDE = os.path.join(ROOT, "csrc", "include")
FLAGS = ["-O3", "-std=c++20", "--expt-relaxed-constexpr"]


def cuda_include_dirs():
    """torch's headers, and the CUDA library headers its nvidia-* wheels ship
    (searched after the toolkit's, as the build does)."""
    torch_include = os.path.join(os.path.dirname(torch.__file__), "include")
    wheels = glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "*", "include"))
    return ["-I", CUDA_SOURCES, "-I", INCLUDE, "-isystem", torch_include,
            *(f"-Xcompiler=-idirafter,{d}" for d in wheels)]


def tensor_core_check():
    from torch.utils.cpp_extension import load

    return load(name="fusedllm_tensor_core_check", sources=[os.path.join(ROOT, "tests", "tensor_core_check.cu")],
                extra_include_paths=[CUDA_SOURCES, INCLUDE], extra_cuda_cflags=FLAGS,
                extra_cflags=["-std=c++20"], verbose=False)


def hopper_check():
    from torch.utils.cpp_extension import load

    return load(name="fusedllm_hopper_check", sources=[os.path.join(ROOT, "tests", "hopper_check.cu")],
                extra_include_paths=[CUDA_SOURCES, INCLUDE],
                extra_cuda_cflags=[*FLAGS, "-gencode", "arch=compute_90a,code=sm_90a"],
                extra_cflags=["-std=c++20"], verbose=False)


# The grouped products' header on CUDA tensors: the same entry point as the self-test op.
GPU_SOURCE = r"""
#include <torch/extension.h>
#include "grouped_gemm.cuh"

at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets, int64_t kind,
                      bool tensor_cores, int64_t tile) {
  const auto product = static_cast<fusedllm::cuda::GroupedProduct>(kind);
  at::Tensor out = kind == 2 ? at::empty({offsets.size(0) - 1, a.size(1), b.size(-1)}, a.options())
                             : at::empty({a.size(0), b.size(kind == 0 ? 1 : 2)}, a.options());
  fusedllm::cuda::grouped::grouped_mm(out, a, b, offsets, product, tensor_cores, static_cast<int>(tile));
  return out;
}
"""


def grouped_gemm_check():
    from torch.utils.cpp_extension import load_inline

    declaration = ("at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, "
                   "const at::Tensor& offsets, int64_t kind, bool tensor_cores, int64_t tile);")
    # On an sm_90 GPU, with the wgmma kernel's sm_90a machine code (as fusedllm's own build).
    hopper = (["-gencode", "arch=compute_90a,code=sm_90a", "-DFUSEDLLM_SM90A_IMAGE=1"]
              if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) else [])
    return load_inline(name="fusedllm_grouped_gemm_check", cpp_sources=declaration, cuda_sources=GPU_SOURCE,
                       functions=["grouped_mm"], extra_include_paths=[CUDA_SOURCES, INCLUDE],
                       # The CUDA library headers of torch's nvidia-* wheels, where the toolkit lacks them.
                       extra_cuda_cflags=[*FLAGS, *hopper,
                                          *(f for f in cuda_include_dirs() if f.startswith("-Xcompiler"))],
                       extra_cflags=["-std=c++20"], verbose=False)


def for_visible_gpu():
    """The builders of the extensions the visible GPU's tests load (the Hopper one on sm_90 only)."""
    builders = [tensor_core_check, grouped_gemm_check]
    if torch.cuda.get_device_capability() == (9, 0):
        builders.append(hopper_check)
    return builders


if __name__ == "__main__":  # python3 tests/gpu_extensions.py NAME: builds that one
    import sys

    globals()[sys.argv[1]]()
