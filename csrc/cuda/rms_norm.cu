// rms_norm ops on CUDA. One block per row (grid-stride over rows), packed
// 16-byte loads where the layout allows, block reductions from primitives.cuh,
// per-row math from fusedllm/rms_norm.h (the code the CPU kernels run too).
// Rows that fit in registers (up to 4 packs a thread) take the *_rows kernels;
// longer or unaligned rows, and float64, the two-pass kernels.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

#include "fusedllm/rms_norm.h"
#include "fusedllm/rms_norm_op.h"
#include "primitives.cuh"

namespace fusedllm::cuda {
namespace {

using rms::Casting;

// Rounds an accumulator value to T and back (what storing it in a T tensor does).
template <typename T, typename acc_t>
struct RoundTo {
  __device__ __forceinline__ acc_t operator()(acc_t v) const {
    return static_cast<acc_t>(static_cast<T>(v));
  }
};

template <typename T, int kVec, bool kHasWeight, Casting kCasting>
__global__ void rms_norm_forward_kernel(const T* __restrict__ input, int64_t input_stride,
                                        const T* __restrict__ residual, int64_t residual_stride,
                                        const T* __restrict__ weight, T* __restrict__ out,
                                        T* __restrict__ residual_out, at::opmath_type<T>* rstd_out,
                                        int64_t rows, int64_t n, at::opmath_type<T> eps,
                                        at::opmath_type<T> offset) {
  using acc_t = at::opmath_type<T>;
  __shared__ acc_t scratch[kWarpSize];
  const RoundTo<T, acc_t> round;
  const int64_t packs = n / kVec;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* x = input + r * input_stride;
    const T* src = x;
    acc_t sumsq = 0;
    if (residual != nullptr) {
      const T* res = residual + r * residual_stride;
      T* h = residual_out + r * n;
      for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
        Pack<T, kVec> a = load_pack<T, kVec>(x + i * kVec);
        const Pack<T, kVec> b = load_pack<T, kVec>(res + i * kVec);
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          a.v[k] = static_cast<T>(static_cast<acc_t>(a.v[k]) + static_cast<acc_t>(b.v[k]));
          const acc_t v = static_cast<acc_t>(a.v[k]);
          sumsq += v * v;
        }
        store_pack<T, kVec>(h + i * kVec, a);
      }
      src = h;  // each thread re-reads only the packs it wrote
    } else {
      for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
        const Pack<T, kVec> a = load_pack<T, kVec>(x + i * kVec);
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const acc_t v = static_cast<acc_t>(a.v[k]);
          sumsq += v * v;
        }
      }
    }
    sumsq = block_reduce_sum(sumsq, scratch);
    const acc_t rstd = rms::rstd_from_sumsq<acc_t>(sumsq, n, eps);
    if (threadIdx.x == 0) rstd_out[r] = rstd;

    T* y = out + r * n;
    for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
      const Pack<T, kVec> a = load_pack<T, kVec>(src + i * kVec);
      Pack<T, kVec> w;
      if constexpr (kHasWeight) w = load_pack<T, kVec>(weight + i * kVec);
      Pack<T, kVec> o;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const acc_t w_eff = kHasWeight ? static_cast<acc_t>(w.v[k]) + offset : acc_t(1);
        o.v[k] = static_cast<T>(
            rms::forward_value(static_cast<acc_t>(a.v[k]), rstd, w_eff, kCasting, round));
      }
      store_pack<T, kVec>(y + i * kVec, o);
    }
  }
}

