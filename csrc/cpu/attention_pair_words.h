// Pair words for the pair products (attention_pairs.h): bfloat16 rows and
// int8 / float8 codes packed or widened into words of two terms, the decoding
// tiles' pair-word lanes (KeyLanes), rows read as they lie as a B operand
// (RowsB), and the probability tile rounded into pairs.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "attention_lanes.h"
#include "attention_pairs.h"
#include "attention_tile.h"
#include "fusedllm/kv_quant.h"

namespace fusedllm::cpu {
inline namespace CPU_CAPABILITY {
namespace flash {

#if defined(__AVX512BF16__)
// Packing. A pair word: bfloat16 bits of term 2p in the low half, 2p + 1 in
// the high half.
inline uint32_t pair_word(uint16_t lo, uint16_t hi) { return uint32_t(lo) | (uint32_t(hi) << 16); }

// Rows of bfloat16 as pair words along the row, transposed: dst[p * ld + i]
// for p < ceil(n / 2) and i < rows, zero for i in [rows, ld). row(i) gives
// row i's first element.
template <typename Row>
inline void pack_rows_transposed(const Row& row, int64_t rows, int64_t ld, int64_t n, uint32_t* dst) {
  const int64_t np = (n + 1) / 2;
  for (int64_t p = 0; p < np; ++p) std::fill(dst + p * ld + rows, dst + (p + 1) * ld, 0u);
  // blocks of 16 rows and 16 words through a 16 x 16 transpose in registers
  // (word by word, its stores ld apart took a tenth of a prefill tile's
  // packing and staging on a Sapphire Rapids); the edges word by word
  const int64_t rows16 = rows / 16 * 16, p16 = n / 2 / 16 * 16;
  for (int64_t i0 = 0; i0 < rows16; i0 += 16) {
    for (int64_t p0 = 0; p0 < p16; p0 += 16) {
      __m512i r[16];
      for (int q = 0; q < 16; ++q) r[q] = _mm512_loadu_si512(row(i0 + q) + 2 * p0);
      transpose_16x16_words(r);
      for (int q = 0; q < 16; ++q) _mm512_storeu_si512(dst + (p0 + q) * ld + i0, r[q]);
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    const c10::BFloat16* r = row(i);
    for (int64_t p = i < rows16 ? p16 : 0; p < n / 2; ++p) {
      uint32_t w;
      std::memcpy(&w, r + 2 * p, sizeof(w));
      dst[p * ld + i] = w;
    }
    if (n % 2 != 0) dst[(np - 1) * ld + i] = pair_word(r[n - 1].x, 0);
  }
}

// Rows of bfloat16 as pair words along the row: dst[i * ldp + p] for
// p < ceil(n / 2), a zero high half past n (odd n).
inline void pack_rows_along(const c10::BFloat16* src, int64_t stride, int64_t rows, int64_t n,
                            uint32_t* dst, int64_t ldp) {
  const int64_t full = n / 2;
  for (int64_t i = 0; i < rows; ++i) {
    const c10::BFloat16* r = src + i * stride;
    uint32_t* out = dst + i * ldp;
    std::memcpy(out, r, sizeof(uint32_t) * full);
    if (n % 2 != 0) out[full] = pair_word(r[n - 1].x, 0);
  }
}

// The codes of a quantized cache (int8, float8 e4m3) as bfloat16: exact, as
// both have at most 8 significant bits and exponents bfloat16 holds.
inline uint16_t code_bfloat16_bits(int8_t x) { return c10::BFloat16(static_cast<float>(x)).x; }
inline uint16_t code_bfloat16_bits(c10::Float8_e4m3fn x) { return c10::BFloat16(kvq::float8_value(x.x)).x; }

// 16 int8 codes from src, or count (<= 16) of them and zeros past count, as float32.
inline __m512 codes_to_float(const int8_t* src) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
}
inline __m512 codes_to_float(const int8_t* src, int64_t count) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << count) - 1), src)));
}

