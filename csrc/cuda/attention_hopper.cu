// The Hopper attention forward (bfloat16 / float16, head dims up to 128, 256 in
// plain calls; sm_90a), warp-specialized in FlashAttention-3's manner: a block
// holds 128 query rows (position, head) of one kv head and sequence, in
// QueryRows' group order, so every K/V tile serves all query heads of the
// group. Warpgroup 0 is the producer: one thread issues TMA loads of Q and of K
// and V tiles into a two-stage ring (full and empty mbarriers, K's and V's
// apart: K is freed once S is done, so the next K load overlaps P V) and the
// warpgroup gives its registers up. Warpgroups 1 and 2 are consumers, 64 rows
// each: S = Q K^T on wgmma from shared memory, the online softmax on S's
// accumulators in registers (the m16n8 accumulator layout of the mma.sync
// forward, so its per-score code serves: masks, windows, soft-capping, ALiBi,
// dropout), P rounded to 16 bits into A fragments and O += P V on wgmma with A
// from registers and V read MN-major. Every operand tile is written by TMA with
// the 128-byte swizzle: rows of 64 head-dim elements, a box per 64 of the head
// dim; a block's Q rows are a box of its group's heads at its positions,
// landing in group-row order or head by head, as the strides of q order them.
// Tiles hold 128 keys (64 at head dim 256, where the block takes 197 KiB of
// shared memory: an sm_90 GPU's, past the emulated sm_80-class device's unless
// FUSEDLLM_SIMT_SMEM_OPTIN raises it).
//
// In a plain call, tile j + 1's scores are issued before tile j's P V, and
// their softmax runs while P V is on the tensor cores (FlashAttention-3's
// intra-warpgroup overlap), the two consumers take turns issuing their
// products (its ping-pong), and the grid is persistent: a block a
// multiprocessor takes (row block, kv head, sequence) items in turn, the
// producer loading the next item's Q and K/V tiles while the consumers finish
// the last one's products and store its rows.
//
// K/V layouts TMA cannot describe keep the mma.sync forward.
#include "attention_hopper.cuh"

