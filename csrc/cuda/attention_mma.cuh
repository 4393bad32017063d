// Tensor-core attention (bfloat16 / float16 on sm_80+, float16 on sm_75): the
// tile pieces the forward (attention_mma.cu) and backward kernels share, and
// the choice between them and the SIMT kernels of attention.cuh.
//
// Operands are staged in shared memory as rows of kD 16-bit elements (the head
// dim zero-padded to 64, 96, 128 or 256) with a stride of kD + 8 elements: an
// odd number of 16-byte chunks, so the 8 rows one ldmatrix phase reads and the
// 8 chunks one cp.async phase writes (8 consecutive rows of one chunk column,
// see stage_tile) fall in 8 distinct groups of 4 banks. Products run on
// mma.m16n8k16 with float32 accumulators; a warp owns 16 rows of a tile.
// Fragment layouts are those of mma.cuh; an accumulator fragment's r[0..1]
// belong to row `group` (lane / 4) and r[2..3] to row group + 8, columns
// 2 * quad (+1) (quad = lane % 4) of its 8-column n-tile.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "attention.cuh"
#include "mma.cuh"

namespace fusedllm::cuda {

// The attention kernels a call can run (kernel_name: the name its launch gives).
enum class AttentionKernel { kSimt, kTensorCore };

namespace {

namespace tc {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kRows = kWarps * 16;  // query rows of a forward block: 16 per warp
// Fewer query rows than one warp's m-tile (decoding) would leave this
// forward's tensor cores mostly idle: the decoding kernels (attention_decode.cu)
// serve up to 16 rows a kv head, and the SIMT kernels the backward below 16.
constexpr int64_t kMinRows = 16;

// The tiles of head dim kD_ for a GPU of architecture kArch_: 80 (sm_80 and
// newer), or 75 (Turing: 64 KiB of shared memory a block, so half the key
// tiles at head dim 128; float16 only, on mma.m16n8k8, up to head dim 128).
template <int kD_, int kArch_ = 80>
struct Tile {
  static_assert(kArch_ == 80 || (kArch_ == 75 && kD_ <= 128), "Turing tiles serve head dims up to 128");
  static constexpr int kD = kD_;                   // padded head dim
  static constexpr int kArch = kArch_;
  static constexpr int kStride = kD + 8;           // shared row stride (elements)
  // Forward: 16-row m-tiles per warp. Two share every K and V fragment a warp
  // reads from shared memory (half the reads per product) and give it two
  // independent chains of products; their output accumulators double, so the
  // key tiles shrink. At head dim 128 two spilled (sm_90) even with 16-key
  // tiles, so it keeps one.
  static constexpr int kFwdM = kD <= 96 ? 2 : 1;
  static constexpr int kKeys =  // keys per K/V tile
      kD <= 64 || (kD == 128 && kArch >= 80) ? 64 : kD <= 128 ? 32 : 16;
  static constexpr int kFwdRows = kWarps * 16 * kFwdM;  // query rows of a forward block
  static constexpr int kNTiles = kD / 8;           // 8-column n-tiles of a [16, kD] accumulator
  // Backward: the tile a block iterates over (keys for dQ, query rows for dK/dV);
  // at kD = 256 dQ's accumulator takes 128 registers, so the tiles are halved
  // (at 128 on Turing, for shared memory).
  static constexpr int kBwdTile = kD <= 96 || (kD == 128 && kArch >= 80) ? 32 : 16;

