// quantize_kv on CUDA: one warp per row (one position of one kv head), its
// max|x| a warp reduction; the math is fusedllm/kv_quant.h, as on the CPU.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>

#include "fusedllm/kv_quant.h"
#include "fusedllm/kv_quant_op.h"
#include "primitives.cuh"

namespace fusedllm::cuda {
namespace {

struct RowStrides {
  int64_t b, h, s, c;
};

RowStrides strides4(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2), t.dim() > 3 ? t.stride(3) : 0}; }

constexpr int kWarpsPerBlock = 4;

template <typename T>
__global__ void quantize_kv_kernel(const T* __restrict__ x, RowStrides xs, uint8_t* __restrict__ values,
                                   RowStrides vs, float* __restrict__ scales, RowStrides ss,
                                   int64_t heads, int64_t seq, int64_t rows, int64_t d, kvq::Code code) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  for (int64_t r = first; r < rows; r += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const int64_t s = r % seq, h = (r / seq) % heads, b = r / (seq * heads);
    const T* row = x + b * xs.b + h * xs.h + s * xs.s;
    float amax = 0.0f, probe = 0.0f;
    for (int64_t c = lane; c < d; c += kWarpSize) {
      const float v = static_cast<float>(row[c * xs.c]);
      amax = fmaxf(amax, fabsf(v));
      probe += v * 0.0f;
    }
    amax = warp_reduce_max(amax);
    probe = warp_reduce_sum(probe);
    const float inverse = kvq::row_inverse(amax, code);
    uint8_t* out = values + b * vs.b + h * vs.h + s * vs.s;
    for (int64_t c = lane; c < d; c += kWarpSize) {
      const float v = static_cast<float>(row[c * xs.c]);
      out[c * vs.c] = code == kvq::Code::kInt8 ? static_cast<uint8_t>(kvq::quantize(v, inverse))
                                               : kvq::quantize_float8(v, inverse);
    }
    if (lane == 0) scales[b * ss.b + h * ss.h + s * ss.s] = kvq::row_scale(amax, probe, code);
  }
}

struct CudaQuantizeKv {
  static void run(const QuantizeKvPlan& p) {
    const DeviceGuard guard(p.x.device());
    const int64_t max_blocks = static_cast<int64_t>(device_properties().multiProcessorCount) * 16;
    const int blocks = static_cast<int>(
        std::clamp<int64_t>((p.rows + kWarpsPerBlock - 1) / kWarpsPerBlock, 1, max_blocks));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, p.x.scalar_type(), "fusedllm_quantize_kv_cuda", [&] {
      launch("quantize_kv_kernel", quantize_kv_kernel<scalar_t>, blocks, kWarpsPerBlock * kWarpSize, 0,
          current_stream(), p.x.const_data_ptr<scalar_t>(), strides4(p.x),
          static_cast<uint8_t*>(p.values.mutable_data_ptr()), strides4(p.values),
          p.scales.mutable_data_ptr<float>(), strides4(p.scales), p.x.size(1), p.x.size(2), p.rows, p.head_dim,
          p.code);
    });
  }
};

}  // namespace

FUSEDLLM_CUDA_OPS_DEFINE(define_kv_quant_ops)
FUSEDLLM_CUDA_OPS_IMPL(m) { FUSEDLLM_IMPL_QUANTIZE_KV_OPS(m, CudaQuantizeKv); }

}  // namespace fusedllm::cuda
