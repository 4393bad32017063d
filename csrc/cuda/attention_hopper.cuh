// What the Hopper attention kernels (sm_90a: attention_hopper.cu, the forward;
// attention_hopper_backward.cu, dQ and dK/dV) share: the block's shape (a TMA
// producer warpgroup and two consumer warpgroups), q, k, v, dO and O as
// tensor maps, how a tile of a group's query rows lands in shared memory, the
// TMA loads, the K/V ring, a consumer lane's place and rows, the operand
// descriptors and the products issued on them, and the zeroing and storing
// of rows.
//
// Operand tiles are written by TMA with the 128-byte swizzle, in boxes of 64
// head-dim elements: a tile of R rows is kD / 64 boxes of R rows of 128 bytes.
// A tile of query rows holds P positions of all G query heads of one kv head
// (P G rows), landing position-major (row p G + h) or head-major (row h P + p)
// (RowOrder): q's order where every operand of the tile can land that way in
// whole 8-row swizzle atoms, loading a position or a head at a time where its
// strides order heads and positions otherwise.
#pragma once

#include <initializer_list>

#include "attention_mma.cuh"
#include "hopper.cuh"

namespace fusedllm::cuda {
namespace {

namespace hk {

constexpr int kConsumers = 2;
constexpr int kThreads = (kConsumers + 1) * 128;
constexpr int kRows = kConsumers * 64;  // query rows (forward, dQ) or keys (dK/dV) of a block
constexpr int kStages = 2;
constexpr int kBox = 64;                // head-dim elements of a TMA box: one 128-byte swizzled row
constexpr int kMaxHeadDim = 256;        // forward; the backward takes up to 128

// Whether each tensor map has heads inside positions (AttentionMap).
struct HeadsInner {
  bool q, k, v, dout, out;
};

// The order of a tile's query rows in shared memory: position-major when q's
// map has heads inside positions, else head-major; G = 2^group_log2 heads and
// P = 2^positions_log2 positions (a group that divides the tile's rows is a
// power of two).
struct RowOrder {
  bool pos_major;
  int group_log2, positions_log2;

