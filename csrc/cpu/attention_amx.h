// Products on the AMX tiles (AMX-TILE, AMX-BF16) for the AMX variant's
// attention: the forward's prefill tiles' S^T = K Q^T and O += P V, the
// backward's five products, on tdpbf16ps, over the same pair words the
// AVX512_BF16 variant's vdpbf16ps kernels read (attention_pair_words.h),
// float32 accumulators. bfloat16 operands as they are; float16 ones as two
// bfloat16 parts each, three products of parts per product (split_row).
//
// A tile register holds 16 rows of 64 bytes: 16 pair words of A (a row's
// terms 2p, 2p + 1 in word p), 16 pair words of B per row (row p: column n's
// terms 2p, 2p + 1 in word n, the layout pack_rows_transposed and
// pack_rows_across leave), 16 float32 of C. tdpbf16ps adds A B over 32 terms
// to C: 16 x 16 x 32 multiply-adds per instruction, against 16 x 2 for
// vdpbf16ps. S^T's operands are the pair words as packed for vdpbf16ps; P V
// takes P's rows as A, so P is packed row-major (pack_tile_rows_amx, one
// 16 x 16 word transpose per 16 rows and 32 keys) and O stays rows x d.
//
// The caller runs configure_tiles() on the thread before the products (the
// tile configuration is per thread) and release_tiles() after them; the
// process must hold the tile data permission (dispatch.cpp asks for it
// before it chooses the AMX variant).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

#include <immintrin.h>

#include <array>
#include <cstdint>
#include <cstring>

#include <c10/util/Half.h>

#include "attention_lanes.h"  // transpose_16x16_words
#include "attention_pair_words.h"  // pack_rows_along