  // Forward: Q rows, then K and V, each double-buffered.
  static constexpr size_t forward_smem(size_t elem) {
    return elem * static_cast<size_t>(kStride) * (kFwdRows + 4 * kKeys);
  }
  // dQ: Q and dO rows, then K and V, each double-buffered.
  static constexpr size_t dq_smem(size_t elem) {
    return elem * static_cast<size_t>(kStride) * (2 * kRows + 4 * kBwdTile);
  }
  // dK/dV: K and V rows (each staged row's lse and delta in K's padding),
  // then Q and dO, each double-buffered.
  static constexpr size_t dkdv_smem(size_t elem) {
    return elem * static_cast<size_t>(kStride) * (2 * kRows + 4 * kBwdTile);
  }
  // dK/dV columns a block accumulates: a warp holds 2 x [16, kDkdvCols] in
  // registers, which past 128 columns do not fit; so at 256 two blocks take
  // each key block, one column half each, and both compute its S^T and dP^T
  // over the whole head (1.5x the products of one block).
  static constexpr int kDkdvCols = kD <= 128 ? kD : kD / 2;
  static constexpr int kDkdvSplits = kD / kDkdvCols;
};

// Where a tensor-core attention block and its lane stand: the block's kv head
// g and sequence b (grid y and z), the lane's warp and its place in the
// fragment layouts (lane = 4 group + quad), and sequence b's rows in the
// query-side operands (Q, dO, O: [B, Hq, S, D] or packed) and in the kv
// head's K and V.
struct BlockPlace {
  int64_t g, b;
  int warp, lane, group, quad;

  __device__ __forceinline__ BlockPlace()
      : g(blockIdx.y), b(blockIdx.z), warp(threadIdx.x / kWarpSize), lane(threadIdx.x % kWarpSize),
        group(lane / 4), quad(lane % 4) {}

  template <typename T>
  __device__ __forceinline__ const T* query_side(const T* x, Strides s, const attn::Seqs& seqs) const {
    return x + b * s.b + seqs.q_start(b) * s.s;
  }
  template <typename T>
  __device__ __forceinline__ const T* key_side(const T* x, Strides s, const attn::Seqs& seqs) const {
    return x + b * s.b + g * s.h + seqs.k_start(b) * s.s;
  }
};

// A block of kBlockRows query rows (position, head) of its kv head's group in
// sequence b (empty past the sequence's rows), and the keys any of them sees
// under `mask`, in tiles of kKeys. The grid's first blocks take the last rows:
// under a causal mask they see the most keys, and starting the longest blocks
// first leaves short ones, not long ones, for the last wave.
template <int kBlockRows, int kKeys>
struct QueryBlock {
  int64_t rows_total, row0;
  int64_t key_lo = 0, key_hi = 0, n_tiles = 0;

