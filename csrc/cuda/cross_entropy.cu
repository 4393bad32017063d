// Linear cross-entropy ops on CUDA: the chunked pass of
// fusedllm/cross_entropy_op.h with the multiplies on cuBLAS (tensor cores for
// bfloat16 and float16, float32 results so the logits are never rounded) and
// one block per row for the row kernel: an online max and sum of exponentials
// in one read of the row, then one pass writing the gradient. The math is
// fusedllm/cross_entropy.h, which the CPU kernels run too.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "fusedllm/cross_entropy.h"
#include "fusedllm/cross_entropy_op.h"
#include "primitives.cuh"

namespace fusedllm::cuda {
namespace {

using Math = act::ScalarMath;

// Columns a thread reads ahead of using them.
constexpr int kLoads = 4;

// Grid-stride over rows, one row per block at a time. `grad` may alias
// `logits` (float32 and float64 inputs): each thread reads and writes only its
// own columns after the barrier that follows the target's read. With `slab`,
// the logits are the columns column0 .. column0 + vocab - 1 of the rows
// (o.vocab is the whole vocabulary's size): lse is read and only the gradient
// is written.
template <typename A, typename G>
__global__ void cross_entropy_rows_kernel(A* logits, int64_t logits_stride,
                                          const int64_t* __restrict__ target, A* __restrict__ loss,
                                          A* __restrict__ lse_io, const A* __restrict__ scale,
                                          G* grad, int64_t grad_stride, int64_t rows, int64_t vocab,
                                          ce::Options o, int64_t ignore_index, bool slab,
                                          int64_t column0) {
  __shared__ A scratch[kWarpSize];
  const bool capped = o.softcap > 0.0;
  const A cap = A(o.softcap);
  const A inf = std::numeric_limits<A>::infinity();
  const A nan = std::numeric_limits<A>::quiet_NaN();
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    A* s = logits + r * logits_stride;
    const int64_t t = target[r];
    const bool ignored = t == ignore_index;
    // An out-of-range target (checked on the host for CPU tensors only) gives NaN.
    const bool valid = ignored || (t >= 0 && t < o.vocab);
    const int64_t tc = t - column0;  // the target's column here, if this row holds it
    A lse;
    if (slab) {
      lse = lse_io[r];  // and each thread caps its own columns in the gradient's loop
    } else {
      // This thread's columns: online maximum and sum of exponentials, sum of s.
      // kLoads columns are read before any is used, so that their loads are in
      // flight together (one at a time, a block waited on each in turn); the
      // arithmetic is column by column, in order.
      A m = -inf, l = A(0), total = A(0);
      const int64_t step = blockDim.x;
      for (int64_t j0 = threadIdx.x; j0 < vocab; j0 += kLoads * step) {
        A x[kLoads];
#pragma unroll
        for (int i = 0; i < kLoads; ++i) x[i] = j0 + i * step < vocab ? s[j0 + i * step] : A(0);
#pragma unroll
        for (int i = 0; i < kLoads; ++i) {
          const int64_t j = j0 + i * step;
          if (j >= vocab) break;
          A v = x[i];
          if (capped) {
            v = ce::capped<Math>(v, cap);
            s[j] = v;
          }
          total += v;
          if (v > m) {
            l = l * Math::exp(m - v) + A(1);
            m = v;
          } else {
            l += Math::exp(v - m);
          }
        }
      }
      const A row_max = block_reduce_max(m, scratch);
      const A sum_exp = block_reduce_sum(m == -inf ? A(0) : l * Math::exp(m - row_max), scratch);
      const A s_sum = block_reduce_sum(total, scratch);  // its barriers publish the capped s
      lse = row_max + Math::log(sum_exp);
      if (threadIdx.x == 0) {
        lse_io[r] = lse;
        loss[r] = ignored ? A(0) : (valid ? ce::row_loss<A>(o, lse, s[tc], s_sum) : nan);
      }
    }
    if (grad == nullptr) continue;
    if (!slab) __syncthreads();  // thread 0 has read s[tc] before it may be overwritten
    G* d = grad + r * grad_stride;
    const ce::RowGrad<A> g = ce::row_grad<A>(o, lse, scale ? scale[r] : A(1));
    const A inv_cap = capped ? A(1) / cap : A(0);
#pragma unroll kLoads
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
      A v;
      if (ignored) {
        v = A(0);
      } else if (!valid) {
        v = nan;
      } else {
        const A sj = slab && capped ? ce::capped<Math>(s[j], cap) : s[j];
        v = g.p_scale * Math::exp(sj - lse) - g.off - (j == tc ? g.on : A(0));
        if (capped) v *= ce::cap_slope(sj, inv_cap);
      }
      d[j] = static_cast<G>(v);
    }
  }
}

