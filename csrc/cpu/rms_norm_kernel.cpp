// RMSNorm CPU kernels, compiled once per instruction set (see CMakeLists.txt).
#include "rms_norm_kernel.h"

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

template <typename T, bool kHasWeight, Casting kCasting>
void forward_rows(const RmsNormForwardArgs& a) {
  using IO = VecIO<T>;
  using acc_t = typename IO::acc_t;
  using AV = typename IO::AV;
  constexpr int P = IO::kParts;
  constexpr int64_t S = IO::kStep;
  const int64_t n = a.n;
  const T* weight = static_cast<const T*>(a.weight);
  const AV offset(static_cast<acc_t>(a.offset));
  const auto round = [](AV v) { return IO::round(v); };

  at::parallel_for(0, a.rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* x = static_cast<const T*>(a.input) + r * a.input_stride;
      T* y = static_cast<T*>(a.out) + r * n;
      // Pass 1 reads the row from memory; pass 2 finds it in cache.
      const T* src = x;
      AV acc[P];
      for (int q = 0; q < P; ++q) acc[q] = AV(acc_t(0));
      if (a.residual != nullptr) {
        const T* res = static_cast<const T*>(a.residual) + r * a.residual_stride;
        T* h = static_cast<T*>(a.residual_out) + r * n;
        for (int64_t j = 0; j < n; j += S) {
          const int64_t c = std::min(S, n - j);
          AV v[P], u[P];
          load_step<IO>(x + j, c, v);
          load_step<IO>(res + j, c, u);
          for (int q = 0; q < P; ++q) v[q] = v[q] + u[q];
          store_step<IO>(h + j, c, v);
          load_step<IO>(h + j, c, v);  // the sum as stored in the input dtype
          for (int q = 0; q < P; ++q) acc[q] = at::vec::fmadd(v[q], v[q], acc[q]);
        }
        src = h;
      } else {
        for (int64_t j = 0; j < n; j += S) {
          const int64_t c = std::min(S, n - j);
          AV v[P];
          load_step<IO>(x + j, c, v);
          for (int q = 0; q < P; ++q) acc[q] = at::vec::fmadd(v[q], v[q], acc[q]);
        }
      }
      for (int q = 1; q < P; ++q) acc[0] = acc[0] + acc[q];
      const acc_t rstd = rms::rstd_from_sumsq<acc_t>(reduce_sum(acc[0]), n, static_cast<acc_t>(a.eps));
      static_cast<acc_t*>(a.rstd)[r] = rstd;

      const AV rstd_v(rstd);
      for (int64_t j = 0; j < n; j += S) {
        const int64_t c = std::min(S, n - j);
        AV v[P], w[P];
        load_step<IO>(src + j, c, v);
        if constexpr (kHasWeight) {
          load_step<IO>(weight + j, c, w);
          for (int q = 0; q < P; ++q) w[q] = w[q] + offset;
        } else {
          for (int q = 0; q < P; ++q) w[q] = AV(acc_t(1));
        }
        for (int q = 0; q < P; ++q) v[q] = rms::forward_value(v[q], rstd_v, w[q], kCasting, round);
        store_step<IO>(y + j, c, v);
      }
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
  const T* weight = static_cast<const T*>(a.weight);
  const AV offset(static_cast<acc_t>(a.offset));
  const bool want_dw = kHasWeight && a.grad_weight != nullptr;
  const auto round = [](AV v) { return IO::round(v); };

  // Rows are split into a fixed number of blocks that depends only on the
  // shape; each block sums its dw into its own buffer row and the buffers are
  // then added in block order, so dw has the same bits for any thread count.
  const int64_t max_blocks = 64;
  const int64_t blocks = std::max<int64_t>(1, std::min(rows, max_blocks));
  const int64_t rows_per_block = (rows + blocks - 1) / blocks;
  std::vector<acc_t> partial(want_dw ? static_cast<size_t>(blocks * n) : 0, acc_t(0));

  at::parallel_for(0, blocks, 1, [&](int64_t b_begin, int64_t b_end) {
    for (int64_t b = b_begin; b < b_end; ++b) {
      acc_t* dw = want_dw ? partial.data() + b * n : nullptr;
      const int64_t r_end = std::min(rows, (b + 1) * rows_per_block);
      for (int64_t r = b * rows_per_block; r < r_end; ++r) {
        const T* g = static_cast<const T*>(a.grad_out) + r * a.grad_out_stride;
        const T* x = static_cast<const T*>(a.input) + r * a.input_stride;
        T* dx = static_cast<T*>(a.grad_input) + r * n;
        const AV rstd(static_cast<const acc_t*>(a.rstd)[r]);

        AV dot[P];
        for (int q = 0; q < P; ++q) dot[q] = AV(acc_t(0));
        for (int64_t j = 0; j < n; j += S) {
          const int64_t c = std::min(S, n - j);
          AV gv[P], xv[P], wv[P];
          load_step<IO>(g + j, c, gv);
          load_step<IO>(x + j, c, xv);
          if constexpr (kHasWeight) {
            load_step<IO>(weight + j, c, wv);
            for (int q = 0; q < P; ++q) wv[q] = wv[q] + offset;
          } else {
            for (int q = 0; q < P; ++q) wv[q] = AV(acc_t(1));
          }
          for (int q = 0; q < P; ++q) dot[q] = dot[q] + rms::backward_dot_term(gv[q], xv[q], rstd, wv[q]);
        }
        for (int q = 1; q < P; ++q) dot[0] = dot[0] + dot[q];
        const AV mean_dot(reduce_sum(dot[0]) / static_cast<acc_t>(n));

        const T* gr = a.grad_residual == nullptr
                          ? nullptr
                          : static_cast<const T*>(a.grad_residual) + r * a.grad_residual_stride;
        for (int64_t j = 0; j < n; j += S) {
          const int64_t c = std::min(S, n - j);
          AV gv[P], xv[P], wv[P], out[P];
          load_step<IO>(g + j, c, gv);
          load_step<IO>(x + j, c, xv);
          if constexpr (kHasWeight) {
            load_step<IO>(weight + j, c, wv);
            for (int q = 0; q < P; ++q) wv[q] = wv[q] + offset;
          } else {
            for (int q = 0; q < P; ++q) wv[q] = AV(acc_t(1));
          }
          for (int q = 0; q < P; ++q) out[q] = rms::input_grad(gv[q], xv[q], rstd, wv[q], mean_dot);
          if (gr != nullptr) {
            AV gres[P];
            load_step<IO>(gr + j, c, gres);
            for (int q = 0; q < P; ++q) out[q] = out[q] + gres[q];
          }
          store_step<IO>(dx + j, c, out);
          if (want_dw) {
            AV acc[P];
            load_acc<IO>(dw + j, c, acc);
            for (int q = 0; q < P; ++q) {
              acc[q] = acc[q] + rms::weight_grad_term(gv[q], xv[q], rstd, kCasting, round);
            }
            store_acc<IO>(dw + j, c, acc);
          }
        }
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
        load_acc<IO>(partial.data() + b * n + j, c, part);
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