// 32 float8 e4m3 codes as the bfloat16 bits of their values, in order, in
// integer instructions (about half of those through float16 and float32):
// a normal code's exponent moves up 4 bits and gains 120 (bias 127 against 7),
// its mantissa up 4; the 8 subnormals (and zero) come from a table. Exact; the
// NaN codes (magnitude 0x7F) become all ones, a NaN.
inline __m512i float8_bfloat16_bits(__m256i codes) {
  alignas(64) static constexpr uint16_t kSubnormal[32] = {0x0000, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};
  const __m512i w = _mm512_cvtepu8_epi16(codes);
  const __m512i magnitude = _mm512_and_si512(w, _mm512_set1_epi16(0x7F));
  const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(magnitude, 4), _mm512_set1_epi16(120 << 7));
  const __mmask32 subnormal = _mm512_cmplt_epu16_mask(magnitude, _mm512_set1_epi16(8));
  const __m512i bits = _mm512_mask_permutexvar_epi16(normal, subnormal, magnitude, _mm512_load_si512(kSubnormal));
  const __mmask32 nan = _mm512_cmpeq_epi16_mask(magnitude, _mm512_set1_epi16(0x7F));
  return _mm512_mask_mov_epi16(_mm512_or_si512(bits, _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8)),
                               nan, _mm512_set1_epi16(-1));
}

template <typename R>
constexpr bool kCodeRows = std::is_same_v<R, int8_t> || std::is_same_v<R, c10::Float8_e4m3fn>;
// Whether a row accessor's rows (its pointer type P) are int8 codes.
template <typename P>
constexpr bool kInt8Rows = std::is_same_v<P, const int8_t*>;

// Up to 32 terms of a row from term c on (n terms in all) as 16 pair words,
// zero past n: bfloat16 as stored, int8 and float8 codes as bfloat16.
inline __m512i row_pair_words(const c10::BFloat16* row, int64_t c, int64_t n) {
  const int64_t count = std::min<int64_t>(32, n - c);
  return _mm512_maskz_loadu_epi16(static_cast<__mmask32>(count == 32 ? ~0u : (1u << count) - 1), row + c);
}
inline __m512i row_pair_words(const c10::Float8_e4m3fn* row, int64_t c, int64_t n) {
  const int64_t count = std::min<int64_t>(32, n - c);
  return float8_bfloat16_bits(
      _mm256_maskz_loadu_epi8(static_cast<__mmask32>(count == 32 ? ~0u : (1u << count) - 1), row + c));
}
inline __m512i row_pair_words(const int8_t* row, int64_t c, int64_t n) {
  const int64_t count = std::min<int64_t>(32, n - c);
  const auto part = [&](int64_t from) {
    return codes_to_float(row + c + from, std::clamp<int64_t>(count - from, 0, 16));
  };
  return (__m512i)_mm512_cvtne2ps_pbh(part(16), part(0));
}

// Up to 32 int8 terms of a row from term c on (n terms in all) as 16 int16
// pair words, zero past n.
inline __m512i int16_pair_words(const int8_t* row, int64_t c, int64_t n) {
  const int64_t count = std::min<int64_t>(32, n - c);
  return _mm512_cvtepi8_epi16(
      _mm256_maskz_loadu_epi8(static_cast<__mmask32>(count == 32 ? ~0u : (1u << count) - 1), row + c));
}

// A row of n bfloat16 terms as int16 pair words dst[p] (p < ceil(n / 2)),
// scaled so that its largest magnitude is 32767 (rounded to nearest): the
// terms are the codes times the returned scale (max / 32767, NaN for a row
// holding a NaN), each within scale / 2.
inline float pack_row_int16(const c10::BFloat16* src, int64_t n, uint32_t* dst) {
  float m = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const float x = src[i];
    nan = nan || std::isnan(x);
    m = std::max(m, std::abs(x));
  }
  const float inv = m > 0.0f && std::isfinite(m) ? 32767.0f / m : 0.0f;
  const auto code = [&](int64_t i) {
    return i < n ? static_cast<uint16_t>(static_cast<int16_t>(std::lrint(float(src[i]) * inv))) : uint16_t(0);
  };
  for (int64_t p = 0; p < (n + 1) / 2; ++p) dst[p] = pair_word(code(2 * p), code(2 * p + 1));
  return nan ? std::numeric_limits<float>::quiet_NaN() : m / 32767.0f;
}

