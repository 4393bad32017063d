// Symmetric int8 quantization of one key or value row (one position of one kv
// head), shared by the CPU and CUDA quantize_kv kernels; attention dequantizes
// value * scale as it loads a row.
#pragma once

#include <cmath>
#include <cstdint>

#include "fusedllm/macros.h"

namespace fusedllm::kvq {

constexpr float kLevels = 127.0f;  // values in [-127, 127]: symmetric, -128 unused

// The row's scale from max|x| and the sum of x * 0 over the row (0, or NaN
// when an entry is infinite or NaN, which a max would hide).
FUSEDLLM_HOST_DEVICE float row_scale(float amax, float nonfinite_probe) {
  return amax / kLevels + nonfinite_probe;
}

// x * this, rounded, is the stored value (0 for an all-zero row).
FUSEDLLM_HOST_DEVICE float row_inverse(float amax) { return amax > 0.0f ? kLevels / amax : 0.0f; }

FUSEDLLM_HOST_DEVICE int8_t quantize(float x, float inverse) {
  // rintf rounds half to even in the default rounding mode, on host and device;
  // the clamp keeps a NaN product (non-finite row) defined.
  const float r = rintf(x * inverse);
  return static_cast<int8_t>(fminf(fmaxf(r, -kLevels), kLevels));
}

}  // namespace fusedllm::kvq