// dx for every row handled by this block, and this block's dw partial sums in
// `partial[blockIdx.x, :]` (each column owned by one thread: no atomics).
template <typename T, int kVec, bool kHasWeight, Casting kCasting>
__global__ void rms_norm_backward_kernel(const T* __restrict__ grad_out, int64_t grad_out_stride,
                                         const T* __restrict__ input, int64_t input_stride,
                                         const at::opmath_type<T>* __restrict__ rstd_in,
                                         const T* __restrict__ weight,
                                         const T* __restrict__ grad_residual,
                                         int64_t grad_residual_stride, T* __restrict__ grad_input,
                                         at::opmath_type<T>* __restrict__ partial, int64_t rows,
                                         int64_t n, at::opmath_type<T> offset) {
  using acc_t = at::opmath_type<T>;
  __shared__ acc_t scratch[kWarpSize];
  const RoundTo<T, acc_t> round;
  const int64_t packs = n / kVec;
  acc_t* dw = partial != nullptr ? partial + blockIdx.x * n : nullptr;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* g = grad_out + r * grad_out_stride;
    const T* x = input + r * input_stride;
    const acc_t rstd = rstd_in[r];
    acc_t dot = 0;
    for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
      const Pack<T, kVec> gp = load_pack<T, kVec>(g + i * kVec);
      const Pack<T, kVec> xp = load_pack<T, kVec>(x + i * kVec);
      Pack<T, kVec> wp;
      if constexpr (kHasWeight) wp = load_pack<T, kVec>(weight + i * kVec);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const acc_t w_eff = kHasWeight ? static_cast<acc_t>(wp.v[k]) + offset : acc_t(1);
        dot += rms::backward_dot_term(static_cast<acc_t>(gp.v[k]), static_cast<acc_t>(xp.v[k]),
                                      rstd, w_eff);
      }
    }
    const acc_t mean_dot = block_reduce_sum(dot, scratch) / static_cast<acc_t>(n);

    const T* gr = grad_residual != nullptr ? grad_residual + r * grad_residual_stride : nullptr;
    T* dx = grad_input + r * n;
    for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
      const Pack<T, kVec> gp = load_pack<T, kVec>(g + i * kVec);
      const Pack<T, kVec> xp = load_pack<T, kVec>(x + i * kVec);
      Pack<T, kVec> wp, grp, o;
      if constexpr (kHasWeight) wp = load_pack<T, kVec>(weight + i * kVec);
      if (gr != nullptr) grp = load_pack<T, kVec>(gr + i * kVec);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const acc_t gv = static_cast<acc_t>(gp.v[k]);
        const acc_t xv = static_cast<acc_t>(xp.v[k]);
        const acc_t w_eff = kHasWeight ? static_cast<acc_t>(wp.v[k]) + offset : acc_t(1);
        acc_t d = rms::input_grad(gv, xv, rstd, w_eff, mean_dot);
        if (gr != nullptr) d += static_cast<acc_t>(grp.v[k]);
        o.v[k] = static_cast<T>(d);
        if (kHasWeight && dw != nullptr) {
          dw[i * kVec + k] += rms::weight_grad_term(gv, xv, rstd, kCasting, round);
        }
      }
      store_pack<T, kVec>(dx + i * kVec, o);
    }
  }
}

// At most this many threads a block: a thread holds up to 96 registers (ptxas
// -v, sm_90), and 1024 of them asked for more than a multiprocessor has.
constexpr int kMaxRowThreads = 512;

// Rows of up to kPacks packs per thread are held in registers: one read of
// each input per row, and in backward the weight read once per block and the
// dw partial sums kept in registers over all the block's rows (one float32 row
// written per block at the end, instead of a read-modify-write per row).
// Thread t holds packs t, t + blockDim.x, ... of every row.
//
// The forward, with up to two packs a thread, loads the block's next row
// before this row's reduction and stores, so that its loads stay in flight
// while the block sums and writes. It re-reads the weight per row (from L1)
// instead of holding it, which leaves the registers to the next row (ptxas,
// sm_90, two bfloat16 packs a thread: 46 registers, where holding it took 59).
template <int kPacks>
constexpr bool kLoadNextRow = kPacks <= 2;