// 32 codes from src widened to 16-bit terms: int8 as int16 (Pairs::kInt16),
// float8 e4m3 as bfloat16 bits.
inline __m512i widen_codes(const int8_t* src) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}
inline __m512i widen_codes(const c10::Float8_e4m3fn* src) {
  return float8_bfloat16_bits(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}

// vpermt2w indices taking words first, first + 1, ... first + 15 of two
// vectors x0 and x1 as pair words (word k of x0 in the low half, of x1 in the high).
inline __m512i interleaved_words(int first) {
  alignas(64) static constexpr uint16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  return _mm512_add_epi16(_mm512_load_si512(kLow), _mm512_set1_epi16(static_cast<int16_t>(first)));
}

// int8 rows as bfloat16 pair words across the rows (pack_rows_across).
template <typename Row>
inline void pack_int8_rows_as_bfloat16(const Row& row, int64_t rows, int64_t n, uint32_t* dst, int64_t ldp) {
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = 0; p * 2 < rows; ++p) {
    const auto* r0 = row(2 * p);
    const auto* r1 = 2 * p + 1 < rows ? row(2 * p + 1) : nullptr;
    uint32_t* out = dst + p * ldp;
    int64_t c = 0;
    for (; c + 16 <= n; c += 16) {
      // the codes in float32 have zero low halves: their bfloat16 bits are the high halves
      const __m512i x0 = _mm512_castps_si512(codes_to_float(r0 + c));
      const __m512i x1 = r1 != nullptr ? _mm512_castps_si512(codes_to_float(r1 + c)) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + c, _mm512_or_si512(_mm512_srli_epi32(x0, 16), _mm512_and_si512(x1, high_half)));
    }
    for (; c < n; ++c) {
      out[c] = pair_word(code_bfloat16_bits(r0[c]), r1 != nullptr ? code_bfloat16_bits(r1[c]) : 0);
    }
    for (; c < ldp; ++c) out[c] = 0;
  }
}

// pack_rows_along for int8 or float8 rows, as bfloat16.
template <typename Code, typename = std::enable_if_t<kCodeRows<Code>>>
inline void pack_rows_along(const Code* src, int64_t stride, int64_t rows, int64_t n, uint32_t* dst,
                            int64_t ldp) {
  const int64_t np = (n + 1) / 2;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t c = 0; c < n; c += 32) {
      const int64_t words = std::min<int64_t>(16, np - c / 2);
      _mm512_mask_storeu_epi32(dst + i * ldp + c / 2, static_cast<__mmask16>((1u << words) - 1),
                               row_pair_words(src + i * stride, c, n));
    }
  }
}

// 32 terms of a row from term c on (n in all) as 16-bit words, zero past n:
// bfloat16 as stored, int8 codes as int16 (Pairs::kInt16), float8 codes as
// bfloat16 bits. Along a key they are its pair words.
template <Pairs kP, typename Code>
[[gnu::always_inline]] inline __m512i row_words(const Code* row, int64_t c, int64_t n) {
  if (c >= n) return _mm512_setzero_si512();
  if constexpr (kP == Pairs::kInt16) {
    return c + 32 <= n ? widen_codes(row + c) : int16_pair_words(row, c, n);
  } else if constexpr (std::is_same_v<Code, c10::BFloat16>) {
    return c + 32 <= n ? _mm512_loadu_si512(row + c) : row_pair_words(row, c, n);
  } else {
    static_assert(std::is_same_v<Code, c10::Float8_e4m3fn>, "int8 rows take Pairs::kInt16");
    return c + 32 <= n ? widen_codes(row + c) : row_pair_words(row, c, n);
  }
}

// Pair-word products (vdpbf16ps on bfloat16 words, vpdpwssd on int16 ones;
// scores_along_keys): A holds rows of pair words along the head dim (word
// i * lda + p: terms 2p, 2p + 1); keys are bfloat16 rows, or int8 / float8
// codes widened in registers (row_words).
template <Pairs kP>
struct KeyLanes : LaneFold<std::conditional_t<kP == Pairs::kInt16, __m512i, __m512>> {
  using Acc = std::conditional_t<kP == Pairs::kInt16, __m512i, __m512>;
  using A = uint32_t;
  static Acc dot(Acc c, __m512i a, __m512i b) {
    if constexpr (kP == Pairs::kInt16) {
      return _mm512_dpwssd_epi32(c, a, b);
    } else {
      return _mm512_dpbf16_ps(c, (__m512bh)a, (__m512bh)b);
    }
  }
  // One key's products with R rows of A: R vectors of 16 partial sums.
  template <int R, typename Code>
  [[gnu::always_inline]] static void products(const Code* key, int64_t n, const uint32_t* a, int64_t lda,
                                              Acc (&acc)[R]) {
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) acc[i] = Acc{};
    if (key == nullptr) return;
    const int64_t np = (n + 1) / 2;
    int64_t c = 0;
    for (; c + 32 <= n; c += 32) {
      const __m512i k = row_words<kP>(key, c, n);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) acc[i] = dot(acc[i], _mm512_loadu_si512(a + i * lda + c / 2), k);
    }
    if (c < n) {
      const __m512i k = row_words<kP>(key, c, n);
      const __mmask16 words = static_cast<__mmask16>((1u << (np - c / 2)) - 1);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) acc[i] = dot(acc[i], _mm512_maskz_loadu_epi32(words, a + i * lda + c / 2), k);
    }
  }
};

