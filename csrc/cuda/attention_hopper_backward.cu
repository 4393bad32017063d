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
  using hopper::Major;
  using L = hk::DqLayout<kD, kStages>;
  constexpr int kBoxes = kD / hk::kBox;
  constexpr int kKeys = L::kKeys;
  unsigned char* raw = dynamic_shared<unsigned char>();
  unsigned char* q_s = raw + (1024 - hopper::shared_address(raw) % 1024) % 1024;
  unsigned char* do_s = q_s + L::kQBytes;
  unsigned char* o_s = do_s + L::kQBytes;
  unsigned char* kv_s = o_s + L::kQBytes;  // stage s: K at 2 s tiles, V after it
  const hk::KvRing<kStages> ring(reinterpret_cast<uint64_t*>(kv_s + 2 * kStages * L::kTileBytes));
  const auto k_tile = [&](int stage) { return kv_s + 2 * stage * L::kTileBytes; };
  const auto v_tile = [&](int stage) { return kv_s + (2 * stage + 1) * L::kTileBytes; };

  const int64_t g = blockIdx.y, b = blockIdx.z;
  const int64_t sq = seqs.q_len(b);
  tc::QueryBlock<hk::kRows, kKeys> block(rows, sq);
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
      hk::load_query_rows<kBoxes>(q_s, map_q, heads_inner.q, order, ring.q_full, pos0, head0, map_b);
      hk::load_query_rows<kBoxes>(do_s, map_do, heads_inner.dout, order, ring.q_full, pos0, head0, map_b);
      hk::load_query_rows<kBoxes>(o_s, map_o, heads_inner.out, order, ring.q_full, pos0, head0, map_b);
      ring.template produce<kBoxes, kKeys>(0, block.n_tiles, seqs.k_start(b) + block.key_lo, static_cast<int32_t>(g),
                                           map_b, map_k, map_v, heads_inner, k_tile, v_tile);
    }
    return;
  }

  hopper::setmaxnreg<240, true>();
  const int t = tid - 128 * warpgroup, warp = t / 32, group = (t % 32) / 4, quad = t % 4;
  const int consumer = warpgroup - 1;
  // This lane's rows and the keys each sees (hk::lane_rows), and its lse.
  int row_offset[2], lo[2], hi[2];
  hk::lane_rows(block, order, rows, mask, consumer * 64 + warp * 16 + group, row_offset, lo, hi);
  const auto lane_row = [&](int r) { return block.row0 + row_offset[r]; };
  float lse_row[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = lane_row(r);
    lse_row[r] = row < block.rows_total
                     ? attn::ScalarOps<float>::finite_or_zero(lse[rows.row_of_group_row(b, g, row)])
                     : 0.f;
  }
  const bool unmodified = kPlain || (!extras.mods.any_score_mod() && !extras.mask.present());
  // The tiles whose every key both rows see: a plain call scores them without testing each key.
  const int full_lo = kPlain ? hk::first_full_tile<kKeys>(lo, hi) : 0;
  const int full_hi = kPlain ? hk::end_full_tile<kKeys>(lo, hi) : 0;

  // delta of this lane's rows (0 where the block sees no key: its rows' outputs are 0).
  float dlt[2] = {0.f, 0.f};
  if (block.n_tiles > 0) {
    hopper::mbarrier_wait(ring.q_full, 0);
    float c[32];  // dO O^T of this consumer's 64 rows
    hopper::fence_operand(c);
    hopper::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      hopper::wgmma<T, 64, Major::kK, Major::kK>(c, hk::k_major(do_s, hk::kRows, consumer * 64, ks),
                                                 hk::k_major(o_s, hk::kRows, consumer * 64, ks), ks > 0);
    }
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
        if (e / 4 == 2 * warp + r && (e / 2) % 2 == r && e % 2 == group % 2) diagonal = c[e];
      }
      dlt[r] = __shfl_sync(kFullMask, diagonal, 4 * group + group / 2);
    }
  }
  if (quad == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (lane_row(r) < block.rows_total) delta[rows.row_of_group_row(b, g, lane_row(r))] = dlt[r];
    }
  }

  float dq[kD / 2], s[kKeys / 2], dp[kKeys / 2];
  mma::FragA ds[kKeys / 16];
