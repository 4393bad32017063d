// The Hopper attention backward (bfloat16 / float16, head dims up to 64, 128
// in plain calls; sm_90a): the tensor-core backward's two deterministic
// kernels (no atomics) on wgmma, with a TMA producer warpgroup and two
// consumer warpgroups as in the forward (attention_hopper.cuh):
//
//   dQ: a block holds 128 query rows of one kv head (64 per consumer) with
//       their Q, dO and O. First delta = rowsum(dO * O), as the diagonal of
//       dO O^T on the same wgmma products, in the same order, as dP = dO V^T
//       (a row whose output is one key's value row then gets dP - delta = 0
//       exactly), written out for dK/dV. K/V tiles stream through a
//       two-stage ring. Per tile:
//       S = Q K^T and dP = dO V^T (both operands from shared memory), P and
//       dS = P (dP - delta) on the accumulators, dS rounded into A fragments
//       and dQ += dS K (K read MN-major).
//   dK, dV: a block holds 128 keys of one kv head (64 per consumer) with their
//       K and V; tiles of 64 query rows (every head of the group at 64 / G
//       positions) that see them stream through the ring with dO. Per tile:
//       S^T = K Q^T and dP^T = V dO^T, P^T and dS^T on the accumulators, then
//       dV += P^T dO and dK += dS^T Q (dO and Q read MN-major). A producer
//       warp loads the tiles' lse, delta and positions into two shared
//       buffers ahead of the consumers (mbarriers full and empty).
//
// Scores follow the forward exactly (scale, soft-capping with its slope dcap,
// ALiBi, masks, the dropout draws of the same Philox stream). Operand rows
// past a sequence's end (a packed neighbour's, or a cut tile's) are zeroed
// before the product that sums over them: their probabilities are 0, but
// 0 x NaN is NaN.
#include "attention_hopper.cuh"

namespace fusedllm::cuda {
namespace {

namespace hk {

constexpr int kBwdMaxHeadDim = 128;
constexpr int kTileRows = 64;  // query rows of a dK/dV tile

// kStages K/V tiles in flight: tile j + 1's S and dP are issued before tile
// j's dQ += dS K, which holds tile j's K; with two stages, tile j + 1's loads
// could start only once tile j - 1's dQ ended, just before they were needed.
// Three give them a tile's lead: 197 KB at head dim 128 (an sm_90's shared
// memory; the emulated sm_80-class device's takes the two-stage form).
template <int kD, int kRingStages>
struct DqLayout {
  static constexpr int kStages = kRingStages;
  // Keys of a K / V tile: S, dP and dQ share a consumer's registers.
  static constexpr int kKeys = kD <= 64 ? 128 : 64;
  static constexpr int kQBytes = kRows * kD * 2;     // Q, dO, and O
  static constexpr int kTileBytes = kKeys * kD * 2;  // one K or V tile
  // Q, dO, O, each stage's K and V, the mbarriers; 1024 bytes to align the tiles.
  static constexpr size_t smem() {
    return 1024 + 3 * kQBytes + 2 * kStages * kTileBytes + 8 * KvRing<kStages>::kBarriers;
  }
};

template <int kD>
struct DkdvLayout {
  static constexpr int kKeyBytes = kRows * kD * 2;       // the block's K, and V
  static constexpr int kTileBytes = kTileRows * kD * 2;  // one Q or dO tile
  // A tile's lse, delta and positions, double-buffered.
  static constexpr int kStatsBytes = 2 * kTileRows * 12;
  // K and V's full barrier, each stage's full and empty, each statistics buffer's full and empty.
  static constexpr int kBarriers = 1 + 2 * kStages + 4;
  // K, V, each stage's Q and dO, the statistics, the mbarriers.
  static constexpr size_t smem() {
    return 1024 + 2 * kKeyBytes + 2 * kStages * kTileBytes + kStatsBytes + 8 * kBarriers;
  }
};

// The dQ block's shared memory: Q, dO and O, then the K/V ring.
template <int kD, int kRingStages>
struct DqSmem {
  using L = DqLayout<kD, kRingStages>;
  unsigned char *q_s, *do_s, *o_s;
  KvStages<L::kTileBytes, kRingStages> kv;

  __device__ __forceinline__ explicit DqSmem(unsigned char* raw)
      : q_s(raw + (1024 - hopper::shared_address(raw) % 1024) % 1024), do_s(q_s + L::kQBytes),
        o_s(do_s + L::kQBytes), kv(o_s + L::kQBytes) {}
};

// A dQ consumer thread's registers (hopper.cuh's layout): its rows' lse and
// delta, dQ, a tile's S (then dS) and dP, and its dS as A fragments.
template <int kD, int kKeys>
struct DqAcc {
  float lse[2], delta[2];
  float dq[kD / 2], s[kKeys / 2], dp[kKeys / 2];
  mma::FragA ds[kKeys / 16];
};

// A dQ consumer thread's work: the steps of a K/V tile.
template <typename T, int kD, bool kPlain, int kRingStages>
struct DqConsumer {
  static constexpr int kBoxes = kD / kBox;
  static constexpr int kKeys = DqLayout<kD, kRingStages>::kKeys;
  using Acc = DqAcc<kD, kKeys>;
  const DqSmem<kD, kRingStages>& smem;
  const tc::QueryBlock<kRows, kKeys>& block;
  const LaneRows<kKeys>& my_rows;
  const FullTiles<kPlain, kKeys>& full;
  const ConsumerLane& lane;
  const attn::QueryRows& rows;
  const Mask& mask;
  const ScoreExtras& extras;
  float scale;
  int64_t g, b;
  bool unmodified;  // no score modifier, no tensor mask

