// Linear cross-entropy ops on CUDA: the chunked pass of
// fusedllm/cross_entropy_op.h with the multiplies on cuBLAS (tensor cores for
// bfloat16 and float16, float32 accumulation, the logits rounded once to the
// input dtype) and one block per row for the row kernel: an online max and sum
// of exponentials in one read of the row, then one pass writing the gradient
// over the logits. The math is fusedllm/cross_entropy.h, which the CPU kernels
// run too.
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

// Packs a thread reads ahead of using them; with a soft cap (whose tanh makes
// the passes issue-bound, not memory-bound) two, which keeps them in registers.
template <bool kCapped>
constexpr int kLoads = kCapped ? 2 : 4;

// Threads a row; at least two blocks a SM (registers at most 128), so that a
// SM has 32 KB of a row's loads in flight.
constexpr int kRowThreads = 256;
constexpr int kRowBlocksPerSm = 2;

// e^x for the row passes: float32 as ex2.approx (two instructions; about 2 ulp,
// probabilities below 2^-126 flushed to zero) where an accurate expf was ten and
// made the passes issue-bound; float64 exactly.
__device__ __forceinline__ float row_exp(float x) { return exp_ftz(x); }
__device__ __forceinline__ double row_exp(double x) { return Math::exp(x); }

// s, the logit as the loss sees it: z capped (in A, from the stored z, so that
// no capped value is ever rounded), or z.
template <bool kCapped, typename A, typename T>
__device__ __forceinline__ A logit_of(T z, A cap) {
  const A v = static_cast<A>(z);
  if constexpr (kCapped) {
    return ce::capped<Math>(v, cap);
  } else {
    return v;
  }
}

// kN packs of row `s` from pack p0 on, a block's width apart (those past
// `packs` not read).
template <typename T, int kVec, int kN>
struct PacksAhead {
  Pack<T, kVec> x[kN];
  __device__ __forceinline__ PacksAhead(const T* s, int64_t p0, int64_t step, int64_t packs) {
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      if (p0 + i * step < packs) x[i] = load_pack<T, kVec>(s + (p0 + i * step) * kVec);
    }
  }
};

// This thread's share of a row's statistics: the running maximum m and sum of
// exponentials l (rescaled once a pack), and the sum of s.
template <bool kCapped, typename T, typename A, int kVec>
__device__ __forceinline__ void row_statistics(const T* s, int64_t packs, A cap, A& m, A& l,
                                               A& total) {
  const int64_t step = blockDim.x;
  constexpr int kN = kLoads<kCapped>;
  for (int64_t p0 = threadIdx.x; p0 < packs; p0 += kN * step) {
    const PacksAhead<T, kVec, kN> ahead(s, p0, step, packs);
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      if (p0 + i * step >= packs) break;
      A v[kVec];
      A pack_max = v[0] = logit_of<kCapped, A>(ahead.x[i].v[0], cap);
#pragma unroll
      for (int k = 1; k < kVec; ++k) {
        v[k] = logit_of<kCapped, A>(ahead.x[i].v[k], cap);
        pack_max = v[k] > pack_max ? v[k] : pack_max;
      }
      if (pack_max > m) {
        l *= row_exp(m - pack_max);
        m = pack_max;
      }
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        total += v[k];
        l += row_exp(v[k] - m);
      }
    }
  }
}

