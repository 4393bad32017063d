// Grouped matrix products for mixture-of-experts: the rows of an [S, *] matrix
// are grouped by expert (group e owns rows offsets[e] .. offsets[e+1] - 1, with
// `offsets` on the device), and each group is multiplied by its own expert's
// weight (forward and input gradient), or each group's rows are reduced into
// its expert's weight gradient.
//
// The host never reads `offsets` (no device-to-host sync): the grid is sized for
// the worst case and every block finds its (group, tile) on the device. With
// kTile the kernel's tile rows, row tile j of group e runs in the block of
// slot offsets[e] / kTile + e + j. A group of
// n rows has ceil(n / kTile) <= (offsets[e] % kTile + n) / kTile + 1 tiles, the
// distance from its first slot to the next group's, so the groups' slots are
// disjoint and increasing in e, ceil(S / kTile) + E slots cover them all, and a
// block finds its group by binary search over `offsets` (E is small: a few
// hundred at most). A block whose slot lies between two groups' tiles (at most
// one per group, e.g. an empty group's) exits at once.
//
// Three kernels:
// - bfloat16 / float16 on sm_90a, where the groups are large: wgmma (hopper.cuh)
//   on 128 x 256 output tiles, two warpgroups, K-steps of 64 staged by
//   cp.async into the swizzled layout wgmma reads, three stages.
// - bfloat16 / float16 on sm_80+, float16 on sm_75: tensor cores (mma.cuh:
//   m16n8k16 with float32 accumulators, on sm_75 two m16n8k8; ldmatrix,
//   cp.async), 4 warps, K-steps of 32 staged in shared memory: 128 x 128
//   output tiles of 64 x 64 a warp, three stages, where the groups are large;
//   64 x 64 tiles of 32 x 32 a warp, two stages, otherwise (TcShape). Ragged
//   edges (rows past a group's end, N or K not tile multiples) and operands
//   cp.async cannot read (16-byte chunks need aligned pointers and strides)
//   are loaded element by element, zeros past the edges.
// - float32 / float64, and bfloat16 below sm_80: a SIMT kernel, 8 x 8 outputs
//   a thread, K-steps of 8 staged (converted to the accumulator type) in
//   shared memory, double-buffered; 128 x 128 tiles as above in float32, 64 x
//   64 tiles otherwise.
// Both write each output once, rounded once from float32 (float64) sums (plus
// the group's bias row, where the row products have one); no atomics, so the
// result does not depend on scheduling.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>

#include "fusedllm/checks.h"
#include "fusedllm/moe.h"
#include "hopper.cuh"
#include "mma.cuh"
#include "primitives.cuh"

