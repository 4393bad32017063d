// Grouped matrix products for mixture-of-experts: the rows of an [S, *] matrix
// are grouped by expert (group e owns rows offsets[e] .. offsets[e+1] - 1, with
// `offsets` on the device), and each group is multiplied by its own expert's
// weight (forward and input gradient), or each group's rows are reduced into
// its expert's weight gradient.
//
// The host never reads `offsets` (no device-to-host sync): the grid is sized for
// the worst case and every block finds its (group, tile) on the device. Row tile
// j of group e runs in the block of slot offsets[e] / kTile + e + j. A group of
// n rows has ceil(n / kTile) <= (offsets[e] % kTile + n) / kTile + 1 tiles, the
// distance from its first slot to the next group's, so the groups' slots are
// disjoint and increasing in e, ceil(S / kTile) + E slots cover them all, and a
// block finds its group by binary search over `offsets` (E is small: a few
// hundred at most). A block whose slot lies between two groups' tiles (at most
// one per group, e.g. an empty group's) exits at once.
//
// Two kernels share that tiling (64 x 64 output tiles):
// - bfloat16 / float16 on sm_80+, float16 on sm_75: tensor cores (mma.cuh:
//   m16n8k16 with float32 accumulators, on sm_75 two m16n8k8; ldmatrix,
//   cp.async), 4 warps of 32 x 32, K-steps of 32 staged
//   in shared memory, double-buffered. Ragged edges (rows past a group's end, N
//   or K not tile multiples) and operands cp.async cannot read (16-byte chunks
//   need aligned pointers and strides) are loaded element by element, zeros
//   past the edges.
// - float32 / float64, and bfloat16 below sm_80: a SIMT kernel, 256 threads
//   of 4 x 4 outputs, K-steps of 16 staged (converted to the accumulator type)
//   in shared memory.
// Both write each output once, rounded once from float32 (float64) sums (plus
// the group's bias row, where the row products have one); no atomics, so the
// result does not depend on scheduling.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>

#include "fusedllm/checks.h"
#include "fusedllm/moe.h"
#include "mma.cuh"
#include "primitives.cuh"