namespace fusedllm::cpu {
inline namespace CPU_CAPABILITY {
namespace flash {

struct alignas(64) TileConfig {
  uint8_t palette = 0, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Palette 1, every tile 16 rows of 64 bytes: C in tmm0-3 (2 x 2 blocks of
// 16 x 16), A in tmm4-5, B in tmm6-7. Returns the thread's configuration
// before (palette 0: none), for release_tiles.
inline TileConfig configure_tiles() {
  TileConfig before, cfg;
  _tile_storeconfig(&before);
  cfg.palette = 1;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  _tile_loadconfig(&cfg);
  return before;
}

// Puts back the configuration configure_tiles found (their data is zero):
// a library that configures the tiles once per thread and skips it while
// it believes them still configured (torch's cpublas brgemm keeps the last
// kernel per thread until brgemm_release) finds its own again.
inline void release_tiles(const TileConfig& before) {
  if (before.palette != 0) {
    _tile_loadconfig(&before);
  } else {
    _tile_release();
  }
}

// The operands of a product on the tiles: C (+)= sum over t < kTerms of
// a[t] b[t], every a[t] (b[t]) in the same layout. More than one term: the
// float16 products (split_row).
template <int kTerms>
using AmxOperands = std::array<const uint32_t*, kTerms>;

template <int kTerms>
inline AmxOperands<kTerms> offset_by(const AmxOperands<kTerms>& x, int64_t by) {
  AmxOperands<kTerms> out;
  for (int t = 0; t < kTerms; ++t) out[t] = x[t] + by;
  return out;
}

// C[MI*16 x NJ*16] (+)= sum_t A_t B_t over kp pair words (kp a multiple of
// 16): A_t's word (i, p) at a[t][i * lda + p], B_t's word (p, n) at
// b[t][p * ldb + n], C's float (i, n) at c[i * ldc + n].
template <int MI, int NJ, bool kLoadC, int kTerms>
inline void amx_block(int64_t kp, const AmxOperands<kTerms>& a, int64_t lda, const AmxOperands<kTerms>& b,
                      int64_t ldb, float* c, int64_t ldc) {
  const int64_t sa = lda * 4, sb = ldb * 4, sc = ldc * 4;
  if constexpr (kLoadC) {
    _tile_loadd(0, c, sc);
    if constexpr (NJ > 1) _tile_loadd(1, c + 16, sc);
    if constexpr (MI > 1) _tile_loadd(2, c + 16 * ldc, sc);
    if constexpr (MI > 1 && NJ > 1) _tile_loadd(3, c + 16 * ldc + 16, sc);
  } else {
    _tile_zero(0);
    if constexpr (NJ > 1) _tile_zero(1);
    if constexpr (MI > 1) _tile_zero(2);
    if constexpr (MI > 1 && NJ > 1) _tile_zero(3);
  }
  for (int64_t p = 0; p < kp; p += 16) {
#pragma GCC unroll 3
    for (int t = 0; t < kTerms; ++t) {
      _tile_loadd(4, a[t] + p, sa);
      _tile_loadd(6, b[t] + p * ldb, sb);
      if constexpr (NJ > 1) _tile_loadd(7, b[t] + p * ldb + 16, sb);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (NJ > 1) _tile_dpbf16ps(1, 4, 7);
      if constexpr (MI > 1) {
        _tile_loadd(5, a[t] + 16 * lda + p, sa);
        _tile_dpbf16ps(2, 5, 6);
        if constexpr (NJ > 1) _tile_dpbf16ps(3, 5, 7);
      }
    }
  }
  _tile_stored(0, c, sc);
  if constexpr (NJ > 1) _tile_stored(1, c + 16, sc);
  if constexpr (MI > 1) _tile_stored(2, c + 16 * ldc, sc);
  if constexpr (MI > 1 && NJ > 1) _tile_stored(3, c + 16 * ldc + 16, sc);
}

// C[m x n] (+)= sum_t A_t B_t (m, n and kp multiples of 16; layouts as
// amx_block's), in blocks of 32 x 32 and their edges.
template <bool kLoadC, int kTerms>
inline void gemm_amx(int64_t m, int64_t n, int64_t kp, const AmxOperands<kTerms>& a, int64_t lda,
                     const AmxOperands<kTerms>& b, int64_t ldb, float* c, int64_t ldc) {
  int64_t i = 0;
  for (; i + 32 <= m; i += 32) {
    const AmxOperands<kTerms> ai = offset_by<kTerms>(a, i * lda);
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) amx_block<2, 2, kLoadC, kTerms>(kp, ai, lda, offset_by<kTerms>(b, j), ldb, c + i * ldc + j, ldc);
    if (j < n) amx_block<2, 1, kLoadC, kTerms>(kp, ai, lda, offset_by<kTerms>(b, j), ldb, c + i * ldc + j, ldc);
  }
  if (i < m) {
    const AmxOperands<kTerms> ai = offset_by<kTerms>(a, i * lda);
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) amx_block<1, 2, kLoadC, kTerms>(kp, ai, lda, offset_by<kTerms>(b, j), ldb, c + i * ldc + j, ldc);
    if (j < n) amx_block<1, 1, kLoadC, kTerms>(kp, ai, lda, offset_by<kTerms>(b, j), ldb, c + i * ldc + j, ldc);
  }
}

// The one-term product C[m x n] (+)= A B.
template <bool kLoadC>
inline void gemm_amx(int64_t m, int64_t n, int64_t kp, const uint32_t* a, int64_t lda, const uint32_t* b,
                     int64_t ldb, float* c, int64_t ldc) {
  gemm_amx<kLoadC, 1>(m, n, kp, {a}, lda, {b}, ldb, c, ldc);
}

// The 16-bit words of a pair vector from two rows' bfloat16 halves: word w is
// the first row's value w / 2 (even w) or the second's (odd w).
alignas(64) inline constexpr int16_t kPairInterleave[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                           21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                           11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// Pair words p0 .. p0 + 15 of P's rows c .. c + 15, rounded to bfloat16 and
// stored row-major at out[(c + i) * ldo + p0 + q]: key j's 16 values (one
// per row) are value(j, j % 2) for j < nk; words past the keys, and the
// missing key of an odd nk, are zero. The words are pack_tile_pairs's, transposed.
template <typename Value>
inline void store_pair_rows_amx(Value&& value, int64_t nk, int64_t p0, int64_t c, uint32_t* out, int64_t ldo) {
  const __m512i interleave = _mm512_load_si512(kPairInterleave);
  __m512i r[16];
#pragma GCC unroll 16
  for (int q = 0; q < 16; ++q) {
    const int64_t j = 2 * (p0 + q);
    if (j >= nk) {
      r[q] = _mm512_setzero_si512();
      continue;
    }
    const __m512 x0 = value(j, 0);
    const __m512 x1 = j + 1 < nk ? value(j + 1, 1) : _mm512_setzero_ps();
    // x0's 16 values in the low half, x1's in the high, then paired per row
    r[q] = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(x1, x0));
  }
  transpose_16x16_words(r);
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + (c + i) * ldo + p0, r[i]);
}

// A transposed float32 tile s[j * ld + col] (j < nk, ld a multiple of 16)
// as P's row-major pair words, word (col, p) at out[col * ldo + p] for
// p < round_up(ceil(nk / 2), 16) <= ldo: the A operand of P V. kLow: the
// words of the values' low parts (low_part) instead.
template <bool kLow = false>
inline void pack_tile_rows_amx(const float* s, int64_t ld, int64_t nk, uint32_t* out, int64_t ldo) {
  const int64_t np16 = ((nk + 1) / 2 + 15) / 16 * 16;
  for (int64_t c = 0; c < ld; c += 16) {
    for (int64_t p0 = 0; p0 < np16; p0 += 16) {
      store_pair_rows_amx(
          [&](int64_t j, int) {
            const __m512 x = _mm512_loadu_ps(s + j * ld + c);
            if constexpr (kLow) {
              return low_part(x);
            } else {
              return x;
            }
          },
          nk, p0, c, out, ldo);
    }
  }
}

// A float16 row of n terms (a multiple of 16) as the bfloat16 rows hi and lo
// (low_part): as pair words along the row, each part of a row is its
// bfloat16 row.
inline void split_row(const c10::Half* src, int64_t n, c10::BFloat16* hi, c10::BFloat16* lo) {
  for (int64_t c = 0; c < n; c += 16) {
    const __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + c)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + c), (__m256i)_mm512_cvtneps_pbh(x));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + c), (__m256i)_mm512_cvtneps_pbh(low_part(x)));
  }
}

