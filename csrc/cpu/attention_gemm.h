// The register-blocked float GEMM the attention kernels run their products
// on (attention_forward_kernel.cpp, attention_backward_kernel.cpp); the pair
// (bfloat16 / int16) products are in attention_pairs.h, the decoding tiles'
// keys-along-the-lanes scores in attention_lanes.h. Included only by files
// compiled once per instruction set: Vectorized<acc_t> takes its width from
// CPU_CAPABILITY.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "attention_tile.h"

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

}  // namespace flash
}  // namespace CPU_CAPABILITY
}  // namespace fusedllm::cpu
