// Matrix products for the CPU ops (matmul.h).
#include "matmul.h"

#include <algorithm>

#include "fusedllm/cpu_dispatch.h"

namespace fusedllm::cpu {
namespace {

// Whether torch's multiply of this half-precision dtype runs on matrix
// instructions on this CPU. Without them it falls back to loops (AMD EPYC Zen 3,
// AVX2, torch 2.14.1, [512, 2048] x [2048, 4096]: 0.3-22 GFLOP/s by layout,
// against 61-65 for float32). Torch's bfloat16 multiply needs AVX-512; its
// float16 one needs AVX512-FP16 or AMX-FP16, which no variant here targets, so
// float16 always takes the float32 blocks.
bool native_half_matmul(at::ScalarType dtype) {
  return dtype == at::kBFloat16 && active_isa() >= Isa::kAvx512;
}

// out = a @ b (+ bias) from bfloat16 / float16 operands through float32
// blocks of at most kBlock in each dimension: each block of out is summed over
// K in float32 and rounded once, as the native multiply rounds it. The blocks
// are copied in their source's layout (a transposed operand stays transposed),
// and the buffers take 3 * 4 MiB whatever the sizes.
void float32_blocks_mm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                       const std::optional<at::Tensor>& bias) {
  constexpr int64_t kBlock = 1024;
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  const auto f32 = a.options().dtype(at::kFloat);
  const at::Tensor a_buf = at::empty({std::min(m, kBlock) * std::min(k, kBlock)}, f32);
  const at::Tensor b_buf = at::empty({std::min(k, kBlock) * std::min(n, kBlock)}, f32);
  const at::Tensor acc_buf = at::empty({std::min(m, kBlock) * std::min(n, kBlock)}, f32);
  // A float32 copy of block [r0, r0 + rows) x [c0, c0 + cols) of x.
  const auto block = [](const at::Tensor& buf, const at::Tensor& x, int64_t r0, int64_t rows,
                        int64_t c0, int64_t cols) {
    const at::Tensor src = x.narrow(0, r0, rows).narrow(1, c0, cols);
    const bool transposed = x.stride(0) == 1 && x.stride(1) != 1;
    at::Tensor dst = buf.narrow(0, 0, rows * cols);
    if (transposed) {
      dst = dst.view({cols, rows});
      dst.copy_(src.t());
      return dst.t();
    }
    dst = dst.view({rows, cols});
    dst.copy_(src);
    return dst;
  };
  const at::Tensor bias_f32 = bias.has_value() ? bias->to(at::kFloat) : at::Tensor();
  for (int64_t m0 = 0; m0 < m; m0 += kBlock) {
    const int64_t mb = std::min(kBlock, m - m0);
    for (int64_t n0 = 0; n0 < n; n0 += kBlock) {
      const int64_t nb = std::min(kBlock, n - n0);
      at::Tensor acc = acc_buf.narrow(0, 0, mb * nb).view({mb, nb});
      for (int64_t k0 = 0; k0 < k; k0 += kBlock) {
        const int64_t kb = std::min(kBlock, k - k0);
        const at::Tensor a_block = block(a_buf, a, m0, mb, k0, kb);
        const at::Tensor b_block = block(b_buf, b, k0, kb, n0, nb);
        if (k0 > 0) {
          acc.addmm_(a_block, b_block);
        } else if (bias_f32.defined()) {
          at::addmm_out(acc, bias_f32.narrow(0, n0, nb), a_block, b_block);
        } else {
          at::mm_out(acc, a_block, b_block);
        }
      }
      out.narrow(0, m0, mb).narrow(1, n0, nb).copy_(acc);
    }
  }
}

}  // namespace

void matrix_product(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                    const std::optional<at::Tensor>& bias) {
  const bool half = a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf;
  if (half && !native_half_matmul(a.scalar_type())) {
    float32_blocks_mm(out, a, b, bias);
  } else if (bias.has_value()) {
    at::addmm_out(out, *bias, a, b);  // one rounding, as F.linear's
  } else {
    at::mm_out(out, a, b);
  }
}

}  // namespace fusedllm::cpu