// split_row for rows row(0) .. row(count - 1), part rows n terms apart.
template <typename Row>
inline void split_rows(const Row& row, int64_t count, int64_t n, c10::BFloat16* hi, c10::BFloat16* lo) {
  for (int64_t i = 0; i < count; ++i) split_row(row(i), n, hi + i * n, lo + i * n);
}

// Float16 rows interleaved as pack_rows_across leaves bfloat16 ones, the
// high parts' words at hi[p * ldp + c], the low parts' at lo[p * ldp + c]
// (zero for c in [n, ldp) and for the missing row of an odd count; ldp a
// multiple of 16).
template <typename Row>
inline void pack_split_rows_across(const Row& row, int64_t rows, int64_t n, uint32_t* hi, uint32_t* lo,
                                   int64_t ldp) {
  const auto words = [](__m512 x0, __m512 x1) {  // (x0, x1) pairs, rounded to bfloat16
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
    const __m512i first = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(both));
    const __m512i second = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(both, 1));
    return _mm512_or_si512(first, _mm512_slli_epi32(second, 16));
  };
  for (int64_t p = 0; p * 2 < rows; ++p) {
    const c10::Half* r0 = row(2 * p);
    const c10::Half* r1 = 2 * p + 1 < rows ? row(2 * p + 1) : nullptr;
    for (int64_t c = 0; c < ldp; c += 16) {
      const __mmask16 live = static_cast<__mmask16>(c + 16 <= n ? 0xFFFF : c < n ? (1u << (n - c)) - 1 : 0);
      const __m512 x0 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, r0 + c));
      const __m512 x1 = r1 != nullptr ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, r1 + c)) : _mm512_setzero_ps();
      _mm512_storeu_si512(hi + p * ldp + c, words(x0, x1));
      _mm512_storeu_si512(lo + p * ldp + c, words(low_part(x0), low_part(x1)));
    }
  }
}

// C[round_up(nk, 16) x n] = A B, A's nk rows bfloat16 rows `stride` elements
// apart from `rows` (kp pair words each, as they lie: S^T = K Q^T and dP^T =
// V dO^T): read in place in whole 16-row blocks where the stride is even and
// the start 4-byte aligned, the rest packed into buf (nk x kp words). C's rows
// past nk come from stale rows of buf: never read as scores.
inline void rows_times_amx(const c10::BFloat16* rows, int64_t stride, int64_t nk, int64_t kp, const uint32_t* b,
                           int64_t n, float* c, uint32_t* buf) {
  const bool in_place = stride % 2 == 0 && reinterpret_cast<uintptr_t>(rows) % 4 == 0;
  const int64_t full = in_place ? nk / 16 * 16 : 0;
  if (full > 0) gemm_amx<false>(full, n, kp, reinterpret_cast<const uint32_t*>(rows), stride / 2, b, n, c, n);
  if (full < nk) {
    pack_rows_along(rows + full * stride, stride, nk - full, 2 * kp, buf, kp);
    gemm_amx<false>(round_up(nk - full, 16), n, kp, buf, kp, b, n, c + full * n, n);
  }
}