  __device__ __forceinline__ QueryBlock(const attn::QueryRows& rows, int64_t sq)
      : QueryBlock(rows, sq, static_cast<int64_t>(gridDim.x - 1 - blockIdx.x)) {}
  // Row block `index` (its rows from index kBlockRows), for a block that takes several.
  __device__ __forceinline__ QueryBlock(const attn::QueryRows& rows, int64_t sq, int64_t index)
      : rows_total(sq * rows.group), row0(index * kBlockRows) {}
  __device__ __forceinline__ bool empty() const { return row0 >= rows_total; }
  __device__ __forceinline__ void find_keys(const Mask& mask, const attn::QueryRows& rows) {
    const int64_t last_row = (row0 + kBlockRows < rows_total ? row0 + kBlockRows : rows_total) - 1;
    key_lo = attn::key_begin(mask, rows.group_pos(row0));
    key_hi = attn::key_end(mask, rows.group_pos(last_row));
    n_tiles = key_hi > key_lo ? (key_hi - key_lo + kKeys - 1) / kKeys : 0;
  }
};

// Calls f(T{}) for the 16-bit type of dtype.
template <typename F>
void with_mma_dtype(at::ScalarType dtype, F&& f) {
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf,
              "fusedllm.attention: the tensor-core kernels take bfloat16 or float16, got ", dtype);
  if (dtype == at::kBFloat16) {
    f(c10::BFloat16{});
  } else {
    f(c10::Half{});
  }
}

// Calls f(std::integral_constant<int, kD>) for the padded head dim of d.
template <typename F>
void with_mma_head_dim(int64_t d, F&& f) {
  if (d <= 64) {
    f(std::integral_constant<int, 64>{});
  } else if (d <= 96) {
    f(std::integral_constant<int, 96>{});
  } else if (d <= 128) {
    f(std::integral_constant<int, 128>{});
  } else {
    f(std::integral_constant<int, 256>{});
  }
}

// Whether this compilation holds the body of a tensor-core kernel for T on
// the tiles of kArch: sm_75 machine code the float16 Turing ones, sm_80+ the
// others (a GPU launches only its own); the emulator and the host pass all.
template <typename T, int kArch>
constexpr bool kBuiltHere = mma::kProductFor<T> &&
#if defined(__CUDA_ARCH__) && !defined(FUSEDLLM_SIMT)
                            (kArch == 80) == (__CUDA_ARCH__ >= 800);
#else
                            true;
#endif

// The tiles this device takes (Tile's kArch): 75 on a Turing GPU (sm_75, the
// emulated one under FUSEDLLM_SIMT_SM=75), 80 from sm_80 on; 0 where the
// tensor-core kernels do not run.
inline int tile_arch() {
  const auto& props = device_properties();
  if (props.major >= 8) return 80;
  return props.major == 7 && props.minor >= 5 ? 75 : 0;
}

// Calls f(T{}, Tile<kD, kArch>{}) for the call's 16-bit type, its padded head
// dim and this device's tiles (choose_attention_kernel has checked they serve it).
template <typename F>
void with_mma_tiles(at::ScalarType dtype, int64_t d, F&& f) {
  const int arch = tile_arch();
  with_mma_dtype(dtype, [&](auto dtype_tag) {
    using T = decltype(dtype_tag);
    with_mma_head_dim(d, [&](auto D) {
      constexpr int kD = decltype(D)::value;
      if (arch == 80) {
        f(T{}, Tile<kD, 80>{});
        return;
      }
      if constexpr (std::is_same_v<T, c10::Half> && kD <= 128) {
        if (arch == 75) {
          f(T{}, Tile<kD, 75>{});
          return;
        }
      }
      TORCH_CHECK(false, "fusedllm.attention: no tensor-core kernel for ", dtype, " at head dim ", d,
                  " on this GPU (sm_", device_properties().major, device_properties().minor, ")");
    });
  });
}

// The most shared memory a block of the forward or backward kernels takes at
// head dim d on the tiles of kArch: the tensor-core kernels serve a call only
// where all of them fit, so that a forward on them has its backward on them too.
template <int kArch>
size_t max_smem(int64_t d, size_t elem) {
  size_t bytes = 0;
  with_mma_head_dim(d, [&](auto D) {
    constexpr int kD = decltype(D)::value;
    if constexpr (kArch == 80 || kD <= 128) {
      using Tl = Tile<kD, kArch>;
      bytes = std::max({Tl::forward_smem(elem), Tl::dq_smem(elem), Tl::dkdv_smem(elem)});
    } else {
      bytes = std::numeric_limits<size_t>::max();  // no Turing tiles past 128
    }
  });
  return bytes;
}

// True when every row of the operand can be copied in 16-byte chunks: an
// aligned pointer and strides that are multiples of 8 elements.
inline bool chunks_aligned(const void* ptr, Strides s) {
  return pack_aligned<uint16_t, 8>(ptr) && s.b % 8 == 0 && s.h % 8 == 0 && s.s % 8 == 0;
}

// Stages kTileRows rows (a multiple of 8) of head dim d into dst (stride
// Tile<kD>::kStride): row r from src_row(r) (nullptr: a row of zeros), zeros
// past d. The block's threads take 16-byte chunks so that each group of 8
// lanes writes one chunk column of 8 consecutive rows (conflict-free with the
// odd chunk stride; in global memory a warp reads 8 rows x 64 contiguous
// bytes); cp.async (zero-filling outside the operand) where `chunks` allows and
// the chunk is whole or past d, element by element otherwise. The caller
// commits the cp.async group.
//
// Where every chunk is whole (chunks and d == kD: the common head dims) and
// kMayUnroll, a thread's units are unrolled into one cp.async each and a test
// of the row:
// the general loop cost about 60 instructions per 16-byte copy in the SASS,
// half of the forward's key-tile loop. (kMayUnroll false: a caller whose
// registers cannot hold every unit's address at once; by default past 128,
// where the unrolled addresses took registers the forward's accumulators
// need, and it spilled.)
template <typename T, int kD, int kTileRows, bool kMayUnroll = (kD <= 128), typename RowFn>
__device__ __forceinline__ void stage_tile(T* dst, RowFn&& src_row, int d, bool chunks) {
  constexpr int kChunks = kD / 8, kStride = Tile<kD>::kStride;
  constexpr int kSlabsPerOctet = kChunks / 4;  // a slab: 8 rows x 4 chunks, one warp's turn
  static_assert(kTileRows % 8 == 0 && kChunks % 4 == 0, "tiles are whole slabs");
  constexpr int kUnits = kTileRows * kChunks;
  static_assert(kUnits % kThreads == 0, "every thread copies the same number of chunks");
  const auto row_of = [](int u) { return 8 * (u / kWarpSize / kSlabsPerOctet) + u % kWarpSize % 8; };
  const auto col_of = [](int u) { return 8 * (4 * (u / kWarpSize % kSlabsPerOctet) + u % kWarpSize / 8); };
  if (kMayUnroll && chunks && d == kD) {
#pragma unroll
    for (int i = 0; i < kUnits / kThreads; ++i) {
      const int u = threadIdx.x + i * kThreads;
      const int row = row_of(u), col = col_of(u);
      const T* from = src_row(row);
      mma::cp_async_16_or_zero(dst + row * kStride + col, from != nullptr ? from + col : dst, from != nullptr);
    }
    return;
  }
  for (int u = threadIdx.x; u < kUnits; u += kThreads) {
    const int row = row_of(u), col = col_of(u);
    T* to = dst + row * kStride + col;
    const T* from = src_row(row);
    if (chunks && (from == nullptr || col + 8 <= d || col >= d)) {
      // Whole chunks and zeros alike by cp.async: every lane issues the same copies.
      const bool inside = from != nullptr && col < d;
      mma::cp_async_16_or_zero(to, inside ? from + col : dst, inside);
    } else if (from == nullptr || col >= d) {
      store_pack<uint32_t, 4>(reinterpret_cast<uint32_t*>(to), Pack<uint32_t, 4>{{0u, 0u, 0u, 0u}});
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) to[e] = col + e < d ? from[col + e] : T(0.f);
    }
  }
}

// Stages rows r < n of src + r * stride (zeros from n on) as stage_tile does.
// Where every chunk is whole and each thread's chunks keep one column (head
// dims 64 and 128), its source pointer steps by a constant stride instead of
// being worked out again for each chunk (64-bit products and tests that took
// most of the decoding kernel's instructions), one copy at a time: unrolled,
// the copies' addresses all live at once spilled the decoding kernel (sm_90).
template <typename T, int kD, int kTileRows>
__device__ __forceinline__ void stage_strided_rows(T* dst, const T* src, int64_t stride, int n, int d,
                                                   bool chunks) {
  constexpr int kChunks = kD / 8, kStride = Tile<kD>::kStride, kSlabsPerOctet = kChunks / 4;
  if constexpr (kD <= 128 && kWarps % kSlabsPerOctet == 0) {
    if (chunks && d == kD) {
      constexpr int kUnits = kTileRows * kChunks, kRowStep = 8 * kWarps / kSlabsPerOctet;
      static_assert(kUnits % kThreads == 0, "every thread copies the same number of chunks");
      // stage_tile's row_of and col_of for unit threadIdx.x; unit threadIdx.x + i kThreads is kRowStep i rows on.
      const int u = threadIdx.x;
      const int row = 8 * (u / kWarpSize / kSlabsPerOctet) + u % kWarpSize % 8;
      const int col = 8 * (4 * (u / kWarpSize % kSlabsPerOctet) + u % kWarpSize / 8);
      const T* from = src + row * stride + col;
      const int64_t step = kRowStep * stride;
#pragma unroll 1
      for (int i = 0; i < kUnits / kThreads; ++i) {
        const int r = row + i * kRowStep;
        mma::cp_async_16_or_zero(dst + r * kStride + col, r < n ? from : dst, r < n);
        from += step;
      }
      return;
    }
  }
  stage_tile<T, kD, kTileRows>(dst, [&](int r) -> const T* { return r < n ? src + r * stride : nullptr; }, d,
                               chunks);
}

// Stages keys [j0, j0 + kTileRows) of one kv head's K and V (rows k + j *
// k_stride; keys at or past `end`: zeros) into k_dst and v_dst.
template <typename T, int kD, int kTileRows, bool kMayUnroll = (kD <= 128)>
__device__ __forceinline__ void stage_key_rows(T* k_dst, T* v_dst, const T* k, int64_t k_stride, const T* v,
                                               int64_t v_stride, int64_t j0, int64_t end, int d, bool chunks) {
  const int n = end - j0 < kTileRows ? static_cast<int>(end - j0) : kTileRows;  // rows present
  const T* k0 = k + j0 * k_stride;
  const T* v0 = v + j0 * v_stride;
  stage_tile<T, kD, kTileRows, kMayUnroll>(
      k_dst, [&](int r) -> const T* { return r < n ? k0 + r * k_stride : nullptr; }, d, chunks);
  stage_tile<T, kD, kTileRows, kMayUnroll>(
      v_dst, [&](int r) -> const T* { return r < n ? v0 + r * v_stride : nullptr; }, d, chunks);
}

// Whether the dQ kernel unrolls its K/V staging past head dim 128: sm_90's
// registers hold the unrolled addresses (head dim 256: 857 -> 623 instructions
// a key tile), sm_80's spilled them. The emulator unrolls, so that its tests
// run the unrolled path at every head dim.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr bool kUnrollWideDqStaging = false;
#else
constexpr bool kUnrollWideDqStaging = true;
#endif

// Stages rows [r0, r0 + kTileRows) (position, head) of kv head g's group from
// the operand x_b (its batch and sequence start; strides s); rows at or past
// `end`: zeros.
template <typename T, int kD, int kTileRows, bool kMayUnroll = (kD <= 128)>
__device__ __forceinline__ void stage_group_rows(T* dst, const T* x_b, Strides s, const attn::QueryRows& rows,
                                                 int64_t g, int64_t r0, int64_t end, int d, bool chunks) {
  stage_tile<T, kD, kTileRows, kMayUnroll>(dst, [&](int r) -> const T* {
    const int64_t row = r0 + r;
    return row < end ? x_b + rows.group_head(g, row) * s.h + rows.group_pos(row) * s.s : nullptr;
  }, d, chunks);
}

// The double-buffered tile pipeline: `stage(t)` issues tile t's cp.async copies
// into buffer t % 2. pipeline_start stages tile 0; pipeline_next, at the top of
// iteration `tile`, stages tile + 1 (its buffer was last read before the
// previous iteration's closing barrier) and waits until tile's copies have
// landed for the whole block.
template <typename Stage>
__device__ __forceinline__ void pipeline_start(int64_t n_tiles, Stage&& stage) {
  if (n_tiles > 0) stage(int64_t{0});
  mma::cp_async_commit();
}

template <typename Stage>
__device__ __forceinline__ void pipeline_next(int64_t tile, int64_t n_tiles, Stage&& stage) {
  if (tile + 1 < n_tiles) {
    stage(tile + 1);
    mma::cp_async_commit();
    mma::cp_async_wait<1>();
  } else {
    mma::cp_async_wait<0>();
  }
  __syncthreads();
}

// c[m][16, kN] += a_m[16, kK] b[kN, kK]^T for kM m-tiles: a_m the 16 rows at
// a + 16 m kStride and b's kN rows from shared memory (row stride kStride), as
// in S = Q K^T; each b fragment read feeds kM products.
template <typename T, int kM, int kK, int kN, int kStride>
__device__ __forceinline__ void mma_rows_rows(mma::FragC (&c)[kM][kN / 8], const T* a, const T* b) {
  const int lane = threadIdx.x % kWarpSize;
  const int matrix = lane / 8, matrix_row = lane % 8;  // the 8x8 matrix this lane addresses
#pragma unroll
  for (int k = 0; k < kK; k += 16) {
    mma::FragA fa[kM];
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      mma::ldmatrix_x4<false>(fa[m].r,
                              a + (16 * m + (matrix % 2) * 8 + matrix_row) * kStride + k + (matrix / 2) * 8);
    }
#pragma unroll
    for (int n = 0; n < kN; n += 16) {
      uint32_t r[4];  // n-tiles n and n + 8: {r[0], r[1]} and {r[2], r[3]}
      mma::ldmatrix_x4<false>(r, b + (n + (matrix / 2) * 8 + matrix_row) * kStride + k + (matrix % 2) * 8);
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        mma::mma_16816<T>(c[m][n / 8], fa[m], mma::FragB{{r[0], r[1]}});
        mma::mma_16816<T>(c[m][n / 8 + 1], fa[m], mma::FragB{{r[2], r[3]}});
      }
    }
  }
}

