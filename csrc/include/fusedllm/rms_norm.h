// RMSNorm math shared by the CPU kernels (scalar and Vectorized<float> lanes)
// and the CUDA kernels. `V` is a float/double scalar or an ATen vector of them;
// `Round` rounds an accumulator value to the tensor dtype and back (identity
// for float32/float64).
#pragma once

#include <cmath>
#include <cstdint>

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
