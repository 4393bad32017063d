// RMSNorm math shared by the CPU kernels (scalar and Vectorized<float> lanes)
// and the CUDA kernels. `V` is a float/double scalar or an ATen vector of them;
// `Round` rounds an accumulator value to the tensor dtype and back (identity
// for float32/float64). Last, the CPU kernels' interface (plain pointers).
#pragma once

#include <c10/core/ScalarType.h>
#include <cmath>
#include <cstdint>

#include "fusedllm/cpu_dispatch.h"
#include "fusedllm/macros.h"

namespace fusedllm::rms {

// Where the weight multiply happens relative to the cast back to the input dtype.
enum class Casting : int {
  kLlama = 0,  // normalize in float32, cast to the dtype, then multiply by w
  kGemma = 1,  // multiply by w in float32, then cast
};

// 1 / sqrt(mean(x^2) + eps) from a row's sum of squares.
template <typename acc_t>
FUSEDLLM_HOST_DEVICE acc_t rstd_from_sumsq(acc_t sumsq, int64_t n, acc_t eps) {
  using std::sqrt;
  return acc_t(1) / sqrt(sumsq / static_cast<acc_t>(n) + eps);
}

// y (before the final cast) from x, the row's rstd and the effective weight
// (offset + w, or 1 when there is no weight).
template <typename V, typename Round>
FUSEDLLM_HOST_DEVICE V forward_value(V x, V rstd, V w_eff, Casting casting, Round round) {
  if (casting == Casting::kLlama) {
    return round(x * rstd) * w_eff;
  }
  return x * rstd * w_eff;
}

// d(sum g*y)/dw for one element: g times the normalized value the weight multiplied.
template <typename V, typename Round>
FUSEDLLM_HOST_DEVICE V weight_grad_term(V g, V x, V rstd, Casting casting, Round round) {
  if (casting == Casting::kLlama) {
    return g * round(x * rstd);
  }
  return g * x * rstd;
}

// Row reduction that backward needs: sum over the row of g * w_eff * xhat.
template <typename V>
FUSEDLLM_HOST_DEVICE V backward_dot_term(V g, V x, V rstd, V w_eff) {
  return g * w_eff * (x * rstd);
}

// dx = rstd * (g*w_eff - xhat * mean(g*w_eff*xhat)), with c = that mean.
template <typename V>
FUSEDLLM_HOST_DEVICE V input_grad(V g, V x, V rstd, V w_eff, V c) {
  V xhat = x * rstd;
  return rstd * (g * w_eff - xhat * c);
}

}  // namespace fusedllm::rms

// The interface between the rms_norm ops (rms_norm.cpp) and their per-ISA
// kernels (rms_norm_kernel.cpp). Plain pointers and strides, no tensors.

namespace fusedllm::cpu {

struct RmsNormForwardArgs {
  at::ScalarType dtype;
  int64_t rows, n;
  const void* input;  int64_t input_stride;     // row strides in elements
  const void* residual; int64_t residual_stride;  // null for plain rms_norm
  const void* weight;   // [n] contiguous, or null
  void* out;            // [rows, n] contiguous
  void* residual_out;   // [rows, n] contiguous, or null
  void* rstd;           // [rows], float32 (float64 for float64 input)
  double eps, offset;
  rms::Casting casting;
};

struct RmsNormBackwardArgs {
  at::ScalarType dtype;
  int64_t rows, n;
  const void* grad_out; int64_t grad_out_stride;
  const void* input;    int64_t input_stride;
  const void* rstd;
  const void* weight;   // or null
  const void* grad_residual; int64_t grad_residual_stride;  // added to grad_input, or null
  void* grad_input;     // [rows, n] contiguous
  void* grad_weight;    // [n], or null when not wanted
  double offset;
  rms::Casting casting;
};

using RmsNormForwardFn = void (*)(const RmsNormForwardArgs&);
using RmsNormBackwardFn = void (*)(const RmsNormBackwardArgs&);

extern KernelTable<RmsNormForwardFn> rms_norm_forward_kernels;
extern KernelTable<RmsNormBackwardFn> rms_norm_backward_kernels;

}  // namespace fusedllm::cpu
