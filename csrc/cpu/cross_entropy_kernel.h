// The interface between the linear cross-entropy ops (cross_entropy.cpp) and
// their per-ISA row kernels (cross_entropy_kernel.cpp): one chunk of logits
// rows as pointers and row strides.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "fusedllm/cpu_dispatch.h"
#include "fusedllm/cross_entropy.h"

namespace fusedllm::cpu {

struct CrossEntropyRowArgs {
  at::ScalarType acc;        // dtype of logits, loss, lse, scale: float32 or float64
  at::ScalarType grad_dtype;  // dtype of grad_logits
  ce::Options options;
  int64_t ignore_index;
  int64_t rows, vocab;
  void* logits; int64_t logits_stride;  // z on entry; s (capped logits) on exit
  const int64_t* target;
  void* loss; void* lse;
  const void* scale;  // null: 1 for every row
  void* grad_logits; int64_t grad_stride;  // null: no gradient
};

using CrossEntropyRowFn = void (*)(const CrossEntropyRowArgs&);

extern KernelTable<CrossEntropyRowFn> cross_entropy_row_kernels;

}  // namespace fusedllm::cpu