// The gradient over this thread's packs of the row, in place: with target
// column tc (if in this row), (p_scale e^(s - lse) - off - [j == tc] on) ds/dz.
template <bool kCapped, typename T, typename A, int kVec>
__device__ __forceinline__ void row_gradient(T* s, int64_t packs, A cap, A lse,
                                             const ce::RowGrad<A>& g, int64_t tc) {
  const int64_t step = blockDim.x;
  const A inv_cap = kCapped ? A(1) / cap : A(0);
  constexpr int kN = kLoads<kCapped>;
  for (int64_t p0 = threadIdx.x; p0 < packs; p0 += kN * step) {
    const PacksAhead<T, kVec, kN> ahead(s, p0, step, packs);
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const int64_t p = p0 + i * step;
      if (p >= packs) break;
      const int64_t target_lane = tc - p * kVec;  // in [0, kVec) in the target's pack only
      Pack<T, kVec> d;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const A sj = logit_of<kCapped, A>(ahead.x[i].v[k], cap);
        A v = g.p_scale * row_exp(sj - lse) - g.off - (k == target_lane ? g.on : A(0));
        if constexpr (kCapped) v *= ce::cap_slope(sj, inv_cap);
        d.v[k] = static_cast<T>(v);
      }
      store_pack_words<T, kVec>(s + p * kVec, d);
    }
  }
}

// A row's gradient that is one value throughout (an ignored target: 0; an
// invalid one: NaN).
template <typename T, int kVec>
__device__ __forceinline__ void row_fill(T* s, int64_t packs, T value) {
  Pack<T, kVec> d;
#pragma unroll
  for (int k = 0; k < kVec; ++k) d.v[k] = value;
  for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) store_pack_words<T, kVec>(s + p * kVec, d);
}

// Grid-stride over rows, one row per block at a time; the logits (the input
// dtype T, math in A) are read kVec at a time (16 bytes, or 1 where the row's
// length or alignment does not allow it), kLoads packs in flight a thread.
// With `grad` each thread writes the gradient over its own columns, after the
// barrier that follows the target's read. With `slab`, the logits are the
// columns column0 .. column0 + vocab - 1 of the rows (o.vocab is the whole
// vocabulary's size): lse is read and only the gradient is written.
template <typename T, typename A, int kVec>
__global__ void __launch_bounds__(kRowThreads, kRowBlocksPerSm) cross_entropy_rows_kernel(T* logits, int64_t logits_stride,
                                          const int64_t* __restrict__ target, A* __restrict__ loss,
                                          A* __restrict__ lse_io, const A* __restrict__ scale,
                                          bool grad, int64_t rows, int64_t vocab, ce::Options o,
                                          int64_t ignore_index, bool slab, int64_t column0) {
  __shared__ A scratch[kWarpSize];
  const bool capped = o.softcap > 0.0;
  const A cap = A(o.softcap);
  const A inf = std::numeric_limits<A>::infinity();
  const A nan = std::numeric_limits<A>::quiet_NaN();
  const int64_t packs = vocab / kVec;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    T* s = logits + r * logits_stride;
    const int64_t t = target[r];
    const bool ignored = t == ignore_index;
    // An out-of-range target (checked on the host for CPU tensors only) gives NaN.
    const bool valid = ignored || (t >= 0 && t < o.vocab);
    const int64_t tc = t - column0;  // the target's column here, if this row holds it
    A lse;
    if (slab) {
      lse = lse_io[r];
    } else {
      A m = -inf, l = A(0), total = A(0);
      if (capped) {
        row_statistics<true, T, A, kVec>(s, packs, cap, m, l, total);
      } else {
        row_statistics<false, T, A, kVec>(s, packs, cap, m, l, total);
      }
      const A row_max = block_reduce_max(m, scratch);
      const A sum_exp = block_reduce_sum(m == -inf ? A(0) : l * Math::exp(m - row_max), scratch);
      const A s_sum = block_reduce_sum(total, scratch);
      lse = row_max + Math::log(sum_exp);
      if (threadIdx.x == 0) {
        lse_io[r] = lse;
        if (ignored || !valid) {
          loss[r] = ignored ? A(0) : nan;
        } else {  // s[tc] only for a target in the row
          const A s_target = capped ? logit_of<true, A>(s[tc], cap) : static_cast<A>(s[tc]);
          loss[r] = ce::row_loss<A>(o, lse, s_target, s_sum);
        }
      }
    }
    if (!grad) continue;
    if (!slab) __syncthreads();  // thread 0 has read s[tc] before it may be overwritten
    if (ignored || !valid) {
      row_fill<T, kVec>(s, packs, static_cast<T>(ignored ? A(0) : nan));
    } else {
      const ce::RowGrad<A> g = ce::row_grad<A>(o, lse, scale ? scale[r] : A(1));
      if (capped) {
        row_gradient<true, T, A, kVec>(s, packs, cap, lse, g, tc);
      } else {
        row_gradient<false, T, A, kVec>(s, packs, cap, lse, g, tc);
      }
    }
  }
}