  __device__ __forceinline__ int64_t lane_row(int r) const { return block.row0 + my_rows.row_offset[r]; }
  static __device__ __forceinline__ int stage_of(int64_t tile) { return static_cast<int>(tile % kRingStages); }

  // delta of this lane's rows (0 where the block sees no key: its rows'
  // outputs are 0), written out for dK/dV.
  __device__ __forceinline__ void find_deltas(Acc& a, float* delta) const {
    a.delta[0] = 0.f, a.delta[1] = 0.f;
    if (block.n_tiles > 0) {
      hopper::mbarrier_wait(smem.kv.ring.q_full, 0);
      float c[32];  // dO O^T of this consumer's 64 rows
      hopper::fence_operand(c);
      hopper::wgmma_fence();
      issue_k_major<T, kD, 64>(c, smem.do_s, kRows, lane.consumer * 64, smem.o_s, kRows, lane.consumer * 64);
      hopper::wgmma_commit();
      hopper::wgmma_wait<0>();
      hopper::fence_operand(c);
      // Row m = 16 warp + group + 8 r meets column m in register 4 (2 warp + r)
      // + 2 r + group % 2 of the group's lane with quad group / 2.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float diagonal = 0.f;
#pragma unroll
        for (int e = 0; e < 32; ++e) {
          if (e / 4 == 2 * lane.warp + r && (e / 2) % 2 == r && e % 2 == lane.group % 2) diagonal = c[e];
        }
        a.delta[r] = __shfl_sync(kFullMask, diagonal, 4 * lane.group + lane.group / 2);
      }
    }
    if (lane.quad == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (lane_row(r) < block.rows_total) delta[rows.row_of_group_row(b, g, lane_row(r))] = a.delta[r];
      }
    }
  }
  // S = Q K^T and dP = dO V^T of a tile, issued and committed once its K and V have landed.
  __device__ __forceinline__ void issue_scores(Acc& a, int64_t tile) const {
    const int stage = stage_of(tile);
    smem.kv.ring.wait_keys(tile);
    smem.kv.ring.wait_values(tile);
    hopper::fence_operand(a.s);
    hopper::fence_operand(a.dp);
    hopper::wgmma_fence();
    issue_k_major<T, kD, kKeys>(a.s, smem.q_s, kRows, lane.consumer * 64, smem.kv.k_tile(stage), kKeys, 0);
    issue_k_major<T, kD, kKeys>(a.dp, smem.do_s, kRows, lane.consumer * 64, smem.kv.v_tile(stage), kKeys, 0);
    hopper::wgmma_commit();
  }
  // After the wait for a tile's S and dP: their registers are read from here
  // on, and its V is free (dQ reads K alone).
  __device__ __forceinline__ void scores_done(Acc& a, int64_t tile) const {
    hopper::fence_operand(a.s);
    hopper::fence_operand(a.dp);
    smem.kv.ring.release_values(tile);
  }
  // s becomes dS = P (dP - delta) (through the cap's slope).
  __device__ __forceinline__ void score_gradients(Acc& a, int64_t tile) const {
    if (tile >= full.lo && tile < full.hi) {
#pragma unroll
      for (int e = 0; e < kKeys / 2; ++e) {
        const int r = (e / 2) % 2;
        const float p = tc::exp_of_difference(a.s[e] * scale, a.lse[r]);
        a.s[e] = attn::score_grad(p, a.dp[e], a.delta[r]);
      }
      return;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = lane_row(r), head = rows.group_head(g, row), pos = rows.group_pos(row);
#pragma unroll
      for (int j = 0; j < kKeys / 8; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int e = 4 * j + 2 * r + c;
          const int key = static_cast<int>(tile) * kKeys + 8 * j + 2 * lane.quad + c;  // from key_lo
          const bool visible = key >= my_rows.lo[r] && key < my_rows.hi[r];
          float dcap;
          const float x = tc::score(a.s[e], visible, unmodified, scale, extras, mask, b, head, pos,
                                    block.key_lo + key, &dcap);
          const float p = tc::exp_of_difference(x, a.lse[r]);
          float dpe = visible ? a.dp[e] : 0.f;
          if (!kPlain && extras.drop.enabled && visible) {
            dpe *= extras.keep_factor<float>(b, head, pos, block.key_lo + key);
          }
          a.s[e] = attn::score_grad(p, dpe, a.delta[r]) * dcap;
        }
      }
    }
  }
  // dQ += dS K of the tile whose dS is in ds, committed (K read MN-major).
  // K rows past the block's last visible key are zeroed first: the product
  // sums over them.
  __device__ __forceinline__ void issue_dq(Acc& a, int64_t tile) const {
    const int stage = stage_of(tile);
    const int64_t visible_keys = block.key_hi - (block.key_lo + tile * kKeys);
    if (visible_keys < kKeys) {
      zero_keys_from<kBoxes, kKeys>(smem.kv.k_tile(stage), static_cast<int>(visible_keys), lane.t, 1 + lane.consumer);
    }
    hopper::fence_operand(a.dq);
    fence_fragments(a.ds);
    hopper::wgmma_fence();
    issue_mn_major<T, kD>(a.dq, a.ds, smem.kv.k_tile(stage), kKeys);
    hopper::wgmma_commit();
  }
  // After dQ's wait: its registers are read from here on, its K is free.
  __device__ __forceinline__ void dq_done(Acc& a, int64_t tile) const {
    hopper::fence_operand(a.dq);
    fence_fragments(a.ds);
    smem.kv.ring.release_keys(tile);
  }