// One m-tile: c[16, kN] += a[16, kK] b[kN, kK]^T.
template <typename T, int kK, int kN, int kStride>
__device__ __forceinline__ void mma_rows_rows(mma::FragC (&c)[kN / 8], const T* a, const T* b) {
  mma_rows_rows<T, 1, kK, kN, kStride>(reinterpret_cast<mma::FragC(&)[1][kN / 8]>(c), a, b);
}

// c[m][16, kN] += a[m][16, kK] b[kK, kN] for kM m-tiles: a in registers (kK / 16
// A fragments each), b's kK rows of kN from shared memory (ldmatrix .trans), as
// in O += P V; each b fragment read feeds kM products.
template <typename T, int kM, int kK, int kN, int kStride>
__device__ __forceinline__ void mma_frags_rows(mma::FragC (&c)[kM][kN / 8], const mma::FragA (&a)[kM][kK / 16],
                                               const T* b) {
  const int lane = threadIdx.x % kWarpSize;
  const int matrix = lane / 8, matrix_row = lane % 8;
#pragma unroll
  for (int k = 0; k < kK; k += 16) {
#pragma unroll
    for (int n = 0; n < kN; n += 16) {
      uint32_t r[4];
      mma::ldmatrix_x4<true>(r, b + (k + (matrix % 2) * 8 + matrix_row) * kStride + n + (matrix / 2) * 8);
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        mma::mma_16816<T>(c[m][n / 8], a[m][k / 16], mma::FragB{{r[0], r[1]}});
        mma::mma_16816<T>(c[m][n / 8 + 1], a[m][k / 16], mma::FragB{{r[2], r[3]}});
      }
    }
  }
}