namespace fusedllm::cuda {

// The products (fusedllm/moe.h): kRowsTimesWeightT (forward: x @ W^T), kRowsTimesWeight
// (input gradient), kWeightGradient (zeros for an empty group).
using GroupedProduct = ::fusedllm::moe::GroupedProduct;

namespace grouped {

// Output tile: kTile x kTile for both kernels (so both share the row-tile slots).
constexpr int kTile = 64;
constexpr int kTcK = 32;  // tensor-core kernel: K-step
constexpr int kTcThreads = 128;
constexpr int kTcStages = 2;
constexpr int kSimtK = 16;  // SIMT kernel: K-step
constexpr int kSimtThreads = 256;
constexpr int kSimtStride = kTile + 1;  // padded rows of the transposed tiles

// Every product as C [M, N] = A [M, K] B [K, N]. An operand is stored either
// "K-contiguous" (rows of M or N, K along the row: a in the row products, b in
// the forward) or "MN-contiguous" (rows of K: b in the input gradient, both a
// and b in the weight gradient, where K is the group's rows).
template <GroupedProduct kKind>
constexpr bool kAIsKContiguous = kKind != GroupedProduct::kWeightGradient;
template <GroupedProduct kKind>
constexpr bool kBIsKContiguous = kKind == GroupedProduct::kRowsTimesWeightT;

template <typename T>
struct Args {
  const T* a;
  int64_t a_stride;  // a's row stride
  const T* b;
  int64_t b_expert_stride, b_stride;  // b_expert_stride unused by the weight gradient
  T* out;
  int64_t out_expert_stride, out_stride;  // out_expert_stride: the weight gradient's only
  const int64_t* offsets;                 // [experts + 1], contiguous
  int64_t rows, experts;                  // S, E
  int64_t m, n, k;  // the weight gradient's M and N; the row products' N and K (m unused)
  const T* bias;    // row products: [E, N] (row stride n) added to group e's rows, or null
  bool a_chunks, b_chunks;  // 16-byte copies possible (aligned pointer, strides multiples of 8)
};

// offsets[e] clamped to [0, rows], so that malformed offsets cannot send a
// block outside the operands.
__device__ __forceinline__ int64_t group_start(const int64_t* offsets, int64_t e, int64_t rows) {
  const int64_t v = offsets[e];
  return v < 0 ? 0 : (v > rows ? rows : v);
}

// The rows [begin, end) of the row tile in slot `slot` (see the file comment),
// and its group; false when the slot holds no tile.
__device__ __forceinline__ bool find_row_tile(const int64_t* offsets, int64_t experts, int64_t rows,
                                              int64_t slot, int64_t& group, int64_t& begin,
                                              int64_t& end) {
  // The last group whose first slot is at or before `slot`.
  int64_t lo = 0, hi = experts - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (group_start(offsets, mid, rows) / kTile + mid <= slot) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int64_t first = group_start(offsets, lo, rows);
  const int64_t last = group_start(offsets, lo + 1, rows);
  const int64_t tile = slot - (first / kTile + lo);
  begin = first + tile * kTile;
  if (tile < 0 || begin >= last) return false;
  group = lo;
  end = begin + kTile < last ? begin + kTile : last;
  return true;
}

// Where a block's operands start, and how far they extend: the block computes
// C[0 : m_valid, 0 : n_valid] (clipped to the tile) = A[0 : m_valid, 0 : k] B[0 : k, 0 : n_valid],
// A and B stored from a0 and b0 as described by kAIsKContiguous / kBIsKContiguous.
template <typename T>
struct Block {
  const T* a0;
  const T* b0;
  T* c0;
  const T* bias0;  // the tile's first column of its group's bias, or null
  int64_t m_valid, n_valid, k;
};

// The block's tile; false when the block has none (a slot past its group's tiles).
template <GroupedProduct kKind, typename T>
__device__ __forceinline__ bool locate(const Args<T>& p, Block<T>& blk) {
  if constexpr (kKind == GroupedProduct::kWeightGradient) {
    const int64_t e = blockIdx.z, m0 = static_cast<int64_t>(blockIdx.y) * kTile,
                  n0 = static_cast<int64_t>(blockIdx.x) * kTile;
    const int64_t first = group_start(p.offsets, e, p.rows);
    const int64_t last = group_start(p.offsets, e + 1, p.rows);
    blk.a0 = p.a + first * p.a_stride + m0;
    blk.b0 = p.b + first * p.b_stride + n0;
    blk.c0 = p.out + e * p.out_expert_stride + m0 * p.out_stride + n0;
    blk.bias0 = nullptr;
    blk.m_valid = p.m - m0;
    blk.n_valid = p.n - n0;
    blk.k = last > first ? last - first : 0;  // an empty group's tile is written as zeros
    return true;
  } else {
    int64_t e, begin, end;
    if (!find_row_tile(p.offsets, p.experts, p.rows, blockIdx.x, e, begin, end)) return false;
    const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kTile;
    blk.a0 = p.a + begin * p.a_stride;
    const T* b = p.b + e * p.b_expert_stride;
    blk.b0 = kKind == GroupedProduct::kRowsTimesWeightT ? b + n0 * p.b_stride : b + n0;
    blk.c0 = p.out + begin * p.out_stride + n0;
    blk.bias0 = p.bias != nullptr ? p.bias + e * p.n + n0 : nullptr;
    blk.m_valid = end - begin;
    blk.n_valid = p.n - n0;
    blk.k = p.k;
    return true;
  }
}

__device__ __forceinline__ int clip_to(int64_t v, int limit) {
  return v < 0 ? 0 : (v > limit ? limit : static_cast<int>(v));
}

// ---- Tensor-core kernel (bfloat16 / float16, sm_80+) ------------------------

// Shared-memory tile of one operand for one K-step: K-contiguous operands as
// [kTile][kTcK] rows, MN-contiguous ones as [kTcK][kTile] rows, padded by 16
// bytes so that the 8 rows an ldmatrix reads fall in distinct banks.
template <bool kKContiguous>
struct TcTile {
  static constexpr int kRows = kKContiguous ? kTile : kTcK;
  static constexpr int kCols = kKContiguous ? kTcK : kTile;
  static constexpr int kStride = kCols + 8;
  static constexpr int kSize = kRows * kStride;
};

// Stages a [kRows, kCols] tile of a row-major matrix (row stride `stride`,
// rows_valid x cols_valid of it inside the operand) into `s`, zeros outside:
// 16-byte cp.async chunks where the chunk is whole and `chunks` allows, element
// by element otherwise.
template <typename T, int kRows, int kCols, int kStride>
__device__ __forceinline__ void stage_tc_tile(T* s, const T* g, int64_t stride, int rows_valid,
                                              int cols_valid, bool chunks) {
  constexpr int kPerChunk = 16 / static_cast<int>(sizeof(T));
  constexpr int kChunksPerRow = kCols / kPerChunk;
  constexpr int kChunks = kRows * kChunksPerRow;
  if (chunks && rows_valid == kRows && cols_valid == kCols && kChunks % kTcThreads == 0) {
    // A whole tile (all but a group's edges): each thread's chunks unrolled,
    // no per-chunk tests (the general loop cost ~12 integer instructions a
    // chunk, most of a K-step's issue).
#pragma unroll
    for (int i = 0; i < kChunks / kTcThreads; ++i) {
      const int c = threadIdx.x + i * kTcThreads;
      const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * kPerChunk;
      mma::cp_async_16(s + r * kStride + col, g + r * stride + col);
    }
    return;
  }
  for (int c = threadIdx.x; c < kChunks; c += kTcThreads) {
    const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * kPerChunk;
    T* dst = s + r * kStride + col;
    if (chunks && r < rows_valid && col + kPerChunk <= cols_valid) {
      mma::cp_async_16(dst, g + r * stride + col);
    } else {
#pragma unroll
      for (int i = 0; i < kPerChunk; ++i) {
        dst[i] = (r < rows_valid && col + i < cols_valid) ? g[r * stride + col + i] : T(0.f);
      }
    }
  }
}

// Stages K-step [k0, k0 + kTcK) of an operand (see Block) into `s`.
template <bool kKContiguous, typename T>
__device__ __forceinline__ void stage_tc_operand(T* s, const T* x0, int64_t stride, int64_t mn_valid,
                                                 int64_t k, int64_t k0, bool chunks) {
  using Tile = TcTile<kKContiguous>;
  if constexpr (kKContiguous) {
    stage_tc_tile<T, Tile::kRows, Tile::kCols, Tile::kStride>(
        s, x0 + k0, stride, clip_to(mn_valid, kTile), clip_to(k - k0, kTcK), chunks);
  } else {
    stage_tc_tile<T, Tile::kRows, Tile::kCols, Tile::kStride>(
        s, x0 + k0 * stride, stride, clip_to(k - k0, kTcK), clip_to(mn_valid, kTile), chunks);
  }
}

template <typename T, GroupedProduct kKind>
__global__ void __launch_bounds__(kTcThreads) grouped_mm_tc_kernel(Args<T> p) {
  if constexpr (!mma::kProductFor<T>) {
    __trap();  // grouped_mm launches the SIMT kernel where T has no tensor-core product
  } else {
    constexpr bool kAK = kAIsKContiguous<kKind>, kBK = kBIsKContiguous<kKind>;
    using TileA = TcTile<kAK>;
    using TileB = TcTile<kBK>;
    Block<T> blk;
    if (!locate<kKind>(p, blk)) return;  // the whole block: its slot holds no tile
    T* sa = dynamic_shared<T>();               // [kTcStages][TileA::kSize]
    T* sb = sa + kTcStages * TileA::kSize;     // [kTcStages][TileB::kSize]

    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    const int wm = (warp % 2) * 32, wn = (warp / 2) * 32;  // this warp's 32 x 32 of the tile
    const int matrix = lane / 8, matrix_row = lane % 8;    // the 8x8 matrix this lane addresses
    mma::FragC acc[2][4];

    const int64_t steps = (blk.k + kTcK - 1) / kTcK;
    const auto stage = [&](int64_t step) {
      const int buffer = static_cast<int>(step % kTcStages);
      stage_tc_operand<kAK>(sa + buffer * TileA::kSize, blk.a0, p.a_stride, blk.m_valid, blk.k,
                            step * kTcK, p.a_chunks);
      stage_tc_operand<kBK>(sb + buffer * TileB::kSize, blk.b0, p.b_stride, blk.n_valid, blk.k,
                            step * kTcK, p.b_chunks);
      mma::cp_async_commit();
    };
    if (steps > 0) stage(0);
    for (int64_t step = 0; step < steps; ++step) {
      if (step + 1 < steps) {
        stage(step + 1);  // its buffer was last read before the previous step's closing barrier
        mma::cp_async_wait<1>();
      } else {
        mma::cp_async_wait<0>();
      }
      __syncthreads();
      const T* ta = sa + static_cast<int>(step % kTcStages) * TileA::kSize;
      const T* tb = sb + static_cast<int>(step % kTcStages) * TileB::kSize;
#pragma unroll
      for (int ks = 0; ks < kTcK; ks += 16) {
        mma::FragA fa[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int m = wm + i * 16;
          if constexpr (kAK) {
            mma::ldmatrix_x4<false>(
                fa[i].r, ta + (m + (matrix % 2) * 8 + matrix_row) * TileA::kStride + ks + (matrix / 2) * 8);
          } else {
            mma::ldmatrix_x4<true>(
                fa[i].r, ta + (ks + (matrix / 2) * 8 + matrix_row) * TileA::kStride + m + (matrix % 2) * 8);
          }
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int n = wn + j * 16;
          uint32_t r[4];  // two n-tiles of 8: {r[0], r[1]} and {r[2], r[3]}
          if constexpr (kBK) {
            mma::ldmatrix_x4<false>(
                r, tb + (n + (matrix / 2) * 8 + matrix_row) * TileB::kStride + ks + (matrix % 2) * 8);
          } else {
            mma::ldmatrix_x4<true>(
                r, tb + (ks + (matrix % 2) * 8 + matrix_row) * TileB::kStride + n + (matrix / 2) * 8);
          }
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            mma::mma_16816<T>(acc[i][2 * j], fa[i], mma::FragB{{r[0], r[1]}});
            mma::mma_16816<T>(acc[i][2 * j + 1], fa[i], mma::FragB{{r[2], r[3]}});
          }
        }
      }
      __syncthreads();  // every warp is done with this buffer before it is staged again
    }

    const int group = lane / 4, quad = lane % 4;
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const int col = wn + t * 8 + 2 * quad;
      // The bias of this lane's two columns, added to the float32 sums (rounded once).
      float bias[2] = {0.f, 0.f};
      if (blk.bias0 != nullptr) {
        if (col < blk.n_valid) bias[0] = static_cast<float>(blk.bias0[col]);
        if (col + 1 < blk.n_valid) bias[1] = static_cast<float>(blk.bias0[col + 1]);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // rows group and group + 8
          const int row = wm + i * 16 + group + half * 8;
          if (row >= blk.m_valid) continue;
          T* c = blk.c0 + row * p.out_stride + col;
          if (col < blk.n_valid) c[0] = T(acc[i][t].r[2 * half] + bias[0]);
          if (col + 1 < blk.n_valid) c[1] = T(acc[i][t].r[2 * half + 1] + bias[1]);
        }
      }
    }
  }
}

