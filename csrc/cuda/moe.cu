// Mixture-of-experts ops on CUDA: the flow of fusedllm/moe_op.h with the
// router one thread per token, a stable counting sort one block per expert,
// row moves one block per row, and the experts' products as grouped
// multiplies (grouped_gemm.cuh: tensor cores for bfloat16 and float16) that
// read the groups' bounds on the device, so no step waits for the host. The
// math is fusedllm/moe.h, which the CPU kernels run too.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

#include "fusedllm/activations.h"
#include "fusedllm/moe.h"
#include "fusedllm/moe_op.h"
#include "grouped_gemm.cuh"
#include "primitives.cuh"

namespace fusedllm::cuda {
namespace {

using Math = act::ScalarMath;

constexpr int kMoeThreads = 256;
constexpr int kRouteThreads = 128;

// One thread per token; `work` [tokens, 2E] and `taken` [tokens, E] are its scratch.
template <typename T, typename A>
__global__ void moe_route_kernel(const T* __restrict__ z, const A* __restrict__ bias,
                                 moe::RouteOptions o, int64_t tokens, A* work, unsigned char* taken,
                                 A* __restrict__ weights, int64_t* __restrict__ indices) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= tokens) return;
  const int64_t n = o.experts, k = o.top_k;
  moe::route_row<Math>(z + t * n, bias, o, work + t * 2 * n, taken + t * n, weights + t * k,
                       indices + t * k);
}

template <typename T, typename G, typename A>
__global__ void moe_route_backward_kernel(const T* __restrict__ z, const int64_t* __restrict__ idx,
                                          const G* __restrict__ g, moe::RouteOptions o,
                                          int64_t tokens, A* work, T* __restrict__ dz) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= tokens) return;
  const int64_t n = o.experts, k = o.top_k;
  moe::route_row_backward<Math, A>(z + t * n, idx + t * k, g + t * k, o, work + t * n, dz + t * n);
}

// Block e gathers the pairs of expert e in pair order (block `experts`: the
// pairs whose index is out of range, placed last and marked by a negative
// position). Two reads of the indices: one counting the pairs of lower
// experts (this group's first row) and one placing, a block-wide prefix count
// per step of blockDim pairs.
__global__ void moe_sort_kernel(const int64_t* __restrict__ ids, int64_t pairs, int64_t experts,
                                int64_t* __restrict__ order, int64_t* __restrict__ position,
                                int64_t* __restrict__ offsets) {
  __shared__ int64_t scratch[kWarpSize];
  __shared__ int warp_totals[kMoeThreads / kWarpSize];
  const int64_t e = blockIdx.x;
  const auto in_range = [&](int64_t v) { return v >= 0 && v < experts; };
  const auto mine = [&](int64_t v) { return e < experts ? v == e : !in_range(v); };
  int64_t before = 0;
  for (int64_t i = threadIdx.x; i < pairs; i += blockDim.x) {
    const int64_t v = ids[i];
    before += e < experts ? (in_range(v) && v < e) : in_range(v);
  }
  int64_t base = block_reduce_sum(before, scratch);
  if (threadIdx.x == 0) offsets[e] = base;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  for (int64_t start = 0; start < pairs; start += blockDim.x) {
    const int64_t i = start + threadIdx.x;
    const bool flag = i < pairs && mine(ids[i]);
    int warp_total = 0;
    const int below = lanes_below(flag, kFullMask, warp_total);
    if (lane == 0) warp_totals[warp] = warp_total;
    __syncthreads();
    int64_t p = base + below, step_total = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x / kWarpSize); ++w) {
      if (w < warp) p += warp_totals[w];
      step_total += warp_totals[w];
    }
    if (flag) {
      order[p] = i;
      position[i] = e < experts ? p : -1 - p;
    }
    base += step_total;
    __syncthreads();  // warp_totals is rewritten by the next step
  }
}

// Grid-stride over rows, one row per block at a time.
template <typename T, typename W>
__global__ void moe_gather_kernel(T* __restrict__ dst, const T* __restrict__ src,
                                  const int64_t* __restrict__ order, const W* __restrict__ weights,
                                  int64_t rows, int64_t cols, int64_t k) {
  for (int64_t p = blockIdx.x; p < rows; p += gridDim.x) {
    const int64_t pair = order[p];
    moe::gather_row<MoeAcc<T>>(dst + p * cols, src + (pair / k) * cols,
                            weights ? weights + pair : weights, cols, threadIdx.x, blockDim.x);
  }
}

template <typename T, typename W>
__global__ void moe_combine_kernel(T* __restrict__ dst, const T* __restrict__ src,
                                   const int64_t* __restrict__ position,
                                   const W* __restrict__ weights, int64_t tokens, int64_t cols,
                                   int64_t k) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    moe::combine_row<MoeAcc<T>>(dst + t * cols, src, cols, position + t * k,
                             weights ? weights + t * k : weights, k, cols, threadIdx.x, blockDim.x);
  }
}