namespace fusedllm::cuda {
namespace {

namespace hk {

template <int kD>
struct Layout {
  // Keys of a K / V tile: at head dim 256 O takes 128 registers a thread, so
  // S gets 32 (64 keys) and the tiles fit shared memory (197 KiB).
  static constexpr int kKeys = kD <= 128 ? 128 : 64;
  static constexpr int kQBytes = kRows * kD * 2;
  static constexpr int kTileBytes = kKeys * kD * 2;  // one K or V tile
  // Q, then each stage's K and V, then the mbarriers; 1024 bytes to align the tiles.
  static constexpr size_t smem() { return 1024 + kQBytes + 2 * kStages * kTileBytes + 8 * hk::KvRing<>::kBarriers; }
};

}  // namespace hk

// kPlain: no score modifier, no tensor mask, no dropout (the visibility of
// keys in the tiles a causal or window bound cuts is the only per-score work).
template <typename T, int kD, bool kPlain>
__global__ void __launch_bounds__(hk::kThreads, 1)
attention_hopper_forward_kernel(const FUSEDLLM_GRID_CONSTANT hopper::TensorMap map_q,
                                const FUSEDLLM_GRID_CONSTANT hopper::TensorMap map_k,
                                const FUSEDLLM_GRID_CONSTANT hopper::TensorMap map_v, T* __restrict__ out,
                                float* __restrict__ lse, attn::QueryRows rows, attn::Seqs seqs, int d, float scale,
                                Mask mask_all, ScoreExtras extras, hk::HeadsInner heads_inner,
                                hk::RowOrder order, hk::WorkItems work) {
  using hopper::Major;
  using L = hk::Layout<kD>;
  constexpr int kBoxes = kD / hk::kBox;
  constexpr int kKeys = L::kKeys;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  unsigned char* raw = dynamic_shared<unsigned char>();
  unsigned char* q_s = raw + (1024 - hopper::shared_address(raw) % 1024) % 1024;
  unsigned char* kv_s = q_s + L::kQBytes;  // stage s: K at 2 s tiles, V after it
  const hk::KvRing<> ring(reinterpret_cast<uint64_t*>(kv_s + 2 * hk::kStages * L::kTileBytes));
  const auto k_tile = [&](int stage) { return kv_s + 2 * stage * L::kTileBytes; };
  const auto v_tile = [&](int stage) { return kv_s + (2 * stage + 1) * L::kTileBytes; };

  const int tid = threadIdx.x;
  if (tid == 0) ring.init();
  __syncthreads();
  // Uniform across each warp as the compiler can see: the products of a
  // branch it takes for divergent are serialised.
  const int warpgroup = __shfl_sync(kFullMask, tid / 128, 0);

  // In a plain call the block takes work items (row block, kv head,
  // sequence) one after another; the ring's stream of K/V tiles and the Q
  // tile's barriers run on across them, so that the next item's Q and first
  // tiles load while the consumers finish an item. Otherwise a block takes one
  // item (its round 0): what the loop would hold across items spilled beside
  // the general scoring's registers. Items past a (packed) sequence's end are
  // skipped by producer and consumers alike.
  constexpr int32_t kRounds = kPlain ? std::numeric_limits<int32_t>::max() : 1;
  int64_t g = 0, b = 0, sq = 0;
  bool length_ok = true;
  Mask mask = mask_all;
  const auto find_item = [&](int64_t item) {
    int64_t row_block = 0;
    work.decode(item, row_block, g, b);
    sq = seqs.q_len(b);
    tc::QueryBlock<hk::kRows, kKeys> found(rows, sq, row_block);
    if (!found.empty()) {
      length_ok = seqs.k_len_ok(b);
      mask = mask_all.of_lengths(sq, length_ok ? seqs.k_len(b) : 0);
      found.find_keys(mask, rows);
    }
    return found;
  };

  if (warpgroup == 0) {  // producer
    hopper::setmaxnreg<24, false>();
    if (tid == 0) {
      int64_t first = 0;  // the stream place of the item's first K/V tile
      int32_t served = 0;
      for (int32_t round = 0; round < kRounds && work.item(round) < work.count(); ++round) {
        const auto block = find_item(work.item(round));
        if (block.empty()) continue;
        const int32_t pos0 = static_cast<int32_t>(seqs.q_start(b) + rows.group_pos(block.row0));
        const auto map_b = static_cast<int32_t>(seqs.packed() ? 0 : b);  // packed: one [1, H, total, D] tensor
        if (served > 0) hopper::mbarrier_wait(ring.q_empty, static_cast<unsigned>(served - 1) & 1u);
        hopper::mbarrier_arrive_expect_tx(ring.q_full, L::kQBytes);
        hk::load_query_rows<kBoxes>(q_s, map_q, heads_inner.q, order, ring.q_full, pos0,
                                    static_cast<int32_t>(g * rows.group), map_b);
        ring.produce<kBoxes, kKeys>(first, block.n_tiles, seqs.k_start(b) + block.key_lo, static_cast<int32_t>(g),
                                    map_b, map_k, map_v, heads_inner, k_tile, v_tile);
        first += block.n_tiles;
        ++served;
      }
    }
    return;
  }

  hopper::setmaxnreg<240, true>();
  const int t = tid - 128 * warpgroup, warp = t / 32, group = (t % 32) / 4, quad = t % 4;
  const int consumer = warpgroup - 1;
  // Plain calls: the two consumers take turns issuing their products (named
  // barriers 1 and 2, consumer 0 first), so that one's softmax runs while the
  // other's products do; the turns run on across items.
  const int mine = 1 + consumer, theirs = 2 - consumer;
  const auto my_turn = [&] { hopper::named_barrier_sync(mine, 256); };
  const auto your_turn = [&] { hopper::named_barrier_arrive(theirs, 256); };
  if (kPlain && consumer == 1) your_turn();
  int64_t first = 0;
  int32_t served = 0;
  for (int32_t round = 0; round < kRounds && work.item(round) < work.count(); ++round) {
    const auto block = find_item(work.item(round));
    if (block.empty()) continue;
    // This lane's rows and the keys each sees (hk::lane_rows); all other row
    // values are worked out where needed: the registers go to the accumulators.
    int row_offset[2], lo[2], hi[2];
    hk::lane_rows(block, order, rows, mask, consumer * 64 + warp * 16 + group, row_offset, lo, hi);
    const auto lane_row = [&](int r) { return block.row0 + row_offset[r]; };
    // The tiles whose every key both rows see, [full_lo, full_hi): a plain call
    // scores them without testing each key.
    const int full_lo = kPlain ? hk::first_full_tile<kKeys>(lo, hi) : 0;
    const int full_hi = kPlain ? hk::end_full_tile<kKeys>(lo, hi) : 0;

    // Operand descriptors: Q and K K-major, V read MN-major (its rows are keys).
    const auto q_desc = [&](int ks) { return hk::k_major(q_s, hk::kRows, consumer * 64, ks); };
    const auto k_desc = [&](int stage, int ks) { return hk::k_major(k_tile(stage), kKeys, 0, ks); };
    const auto v_desc = [&](int stage, int step) { return hk::mn_major(v_tile(stage), kKeys, step); };

    // Accumulators in the layout of hopper.cuh: s[4 j + 2 r + c] is lane row r,
    // column 8 j + 2 quad + c (O's likewise).
    float o[kD / 2], m[2], l[2];
#pragma unroll
    for (float& x : o) x = 0.f;
#pragma unroll
    for (int r = 0; r < 2; ++r) m[r] = -kInf, l[r] = 0.f;
    const auto stage_of = [&](int64_t tile) { return static_cast<int>((first + tile) % hk::kStages); };
    const auto wait_keys = [&](int64_t tile) { ring.wait_keys(first + tile); };
    // The V tile of `tile` landed. In the tile the block's last visible key
    // cuts, the rows past it are zeroed: their probabilities are 0, but the
    // rows may hold anything (a cache's slots past a sequence's length), and
    // 0 x NaN is NaN. Both consumers write the same zeros; each fences them for
    // its own products and waits for its warpgroup's writes.
    const auto wait_values = [&](int64_t tile) {
      const int stage = stage_of(tile);
      ring.wait_values(first + tile);
      const int64_t visible = block.key_hi - (block.key_lo + tile * kKeys);
      if (visible < kKeys) {
        hk::zero_rows_from<kBoxes>(v_tile(stage), kKeys, static_cast<int>(visible), t);
        hopper::fence_proxy_async();
        hopper::named_barrier_sync(3 + consumer, 128);
      }
    };
    // S = Q K^T of a tile whose K has landed (wait_keys), issued and committed.
    const auto issue_scores = [&](float (&s)[kKeys / 2], int64_t tile) {
      const int stage = stage_of(tile);
      hopper::fence_operand(s);
      hopper::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kD / 16; ++ks) {
        hopper::wgmma<T, kKeys, Major::kK, Major::kK>(s, q_desc(ks), k_desc(stage, ks), ks > 0);
      }
      hopper::wgmma_commit();
    };
    // The online softmax of a tile's finished scores: s becomes P (after
    // dropout), m and l move on; returns in alpha what O must be scaled by.
    const auto softmax = [&](float (&s)[kKeys / 2], int64_t tile, float (&alpha)[2]) {
      float tile_max[2] = {-kInf, -kInf};
      if (tile >= full_lo && tile < full_hi) {
#pragma unroll
        for (int e = 0; e < kKeys / 2; ++e) {
          s[e] *= scale;
          tile_max[(e / 2) % 2] = fmaxf(tile_max[(e / 2) % 2], s[e]);
        }
      } else {
        const auto head_pos = [&](int r, int64_t& head, int64_t& pos) {
          head = rows.group_head(g, lane_row(r));
          pos = rows.group_pos(lane_row(r));
        };
        hk::tile_scores<kKeys, kPlain>(s, scale, extras, mask, b, head_pos, block.key_lo,
                                       static_cast<int>(tile) * kKeys, quad, lo, hi);
#pragma unroll
        for (int e = 0; e < kKeys / 2; ++e) tile_max[(e / 2) % 2] = fmaxf(tile_max[(e / 2) % 2], s[e]);
      }
      float shift[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        alpha[r] = attn::online_softmax_step(m[r], quad_reduce_max(tile_max[r]), shift[r], attn::ScalarOps<float>{});
        l[r] *= alpha[r];
      }
#pragma unroll
      for (int e = 0; e < kKeys / 2; ++e) {
        const int r = (e / 2) % 2;
        const float p = tc::exp_of_difference(s[e], shift[r]);
        l[r] += p;  // the sum (and so the lse) is that of the probabilities before dropout
        s[e] = p;
      }
      if (!kPlain && extras.drop.enabled) {
        const int64_t j0 = block.key_lo + tile * kKeys;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int64_t row = lane_row(r), head = rows.group_head(g, row), pos = rows.group_pos(row);
#pragma unroll
          for (int j = 0; j < kKeys / 8; ++j) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              float& p = s[4 * j + 2 * r + c];
              if (p > 0.f) p *= extras.keep_factor<float>(b, head, pos, j0 + 8 * j + 2 * quad + c);
            }
          }
        }
      }
    };
    const auto rescale = [&](const float (&alpha)[2]) {
#pragma unroll
      for (int n = 0; n < kD / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) o[4 * n + e] *= alpha[e / 2];
      }
    };

    hopper::mbarrier_wait(ring.q_full, static_cast<unsigned>(served) & 1u);
    float s[kKeys / 2], alpha[2];
    mma::FragA pa[kKeys / 16];
    // O += P V of the tile whose P is in pa, committed; its V tile landed (wait_values).
    const auto issue_values = [&](int64_t tile) {
      const int stage = stage_of(tile);
      hopper::fence_operand(o);
#pragma unroll
      for (int i = 0; i < kKeys / 16; ++i) hopper::fence_operand(pa[i]);
      hopper::wgmma_fence();
#pragma unroll
      for (int i = 0; i < kKeys / 16; ++i) {
        hopper::wgmma<T, kD, Major::kMN>(o, pa[i], v_desc(stage, i), true);
      }
      hopper::wgmma_commit();
    };
    // After a wait: the registers of what it completed are read from here on.
    const auto scores_done = [&] { hopper::fence_operand(s); };
    // Once the item's last scores are done: the producer may load the next Q.
    const auto release_query = [&] { hopper::mbarrier_arrive(ring.q_empty); };
    const auto values_done = [&] {
      hopper::fence_operand(o);
#pragma unroll
      for (int i = 0; i < kKeys / 16; ++i) hopper::fence_operand(pa[i]);
    };
    if constexpr (kPlain) {
      // Tile j's P V runs on the tensor cores while the softmax of tile j + 1's
      // scores (issued before it) runs beside it; O is rescaled once P V is
      // done. Every tile but the last has a next one: no product is issued
      // under a condition, so ptxas sees which group each wait completes (else
      // it serialises the products).
      if (block.n_tiles > 0) {
        wait_keys(0);
        my_turn();
        issue_scores(s, 0);
        your_turn();
        hopper::wgmma_wait<0>();
        scores_done();
        ring.release_keys(first);
        softmax(s, 0, alpha);
        hk::accumulators_to_frags<T, kKeys>(s, pa);  // O is zero: nothing to rescale
      }
      for (int64_t tile = 0; tile + 1 < block.n_tiles; ++tile) {
        wait_keys(tile + 1);
        wait_values(tile);
        my_turn();
        issue_scores(s, tile + 1);
        issue_values(tile);
        your_turn();
        hopper::wgmma_wait<1>();  // the scores, not P V
        scores_done();
        ring.release_keys(first + tile + 1);
        softmax(s, tile + 1, alpha);
        hopper::wgmma_wait<0>();
        values_done();
        ring.release_values(first + tile);
        rescale(alpha);
        hk::accumulators_to_frags<T, kKeys>(s, pa);
      }
      release_query();  // every score is done
      if (block.n_tiles > 0) {
        wait_values(block.n_tiles - 1);
        my_turn();
        issue_values(block.n_tiles - 1);
        your_turn();
        hopper::wgmma_wait<0>();
        values_done();
        ring.release_values(first + block.n_tiles - 1);
      }
    } else {
      // Score modifiers, masks and dropout need the registers that overlapping
      // the softmax with P V would hold: one product at a time.
      for (int64_t tile = 0; tile < block.n_tiles; ++tile) {
        wait_keys(tile);
        issue_scores(s, tile);
        hopper::wgmma_wait<0>();
        scores_done();
        ring.release_keys(first + tile);
        softmax(s, tile, alpha);
        rescale(alpha);
        hk::accumulators_to_frags<T, kKeys>(s, pa);
        wait_values(tile);
        issue_values(tile);
        hopper::wgmma_wait<0>();
        values_done();
        ring.release_values(first + tile);
      }
      release_query();
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = quad_reduce_sum(l[r]);
      const int64_t row = lane_row(r);
      if (row >= block.rows_total) continue;
      const int64_t out_row = rows.row_of_group_row(b, g, row);
      float lse_r = attn::row_lse(m[r], sum);
      float factor = attn::row_norm(m[r], sum, lse_r);
      make_nan_if(!length_ok, factor, lse_r);
      // A sink joins the finished row's denominator: it scales the output and the lse includes it.
      if (extras.mods.sinks != nullptr) {
        factor *= attn::fold_sink(lse_r, extras.mods.sink<float>(rows.group_head(g, row)));
      }
      hk::store_lane_row<T, kD>(out + out_row * d, o, r, quad, d, factor);
      if (quad == 0) lse[out_row] = lse_r;
    }
    first += block.n_tiles;
    ++served;
  }
}

}  // namespace

