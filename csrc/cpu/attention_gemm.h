// The register-blocked GEMM the attention kernels run their products on
// (attention_forward_kernel.cpp, attention_backward_kernel.cpp). Included only
// by files compiled once per instruction set: Vectorized<acc_t> takes its width
// from CPU_CAPABILITY.
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include "attention_tile.h"  // float8_half_bits
#include "fusedllm/kv_quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

namespace fusedllm::cpu {
inline namespace CPU_CAPABILITY {
namespace flash {

using at::vec::Vectorized;

// ---------------------------------------------------------------------------
// GEMM core: C (+)= A B on accumulator-type tiles.
//
// A(i, k) is a[i * lda + k] (row-major) or a[k * lda + i] (column-major, how
// the kernels read P and dS out of the transposed score tile); B is row-major
// with leading dimension ldb and N a multiple of the vector width (callers
// pad). The micro-kernel keeps an MR x (NV vectors) block of C in registers:
// per k it loads NV vectors of B and broadcasts MR values of A, for MR * NV
// fused multiply-adds.
//
// The K loop runs in chunks of kKC: each chunk sums from zero in registers
// and is then added to C (the previous chunks, or the rescaled old C). One
// sequential chain of fused multiply-adds over the whole K rounds every term
// at the size of the running sum: over a 256-wide head dim that made the
// scores, and through them outputs and gradients, 2-3x less accurate than
// SDPA's; starting from the old C did the same to dK/dV sums over many query
// tiles. Chunking costs an add per accumulator per kKC steps (with AVX-512's
// 32 registers; a load and store of the C block with fewer).
// ---------------------------------------------------------------------------

enum class ALayout { kRowMajor, kColMajor };

constexpr int kMR = 6;         // rows per micro-kernel
constexpr int kNV = 2;         // vectors of columns per micro-kernel
constexpr int64_t kKC = 32;    // terms summed in registers before they join C

// acc[i][v] += sum over k in [k0, k0 + n) of A(i, k) B(k, v), from zero
// (kN > 0: n is the constant kN, so the loop unrolls without a remainder).
template <typename acc_t, int MR, int NV, ALayout kA, int kN>
inline void chunk_sum(Vectorized<acc_t> (&acc)[MR][NV], int64_t k0, int64_t n,
                      const acc_t* __restrict a, int64_t lda, const acc_t* __restrict b,
                      int64_t ldb) {
  using V = Vectorized<acc_t>;
  constexpr int W = V::size();
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = V(acc_t(0));
  }
  const int64_t count = kN > 0 ? kN : n;
#pragma GCC unroll 4
  for (int64_t kk = 0; kk < count; ++kk) {
    const int64_t k = k0 + kk;
    V bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = V::loadu(b + k * ldb + v * W);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const V ai(kA == ALayout::kRowMajor ? a[i * lda + k] : a[k * lda + i]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = at::vec::fmadd(ai, bv[v], acc[i][v]);
    }
  }
}

// C[MR x NV*W] = (kLoadC ? diag(row_scale) C : 0) + A[MR x K] B[K x NV*W]
// (row_scale may be null: no rescale). The chunks' sums are added up in
// registers where the ISA has enough of them (AVX-512's 32), else in C.
template <typename acc_t, int MR, int NV, ALayout kA, bool kLoadC>
inline void micro_kernel(int64_t K, const acc_t* __restrict a, int64_t lda,
                         const acc_t* __restrict b, int64_t ldb, acc_t* __restrict c, int64_t ldc,
                         const acc_t* __restrict row_scale) {
  using V = Vectorized<acc_t>;
  constexpr int W = V::size();
  constexpr bool kTotalsInRegisters = W * sizeof(acc_t) == 64;
  V total[MR][NV], part[MR][NV];
  // First chunk (possibly short): from zero, plus the rescaled old C.
  const int64_t first = std::min(K, kKC);
  chunk_sum<acc_t, MR, NV, kA, 0>(total, 0, first, a, lda, b, ldb);
  if constexpr (kLoadC) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const V scale_i = row_scale != nullptr ? V(row_scale[i]) : V(acc_t(1));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        total[i][v] = at::vec::fmadd(V::loadu(c + i * ldc + v * W), scale_i, total[i][v]);
      }
    }
  }
  if (K > first) {
    if constexpr (!kTotalsInRegisters) {
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) total[i][v].store(c + i * ldc + v * W);
      }
    }
    for (int64_t k0 = first; k0 < K; k0 += kKC) {
      if (k0 + kKC <= K) {
        chunk_sum<acc_t, MR, NV, kA, kKC>(part, k0, kKC, a, lda, b, ldb);
      } else {
        chunk_sum<acc_t, MR, NV, kA, 0>(part, k0, K - k0, a, lda, b, ldb);
      }
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) {
          if constexpr (kTotalsInRegisters) {
            total[i][v] = total[i][v] + part[i][v];
          } else {
            (V::loadu(c + i * ldc + v * W) + part[i][v]).store(c + i * ldc + v * W);
          }
        }
      }
    }
    if constexpr (!kTotalsInRegisters) return;
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) total[i][v].store(c + i * ldc + v * W);
  }
}