namespace fusedllm::cuda {

// The products (fusedllm/moe.h): kRowsTimesWeightT (forward: x @ W^T), kRowsTimesWeight
// (input gradient), kWeightGradient (zeros for an empty group).
using GroupedProduct = ::fusedllm::moe::GroupedProduct;

namespace grouped {

// Both kernels' output tiles are 64 x 64 or 128 x 128 (TcShape, SimtShape); a
// block's row-tile slots (see the file comment) count in its own tile's rows.
constexpr int kTcK = 32;  // tensor-core kernel: K-step
constexpr int kTcThreads = 128;
constexpr int kSimtK = 8;   // SIMT kernel: K-step

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
  bool out_pairs;           // two 16-bit outputs a 4-byte store (aligned pointer, even strides)
};

// offsets[e] clamped to [0, rows], so that malformed offsets cannot send a
// block outside the operands.
__device__ __forceinline__ int64_t group_start(const int64_t* offsets, int64_t e, int64_t rows) {
  const int64_t v = offsets[e];
  return v < 0 ? 0 : (v > rows ? rows : v);
}

// The rows [begin, end) of the row tile in slot `slot` (see the file comment),
// and its group; false when the slot holds no tile.
template <int kRowTile>
__device__ __forceinline__ bool find_row_tile(const int64_t* offsets, int64_t experts, int64_t rows,
                                              int64_t slot, int64_t& group, int64_t& begin,
                                              int64_t& end) {
  // The last group whose first slot is at or before `slot`.
  int64_t lo = 0, hi = experts - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (group_start(offsets, mid, rows) / kRowTile + mid <= slot) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int64_t first = group_start(offsets, lo, rows);
  const int64_t last = group_start(offsets, lo + 1, rows);
  const int64_t tile = slot - (first / kRowTile + lo);
  begin = first + tile * kRowTile;
  if (tile < 0 || begin >= last) return false;
  group = lo;
  end = begin + kRowTile < last ? begin + kRowTile : last;
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

// The block's kTileM x kTileN tile; false when the block has none (a slot
// past its group's tiles).
template <GroupedProduct kKind, int kTileM, int kTileN, typename T>
__device__ __forceinline__ bool locate(const Args<T>& p, Block<T>& blk) {
  if constexpr (kKind == GroupedProduct::kWeightGradient) {
    const int64_t e = blockIdx.z, m0 = static_cast<int64_t>(blockIdx.y) * kTileM,
                  n0 = static_cast<int64_t>(blockIdx.x) * kTileN;
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
    if (!find_row_tile<kTileM>(p.offsets, p.experts, p.rows, blockIdx.x, e, begin, end)) return false;
    const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kTileN;
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

// The bias of output columns col and col + 1 of the block's tile (zeros past
// its columns or without a bias), added to the float32 sums before they are
// rounded once.
struct Bias2 {
  float v[2] = {0.f, 0.f};
  template <typename T>
  __device__ __forceinline__ Bias2(const Block<T>& blk, int col) {
    if (blk.bias0 != nullptr) {
      if (col < blk.n_valid) v[0] = static_cast<float>(blk.bias0[col]);
      if (col + 1 < blk.n_valid) v[1] = static_cast<float>(blk.bias0[col + 1]);
    }
  }
};

// Outputs (row, col) and (row, col + 1) of the block's tile from float32
// sums; those outside the tile are not written.
template <typename T>
__device__ __forceinline__ void write_pair(const Args<T>& p, const Block<T>& blk, int row, int col, float lo,
                                           float hi) {
  if (row >= blk.m_valid) return;
  T* c = blk.c0 + row * p.out_stride + col;
  if (p.out_pairs && col + 1 < blk.n_valid) {
    store_pack<T, 2>(c, Pack<T, 2>{{T(lo), T(hi)}});
  } else {
    if (col < blk.n_valid) c[0] = T(lo);
    if (col + 1 < blk.n_valid) c[1] = T(hi);
  }
}

// ---- Tensor-core kernel (bfloat16 / float16, sm_80+; float16 on sm_75) ------

// A block of 4 warps in 2 x 2, each computing a kWarp x kWarp square of the
// block's output tile. kWarp = 64 (128 x 128 tiles, three stages): a K-step
// issues 64 mma a warp against 16 ldmatrix and 8 copies a thread. kWarp = 32
// (64 x 64 tiles, two stages) where groups are small or the large tiles would
// not fill the GPU (the host's choice: launch_grouped_mm).
template <int kWarp>
struct TcShape {
  static_assert(kWarp == 32 || kWarp == 64);
  static constexpr int kTile = 2 * kWarp;
  static constexpr int kStages = kWarp == 64 ? 3 : 2;
  // Blocks a multiprocessor should hold, which caps registers (at most 170
  // and 128 a thread): the large tiles' memory fits three on an H100 (one on
  // sm_75, whose 16-byte copies pass through registers: uncapped there), and
  // ptxas left alone gives the small ones 80 registers and a spill on sm_75.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  static constexpr int kMinBlocks = kWarp == 64 ? 1 : 4;
#else
  static constexpr int kMinBlocks = kWarp == 64 ? 3 : 4;
#endif
  static constexpr int kMFrags = kWarp / 16;  // m16 fragments a warp
  static constexpr int kNPairs = kWarp / 16;  // pairs of n8 fragments (one ldmatrix.x4 each)
};

// Shared-memory tile of one operand for one K-step of the mma.sync kernel:
// K-contiguous operands as [kTileMN][kTcK] rows, MN-contiguous ones as
// [kTcK][kTileMN] rows, padded by 16 bytes so that the 8 rows an ldmatrix
// reads fall in distinct banks. at(row, col): the element's offset;
// kRowPitch: the offset of a row from the one before (StagedOperand steps
// its passes by it).
template <bool kKContiguous_, int kTileMN>
struct TcTile {
  static constexpr bool kKContiguous = kKContiguous_;
  static constexpr int kMN = kTileMN, kK = kTcK;
  static constexpr int kRows = kKContiguous ? kTileMN : kTcK;
  static constexpr int kCols = kKContiguous ? kTcK : kTileMN;
  static constexpr int kStride = kCols + 8;
  static constexpr int kRowPitch = kStride;
  static constexpr int kSize = kRows * kStride;
  __device__ __forceinline__ static int at(int row, int col) { return row * kStride + col; }
};

// The same for the wgmma kernel (sm_90a): K-steps of 64 16-bit elements, in
// the 128-byte-swizzled layout wgmma reads. K-contiguous operands as
// [kTileMN][64] rows of 128 bytes; MN-contiguous ones as kTileMN / 64 boxes
// of [64][64] (64 K rows of 64 MN elements) side by side. In each 8-row group
// of 1024 bytes, 16-byte chunk c of row r lies at chunk c ^ (r % 8). Rows 8
// apart share the swizzle, so kRowPitch holds for the passes' multiples of 8.
template <bool kKContiguous_, int kTileMN>
struct SwizzledTile {
  static constexpr bool kKContiguous = kKContiguous_;
  static constexpr int kMN = kTileMN, kK = 64;
  static constexpr int kRows = kKContiguous ? kTileMN : kK;
  static constexpr int kCols = kKContiguous ? kK : kTileMN;
  static constexpr int kRowPitch = 64;
  static constexpr int kBox = kRows * 64;  // elements of a box of 64 columns
  static constexpr int kSize = kTileMN * kK;
  __device__ __forceinline__ static int at(int row, int col) {
    return (col / 64) * kBox + row * 64 + ((((col % 64) / 8) ^ (row % 8)) * 8) + col % 8;
  }
};

// One operand's K-steps staged into shared memory by the kThreads threads of
// the block, into a ring of tiles laid out as Tile (see Block for x0, stride,
// mn_valid and k). A whole tile (rows and columns inside the operand, 16-byte
// copies possible: all but a group's edges and the last K-step) takes each
// thread's kPasses 16-byte copies at addresses kept across steps, advanced by
// one K-step each; any other tile goes element by element where a chunk is
// cut, zeros outside the operand.
template <typename T, typename Tile, int kThreads>
struct StagedOperand {
  static constexpr int kPerChunk = 16 / static_cast<int>(sizeof(T));
  static constexpr int kChunksPerRow = Tile::kCols / kPerChunk;
  static constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  static constexpr int kPasses = Tile::kRows / kRowsPerPass;
  static_assert(kThreads % kChunksPerRow == 0 && Tile::kRows % kRowsPerPass == 0 && kRowsPerPass % 8 == 0);

  const T* x0;
  int64_t stride, mn_valid, k;
  bool chunks;     // 16-byte copies allowed (aligned pointer and strides)
  int whole_left;  // K-steps left to stage whole (every full one if the tile's rows or columns are)
  // Kept from step to step: rebuilt from the thread index and the shared base
  // each step, they were most of a K-step's integer instructions.
  const T* mine;   // this thread's first chunk at the next K-step
  int64_t k_step;  // elements between two K-steps' chunks
  T* s_write;      // this thread's first chunk in the stage the next K-step goes to
  int write;       // that stage

  __device__ __forceinline__ StagedOperand(T* s, const T* x0_, int64_t stride_, int64_t mn_valid_, int64_t k_,
                                           bool chunks_)
      : x0(x0_), stride(stride_), mn_valid(mn_valid_), k(k_), chunks(chunks_),
        whole_left(chunks_ && mn_valid_ >= Tile::kMN ? static_cast<int>(k_ / Tile::kK) : 0), write(0) {
    const int row = threadIdx.x / kChunksPerRow, col = (threadIdx.x % kChunksPerRow) * kPerChunk;
    mine = x0 + row * stride + col;
    k_step = Tile::kKContiguous ? Tile::kK : Tile::kK * stride;
    s_write = s + Tile::at(row, col);
  }

  // Stages K-step `step` into the next stage of s_write's ring of kStages;
  // steps are staged in order from 0.
  template <int kStages>
  __device__ __forceinline__ void stage(int step) {
    if (whole_left > 0) {
#pragma unroll
      for (int i = 0; i < kPasses; ++i) {
        mma::cp_async_16(s_write + i * kRowsPerPass * Tile::kRowPitch, mine + i * kRowsPerPass * stride);
      }
    } else {
      const int row = threadIdx.x / kChunksPerRow, col = (threadIdx.x % kChunksPerRow) * kPerChunk;
      T* s = s_write - Tile::at(row, col);  // the stage's tile
      const int64_t k0 = static_cast<int64_t>(step) * Tile::kK;
      const int mn = clip_to(mn_valid, Tile::kMN), kk = clip_to(k - k0, Tile::kK);
      if constexpr (Tile::kKContiguous) {
        stage_edges(s, x0 + k0, mn, kk);
      } else {
        stage_edges(s, x0 + k0 * stride, kk, mn);
      }
    }
    --whole_left;
    mine += k_step;
    if (++write == kStages) {
      write = 0;
      s_write -= (kStages - 1) * Tile::kSize;
    } else {
      s_write += Tile::kSize;
    }
  }

  // The tile at g (rows_valid x cols_valid of it inside the operand) into s.
  __device__ __forceinline__ void stage_edges(T* s, const T* g, int rows_valid, int cols_valid) const {
    for (int c = threadIdx.x; c < Tile::kRows * kChunksPerRow; c += kThreads) {
      const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * kPerChunk;
      T* dst = s + Tile::at(r, col);
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
};

template <typename T, GroupedProduct kKind, int kWarp>
__global__ void __launch_bounds__(kTcThreads, TcShape<kWarp>::kMinBlocks) grouped_mm_tc_kernel(Args<T> p) {
  if constexpr (!mma::kProductFor<T>) {
    __trap();  // grouped_mm launches the SIMT kernel where T has no tensor-core product
  } else {
    using Shape = TcShape<kWarp>;
    constexpr bool kAK = kAIsKContiguous<kKind>, kBK = kBIsKContiguous<kKind>;
    using TileA = TcTile<kAK, Shape::kTile>;
    using TileB = TcTile<kBK, Shape::kTile>;
    Block<T> blk;
    if (!locate<kKind, Shape::kTile, Shape::kTile>(p, blk)) return;  // the whole block: its slot holds no tile
    T* sa = dynamic_shared<T>();                 // [kStages][TileA::kSize]
    T* sb = sa + Shape::kStages * TileA::kSize;  // [kStages][TileB::kSize]
    StagedOperand<T, TileA, kTcThreads> a(sa, blk.a0, p.a_stride, blk.m_valid, blk.k, p.a_chunks);
    StagedOperand<T, TileB, kTcThreads> b(sb, blk.b0, p.b_stride, blk.n_valid, blk.k, p.b_chunks);

    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    const int wm = (warp % 2) * kWarp, wn = (warp / 2) * kWarp;  // this warp's square of the tile
    const int matrix = lane / 8, matrix_row = lane % 8;          // the 8x8 matrix this lane addresses
    // The row this lane passes to ldmatrix for the warp's first fragment at
    // k = 0, in the stage the next step lies in (kept step to step, as s_write).
    const T* ta = sa + (kAK ? (wm + (matrix % 2) * 8 + matrix_row) * TileA::kStride + (matrix / 2) * 8
                            : ((matrix / 2) * 8 + matrix_row) * TileA::kStride + wm + (matrix % 2) * 8);
    const T* tb = sb + (kBK ? (wn + (matrix / 2) * 8 + matrix_row) * TileB::kStride + (matrix % 2) * 8
                            : ((matrix % 2) * 8 + matrix_row) * TileB::kStride + wn + (matrix / 2) * 8);
    int read = 0;
    mma::FragC acc[Shape::kMFrags][2 * Shape::kNPairs];

    // K-steps fit an int (K past 2^36 would not fit in memory).
    const int steps = static_cast<int>((blk.k + kTcK - 1) / kTcK);
    int staged = 0;
    const auto stage_next = [&](bool any) {  // one commit group a step, empty past the last
      if (any) {
        a.template stage<Shape::kStages>(staged);
        b.template stage<Shape::kStages>(staged);
        ++staged;
      }
      mma::cp_async_commit();
    };
#pragma unroll
    for (int s = 0; s < Shape::kStages - 1; ++s) stage_next(s < steps);
    for (int left = steps; left > 0; --left) {
      mma::cp_async_wait<Shape::kStages - 2>();  // this thread's copies of this step have landed
      // Everyone's have; and every warp is done with the previous step's stage, staged next.
      __syncthreads();
      stage_next(left > Shape::kStages - 1);
#pragma unroll
      for (int ks = 0; ks < kTcK; ks += 16) {
        mma::FragA fa[Shape::kMFrags];
#pragma unroll
        for (int i = 0; i < Shape::kMFrags; ++i) {
          mma::ldmatrix_x4<!kAK>(fa[i].r, ta + (kAK ? i * 16 * TileA::kStride + ks : ks * TileA::kStride + i * 16));
        }
#pragma unroll
        for (int j = 0; j < Shape::kNPairs; ++j) {
          uint32_t r[4];  // two n-tiles of 8: {r[0], r[1]} and {r[2], r[3]}
          mma::ldmatrix_x4<!kBK>(r, tb + (kBK ? j * 16 * TileB::kStride + ks : ks * TileB::kStride + j * 16));
#pragma unroll
          for (int i = 0; i < Shape::kMFrags; ++i) {
            mma::mma_16816<T>(acc[i][2 * j], fa[i], mma::FragB{{r[0], r[1]}});
            mma::mma_16816<T>(acc[i][2 * j + 1], fa[i], mma::FragB{{r[2], r[3]}});
          }
        }
      }
      if (++read == Shape::kStages) {
        read = 0;
        ta -= (Shape::kStages - 1) * TileA::kSize;
        tb -= (Shape::kStages - 1) * TileB::kSize;
      } else {
        ta += TileA::kSize;
        tb += TileB::kSize;
      }
    }

    const int group = lane / 4, quad = lane % 4;
#pragma unroll
    for (int t = 0; t < 2 * Shape::kNPairs; ++t) {
      const int col = wn + t * 8 + 2 * quad;
      const Bias2 bias(blk, col);
#pragma unroll
      for (int i = 0; i < Shape::kMFrags; ++i) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // rows group and group + 8
          write_pair(p, blk, wm + i * 16 + group + half * 8, col, acc[i][t].r[2 * half] + bias.v[0],
                     acc[i][t].r[2 * half + 1] + bias.v[1]);
        }
      }
    }
  }
}

// ---- wgmma kernel (bfloat16 / float16 on sm_90a) ------------------------------

// 128 x 256 output tiles, 64 x 256 a warpgroup: a K-step of 64 is four wgmma
// m64n256k16 a warpgroup, each reading the warpgroup's 64 rows of A and all
// of B from shared memory, which the block's 256 threads fill by cp.async in
// the layout wgmma reads (SwizzledTile), three stages deep: 145 KiB, one block
// a multiprocessor. A block's operands per K-step are 48 KiB for 2 Mi
// multiply-adds: a quarter less from L2 a product than the mma.sync kernel's
// 128 x 128 tiles read.
struct WgShape {
  static constexpr int kTileM = 128, kTileN = 256;
  static constexpr int kThreads = 256;
  static constexpr int kStages = 3;
};

template <typename T>
constexpr size_t wgmma_shared_bytes() {
  return WgShape::kStages * (WgShape::kTileM + WgShape::kTileN) * 64 * sizeof(T) + 1024;  // + the alignment
}

// The wgmma descriptor of a swizzled tile at its first K sub-step of 16
// (K-contiguous tiles read K-major: 8-row groups 1024 bytes apart;
// MN-contiguous ones MN-major: boxes kBox apart, 8 K rows 1024 bytes apart),
// and the bytes from one sub-step to the next.
template <typename Tile>
__device__ __forceinline__ uint64_t swizzled_descriptor(const void* tile) {
  return hopper::make_descriptor(tile, hopper::Swizzle::k128B, Tile::kKContiguous ? 16 : Tile::kBox * 2, 1024);
}
template <typename Tile>
constexpr uint32_t kSubStepBytes = Tile::kKContiguous ? 16 * 2 : 16 * 128;

template <typename T, GroupedProduct kKind>
__global__ void __launch_bounds__(WgShape::kThreads, 1) grouped_mm_wgmma_kernel(Args<T> p) {
#if FUSEDLLM_HAS_SM90A || defined(FUSEDLLM_SIMT)
  if constexpr (!mma::kIs16Bit<T>) {
    __trap();  // grouped_mm launches it for 16-bit types only
  } else {
    constexpr bool kAK = kAIsKContiguous<kKind>, kBK = kBIsKContiguous<kKind>;
    constexpr auto kMajorA = kAK ? hopper::Major::kK : hopper::Major::kMN;
    constexpr auto kMajorB = kBK ? hopper::Major::kK : hopper::Major::kMN;
    constexpr int kStages = WgShape::kStages;
    using TileA = SwizzledTile<kAK, WgShape::kTileM>;
    using TileB = SwizzledTile<kBK, WgShape::kTileN>;
    Block<T> blk;
    if (!locate<kKind, WgShape::kTileM, WgShape::kTileN>(p, blk)) return;
    unsigned char* raw = dynamic_shared<unsigned char>();
    T* sa = reinterpret_cast<T*>(raw + (1024 - hopper::shared_address(raw) % 1024) % 1024);  // [kStages][TileA]
    T* sb = sa + kStages * TileA::kSize;                                                      // [kStages][TileB]
    StagedOperand<T, TileA, WgShape::kThreads> a(sa, blk.a0, p.a_stride, blk.m_valid, blk.k, p.a_chunks);
    StagedOperand<T, TileB, WgShape::kThreads> b(sb, blk.b0, p.b_stride, blk.n_valid, blk.k, p.b_chunks);
    // The warpgroup, uniform across each warp as the compiler can see (else it
    // serialises the wgmma of a branch it takes for divergent), and its rows of A.
    const int warpgroup = __shfl_sync(kFullMask, threadIdx.x / 128, 0);
    const uint64_t desc_a =
        swizzled_descriptor<TileA>(sa + (kAK ? TileA::at(64 * warpgroup, 0) : TileA::at(0, 64 * warpgroup)));
    const uint64_t desc_b = swizzled_descriptor<TileB>(sb);
    float acc[WgShape::kTileN / 2] = {};

    const int steps = static_cast<int>((blk.k + TileA::kK - 1) / TileA::kK);
    int staged = 0;
    const auto stage_next = [&](bool any) {  // one commit group a step, empty past the last
      if (any) {
        a.template stage<kStages>(staged);
        b.template stage<kStages>(staged);
        ++staged;
      }
      mma::cp_async_commit();
    };
    // Copies run kStages - 2 steps ahead of the products, which run one step
    // ahead of their wait: step t's stage takes step t + kStages's operands
    // during step t + kStages - 1, after the barrier every thread reaches past
    // its wait for step t's products.
    static_assert(kStages >= 3);
#pragma unroll
    for (int s = 0; s < kStages - 2; ++s) stage_next(s < steps);
    int read = 0;
    for (int left = steps; left > 0; --left) {
      mma::cp_async_wait<kStages - 3>();  // this thread's copies of this step have landed
      hopper::fence_proxy_async();        // where wgmma (the async proxy) sees them
      __syncthreads();                    // everyone's; and both warpgroups' products of two steps back are done
      stage_next(left > kStages - 2);
      hopper::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < TileA::kK / 16; ++ks) {
        hopper::wgmma<T, WgShape::kTileN, kMajorA, kMajorB>(
            acc, hopper::advance_descriptor(desc_a, read * TileA::kSize * 2 + ks * kSubStepBytes<TileA>),
            hopper::advance_descriptor(desc_b, read * TileB::kSize * 2 + ks * kSubStepBytes<TileB>), true);
      }
      hopper::wgmma_commit();
      hopper::wgmma_wait<1>();  // the previous step's products are done
      hopper::fence_operand(acc);
      read = read + 1 == kStages ? 0 : read + 1;
    }
    hopper::wgmma_wait<0>();
    hopper::fence_operand(acc);

    // hopper.cuh's accumulator layout: acc[4j + 2h + c] is row 16 w + g + 8 h, column 8 j + 2 q + c.
    const int lane = threadIdx.x % kWarpSize, warp = (threadIdx.x % 128) / kWarpSize;
    const int row = 64 * warpgroup + 16 * warp + lane / 4, quad = lane % 4;
#pragma unroll
    for (int j = 0; j < WgShape::kTileN / 8; ++j) {
      const int col = 8 * j + 2 * quad;
      const Bias2 bias(blk, col);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        write_pair(p, blk, row + 8 * h, col, acc[4 * j + 2 * h] + bias.v[0], acc[4 * j + 2 * h + 1] + bias.v[1]);
      }
    }
  }
#else
  __trap();  // sm_90a only: launched where its machine code exists (wgmma_serves)
#endif
}

// ---- SIMT kernel (float32 / float64, and 16-bit types without a product) ---

// A block of kSide x kSide threads, each computing 8 x 8 outputs of the
// block's kTile x kTile tile (kTile = 8 kSide: 128 for large groups, 64
// otherwise): rows 4 ty + {0..3} and kTile / 2 + 4 ty + {0..3}, columns
// likewise from tx, so that for each k a thread reads two 4-vectors of each
// staged operand (16-byte shared loads in float32) for 64 FMAs.
template <int kTileSide>
struct SimtShape {
  static_assert(kTileSide == 64 || kTileSide == 128);
  static constexpr int kTile = kTileSide;
  static constexpr int kSide = kTile / 8;
  static constexpr int kThreads = kSide * kSide;
  static constexpr int kStride = kTile + 4;  // padded rows: the transposed stores fall in distinct banks
  static constexpr int kSize = kSimtK * kStride;
};

// One operand's K-steps staged by the block as [kSimtK][kStride] rows of Acc
// (K-major, whatever the operand's layout), in two buffers. A whole step of a
// float32 / float64 operand (see StagedOperand) is read as 16-byte packs into
// registers before the previous step's products and stored after them; any
// other step element by element, zeros outside the operand.
template <typename T, typename Acc, bool kKContiguous, int kTile, int kThreads>
struct SimtOperand {
  using Shape = SimtShape<kTile>;
  static constexpr int kPer = 16 / static_cast<int>(sizeof(T));
  static constexpr bool kPacks = sizeof(T) >= 4;  // float32, float64 (Acc is T)
  static constexpr int kRows = kKContiguous ? kTile : kSimtK;  // the operand's rows in a step
  static constexpr int kCols = kKContiguous ? kSimtK : kTile;
  static constexpr int kChunksPerRow = kPacks ? kCols / kPer : 1;
  static constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  static constexpr int kPasses = kPacks ? kRows / kRowsPerPass : 1;
  static_assert(!kPacks || (kThreads % kChunksPerRow == 0 && kRows % kRowsPerPass == 0));

  const T* x0;
  int64_t stride, mn_valid, k;
  int whole_left;  // K-steps left to read as packs (every full one if the tile's rows or columns are)
  const T* mine;   // this thread's first pack at the next K-step
  int64_t k_step;  // elements between two K-steps' packs
  int s_mine;      // where that pack goes in a buffer (its first element)
  Pack<T, kPer> held[kPasses];

  __device__ __forceinline__ SimtOperand(const T* x0_, int64_t stride_, int64_t mn_valid_, int64_t k_,
                                         bool chunks)
      : x0(x0_), stride(stride_), mn_valid(mn_valid_), k(k_),
        whole_left(kPacks && chunks && mn_valid_ >= kTile ? static_cast<int>(k_ / kSimtK) : 0) {
    const int row = threadIdx.x / kChunksPerRow, col = (threadIdx.x % kChunksPerRow) * kPer;
    mine = x0 + row * stride + col;
    k_step = kKContiguous ? kSimtK : kSimtK * stride;
    s_mine = kKContiguous ? col * Shape::kStride + row : row * Shape::kStride + col;
  }

  // Whether the next step is read as packs (read, then put), else staged by `stage`.
  __device__ __forceinline__ bool packed() const { return whole_left > 0; }

  __device__ __forceinline__ void read() {
    if constexpr (kPacks) {
#pragma unroll
      for (int i = 0; i < kPasses; ++i) held[i] = load_pack<T, kPer>(mine + i * kRowsPerPass * stride);
    }
  }

  // The packs read into buffer s (K-contiguous operands transposed).
  __device__ __forceinline__ void put(Acc* s) {
    if constexpr (kPacks) {
#pragma unroll
      for (int i = 0; i < kPasses; ++i) {
        if constexpr (kKContiguous) {
#pragma unroll
          for (int j = 0; j < kPer; ++j) s[s_mine + j * Shape::kStride + i * kRowsPerPass] = held[i].v[j];
        } else {
          store_pack<Acc, kPer>(s + s_mine + i * kRowsPerPass * Shape::kStride, held[i]);
        }
      }
    }
    next();
  }

  // K-step `step` into buffer s, element by element.
  __device__ __forceinline__ void stage(Acc* s, int step) {
    const int64_t k0 = static_cast<int64_t>(step) * kSimtK;
    const int mn_limit = clip_to(mn_valid, kTile), k_limit = clip_to(k - k0, kSimtK);
    for (int i = threadIdx.x; i < kTile * kSimtK; i += kThreads) {
      // Consecutive threads along the operand's contiguous dimension.
      const int kk = kKContiguous ? i % kSimtK : i / kTile;
      const int mn = kKContiguous ? i / kSimtK : i % kTile;
      Acc v = Acc(0);
      if (mn < mn_limit && kk < k_limit) {
        v = static_cast<Acc>(kKContiguous ? x0[mn * stride + k0 + kk] : x0[(k0 + kk) * stride + mn]);
      }
      s[kk * Shape::kStride + mn] = v;
    }
    next();
  }

  __device__ __forceinline__ void next() {
    --whole_left;
    mine += k_step;
  }
};

// Four consecutive values of a staged row (16-byte aligned: kStride and the
// offsets are multiples of 4).
template <typename Acc>
__device__ __forceinline__ void load4(const Acc* s, Acc (&v)[8], int at) {
  if constexpr (sizeof(Acc) == 4) {
    const Pack<Acc, 4> q = load_pack<Acc, 4>(s);
#pragma unroll
    for (int i = 0; i < 4; ++i) v[at + i] = q.v[i];
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const Pack<Acc, 2> q = load_pack<Acc, 2>(s + 2 * h);
      v[at + 2 * h] = q.v[0];
      v[at + 2 * h + 1] = q.v[1];
    }
  }
}

template <typename T, GroupedProduct kKind, int kTileSide>
__global__ void __launch_bounds__(SimtShape<kTileSide>::kThreads) grouped_mm_simt_kernel(Args<T> p) {
  using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
  using Shape = SimtShape<kTileSide>;
  constexpr int kTile = Shape::kTile, kHalf = kTile / 2;
  Block<T> blk;
  if (!locate<kKind, kTile, kTile>(p, blk)) return;
  Acc* sa = dynamic_shared<Acc>();   // [2][kSimtK][kStride]
  Acc* sb = sa + 2 * Shape::kSize;   // [2][kSimtK][kStride]
  SimtOperand<T, Acc, kAIsKContiguous<kKind>, kTile, Shape::kThreads> a(blk.a0, p.a_stride, blk.m_valid,
                                                                         blk.k, p.a_chunks);
  SimtOperand<T, Acc, kBIsKContiguous<kKind>, kTile, Shape::kThreads> b(blk.b0, p.b_stride, blk.n_valid,
                                                                         blk.k, p.b_chunks);
  const int tx = threadIdx.x % Shape::kSide, ty = threadIdx.x / Shape::kSide;
  Acc acc[8][8] = {};

  // K-steps fit an int (K past 2^34 would not fit in memory).
  const int steps = static_cast<int>((blk.k + kSimtK - 1) / kSimtK);
  const auto stage = [&](auto& x, Acc* s, int step) {
    if (x.packed()) {
      x.read();
      x.put(s);
    } else {
      x.stage(s, step);
    }
  };
  if (steps > 0) {
    stage(a, sa, 0);
    stage(b, sb, 0);
  }
  __syncthreads();
  for (int step = 0; step < steps; ++step) {
    const int buffer = step % 2;
    const bool more = step + 1 < steps;
    // The next step's packs are read before this step's products and
    // stored after them, into the other buffer.
    const bool a_packs = more && a.packed(), b_packs = more && b.packed();
    if (a_packs) a.read();
    if (b_packs) b.read();
    const Acc* ta = sa + buffer * Shape::kSize + 4 * ty;
    const Acc* tb = sb + buffer * Shape::kSize + 4 * tx;
#pragma unroll
    for (int kk = 0; kk < kSimtK; ++kk) {
      Acc av[8], bv[8];
      load4(ta + kk * Shape::kStride, av, 0);
      load4(ta + kk * Shape::kStride + kHalf, av, 4);
      load4(tb + kk * Shape::kStride, bv, 0);
      load4(tb + kk * Shape::kStride + kHalf, bv, 4);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] += av[i] * bv[j];
      }
    }
    if (more) {
      // The other buffer was last read before the previous step's barrier.
      Acc* na = sa + (1 - buffer) * Shape::kSize;
      Acc* nb = sb + (1 - buffer) * Shape::kSize;
      if (a_packs) {
        a.put(na);
      } else {
        a.stage(na, step + 1);
      }
      if (b_packs) {
        b.put(nb);
      } else {
        b.stage(nb, step + 1);
      }
    }
    __syncthreads();
  }

  const auto at = [&](int i, int t) { return i < 4 ? 4 * t + i : kHalf + 4 * t + i - 4; };
  Acc bias[8] = {};  // this thread's columns' bias, added to the sums (rounded once)
  if (blk.bias0 != nullptr) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (at(j, tx) < blk.n_valid) bias[j] = static_cast<Acc>(blk.bias0[at(j, tx)]);
    }
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int row = at(i, ty);
    if (row >= blk.m_valid) continue;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int col = at(j, tx);
      if (col < blk.n_valid) blk.c0[row * p.out_stride + col] = static_cast<T>(acc[i][j] + bias[j]);
    }
  }
}