// ---- SIMT kernel (float32 / float64, and bfloat16 below sm_80) -------------

// Stages K-step [k0, k0 + kSimtK) of an operand (see Block) into `s` as
// [kSimtK][kSimtStride] rows of Acc (K-major, whatever the operand's layout),
// zeros outside the operand.
template <bool kKContiguous, typename Acc, typename T>
__device__ __forceinline__ void stage_simt_operand(Acc* s, const T* x0, int64_t stride,
                                                   int64_t mn_valid, int64_t k, int64_t k0) {
  const int mn_limit = clip_to(mn_valid, kTile), k_limit = clip_to(k - k0, kSimtK);
  for (int i = threadIdx.x; i < kTile * kSimtK; i += kSimtThreads) {
    // Consecutive threads along the operand's contiguous dimension.
    const int kk = kKContiguous ? i % kSimtK : i / kTile;
    const int mn = kKContiguous ? i / kSimtK : i % kTile;
    Acc v = Acc(0);
    if (mn < mn_limit && kk < k_limit) {
      v = static_cast<Acc>(kKContiguous ? x0[mn * stride + k0 + kk] : x0[(k0 + kk) * stride + mn]);
    }
    s[kk * kSimtStride + mn] = v;
  }
}

template <typename T, GroupedProduct kKind>
__global__ void __launch_bounds__(kSimtThreads) grouped_mm_simt_kernel(Args<T> p) {
  using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
  Block<T> blk;
  if (!locate<kKind>(p, blk)) return;
  Acc* sa = dynamic_shared<Acc>();       // [kSimtK][kSimtStride]
  Acc* sb = sa + kSimtK * kSimtStride;   // [kSimtK][kSimtStride]
  // Thread (ty, tx) owns rows ty + 16 i and columns tx + 16 j: a warp reads 16
  // consecutive columns of sb and broadcasts 2 rows of sa.
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  Acc acc[4][4] = {};
  for (int64_t k0 = 0; k0 < blk.k; k0 += kSimtK) {
    stage_simt_operand<kAIsKContiguous<kKind>>(sa, blk.a0, p.a_stride, blk.m_valid, blk.k, k0);
    stage_simt_operand<kBIsKContiguous<kKind>>(sb, blk.b0, p.b_stride, blk.n_valid, blk.k, k0);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kSimtK; ++kk) {
      Acc av[4], bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        av[i] = sa[kk * kSimtStride + ty + 16 * i];
        bv[i] = sb[kk * kSimtStride + tx + 16 * i];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += av[i] * bv[j];
      }
    }
    __syncthreads();  // all reads done before the next step's staging
  }
  Acc bias[4] = {};  // this thread's columns' bias, added to the sums (rounded once)
  if (blk.bias0 != nullptr) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (tx + 16 * j < blk.n_valid) bias[j] = static_cast<Acc>(blk.bias0[tx + 16 * j]);
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = ty + 16 * i;
    if (row >= blk.m_valid) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int col = tx + 16 * j;
      if (col < blk.n_valid) blk.c0[row * p.out_stride + col] = static_cast<T>(acc[i][j] + bias[j]);
    }
  }
}