// B of the pair kernels as rows read as they lie (row(j): j < rows, n terms
// each): word (p, col) pairs term col of rows 2p and 2p + 1, interleaved in
// registers (one permute per 16 words) instead of packed in memory first.
template <Pairs kP, typename Row>
struct RowsB {
  const Row& row;
  int64_t rows, n;
  __m512i low, high;
  RowsB(const Row& row, int64_t rows, int64_t n) : row(row), rows(rows), n(n) {
    low = interleaved_words(0);
    high = interleaved_words(16);
  }
  template <int NV>
  [[gnu::always_inline]] void load(int64_t p, int64_t col, __m512i (&bv)[NV]) const {
    const auto* r0 = row(2 * p);
    const auto* r1 = 2 * p + 1 < rows ? row(2 * p + 1) : nullptr;
#pragma GCC unroll 4
    for (int v = 0; v < NV; v += 2) {
      const __m512i x0 = row_words<kP>(r0, col + 16 * v, n);
      const __m512i x1 = r1 != nullptr ? row_words<kP>(r1, col + 16 * v, n) : _mm512_setzero_si512();
      bv[v] = _mm512_permutex2var_epi16(x0, low, x1);
      if constexpr (NV > 1) bv[v + 1] = _mm512_permutex2var_epi16(x0, high, x1);
    }
  }
};

// Rows r, r + 1 interleaved: dst[p * ldp + c] = (row 2p, row 2p + 1) of
// column c as bfloat16, for p < ceil(rows / 2) and c < n (zero for c in
// [n, ldp) and for the missing row of an odd count; ldp a multiple of 16).
// row(i) gives row i's first element: bfloat16, or int8 / float8 codes.
template <typename Row>
inline void pack_rows_across(const Row& row, int64_t rows, int64_t n, uint32_t* dst, int64_t ldp) {
  if constexpr (kInt8Rows<decltype(row(0))>) {
    pack_int8_rows_as_bfloat16(row, rows, n, dst, ldp);
  } else {
    const RowsB<Pairs::kBf16, Row> b(row, rows, n);
    for (int64_t p = 0; p * 2 < rows; ++p) {
      uint32_t* out = dst + p * ldp;
      int64_t c = 0;
      for (; c + 32 <= ldp; c += 32) {
        __m512i bv[2];
        b.template load<2>(p, c, bv);
        _mm512_storeu_si512(out + c, bv[0]);
        _mm512_storeu_si512(out + c + 16, bv[1]);
      }
      if (c < ldp) {
        __m512i bv[1];
        b.template load<1>(p, c, bv);
        _mm512_storeu_si512(out + c, bv[0]);
      }
    }
  }
}

