// The interface between the rms_norm ops (rms_norm.cpp) and their per-ISA
// kernels (rms_norm_kernel.cpp). Plain pointers and strides, no tensors.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "fusedllm/cpu_dispatch.h"
#include "fusedllm/rms_norm.h"

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