// ---- Host side ----------------------------------------------------------------

// True when 16-byte copies of the operand are aligned: the pointer, and every
// stride that moves between rows or experts (in elements).
template <typename T>
inline bool chunks_aligned(const T* ptr, std::initializer_list<int64_t> strides) {
  constexpr int kPerChunk = 16 / static_cast<int>(sizeof(T));
  if (!pack_aligned<T, kPerChunk>(ptr)) return false;
  for (const int64_t s : strides) {
    if (s % kPerChunk != 0) return false;
  }
  return true;
}

template <typename T, GroupedProduct kKind>
void launch_grouped_mm(const Args<T>& p, bool tensor_cores, Stream stream) {
  const int64_t n_tiles = (p.n + kTile - 1) / kTile;
  dim3 grid;
  if constexpr (kKind == GroupedProduct::kWeightGradient) {
    const int64_t m_tiles = (p.m + kTile - 1) / kTile;
    TORCH_CHECK_VALUE(m_tiles <= 65535 && p.experts <= 65535 && n_tiles <= INT32_MAX,
                      "grouped_mm: a weight gradient of ", p.experts, " x ", p.m, " x ", p.n,
                      " is too large for one launch");
    grid = dim3(static_cast<unsigned>(n_tiles), static_cast<unsigned>(m_tiles),
                static_cast<unsigned>(p.experts));
  } else {
    const int64_t slots = (p.rows + kTile - 1) / kTile + p.experts;
    TORCH_CHECK_VALUE(n_tiles <= 65535 && slots <= INT32_MAX, "grouped_mm: ", p.rows, " rows of ",
                      p.n, " outputs over ", p.experts, " experts are too many for one launch");
    grid = dim3(static_cast<unsigned>(slots), static_cast<unsigned>(n_tiles));
  }
  if constexpr (mma::kIs16Bit<T>) {
    if (tensor_cores) {
      const size_t smem = kTcStages *
                          (TcTile<kAIsKContiguous<kKind>>::kSize + TcTile<kBIsKContiguous<kKind>>::kSize) *
                          sizeof(T);
      launch("grouped_mm_tc_kernel", grouped_mm_tc_kernel<T, kKind>, grid, kTcThreads, smem, stream, p);
      return;
    }
  }
  using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const size_t smem = 2 * kSimtK * kSimtStride * sizeof(Acc);
  launch("grouped_mm_simt_kernel", grouped_mm_simt_kernel<T, kKind>, grid, kSimtThreads, smem, stream, p);
}

