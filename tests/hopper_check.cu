// The Hopper check product (csrc/cuda/hopper_check.cuh) on CUDA tensors, for an
// sm_90a GPU; built by tests/test_hopper.py.
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

#include "hopper_check.cuh"

at::Tensor wgmma_tile(const at::Tensor& a, const at::Tensor& b, int64_t span, bool b_mn_major, bool a_in_registers) {
  TORCH_CHECK_VALUE(a.is_cuda() && b.is_cuda(), "wgmma_tile: a and b must be CUDA tensors");
  const c10::cuda::CUDAGuard guard(a.device());
  // N = 128 only: each instantiation is ptxas time on the GPU machine, where this builds.
  return fusedllm::cuda::hopper::wgmma_tile<false>(a, b, span, b_mn_major, a_in_registers,
                                                   at::cuda::getCurrentCUDAStream());
}

// The TMA round trip (hopper_check.cuh) over CUDA tensors, the box landing
// `offset` bytes past a 1024-byte boundary.
std::tuple<at::Tensor, at::Tensor> tma_box(const at::Tensor& src, std::vector<int64_t> box,
                                           std::vector<int64_t> coords, int64_t swizzle, int64_t offset) {
  TORCH_CHECK_VALUE(src.is_cuda(), "tma_box: src must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(src.device());
  return fusedllm::cuda::hopper::tma_box(src, box, coords, swizzle, at::cuda::getCurrentCUDAStream(), offset);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("wgmma_tile", &wgmma_tile);
  m.def("tma_box", &tma_box);
}