// Whether a key tile [j0, j0 + nk) reads its pair words across keys out of
// its whole sequence's, packed once: its pairs are the sequence's (j0 even)
// and its 16-word steps end with it (nk a multiple of 32).
inline bool tile_in_sequence_pairs(int64_t j0, int64_t nk) { return j0 % 2 == 0 && nk % 32 == 0; }

// out[i] = sum_t A_t's row i times B_t's column i for i < m (a multiple of
// 16): the diagonal of sum_t A_t B_t, each element summed as amx_block sums
// it (so equal to the same element of another product of the same rows and
// columns); scratch holds 256 floats.
template <int kTerms>
inline void diagonal_amx(int64_t m, int64_t kp, const AmxOperands<kTerms>& a, int64_t lda,
                         const AmxOperands<kTerms>& b, int64_t ldb, float* out, float* scratch) {
  for (int64_t i0 = 0; i0 < m; i0 += 16) {
    amx_block<1, 1, false, kTerms>(kp, offset_by<kTerms>(a, i0 * lda), lda, offset_by<kTerms>(b, i0), ldb, scratch, 16);
    for (int i = 0; i < 16; ++i) out[i0 + i] = scratch[i * 17];
  }
}

// C[nk x n] += sum_t A_t B_t with the A_t's rows past nk (up to the next
// multiple of 16) anything, even NaN: whole 16-row blocks accumulate in
// place, the last partial one in `edge` (16 x n floats) and is added from
// there, so no row of C past nk is read or written (another thread may own
// it).
template <int kTerms>
inline void accumulate_rows_amx(int64_t nk, int64_t n, int64_t kp, const AmxOperands<kTerms>& a, int64_t lda,
                                const AmxOperands<kTerms>& b, int64_t ldb, float* c, int64_t ldc, float* edge) {
  const int64_t full = nk / 16 * 16;
  if (full > 0) gemm_amx<true, kTerms>(full, n, kp, a, lda, b, ldb, c, ldc);
  if (full == nk) return;
  gemm_amx<false, kTerms>(16, n, kp, offset_by<kTerms>(a, full * lda), lda, b, ldb, edge, n);
  for (int64_t r = 0; r < nk - full; ++r) {
    float* row = c + (full + r) * ldc;
    for (int64_t x = 0; x < n; x += 16) {
      _mm512_storeu_ps(row + x, _mm512_add_ps(_mm512_loadu_ps(row + x), _mm512_loadu_ps(edge + r * n + x)));
    }
  }
}

// s[j * ld + col] *= scale for j < nk and col < ld (a multiple of 16).
inline void scale_tile(float* s, int64_t ld, int64_t nk, float scale) {
  const __m512 f = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < nk; ++j) {
    for (int64_t c = 0; c < ld; c += 16) _mm512_storeu_ps(s + j * ld + c, _mm512_mul_ps(_mm512_loadu_ps(s + j * ld + c), f));
  }
}

// Row i of o (n floats, n a multiple of 16, leading dimension ldo) times
// alpha[i], for i < rows (a multiple of 16). Rows whose alpha is 1 (their
// running max unchanged by the tile: most rows after the first tiles) are
// left as they are, which is exact.
inline void scale_rows_by(float* o, int64_t ldo, int64_t rows, int64_t n, const float* alpha) {
  for (int64_t i0 = 0; i0 < rows; i0 += 16) {
    uint32_t todo = _mm512_cmp_ps_mask(_mm512_loadu_ps(alpha + i0), _mm512_set1_ps(1.0f), _CMP_NEQ_UQ);
    while (todo != 0) {
      const int64_t i = i0 + __builtin_ctz(todo);
      todo &= todo - 1;
      const __m512 f = _mm512_set1_ps(alpha[i]);
      float* r = o + i * ldo;
      for (int64_t c = 0; c < n; c += 16) _mm512_storeu_ps(r + c, _mm512_mul_ps(_mm512_loadu_ps(r + c), f));
    }
  }
}

}  // namespace flash
}  // namespace CPU_CAPABILITY
}  // namespace fusedllm::cpu

#endif  // __AMX_TILE__ && __AMX_BF16__