  // Plain calls: tile j + 1's S and dP are issued before tile j's dQ += dS K,
  // and their gradients formed while it runs. Every tile but the last has a
  // next one: no product is issued under a condition, so ptxas sees which
  // group each wait completes.
  __device__ __forceinline__ void overlapped_tiles(Acc& a) const {
    if (block.n_tiles > 0) {
      issue_scores(a, 0);
      hopper::wgmma_wait<0>();
      scores_done(a, 0);
      score_gradients(a, 0);
      accumulators_to_frags<T, kKeys>(a.s, a.ds);
    }
    for (int64_t tile = 0; tile + 1 < block.n_tiles; ++tile) {
      issue_scores(a, tile + 1);
      issue_dq(a, tile);
      hopper::wgmma_wait<1>();  // S and dP, not dQ
      scores_done(a, tile + 1);
      score_gradients(a, tile + 1);
      hopper::wgmma_wait<0>();
      dq_done(a, tile);
      accumulators_to_frags<T, kKeys>(a.s, a.ds);
    }
    if (block.n_tiles > 0) {
      issue_dq(a, block.n_tiles - 1);
      hopper::wgmma_wait<0>();
      dq_done(a, block.n_tiles - 1);
    }
  }
  // The general scoring needs the registers the overlap would hold: one product at a time.
  __device__ __forceinline__ void serial_tiles(Acc& a) const {
    for (int64_t tile = 0; tile < block.n_tiles; ++tile) {
      issue_scores(a, tile);
      hopper::wgmma_wait<0>();
      scores_done(a, tile);
      score_gradients(a, tile);
      accumulators_to_frags<T, kKeys>(a.s, a.ds);
      issue_dq(a, tile);
      hopper::wgmma_wait<0>();
      dq_done(a, tile);
    }
  }
  __device__ __forceinline__ void store_rows(Acc& a, T* grad_q, int d) const {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = lane_row(r);
      if (row >= block.rows_total) continue;
      store_lane_row<T, kD>(grad_q + rows.row_of_group_row(b, g, row) * d, a.dq, r, lane.quad, d, scale);
    }
  }
};

}  // namespace hk

// kPlain: no score modifier, no tensor mask, no dropout.
template <typename T, int kD, bool kPlain, int kStages>
__global__ void __launch_bounds__(hk::kThreads, 1)
attention_hopper_dq_kernel(const FUSEDLLM_GRID_CONSTANT hopper::TensorMap map_q,
                           const FUSEDLLM_GRID_CONSTANT hopper::TensorMap map_do,
                           const FUSEDLLM_GRID_CONSTANT hopper::TensorMap map_o,
                           const FUSEDLLM_GRID_CONSTANT hopper::TensorMap map_k,
                           const FUSEDLLM_GRID_CONSTANT hopper::TensorMap map_v, const float* __restrict__ lse,
                           float* __restrict__ delta, T* __restrict__ grad_q, attn::QueryRows rows,
                           attn::Seqs seqs, int d, float scale, Mask mask_all, ScoreExtras extras,
                           hk::HeadsInner heads_inner, hk::RowOrder order) {
  using L = hk::DqLayout<kD, kStages>;
  constexpr int kBoxes = kD / hk::kBox;
  using Consumer = hk::DqConsumer<T, kD, kPlain, kStages>;
  const hk::DqSmem<kD, kStages> smem(dynamic_shared<unsigned char>());
  const hk::KvRing<kStages>& ring = smem.kv.ring;

  const int64_t g = blockIdx.y, b = blockIdx.z;
  const int64_t sq = seqs.q_len(b);
  tc::QueryBlock<hk::kRows, L::kKeys> block(rows, sq);
  if (block.empty()) return;  // past this (packed) sequence's end: the whole block
  const Mask mask = mask_all.of_lengths(sq, seqs.k_len(b));
  block.find_keys(mask, rows);

  const int tid = threadIdx.x;
  if (tid == 0) ring.init();
  __syncthreads();
  const int warpgroup = __shfl_sync(kFullMask, tid / 128, 0);

  if (warpgroup == 0) {  // producer
    hopper::setmaxnreg<24, false>();
    if (tid == 0 && block.n_tiles > 0) {
      const int32_t pos0 = static_cast<int32_t>(seqs.q_start(b) + rows.group_pos(block.row0));
      const auto map_b = static_cast<int32_t>(seqs.packed() ? 0 : b);  // packed: one [1, H, total, D] tensor
      const auto head0 = static_cast<int32_t>(g * rows.group);
      hopper::mbarrier_arrive_expect_tx(ring.q_full, 3 * L::kQBytes);
      hk::load_query_rows<kBoxes>(smem.q_s, map_q, heads_inner.q, order, ring.q_full, pos0, head0, map_b);
      hk::load_query_rows<kBoxes>(smem.do_s, map_do, heads_inner.dout, order, ring.q_full, pos0, head0, map_b);
      hk::load_query_rows<kBoxes>(smem.o_s, map_o, heads_inner.out, order, ring.q_full, pos0, head0, map_b);
      ring.template produce<kBoxes, L::kKeys>(0, block.n_tiles, seqs.k_start(b) + block.key_lo,
                                              static_cast<int32_t>(g), map_b, map_k, map_v, heads_inner, smem.kv);
    }
    return;
  }

  hopper::setmaxnreg<240, true>();
  const hk::ConsumerLane lane(tid - 128 * warpgroup, warpgroup - 1);
  // This lane's rows and the keys each sees (hk::LaneRows), and its lse.
  const hk::LaneRows<L::kKeys> my_rows(block, order, rows, mask, lane);
  typename Consumer::Acc a;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = block.row0 + my_rows.row_offset[r];
    a.lse[r] = row < block.rows_total
                   ? attn::ScalarOps<float>::finite_or_zero(lse[rows.row_of_group_row(b, g, row)])
                   : 0.f;
  }
  const bool unmodified = kPlain || (!extras.mods.any_score_mod() && !extras.mask.present());
  const hk::FullTiles<kPlain, L::kKeys> full(my_rows);
  const Consumer c{smem, block, my_rows, full, lane, rows, mask, extras, scale, g, b, unmodified};
  c.find_deltas(a, delta);