  // Shared row i's position and head as offsets from the tile's first.
  __device__ __forceinline__ int pos_of(int i) const {
    return pos_major ? i >> group_log2 : i & ((1 << positions_log2) - 1);
  }
  __device__ __forceinline__ int head_of(int i) const {
    return pos_major ? i & ((1 << group_log2) - 1) : i >> positions_log2;
  }
  // Shared row i's group row (p G + h) from the tile's first.
  __device__ __forceinline__ int group_row_of(int i) const {
    return pos_major ? i : (pos_of(i) << group_log2) + head_of(i);
  }
};

// Issues the TMA loads of a query-row tile (kBoxes boxes of 64 head-dim
// elements; positions pos0.., heads head0.. of `batch` in map coordinates) into
// dst in `order`, completing on bar: one box per 64 of the head dim where the
// map's order is the tile's, else a box per position (position-major) or per
// head (head-major), as AttentionMap::encode_rows shaped the map's box.
template <int kBoxes>
__device__ __forceinline__ void load_query_rows(unsigned char* dst, const hopper::TensorMap& map,
                                                bool map_heads_inner, const RowOrder& order, uint64_t* bar,
                                                int32_t pos0, int32_t head0, int32_t batch) {
  const int tile_rows = 1 << (order.group_log2 + order.positions_log2);
  const bool whole = map_heads_inner == order.pos_major;
  const int pieces = whole ? 1 : 1 << (order.pos_major ? order.positions_log2 : order.group_log2);
  const int piece_rows = tile_rows / pieces;
  for (int box = 0; box < kBoxes; ++box) {
    for (int piece = 0; piece < pieces; ++piece) {
      const int32_t pos = pos0 + (!whole && order.pos_major ? piece : 0);
      const int32_t head = head0 + (!whole && !order.pos_major ? piece : 0);
      const int32_t at[4] = {box * kBox, map_heads_inner ? head : pos, map_heads_inner ? pos : head, batch};
      hopper::tma_load(dst + (box * tile_rows + piece * piece_rows) * 128, map, bar, at);
    }
  }
}

// Issues the TMA loads of kKeys key rows (key0.. of kv head `head` of
// `batch`, map coordinates) of a K or V map into dst, completing on bar.
template <int kBoxes, int kKeys>
__device__ __forceinline__ void load_key_rows(unsigned char* dst, const hopper::TensorMap& map,
                                              bool map_heads_inner, uint64_t* bar, int32_t key0, int32_t head,
                                              int32_t batch) {
  for (int box = 0; box < kBoxes; ++box) {
    const int32_t at[4] = {box * kBox, map_heads_inner ? head : key0, map_heads_inner ? key0 : head, batch};
    hopper::tma_load(dst + box * kKeys * 128, map, bar, at);
  }
}

// Zeros rows [first, rows) of a swizzled tile of `rows` rows (kBoxes boxes of
// 128-byte rows; the swizzle keeps each row's bytes in it), by the 128
// threads of a warpgroup (t its thread).
template <int kBoxes>
__device__ __forceinline__ void zero_rows_from(unsigned char* tile, int rows, int first, int t) {
  constexpr int kChunksPerRow = 128 / 16;
  const int chunks = (rows - first) * kChunksPerRow;
  for (int c = t; c < kBoxes * chunks; c += 128) {
    const int box = c / chunks, row = first + (c % chunks) / kChunksPerRow, chunk = c % kChunksPerRow;
    *reinterpret_cast<Pack<uint32_t, 4>*>(tile + (box * rows + row) * 128 + chunk * 16) =
        Pack<uint32_t, 4>{{0u, 0u, 0u, 0u}};
  }
}

// Rounds a 64 x kN accumulator (hopper.cuh's layout) into the A fragments of
// a product that sums over its kN columns: n-tiles 2i and 2i + 1 are fragment i's.
template <typename T, int kN>
__device__ __forceinline__ void accumulators_to_frags(const float (&s)[kN / 2], mma::FragA (&a)[kN / 16]) {
#pragma unroll
  for (int i = 0; i < kN / 16; ++i) {
    const float* p = s + 8 * i;
    a[i].r[0] = mma::pack2(T(p[0]), T(p[1]));
    a[i].r[1] = mma::pack2(T(p[2]), T(p[3]));
    a[i].r[2] = mma::pack2(T(p[4]), T(p[5]));
    a[i].r[3] = mma::pack2(T(p[6]), T(p[7]));
  }
}

// Descriptors of 128-byte-swizzled tiles of `rows` rows: K-major (the
// product sums along the head dim: k-step ks of 16 elements, starting at row
// `row0`, a multiple of 8) and MN-major (it sums along the rows: k-step
// `step` of 16 rows, the head dim as N).
// (The step's offset is added to the tile's descriptor, which the compiler
// keeps across the unrolled steps.)
__device__ __forceinline__ uint64_t k_major(const unsigned char* tile, int rows, int row0, int ks) {
  return hopper::advance_descriptor(hopper::make_descriptor(tile + row0 * 128, hopper::Swizzle::k128B, 16, 1024),
                                    (ks / 4) * rows * 128 + 32 * (ks % 4));
}
__device__ __forceinline__ uint64_t mn_major(const unsigned char* tile, int rows, int step) {
  return hopper::advance_descriptor(hopper::make_descriptor(tile, hopper::Swizzle::k128B, rows * 128, 1024),
                                    step * 16 * 128);
}

// Issues acc = A B^T, summed over the head dim (kD / 16 k-steps): A the 64
// rows from a_row0 of a tile of a_rows, B the kN rows from b_row0 of a tile
// of b_rows, both K-major.
template <typename T, int kD, int kN>
__device__ __forceinline__ void issue_k_major(float (&acc)[kN / 2], const unsigned char* a, int a_rows, int a_row0,
                                              const unsigned char* b, int b_rows, int b_row0) {
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks) {
    hopper::wgmma<T, kN, hopper::Major::kK, hopper::Major::kK>(acc, k_major(a, a_rows, a_row0, ks),
                                                               k_major(b, b_rows, b_row0, ks), ks > 0);
  }
}

// Issues acc += A B, summed over 16 kSteps rows of B: A in fragments, B a
// tile of b_rows rows read MN-major (N along its head dim).
template <typename T, int kN, int kSteps>
__device__ __forceinline__ void issue_mn_major(float (&acc)[kN / 2], const mma::FragA (&a)[kSteps],
                                               const unsigned char* b, int b_rows) {
#pragma unroll
  for (int i = 0; i < kSteps; ++i) hopper::wgmma<T, kN, hopper::Major::kMN>(acc, a[i], mn_major(b, b_rows, i), true);
}

// The fence of hopper::fence_operand for each of an array of A fragments.
template <int kN>
__device__ __forceinline__ void fence_fragments(mma::FragA (&a)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) hopper::fence_operand(a[i]);
}

// Zeros the rows of a tile of kKeys keys from `first` on (those past the
// block's last visible key, in the tile that key cuts) for a product that
// sums over the tile's rows: their probabilities are 0, but the rows may hold
// anything (a cache's slots past a sequence's length), and 0 x NaN is NaN.
// Both consumers write the same zeros; each fences them for its own products
// and waits for its warpgroup's writes (named barrier `barrier`).
template <int kBoxes, int kKeys>
__device__ __forceinline__ void zero_keys_from(unsigned char* tile, int first, int t, int barrier) {
  zero_rows_from<kBoxes>(tile, kKeys, first, t);
  hopper::fence_proxy_async();
  hopper::named_barrier_sync(barrier, 128);
}

// The work of a persistent grid (one block a multiprocessor, each taking
// several items): (row block, kv head, sequence) items, the last row blocks
// first (under a causal mask they see the most keys), dealt to the blocks in
// a snake: round r gives block k item r P + k when r is even and
// r P + P - 1 - k when odd (P blocks), so each block's sum of decreasing
// costs evens out.
struct WorkItems {
  int32_t row_blocks, kv_heads, batch;