// dst[j] = row's pack threadIdx.x + j * blockDim.x, for those of the row's `packs`.
template <typename T, int kVec, int kPacks>
__device__ __forceinline__ void load_row_packs(const T* __restrict__ row, int packs,
                                               Pack<T, kVec> (&dst)[kPacks]) {
#pragma unroll
  for (int j = 0; j < kPacks; ++j) {
    const int p = threadIdx.x + j * blockDim.x;
    if (p < packs) dst[j] = load_pack<T, kVec>(row + p * kVec);
  }
}

template <typename T, int kVec, int kPacks, bool kHasWeight, Casting kCasting>
__global__ void __launch_bounds__(kMaxRowThreads)
rms_norm_forward_rows_kernel(const T* __restrict__ input, int64_t input_stride,
                             const T* __restrict__ residual, int64_t residual_stride,
                             const T* __restrict__ weight, T* __restrict__ out,
                             T* __restrict__ residual_out, at::opmath_type<T>* rstd_out,
                             int64_t rows, int64_t n, at::opmath_type<T> eps,
                             at::opmath_type<T> offset) {
  using acc_t = at::opmath_type<T>;
  __shared__ acc_t scratch[kWarpSize];
  const RoundTo<T, acc_t> round;
  const int packs = static_cast<int>(n / kVec);
  // a: the row's input packs (the fused add's residual is read in the row's turn)
  Pack<T, kVec> a[kPacks];
  int64_t r = blockIdx.x;
  if (kLoadNextRow<kPacks> && r < rows) load_row_packs<T, kVec, kPacks>(input + r * input_stride, packs, a);
  for (; r < rows; r += gridDim.x) {
    Pack<T, kVec> next_a[kPacks];
    const int64_t next = r + gridDim.x;
    if constexpr (kLoadNextRow<kPacks>) {
      if (next < rows) load_row_packs<T, kVec, kPacks>(input + next * input_stride, packs, next_a);
    } else {
      load_row_packs<T, kVec, kPacks>(input + r * input_stride, packs, a);
    }
    acc_t sumsq = 0;
    if (residual != nullptr) {
      const T* res = residual + r * residual_stride;
      T* h = residual_out + r * n;
#pragma unroll
      for (int j = 0; j < kPacks; ++j) {
        const int p = threadIdx.x + j * blockDim.x;
        if (p >= packs) continue;
        const Pack<T, kVec> b = load_pack<T, kVec>(res + p * kVec);
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          a[j].v[k] = static_cast<T>(static_cast<acc_t>(a[j].v[k]) + static_cast<acc_t>(b.v[k]));
        }
        store_pack<T, kVec>(h + p * kVec, a[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      if (threadIdx.x + j * blockDim.x >= packs) continue;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const acc_t v = static_cast<acc_t>(a[j].v[k]);
        sumsq += v * v;
      }
    }
    sumsq = block_reduce_sum(sumsq, scratch);
    const acc_t rstd = rms::rstd_from_sumsq<acc_t>(sumsq, n, eps);
    if (threadIdx.x == 0) rstd_out[r] = rstd;
    T* y = out + r * n;
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      const int p = threadIdx.x + j * blockDim.x;
      if (p >= packs) continue;
      Pack<T, kVec> o, w;
      if constexpr (kHasWeight) w = load_pack<T, kVec>(weight + p * kVec);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const acc_t w_eff = kHasWeight ? static_cast<acc_t>(w.v[k]) + offset : acc_t(1);
        o.v[k] = static_cast<T>(
            rms::forward_value(static_cast<acc_t>(a[j].v[k]), rstd, w_eff, kCasting, round));
      }
      store_pack<T, kVec>(y + p * kVec, o);
    }
    if constexpr (kLoadNextRow<kPacks>) {
#pragma unroll
      for (int j = 0; j < kPacks; ++j) a[j] = next_a[j];
    }
  }
}