struct CudaCrossEntropy {
  // At 512 rows or more a chunk's products are compute-bound on an H100
  // (262 FLOP a byte of bfloat16 weight at 256 rows is its ridge point), and
  // reading and writing a half-precision weight's gradient once per chunk
  // costs less than a fourth multiply; below, the slabs are faster.
  static constexpr int64_t kHalfWeightSumFromRows = 512;

  static void matmul(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                     const std::optional<at::Tensor>& bias) {
#if defined(FUSEDLLM_SIMT)
    // Emulated: CPU tensors, the operands widened as the GPU's float32
    // accumulation does, the result rounded once.
    at::Tensor product = at::mm(widened(a), widened(b));
    if (bias.has_value()) product.add_(widened(*bias));
    out.copy_(product);
#else
    if (bias.has_value()) {
      at::addmm_out(out, *bias, a, b);
    } else {
      at::mm_out(out, a, b);
    }
#endif
  }

  static void matmul_add(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
#if defined(FUSEDLLM_SIMT)
    out.copy_(at::addmm(widened(out), widened(a), widened(b)));
#else
    out.addmm_(a, b);
#endif
  }

  static void rows(const CrossEntropyRows& r) {
    const DeviceGuard guard(r.logits.device());
    const Stream stream = current_stream();
    const int64_t rows = r.logits.size(0), vocab = r.logits.size(1);
    const int blocks = static_cast<int>(std::clamp<int64_t>(
        rows, 1, static_cast<int64_t>(device_properties().multiProcessorCount) * 8));
    const auto run = [&](auto tag, auto acc_tag) {
      using T = decltype(tag);
      using A = decltype(acc_tag);
      const auto launch_with = [&](auto kernel) {
        launch("cross_entropy_rows_kernel", kernel, blocks, kRowThreads, 0, stream,
               r.logits.mutable_data_ptr<T>(), r.logits.stride(0),
               r.target.const_data_ptr<int64_t>(), r.loss.mutable_data_ptr<A>(),
               r.lse.mutable_data_ptr<A>(),
               r.scale.defined() ? r.scale.const_data_ptr<A>() : nullptr, r.grad, rows, vocab,
               r.options, r.ignore_index, r.slab, r.column0);
      };
      constexpr int kWide = 16 / sizeof(T);
      if (pack_width<T>(vocab, {{r.logits.const_data_ptr(), r.logits.stride(0)}}) == kWide) {
        launch_with(cross_entropy_rows_kernel<T, A, kWide>);
      } else {
        launch_with(cross_entropy_rows_kernel<T, A, 1>);
      }
    };
    switch (r.logits.scalar_type()) {
      case at::kDouble: run(double{}, double{}); break;
      case at::kBFloat16: run(at::BFloat16{}, float{}); break;
      case at::kHalf: run(at::Half{}, float{}); break;
      default: run(float{}, float{}); break;
    }
  }

 private:
  // An operand as the GPU's multiply accumulates it: float32 (float64 for float64).
  static at::Tensor widened(const at::Tensor& t) {
    return t.to(accumulation_dtype(t));
  }
};

}  // namespace

FUSEDLLM_CUDA_OPS_DEFINE(define_cross_entropy_ops)
FUSEDLLM_CUDA_OPS_IMPL(m) { FUSEDLLM_IMPL_CROSS_ENTROPY_OPS(m, CudaCrossEntropy); }

}  // namespace fusedllm::cuda