  __host__ __device__ __forceinline__ int64_t count() const {
    return static_cast<int64_t>(row_blocks) * kv_heads * batch;
  }
  // This block's item of round `round`; past the last once count() or more.
  __device__ __forceinline__ int64_t item(int32_t round) const {
    const int32_t p = static_cast<int32_t>(gridDim.x), k = static_cast<int32_t>(blockIdx.x);
    return static_cast<int64_t>(round) * p + ((round & 1) ? p - 1 - k : k);
  }
  __device__ __forceinline__ void decode(int64_t item, int64_t& row_block, int64_t& g, int64_t& b) const {
    const auto heads = static_cast<int32_t>(kv_heads * batch);  // the host checked count() fits 32 bits
    const auto i = static_cast<int32_t>(item) / heads, rem = static_cast<int32_t>(item) - i * heads;
    row_block = row_blocks - 1 - i;
    b = rem / kv_heads;
    g = rem - static_cast<int32_t>(b) * kv_heads;
  }
};

// The mbarriers of a block that streams K/V tiles past its query rows (the
// forward, dQ): the query-side tiles' full and empty barriers, and per stage
// the K and V tiles' full barriers and their empty ones, which all consumer
// threads arrive at. Tiles are numbered by their place in the ring's stream,
// which runs on across the work items of a persistent block. kRingStages
// tiles are in flight at most.
template <int kRingStages = kStages>
struct KvRing {
  static constexpr int kBarriers = 2 + 4 * kRingStages;
  uint64_t *q_full, *q_empty, *k_full, *v_full, *k_empty, *v_empty;