// As rms_norm_backward_kernel; this block's dw partial sums are written whole
// to `partial[blockIdx.x, :]` at the end (every block has at least one row).
template <typename T, int kVec, int kPacks, bool kHasWeight, Casting kCasting>
__global__ void __launch_bounds__(kMaxRowThreads)
rms_norm_backward_rows_kernel(const T* __restrict__ grad_out, int64_t grad_out_stride,
                              const T* __restrict__ input, int64_t input_stride,
                              const at::opmath_type<T>* __restrict__ rstd_in,
                              const T* __restrict__ weight, const T* __restrict__ grad_residual,
                              int64_t grad_residual_stride, T* __restrict__ grad_input,
                              at::opmath_type<T>* __restrict__ partial, int64_t rows, int64_t n,
                              at::opmath_type<T> offset) {
  using acc_t = at::opmath_type<T>;
  __shared__ acc_t scratch[kWarpSize];
  const RoundTo<T, acc_t> round;
  const int packs = static_cast<int>(n / kVec);
  Pack<T, kVec> w[kPacks];
  if constexpr (kHasWeight) load_row_packs<T, kVec, kPacks>(weight, packs, w);
  Pack<acc_t, kVec> dw[kPacks];
#pragma unroll
  for (int j = 0; j < kPacks; ++j) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) dw[j].v[k] = 0;
  }
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const acc_t rstd = rstd_in[r];
    Pack<T, kVec> gp[kPacks], xp[kPacks];
    load_row_packs<T, kVec, kPacks>(grad_out + r * grad_out_stride, packs, gp);
    load_row_packs<T, kVec, kPacks>(input + r * input_stride, packs, xp);
    acc_t dot = 0;
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      if (threadIdx.x + j * blockDim.x >= packs) continue;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const acc_t w_eff = kHasWeight ? static_cast<acc_t>(w[j].v[k]) + offset : acc_t(1);
        dot += rms::backward_dot_term(static_cast<acc_t>(gp[j].v[k]), static_cast<acc_t>(xp[j].v[k]),
                                      rstd, w_eff);
      }
    }
    const acc_t mean_dot = block_reduce_sum(dot, scratch) / static_cast<acc_t>(n);
    const T* gr = grad_residual != nullptr ? grad_residual + r * grad_residual_stride : nullptr;
    T* dx = grad_input + r * n;
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      const int p = threadIdx.x + j * blockDim.x;
      if (p >= packs) continue;
      Pack<T, kVec> grp, o;
      if (gr != nullptr) grp = load_pack<T, kVec>(gr + p * kVec);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const acc_t gv = static_cast<acc_t>(gp[j].v[k]);
        const acc_t xv = static_cast<acc_t>(xp[j].v[k]);
        const acc_t w_eff = kHasWeight ? static_cast<acc_t>(w[j].v[k]) + offset : acc_t(1);
        acc_t d = rms::input_grad(gv, xv, rstd, w_eff, mean_dot);
        if (gr != nullptr) d += static_cast<acc_t>(grp.v[k]);
        o.v[k] = static_cast<T>(d);
        if constexpr (kHasWeight) dw[j].v[k] += rms::weight_grad_term(gv, xv, rstd, kCasting, round);
      }
      store_pack<T, kVec>(dx + p * kVec, o);
    }
  }
  if (kHasWeight && partial != nullptr) {
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      const int p = threadIdx.x + j * blockDim.x;
      if (p < packs) store_pack<acc_t, kVec>(partial + blockIdx.x * n + p * kVec, dw[j]);
    }
  }
}

// dw[j] = sum over b of partial[b, j]. A block per 32 columns (each lane one:
// a warp reads 32 consecutive values of a row), its kSumWarps warps taking
// every kSumWarps-th row, kSumLoads loads in flight each; then the warps' sums
// added in warp order: deterministic. (One thread per column, adding all rows
// in turn, put 1024 columns on 4 SMs, each thread waiting on thousands of loads.)
constexpr int kSumWarps = 32;
// At 4 loads in flight the 32 blocks of a 1024-wide row, summing 2112 partial
// rows, took 12 us on an H200, stalled on their loads; at 16, 9.6 us.
constexpr int kSumLoads = 16;