// One column panel of NV vectors for all M rows.
template <typename acc_t, int NV, ALayout kA, bool kLoadC>
inline void gemm_panel(int64_t M, int64_t K, const acc_t* a, int64_t lda, const acc_t* b,
                       int64_t ldb, acc_t* c, int64_t ldc, const acc_t* row_scale) {
  const auto a_rows = [lda](const acc_t* base, int64_t i) {
    return kA == ALayout::kRowMajor ? base + i * lda : base + i;
  };
  int64_t i = 0;
  for (; i + kMR <= M; i += kMR) {
    micro_kernel<acc_t, kMR, NV, kA, kLoadC>(K, a_rows(a, i), lda, b, ldb, c + i * ldc, ldc,
                                             row_scale ? row_scale + i : nullptr);
  }
  const acc_t* ai = a_rows(a, i);
  acc_t* ci = c + i * ldc;
  const acc_t* si = row_scale ? row_scale + i : nullptr;
  switch (M - i) {
    case 1: micro_kernel<acc_t, 1, NV, kA, kLoadC>(K, ai, lda, b, ldb, ci, ldc, si); break;
    case 2: micro_kernel<acc_t, 2, NV, kA, kLoadC>(K, ai, lda, b, ldb, ci, ldc, si); break;
    case 3: micro_kernel<acc_t, 3, NV, kA, kLoadC>(K, ai, lda, b, ldb, ci, ldc, si); break;
    case 4: micro_kernel<acc_t, 4, NV, kA, kLoadC>(K, ai, lda, b, ldb, ci, ldc, si); break;
    case 5: micro_kernel<acc_t, 5, NV, kA, kLoadC>(K, ai, lda, b, ldb, ci, ldc, si); break;
    default: break;
  }
}

// C[M x N] = (kLoadC ? diag(row_scale) C : 0) + A[M x K] B[K x N], N a multiple of
// the vector width. Column panels outside, so each panel of B stays in L1
// while every row block of A streams past it.
template <typename acc_t, ALayout kA, bool kLoadC>
void gemm(int64_t M, int64_t N, int64_t K, const acc_t* a, int64_t lda, const acc_t* b,
          int64_t ldb, acc_t* c, int64_t ldc, const acc_t* row_scale = nullptr) {
  constexpr int64_t W = Vectorized<acc_t>::size();
  int64_t j = 0;
  for (; j + kNV * W <= N; j += kNV * W) {
    gemm_panel<acc_t, kNV, kA, kLoadC>(M, K, a, lda, b + j, ldb, c + j, ldc, row_scale);
  }
  for (; j < N; j += W) {
    gemm_panel<acc_t, 1, kA, kLoadC>(M, K, a, lda, b + j, ldb, c + j, ldc, row_scale);
  }
}