// ---- Host side ----------------------------------------------------------------

// True when accesses of kElems elements at a time are aligned: the pointer,
// and every stride that moves between rows or experts (in elements).
template <int kElems, typename T>
inline bool aligned_for(const T* ptr, std::initializer_list<int64_t> strides) {
  if (!pack_aligned<T, kElems>(ptr)) return false;
  for (const int64_t s : strides) {
    if (s % kElems != 0) return false;
  }
  return true;
}

// The grid of a product's output tiles (tile_m x tile_n): for the row
// products, the row-tile slots (see the file comment) by column tiles; for
// the weight gradient, column tiles by row tiles by experts.
template <GroupedProduct kKind, typename T>
dim3 grid_for(const Args<T>& p, int tile_m, int tile_n) {
  const int64_t n_tiles = (p.n + tile_n - 1) / tile_n;
  if constexpr (kKind == GroupedProduct::kWeightGradient) {
    const int64_t m_tiles = (p.m + tile_m - 1) / tile_m;
    TORCH_CHECK_VALUE(m_tiles <= 65535 && p.experts <= 65535 && n_tiles <= INT32_MAX,
                      "grouped_mm: a weight gradient of ", p.experts, " x ", p.m, " x ", p.n,
                      " is too large for one launch");
    return dim3(static_cast<unsigned>(n_tiles), static_cast<unsigned>(m_tiles), static_cast<unsigned>(p.experts));
  } else {
    const int64_t slots = (p.rows + tile_m - 1) / tile_m + p.experts;
    TORCH_CHECK_VALUE(n_tiles <= 65535 && slots <= INT32_MAX, "grouped_mm: ", p.rows, " rows of ", p.n,
                      " outputs over ", p.experts, " experts are too many for one launch");
    return dim3(static_cast<unsigned>(slots), static_cast<unsigned>(n_tiles));
  }
}

