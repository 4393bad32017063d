// Quantization of one key or value row (one position of one kv head) with one
// float32 scale, shared by the CPU and CUDA quantize_kv kernels and by the
// attention kernels that read the codes back: symmetric int8, or float8 e4m3
// (torch.float8_e4m3fn: 4 exponent bits, 3 mantissa bits, finite up to 448).
// A stored row is code * scale.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "fusedllm/macros.h"

namespace fusedllm::kvq {

// What a cache stores: int8 in [-127, 127] (-128 unused), or e4m3 codes in [-448, 448].
enum class Code : int { kInt8 = 0, kFloat8 = 1 };

FUSEDLLM_HOST_DEVICE float levels(Code code) { return code == Code::kInt8 ? 127.0f : 448.0f; }

// The row's scale from max|x| and the sum of x * 0 over the row (0, or NaN
// when an entry is infinite or NaN, which a max would hide).
FUSEDLLM_HOST_DEVICE float row_scale(float amax, float nonfinite_probe, Code code) {
  return amax / levels(code) + nonfinite_probe;
}

// x * this is the value a code stores (0 for an all-zero row).
FUSEDLLM_HOST_DEVICE float row_inverse(float amax, Code code) {
  return amax > 0.0f ? levels(code) / amax : 0.0f;
}

FUSEDLLM_HOST_DEVICE int8_t quantize(float x, float inverse) {
  // rintf rounds half to even in the default rounding mode, on host and device;
  // the clamp keeps a NaN product (non-finite row) defined.
  const float r = rintf(x * inverse);
  return static_cast<int8_t>(fminf(fmaxf(r, -127.0f), 127.0f));
}

// The e4m3 code of y (|y| <= 448 up to rounding; clamped), rounded to nearest
// even as torch's conversion rounds; NaN gives the NaN code 0x7F.
FUSEDLLM_HOST_DEVICE uint8_t float8_code(float y) {
  const uint8_t sign = copysignf(1.0f, y) < 0.0f ? 0x80 : 0x00;  // -0 too, as torch stores it
  float a = fabsf(y);
  if (!(a == a)) return 0x7F;
  a = fminf(a, 448.0f);
  if (a < 0.015625f) {  // below 2^-6: subnormal steps of 2^-9 (8 steps is 2^-6, code 0x08)
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(rintf(a * 512.0f)));
  }
  int e;
  const float f = frexpf(a, &e);           // a = f 2^e, f in [0.5, 1)
  const float m = rintf((2.0f * f - 1.0f) * 8.0f);  // 3 mantissa bits; 8 carries into the exponent
  return static_cast<uint8_t>(sign | (((e - 1 + 7) << 3) + static_cast<int>(m)));
}

FUSEDLLM_HOST_DEVICE uint8_t quantize_float8(float x, float inverse) { return float8_code(x * inverse); }

// The float32 whose bits are `bits`.
FUSEDLLM_HOST_DEVICE float float_of_bits(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// The value of an e4m3 code. A normal code's exponent and mantissa bits placed
// under a float32's are its value times 2^-120; a subnormal's (exponent 0) are
// m 2^-9. Both exact, with no subnormal float32 on the way (flush-to-zero
// modes change nothing); a decoding kernel converts 16 codes per load.
FUSEDLLM_HOST_DEVICE float float8_value(uint8_t code) {
  const uint32_t magnitude = code & 0x7Fu;
  const float a = magnitude < 8u ? static_cast<float>(magnitude) * 0x1p-9f
                                 : float_of_bits(magnitude << 20) * 0x1p120f;
  // Selects, not an early return: on a GPU the return was a branch per code.
  const float signed_a = (code & 0x80u) ? -a : a;
  return magnitude == 0x7Fu ? NAN : signed_a;
}

}  // namespace fusedllm::kvq