  __device__ __forceinline__ explicit KvRing(uint64_t* bars)
      : q_full(bars), q_empty(bars + 1), k_full(bars + 2), v_full(bars + 2 + kRingStages),
        k_empty(bars + 2 + 2 * kRingStages), v_empty(bars + 2 + 3 * kRingStages) {}
  // By thread 0, before the block's __syncthreads.
  __device__ __forceinline__ void init() const {
    hopper::mbarrier_init(q_full, 1);
    hopper::mbarrier_init(q_empty, kConsumers * 128);
    for (int s = 0; s < kRingStages; ++s) {
      hopper::mbarrier_init(&k_full[s], 1);
      hopper::mbarrier_init(&v_full[s], 1);
      hopper::mbarrier_init(&k_empty[s], kConsumers * 128);
      hopper::mbarrier_init(&v_empty[s], kConsumers * 128);
    }
    hopper::mbarrier_init_fence();
  }
  // The producer's thread: n_tiles tiles of kKeys keys from map key key0 of
  // kv head `head` into tiles.k_tile(stage) and tiles.v_tile(stage), the
  // first at stream place `first`, each tile once its consumers freed it. K
  // and V are freed apart: a consumer done with a K tile before its V tile
  // (the forward) lets the next K load start a product early.
  template <int kBoxes, int kKeys, typename Tiles>
  __device__ __forceinline__ void produce(int64_t first, int64_t n_tiles, int64_t key0, int32_t head, int32_t batch,
                                          const hopper::TensorMap& map_k, const hopper::TensorMap& map_v,
                                          const HeadsInner& heads_inner, const Tiles& tiles) const {
    constexpr uint32_t kTileBytes = kKeys * kBoxes * 128;
    for (int64_t tile = 0; tile < n_tiles; ++tile) {
      const int64_t place = first + tile;
      const int stage = static_cast<int>(place % kRingStages);
      const unsigned free_parity = (static_cast<unsigned>(place / kRingStages) & 1u) ^ 1u;
      const auto key = static_cast<int32_t>(key0 + tile * kKeys);
      hopper::mbarrier_wait(&k_empty[stage], free_parity);
      hopper::mbarrier_arrive_expect_tx(&k_full[stage], kTileBytes);
      load_key_rows<kBoxes, kKeys>(tiles.k_tile(stage), map_k, heads_inner.k, &k_full[stage], key, head, batch);
      hopper::mbarrier_wait(&v_empty[stage], free_parity);
      hopper::mbarrier_arrive_expect_tx(&v_full[stage], kTileBytes);
      load_key_rows<kBoxes, kKeys>(tiles.v_tile(stage), map_v, heads_inner.v, &v_full[stage], key, head, batch);
    }
  }
  __device__ __forceinline__ void wait_keys(int64_t tile) const {
    hopper::mbarrier_wait(&k_full[tile % kRingStages], static_cast<unsigned>(tile / kRingStages) & 1u);
  }
  __device__ __forceinline__ void wait_values(int64_t tile) const {
    hopper::mbarrier_wait(&v_full[tile % kRingStages], static_cast<unsigned>(tile / kRingStages) & 1u);
  }
  // Each consumer thread, once the products reading the tile completed.
  __device__ __forceinline__ void release_keys(int64_t tile) const {
    hopper::mbarrier_arrive(&k_empty[tile % kRingStages]);
  }
  __device__ __forceinline__ void release_values(int64_t tile) const {
    hopper::mbarrier_arrive(&v_empty[tile % kRingStages]);
  }
};

// A ring's K and V tiles of kTileBytes in shared memory (stage s: K at 2 s
// tiles, V after it) and its mbarriers after them.
template <int kTileBytes, int kRingStages = kStages>
struct KvStages {
  unsigned char* kv_s;
  KvRing<kRingStages> ring;