#pragma unroll
  for (float& x : a.dq) x = 0.f;
  if constexpr (kPlain) {
    c.overlapped_tiles(a);
  } else {
    c.serial_tiles(a);
  }
  c.store_rows(a, grad_q, d);
}

FUSEDLLM_ATTENTION_KERNEL_NOTE(attention_hopper_dq_kernel,
                               "wgmma and TMA: bfloat16/float16, head dims up to 64, 128 in plain calls, sm_90a")

namespace hk {

// The dK/dV block's shared memory: K, V, each stage's Q and dO tiles, the
// tiles' statistics (double-buffered), the mbarriers.
template <int kD>
struct DkdvSmem {
  using L = DkdvLayout<kD>;
  unsigned char *k_s, *v_s;
  unsigned char* rows_s;  // stage s: Q at 2 s tiles, dO after it
  float* stats_s;
  uint64_t *kv_full, *full, *empty, *stats_full, *stats_empty;

  __device__ __forceinline__ explicit DkdvSmem(unsigned char* raw)
      : k_s(raw + (1024 - hopper::shared_address(raw) % 1024) % 1024), v_s(k_s + L::kKeyBytes),
        rows_s(v_s + L::kKeyBytes), stats_s(reinterpret_cast<float*>(rows_s + 2 * kStages * L::kTileBytes)),
        kv_full(reinterpret_cast<uint64_t*>(reinterpret_cast<unsigned char*>(stats_s) + L::kStatsBytes)),
        full(kv_full + 1), empty(full + kStages), stats_full(empty + kStages), stats_empty(stats_full + 2) {}
  // By thread 0, before the block's __syncthreads.
  __device__ __forceinline__ void init() const {
    hopper::mbarrier_init(kv_full, 1);
    for (int s = 0; s < kStages; ++s) {
      hopper::mbarrier_init(&full[s], 1);
      hopper::mbarrier_init(&empty[s], kConsumers * 128);
    }
    for (int buf = 0; buf < 2; ++buf) {
      hopper::mbarrier_init(&stats_full[buf], 32);
      hopper::mbarrier_init(&stats_empty[buf], kConsumers * 128);
    }
    hopper::mbarrier_init_fence();
  }
  // Statistics buffer `buf`: lse, delta, and the position of each shared row
  // of its tile (-1 past the positions that see a key).
  __device__ __forceinline__ float* lse_s(int buf) const { return stats_s + buf * 3 * kTileRows; }
  __device__ __forceinline__ float* delta_s(int buf) const { return lse_s(buf) + kTileRows; }
  __device__ __forceinline__ int* pos_s(int buf) const { return reinterpret_cast<int*>(lse_s(buf) + 2 * kTileRows); }
  __device__ __forceinline__ unsigned char* q_tile(int stage) const { return rows_s + 2 * stage * L::kTileBytes; }
  __device__ __forceinline__ unsigned char* do_tile(int stage) const {
    return rows_s + (2 * stage + 1) * L::kTileBytes;
  }
};

// A dK/dV block's keys j0.. of kv head g of sequence b (grid y and z; empty
// past the sequence's keys) and the positions that see any of them, P = 64 /
// G of them a tile.
struct KeyBlock {
  int64_t g, b, sq, sk, j0;
  int64_t j_end = 0, pos_begin = 0, pos_end = 0, n_tiles = 0;
  int positions = 0;
  Mask mask;

