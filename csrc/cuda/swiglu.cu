// swiglu ops on CUDA: one thread per pack of elements (16-byte packs where the
// layout allows), grid-stride over [rows, n]; the activation math is
// fusedllm/activations.h, the code the CPU kernels run too.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <algorithm>

#include "fusedllm/activations.h"
#include "fusedllm/swiglu_op.h"
#include "primitives.cuh"

namespace fusedllm::cuda {
namespace {

using act::Activation;
using Math = act::ScalarMath;

template <typename T, int kVec, Activation A>
__global__ void swiglu_forward_kernel(const T* __restrict__ gate, int64_t gate_stride,
                                      const T* __restrict__ up, int64_t up_stride,
                                      T* __restrict__ out, int64_t out_stride, int64_t rows,
                                      int64_t n) {
  using acc_t = at::opmath_type<T>;
  grid_stride_2d(rows, n / kVec, [&](int64_t r, int64_t pack) {
    const int64_t c = pack * kVec;
    const Pack<T, kVec> g = load_pack<T, kVec>(gate + r * gate_stride + c);
    const Pack<T, kVec> u = load_pack<T, kVec>(up + r * up_stride + c);
    Pack<T, kVec> h;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      h.v[k] = static_cast<T>(
          act::gated<A, Math>(static_cast<acc_t>(g.v[k]), static_cast<acc_t>(u.v[k])));
    }
    store_pack<T, kVec>(out + r * out_stride + c, h);
  });
}

template <typename T, int kVec, Activation A>
__global__ void swiglu_backward_kernel(const T* __restrict__ grad_out, int64_t grad_out_stride,
                                       const T* __restrict__ gate, int64_t gate_stride,
                                       const T* __restrict__ up, int64_t up_stride,
                                       T* __restrict__ grad_gate, int64_t grad_gate_stride,
                                       T* __restrict__ grad_up, int64_t grad_up_stride,
                                       int64_t rows, int64_t n) {
  using acc_t = at::opmath_type<T>;
  grid_stride_2d(rows, n / kVec, [&](int64_t r, int64_t pack) {
    const int64_t c = pack * kVec;
    const Pack<T, kVec> dh = load_pack<T, kVec>(grad_out + r * grad_out_stride + c);
    const Pack<T, kVec> g = load_pack<T, kVec>(gate + r * gate_stride + c);
    const Pack<T, kVec> u = load_pack<T, kVec>(up + r * up_stride + c);
    Pack<T, kVec> dg, du;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      acc_t a, b;
      act::gated_grad<A, Math>(static_cast<acc_t>(dh.v[k]), static_cast<acc_t>(g.v[k]),
                               static_cast<acc_t>(u.v[k]), a, b);
      dg.v[k] = static_cast<T>(a);
      du.v[k] = static_cast<T>(b);
    }
    store_pack<T, kVec>(grad_gate + r * grad_gate_stride + c, dg);
    store_pack<T, kVec>(grad_up + r * grad_up_stride + c, du);
  });
}

constexpr int kSwigluThreads = 256;

int blocks_for(int64_t rows, int64_t n, int vec) {
  const int64_t work = rows * (n / vec);
  const int64_t max_blocks =
      static_cast<int64_t>(device_properties().multiProcessorCount) * 16;
  return static_cast<int>(std::clamp<int64_t>((work + kSwigluThreads - 1) / kSwigluThreads, 1, max_blocks));
}

// Calls f(integral_constant<int, V>, integral_constant<Activation, A>).
template <typename T, typename F>
void with_swiglu_variant(int vec, Activation activation, F&& f) {
  constexpr int kWide = 16 / sizeof(T);
  auto by_act = [&](auto v) {
    if (activation == Activation::kSilu) {
      f(v, std::integral_constant<Activation, Activation::kSilu>{});
    } else {
      f(v, std::integral_constant<Activation, Activation::kGeluTanh>{});
    }
  };
  if (vec == kWide) {
    by_act(std::integral_constant<int, kWide>{});
  } else {
    by_act(std::integral_constant<int, 1>{});
  }
}

struct CudaSwiglu {
  static void forward(const SwigluPlan& p) {
    const DeviceGuard guard(p.gate.device());
    const Stream stream = current_stream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, p.gate.scalar_type(), "fusedllm_swiglu_cuda", [&] {
      const scalar_t* g = p.gate.const_data_ptr<scalar_t>();
      const scalar_t* u = p.up.const_data_ptr<scalar_t>();
      scalar_t* h = p.out.mutable_data_ptr<scalar_t>();
      const int vec = pack_width<scalar_t>(
          p.n, {{g, p.gate.stride(0)}, {u, p.up.stride(0)}, {h, p.out.stride(0)}});
      with_swiglu_variant<scalar_t>(vec, p.activation, [&](auto V, auto A) {
        launch("swiglu_forward_kernel",
               swiglu_forward_kernel<scalar_t, decltype(V)::value, decltype(A)::value>,
               blocks_for(p.rows, p.n, vec), kSwigluThreads, 0, stream, g, p.gate.stride(0), u,
               p.up.stride(0), h, p.out.stride(0), p.rows, p.n);
      });
    });
  }

  static void backward(const SwigluPlan& p) {
    const DeviceGuard guard(p.gate.device());
    const Stream stream = current_stream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, p.gate.scalar_type(), "fusedllm_swiglu_backward_cuda", [&] {
      const scalar_t* dh = p.grad_out.const_data_ptr<scalar_t>();
      const scalar_t* g = p.gate.const_data_ptr<scalar_t>();
      const scalar_t* u = p.up.const_data_ptr<scalar_t>();
      scalar_t* dg = p.grad_gate.mutable_data_ptr<scalar_t>();
      scalar_t* du = p.grad_up.mutable_data_ptr<scalar_t>();
      const int vec = pack_width<scalar_t>(
          p.n, {{dh, p.grad_out.stride(0)}, {g, p.gate.stride(0)}, {u, p.up.stride(0)},
                {dg, p.grad_gate.stride(0)}, {du, p.grad_up.stride(0)}});
      with_swiglu_variant<scalar_t>(vec, p.activation, [&](auto V, auto A) {
        launch("swiglu_backward_kernel",
               swiglu_backward_kernel<scalar_t, decltype(V)::value, decltype(A)::value>,
               blocks_for(p.rows, p.n, vec), kSwigluThreads, 0, stream, dh, p.grad_out.stride(0), g,
               p.gate.stride(0), u, p.up.stride(0), dg, p.grad_gate.stride(0), du,
               p.grad_up.stride(0), p.rows, p.n);
      });
    });
  }
};

}  // namespace

FUSEDLLM_CUDA_OPS_DEFINE(define_swiglu_ops)
FUSEDLLM_CUDA_OPS_IMPL(m) { FUSEDLLM_IMPL_SWIGLU_OPS(m, CudaSwiglu); }

}  // namespace fusedllm::cuda