  __device__ __forceinline__ explicit KvStages(unsigned char* kv)
      : kv_s(kv), ring(reinterpret_cast<uint64_t*>(kv + 2 * kRingStages * kTileBytes)) {}
  __device__ __forceinline__ unsigned char* k_tile(int stage) const { return kv_s + 2 * stage * kTileBytes; }
  __device__ __forceinline__ unsigned char* v_tile(int stage) const { return kv_s + (2 * stage + 1) * kTileBytes; }
};

// A consumer thread's place: thread t of consumer warpgroup `consumer`, its
// warp, and its place in the accumulator layouts (t % 32 = 4 group + quad).
struct ConsumerLane {
  int t, warp, group, quad, consumer;

  __device__ __forceinline__ ConsumerLane(int t, int consumer)
      : t(t), warp(t / 32), group((t % 32) / 4), quad(t % 4), consumer(consumer) {}
};

// A consumer lane's two query rows (r = 0, 1: rows `group` and group + 8 of
// its warp's 16, shared row first_row + 8 r) as offsets from the block's row0,
// and the keys each sees as offsets from its key_lo in 32 bits (lo == hi:
// none; rows past the block's rows see none), for a block of kKeys-key tiles.
// The offsets first, then the ranges: in one loop, ptxas (nvcc 13.0, sm_90a)
// gave the forward's key-tile loop 64 more instructions (other conversions of P).
template <int kBlockRows, int kKeys>
__device__ __forceinline__ void lane_rows(const tc::QueryBlock<kBlockRows, kKeys>& block, const RowOrder& order,
                                          const attn::QueryRows& rows, const Mask& mask, int first_row,
                                          int (&offset)[2], int (&lo)[2], int (&hi)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) offset[r] = order.group_row_of(first_row + 8 * r);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = block.row0 + offset[r], pos = rows.group_pos(row);
    const bool valid = row < block.rows_total;
    const int64_t a = valid ? attn::key_begin(mask, pos) - block.key_lo : 0;
    const int64_t z = valid ? attn::key_end(mask, pos) - block.key_lo : 0;
    const int64_t span = block.n_tiles * kKeys;
    lo[r] = static_cast<int>(a < 0 ? 0 : a > span ? span : a);
    hi[r] = static_cast<int>(z < lo[r] ? lo[r] : z > span ? span : z);
  }
}

// The tiles both rows of a lane see every key of, [first, last) (lane_rows' lo and hi).
template <int kKeys>
__device__ __forceinline__ int first_full_tile(const int (&lo)[2], const int (&hi)[2]) {
  const int all_lo = lo[0] > lo[1] ? lo[0] : lo[1], all_hi = hi[0] < hi[1] ? hi[0] : hi[1];
  return all_hi > all_lo ? (all_lo + kKeys - 1) / kKeys : 0;
}
template <int kKeys>
__device__ __forceinline__ int end_full_tile(const int (&lo)[2], const int (&hi)[2]) {
  const int all_lo = lo[0] > lo[1] ? lo[0] : lo[1], all_hi = hi[0] < hi[1] ? hi[0] : hi[1];
  return all_hi > all_lo ? all_hi / kKeys : 0;
}

// A consumer lane's rows and the keys each sees (lane_rows); all other row
// values are worked out where needed: the registers go to the accumulators.
template <int kKeys>
struct LaneRows {
  // The member order sets nvcc 13.0's register numbering, which ptxas's code follows: keep it.
  int row_offset[2], hi[2], lo[2];

  template <int kBlockRows>
  __device__ __forceinline__ LaneRows(const tc::QueryBlock<kBlockRows, kKeys>& block, const RowOrder& order,
                                      const attn::QueryRows& rows, const Mask& mask, const ConsumerLane& lane) {
    lane_rows(block, order, rows, mask, lane.consumer * 64 + lane.warp * 16 + lane.group, row_offset, lo, hi);
  }
};