  __device__ __forceinline__ explicit KeyBlock(const attn::Seqs& seqs)
      : g(blockIdx.y), b(blockIdx.z), sq(seqs.q_len(b)), sk(seqs.k_len(b)),
        j0(static_cast<int64_t>(blockIdx.x) * kRows) {}
  __device__ __forceinline__ bool empty() const { return j0 >= sk; }
  __device__ __forceinline__ void find_positions(const Mask& mask_all, const RowOrder& order) {
    j_end = j0 + kRows < sk ? j0 + kRows : sk;
    mask = mask_all.of_lengths(sq, sk);
    pos_begin = attn::query_begin(mask, j0, sq), pos_end = attn::query_end(mask, j_end, sq);
    positions = 1 << order.positions_log2;
    n_tiles = pos_end > pos_begin ? (pos_end - pos_begin + positions - 1) / positions : 0;
  }
};

// The producer's thread: the block's K and V, then each tile's Q and dO
// once its consumers freed the stage.
template <int kD>
__device__ __forceinline__ void produce_tiles(const DkdvSmem<kD>& smem, const KeyBlock& block,
                                              const hopper::TensorMap& map_q, const hopper::TensorMap& map_do,
                                              const hopper::TensorMap& map_k, const hopper::TensorMap& map_v,
                                              const attn::QueryRows& rows, const attn::Seqs& seqs,
                                              const HeadsInner& heads_inner, const RowOrder& order) {
  using L = DkdvLayout<kD>;
  constexpr int kBoxes = kD / kBox;
  const int64_t g = block.g, b = block.b;
  const auto map_b = static_cast<int32_t>(seqs.packed() ? 0 : b);  // packed: one [1, H, total, D] tensor
  const auto key0 = static_cast<int32_t>(seqs.k_start(b) + block.j0);
  hopper::mbarrier_arrive_expect_tx(smem.kv_full, 2 * L::kKeyBytes);
  load_key_rows<kBoxes, kRows>(smem.k_s, map_k, heads_inner.k, smem.kv_full, key0, static_cast<int32_t>(g), map_b);
  load_key_rows<kBoxes, kRows>(smem.v_s, map_v, heads_inner.v, smem.kv_full, key0, static_cast<int32_t>(g), map_b);
  const int64_t pos_start = seqs.q_start(b) + block.pos_begin;
  const auto head0 = static_cast<int32_t>(g * rows.group);
  for (int64_t tile = 0; tile < block.n_tiles; ++tile) {
    const int stage = static_cast<int>(tile % kStages);
    const unsigned round = static_cast<unsigned>(tile / kStages);
    hopper::mbarrier_wait(&smem.empty[stage], (round & 1u) ^ 1u);
    const auto pos0 = static_cast<int32_t>(pos_start + tile * block.positions);
    hopper::mbarrier_arrive_expect_tx(&smem.full[stage], 2 * L::kTileBytes);
    load_query_rows<kBoxes>(smem.q_tile(stage), map_q, heads_inner.q, order, &smem.full[stage], pos0, head0, map_b);
    load_query_rows<kBoxes>(smem.do_tile(stage), map_do, heads_inner.dout, order, &smem.full[stage], pos0, head0,
                            map_b);
  }
}

// The producer's warp 1 (lane its lane): the tiles' statistics a buffer
// ahead, read from global memory here so that no consumer waits on the loads
// (they were the consumers' longest wait): both consumers read a buffer, then
// free it. Each lane takes two rows of a tile, their offsets worked out once:
// this code has 24 registers (setmaxnreg).
template <int kD>
__device__ __forceinline__ void produce_stats(const DkdvSmem<kD>& smem, const KeyBlock& block,
                                              const float* lse, const float* delta, const attn::QueryRows& rows,
                                              const RowOrder& order, int lane) {
  static_assert(kTileRows == 64, "two rows a lane");
  const int64_t pos_begin = block.pos_begin;
  const auto span = static_cast<int32_t>(block.pos_end - pos_begin), first = static_cast<int32_t>(pos_begin);
  int64_t row_at[2];  // the lse / delta row of the lane's rows at the tile's first position pos_begin
  int32_t offset[2];  // their positions from the tile's first
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    offset[r] = order.pos_of(lane + 32 * r);
    row_at[r] = rows.row(block.b, block.g * rows.group + order.head_of(lane + 32 * r), pos_begin);
  }
  for (int32_t tile = 0; tile < static_cast<int32_t>(block.n_tiles); ++tile) {
    const int buf = tile % 2;
    hopper::mbarrier_wait(&smem.stats_empty[buf], (static_cast<unsigned>(tile / 2) & 1u) ^ 1u);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int32_t at = tile * block.positions + offset[r];  // from pos_begin
      const bool valid = at < span;
      const int i = lane + 32 * r;
      smem.lse_s(buf)[i] = valid ? attn::ScalarOps<float>::finite_or_zero(lse[row_at[r] + at]) : 0.f;
      smem.delta_s(buf)[i] = valid ? delta[row_at[r] + at] : 0.f;
      smem.pos_s(buf)[i] = valid ? first + at : -1;
    }
    hopper::mbarrier_arrive(&smem.stats_full[buf]);
  }
}

// A dK/dV consumer thread's work: the steps of a tile of query rows, whose
// products accumulate into dK and dV (hopper.cuh's layout).
template <typename T, int kD, bool kPlain>
struct DkdvConsumer {
  static constexpr int kBoxes = kD / kBox;
  static constexpr int kTile = kTileRows;
  const DkdvSmem<kD>& smem;
  const KeyBlock& block;
  const ConsumerLane& lane;
  const attn::QueryRows& rows;
  const ScoreExtras& extras;
  const RowOrder& order;
  float scale;
  bool unmodified;  // no score modifier, no tensor mask
  int64_t warp_j0;  // the first of its warp's keys