// One m-tile: c[16, kN] += a[16, kK] b[kK, kN].
template <typename T, int kK, int kN, int kStride>
__device__ __forceinline__ void mma_frags_rows(mma::FragC (&c)[kN / 8], const mma::FragA (&a)[kK / 16],
                                               const T* b) {
  mma_frags_rows<T, 1, kK, kN, kStride>(reinterpret_cast<mma::FragC(&)[1][kN / 8]>(c),
                                        reinterpret_cast<const mma::FragA(&)[1][kK / 16]>(a), b);
}

// Accumulator fragments of a [16, kN] product as the A fragments of the next
// product's [16, kN] left operand, rounded to T: n-tiles 2i and 2i + 1 hold
// exactly the rows and columns A fragment i wants (the layouts of mma.cuh),
// so no value leaves its lane.
template <typename T, int kN>
__device__ __forceinline__ void to_a_frags(mma::FragA (&a)[kN / 16], const mma::FragC (&c)[kN / 8]) {
#pragma unroll
  for (int i = 0; i < kN / 16; ++i) {
    const mma::FragC& lo = c[2 * i];
    const mma::FragC& hi = c[2 * i + 1];
    a[i].r[0] = mma::pack2(T(lo.r[0]), T(lo.r[1]));
    a[i].r[1] = mma::pack2(T(lo.r[2]), T(lo.r[3]));
    a[i].r[2] = mma::pack2(T(hi.r[0]), T(hi.r[1]));
    a[i].r[3] = mma::pack2(T(hi.r[2]), T(hi.r[3]));
  }
}