// The sizes of a grouped product: S rows, E experts, and M, N and K as Args counts them.
struct ProductShape {
  int64_t rows, experts, m, n, k;
};

// a, offsets and b checked for the product `kind`, and its sizes.
inline ProductShape product_shape(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets,
                                  GroupedProduct kind) {
  const bool weight_gradient = kind == GroupedProduct::kWeightGradient;
  TORCH_CHECK_VALUE(a.dim() == 2, "grouped_mm: a must be 2-D [S, ", weight_gradient ? "M" : "K",
                    "], got ", a.sizes());
  TORCH_CHECK_VALUE(offsets.dim() == 1 && offsets.size(0) >= 1 && offsets.scalar_type() == at::kLong &&
                        offsets.is_contiguous(),
                    "grouped_mm: offsets must be a contiguous int64 [E + 1] tensor, got ",
                    dtype_name(offsets.scalar_type()), " ", offsets.sizes(), " with strides ", offsets.strides());
  const int64_t rows = a.size(0), experts = offsets.size(0) - 1;
  int64_t m = 0, n = 0, k = 0;
  switch (kind) {
    case GroupedProduct::kRowsTimesWeightT:
      k = a.size(1);
      TORCH_CHECK_VALUE(b.dim() == 3 && b.size(0) == experts && b.size(2) == k,
                        "grouped_mm: b must be [E, N, K] = [", experts, ", N, ", k,
                        "] (E from offsets [E + 1], K from a [S, K]), got ", b.sizes());
      n = b.size(1);
      break;
    case GroupedProduct::kRowsTimesWeight:
      k = a.size(1);
      TORCH_CHECK_VALUE(b.dim() == 3 && b.size(0) == experts && b.size(1) == k,
                        "grouped_mm: b must be [E, K, N] = [", experts, ", ", k,
                        ", N] (E from offsets [E + 1], K from a [S, K]), got ", b.sizes());
      n = b.size(2);
      break;
    case GroupedProduct::kWeightGradient:
      m = a.size(1);
      TORCH_CHECK_VALUE(b.dim() == 2 && b.size(0) == rows,
                        "grouped_mm: b must be [S, N] with S = ", rows, " (a's rows), got ", b.sizes());
      n = b.size(1);
      break;
  }
  return {rows, experts, m, n, k};
}

