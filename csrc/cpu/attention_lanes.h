// Decoding tiles (at most a few query rows per kv head) scored with the keys
// along the vector lanes: K read as it lies, no packing or transpose of K
// (attention_forward_kernel.cpp). The pair-word lanes (KeyLanes) are in
// attention_pair_words.h.
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "attention_tile.h"  // float8_half_bits

namespace fusedllm::cpu {
inline namespace CPU_CAPABILITY {
namespace flash {

#if defined(__AVX2__)
// ---------------------------------------------------------------------------
// Decoding tiles (at most a few query rows per kv head), keys along the lanes.
// ---------------------------------------------------------------------------

#if defined(__AVX512F__)
// r[i] becomes column i of the 16 x 16 matrix of 32-bit words whose rows were r.
// Always inlined: called out of line, the 16 registers go through memory.
__attribute__((always_inline)) inline void transpose_16x16_words(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane L: words 4L, 4L + 1 (lo) and 4L + 2, 4L + 3 (hi) of rows 2i, 2i + 1
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + k], lane L: word 4L + k of rows 4i .. 4i + 3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // column 4L + k: lane L of r[k], r[4 + k], r[8 + k], r[12 + k]
    const __m512i a = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x44), b = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xEE);
    const __m512i c = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x44);
    const __m512i d = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xEE);
    t[k] = _mm512_shuffle_i32x4(a, c, 0x88);
    t[4 + k] = _mm512_shuffle_i32x4(a, c, 0xDD);
    t[8 + k] = _mm512_shuffle_i32x4(b, d, 0x88);
    t[12 + k] = _mm512_shuffle_i32x4(b, d, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// dst[c * 16 + r] = src[r * lds + c] for r < 16 and c < round_up(cols, 16)
// (src readable that far): a 16-row float32 tile transposed, 16 columns at a time.
inline void transpose_16_rows(const float* src, int64_t lds, int64_t cols, float* dst) {
  for (int64_t c = 0; c < cols; c += 16) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * lds + c);
    transpose_16x16_words(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + (c + i) * 16, r[i]);
  }
}

#endif  // __AVX512F__

// Scores of a decoding tile, keys along the lanes, without packing K:
// out[i * ldo + j] = out_scale * q_scale[i] * (row i of A) . (key j) for
// i < rows, j < round_up(nk, kLanes) (0 past nk; a null q_scale meaning ones).
// key(j) gives key j's n terms, read as they lie (widened in registers).
// Each key's products run along the head dim, a vector of partial sums per
// row (L::products: FloatKeyLanes on float32 FMAs, KeyLanes on pair words),
// which a tree of log2(kLanes) levels (kLanes - 1 unpack-and-add steps per
// row and kLanes keys) folds into one lane per key: no transpose of K.
template <typename Acc>
struct LaneFold;

#if defined(__AVX512F__)
template <typename Acc>
struct LaneFold512 {
  static constexpr bool kInt = std::is_same_v<Acc, __m512i>;
  static constexpr int kLanes = 16, kLevels = 4;
  static constexpr int kRowBlock = 4;  // rows per fold tree: at most 5 x 4 vectors live
  static Acc add(Acc x, Acc y) {
    if constexpr (kInt) {
      return _mm512_add_epi32(x, y);
    } else {
      return _mm512_add_ps(x, y);
    }
  }
  static __m512i bits(Acc x) {
    if constexpr (kInt) {
      return x;
    } else {
      return _mm512_castps_si512(x);
    }
  }
  static Acc acc(__m512i x) {
    if constexpr (kInt) {
      return x;
    } else {
      return _mm512_castsi512_ps(x);
    }
  }
  static __m512 to_float(Acc x) {
    if constexpr (kInt) {
      return _mm512_cvtepi32_ps(x);
    } else {
      return x;
    }
  }
  static void store(float* dst, Acc x, float scale) {
    _mm512_storeu_ps(dst, _mm512_mul_ps(to_float(x), _mm512_set1_ps(scale)));
  }
  // Two vectors of partial sums, x over keys X and y over keys Y (the same
  // number of lanes each), folded into one holding both: levels 0 and 1 add
  // the two halves of each 128-bit lane (x's and y's 32-bit, then 64-bit,
  // entries interleaved), levels 2 and 3 pairs of 128-bit lanes.
  template <int kLevel>
  static Acc fold(Acc x, Acc y) {
    const __m512i a = bits(x), b = bits(y);
    if constexpr (kLevel == 0) {
      return add(acc(_mm512_unpacklo_epi32(a, b)), acc(_mm512_unpackhi_epi32(a, b)));
    } else if constexpr (kLevel == 1) {
      return add(acc(_mm512_unpacklo_epi64(a, b)), acc(_mm512_unpackhi_epi64(a, b)));
    } else {
      return add(acc(_mm512_shuffle_i32x4(a, b, 0x88)), acc(_mm512_shuffle_i32x4(a, b, 0xDD)));
    }
  }
};
template <>
struct LaneFold<__m512> : LaneFold512<__m512> {};
template <>
struct LaneFold<__m512i> : LaneFold512<__m512i> {};
#endif  // __AVX512F__