// exp(x - y) for a score x and a shift y (the running max, or the lse in the
// backward): the difference first, then exp_ftz, so that x == y gives exactly
// 1 and the backward's exp(score - lse) are the forward's probabilities to
// rounding (a shift folded into one fused multiply-add, x log2(e) - y log2(e),
// is off by the rounding of y log2(e), which grows with the scores).
__device__ __forceinline__ float exp_of_difference(float x, float y) { return exp_ftz(x - y); }

// The score of (q row, key) from its accumulator value, -inf when the key is
// not visible; `plain` (no modifier, no tensor mask): scale times the value.
// d score / d (scale q . k) in *dcap where asked (the backward).
__device__ __forceinline__ float score(float acc, bool visible, bool plain, float scale, const ScoreExtras& extras,
                                       const Mask& mask, int64_t b, int64_t head, int64_t pos, int64_t key,
                                       float* dcap) {
  if (dcap != nullptr) *dcap = 1.f;
  if (!visible) return -std::numeric_limits<float>::infinity();
  if (plain) return acc * scale;
  const float z = extras.modified<float>(acc * scale, b, head, pos + mask.offset, key, dcap);
  return extras.masked(z, b, head, pos, key);
}

// This lane's half of row `group` + 8 half of a [16, 8 kN] accumulator (two
// columns of each n-tile), times `factor` and rounded to T, into the columns
// of row dst below d.
template <typename T, int kN>
__device__ __forceinline__ void store_acc_row(T* dst, const mma::FragC (&c)[kN], int half, float factor, int quad,
                                              int d) {
#pragma unroll
  for (int n = 0; n < kN; ++n) {
    const int col = n * 8 + 2 * quad;
    if (col < d) dst[col] = T(c[n].r[2 * half] * factor);
    if (col + 1 < d) dst[col + 1] = T(c[n].r[2 * half + 1] * factor);
  }
}

}  // namespace tc

