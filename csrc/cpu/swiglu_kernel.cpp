// SwiGLU / GeGLU CPU kernels, compiled once per instruction set.
#include "fusedllm/swiglu.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>

#include "vec.h"

namespace fusedllm::cpu {
inline namespace CPU_CAPABILITY {
namespace {

using act::Activation;

// Elements per parallel work item: rows are cut into chunks so that a few long
// rows or many short ones both spread over every thread.
constexpr int64_t kChunk = 2048;

// Calls `body(row, col_begin, col_end)` over [rows, n] in parallel chunks.
template <typename Body>
void for_each_chunk(int64_t rows, int64_t n, const Body& body) {
  const int64_t chunks_per_row = (n + kChunk - 1) / kChunk;
  const int64_t items = rows * chunks_per_row;
  const int64_t grain = std::max<int64_t>(1, 8 * kChunk / std::min(n, kChunk));
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / chunks_per_row;
      const int64_t c0 = (i % chunks_per_row) * kChunk;
      body(r, c0, std::min(n, c0 + kChunk));
    }
  });
}

// When every operand is one contiguous block, the rows are one long row.
inline void collapse_contiguous(SwigluArgs& a, bool backward) {
  const int64_t n = a.n;
  bool contiguous = a.gate_stride == n && a.up_stride == n;
  if (backward) {
    contiguous = contiguous && a.grad_out_stride == n && a.grad_gate_stride == n &&
                 a.grad_up_stride == n;
  } else {
    contiguous = contiguous && a.out_stride == n;
  }
  if (contiguous && a.rows > 1) {
    a.n = a.rows * n;
    a.rows = 1;
  }
}

template <typename T, Activation A>
void forward_span(const T* g, const T* u, T* h, int64_t count) {
  using IO = VecIO<T>;
  using AV = typename IO::AV;
  constexpr int P = IO::kParts;
  row_for_each<IO>(count, [&](int64_t j, int64_t c) {
    AV gv[P], uv[P];
    load_step<IO>(g + j, c, gv);
    load_step<IO>(u + j, c, uv);
    for (int q = 0; q < P; ++q) gv[q] = act::gated<A, VecMath<AV>>(gv[q], uv[q]);
    store_step<IO>(h + j, c, gv);
  });
}

template <typename T, Activation A>
void backward_span(const T* dh, const T* g, const T* u, T* dg, T* du, int64_t count) {
  using IO = VecIO<T>;
  using AV = typename IO::AV;
  constexpr int P = IO::kParts;
  row_for_each<IO>(count, [&](int64_t j, int64_t c) {
    AV dhv[P], gv[P], uv[P], dgv[P], duv[P];
    load_step<IO>(dh + j, c, dhv);
    load_step<IO>(g + j, c, gv);
    load_step<IO>(u + j, c, uv);
    for (int q = 0; q < P; ++q) {
      act::gated_grad<A, VecMath<AV>>(dhv[q], gv[q], uv[q], dgv[q], duv[q]);
    }
    store_step<IO>(dg + j, c, dgv);
    store_step<IO>(du + j, c, duv);
  });
}

template <typename T, Activation A>
void forward_typed(SwigluArgs a) {
  collapse_contiguous(a, /*backward=*/false);
  for_each_chunk(a.rows, a.n, [&a](int64_t r, int64_t c0, int64_t c1) {
    forward_span<T, A>(static_cast<const T*>(a.gate) + r * a.gate_stride + c0,
                       static_cast<const T*>(a.up) + r * a.up_stride + c0,
                       static_cast<T*>(a.out) + r * a.out_stride + c0, c1 - c0);
  });
}

template <typename T, Activation A>
void backward_typed(SwigluArgs a) {
  collapse_contiguous(a, /*backward=*/true);
  for_each_chunk(a.rows, a.n, [&a](int64_t r, int64_t c0, int64_t c1) {
    backward_span<T, A>(static_cast<const T*>(a.grad_out) + r * a.grad_out_stride + c0,
                        static_cast<const T*>(a.gate) + r * a.gate_stride + c0,
                        static_cast<const T*>(a.up) + r * a.up_stride + c0,
                        static_cast<T*>(a.grad_gate) + r * a.grad_gate_stride + c0,
                        static_cast<T*>(a.grad_up) + r * a.grad_up_stride + c0, c1 - c0);
  });
}

template <bool kBackward>
void run(const SwigluArgs& a) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.dtype, "fusedllm_swiglu_cpu", [&] {
    if (a.activation == Activation::kSilu) {
      kBackward ? backward_typed<scalar_t, Activation::kSilu>(a)
                : forward_typed<scalar_t, Activation::kSilu>(a);
    } else {
      kBackward ? backward_typed<scalar_t, Activation::kGeluTanh>(a)
                : forward_typed<scalar_t, Activation::kGeluTanh>(a);
    }
  });
}

void swiglu_forward(const SwigluArgs& a) { run<false>(a); }
void swiglu_backward(const SwigluArgs& a) { run<true>(a); }

}  // namespace

FUSEDLLM_REGISTER_CPU_KERNEL(swiglu_forward_kernels, &swiglu_forward);
FUSEDLLM_REGISTER_CPU_KERNEL(swiglu_backward_kernels, &swiglu_backward);

}  // namespace CPU_CAPABILITY
}  // namespace fusedllm::cpu