template <typename T>
__global__ void __launch_bounds__(kSumWarps * kWarpSize)
    sum_partials_kernel(const at::opmath_type<T>* __restrict__ partial, int64_t blocks, int64_t n,
                        T* __restrict__ grad_weight) {
  using acc_t = at::opmath_type<T>;
  __shared__ acc_t warp_sums[kSumWarps][kWarpSize];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int64_t j = blockIdx.x * static_cast<int64_t>(kWarpSize) + lane;
  acc_t s[kSumLoads] = {};
  if (j < n) {
    int64_t b = warp;
    for (; b + (kSumLoads - 1) * kSumWarps < blocks; b += kSumLoads * kSumWarps) {
#pragma unroll
      for (int u = 0; u < kSumLoads; ++u) s[u] += partial[(b + u * kSumWarps) * n + j];
    }
    for (; b < blocks; b += kSumWarps) s[0] += partial[b * n + j];
  }
#pragma unroll
  for (int width = kSumLoads / 2; width > 0; width /= 2) {
#pragma unroll
    for (int u = 0; u < width; ++u) s[u] += s[u + width];
  }
  warp_sums[warp][lane] = s[0];
  __syncthreads();
  if (warp == 0 && j < n) {
    acc_t total = 0;
#pragma unroll 8
    for (int w = 0; w < kSumWarps; ++w) total += warp_sums[w][lane];
    grad_weight[j] = static_cast<T>(total);
  }
}

int threads_for(int64_t n, int vec) {
  const int64_t packs = (n + vec - 1) / vec;
  const int64_t warps = std::clamp<int64_t>((packs + kWarpSize - 1) / kWarpSize, 1, 32);
  return static_cast<int>(warps * kWarpSize);
}

// The rows kernels: packs per thread (1, 2 or up to `max_per_thread`) and
// threads for a row of `packs` packs, two packs a thread where the row allows
// (two 16-byte loads of each input in flight per thread); 0 packs when the row
// is too long. The forward holds up to 4 packs a thread; the backward, which
// also holds dO and the weight gradient's sums, 2 (at 4 it spilled registers
// under the 512-thread bound on sm_75, sm_80 and sm_90).
constexpr int kForwardRowPacks = 4;
constexpr int kBackwardRowPacks = 2;
struct RowsShape {
  int packs_per_thread;
  int threads;
};
RowsShape rows_shape(int64_t packs, int max_per_thread) {
  if (packs > static_cast<int64_t>(kMaxRowThreads) * max_per_thread) return {0, 0};
  const int64_t threads =
      std::clamp<int64_t>((packs / 2 + kWarpSize - 1) / kWarpSize * kWarpSize, kWarpSize, kMaxRowThreads);
  const int64_t per_thread = (packs + threads - 1) / threads;
  return {per_thread <= 1 ? 1 : per_thread <= 2 ? 2 : 4, static_cast<int>(threads)};
}

// Calls f(integral_constant<int, P>) for P = packs_per_thread in 1, 2, 4 up to kMax.
template <int kMax, typename F>
void with_row_packs(int packs_per_thread, F&& f) {
  if (packs_per_thread == 1) {
    f(std::integral_constant<int, 1>{});
  } else if constexpr (kMax == 2) {
    f(std::integral_constant<int, 2>{});
  } else if (packs_per_thread == 2) {
    f(std::integral_constant<int, 2>{});
  } else {
    f(std::integral_constant<int, 4>{});
  }
}

// `per_sm` blocks on each multiprocessor.
int max_blocks(int per_sm) {
  return device_properties().multiProcessorCount * per_sm;
}