  // S^T = K Q^T and dP^T = V dO^T of a tile (this lane's keys x the tile's
  // rows), once its Q, dO and statistics have landed.
  __device__ __forceinline__ void scores(float (&s)[kTile / 2], float (&dp)[kTile / 2], int stage, int buf,
                                         int64_t tile) const {
    hopper::mbarrier_wait(&smem.full[stage], static_cast<unsigned>(tile / kStages) & 1u);
    // (a wait between the products' issue and their completion spilled their accumulators)
    hopper::mbarrier_wait(&smem.stats_full[buf], static_cast<unsigned>(tile / 2) & 1u);
    hopper::fence_operand(s);
    hopper::fence_operand(dp);
    hopper::wgmma_fence();
    issue_k_major<T, kD, kTile>(s, smem.k_s, kRows, lane.consumer * 64, smem.q_tile(stage), kTile, 0);
    issue_k_major<T, kD, kTile>(dp, smem.v_s, kRows, lane.consumer * 64, smem.do_tile(stage), kTile, 0);
    hopper::wgmma_commit();
    hopper::wgmma_wait<0>();
    hopper::fence_operand(s);
    hopper::fence_operand(dp);
  }
  // s becomes P^T (after dropout), dp dS^T (through the cap's slope), for
  // the tile whose first position is p0.
  __device__ __forceinline__ void score_gradients(float (&s)[kTile / 2], float (&dp)[kTile / 2], int buf,
                                                  int64_t p0) const {
    const Mask& mask = block.mask;
    const int64_t p_last = p0 + block.positions - 1;
    // Every row of the tile sees every key of this warp: its first
    // position's range ends after them and its last position's begins before them.
    const bool inside = kPlain && p_last < block.pos_end && warp_j0 + 16 <= block.j_end &&
                        warp_j0 + 16 <= attn::key_end(mask, p0) && warp_j0 >= attn::key_begin(mask, p_last);
    if (inside) {
#pragma unroll
      for (int e = 0; e < kTile / 2; ++e) {
        const int col = 8 * (e / 4) + 2 * lane.quad + e % 2;
        const float p = tc::exp_of_difference(s[e] * scale, smem.lse_s(buf)[col]);
        dp[e] = attn::score_grad(p, dp[e], smem.delta_s(buf)[col]);
        s[e] = p;
      }
    } else {
#pragma unroll
      for (int e = 0; e < kTile / 2; ++e) {
        const int col = 8 * (e / 4) + 2 * lane.quad + e % 2;
        const int64_t key = warp_j0 + lane.group + 8 * ((e / 2) % 2);
        const int pos = smem.pos_s(buf)[col];
        const int64_t head = block.g * rows.group + order.head_of(col);
        const bool visible = pos >= 0 && key < block.j_end && key >= attn::key_begin(mask, pos) &&
                             key < attn::key_end(mask, pos);
        float dcap;
        const float x = tc::score(s[e], visible, unmodified, scale, extras, mask, block.b, head, pos, key, &dcap);
        const float p = tc::exp_of_difference(x, smem.lse_s(buf)[col]);
        float keep = 1.f;
        if (!kPlain && extras.drop.enabled && visible) keep = extras.keep_factor<float>(block.b, head, pos, key);
        const float dpe = visible ? dp[e] * keep : 0.f;
        dp[e] = attn::score_grad(p, dpe, smem.delta_s(buf)[col]) * dcap;
        s[e] = p * keep;  // dV sees the probabilities after dropout
      }
    }
  }
  // Zeros the rows past the positions that see a key (the last tile's, a
  // packed neighbour's) of the tile whose first position is p0: dV and dK
  // sum over dO's and Q's rows.
  __device__ __forceinline__ void zero_rows_past_end(int stage, int64_t p0) const {
    unsigned char* q_tile = smem.q_tile(stage);
    unsigned char* do_tile = smem.do_tile(stage);
    const int first_pos = static_cast<int>(block.pos_end - p0);
    if (order.pos_major) {
      zero_rows_from<kBoxes>(q_tile, kTile, first_pos << order.group_log2, lane.t);
      zero_rows_from<kBoxes>(do_tile, kTile, first_pos << order.group_log2, lane.t);
    } else {
      for (int c = lane.t; c < kBoxes * kTile * 8; c += 128) {  // 16-byte chunks of rows whose position is past
        const int box = c / (kTile * 8), row = (c / 8) % kTile, chunk = c % 8;
        if (order.pos_of(row) < first_pos) continue;
        const int at = (box * kTile + row) * 128 + chunk * 16;
        *reinterpret_cast<Pack<uint32_t, 4>*>(q_tile + at) = Pack<uint32_t, 4>{{0u, 0u, 0u, 0u}};
        *reinterpret_cast<Pack<uint32_t, 4>*>(do_tile + at) = Pack<uint32_t, 4>{{0u, 0u, 0u, 0u}};
      }
    }
    hopper::fence_proxy_async();
    hopper::named_barrier_sync(1 + lane.consumer, 128);
  }
  // dV += P^T dO and dK += dS^T Q (dO and Q read MN-major), waited for.
  __device__ __forceinline__ void accumulate(float (&dk)[kD / 2], float (&dv)[kD / 2], const float (&s)[kTile / 2],
                                             const float (&dp)[kTile / 2], int stage) const {
    mma::FragA pa[kTile / 16], dsa[kTile / 16];
    accumulators_to_frags<T, kTile>(s, pa);
    accumulators_to_frags<T, kTile>(dp, dsa);
    hopper::fence_operand(dv);
    hopper::fence_operand(dk);
#pragma unroll
    for (int i = 0; i < kTile / 16; ++i) hopper::fence_operand(pa[i]), hopper::fence_operand(dsa[i]);
    hopper::wgmma_fence();
    issue_mn_major<T, kD>(dv, pa, smem.do_tile(stage), kTile);
    issue_mn_major<T, kD>(dk, dsa, smem.q_tile(stage), kTile);
    hopper::wgmma_commit();
    hopper::wgmma_wait<0>();
    hopper::fence_operand(dv);
    hopper::fence_operand(dk);
#pragma unroll
    for (int i = 0; i < kTile / 16; ++i) hopper::fence_operand(pa[i]), hopper::fence_operand(dsa[i]);
  }
  __device__ __forceinline__ void store_rows(const float (&dk)[kD / 2], const float (&dv)[kD / 2], T* grad_k,
                                             T* grad_v, const attn::KeyRows& key_rows, int d) const {
    const int64_t kv_row0 = key_rows.row(block.b, block.g, 0);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t key = warp_j0 + lane.group + 8 * r;
      if (key >= block.j_end) continue;
      store_lane_row<T, kD>(grad_k + (kv_row0 + key) * d, dk, r, lane.quad, d, scale);
      store_lane_row<T, kD>(grad_v + (kv_row0 + key) * d, dv, r, lane.quad, d, 1.f);
    }
  }
};

}  // namespace hk

