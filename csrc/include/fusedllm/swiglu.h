// The interface between the swiglu ops (swiglu.cpp) and their per-ISA kernels
// (swiglu_kernel.cpp): [rows, n] operands as pointers and row strides.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "fusedllm/activations.h"
#include "fusedllm/cpu_dispatch.h"

namespace fusedllm::cpu {

struct SwigluArgs {
  at::ScalarType dtype;
  act::Activation activation;
  int64_t rows, n;
  const void* gate; int64_t gate_stride;
  const void* up; int64_t up_stride;
  void* out; int64_t out_stride;                  // forward only
  const void* grad_out; int64_t grad_out_stride;  // backward only
  void* grad_gate; int64_t grad_gate_stride;      // backward only
  void* grad_up; int64_t grad_up_stride;          // backward only
};

using SwigluFn = void (*)(const SwigluArgs&);

extern KernelTable<SwigluFn> swiglu_forward_kernels;
extern KernelTable<SwigluFn> swiglu_backward_kernels;

}  // namespace fusedllm::cpu