// AVX2: 8 lanes, the same levels 0 and 1 within each 128-bit lane, level 2
// across the two.
template <>
struct LaneFold<__m256> {
  static constexpr int kLanes = 8, kLevels = 3;
  static constexpr int kRowBlock = 2;  // 16 registers
  static void store(float* dst, __m256 x, float scale) {
    _mm256_storeu_ps(dst, _mm256_mul_ps(x, _mm256_set1_ps(scale)));
  }
  template <int kLevel>
  static __m256 fold(__m256 x, __m256 y) {
    const __m256i a = _mm256_castps_si256(x), b = _mm256_castps_si256(y);
    __m256i lo, hi;
    if constexpr (kLevel == 0) {
      lo = _mm256_unpacklo_epi32(a, b), hi = _mm256_unpackhi_epi32(a, b);
    } else if constexpr (kLevel == 1) {
      lo = _mm256_unpacklo_epi64(a, b), hi = _mm256_unpackhi_epi64(a, b);
    } else {
      lo = _mm256_permute2x128_si256(a, b, 0x20), hi = _mm256_permute2x128_si256(a, b, 0x31);
    }
    return _mm256_add_ps(_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi));
  }
};

// float32 products: A holds rows of float32 terms (zero from n to a multiple
// of the lanes), keys are float32, bfloat16 or float16 rows, or int8 /
// float8 e4m3 codes (their scales applied to the scores after).
#if defined(__AVX512F__)
using FloatLanes = __m512;
#else
using FloatLanes = __m256;
#endif
struct FloatKeyLanes : LaneFold<FloatLanes> {
  using Acc = FloatLanes;
  using A = float;
  // Terms c .. c + kLanes - 1 of a row as float32, zero past n.
  template <typename Code>
  [[gnu::always_inline]] static Acc terms(const Code* row, int64_t c, int64_t n) {
#if defined(__AVX512F__)
    const __mmask16 m = c + 16 <= n ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - c)) - 1);
    if constexpr (std::is_same_v<Code, float>) {
      return _mm512_maskz_loadu_ps(m, row + c);
    } else if constexpr (std::is_same_v<Code, c10::BFloat16>) {
      const __m512i bits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, row + c));
      return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
    } else if constexpr (std::is_same_v<Code, c10::Half>) {
      return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, row + c));
    } else if constexpr (std::is_same_v<Code, int8_t>) {
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, row + c)));
    } else {
      static_assert(std::is_same_v<Code, c10::Float8_e4m3fn>, "float, 16-bit or code rows");
      const __m256i half = float8_half_bits(_mm_maskz_loadu_epi8(m, row + c));  // code * 2^-8
      return _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.0f));
    }
#else
    Code tail[8] = {};
    const Code* src = row + c;
    if (c + 8 > n) {  // the row's last terms, zero after
      std::copy(src, row + n, tail);
      src = tail;
    }
    if constexpr (std::is_same_v<Code, float>) {
      return _mm256_loadu_ps(src);
    } else if constexpr (std::is_same_v<Code, c10::BFloat16>) {
      const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
      return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
    } else if constexpr (std::is_same_v<Code, c10::Half>) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    } else if constexpr (std::is_same_v<Code, int8_t>) {
      return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src))));
    } else {
      static_assert(std::is_same_v<Code, c10::Float8_e4m3fn>, "float, 16-bit or code rows");
      const __m256i half = float8_half_bits(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
      return _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(half)), _mm256_set1_ps(256.0f));
    }
