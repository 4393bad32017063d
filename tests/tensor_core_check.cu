// The tensor-core check tile (csrc/cuda/mma_check.cuh) on CUDA tensors, with the
// hardware instructions or their portable forms; built by tests/test_tensor_core.py.
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

#include "mma_check.cuh"

at::Tensor mma_tile(const at::Tensor& a, const at::Tensor& b, bool b_rows_are_n, bool portable) {
  const int64_t d = fusedllm::cuda::mma::kCheckDim;
  TORCH_CHECK_VALUE(a.is_cuda() && b.is_cuda(), "mma_tile: a and b must be CUDA tensors");
  TORCH_CHECK_VALUE(a.sizes() == at::IntArrayRef({d, d}) && b.sizes() == at::IntArrayRef({d, d}),
                    "mma_tile: a and b must be [64, 64]");
  TORCH_CHECK_VALUE(a.scalar_type() == b.scalar_type() &&
                        (a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf),
                    "mma_tile: a and b must both be bfloat16 or both float16");
  const c10::cuda::CUDAGuard guard(a.device());
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  at::Tensor c = at::empty({d, d}, a.options().dtype(at::kFloat));
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (a.scalar_type() == at::kBFloat16) {
    fusedllm::cuda::mma::launch_mma_tile(ac.const_data_ptr<at::BFloat16>(), bc.const_data_ptr<at::BFloat16>(),
                                         c.data_ptr<float>(), b_rows_are_n, portable, stream);
  } else {
    fusedllm::cuda::mma::launch_mma_tile(ac.const_data_ptr<at::Half>(), bc.const_data_ptr<at::Half>(),
                                         c.data_ptr<float>(), b_rows_are_n, portable, stream);
  }
  return c;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("mma_tile", &mma_tile); }
