// The interface between the rope ops (rope.cpp) and their per-ISA kernels
// (rope_kernel.cpp): [B, H, S, D] operands as pointers and strides.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "fusedllm/cpu_dispatch.h"

namespace fusedllm::cpu {

struct RopeTensorArgs {
  int64_t heads;
  const void* in; int64_t in_b, in_h, in_s;  // element strides; unit stride along D
  void* out; int64_t out_b, out_h, out_s;    // may equal `in` (in place)
};

struct RopeArgs {
  at::ScalarType dtype;
  int64_t batch, seq, head_dim, rotary_dim;
  bool interleaved, inverse;
  RopeTensorArgs q, k;
  const void* cos; const void* sin;  // accumulation dtype, [B, P, rotary_dim / 2]
  int64_t table_b, table_row, table_rows;
  const int64_t* positions; int64_t positions_b;  // [B, S] (unit stride along S), or null
  int64_t offset;                                 // position of s is offset + s without positions
};

using RopeFn = void (*)(const RopeArgs&);

extern KernelTable<RopeFn> rope_kernels;

}  // namespace fusedllm::cpu