template <typename T, GroupedProduct kKind, int kWarp>
size_t tc_shared_bytes() {
  using Shape = TcShape<kWarp>;
  return Shape::kStages *
         (TcTile<kAIsKContiguous<kKind>, Shape::kTile>::kSize + TcTile<kBIsKContiguous<kKind>, Shape::kTile>::kSize) *
         sizeof(T);
}

template <typename T, GroupedProduct kKind, int kWarp>
void launch_tc(const Args<T>& p, Stream stream) {
  const size_t smem = tc_shared_bytes<T, kKind, kWarp>();
  const auto kernel = grouped_mm_tc_kernel<T, kKind, kWarp>;
  if (smem > 48 * 1024) allow_dynamic_shared_memory(kernel, smem);
  // The name says the tile, so that the emulator's launch counts show which ran.
  launch(kWarp == 64 ? "grouped_mm_tc_kernel 128" : "grouped_mm_tc_kernel 64", kernel,
         grid_for<kKind>(p, TcShape<kWarp>::kTile, TcShape<kWarp>::kTile), kTcThreads, smem, stream, p);
}

template <typename T, GroupedProduct kKind>
void launch_wgmma(const Args<T>& p, Stream stream) {
  constexpr size_t smem = wgmma_shared_bytes<T>();
  const auto kernel = grouped_mm_wgmma_kernel<T, kKind>;
  allow_dynamic_shared_memory(kernel, smem);
  launch("grouped_mm_wgmma_kernel 128x256", kernel, grid_for<kKind>(p, WgShape::kTileM, WgShape::kTileN),
         WgShape::kThreads, smem, stream, p);
}