// The tiles whose every key both rows of a lane see, [lo, hi): a plain call
// scores them without testing each key.
template <bool kPlain, int kKeys>
struct FullTiles {
  int lo, hi;

  __device__ __forceinline__ explicit FullTiles(const LaneRows<kKeys>& rows)
      : lo(kPlain ? first_full_tile<kKeys>(rows.lo, rows.hi) : 0),
        hi(kPlain ? end_full_tile<kKeys>(rows.lo, rows.hi) : 0) {}
};

// The scores of a tile's accumulators s[4 j + 2 r + c] (lane row r, key
// tile_key + 8 j + 2 quad + c counted from the block's key_lo, which is key
// `key_lo` of the sequence): scaled, -inf where the row does not see the key
// (lane_rows' lo and hi); then, unless kPlain, each score modifier and the
// tensor mask as its own pass over all of them behind one uniform branch, in
// tc::score's order and arithmetic (soft cap, ALiBi, mask), so that the
// backward's recomputed scores are these. Passes keep the executed loop short
// and nearly branch-free; every option tested per score was about four
// branches a score. head_pos(r, head, pos) gives lane row r's query head and
// position, worked out in the passes that need them, not held through the tile.
template <int kKeys, bool kPlain, typename HeadPos>
__device__ __forceinline__ void tile_scores(float (&s)[kKeys / 2], float scale, const ScoreExtras& extras,
                                            const Mask& mask, int64_t b, HeadPos&& head_pos, int64_t key_lo,
                                            int tile_key, int quad, const int (&lo)[2], const int (&hi)[2]) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const auto key_of = [&](int j, int c) { return tile_key + 8 * j + 2 * quad + c; };
#pragma unroll
  for (int j = 0; j < kKeys / 8; ++j) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int key = key_of(j, c);
        float& z = s[4 * j + 2 * r + c];
        z = key >= lo[r] && key < hi[r] ? z * scale : -kInf;
      }
    }
  }
  if constexpr (!kPlain) {
    if (extras.mods.softcap > 0) {
      const float cap = static_cast<float>(extras.mods.softcap);
#pragma unroll
      for (float& z : s) {
        const float x = act::capped<act::ScalarMath>(z, cap);  // finite at -inf: -cap
        z = z == -kInf ? z : x;
      }
    }
    if (extras.mods.alibi != nullptr) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        int64_t head, pos;
        head_pos(r, head, pos);
        const float slope = extras.mods.slope<float>(b, head);
#pragma unroll
        for (int j = 0; j < kKeys / 8; ++j) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            s[4 * j + 2 * r + c] += slope * attn::alibi_distance<float>(pos + mask.offset, key_lo + key_of(j, c));
          }
        }
      }
    }
    if (extras.mask.present()) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        int64_t head, pos;
        head_pos(r, head, pos);
#pragma unroll
        for (int j = 0; j < kKeys / 8; ++j) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            float& z = s[4 * j + 2 * r + c];
            if (z != -kInf) z = extras.masked(z, b, head, pos, key_lo + key_of(j, c));
          }
        }
      }
    }
  }
}

// Stores lane row r of a 64 x kD accumulator (hopper.cuh's layout) times
// `factor` into dst_row as T, the head dim's first d elements.
template <typename T, int kD>
__device__ __forceinline__ void store_lane_row(T* dst_row, const float (&acc)[kD / 2], int r, int quad, int d,
                                               float factor) {
#pragma unroll
  for (int n = 0; n < kD / 8; ++n) {
    const int c = n * 8 + 2 * quad;
    if (c < d) dst_row[c] = T(acc[4 * n + 2 * r] * factor);
    if (c + 1 < d) dst_row[c + 1] = T(acc[4 * n + 2 * r + 1] * factor);
  }
}