// grad[t, j] = <grad_out[t], src[position[t * k + j]]>, NaN for a pair out of range.
template <typename T, typename A>
__global__ void moe_weights_grad_kernel(A* __restrict__ grad, const T* __restrict__ grad_out,
                                        const T* __restrict__ src,
                                        const int64_t* __restrict__ position, int64_t tokens,
                                        int64_t cols, int64_t k) {
  __shared__ A scratch[kWarpSize];
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t p = position[t * k + j];
      A acc = A(0);
      if (p >= 0) {
        for (int64_t h = threadIdx.x; h < cols; h += blockDim.x) {
          acc += static_cast<A>(grad_out[t * cols + h]) * static_cast<A>(src[p * cols + h]);
        }
      }
      const A total = block_reduce_sum(acc, scratch);
      if (threadIdx.x == 0) grad[t * k + j] = p >= 0 ? total : std::numeric_limits<A>::quiet_NaN();
    }
  }
}

// The gated activation (moe::gated_row) of rows of 2 * inter gate/up values,
// grid-stride over rows, the block's threads along the row.
template <typename T>
__global__ void moe_gated_kernel(T* __restrict__ out, const T* __restrict__ gate_up,
                                 moe::Gating o, int64_t rows, int64_t inter) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    moe::gated_row<act::ScalarMath, MoeAcc<T>>(o, out + r * inter, gate_up + r * 2 * inter, inter,
                                               threadIdx.x, blockDim.x);
  }
}

template <typename T>
__global__ void moe_gated_backward_kernel(T* __restrict__ grad_gate_up, const T* __restrict__ grad,
                                          const T* __restrict__ gate_up, moe::Gating o,
                                          int64_t rows, int64_t inter) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    moe::gated_row_backward<act::ScalarMath, MoeAcc<T>>(o, grad_gate_up + r * 2 * inter,
                                                        grad + r * inter, gate_up + r * 2 * inter,
                                                        inter, threadIdx.x, blockDim.x);
  }
}

// out[e, c] = the sum of rows offsets[e] .. offsets[e + 1] of column c of src
// (a bias gradient): block (column tile, e), one thread per column adding the
// group's rows in order (coalesced along the row; deterministic).
template <typename T>
__global__ void moe_group_sum_kernel(T* __restrict__ out, const T* __restrict__ src,
                                     const int64_t* __restrict__ offsets, int64_t rows,
                                     int64_t cols) {
  const int64_t e = blockIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const auto clamp_row = [&](int64_t v) { return v < 0 ? 0 : (v > rows ? rows : v); };
  const int64_t first = clamp_row(offsets[e]), last = clamp_row(offsets[e + 1]);
  MoeAcc<T> acc = 0;
  for (int64_t r = first; r < last; ++r) acc += static_cast<MoeAcc<T>>(src[r * cols + c]);
  out[e * cols + c] = static_cast<T>(acc);
}

int row_blocks(int64_t rows) {
  return static_cast<int>(std::clamp<int64_t>(
      rows, 1, static_cast<int64_t>(device_properties().multiProcessorCount) * 16));
}

int thread_blocks(int64_t n, int threads) {
  return static_cast<int>((n + threads - 1) / threads);
}

// `fn(T{})` for the 16-bit and float types of `t` (the dtypes of every op).
template <typename Fn>
void for_dtype(at::ScalarType t, Fn&& fn) {
  switch (t) {
    case at::kFloat: fn(float{}); break;
    case at::kDouble: fn(double{}); break;
    case at::kBFloat16: fn(at::BFloat16{}); break;
    case at::kHalf: fn(at::Half{}); break;
    default: TORCH_CHECK(false, "fusedllm moe: unexpected dtype ", t);
  }
}

struct CudaMoe {
#if defined(FUSEDLLM_SIMT)
  static constexpr const char* kOps = "fusedllm_simt";
#else
  static constexpr const char* kOps = "fusedllm";
#endif

  static void route(const at::Tensor& logits, const at::Tensor& bias, const moe::RouteOptions& o,
                    at::Tensor& weights, at::Tensor& indices) {
    const DeviceGuard guard(logits.device());
    const int64_t tokens = logits.size(0);
    for_dtype(logits.scalar_type(), [&](auto z_tag) {
      using T = decltype(z_tag);
      using A = MoeAcc<T>;
      at::Tensor work = at::empty({tokens, 2 * o.experts}, weights.options());
      at::Tensor taken = at::empty({tokens, o.experts}, logits.options().dtype(at::kByte));
      launch("moe_route_kernel", moe_route_kernel<T, A>, thread_blocks(tokens, kRouteThreads),
             kRouteThreads, 0, current_stream(), logits.const_data_ptr<T>(),
             bias.defined() ? bias.const_data_ptr<A>() : nullptr, o, tokens,
             work.mutable_data_ptr<A>(), taken.mutable_data_ptr<unsigned char>(),
             weights.mutable_data_ptr<A>(), indices.mutable_data_ptr<int64_t>());
    });
  }