template <typename T, GroupedProduct kKind, int kTileSide>
void launch_simt(const Args<T>& p, Stream stream) {
  using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
  using Shape = SimtShape<kTileSide>;
  launch(kTileSide == 128 ? "grouped_mm_simt_kernel 128" : "grouped_mm_simt_kernel 64",
         grouped_mm_simt_kernel<T, kKind, kTileSide>, grid_for<kKind>(p, kTileSide, kTileSide),
         Shape::kThreads, 4 * Shape::kSize * sizeof(Acc), stream, p);
}

// Whether 128 x 128 tiles serve the product: the groups average 128 rows or
// more (the row products; the weight gradient reduces over them) and those
// tiles give every multiprocessor a block. Otherwise 64 x 64 tiles, which
// leave less of a small group's tile empty and fill more of the GPU.
template <GroupedProduct kKind, typename T>
bool large_tiles(const Args<T>& p) {
  constexpr int64_t kLarge = 128;
  const int64_t n_tiles = (p.n + kLarge - 1) / kLarge;
  int64_t tiles = 0;
  if constexpr (kKind == GroupedProduct::kWeightGradient) {
    tiles = p.experts * ((p.m + kLarge - 1) / kLarge) * n_tiles;
  } else {
    if (p.rows < kLarge * p.experts) return false;
    tiles = p.rows / kLarge * n_tiles;
  }
  return tiles >= device_properties().multiProcessorCount;
}