// q, k, v, dO or O ([B, H, S, D] with any strides, or packed as [1, H, total, D])
// as a tensor map: the head dim, then heads and positions in the order of
// their strides, then the batch, each dimension's stride at least the extent
// of the one inside it (as the driver describes tensors). A dimension of one
// element takes the extent of the one inside it as its stride.
struct AttentionMap {
  bool heads_inner = true;  // dimensions D, H, S, B; else D, S, H, B
  int64_t dims[4] = {}, strides[3] = {};  // strides in bytes, of dimensions 1..3
  bool ok = false;          // TMA can describe the tensor

  explicit AttentionMap(const at::Tensor& t) {
    const auto stride_of = [&](int dim, int64_t inner_extent) {
      return t.size(dim) == 1 ? inner_extent : 2 * t.stride(dim);
    };
    const int64_t row = 2 * t.size(3);
    // Heads inside positions when their stride is the smaller (a dimension
    // of one element goes outside).
    heads_inner = t.size(1) == 1 ? false : t.size(2) == 1 ? true : t.stride(1) < t.stride(2);
    const int inner = heads_inner ? 1 : 2, outer = heads_inner ? 2 : 1;
    dims[0] = t.size(3);
    dims[1] = t.size(inner);
    dims[2] = t.size(outer);
    dims[3] = t.size(0);
    strides[0] = stride_of(inner, row);
    strides[1] = stride_of(outer, strides[0] * dims[1]);
    strides[2] = stride_of(0, strides[1] * dims[2]);
    ok = reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0 && t.stride(3) == 1 && strides[0] >= row;
    int64_t extent = row;
    for (int d = 0; d < 3; ++d) {
      ok = ok && strides[d] % 16 == 0 && strides[d] >= extent && strides[d] < (int64_t{1} << 40);
      extent = strides[d] * dims[d + 1];
    }
  }

  // Boxes of 64 head-dim elements x box_heads x box_positions (x 1 batch).
  hopper::TensorMap encode(const at::Tensor& t, int box_heads, int box_positions) const {
    const int box[4] = {kBox, heads_inner ? box_heads : box_positions, heads_inner ? box_positions : box_heads, 1};
    return hopper::encode_tensor_map(t.const_data_ptr(), 2, 4, dims, strides, box, hopper::Swizzle::k128B);
  }
  // The box load_query_rows takes for tiles of `positions` x `group` rows in
  // `order` (pos_major): the whole tile, or one position's or one head's rows.
  hopper::TensorMap encode_rows(const at::Tensor& t, bool pos_major, int group, int positions) const {
    if (heads_inner == pos_major) return encode(t, group, positions);
    return pos_major ? encode(t, group, 1) : encode(t, 1, positions);
  }
};

// log2 of a power of two.
inline int log2_of(int n) {
  int k = 0;
  while ((1 << k) < n) ++k;
  return k;
}

// Whether `map` loads a tile of `tile_rows` query rows of a group in that
// order as whole 8-row swizzle atoms: in one box per 64 of the head dim, or
// in pieces (a position's heads or a head's positions) of a multiple of 8 rows.
inline bool loads_in_atoms(const AttentionMap& map, bool pos_major, int group, int tile_rows) {
  return map.heads_inner == pos_major || (pos_major ? group : tile_rows / group) % 8 == 0;
}

// The order of tiles of `tile_rows` query rows of a group (dividing
// tile_rows) in which every map loads in whole atoms: q's own if it serves,
// else the other; false where neither does.
inline bool row_order(std::initializer_list<const AttentionMap*> maps, const AttentionMap& q_map, int group,
                      int tile_rows, RowOrder& order) {
  for (const bool pos_major : {q_map.heads_inner, !q_map.heads_inner}) {
    bool all = true;
    for (const AttentionMap* m : maps) all = all && loads_in_atoms(*m, pos_major, group, tile_rows);
    if (all) {
      order = RowOrder{pos_major, log2_of(group), log2_of(tile_rows / group)};
      return true;
    }
  }
  return false;
}

}  // namespace hk

}  // namespace
}  // namespace fusedllm::cuda