  static void route_backward(const at::Tensor& grad_weights, const at::Tensor& logits,
                             const at::Tensor& indices, const moe::RouteOptions& o,
                             at::Tensor& grad) {
    const DeviceGuard guard(logits.device());
    const int64_t tokens = logits.size(0);
    for_dtype(logits.scalar_type(), [&](auto z_tag) {
      using T = decltype(z_tag);
      using A = MoeAcc<T>;
      const at::ScalarType acc = c10::CppTypeToScalarType<A>::value;
      const at::Tensor g = grad_weights.scalar_type() == acc ? grad_weights : grad_weights.to(acc);
      at::Tensor work = at::empty({tokens, o.experts}, g.options());
      launch("moe_route_backward_kernel", moe_route_backward_kernel<T, A, A>,
             thread_blocks(tokens, kRouteThreads), kRouteThreads, 0, current_stream(),
             logits.const_data_ptr<T>(), indices.const_data_ptr<int64_t>(), g.const_data_ptr<A>(),
             o, tokens, work.mutable_data_ptr<A>(), grad.mutable_data_ptr<T>());
    });
  }

  static void sort(const at::Tensor& flat, int64_t experts, at::Tensor& order, at::Tensor& position,
                   at::Tensor& offsets) {
    const DeviceGuard guard(flat.device());
    // One block more than experts: the pairs out of range, after every group
    // (its offsets entry is the end of the last group).
    launch("moe_sort_kernel", moe_sort_kernel, static_cast<int>(experts + 1), kMoeThreads, 0,
           current_stream(), flat.const_data_ptr<int64_t>(), flat.numel(), experts,
           order.mutable_data_ptr<int64_t>(), position.mutable_data_ptr<int64_t>(),
           offsets.mutable_data_ptr<int64_t>());
  }