// A transposed float32 tile s[j * ld + col] (j < nk) rounded to bfloat16 and
// packed as column pairs along j: word (p, col) at out[p * ld + col] for
// p < ceil(nk / 2). out may be s itself: row p is written after rows 2p and
// 2p + 1 are read, and no later pair reads it.
inline uint32_t* pack_tile_pairs(const float* s, int64_t ld, int64_t nk, uint32_t* out) {
  for (int64_t p = 0; p * 2 < nk; ++p) {
    const float* r0 = s + 2 * p * ld;
    const float* r1 = 2 * p + 1 < nk ? r0 + ld : nullptr;
    for (int64_t c = 0; c < ld; c += 16) {
      const __m512 x0 = _mm512_loadu_ps(r0 + c);
      const __m512 x1 = r1 != nullptr ? _mm512_loadu_ps(r1 + c) : _mm512_setzero_ps();
      // One conversion of both rows: x0's 16 values in the low half, x1's high.
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
      const __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(both));
      const __m512i hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(both, 1));
      _mm512_storeu_si512(out + p * ld + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
  return out;
}

// pack_tile_pairs in int16: each column col of the tile scaled so that its
// largest magnitude is 32767 and rounded, its scale back (max / 32767; NaN
// for a column holding a NaN) in col_scale[col]. out may be s itself.
inline uint32_t* pack_tile_pairs_int16(const float* s, int64_t ld, int64_t nk, uint32_t* out, float* col_scale) {
  const __m512i low_half = _mm512_set1_epi32(0xFFFF);
  for (int64_t c = 0; c < ld; c += 16) {
    __m512 m = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t j = 0; j < nk; ++j) {
      const __m512 x = _mm512_loadu_ps(s + j * ld + c);
      nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      m = _mm512_max_ps(m, _mm512_abs_ps(x));
    }
    const __mmask16 usable = _mm512_cmp_ps_mask(m, _mm512_set1_ps(0.0f), _CMP_GT_OQ) &
                             _mm512_cmp_ps_mask(m, _mm512_set1_ps(INFINITY), _CMP_LT_OQ) & ~nan;
    const __m512 inv = _mm512_maskz_div_ps(usable, _mm512_set1_ps(32767.0f), m);
    _mm512_storeu_ps(col_scale + c, _mm512_mask_mov_ps(_mm512_mul_ps(m, _mm512_set1_ps(1.0f / 32767.0f)), nan,
                                                       _mm512_set1_ps(NAN)));
    // word p (row p) is written after rows 2p and 2p + 1 of these columns are read
    for (int64_t p = 0; p * 2 < nk; ++p) {
      const __m512i x0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(s + 2 * p * ld + c), inv));
      const __m512i x1 = 2 * p + 1 < nk ? _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(s + (2 * p + 1) * ld + c), inv))
                                        : _mm512_setzero_si512();
      _mm512_storeu_si512(out + p * ld + c, _mm512_or_si512(_mm512_and_si512(x0, low_half), _mm512_slli_epi32(x1, 16)));
    }
  }
  return out;
}

// Float16 on bfloat16 products (the AMX variant): x = hi + lo, hi the
// bfloat16 nearest x, lo the bfloat16 nearest x - hi (0 where x is
// infinite). For float16 x (11 significant bits) both are exact;
// |lo| <= 2^-8 |x|. A product x y is taken as hi_x hi_y + hi_x lo_y +
// lo_x hi_y, three exact bfloat16 products summed in float32: the term left
// out, lo_x lo_y, is at most 2^-16 |x y| (float16's own rounding is 2^-11).
// A float32 x (the probabilities) keeps 16 significant bits this way, within
// 2^-16 of x. bfloat16_part(x) is hi as float32, low_part(x) is x - hi.
inline __m512 bfloat16_part(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}
inline __m512 low_part(__m512 x) {
  const __mmask16 finite = static_cast<__mmask16>(~_mm512_fpclass_ps_mask(x, 0x18));  // not +-inf
  return _mm512_maskz_sub_ps(finite, x, bfloat16_part(x));
}

// A float32 tile s[j * ld + col] (j < nk, ld even) rounded to bfloat16 and
// packed in place as pair words along each row: word (j, p) at
// reinterpret_cast<uint32_t*>(s)[j * ld / 2 + p]. Row j's bfloat16 bytes lie
// in float32 rows <= j, already read. With low (not null), the words of the
// values' low parts (low_part) at low[j * ld / 2 + p] too.
inline uint32_t* pack_tile_rows_in_place(float* s, int64_t ld, int64_t nk, uint32_t* low = nullptr) {
  uint16_t* out = reinterpret_cast<uint16_t*>(s);
  uint16_t* out_low = reinterpret_cast<uint16_t*>(low);
  const auto store = [&](uint16_t* at, __m512i both, bool whole) {
    if (whole) {
      _mm512_storeu_si512(at, both);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(at), _mm512_castsi512_si256(both));
    }
  };
  for (int64_t j = 0; j < nk; ++j) {
    const float* r = s + j * ld;
    for (int64_t c = 0; c < ld; c += 32) {
      const bool whole = c + 16 < ld;
      const __m512 x0 = _mm512_loadu_ps(r + c);
      const __m512 x1 = whole ? _mm512_loadu_ps(r + c + 16) : _mm512_setzero_ps();
      if (low != nullptr) {
        store(out_low + j * ld + c, (__m512i)_mm512_cvtne2ps_pbh(low_part(x1), low_part(x0)), whole);
      }
      store(out + j * ld + c, (__m512i)_mm512_cvtne2ps_pbh(x1, x0), whole);
    }
  }
  return reinterpret_cast<uint32_t*>(s);
}
#endif  // __AVX512BF16__

}  // namespace flash
}  // namespace CPU_CAPABILITY
}  // namespace fusedllm::cpu