#endif
  }
  // One key's products with R rows of A: R vectors of partial sums.
  template <int R, typename Code>
  [[gnu::always_inline]] static void products(const Code* key, int64_t n, const float* a, int64_t lda,
                                              Acc (&acc)[R]) {
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) acc[i] = Acc{};
    if (key == nullptr) return;
    for (int64_t c = 0; c < n; c += kLanes) {
      const Acc k = terms(key, c, n);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
#if defined(__AVX512F__)
        acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(a + i * lda + c), k, acc[i]);
#else
        acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i * lda + c), k, acc[i]);
#endif
      }
    }
  }
};

// Keys [j, j + 2^kLevel) against R rows, folded kLevel times: lane l of
// out[i] holds key j + l's sum when kLevel is L's last level. Keys 2m and
// 2m + 1 fold first, then pairs of those, and so on, so that at most
// (kLevels + 1) R vectors are live.
template <int kLevel, int R, typename L, typename Key>
[[gnu::always_inline]] inline void folded_keys(const Key& key, int64_t j, int64_t nk, int64_t n,
                                               const typename L::A* a, int64_t lda, typename L::Acc (&out)[R]) {
  if constexpr (kLevel == 0) {
    L::template products<R>(j < nk ? key(j) : nullptr, n, a, lda, out);
  } else {
    typename L::Acc x[R], y[R];
    folded_keys<kLevel - 1, R, L>(key, j, nk, n, a, lda, x);
    folded_keys<kLevel - 1, R, L>(key, j + (1 << (kLevel - 1)), nk, n, a, lda, y);
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) out[i] = L::template fold<kLevel - 1>(x[i], y[i]);
  }
}

template <int R, typename L, typename Key>
inline void scores_lane_keys(const Key& key, int64_t j0, int64_t nk, int64_t n, const typename L::A* a, int64_t lda,
                             float* out, int64_t ldo, float out_scale, const float* q_scale) {
  typename L::Acc s[R];
  folded_keys<L::kLevels, R, L>(key, j0, nk, n, a, lda, s);
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i) {
    L::store(out + i * ldo + j0, s[i], q_scale != nullptr ? out_scale * q_scale[i] : out_scale);
  }
}

// scores_lane_keys for r <= R rows (R a compile-time bound).
template <int R, typename L, typename Key>
inline void scores_lane_keys_up_to(int64_t r, const Key& key, int64_t j0, int64_t nk, int64_t n,
                                   const typename L::A* a, int64_t lda, float* out, int64_t ldo, float out_scale,
                                   const float* q_scale) {
  if constexpr (R > 1) {
    if (r < R) return scores_lane_keys_up_to<R - 1, L>(r, key, j0, nk, n, a, lda, out, ldo, out_scale, q_scale);
  }
  scores_lane_keys<R, L>(key, j0, nk, n, a, lda, out, ldo, out_scale, q_scale);
}

template <typename L, typename Key>
inline void scores_along_keys(const Key& key, int64_t nk, int64_t n, const typename L::A* a, int64_t lda, int64_t rows,
                              float* out, int64_t ldo, float out_scale, const float* q_scale) {
  for (int64_t i0 = 0; i0 < rows; i0 += L::kRowBlock) {
    const int64_t r = std::min<int64_t>(L::kRowBlock, rows - i0);
    const float* si = q_scale != nullptr ? q_scale + i0 : nullptr;
    for (int64_t j0 = 0; j0 < nk; j0 += L::kLanes) {
      scores_lane_keys_up_to<L::kRowBlock, L>(r, key, j0, nk, n, a + i0 * lda, lda, out + i0 * ldo, ldo, out_scale,
                                              si);
    }
  }
}

#endif  // __AVX2__

}  // namespace flash
}  // namespace CPU_CAPABILITY
}  // namespace fusedllm::cpu