#pragma unroll
  for (float& x : dq) x = 0.f;
  const auto stage_of = [](int64_t tile) { return static_cast<int>(tile % kStages); };
  // S = Q K^T and dP = dO V^T of a tile, issued and committed once its K and V have landed.
  const auto issue_scores = [&](int64_t tile) {
    const int stage = stage_of(tile);
    ring.wait_keys(tile);
    ring.wait_values(tile);
    hopper::fence_operand(s);
    hopper::fence_operand(dp);
    hopper::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      hopper::wgmma<T, kKeys, Major::kK, Major::kK>(s, hk::k_major(q_s, hk::kRows, consumer * 64, ks),
                                                    hk::k_major(k_tile(stage), kKeys, 0, ks), ks > 0);
    }
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      hopper::wgmma<T, kKeys, Major::kK, Major::kK>(dp, hk::k_major(do_s, hk::kRows, consumer * 64, ks),
                                                    hk::k_major(v_tile(stage), kKeys, 0, ks), ks > 0);
    }
    hopper::wgmma_commit();
  };
  // After the wait for a tile's S and dP: their registers are read from here
  // on, and its V is free (dQ reads K alone).
  const auto scores_done = [&](int64_t tile) {
    hopper::fence_operand(s);
    hopper::fence_operand(dp);
    ring.release_values(tile);
  };
  // s becomes dS = P (dP - delta) (through the cap's slope).
  const auto score_gradients = [&](int64_t tile) {
    if (tile >= full_lo && tile < full_hi) {
#pragma unroll
      for (int e = 0; e < kKeys / 2; ++e) {
        const int r = (e / 2) % 2;
        const float p = tc::exp_of_difference(s[e] * scale, lse_row[r]);
        s[e] = attn::score_grad(p, dp[e], dlt[r]);
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
          const int key = static_cast<int>(tile) * kKeys + 8 * j + 2 * quad + c;  // from key_lo
          const bool visible = key >= lo[r] && key < hi[r];
          float dcap;
          const float x = tc::score(s[e], visible, unmodified, scale, extras, mask, b, head, pos,
                                    block.key_lo + key, &dcap);
          const float p = tc::exp_of_difference(x, lse_row[r]);
          float dpe = visible ? dp[e] : 0.f;
          if (!kPlain && extras.drop.enabled && visible) {
            dpe *= extras.keep_factor<float>(b, head, pos, block.key_lo + key);
          }
          s[e] = attn::score_grad(p, dpe, dlt[r]) * dcap;
        }
      }
    }
  };
  // dQ += dS K of the tile whose dS is in ds, committed. K rows past the
  // block's last visible key are zeroed first: the product sums over them.
  const auto issue_dq = [&](int64_t tile) {
    const int stage = stage_of(tile);
    const int64_t visible_keys = block.key_hi - (block.key_lo + tile * kKeys);
    if (visible_keys < kKeys) {
      hk::zero_rows_from<kBoxes>(k_tile(stage), kKeys, static_cast<int>(visible_keys), t);
      hopper::fence_proxy_async();
      hopper::named_barrier_sync(1 + consumer, 128);
    }
    hopper::fence_operand(dq);
#pragma unroll
    for (int i = 0; i < kKeys / 16; ++i) hopper::fence_operand(ds[i]);
    hopper::wgmma_fence();
#pragma unroll
    for (int i = 0; i < kKeys / 16; ++i) {
      hopper::wgmma<T, kD, Major::kMN>(dq, ds[i], hk::mn_major(k_tile(stage), kKeys, i), true);
    }
    hopper::wgmma_commit();
  };
  // After dQ's wait: its registers are read from here on, its K is free.
  const auto dq_done = [&](int64_t tile) {
    hopper::fence_operand(dq);
#pragma unroll
    for (int i = 0; i < kKeys / 16; ++i) hopper::fence_operand(ds[i]);
    ring.release_keys(tile);
  };
  if constexpr (kPlain) {
    // Tile j + 1's S and dP are issued before tile j's dQ += dS K, and their
    // gradients formed while it runs. Every tile but the last has a next one:
    // no product is issued under a condition, so ptxas sees which group each
    // wait completes.
    if (block.n_tiles > 0) {
      issue_scores(0);
      hopper::wgmma_wait<0>();
      scores_done(0);
      score_gradients(0);
      hk::accumulators_to_frags<T, kKeys>(s, ds);
    }
    for (int64_t tile = 0; tile + 1 < block.n_tiles; ++tile) {
      issue_scores(tile + 1);
      issue_dq(tile);
      hopper::wgmma_wait<1>();  // S and dP, not dQ
      scores_done(tile + 1);
      score_gradients(tile + 1);
      hopper::wgmma_wait<0>();
      dq_done(tile);
      hk::accumulators_to_frags<T, kKeys>(s, ds);
    }
    if (block.n_tiles > 0) {
      issue_dq(block.n_tiles - 1);
      hopper::wgmma_wait<0>();
      dq_done(block.n_tiles - 1);
    }
  } else {
    // The general scoring needs the registers the overlap would hold: one product at a time.
    for (int64_t tile = 0; tile < block.n_tiles; ++tile) {
      issue_scores(tile);
      hopper::wgmma_wait<0>();
      scores_done(tile);
      score_gradients(tile);
      hk::accumulators_to_frags<T, kKeys>(s, ds);
      issue_dq(tile);
      hopper::wgmma_wait<0>();
      dq_done(tile);
    }
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = lane_row(r);
    if (row >= block.rows_total) continue;
    hk::store_lane_row<T, kD>(grad_q + rows.row_of_group_row(b, g, row) * d, dq, r, quad, d, scale);
  }
}

