// Rotary position embedding math shared by the CPU kernels (scalar and ATen
// vector lanes) and the CUDA kernels.
#pragma once

#include <cstdint>

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