  static void gather(at::Tensor& dst, const at::Tensor& src, const at::Tensor& order, int64_t k,
                     const at::Tensor& weights) {
    const DeviceGuard guard(dst.device());
    const int64_t rows = dst.size(0), cols = dst.size(1);
    for_dtype(dst.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      with_moe_weights<T>(weights, [&](const auto* w) {
        launch("moe_gather_kernel", moe_gather_kernel<T, std::remove_cv_t<std::remove_pointer_t<decltype(w)>>>,
               row_blocks(rows), kMoeThreads, 0, current_stream(), dst.mutable_data_ptr<T>(),
               src.const_data_ptr<T>(), order.const_data_ptr<int64_t>(), w, rows, cols, k);
      });
    });
  }

  static void combine(at::Tensor& dst, const at::Tensor& src, const at::Tensor& position, int64_t k,
                      const at::Tensor& weights) {
    const DeviceGuard guard(dst.device());
    const int64_t tokens = dst.size(0), cols = dst.size(1);
    for_dtype(dst.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      with_moe_weights<T>(weights, [&](const auto* w) {
        launch("moe_combine_kernel", moe_combine_kernel<T, std::remove_cv_t<std::remove_pointer_t<decltype(w)>>>,
               row_blocks(tokens), kMoeThreads, 0, current_stream(), dst.mutable_data_ptr<T>(),
               src.const_data_ptr<T>(), position.const_data_ptr<int64_t>(), w, tokens, cols, k);
      });
    });
  }

  static void weights_grad(at::Tensor& grad, const at::Tensor& grad_out, const at::Tensor& src,
                           const at::Tensor& position) {
    const DeviceGuard guard(grad.device());
    const int64_t tokens = grad.size(0), k = grad.size(1), cols = grad_out.size(1);
    for_dtype(src.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      launch("moe_weights_grad_kernel", moe_weights_grad_kernel<T, MoeAcc<T>>, row_blocks(tokens),
             kMoeThreads, 0, current_stream(), grad.mutable_data_ptr<MoeAcc<T>>(),
             grad_out.const_data_ptr<T>(), src.const_data_ptr<T>(),
             position.const_data_ptr<int64_t>(), tokens, cols, k);
    });
  }

  static void gated(at::Tensor& out, const at::Tensor& gate_up, const moe::Gating& o) {
    const DeviceGuard guard(out.device());
    const int64_t rows = out.size(0), inter = out.size(1);
    for_dtype(out.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      launch("moe_gated_kernel", moe_gated_kernel<T>, row_blocks(rows), kMoeThreads, 0,
             current_stream(), out.mutable_data_ptr<T>(), gate_up.const_data_ptr<T>(), o, rows,
             inter);
    });
  }

  static void gated_backward(at::Tensor& grad_gate_up, const at::Tensor& grad,
                             const at::Tensor& gate_up, const moe::Gating& o) {
    const DeviceGuard guard(grad.device());
    const int64_t rows = grad.size(0), inter = grad.size(1);
    for_dtype(grad.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      launch("moe_gated_backward_kernel", moe_gated_backward_kernel<T>, row_blocks(rows), kMoeThreads,
             0, current_stream(), grad_gate_up.mutable_data_ptr<T>(), grad.const_data_ptr<T>(),
             gate_up.const_data_ptr<T>(), o, rows, inter);
    });
  }

  static void group_sum(at::Tensor& out, const at::Tensor& src, const at::Tensor& offsets) {
    const DeviceGuard guard(out.device());
    const int64_t experts = out.size(0), cols = out.size(1);
    TORCH_CHECK_VALUE(experts <= 65535, "fusedllm moe: ", experts,
                      " experts are too many for one bias-gradient launch");
    for_dtype(out.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      launch("moe_group_sum_kernel", moe_group_sum_kernel<T>,
             dim3(static_cast<unsigned>(thread_blocks(cols, kMoeThreads)), static_cast<unsigned>(experts)),
             kMoeThreads, 0, current_stream(), out.mutable_data_ptr<T>(), src.const_data_ptr<T>(),
             offsets.const_data_ptr<int64_t>(), src.size(0), cols);
    });
  }

  // The grouped products a chunk of `rows` expert-ordered rows at a time,
  // wherever the experts' bounds fall (the host does not know them without
  // waiting for the device): the groups' bounds are clipped to the chunk on
  // the device. The biases join the products' epilogues.
  static void expert_mlp(at::Tensor& expert_out, at::Tensor& gate_up, const at::Tensor& hidden,
                         const at::Tensor& order, const at::Tensor& offsets, int64_t k,
                         const MoeExpertWeights& w, int64_t rows) {
    const int64_t pairs = order.numel(), cols = hidden.size(1);
    const int64_t two_inter = w.transposed ? w.gate_up_proj.size(2) : w.gate_up_proj.size(1);
    const bool keep = gate_up.size(0) > 0;
    const int64_t chunk = std::min(rows, pairs);
    at::Tensor gathered = at::empty({chunk, cols}, hidden.options());
    at::Tensor gu_chunk = keep ? at::Tensor() : at::empty({chunk, two_inter}, hidden.options());
    for (int64_t p0 = 0; p0 < pairs; p0 += chunk) {
      const int64_t n = std::min(chunk, pairs - p0);
      const at::Tensor bounds = n == pairs ? offsets : (offsets.clamp(p0, p0 + n) - p0);
      at::Tensor r = gathered.narrow(0, 0, n);
      gather(r, hidden, order.narrow(0, p0, n), k, at::Tensor());
      at::Tensor gu = keep ? gate_up.narrow(0, p0, n) : gu_chunk.narrow(0, 0, n);
      grouped_mm(gu, r, w.gate_up_proj, bounds, w.forward_product(), w.gate_up_bias);
      at::Tensor y = expert_out.narrow(0, p0, n);
      grouped_mm(y, MoeOps<CudaMoe>::gated(gu, w), w.down_proj, bounds, w.forward_product(),
                 w.down_bias);
    }
  }

  static void expert_mlp_combined(at::Tensor& out, const at::Tensor& hidden, const at::Tensor& order,
                                  const at::Tensor& position, const at::Tensor& offsets, int64_t k,
                                  const at::Tensor& weights, const MoeExpertWeights& w, int64_t rows) {
    at::Tensor expert_out = at::empty({order.numel(), hidden.size(1)}, hidden.options());
    const int64_t two_inter = w.transposed ? w.gate_up_proj.size(2) : w.gate_up_proj.size(1);
    at::Tensor none = hidden.new_empty({0, two_inter});
    expert_mlp(expert_out, none, hidden, order, offsets, k, w, rows);
    combine(out, expert_out, position, k, weights);
  }

  static void grouped_mm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                         const at::Tensor& offsets, GroupedProduct kind, const at::Tensor& bias) {
    const at::Tensor bc = b.stride(-1) == 1 ? b : b.contiguous();
    cuda::grouped_mm(out, a, bc, offsets, kind, bias);
  }
};

}  // namespace

FUSEDLLM_CUDA_OPS_DEFINE(define_moe_ops)
FUSEDLLM_CUDA_OPS_IMPL(m) { FUSEDLLM_IMPL_MOE_OPS(m, CudaMoe); }

}  // namespace fusedllm::cuda