bool launch_attention_hopper_forward(const AttentionForwardPlan& p, Stream stream) {
  const AttentionShape& s = p.shape;
  const at::ScalarType dtype = p.q.scalar_type();
  const ScoreExtras extras = extras_of(p);
  const bool plain = !extras.mods.any_score_mod() && !extras.mask.present() && !extras.drop.enabled;
  const hk::AttentionMap q_map(p.q), k_map(p.k), v_map(p.v);
  const size_t smem = s.head_dim <= 64    ? hk::Layout<64>::smem()
                      : s.head_dim <= 128 ? hk::Layout<128>::smem()
                                          : hk::Layout<256>::smem();
  // At head dim 256 the general scoring (modifiers, masks, dropout) would
  // spill beside O's 128 registers: those calls keep the mma.sync forward.
  if ((dtype != at::kBFloat16 && dtype != at::kHalf) || s.head_dim > hk::kMaxHeadDim ||
      (s.head_dim > 128 && !plain) || smem > device_properties().sharedMemPerBlockOptin ||
      hk::kRows % p.rows.group != 0 || p.k_scale.defined() || p.pages.paged() || !q_map.ok || !k_map.ok ||
      !v_map.ok) {
    return false;
  }
  const attn::QueryRows rows = rows_of(p);
  const int64_t row_blocks = (rows.group_rows() + hk::kRows - 1) / hk::kRows;
  if (row_blocks * s.kv_heads * s.batch > std::numeric_limits<int32_t>::max()) return false;
  const hk::WorkItems work{static_cast<int32_t>(row_blocks), static_cast<int32_t>(s.kv_heads),
                           static_cast<int32_t>(s.batch)};
  const int group = static_cast<int>(rows.group);
  hk::RowOrder order;
  hk::row_order({&q_map}, q_map, group, hk::kRows, order);  // q's own: one box per 64 of the head dim
  const hopper::TensorMap map_q = q_map.encode_rows(p.q, order.pos_major, group, hk::kRows / group);
  tc::with_mma_dtype(dtype, [&](auto dtype_tag) {
    using T = decltype(dtype_tag);
    const auto run = [&](auto D, auto kPlain) {
      constexpr int kD = decltype(D)::value;
      const hopper::TensorMap map_k = k_map.encode(p.k, 1, hk::Layout<kD>::kKeys);
      const hopper::TensorMap map_v = v_map.encode(p.v, 1, hk::Layout<kD>::kKeys);
      auto kernel = attention_hopper_forward_kernel<T, kD, decltype(kPlain)::value>;
      allow_shared_memory(kernel, smem);
      // Plain calls: one block a multiprocessor (its shared memory allows no
      // second), each taking items in turn; else a block an item.
      const auto blocks = decltype(kPlain)::value
                              ? std::min<int64_t>(work.count(), device_properties().multiProcessorCount)
                              : work.count();
      launch("attention_hopper_forward_kernel", kernel, dim3(static_cast<unsigned>(blocks)), hk::kThreads, smem,
             stream, map_q, map_k, map_v, p.out.mutable_data_ptr<T>(), p.lse.mutable_data_ptr<float>(), rows,
             p.seqs, static_cast<int>(s.head_dim), static_cast<float>(p.scale), p.mask, extras,
             hk::HeadsInner{q_map.heads_inner, k_map.heads_inner, v_map.heads_inner, false, false}, order, work);
    };
    if (s.head_dim <= 64) {
      plain ? run(std::integral_constant<int, 64>{}, std::true_type{})
            : run(std::integral_constant<int, 64>{}, std::false_type{});
    } else if (s.head_dim <= 128) {
      plain ? run(std::integral_constant<int, 128>{}, std::true_type{})
            : run(std::integral_constant<int, 128>{}, std::false_type{});
    } else {
      run(std::integral_constant<int, 256>{}, std::true_type{});  // plain, as checked above
    }
  });
  return true;
}

}  // namespace fusedllm::cuda
