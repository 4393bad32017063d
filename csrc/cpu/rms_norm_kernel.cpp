// RMSNorm CPU kernels, compiled once per instruction set (see CMakeLists.txt).
#include "fusedllm/rms_norm.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "vec.h"

namespace fusedllm::cpu {
inline namespace CPU_CAPABILITY {
namespace {

using rms::Casting;

// Rows per parallel task: enough elements that scheduling costs stay small.
inline int64_t row_grain(int64_t n) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)); }

// offset + weight for elements [j, j + c), or ones without a weight.
template <typename IO, bool kHasWeight, typename T>
inline void load_scale(const T* weight, int64_t j, int64_t c, const typename IO::AV& offset,
                       typename IO::AV (&out)[IO::kParts]) {
  using AV = typename IO::AV;
  if constexpr (kHasWeight) {
    load_step<IO>(weight + j, c, out);
    for (int q = 0; q < IO::kParts; ++q) out[q] = out[q] + offset;
  } else {
    for (int q = 0; q < IO::kParts; ++q) out[q] = AV(typename IO::acc_t(1));
  }
}

// Per-row work takes every value as a parameter: the vector stores use
// may-alias types, so anything read through a pointer or reference (e.g. a
// lambda capture) would be re-read from memory after every store.
template <typename T, bool kHasWeight, Casting kCasting>
void forward_row(const T* x, const T* res, T* h, const T* weight, T* y,
                 typename VecIO<T>::acc_t* rstd_out, int64_t n, typename VecIO<T>::acc_t eps,
                 typename VecIO<T>::acc_t offset_value) {
  using IO = VecIO<T>;
  using acc_t = typename IO::acc_t;
  using AV = typename IO::AV;
  constexpr int P = IO::kParts;
  const auto round = [](AV v) { return IO::round(v); };

  // Pass 1 reads the row from memory; pass 2 finds it in cache.
  const T* src = x;
  acc_t sumsq;
  if (res != nullptr) {
    sumsq = row_sum<IO>(n, [&](int64_t j, int64_t c, AV(&acc)[P]) {
      AV v[P], u[P];
      load_step<IO>(x + j, c, v);
      load_step<IO>(res + j, c, u);
      for (int q = 0; q < P; ++q) v[q] = v[q] + u[q];
      store_step<IO>(h + j, c, v);
      load_step<IO>(h + j, c, v);  // the sum as stored in the input dtype
      for (int q = 0; q < P; ++q) acc[q] = at::vec::fmadd(v[q], v[q], acc[q]);
    });
    src = h;
  } else {
    sumsq = row_sum<IO>(n, [&](int64_t j, int64_t c, AV(&acc)[P]) {
      AV v[P];
      load_step<IO>(x + j, c, v);
      for (int q = 0; q < P; ++q) acc[q] = at::vec::fmadd(v[q], v[q], acc[q]);
    });
  }
  const acc_t rstd = rms::rstd_from_sumsq<acc_t>(sumsq, n, eps);
  *rstd_out = rstd;

  const AV rstd_v(rstd);
  const AV offset(offset_value);
  row_for_each<IO>(n, [&](int64_t j, int64_t c) {
    AV v[P], w[P];
    load_step<IO>(src + j, c, v);
    load_scale<IO, kHasWeight>(weight, j, c, offset, w);
    for (int q = 0; q < P; ++q) v[q] = rms::forward_value(v[q], rstd_v, w[q], kCasting, round);
    store_step<IO>(y + j, c, v);
  });
}