// out[c] = sum over k < K of x[k * ld + c] y[k * ld + c] for c < ld (a
// multiple of the vector width), summed as micro_kernel sums one element of
// A B (kKC terms at a time from zero, the chunks added in turn): equal rows
// give the value their product there has, to the bit.
template <typename acc_t>
void column_dots(int64_t K, const acc_t* x, const acc_t* y, int64_t ld, acc_t* out) {
  using V = Vectorized<acc_t>;
  for (int64_t c = 0; c < ld; c += V::size()) {
    V total(acc_t(0));
    for (int64_t k0 = 0; k0 < K; k0 += kKC) {
      V part(acc_t(0));
      for (int64_t k = k0; k < std::min(K, k0 + kKC); ++k) {
        part = at::vec::fmadd(V::loadu(x + k * ld + c), V::loadu(y + k * ld + c), part);
      }
      total = k0 == 0 ? part : total + part;
    }
    total.store(out + c);
  }
}

// Whether a T operand's products run on the pair kernels below in this variant.
template <typename T>
constexpr bool kPairProducts =
#if defined(__AVX512BF16__)
    std::is_same_v<T, c10::BFloat16>;
#else
    false;
#endif

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

#if defined(__AVX512BF16__)
// ---------------------------------------------------------------------------
// Pair products: C (+)= A B, two terms of the inner dimension per instruction.
//
// Operands are pair-packed: a uint32 word holds terms k = 2p (low half) and
// 2p + 1 (high half) of one row or column, zero where k runs past K. A's word
// (i, p) is a[i * lda + p] (kRowMajor) or a[p * lda + i] (kColMajor); B's
// word (p, n) is b[p * ldb + n], N a multiple of 16.
//
// Pairs::kBf16: bfloat16 terms on vdpbf16ps (AVX512-BF16), float32
// accumulators: each lane sums its K terms in float32 as the float32 kernel
// does. Pairs::kInt16: int16 terms on vpdpwssd (AVX512-VNNI), exact int32
// accumulators converted to float32 once, at the end. The sums must stay
// within int32: the callers multiply int8 codes by int16 values of at most
// 32767 over at most 256 head dims or one key tile (256 * 127 * 32767 < 2^31).
// ---------------------------------------------------------------------------

enum class Pairs { kBf16, kInt16 };

constexpr int kMRPairs = 6;  // rows per micro-kernel
constexpr int kNVPairs = 4;  // vectors of 16 columns per micro-kernel (24 accumulators)

// B operands of the pair kernels: load<NV>(p, col, bv) gives words (p, col +
// 16 v) .. (p, col + 16 v + 15) of B in bv[v].
struct PackedB {  // pair-packed in memory: word (p, n) at b[p * ldb + n]
  const uint32_t* b;
  int64_t ldb;
  template <int NV>
  void load(int64_t p, int64_t col, __m512i (&bv)[NV]) const {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = _mm512_loadu_si512(b + p * ldb + col + v * 16);
  }
};

// C[MR x NV*16] = out_scale * diag(a_scale) A B + (kLoadC ? diag(row_scale) C : 0),
// a null a_scale or row_scale meaning ones.
template <int MR, int NV, ALayout kA, bool kLoadC, Pairs kP, typename B>
inline void micro_kernel_pairs(int64_t KP, const uint32_t* __restrict a, int64_t lda, const B& b, int64_t col,
                               float* __restrict c, int64_t ldc, const float* __restrict row_scale,
                               float out_scale, const float* __restrict a_scale) {
  using Acc = std::conditional_t<kP == Pairs::kInt16, __m512i, __m512>;
  Acc acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = Acc{};
  }