// out and bias checked against the product's sizes, and every operand's
// dtype, device and last-dimension stride.
inline void check_operands(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                           const at::Tensor& offsets, const at::Tensor& bias, GroupedProduct kind,
                           const ProductShape& s) {
  const bool weight_gradient = kind == GroupedProduct::kWeightGradient;
  if (weight_gradient) {
    TORCH_CHECK_VALUE(out.dim() == 3 && out.size(0) == s.experts && out.size(1) == s.m && out.size(2) == s.n,
                      "grouped_mm: out must be [E, M, N] = [", s.experts, ", ", s.m, ", ", s.n, "], got ",
                      out.sizes());
  } else {
    TORCH_CHECK_VALUE(out.dim() == 2 && out.size(0) == s.rows && out.size(1) == s.n,
                      "grouped_mm: out must be [S, N] = [", s.rows, ", ", s.n, "], got ", out.sizes());
  }
  if (bias.defined()) {
    TORCH_CHECK_VALUE(!weight_gradient, "grouped_mm: a bias is for the row products only");
    TORCH_CHECK_VALUE(bias.dim() == 2 && bias.size(0) == s.experts && bias.size(1) == s.n &&
                          bias.is_contiguous() && bias.scalar_type() == out.scalar_type() &&
                          bias.device() == out.device(),
                      "grouped_mm: bias must be a contiguous [E, N] = [", s.experts, ", ", s.n,
                      "] tensor of out's dtype and device, got ", dtype_name(bias.scalar_type()), " ",
                      bias.sizes(), " on ", bias.device());
  }
  TORCH_CHECK_VALUE(s.experts > 0 || s.rows == 0,
                    "grouped_mm: offsets has no groups (E = 0) but a has ", s.rows, " rows");
  const auto dtype = out.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 ||
                        dtype == at::kHalf,
                    "grouped_mm: out must be float32, float64, bfloat16 or float16, got ", dtype_name(dtype));
  TORCH_CHECK_VALUE(a.scalar_type() == dtype && b.scalar_type() == dtype,
                    "grouped_mm: a, b and out must have one dtype, got ", dtype_name(a.scalar_type()), ", ",
                    dtype_name(b.scalar_type()), " and ", dtype_name(dtype));
  TORCH_CHECK_VALUE(a.device() == out.device() && b.device() == out.device() &&
                        offsets.device() == out.device(),
                    "grouped_mm: out, a, b and offsets must be on one device, got ", out.device(), ", ",
                    a.device(), ", ", b.device(), " and ", offsets.device());
  // The list's type spelled out: nvcc 12.4 deduces none from {std::pair<...>{...}, {...}}.
  for (const auto& [name, t] :
       std::initializer_list<std::pair<const char*, const at::Tensor&>>{{"out", out}, {"a", a}, {"b", b}}) {
    TORCH_CHECK_VALUE(t.stride(-1) == 1 || t.size(-1) <= 1,
                      "grouped_mm: ", name, "'s last dimension must have unit stride, got strides ",
                      t.strides());
  }
}