// FUSEDLLM_CUDA_GROUPED_MM: "wgmma" runs the 16-bit products' large tiles on
// the wgmma kernel, on an sm_90 GPU with this build's sm_90a machine code and
// on the emulator; unset, "auto" or "mma", on the mma.sync kernel everywhere
// (the wgmma kernel has not yet been timed on a GPU).
enum class GroupedRequest { kAuto, kMma, kWgmma };
inline GroupedRequest grouped_request() {
  const char* value = std::getenv("FUSEDLLM_CUDA_GROUPED_MM");
  if (value == nullptr || *value == '\0' || std::string(value) == "auto") return GroupedRequest::kAuto;
  if (std::string(value) == "mma") return GroupedRequest::kMma;
  TORCH_CHECK_VALUE(std::string(value) == "wgmma", "FUSEDLLM_CUDA_GROUPED_MM must be 'auto', 'mma' or 'wgmma', got '",
                    value, "'");
  return GroupedRequest::kWgmma;
}

// Whether the wgmma kernel serves this device's large tiles.
template <typename T>
bool wgmma_serves() {
  const GroupedRequest request = grouped_request();
  const auto& props = device_properties();
  const bool fits = wgmma_shared_bytes<T>() <= props.sharedMemPerBlockOptin;
#if defined(FUSEDLLM_SIMT)
  return request == GroupedRequest::kWgmma && props.major >= 8 && fits;
#elif defined(FUSEDLLM_SM90A_IMAGE)
  return request == GroupedRequest::kWgmma && props.major == 9 && props.minor == 0 && fits;
#else
  (void)request, (void)fits;
  return false;
#endif
}