template <typename T, int kD, bool kPlain>
__global__ void __launch_bounds__(hk::kThreads, 1)
attention_hopper_dkdv_kernel(const FUSEDLLM_GRID_CONSTANT hopper::TensorMap map_q,
                             const FUSEDLLM_GRID_CONSTANT hopper::TensorMap map_do,
                             const FUSEDLLM_GRID_CONSTANT hopper::TensorMap map_k,
                             const FUSEDLLM_GRID_CONSTANT hopper::TensorMap map_v, const float* __restrict__ lse,
                             const float* __restrict__ delta, T* __restrict__ grad_k, T* __restrict__ grad_v,
                             attn::QueryRows rows, attn::KeyRows key_rows, attn::Seqs seqs, int d, float scale,
                             Mask mask_all, ScoreExtras extras, hk::HeadsInner heads_inner, hk::RowOrder order) {
  using hopper::Major;
  using L = hk::DkdvLayout<kD>;
  constexpr int kBoxes = kD / hk::kBox;
  constexpr int kTile = hk::kTileRows;
  unsigned char* raw = dynamic_shared<unsigned char>();
  unsigned char* k_s = raw + (1024 - hopper::shared_address(raw) % 1024) % 1024;
  unsigned char* v_s = k_s + L::kKeyBytes;
  unsigned char* rows_s = v_s + L::kKeyBytes;  // stage s: Q at 2 s tiles, dO after it
  auto* stats_s = reinterpret_cast<float*>(rows_s + 2 * hk::kStages * L::kTileBytes);
  auto* kv_full = reinterpret_cast<uint64_t*>(reinterpret_cast<unsigned char*>(stats_s) + L::kStatsBytes);
  uint64_t* full = kv_full + 1;
  uint64_t* empty = full + hk::kStages;
  uint64_t* stats_full = empty + hk::kStages;
  uint64_t* stats_empty = stats_full + 2;
  // Statistics buffer `buf`: lse, delta, and the position of each shared row
  // of its tile (-1 past the positions that see a key).
  const auto lse_s = [&](int buf) { return stats_s + buf * 3 * kTile; };
  const auto delta_s = [&](int buf) { return lse_s(buf) + kTile; };
  const auto pos_s = [&](int buf) { return reinterpret_cast<int*>(lse_s(buf) + 2 * kTile); };
  const auto q_tile = [&](int stage) { return rows_s + 2 * stage * L::kTileBytes; };
  const auto do_tile = [&](int stage) { return rows_s + (2 * stage + 1) * L::kTileBytes; };

  const int64_t g = blockIdx.y, b = blockIdx.z;
  const int64_t sq = seqs.q_len(b), sk = seqs.k_len(b);
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * hk::kRows;
  if (j0 >= sk) return;  // past this (packed) sequence's end: the whole block
  const int64_t j_end = j0 + hk::kRows < sk ? j0 + hk::kRows : sk;
  const Mask mask = mask_all.of_lengths(sq, sk);
  // The positions that see any key of this block, P = 64 / G of them a tile.
  const int64_t pos_begin = attn::query_begin(mask, j0, sq), pos_end = attn::query_end(mask, j_end, sq);
  const int positions = 1 << order.positions_log2;
  const int64_t n_tiles = pos_end > pos_begin ? (pos_end - pos_begin + positions - 1) / positions : 0;

  const int tid = threadIdx.x;
  if (tid == 0) {
    hopper::mbarrier_init(kv_full, 1);
    for (int s = 0; s < hk::kStages; ++s) {
      hopper::mbarrier_init(&full[s], 1);
      hopper::mbarrier_init(&empty[s], hk::kConsumers * 128);
    }
    for (int buf = 0; buf < 2; ++buf) {
      hopper::mbarrier_init(&stats_full[buf], 32);
      hopper::mbarrier_init(&stats_empty[buf], hk::kConsumers * 128);
    }
    hopper::mbarrier_init_fence();
  }
  __syncthreads();
  const int warpgroup = __shfl_sync(kFullMask, tid / 128, 0);

  if (warpgroup == 0) {  // producer: thread 0 the TMA loads, warp 1 the tiles' statistics
    hopper::setmaxnreg<24, false>();
    if (tid == 0 && n_tiles > 0) {
      const auto map_b = static_cast<int32_t>(seqs.packed() ? 0 : b);  // packed: one [1, H, total, D] tensor
      const auto key0 = static_cast<int32_t>(seqs.k_start(b) + j0);
      hopper::mbarrier_arrive_expect_tx(kv_full, 2 * L::kKeyBytes);
      hk::load_key_rows<kBoxes, hk::kRows>(k_s, map_k, heads_inner.k, kv_full, key0, static_cast<int32_t>(g), map_b);
      hk::load_key_rows<kBoxes, hk::kRows>(v_s, map_v, heads_inner.v, kv_full, key0, static_cast<int32_t>(g), map_b);
      const int64_t pos_start = seqs.q_start(b) + pos_begin;
      const auto head0 = static_cast<int32_t>(g * rows.group);
      for (int64_t tile = 0; tile < n_tiles; ++tile) {
        const int stage = static_cast<int>(tile % hk::kStages);
        const unsigned round = static_cast<unsigned>(tile / hk::kStages);
        hopper::mbarrier_wait(&empty[stage], (round & 1u) ^ 1u);
        const auto pos0 = static_cast<int32_t>(pos_start + tile * positions);
        hopper::mbarrier_arrive_expect_tx(&full[stage], 2 * L::kTileBytes);
        hk::load_query_rows<kBoxes>(q_tile(stage), map_q, heads_inner.q, order, &full[stage], pos0, head0, map_b);
        hk::load_query_rows<kBoxes>(do_tile(stage), map_do, heads_inner.dout, order, &full[stage], pos0, head0,
                                    map_b);
      }
    } else if (tid / 32 == 1 && n_tiles > 0) {
      // The tiles' statistics a buffer ahead, read from global memory here so
      // that no consumer waits on the loads (they were the consumers' longest
      // wait): both consumers read a buffer, then free it. Each lane takes two
      // rows of a tile, their offsets worked out once: this code has 24
      // registers (setmaxnreg).
      static_assert(kTile == 64, "two rows a lane");
      const int lane = tid % 32;
      const auto span = static_cast<int32_t>(pos_end - pos_begin), first = static_cast<int32_t>(pos_begin);
      int64_t row_at[2];  // the lse / delta row of the lane's rows at the tile's first position pos_begin
      int32_t offset[2];  // their positions from the tile's first
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        offset[r] = order.pos_of(lane + 32 * r);
        row_at[r] = rows.row(b, g * rows.group + order.head_of(lane + 32 * r), pos_begin);
      }
      for (int32_t tile = 0; tile < static_cast<int32_t>(n_tiles); ++tile) {
        const int buf = tile % 2;
        hopper::mbarrier_wait(&stats_empty[buf], (static_cast<unsigned>(tile / 2) & 1u) ^ 1u);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int32_t at = tile * positions + offset[r];  // from pos_begin
          const bool valid = at < span;
          const int i = lane + 32 * r;
          lse_s(buf)[i] = valid ? attn::ScalarOps<float>::finite_or_zero(lse[row_at[r] + at]) : 0.f;
          delta_s(buf)[i] = valid ? delta[row_at[r] + at] : 0.f;
          pos_s(buf)[i] = valid ? first + at : -1;
        }
        hopper::mbarrier_arrive(&stats_full[buf]);
      }
    }
    return;
  }

  hopper::setmaxnreg<240, true>();
  const int t = tid - 128 * warpgroup, warp = t / 32, group = (t % 32) / 4, quad = t % 4;
  const int consumer = warpgroup - 1;
  const bool unmodified = kPlain || (!extras.mods.any_score_mod() && !extras.mask.present());
  // This lane's keys (r = 0, 1: keys `group` and group + 8 of its warp's 16)
  // and its warp's 16.
  const int64_t warp_j0 = j0 + consumer * 64 + warp * 16;

  float dk[kD / 2], dv[kD / 2];
