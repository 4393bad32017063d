// quantize_kv: its schema (defined in fusedllm/kv_quant_op.h) and its CPU operator:
// rows in parallel, each with the shared fusedllm/kv_quant.h math. Appending to a
// cache writes few rows; this runs once per row, not per step. No autograd: a
// cache is written for inference.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "fusedllm/kv_quant.h"
#include "fusedllm/kv_quant_op.h"
#include "fusedllm/macros.h"

FUSEDLLM_DEFINE_OPS(fusedllm, define_kv_quant_ops)

namespace fusedllm::cpu {
namespace {

struct CpuQuantizeKv {
  static void run(const QuantizeKvPlan& p) {
    const at::Tensor& x = p.x;
    const int64_t d = p.head_dim, heads = x.size(1), seq = x.size(2);
    const kvq::Code code = p.code;
    uint8_t* values = static_cast<uint8_t*>(p.values.mutable_data_ptr());
    float* scales = p.scales.mutable_data_ptr<float>();
    const auto xs = x.strides(), vs = p.values.strides(), ss = p.scales.strides();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fusedllm_quantize_kv_cpu", [&] {
      const scalar_t* src = x.const_data_ptr<scalar_t>();
      at::parallel_for(0, p.rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const int64_t s = r % seq, h = (r / seq) % heads, b = r / (seq * heads);
          const scalar_t* row = src + b * xs[0] + h * xs[1] + s * xs[2];
          float amax = 0.0f, probe = 0.0f;
          for (int64_t c = 0; c < d; ++c) {
            const float v = static_cast<float>(row[c * xs[3]]);
            amax = std::fmax(amax, std::fabs(v));
            probe += v * 0.0f;
          }
          const float inverse = kvq::row_inverse(amax, code);
          uint8_t* out = values + b * vs[0] + h * vs[1] + s * vs[2];
          for (int64_t c = 0; c < d; ++c) {
            const float v = static_cast<float>(row[c * xs[3]]);
            out[c * vs[3]] = code == kvq::Code::kInt8 ? static_cast<uint8_t>(kvq::quantize(v, inverse))
                                                      : kvq::quantize_float8(v, inverse);
          }
          scales[b * ss[0] + h * ss[1] + s * ss[2]] = kvq::row_scale(amax, probe, code);
        }
      });
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fusedllm, CPU, m) { FUSEDLLM_IMPL_QUANTIZE_KV_OPS(m, CpuQuantizeKv); }

}  // namespace fusedllm::cpu
