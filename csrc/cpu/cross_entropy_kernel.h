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
