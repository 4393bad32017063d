// Cross-entropy of one row of logits and its gradient, shared by the CPU
// kernels (scalar and ATen vector lanes) and the CUDA kernels. `V` is
// float/double or an ATen vector of them; `Math` supplies tanh for V.
//
// With s = softcap * tanh(z / softcap) (or s = z without a cap), p = softmax(s),
// eps the label smoothing over a vocabulary of n, t the target and zl the
// z-loss weight, a row's loss is
//   lse - (1 - eps) * s[t] - (eps / n) * sum(s) + zl * lse^2
// (cross_entropy's smoothing: (1 - eps) on the target, eps spread uniformly),
// and its gradient with respect to z[j] is
//   ((1 + 2 zl lse) * p[j] - (1 - eps) * [j == t] - eps / n) * ds/dz[j],
// with ds/dz = 1 - (s / softcap)^2 under the cap. Last, the CPU kernels'
// interface (plain pointers).
#pragma once

#include <c10/core/ScalarType.h>
#include <cstdint>

#include "fusedllm/activations.h"
#include "fusedllm/cpu_dispatch.h"
#include "fusedllm/macros.h"

namespace fusedllm::ce {

// Double, so that float64 inputs keep their options exact (0.1 as a float is
// 0.1 + 1.5e-9); each kernel converts them to its accumulation type.
struct Options {
  double smoothing = 0.0;  // label smoothing eps in [0, 1]
  double softcap = 0.0;    // 0: no cap
  double z_loss = 0.0;     // weight of lse^2
  int64_t vocab = 0;
};

// Soft-capping of the logits (activations.h, shared with attention's scores).
using act::cap_slope;
using act::capped;

// The loss of a row from its lse, its target's s and the sum of its s (used
// only when smoothing).
template <typename T>
FUSEDLLM_HOST_DEVICE T row_loss(const Options& o, T lse, T s_target, T s_sum) {
  const T eps = T(o.smoothing);
  return lse - (T(1) - eps) * s_target - eps / T(o.vocab) * s_sum + T(o.z_loss) * lse * lse;
}

// The parts of a row's gradient that do not depend on j: the gradient is
// (p_scale * p[j] - off - (j == t ? on : 0)) * ds/dz[j].
template <typename T>
struct RowGrad {
  T p_scale, off, on;
};

template <typename T>
FUSEDLLM_HOST_DEVICE RowGrad<T> row_grad(const Options& o, T lse, T scale) {
  const T eps = T(o.smoothing);
  return {scale * (T(1) + T(2) * T(o.z_loss) * lse), scale * eps / T(o.vocab),
          scale * (T(1) - eps)};
}

}  // namespace fusedllm::ce

// The interface between the linear cross-entropy ops (cross_entropy.cpp) and
// their per-ISA row kernels (cross_entropy_kernel.cpp): one chunk of logits
// rows as pointers and row strides.

namespace fusedllm::cpu {

struct CrossEntropyRowArgs {
  at::ScalarType dtype;  // of the logits; loss, lse and scale are float32 (float64 for float64)
  ce::Options options;
  int64_t ignore_index;
  int64_t rows, vocab;
  // z on entry; the capped logits after, or with `grad` the gradient of
  // sum(scale * loss) with respect to z
  void* logits; int64_t logits_stride;
  const int64_t* target;
  void* loss; void* lse;
  const void* scale;  // null: 1 for every row
  bool grad;
  // The logits are the columns column0 .. column0 + vocab - 1 of the rows,
  // whose lse is read: only the gradient is written (options.vocab is the
  // whole vocabulary's size).
  bool slab;
  int64_t column0;
};

using CrossEntropyRowFn = void (*)(const CrossEntropyRowArgs&);

extern KernelTable<CrossEntropyRowFn> cross_entropy_row_kernels;

}  // namespace fusedllm::cpu