// FUSEDLLM_CUDA_ATTENTION=simt keeps every call on the SIMT kernels: benchmarks
// compare the two, and the emulated test suite runs its broad attention grid on
// the SIMT kernels (the tensor-core kernels have their own grid). "mma": the
// mma.sync tensor-core kernels, never the Hopper ones. "hopper": the Hopper
// kernels (attention_hopper*.cu) wherever they serve a call, on the emulator
// too. Unset or "auto": the Hopper kernels on an sm_90 GPU with this build's
// sm_90a machine code (2-3x the mma.sync kernels' speed there), else the
// choice below; the emulated device is an sm_80 one (sm_75 under
// FUSEDLLM_SIMT_SM=75).
enum class AttentionRequest { kAuto, kSimt, kMma, kHopper };
inline AttentionRequest attention_request() {
  const char* value = std::getenv("FUSEDLLM_CUDA_ATTENTION");
  if (value == nullptr || *value == '\0' || std::string(value) == "auto") return AttentionRequest::kAuto;
  if (std::string(value) == "simt") return AttentionRequest::kSimt;
  if (std::string(value) == "mma") return AttentionRequest::kMma;
  TORCH_CHECK_VALUE(std::string(value) == "hopper",
                    "FUSEDLLM_CUDA_ATTENTION must be 'auto', 'simt', 'mma' or 'hopper', got '", value, "'");
  return AttentionRequest::kHopper;
}
inline bool simt_attention_requested() { return attention_request() == AttentionRequest::kSimt; }