template <typename T, bool kHasWeight, Casting kCasting>
void forward_rows(const RmsNormForwardArgs& a) {
  using acc_t = typename VecIO<T>::acc_t;
  at::parallel_for(0, a.rows, row_grain(a.n), [&a](int64_t begin, int64_t end) {
    const int64_t n = a.n;
    const T* input = static_cast<const T*>(a.input);
    const T* residual = static_cast<const T*>(a.residual);
    T* residual_out = static_cast<T*>(a.residual_out);
    T* out = static_cast<T*>(a.out);
    acc_t* rstd = static_cast<acc_t*>(a.rstd);
    const int64_t input_stride = a.input_stride, residual_stride = a.residual_stride;
    const T* weight = static_cast<const T*>(a.weight);
    const acc_t eps = static_cast<acc_t>(a.eps), offset = static_cast<acc_t>(a.offset);
    for (int64_t r = begin; r < end; ++r) {
      forward_row<T, kHasWeight, kCasting>(
          input + r * input_stride, residual ? residual + r * residual_stride : nullptr,
          residual ? residual_out + r * n : nullptr, weight, out + r * n, rstd + r, n, eps, offset);
    }
  });
}

// dx for one row (plus grad_residual when given); adds this row's dw terms to `dw`.
template <typename T, bool kHasWeight, Casting kCasting>
void backward_row(const T* g, const T* x, const T* gr, const T* weight, T* dx,
                  typename VecIO<T>::acc_t* dw, int64_t n, typename VecIO<T>::acc_t rstd_value,
                  typename VecIO<T>::acc_t offset_value) {
  using IO = VecIO<T>;
  using acc_t = typename IO::acc_t;
  using AV = typename IO::AV;
  constexpr int P = IO::kParts;
  const auto round = [](AV v) { return IO::round(v); };
  const AV rstd(rstd_value);
  const AV offset(offset_value);

  const acc_t dot = row_sum<IO>(n, [&](int64_t j, int64_t c, AV(&acc)[P]) {
    AV gv[P], xv[P], wv[P];
    load_step<IO>(g + j, c, gv);
    load_step<IO>(x + j, c, xv);
    load_scale<IO, kHasWeight>(weight, j, c, offset, wv);
    for (int q = 0; q < P; ++q) acc[q] = acc[q] + rms::backward_dot_term(gv[q], xv[q], rstd, wv[q]);
  });
  const AV mean_dot(dot / static_cast<acc_t>(n));

  row_for_each<IO>(n, [&](int64_t j, int64_t c) {
    AV gv[P], xv[P], wv[P], out[P];
    load_step<IO>(g + j, c, gv);
    load_step<IO>(x + j, c, xv);
    load_scale<IO, kHasWeight>(weight, j, c, offset, wv);
    for (int q = 0; q < P; ++q) out[q] = rms::input_grad(gv[q], xv[q], rstd, wv[q], mean_dot);
    if (gr != nullptr) {
      AV gres[P];
      load_step<IO>(gr + j, c, gres);
      for (int q = 0; q < P; ++q) out[q] = out[q] + gres[q];
    }
    store_step<IO>(dx + j, c, out);
    if (dw != nullptr) {
      AV acc[P];
      load_acc<IO>(dw + j, c, acc);
      for (int q = 0; q < P; ++q) {
        acc[q] = acc[q] + rms::weight_grad_term(gv[q], xv[q], rstd, kCasting, round);
      }
      store_acc<IO>(dw + j, c, acc);
    }
  });
}

