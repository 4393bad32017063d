// The Hopper check product (csrc/cuda/hopper_check.cuh) on CUDA tensors, for an
// sm_90a GPU; built by tests/test_hopper.py.
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

#include "hopper_check.cuh"

at::Tensor wgmma_tile(const at::Tensor& a, const at::Tensor& b, int64_t span, bool b_mn_major, bool a_in_registers) {
  TORCH_CHECK_VALUE(a.is_cuda() && b.is_cuda(), "wgmma_tile: a and b must be CUDA tensors");
  TORCH_CHECK_VALUE(a.dim() == 2 && b.dim() == 2 && a.size(0) == 64, "wgmma_tile: a must be [64, k] and b 2-D");
  TORCH_CHECK_VALUE(a.scalar_type() == b.scalar_type() &&
                        (a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf),
                    "wgmma_tile: a and b must both be bfloat16 or both float16");
  const c10::cuda::CUDAGuard guard(a.device());
  const int64_t k = a.size(1), n = b_mn_major ? b.size(1) : b.size(0);
  // N = 128 only: each instantiation is ptxas time on the GPU machine, where this builds.
  TORCH_CHECK_VALUE(n == 128 && k > 0 && k % 64 == 0, "wgmma_tile: n must be 128 and k a positive multiple of 64");
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  at::Tensor c = at::empty({64, n}, a.options().dtype(at::kFloat));
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (a.scalar_type() == at::kBFloat16) {
    fusedllm::cuda::hopper::launch_wgmma_tile_n<at::BFloat16, 128>(
        ac.const_data_ptr<at::BFloat16>(), bc.const_data_ptr<at::BFloat16>(), c.data_ptr<float>(), static_cast<int>(k),
        static_cast<int>(span), b_mn_major, a_in_registers, stream);
  } else {
    fusedllm::cuda::hopper::launch_wgmma_tile_n<at::Half, 128>(
        ac.const_data_ptr<at::Half>(), bc.const_data_ptr<at::Half>(), c.data_ptr<float>(), static_cast<int>(k),
        static_cast<int>(span), b_mn_major, a_in_registers, stream);
  }
  return c;
}

// The TMA round trip (hopper_check.cuh) over CUDA tensors.
std::tuple<at::Tensor, at::Tensor> tma_box(const at::Tensor& src, std::vector<int64_t> box,
                                           std::vector<int64_t> coords, int64_t swizzle) {
  TORCH_CHECK_VALUE(src.is_cuda(), "tma_box: src must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(src.device());
  return fusedllm::cuda::hopper::tma_box(src, box, coords, swizzle, at::cuda::getCurrentCUDAStream());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("wgmma_tile", &wgmma_tile);
  m.def("tma_box", &tma_box);
}