#pragma GCC unroll 2
  for (int64_t p = 0; p < KP; ++p) {
    __m512i bv[NV];
    b.template load<NV>(p, col, bv);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512i ai = _mm512_set1_epi32(
          static_cast<int>(kA == ALayout::kRowMajor ? a[i * lda + p] : a[p * lda + i]));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        if constexpr (kP == Pairs::kInt16) {
          acc[i][v] = _mm512_dpwssd_epi32(acc[i][v], ai, bv[v]);
        } else {
          acc[i][v] = _mm512_dpbf16_ps(acc[i][v], (__m512bh)ai, (__m512bh)bv[v]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const __m512 rs = _mm512_set1_ps(row_scale != nullptr ? row_scale[i] : 1.0f);
    const __m512 os = _mm512_set1_ps(a_scale != nullptr ? out_scale * a_scale[i] : out_scale);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float* ci = c + i * ldc + v * 16;
      __m512 r;
      if constexpr (kP == Pairs::kInt16) {
        r = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[i][v]), os);
      } else {
        r = _mm512_mul_ps(acc[i][v], os);
      }
      if constexpr (kLoadC) r = _mm512_fmadd_ps(_mm512_loadu_ps(ci), rs, r);
      _mm512_storeu_ps(ci, r);
    }
  }
}

template <int NV, ALayout kA, bool kLoadC, Pairs kP, typename B>
inline void gemm_pairs_panel(int64_t M, int64_t KP, const uint32_t* a, int64_t lda, const B& b, int64_t col,
                             float* c, int64_t ldc, const float* row_scale, float out_scale, const float* a_scale) {
  const auto a_rows = [lda](const uint32_t* base, int64_t i) {
    return kA == ALayout::kRowMajor ? base + i * lda : base + i;
  };
  const auto rows_from = [](const float* v, int64_t i) { return v != nullptr ? v + i : nullptr; };
  int64_t i = 0;
  for (; i + kMRPairs <= M; i += kMRPairs) {
    micro_kernel_pairs<kMRPairs, NV, kA, kLoadC, kP>(KP, a_rows(a, i), lda, b, col, c + i * ldc, ldc,
                                                     rows_from(row_scale, i), out_scale, rows_from(a_scale, i));
  }
  const uint32_t* ai = a_rows(a, i);
  float* ci = c + i * ldc;
  const float* si = rows_from(row_scale, i);
  const float* ti = rows_from(a_scale, i);
  switch (M - i) {
    case 1: micro_kernel_pairs<1, NV, kA, kLoadC, kP>(KP, ai, lda, b, col, ci, ldc, si, out_scale, ti); break;
    case 2: micro_kernel_pairs<2, NV, kA, kLoadC, kP>(KP, ai, lda, b, col, ci, ldc, si, out_scale, ti); break;
    case 3: micro_kernel_pairs<3, NV, kA, kLoadC, kP>(KP, ai, lda, b, col, ci, ldc, si, out_scale, ti); break;
    case 4: micro_kernel_pairs<4, NV, kA, kLoadC, kP>(KP, ai, lda, b, col, ci, ldc, si, out_scale, ti); break;
    case 5: micro_kernel_pairs<5, NV, kA, kLoadC, kP>(KP, ai, lda, b, col, ci, ldc, si, out_scale, ti); break;
    default: break;
  }
}