#pragma unroll
  for (int e = 0; e < kD / 2; ++e) dk[e] = 0.f, dv[e] = 0.f;
  if (n_tiles > 0) hopper::mbarrier_wait(kv_full, 0);
  for (int64_t tile = 0; tile < n_tiles; ++tile) {
    const int stage = static_cast<int>(tile % hk::kStages), buf = static_cast<int>(tile % 2);
    const int64_t p0 = pos_begin + tile * positions;  // the tile's first position
    float s[kTile / 2], dp[kTile / 2];                 // S^T and dP^T: this lane's keys x the tile's rows
    hopper::mbarrier_wait(&full[stage], static_cast<unsigned>(tile / hk::kStages) & 1u);
    // (a wait between the products' issue and their completion spilled their accumulators)
    hopper::mbarrier_wait(&stats_full[buf], static_cast<unsigned>(tile / 2) & 1u);
    hopper::fence_operand(s);
    hopper::fence_operand(dp);
    hopper::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      hopper::wgmma<T, kTile, Major::kK, Major::kK>(s, hk::k_major(k_s, hk::kRows, consumer * 64, ks),
                                                    hk::k_major(q_tile(stage), kTile, 0, ks), ks > 0);
    }
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      hopper::wgmma<T, kTile, Major::kK, Major::kK>(dp, hk::k_major(v_s, hk::kRows, consumer * 64, ks),
                                                    hk::k_major(do_tile(stage), kTile, 0, ks), ks > 0);
    }
    hopper::wgmma_commit();
    hopper::wgmma_wait<0>();
    hopper::fence_operand(s);
    hopper::fence_operand(dp);

    // s becomes P^T (after dropout), dp dS^T (through the cap's slope).
    // Every row of the tile sees every key of this warp: its first
    // position's range ends after them and its last position's begins before them.
    const int64_t p_last = p0 + positions - 1;
    const bool inside = kPlain && p_last < pos_end && warp_j0 + 16 <= j_end &&
                        warp_j0 + 16 <= attn::key_end(mask, p0) && warp_j0 >= attn::key_begin(mask, p_last);
    if (inside) {
#pragma unroll
      for (int e = 0; e < kTile / 2; ++e) {
        const int col = 8 * (e / 4) + 2 * quad + e % 2;
        const float p = tc::exp_of_difference(s[e] * scale, lse_s(buf)[col]);
        dp[e] = attn::score_grad(p, dp[e], delta_s(buf)[col]);
        s[e] = p;
      }
    } else {
#pragma unroll
      for (int e = 0; e < kTile / 2; ++e) {
        const int col = 8 * (e / 4) + 2 * quad + e % 2;
        const int64_t key = warp_j0 + group + 8 * ((e / 2) % 2);
        const int pos = pos_s(buf)[col];
        const int64_t head = g * rows.group + order.head_of(col);
        const bool visible = pos >= 0 && key < j_end && key >= attn::key_begin(mask, pos) &&
                             key < attn::key_end(mask, pos);
        float dcap;
        const float x = tc::score(s[e], visible, unmodified, scale, extras, mask, b, head, pos, key, &dcap);
        const float p = tc::exp_of_difference(x, lse_s(buf)[col]);
        float keep = 1.f;
        if (!kPlain && extras.drop.enabled && visible) keep = extras.keep_factor<float>(b, head, pos, key);
        const float dpe = visible ? dp[e] * keep : 0.f;
        dp[e] = attn::score_grad(p, dpe, delta_s(buf)[col]) * dcap;
        s[e] = p * keep;  // dV sees the probabilities after dropout
      }
    }
    hopper::mbarrier_arrive(&stats_empty[buf]);  // the statistics' last reader
    // Rows past the positions that see a key (the last tile's, a packed
    // neighbour's): dV and dK sum over dO's and Q's rows.
    if (p_last >= pos_end) {
      const int first_pos = static_cast<int>(pos_end - p0);
      if (order.pos_major) {
        hk::zero_rows_from<kBoxes>(q_tile(stage), kTile, first_pos << order.group_log2, t);
        hk::zero_rows_from<kBoxes>(do_tile(stage), kTile, first_pos << order.group_log2, t);
      } else {
        for (int c = t; c < kBoxes * kTile * 8; c += 128) {  // 16-byte chunks of rows whose position is past
          const int box = c / (kTile * 8), row = (c / 8) % kTile, chunk = c % 8;
          if (order.pos_of(row) < first_pos) continue;
          const int at = (box * kTile + row) * 128 + chunk * 16;
          *reinterpret_cast<Pack<uint32_t, 4>*>(q_tile(stage) + at) = Pack<uint32_t, 4>{{0u, 0u, 0u, 0u}};
          *reinterpret_cast<Pack<uint32_t, 4>*>(do_tile(stage) + at) = Pack<uint32_t, 4>{{0u, 0u, 0u, 0u}};
        }
      }
      hopper::fence_proxy_async();
      hopper::named_barrier_sync(1 + consumer, 128);
    }
    mma::FragA pa[kTile / 16], dsa[kTile / 16];
    hk::accumulators_to_frags<T, kTile>(s, pa);
    hk::accumulators_to_frags<T, kTile>(dp, dsa);
    hopper::fence_operand(dv);
    hopper::fence_operand(dk);