template <typename T, bool kHasWeight, Casting kCasting>
void backward_rows(const RmsNormBackwardArgs& a) {
  using IO = VecIO<T>;
  using acc_t = typename IO::acc_t;
  using AV = typename IO::AV;
  constexpr int P = IO::kParts;
  constexpr int64_t S = IO::kStep;
  const int64_t n = a.n;
  const int64_t rows = a.rows;
  const bool want_dw = kHasWeight && a.grad_weight != nullptr;

  // Rows are split into a fixed number of blocks that depends only on the
  // shape; each block sums its dw into its own buffer row and the buffers are
  // then added in block order, so dw has the same bits for any thread count.
  const int64_t max_blocks = 64;
  const int64_t blocks = std::max<int64_t>(1, std::min(rows, max_blocks));
  const int64_t rows_per_block = (rows + blocks - 1) / blocks;
  std::vector<acc_t> partial(want_dw ? static_cast<size_t>(blocks * n) : 0, acc_t(0));
  acc_t* partial_data = partial.data();

  at::parallel_for(0, blocks, 1, [&](int64_t b_begin, int64_t b_end) {
    const T* grad_out = static_cast<const T*>(a.grad_out);
    const T* input = static_cast<const T*>(a.input);
    const T* grad_res = static_cast<const T*>(a.grad_residual);
    const T* weight = static_cast<const T*>(a.weight);
    const acc_t* rstd = static_cast<const acc_t*>(a.rstd);
    T* grad_input = static_cast<T*>(a.grad_input);
    const int64_t g_stride = a.grad_out_stride, x_stride = a.input_stride;
    const int64_t gr_stride = a.grad_residual_stride;
    const acc_t offset = static_cast<acc_t>(a.offset);
    for (int64_t b = b_begin; b < b_end; ++b) {
      acc_t* dw = want_dw ? partial_data + b * n : nullptr;
      const int64_t r_end = std::min(rows, (b + 1) * rows_per_block);
      for (int64_t r = b * rows_per_block; r < r_end; ++r) {
        backward_row<T, kHasWeight, kCasting>(
            grad_out + r * g_stride, input + r * x_stride,
            grad_res ? grad_res + r * gr_stride : nullptr, weight, grad_input + r * n, dw, n,
            rstd[r], offset);
      }
    }
  });

  if (!want_dw) return;
  T* grad_weight = static_cast<T*>(a.grad_weight);
  at::parallel_for(0, (n + S - 1) / S, 1, [&](int64_t s_begin, int64_t s_end) {
    for (int64_t s = s_begin; s < s_end; ++s) {
      const int64_t j = s * S;
      const int64_t c = std::min(S, n - j);
      AV sum[P], part[P];
      for (int q = 0; q < P; ++q) sum[q] = AV(acc_t(0));
      for (int64_t b = 0; b < blocks; ++b) {
        load_acc<IO>(partial_data + b * n + j, c, part);
        for (int q = 0; q < P; ++q) sum[q] = sum[q] + part[q];
      }
      store_step<IO>(grad_weight + j, c, sum);
    }
  });
}

template <template <typename, bool, Casting> class Kernel, typename Args>
void dispatch_variant(const Args& a, bool has_weight) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.dtype, "fusedllm_rms_norm_cpu", [&] {
    if (has_weight) {
      if (a.casting == Casting::kLlama) {
        Kernel<scalar_t, true, Casting::kLlama>::run(a);
      } else {
        Kernel<scalar_t, true, Casting::kGemma>::run(a);
      }
    } else {
      // Without a weight both castings compute round(x * rstd).
      Kernel<scalar_t, false, Casting::kGemma>::run(a);
    }
  });
}

template <typename T, bool W, Casting C>
struct ForwardKernel {
  static void run(const RmsNormForwardArgs& a) { forward_rows<T, W, C>(a); }
};
template <typename T, bool W, Casting C>
struct BackwardKernel {
  static void run(const RmsNormBackwardArgs& a) { backward_rows<T, W, C>(a); }
};

void rms_norm_forward(const RmsNormForwardArgs& a) {
  dispatch_variant<ForwardKernel>(a, a.weight != nullptr);
}
void rms_norm_backward(const RmsNormBackwardArgs& a) {
  dispatch_variant<BackwardKernel>(a, a.weight != nullptr);
}

}  // namespace

FUSEDLLM_REGISTER_CPU_KERNEL(rms_norm_forward_kernels, &rms_norm_forward);
FUSEDLLM_REGISTER_CPU_KERNEL(rms_norm_backward_kernels, &rms_norm_backward);

}  // namespace CPU_CAPABILITY
}  // namespace fusedllm::cpu