// C[M x N] = out_scale * diag(a_scale) A B + (kLoadC ? diag(row_scale) C : 0)
// over KP pairs of the inner dimension; N a multiple of 16; B a PackedB (the
// pointer overload) or any source with its load<NV>.
template <ALayout kA, bool kLoadC, Pairs kP = Pairs::kBf16, typename B>
void gemm_pairs(int64_t M, int64_t N, int64_t KP, const uint32_t* a, int64_t lda, const B& b, float* c,
                int64_t ldc, const float* row_scale = nullptr, float out_scale = 1.0f,
                const float* a_scale = nullptr) {
  int64_t j = 0;
  for (; j + kNVPairs * 16 <= N; j += kNVPairs * 16) {
    gemm_pairs_panel<kNVPairs, kA, kLoadC, kP>(M, KP, a, lda, b, j, c + j, ldc, row_scale, out_scale, a_scale);
  }
  for (; j + 32 <= N; j += 32) {
    gemm_pairs_panel<2, kA, kLoadC, kP>(M, KP, a, lda, b, j, c + j, ldc, row_scale, out_scale, a_scale);
  }
  for (; j < N; j += 16) {
    gemm_pairs_panel<1, kA, kLoadC, kP>(M, KP, a, lda, b, j, c + j, ldc, row_scale, out_scale, a_scale);
  }
}
template <ALayout kA, bool kLoadC, Pairs kP = Pairs::kBf16>
void gemm_pairs(int64_t M, int64_t N, int64_t KP, const uint32_t* a, int64_t lda, const uint32_t* b,
                int64_t ldb, float* c, int64_t ldc, const float* row_scale = nullptr,
                float out_scale = 1.0f, const float* a_scale = nullptr) {
  gemm_pairs<kA, kLoadC, kP>(M, N, KP, a, lda, PackedB{b, ldb}, c, ldc, row_scale, out_scale, a_scale);
}

// column_dots over pair words (KP of them, word p of column c at
// x[p * ld + c], as pack_rows_transposed leaves them), summed as
// micro_kernel_pairs sums one element: one chain of vdpbf16ps from zero.
inline void column_dots_pairs(int64_t KP, const uint32_t* x, const uint32_t* y, int64_t ld, float* out) {
  for (int64_t c = 0; c < ld; c += 16) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t p = 0; p < KP; ++p) {
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x + p * ld + c),
                             (__m512bh)_mm512_loadu_si512(y + p * ld + c));
    }
    _mm512_storeu_ps(out + c, acc);
  }
}

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
  for (int64_t i = 0; i < rows; ++i) {
    const c10::BFloat16* r = row(i);
    for (int64_t p = 0; p < n / 2; ++p) {
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
// its mantissa up 4; the 8 subnormals (and zero) come from a table. Exact; a
// NaN code reads as 480, as float8_half_bits does.
inline __m512i float8_bfloat16_bits(__m256i codes) {
  alignas(64) static constexpr uint16_t kSubnormal[32] = {0x0000, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};
  const __m512i w = _mm512_cvtepu8_epi16(codes);
  const __m512i magnitude = _mm512_and_si512(w, _mm512_set1_epi16(0x7F));
  const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(magnitude, 4), _mm512_set1_epi16(120 << 7));
  const __mmask32 subnormal = _mm512_cmplt_epu16_mask(magnitude, _mm512_set1_epi16(8));
  const __m512i bits = _mm512_mask_permutexvar_epi16(normal, subnormal, magnitude, _mm512_load_si512(kSubnormal));
  return _mm512_or_si512(bits, _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8));
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

// A float32 tile s[j * ld + col] (j < nk, ld even) rounded to bfloat16 and
// packed in place as pair words along each row: word (j, p) at
// reinterpret_cast<uint32_t*>(s)[j * ld / 2 + p]. Row j's bfloat16 bytes lie
// in float32 rows <= j, already read.
inline uint32_t* pack_tile_rows_in_place(float* s, int64_t ld, int64_t nk) {
  uint16_t* out = reinterpret_cast<uint16_t*>(s);
  for (int64_t j = 0; j < nk; ++j) {
    const float* r = s + j * ld;
    for (int64_t c = 0; c < ld; c += 32) {
      const __m512 x0 = _mm512_loadu_ps(r + c);
      const __m512 x1 = c + 16 < ld ? _mm512_loadu_ps(r + c + 16) : _mm512_setzero_ps();
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
      if (c + 16 < ld) {
        _mm512_storeu_si512(out + j * ld + c, both);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j * ld + c), _mm512_castsi512_si256(both));
      }
    }
  }
  return reinterpret_cast<uint32_t*>(s);
}
#endif  // __AVX512BF16__

}  // namespace flash
}  // namespace CPU_CAPABILITY
}  // namespace fusedllm::cpu