constexpr int kRowThreads = 256;

struct CudaCrossEntropy {
  // float32 logits (cuBLAS's float32 output from bfloat16 / float16 operands).
  static constexpr bool kLogitsInInputDtype = false;

  static void matmul(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                     const std::optional<at::Tensor>& bias) {
#if defined(FUSEDLLM_SIMT)
    // Emulated: CPU tensors, the operands widened as the GPU's float32
    // accumulation does, the result rounded once.
    const at::ScalarType acc = a.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    at::Tensor product = at::mm(a.to(acc), b.to(acc));
    if (bias.has_value()) product.add_(bias->to(acc));
    out.copy_(product);
#else
    if (a.scalar_type() != out.scalar_type()) {
      at::mm_out(out, a, b, out.scalar_type());
      if (bias.has_value()) out.add_(*bias);
    } else if (bias.has_value()) {
      at::addmm_out(out, *bias, a, b);
    } else {
      at::mm_out(out, a, b);
    }
#endif
  }

  static void rows(const CrossEntropyRows& r) {
    const DeviceGuard guard(r.logits.device());
    const Stream stream = current_stream();
    const int64_t rows = r.logits.size(0), vocab = r.logits.size(1);
    const int blocks = static_cast<int>(std::clamp<int64_t>(
        rows, 1, static_cast<int64_t>(device_properties().multiProcessorCount) * 8));
    const auto run = [&](auto logits_tag, auto grad_tag) {
      using A = decltype(logits_tag);
      using G = decltype(grad_tag);
      launch("cross_entropy_rows_kernel", cross_entropy_rows_kernel<A, G>, blocks, kRowThreads, 0,
             stream, r.logits.mutable_data_ptr<A>(), r.logits.stride(0),
             r.target.const_data_ptr<int64_t>(), r.loss.mutable_data_ptr<A>(),
             r.lse.mutable_data_ptr<A>(), r.scale.defined() ? r.scale.const_data_ptr<A>() : nullptr,
             r.grad ? r.grad_logits.mutable_data_ptr<G>() : nullptr,
             r.grad ? r.grad_logits.stride(0) : int64_t{0}, rows, vocab, r.options,
             r.ignore_index, r.slab, r.column0);
    };
    // The gradient has the input's dtype: the logits' own (in place) or a half type.
    const at::ScalarType grad_dtype = r.grad ? r.grad_logits.scalar_type() : r.logits.scalar_type();
    if (r.logits.scalar_type() == at::kDouble) {
      run(double{}, double{});
    } else if (grad_dtype == at::kBFloat16) {
      run(float{}, at::BFloat16{});
    } else if (grad_dtype == at::kHalf) {
      run(float{}, at::Half{});
    } else {
      run(float{}, float{});
    }
  }
};

}  // namespace

FUSEDLLM_CUDA_OPS_IMPL(m) { FUSEDLLM_IMPL_CROSS_ENTROPY_OPS(m, CudaCrossEntropy); }

}  // namespace fusedllm::cuda