template <typename T, int kD, bool kPlain>
__global__ void __launch_bounds__(hk::kThreads, 1)
attention_hopper_dkdv_kernel(const FUSEDLLM_GRID_CONSTANT hopper::TensorMap map_q,
                             const FUSEDLLM_GRID_CONSTANT hopper::TensorMap map_do,
                             const FUSEDLLM_GRID_CONSTANT hopper::TensorMap map_k,
                             const FUSEDLLM_GRID_CONSTANT hopper::TensorMap map_v, const float* __restrict__ lse,
                             const float* __restrict__ delta, T* __restrict__ grad_k, T* __restrict__ grad_v,
                             attn::QueryRows rows, attn::KeyRows key_rows, attn::Seqs seqs, int d, float scale,
                             Mask mask_all, ScoreExtras extras, hk::HeadsInner heads_inner, hk::RowOrder order) {
  const hk::DkdvSmem<kD> smem(dynamic_shared<unsigned char>());
  hk::KeyBlock block(seqs);
  if (block.empty()) return;  // past this (packed) sequence's end: the whole block
  block.find_positions(mask_all, order);

  const int tid = threadIdx.x;
  if (tid == 0) smem.init();
  __syncthreads();
  const int warpgroup = __shfl_sync(kFullMask, tid / 128, 0);

  if (warpgroup == 0) {  // producer: thread 0 the TMA loads, warp 1 the tiles' statistics
    hopper::setmaxnreg<24, false>();
    if (tid == 0 && block.n_tiles > 0) {
      hk::produce_tiles(smem, block, map_q, map_do, map_k, map_v, rows, seqs, heads_inner, order);
    } else if (tid / 32 == 1 && block.n_tiles > 0) {
      hk::produce_stats(smem, block, lse, delta, rows, order, tid % 32);
    }
    return;
  }

  hopper::setmaxnreg<240, true>();
  const hk::ConsumerLane lane(tid - 128 * warpgroup, warpgroup - 1);
  const bool unmodified = kPlain || (!extras.mods.any_score_mod() && !extras.mask.present());
  // This lane's keys (r = 0, 1: keys `group` and group + 8 of its warp's 16)
  // and its warp's 16.
  const int64_t warp_j0 = block.j0 + lane.consumer * 64 + lane.warp * 16;
  const hk::DkdvConsumer<T, kD, kPlain> c{smem, block, lane, rows, extras, order, scale, unmodified, warp_j0};
  float dk[kD / 2], dv[kD / 2];
#pragma unroll
  for (int e = 0; e < kD / 2; ++e) dk[e] = 0.f, dv[e] = 0.f;
  if (block.n_tiles > 0) hopper::mbarrier_wait(smem.kv_full, 0);
  for (int64_t tile = 0; tile < block.n_tiles; ++tile) {
    const int stage = static_cast<int>(tile % hk::kStages), buf = static_cast<int>(tile % 2);
    const int64_t p0 = block.pos_begin + tile * block.positions;  // the tile's first position
    float s[hk::kTileRows / 2], dp[hk::kTileRows / 2];  // S^T and dP^T: this lane's keys x the tile's rows
    c.scores(s, dp, stage, buf, tile);
    const int64_t p_last = p0 + block.positions - 1;
    c.score_gradients(s, dp, buf, p0);
    hopper::mbarrier_arrive(&smem.stats_empty[buf]);  // the statistics' last reader
    if (p_last >= block.pos_end) c.zero_rows_past_end(stage, p0);
    c.accumulate(dk, dv, s, dp, stage);
    hopper::mbarrier_arrive(&smem.empty[stage]);
  }
  c.store_rows(dk, dv, grad_k, grad_v, key_rows, d);
}

FUSEDLLM_ATTENTION_KERNEL_NOTE(attention_hopper_dkdv_kernel,
                               "wgmma and TMA: bfloat16/float16, head dims up to 64, 128 in plain calls, sm_90a")

}  // namespace

