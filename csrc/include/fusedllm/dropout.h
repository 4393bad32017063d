// Attention dropout shared by the CPU and CUDA kernels (and mirrored by
// fusedllm/_philox.py): Philox-4x32-10, a counter-based generator, so the
// decision for probability (b, h, i, j) is a pure function of the seed and that
// index. Forward and backward regenerate the same pattern without storing it,
// on any thread layout.
#pragma once

#include <cmath>
#include <cstdint>

#include "fusedllm/macros.h"

namespace fusedllm::dropout {

struct Words {
  uint32_t w[4];
};

FUSEDLLM_HOST_DEVICE void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

// The four 32-bit words of Philox-4x32-10 for the 64-bit counter `ctr` (upper
// counter words zero) under the 64-bit key `seed`.
FUSEDLLM_HOST_DEVICE Words philox(uint64_t seed, uint64_t ctr) {
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  uint32_t c0 = static_cast<uint32_t>(ctr), c1 = static_cast<uint32_t>(ctr >> 32), c2 = 0, c3 = 0;
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(0xD2511F53u, c0, hi0, lo0);
    mulhilo(0xCD9E8D57u, c2, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Words{{c0, c1, c2, c3}};
}

// A 24-bit draw is kept when it is >= this threshold: P(drop) = p up to 2^-24.
inline uint32_t keep_threshold(double p) { return static_cast<uint32_t>(std::ceil(p * 16777216.0)); }

// The keep rule, given a probability's random word: its top 24 bits reach the
// threshold (as dropout_keep in fusedllm/_philox.py).
FUSEDLLM_HOST_DEVICE bool kept(uint32_t word, uint32_t threshold) { return (word >> 8) >= threshold; }

// Element n of the [B, Hq, Sq, Sk] probabilities (row-major index) uses word
// n % 4 of Philox(n / 4).
FUSEDLLM_HOST_DEVICE bool keep(uint64_t seed, uint64_t n, uint32_t threshold) {
  const Words r = philox(seed, n >> 2);
  const uint32_t lane = static_cast<uint32_t>(n & 3);
  // Selects rather than r.w[lane]: a dynamic index would put r in local memory on GPUs.
  const uint32_t word = lane == 0 ? r.w[0] : lane == 1 ? r.w[1] : lane == 2 ? r.w[2] : r.w[3];
  return kept(word, threshold);
}

// What the kernels need: seed, threshold and the scale of kept probabilities.
struct Dropout {
  bool enabled = false;
  uint64_t seed = 0;
  uint32_t threshold = 0;
  double scale = 1.0;  // 1 / (1 - p)
};

}  // namespace fusedllm::dropout