// Whether the Hopper kernels run here: on the emulator when requested (not as
// an sm_75 device); on an sm_90 GPU with this build's sm_90a machine code
// unless another kernel family is requested.
inline bool hopper_attention_available() {
  const AttentionRequest request = attention_request();
#if defined(FUSEDLLM_SIMT)
  return request == AttentionRequest::kHopper && tc::tile_arch() == 80;
#elif defined(FUSEDLLM_SM90A_IMAGE)
  if (request != AttentionRequest::kAuto && request != AttentionRequest::kHopper) return false;
  const auto& props = device_properties();
  return props.major == 9 && props.minor == 0;
#else
  (void)request;
  return false;
#endif
}

// Which kernel serves a call: the tensor-core kernels for bfloat16 / float16
// on sm_80+ (the emulated device is one) and for float16 on sm_75, when the
// query rows of a kv head fill a warp's m-tile and the tiles fit in shared
// memory; the SIMT kernels otherwise (float32 / float64, decoding, bfloat16
// on Turing, older GPUs). A forward of at most 16 rows a kv head tries the
// decoding kernels first (CudaAttention::forward).
inline AttentionKernel choose_attention_kernel(const AttentionParams& p, at::ScalarType dtype) {
  if (simt_attention_requested()) return AttentionKernel::kSimt;
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return AttentionKernel::kSimt;
  const int arch = tc::tile_arch();
  if (arch == 0 || (arch == 75 && dtype != at::kHalf)) return AttentionKernel::kSimt;
  if (p.rows.group_rows() < tc::kMinRows) return AttentionKernel::kSimt;
  const size_t smem = arch == 75 ? tc::max_smem<75>(p.shape.head_dim, 2) : tc::max_smem<80>(p.shape.head_dim, 2);
  if (smem > device_properties().sharedMemPerBlockOptin) return AttentionKernel::kSimt;
  return AttentionKernel::kTensorCore;
}

}  // namespace

// The Hopper forward (attention_hopper.cu), where it serves the call (16-bit
// types, head dims up to 128 (256 in plain calls where its shared memory
// fits), a group that divides its 128 rows, operands TMA can describe);
// false, launching nothing, where it does not.
bool launch_attention_hopper_forward(const AttentionForwardPlan& p, Stream stream);
// The Hopper backward (attention_hopper_backward.cu: delta and dQ, then dK and
// dV; delta: a tensor of the call's query rows it fills), where it serves the call
// (16-bit types, head dims up to 128, a group that divides its 64-row tiles,
// operands TMA can describe); false, launching nothing, where it does not.
bool launch_attention_hopper_backward(const AttentionBackwardPlan& p, const at::Tensor& delta, Stream stream);

// The tensor-core forward (attention_mma.cu) and backward (attention_mma_backward.cu;
// dK/dV in column halves past head dim 128).
void launch_attention_mma_forward(const AttentionForwardPlan& p, Stream stream);
// delta = rowsum(dO * O) as the tensor-core dP sums it (the SIMT kernels':
// launch_attention_delta).
void launch_attention_mma_delta(const AttentionBackwardPlan& p, const at::Tensor& delta, Stream stream);
void launch_attention_mma_dq(const AttentionBackwardPlan& p, const at::Tensor& delta, Stream stream);
void launch_attention_mma_dkdv(const AttentionBackwardPlan& p, const at::Tensor& delta, Stream stream);

}  // namespace fusedllm::cuda