// Calls `f(std::integral_constant<int, V>, std::bool_constant<W>, std::integral_constant<Casting, C>)`.
template <typename T, typename F>
void with_rms_norm_variant(int vec, bool has_weight, Casting casting, F&& f) {
  constexpr int kWide = 16 / sizeof(T);
  auto by_vec = [&](auto w, auto c) {
    if (vec == kWide) {
      f(std::integral_constant<int, kWide>{}, w, c);
    } else {
      f(std::integral_constant<int, 1>{}, w, c);
    }
  };
  if (!has_weight) {
    by_vec(std::false_type{}, std::integral_constant<Casting, Casting::kGemma>{});
  } else if (casting == Casting::kLlama) {
    by_vec(std::true_type{}, std::integral_constant<Casting, Casting::kLlama>{});
  } else {
    by_vec(std::true_type{}, std::integral_constant<Casting, Casting::kGemma>{});
  }
}

struct CudaRmsNorm {
  static void forward(const RmsNormForwardPlan& p, double eps, double offset) {
    const DeviceGuard guard(p.x.device());
    const int64_t rows = p.x.size(0);
    const int64_t n = p.n;
    const Stream stream = current_stream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, p.x.scalar_type(), "fusedllm_rms_norm_cuda", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* x = p.x.const_data_ptr<scalar_t>();
      const scalar_t* res = p.residual.defined() ? p.residual.const_data_ptr<scalar_t>() : nullptr;
      const scalar_t* w = p.weight.defined() ? p.weight.const_data_ptr<scalar_t>() : nullptr;
      scalar_t* h = p.residual_out.defined() ? p.residual_out.mutable_data_ptr<scalar_t>() : nullptr;
      const int vec = pack_width<scalar_t>(
          n, {{x, p.x.stride(0)}, {res, res ? p.residual.stride(0) : 0}, {w, 0},
              {p.out.const_data_ptr(), n}, {h, n}});
      const int blocks = static_cast<int>(std::min<int64_t>(rows, max_blocks(8)));
      constexpr int kWide = 16 / sizeof(scalar_t);
      const RowsShape shape = rows_shape(n / kWide, kForwardRowPacks);
      if constexpr (!std::is_same_v<scalar_t, double>) {
        if (vec == kWide && shape.packs_per_thread > 0) {
          with_row_packs<kForwardRowPacks>(shape.packs_per_thread, [&](auto P) {
            with_rms_norm_variant<scalar_t>(vec, w != nullptr, p.casting, [&](auto V, auto W, auto C) {
              const auto kernel = rms_norm_forward_rows_kernel<scalar_t, kWide, decltype(P)::value,
                                                               decltype(W)::value, decltype(C)::value>;
              // as many blocks as the device holds at once: one wave
              const int row_blocks = static_cast<int>(
                  std::min<int64_t>(rows, max_blocks(resident_blocks(kernel, shape.threads, 0))));
              launch("rms_norm_forward_rows_kernel", kernel, row_blocks, shape.threads, 0, stream, x,
                     p.x.stride(0), res, res ? p.residual.stride(0) : 0, w,
                     p.out.mutable_data_ptr<scalar_t>(), h, p.rstd.mutable_data_ptr<acc_t>(), rows, n,
                     static_cast<acc_t>(eps), static_cast<acc_t>(offset));
            });
          });
          return;
        }
      }
      const int threads = threads_for(n, vec);
      with_rms_norm_variant<scalar_t>(vec, w != nullptr, p.casting, [&](auto V, auto W, auto C) {
        launch("rms_norm_forward_kernel",
               rms_norm_forward_kernel<scalar_t, decltype(V)::value, decltype(W)::value,
                                       decltype(C)::value>,
               blocks, threads, 0, stream, x, p.x.stride(0), res, res ? p.residual.stride(0) : 0, w,
               p.out.mutable_data_ptr<scalar_t>(), h, p.rstd.mutable_data_ptr<acc_t>(), rows, n,
               static_cast<acc_t>(eps), static_cast<acc_t>(offset));
      });
    });
  }

  static void backward(const RmsNormBackwardPlan& p, double offset) {
    const DeviceGuard guard(p.x.device());
    const int64_t rows = p.x.size(0);
    const int64_t n = p.n;
    const Stream stream = current_stream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, p.x.scalar_type(), "fusedllm_rms_norm_backward_cuda", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* g = p.grad_out.const_data_ptr<scalar_t>();
      const scalar_t* x = p.x.const_data_ptr<scalar_t>();
      const scalar_t* w = p.weight.defined() ? p.weight.const_data_ptr<scalar_t>() : nullptr;
      const scalar_t* gr =
          p.grad_residual.defined() ? p.grad_residual.const_data_ptr<scalar_t>() : nullptr;
      const int vec = pack_width<scalar_t>(
          n, {{g, p.grad_out.stride(0)}, {x, p.x.stride(0)}, {w, 0},
              {gr, gr ? p.grad_residual.stride(0) : 0}, {p.grad_input.const_data_ptr(), n}});
      constexpr int kWide = 16 / sizeof(scalar_t);
      RowsShape shape = rows_shape(n / kWide, kBackwardRowPacks);
      if (vec != kWide || std::is_same_v<scalar_t, double>) shape = {0, 0};
      // Launches `kernel` on `blocks` blocks of `threads`, each writing its row of
      // dw partial sums (adding to it when `accumulates`), then sums those rows.
      auto run = [&](const char* name, auto kernel, int blocks, int threads, bool accumulates) {
        at::Tensor partial;
        if (p.want_weight_grad) {
          const auto options = p.x.options().dtype(accumulation_dtype(p.x));
          partial = accumulates ? at::zeros({blocks, n}, options) : at::empty({blocks, n}, options);
        }
        acc_t* partial_ptr = partial.defined() ? partial.mutable_data_ptr<acc_t>() : nullptr;
        launch(name, kernel, blocks, threads, 0, stream, g, p.grad_out.stride(0), x, p.x.stride(0),
               p.rstd.const_data_ptr<acc_t>(), w, gr, gr ? p.grad_residual.stride(0) : 0,
               p.grad_input.mutable_data_ptr<scalar_t>(), partial_ptr, rows, n, static_cast<acc_t>(offset));
        if (partial_ptr != nullptr) {
          const int blocks_sum = static_cast<int>((n + kWarpSize - 1) / kWarpSize);
          launch("sum_partials_kernel", sum_partials_kernel<scalar_t>, blocks_sum,
                 kSumWarps * kWarpSize, 0, stream, partial_ptr, blocks, n,
                 p.grad_weight.mutable_data_ptr<scalar_t>());
        }
      };
      if constexpr (!std::is_same_v<scalar_t, double>) {
        if (shape.threads > 0) {
          with_row_packs<kBackwardRowPacks>(shape.packs_per_thread, [&](auto P) {
            with_rms_norm_variant<scalar_t>(vec, w != nullptr, p.casting, [&](auto V, auto W, auto C) {
              const auto kernel = rms_norm_backward_rows_kernel<scalar_t, kWide, decltype(P)::value,
                                                                decltype(W)::value, decltype(C)::value>;
              // the blocks the device holds at once, each writing one dw row
              const int blocks = static_cast<int>(
                  std::min<int64_t>(rows, max_blocks(resident_blocks(kernel, shape.threads, 0))));
              run("rms_norm_backward_rows_kernel", kernel, blocks, shape.threads, false);
            });
          });
          return;
        }
      }
      // fewer blocks: each owns a float32 row of dw partial sums it updates per row
      const int blocks = static_cast<int>(std::min<int64_t>(rows, max_blocks(2)));
      with_rms_norm_variant<scalar_t>(vec, w != nullptr, p.casting, [&](auto V, auto W, auto C) {
        run("rms_norm_backward_kernel",
            rms_norm_backward_kernel<scalar_t, decltype(V)::value, decltype(W)::value, decltype(C)::value>,
            blocks, threads_for(n, vec), true);
      });
    });
  }
};

}  // namespace

FUSEDLLM_CUDA_OPS_DEFINE(define_rms_norm_ops)
FUSEDLLM_CUDA_OPS_IMPL(m) { FUSEDLLM_IMPL_RMS_NORM_OPS(m, CudaRmsNorm); }

}  // namespace fusedllm::cuda