#pragma unroll
    for (int i = 0; i < kTile / 16; ++i) hopper::fence_operand(pa[i]), hopper::fence_operand(dsa[i]);
    hopper::wgmma_fence();
#pragma unroll
    for (int i = 0; i < kTile / 16; ++i) {
      hopper::wgmma<T, kD, Major::kMN>(dv, pa[i], hk::mn_major(do_tile(stage), kTile, i), true);
    }
#pragma unroll
    for (int i = 0; i < kTile / 16; ++i) {
      hopper::wgmma<T, kD, Major::kMN>(dk, dsa[i], hk::mn_major(q_tile(stage), kTile, i), true);
    }
    hopper::wgmma_commit();
    hopper::wgmma_wait<0>();
    hopper::fence_operand(dv);
    hopper::fence_operand(dk);
#pragma unroll
    for (int i = 0; i < kTile / 16; ++i) hopper::fence_operand(pa[i]), hopper::fence_operand(dsa[i]);
    hopper::mbarrier_arrive(&empty[stage]);
  }

  const int64_t kv_row0 = key_rows.row(b, g, 0);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t key = warp_j0 + group + 8 * r;
    if (key >= j_end) continue;
    hk::store_lane_row<T, kD>(grad_k + (kv_row0 + key) * d, dk, r, quad, d, scale);
    hk::store_lane_row<T, kD>(grad_v + (kv_row0 + key) * d, dv, r, quad, d, 1.f);
  }
}

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
