// Pair products for the attention kernels: C (+)= A B with two terms of the
// inner dimension per instruction (vdpbf16ps, vpdpwssd), on operands packed as
// pair words (attention_pair_words.h packs them).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "attention_gemm.h"  // ALayout

namespace fusedllm::cpu {
inline namespace CPU_CAPABILITY {
namespace flash {

// Whether a T operand's products run on the pair kernels in this variant.
template <typename T>
constexpr bool kPairProducts =
#if defined(__AVX512BF16__)
    std::is_same_v<T, c10::BFloat16>;
#else
    false;
#endif

// Whether a T operand's prefill products run on the AMX tiles in bfloat16
// high and low parts (split_row, attention_amx.h) in this variant: float16.
template <typename T>
constexpr bool kSplitProducts =
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    std::is_same_v<T, c10::Half>;
#else
    false;
#endif

// Whether a T operand's decoding tiles (at most kNarrowRows rows) score on
// float32 FMAs with the keys along the lanes (FloatKeyLanes, attention_lanes.h)
// in this variant: float32, and 16-bit operands without the pair kernels.
template <typename T>
constexpr bool kFloatKeyLanes =
#if defined(__AVX2__)
    !kPairProducts<T> && std::is_same_v<typename VecIO<T>::acc_t, float>;
#else
    false;
#endif

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
#endif  // __AVX512BF16__

}  // namespace flash
}  // namespace CPU_CAPABILITY
}  // namespace fusedllm::cpu
