// Rotary position embedding math shared by the CPU kernels (scalar and ATen
// vector lanes) and the CUDA kernels; last, the CPU kernels' interface.
#pragma once

#include <c10/core/ScalarType.h>
#include <cstdint>

#include "fusedllm/cpu_dispatch.h"
#include "fusedllm/macros.h"

namespace fusedllm::rope {

// Rotates the pair (x0, x1) by the angle whose cosine and sine are c and s:
// (x0, x1) -> (x0 c - x1 s, x1 c + x0 s). The inverse rotation (the backward
// pass) is the same call with -s.
template <typename V>
FUSEDLLM_HOST_DEVICE void rotate_pair(V& x0, V& x1, V c, V s) {
  const V r0 = x0 * c - x1 * s;
  const V r1 = x1 * c + x0 * s;
  x0 = r0;
  x1 = r1;
}

// Feature indices of pair i among the first `rotary_dim` features.
//   half-split (NeoX, Llama, HF rotate_half): (i, i + rotary_dim / 2)
//   interleaved (GPT-J):                       (2 i, 2 i + 1)
FUSEDLLM_HOST_DEVICE int64_t pair_first(int64_t i, int64_t rotary_dim, bool interleaved) {
  (void)rotary_dim;
  return interleaved ? 2 * i : i;
}
FUSEDLLM_HOST_DEVICE int64_t pair_second(int64_t i, int64_t rotary_dim, bool interleaved) {
  return interleaved ? 2 * i + 1 : i + rotary_dim / 2;
}

}  // namespace fusedllm::rope

// The interface between the rope ops (rope.cpp) and their per-ISA kernels
// (rope_kernel.cpp): [B, H, S, D] operands as pointers and strides.

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