bool launch_attention_hopper_backward(const AttentionBackwardPlan& p, const at::Tensor& delta, Stream stream) {
  const AttentionShape& s = p.shape;
  const at::ScalarType dtype = p.q.scalar_type();
  const ScoreExtras extras = extras_of(p);
  const bool plain = !extras.mods.any_score_mod() && !extras.mask.present() && !extras.drop.enabled;
  const hk::AttentionMap q_map(p.q), do_map(p.grad_out), o_map(p.out), k_map(p.k), v_map(p.v);
  // dQ takes three K/V stages where they fit (head dim 64 everywhere, 128 on an sm_90), else two.
  const size_t optin = device_properties().sharedMemPerBlockOptin;
  const bool dq_three = s.head_dim <= 64 || hk::DqLayout<128, 3>::smem() <= optin;
  const size_t smem = s.head_dim <= 64 ? std::max(hk::DqLayout<64, 3>::smem(), hk::DkdvLayout<64>::smem())
                                       : std::max(hk::DqLayout<128, 2>::smem(), hk::DkdvLayout<128>::smem());
  // At head dim 128 the general scoring (modifiers, masks, dropout) spilled
  // in dK/dV beside its 128 registers of dK and dV: those calls keep the
  // mma.sync backward.
  if ((dtype != at::kBFloat16 && dtype != at::kHalf) || s.head_dim > hk::kBwdMaxHeadDim ||
      (s.head_dim > 64 && !plain) || smem > optin ||
      hk::kTileRows % p.rows.group != 0 || !q_map.ok || !do_map.ok || !o_map.ok || !k_map.ok || !v_map.ok) {
    return false;
  }
  const attn::QueryRows rows = rows_of(p);
  const int group = static_cast<int>(rows.group);
  hk::RowOrder dq_order, dkdv_order;  // of dQ's 128-row blocks, of dK/dV's 64-row tiles
  if (!hk::row_order({&q_map, &do_map, &o_map}, q_map, group, hk::kRows, dq_order) ||
      !hk::row_order({&q_map, &do_map}, q_map, group, hk::kTileRows, dkdv_order)) {
    return false;
  }
  const hk::HeadsInner heads_inner{q_map.heads_inner, k_map.heads_inner, v_map.heads_inner, do_map.heads_inner,
                                   o_map.heads_inner};
  tc::with_mma_dtype(dtype, [&](auto dtype_tag) {
    using T = decltype(dtype_tag);
    const auto run = [&](auto D, auto kPlain, auto kDqStages) {
      constexpr int kD = decltype(D)::value;
      constexpr bool kIsPlain = decltype(kPlain)::value;
      using Dq = hk::DqLayout<kD, decltype(kDqStages)::value>;
      {  // dQ: blocks of 128 query rows
        const hk::RowOrder& order = dq_order;
        const int positions = hk::kRows / group;
        auto kernel = attention_hopper_dq_kernel<T, kD, kIsPlain, Dq::kStages>;
        allow_shared_memory(kernel, Dq::smem());
        const dim3 grid(static_cast<unsigned>((rows.group_rows() + hk::kRows - 1) / hk::kRows),
                        static_cast<unsigned>(s.kv_heads), static_cast<unsigned>(s.batch));
        launch("attention_hopper_dq_kernel", kernel, grid, hk::kThreads, Dq::smem(), stream,
               q_map.encode_rows(p.q, order.pos_major, group, positions),
               do_map.encode_rows(p.grad_out, order.pos_major, group, positions),
               o_map.encode_rows(p.out, order.pos_major, group, positions), k_map.encode(p.k, 1, Dq::kKeys),
               v_map.encode(p.v, 1, Dq::kKeys), p.lse.const_data_ptr<float>(), delta.mutable_data_ptr<float>(),
               p.grad_q.mutable_data_ptr<T>(), rows, p.seqs,
               static_cast<int>(s.head_dim), static_cast<float>(p.scale), p.mask, extras, heads_inner, order);
      }
      {  // dK, dV: blocks of 128 keys, tiles of 64 query rows
        const hk::RowOrder& order = dkdv_order;
        const int positions = hk::kTileRows / group;
        auto kernel = attention_hopper_dkdv_kernel<T, kD, kIsPlain>;
        const size_t bytes = hk::DkdvLayout<kD>::smem();
        allow_shared_memory(kernel, bytes);
        // Sized by the longest sequence's keys (packed); shorter ones return early.
        const dim3 grid(static_cast<unsigned>((s.sk + hk::kRows - 1) / hk::kRows),
                        static_cast<unsigned>(s.kv_heads), static_cast<unsigned>(s.batch));
        launch("attention_hopper_dkdv_kernel", kernel, grid, hk::kThreads, bytes, stream,
               q_map.encode_rows(p.q, order.pos_major, group, positions),
               do_map.encode_rows(p.grad_out, order.pos_major, group, positions), k_map.encode(p.k, 1, hk::kRows),
               v_map.encode(p.v, 1, hk::kRows), p.lse.const_data_ptr<float>(), delta.const_data_ptr<float>(),
               p.grad_k.mutable_data_ptr<T>(), p.grad_v.mutable_data_ptr<T>(), rows, p.key_rows, p.seqs,
               static_cast<int>(s.head_dim), static_cast<float>(p.scale), p.mask, extras, heads_inner, order);
      }
    };
    using Three = std::integral_constant<int, 3>;
    if (s.head_dim <= 64) {
      plain ? run(std::integral_constant<int, 64>{}, std::true_type{}, Three{})
            : run(std::integral_constant<int, 64>{}, std::false_type{}, Three{});
    } else if (dq_three) {  // plain, as checked above
      run(std::integral_constant<int, 128>{}, std::true_type{}, Three{});
    } else {
      run(std::integral_constant<int, 128>{}, std::true_type{}, std::integral_constant<int, 2>{});
    }
  });
  return true;
}

}  // namespace fusedllm::cuda