// Which kernel grouped_mm runs: tensor cores where the GPU has a product for
// the dtype, else SIMT (128 x 128 tiles in float32 only, to keep the build's
// instantiations few); `tile` 64 or 128, or 0 for large_tiles' choice (the
// tensor cores' large tiles also need a multiprocessor to hold two of their
// blocks: their memory within what one block may opt in to, an A100's or
// H100's, not the 99 KiB of sm_86/89 or a T4's 64). Where wgmma_serves, the
// large tiles are the wgmma kernel's.
template <typename T, GroupedProduct kKind>
void launch_grouped_mm(const Args<T>& p, bool tensor_cores, int tile, Stream stream) {
  if constexpr (mma::kIs16Bit<T>) {
    if (tensor_cores) {
      const bool fit = 2 * tc_shared_bytes<T, kKind, 64>() <= device_properties().sharedMemPerBlockOptin;
      if (tile == 0 ? large_tiles<kKind>(p) && fit : tile == 128) {
        if (wgmma_serves<T>()) {
          launch_wgmma<T, kKind>(p, stream);
        } else {
          launch_tc<T, kKind, 64>(p, stream);
        }
      } else {
        launch_tc<T, kKind, 32>(p, stream);
      }
      return;
    }
  }
  if constexpr (std::is_same_v<T, float>) {  // the others keep one tile: they are rare on a GPU
    if (tile == 0 ? large_tiles<kKind>(p) : tile == 128) {
      launch_simt<T, kKind, 128>(p, stream);
      return;
    }
  }
  launch_simt<T, kKind, 64>(p, stream);
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

// grouped_mm with the kernel choice exposed (tests): tensor_cores = false runs
// the SIMT kernel for 16-bit types too (a GPU without a product for the dtype
// does it anyway: below sm_75, and bfloat16 below sm_80); tile 64 or 128
// picks the output tile of the kernels that have both (tensor cores, float32
// SIMT), 0 leaves it to large_tiles.
inline void grouped_mm(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                       const at::Tensor& offsets, GroupedProduct kind, bool tensor_cores, int tile = 0,
                       const at::Tensor& bias = at::Tensor()) {
  TORCH_CHECK_VALUE(tile == 0 || tile == 64 || tile == 128, "grouped_mm: tile must be 0 (chosen), 64 or 128, got ",
                    tile);
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
    constexpr int kPerChunk = 16 / static_cast<int>(sizeof(T));
    p.a_chunks = aligned_for<kPerChunk>(p.a, {p.a_stride});
    p.b_chunks = aligned_for<kPerChunk>(p.b, {p.b_expert_stride, p.b_stride});
    p.out_pairs = aligned_for<2>(p.out, {p.out_expert_stride, p.out_stride});
    switch (kind) {
      case GroupedProduct::kRowsTimesWeightT:
        launch_grouped_mm<T, GroupedProduct::kRowsTimesWeightT>(p, use_tensor_cores, tile, stream);
        break;
      case GroupedProduct::kRowsTimesWeight:
        launch_grouped_mm<T, GroupedProduct::kRowsTimesWeight>(p, use_tensor_cores, tile, stream);
        break;
      case GroupedProduct::kWeightGradient:
        launch_grouped_mm<T, GroupedProduct::kWeightGradient>(p, use_tensor_cores, tile, stream);
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
  grouped::grouped_mm(out, a, b, offsets, kind, /*tensor_cores=*/true, /*tile=*/0, bias);
}

}  // namespace fusedllm::cuda