// grouped_mm with the kernel choice exposed: tensor_cores = false runs the
// SIMT kernel for 16-bit types too (tests; a GPU without a product for the
// dtype does it anyway: below sm_75, and bfloat16 below sm_80).
inline void grouped_mm(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                       const at::Tensor& offsets, GroupedProduct kind, bool tensor_cores,
                       const at::Tensor& bias = at::Tensor()) {
  const bool weight_gradient = kind == GroupedProduct::kWeightGradient;
  const ProductShape s = product_shape(a, b, offsets, kind);
  check_operands(out, a, b, offsets, bias, kind, s);
  if (out.numel() == 0) return;

  const DeviceGuard guard(out.device());
  const Stream stream = current_stream();
  const auto& props = device_properties();
  const bool use_tensor_cores =
      tensor_cores && (props.major >= 8 || (props.major == 7 && props.minor >= 5 && out.scalar_type() == at::kHalf));
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    Args<T> p;
    p.a = a.const_data_ptr<T>();
    p.a_stride = a.stride(0);
    p.b = b.const_data_ptr<T>();
    p.b_expert_stride = weight_gradient ? 0 : b.stride(0);
    p.b_stride = weight_gradient ? b.stride(0) : b.stride(1);
    p.out = out.mutable_data_ptr<T>();
    p.out_expert_stride = weight_gradient ? out.stride(0) : 0;
    p.out_stride = weight_gradient ? out.stride(1) : out.stride(0);
    p.offsets = offsets.const_data_ptr<int64_t>();
    p.rows = s.rows;
    p.experts = s.experts;
    p.m = s.m;
    p.n = s.n;
    p.k = s.k;
    p.bias = bias.defined() ? bias.const_data_ptr<T>() : nullptr;
    p.a_chunks = chunks_aligned(p.a, {p.a_stride});
    p.b_chunks = chunks_aligned(p.b, {p.b_expert_stride, p.b_stride});
    switch (kind) {
      case GroupedProduct::kRowsTimesWeightT:
        launch_grouped_mm<T, GroupedProduct::kRowsTimesWeightT>(p, use_tensor_cores, stream);
        break;
      case GroupedProduct::kRowsTimesWeight:
        launch_grouped_mm<T, GroupedProduct::kRowsTimesWeight>(p, use_tensor_cores, stream);
        break;
      case GroupedProduct::kWeightGradient:
        launch_grouped_mm<T, GroupedProduct::kWeightGradient>(p, use_tensor_cores, stream);
        break;
    }
  };
  switch (out.scalar_type()) {
    case at::kFloat:
      run(float{});
      break;
    case at::kDouble:
      run(double{});
      break;
    case at::kBFloat16:
      run(c10::BFloat16{});
      break;
    default:
      run(c10::Half{});
      break;
  }
}

}  // namespace grouped

// out = the grouped product `kind` of a and b, grouped by `offsets` (see
// GroupedProduct). out, a, b: one dtype (float32, float64, bfloat16 or
// float16), one device, unit stride along the last dimension (other strides
// arbitrary); out is written, not accumulated into. offsets: int64 [E + 1] on
// the same device, offsets[0] = 0, nondecreasing, offsets[E] = S; never read by
// the host. bias (row products only): contiguous [E, N] or undefined, bias[e]
// added to the rows of group e. Sums in float32 (float64 for float64), bias
// included, rounded once; deterministic.
inline void grouped_mm(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                       const at::Tensor& offsets, GroupedProduct kind,
                       const at::Tensor& bias = at::Tensor()) {
  grouped::grouped_mm(out, a, b, offsets, kind, /*tensor_cores=*/true, bias);
}

}  // namespace fusedllm::cuda
