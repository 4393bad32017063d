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

// The block's shared memory: Q, then the K/V ring.
template <int kD>
struct ForwardSmem {
  unsigned char* q_s;
  KvStages<Layout<kD>::kTileBytes> kv;

  __device__ __forceinline__ explicit ForwardSmem(unsigned char* raw)
      : q_s(raw + (1024 - hopper::shared_address(raw) % 1024) % 1024), kv(q_s + Layout<kD>::kQBytes) {}
};

// The work items (row block, kv head, sequence) a block takes, and what the
// producer and the consumers read of the one it is on. In a plain call the
// block takes items one after another; the ring's stream of K/V tiles and the
// Q tile's barriers run on across them, so that the next item's Q and first
// tiles load while the consumers finish an item. Otherwise a block takes one
// item (its round 0): what the loop would hold across items spilled beside
// the general scoring's registers. Items past a (packed) sequence's end are
// skipped by producer and consumers alike. (The loops over rounds write their
// test out: as a member function returning bool, nvcc 13.0 compiled them
// into other code.)
template <bool kPlain, int kKeys>
struct ForwardItems {
  static constexpr int32_t kRounds = kPlain ? std::numeric_limits<int32_t>::max() : 1;
  const WorkItems& work;
  const attn::QueryRows& rows;
  const attn::Seqs& seqs;
  const Mask& mask_all;
  // The item's kv head and sequence, whether its key length is valid, the mask at its lengths.
  int64_t g = 0, b = 0;
  bool length_ok = true;
  Mask mask;

  __device__ __forceinline__ ForwardItems(const WorkItems& work, const attn::QueryRows& rows, const attn::Seqs& seqs,
                                          const Mask& mask_all)
      : work(work), rows(rows), seqs(seqs), mask_all(mask_all), mask(mask_all) {}
  // Item `item`'s row block and the keys it sees.
  __device__ __forceinline__ tc::QueryBlock<kRows, kKeys> find(int64_t item) {
    int64_t row_block = 0;
    work.decode(item, row_block, g, b);
    const int64_t sq = seqs.q_len(b);
    tc::QueryBlock<kRows, kKeys> found(rows, sq, row_block);
    if (!found.empty()) {
      length_ok = seqs.k_len_ok(b);
      mask = mask_all.of_lengths(sq, length_ok ? seqs.k_len(b) : 0);
      found.find_keys(mask, rows);
    }
    return found;
  }
};

// The producer's thread: each item's Q tile once the consumers freed the
// last one's, then its K/V tiles into the ring.
template <int kD, bool kPlain>
__device__ __forceinline__ void produce_items(ForwardItems<kPlain, Layout<kD>::kKeys>& items,
                                              const ForwardSmem<kD>& smem, const hopper::TensorMap& map_q,
                                              const hopper::TensorMap& map_k, const hopper::TensorMap& map_v,
                                              const HeadsInner& heads_inner, const RowOrder& order) {
  using L = Layout<kD>;
  constexpr int kBoxes = kD / kBox;
  const KvRing<>& ring = smem.kv.ring;
  const attn::QueryRows& rows = items.rows;
  const attn::Seqs& seqs = items.seqs;
  const WorkItems& work = items.work;
  int64_t first = 0;  // the stream place of the item's first K/V tile
  int32_t served = 0;
  for (int32_t round = 0; round < items.kRounds && work.item(round) < work.count(); ++round) {
    const auto block = items.find(work.item(round));
    if (block.empty()) continue;
    const int32_t pos0 = static_cast<int32_t>(seqs.q_start(items.b) + rows.group_pos(block.row0));
    const auto map_b = static_cast<int32_t>(seqs.packed() ? 0 : items.b);  // packed: one [1, H, total, D] tensor
    if (served > 0) hopper::mbarrier_wait(ring.q_empty, static_cast<unsigned>(served - 1) & 1u);
    hopper::mbarrier_arrive_expect_tx(ring.q_full, L::kQBytes);
    load_query_rows<kBoxes>(smem.q_s, map_q, heads_inner.q, order, ring.q_full, pos0,
                            static_cast<int32_t>(items.g * rows.group), map_b);
    ring.template produce<kBoxes, L::kKeys>(first, block.n_tiles, seqs.k_start(items.b) + block.key_lo,
                                            static_cast<int32_t>(items.g), map_b, map_k, map_v, heads_inner,
                                            smem.kv);
    first += block.n_tiles;
    ++served;
  }
}

// Plain calls: the two consumers take turns issuing their products (named
// barriers 1 and 2, consumer 0 first), so that one's softmax runs while the
// other's products do; the turns run on across items.
struct Turns {
  int mine, theirs;

  __device__ __forceinline__ explicit Turns(int consumer) : mine(1 + consumer), theirs(2 - consumer) {}
  __device__ __forceinline__ void my_turn() const { hopper::named_barrier_sync(mine, 256); }
  __device__ __forceinline__ void your_turn() const { hopper::named_barrier_arrive(theirs, 256); }
};

// A consumer thread's accumulators, in the layout of hopper.cuh: s[4 j + 2 r
// + c] is lane row r, column 8 j + 2 quad + c (O's likewise). The rows'
// running sum l and max m, and O; a tile's scores (then P) s, what O is
// scaled by for it (alpha), and its P as A fragments.
template <int kD, int kKeys>
struct ForwardAcc {
  // The member order sets nvcc 13.0's register numbering, which ptxas's code follows: keep it.
  float l[2], m[2], o[kD / 2];
  float s[kKeys / 2], alpha[2];
  mma::FragA pa[kKeys / 16];
};

// A consumer thread's work on one item: the steps of a K/V tile (`tile`
// counts the item's tiles, from the stream place `first`).
template <typename T, int kD, bool kPlain>
struct ForwardConsumer {
  static constexpr int kBoxes = kD / kBox;
  static constexpr int kKeys = Layout<kD>::kKeys;
  static constexpr float kInf = std::numeric_limits<float>::infinity();
  using Acc = ForwardAcc<kD, kKeys>;
  const ForwardSmem<kD>& smem;
  const ForwardItems<kPlain, kKeys>& items;
  const tc::QueryBlock<kRows, kKeys>& block;
  const LaneRows<kKeys>& my_rows;
  const FullTiles<kPlain, kKeys>& full;
  const ConsumerLane& lane;
  const ScoreExtras& extras;
  float scale;
  int64_t first;

  __device__ __forceinline__ int64_t lane_row(int r) const { return block.row0 + my_rows.row_offset[r]; }
  __device__ __forceinline__ int stage_of(int64_t tile) const {
    return static_cast<int>((first + tile) % kStages);
  }
  __device__ __forceinline__ void wait_keys(int64_t tile) const { smem.kv.ring.wait_keys(first + tile); }
  // The V tile of `tile` landed, its rows past the block's last visible key
  // zeroed (zero_keys_from).
  __device__ __forceinline__ void wait_values(int64_t tile) const {
    const int stage = stage_of(tile);
    smem.kv.ring.wait_values(first + tile);
    const int64_t visible = block.key_hi - (block.key_lo + tile * kKeys);
    if (visible < kKeys) {
      zero_keys_from<kBoxes, kKeys>(smem.kv.v_tile(stage), static_cast<int>(visible), lane.t, 3 + lane.consumer);
    }
  }
  // S = Q K^T of a tile whose K has landed (wait_keys), issued and committed.
  __device__ __forceinline__ void issue_scores(Acc& a, int64_t tile) const {
    const int stage = stage_of(tile);
    hopper::fence_operand(a.s);
    hopper::wgmma_fence();
    issue_k_major<T, kD, kKeys>(a.s, smem.q_s, kRows, lane.consumer * 64, smem.kv.k_tile(stage), kKeys, 0);
    hopper::wgmma_commit();
  }
  // After a wait: the registers of what it completed are read from here on.
  static __device__ __forceinline__ void scores_done(Acc& a) { hopper::fence_operand(a.s); }
  // The online softmax of a tile's finished scores: s becomes P (after
  // dropout), m and l move on; alpha is what O must be scaled by.
  __device__ __forceinline__ void softmax(Acc& a, int64_t tile) const {
    float tile_max[2] = {-kInf, -kInf};
    if (tile >= full.lo && tile < full.hi) {
#pragma unroll
      for (int e = 0; e < kKeys / 2; ++e) {
        a.s[e] *= scale;
        tile_max[(e / 2) % 2] = fmaxf(tile_max[(e / 2) % 2], a.s[e]);
      }
    } else {
      const auto head_pos = [&](int r, int64_t& head, int64_t& pos) {
        head = items.rows.group_head(items.g, lane_row(r));
        pos = items.rows.group_pos(lane_row(r));
      };
      tile_scores<kKeys, kPlain>(a.s, scale, extras, items.mask, items.b, head_pos, block.key_lo,
                                 static_cast<int>(tile) * kKeys, lane.quad, my_rows.lo, my_rows.hi);
#pragma unroll
      for (int e = 0; e < kKeys / 2; ++e) tile_max[(e / 2) % 2] = fmaxf(tile_max[(e / 2) % 2], a.s[e]);
    }
    float shift[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      a.alpha[r] = attn::online_softmax_step(a.m[r], quad_reduce_max(tile_max[r]), shift[r], attn::ScalarOps<float>{});
      a.l[r] *= a.alpha[r];
    }
#pragma unroll
    for (int e = 0; e < kKeys / 2; ++e) {
      const int r = (e / 2) % 2;
      const float p = tc::exp_of_difference(a.s[e], shift[r]);
      a.l[r] += p;  // the sum (and so the lse) is that of the probabilities before dropout
      a.s[e] = p;
    }
    if (!kPlain && extras.drop.enabled) apply_dropout(a, tile);
  }
  __device__ __forceinline__ void apply_dropout(Acc& a, int64_t tile) const {
    const int64_t j0 = block.key_lo + tile * kKeys;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = lane_row(r), head = items.rows.group_head(items.g, row), pos = items.rows.group_pos(row);
#pragma unroll
      for (int j = 0; j < kKeys / 8; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float& p = a.s[4 * j + 2 * r + c];
          if (p > 0.f) p *= extras.keep_factor<float>(items.b, head, pos, j0 + 8 * j + 2 * lane.quad + c);
        }
      }
    }
  }
  static __device__ __forceinline__ void rescale(Acc& a) {
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) a.o[4 * n + e] *= a.alpha[e / 2];
    }
  }
  // O += P V of the tile whose P is in pa, committed; its V tile landed
  // (wait_values). V is read MN-major (its rows are keys).
  __device__ __forceinline__ void issue_values(Acc& a, int64_t tile) const {
    const int stage = stage_of(tile);
    hopper::fence_operand(a.o);
    fence_fragments(a.pa);
    hopper::wgmma_fence();
    issue_mn_major<T, kD>(a.o, a.pa, smem.kv.v_tile(stage), kKeys);
    hopper::wgmma_commit();
  }
  static __device__ __forceinline__ void values_done(Acc& a) {
    hopper::fence_operand(a.o);
    fence_fragments(a.pa);
  }
  // Once the item's last scores are done: the producer may load the next Q.
  __device__ __forceinline__ void release_query() const { hopper::mbarrier_arrive(smem.kv.ring.q_empty); }

  // Plain calls: tile j's P V runs on the tensor cores while the softmax of
  // tile j + 1's scores (issued before it) runs beside it; O is rescaled once
  // P V is done. Every tile but the last has a next one: no product is issued
  // under a condition, so ptxas sees which group each wait completes (else it
  // serialises the products).
  __device__ __forceinline__ void overlapped_tiles(Acc& a, const Turns& turns) const {
    const KvRing<>& ring = smem.kv.ring;
    if (block.n_tiles > 0) {
      wait_keys(0);
      turns.my_turn();
      issue_scores(a, 0);
      turns.your_turn();
      hopper::wgmma_wait<0>();
      scores_done(a);
      ring.release_keys(first);
      softmax(a, 0);
      accumulators_to_frags<T, kKeys>(a.s, a.pa);  // O is zero: nothing to rescale
    }
    for (int64_t tile = 0; tile + 1 < block.n_tiles; ++tile) {
      wait_keys(tile + 1);
      wait_values(tile);
      turns.my_turn();
      issue_scores(a, tile + 1);
      issue_values(a, tile);
      turns.your_turn();
      hopper::wgmma_wait<1>();  // the scores, not P V
      scores_done(a);
      ring.release_keys(first + tile + 1);
      softmax(a, tile + 1);
      hopper::wgmma_wait<0>();
      values_done(a);
      ring.release_values(first + tile);
      rescale(a);
      accumulators_to_frags<T, kKeys>(a.s, a.pa);
    }
    release_query();  // every score is done
    if (block.n_tiles > 0) {
      wait_values(block.n_tiles - 1);
      turns.my_turn();
      issue_values(a, block.n_tiles - 1);
      turns.your_turn();
      hopper::wgmma_wait<0>();
      values_done(a);
      ring.release_values(first + block.n_tiles - 1);
    }
  }
  // Score modifiers, masks and dropout need the registers that overlapping
  // the softmax with P V would hold: one product at a time.
  __device__ __forceinline__ void serial_tiles(Acc& a) const {
    const KvRing<>& ring = smem.kv.ring;
    for (int64_t tile = 0; tile < block.n_tiles; ++tile) {
      wait_keys(tile);
      issue_scores(a, tile);
      hopper::wgmma_wait<0>();
      scores_done(a);
      ring.release_keys(first + tile);
      softmax(a, tile);
      rescale(a);
      accumulators_to_frags<T, kKeys>(a.s, a.pa);
      wait_values(tile);
      issue_values(a, tile);
      hopper::wgmma_wait<0>();
      values_done(a);
      ring.release_values(first + tile);
    }
    release_query();
  }
  // The item's output rows (normalized) and their lse.
  __device__ __forceinline__ void store_rows(Acc& a, T* out, float* lse, int d) const {
    const attn::QueryRows& rows = items.rows;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = quad_reduce_sum(a.l[r]);
      const int64_t row = lane_row(r);
      if (row >= block.rows_total) continue;
      const int64_t out_row = rows.row_of_group_row(items.b, items.g, row);
      float lse_r = attn::row_lse(a.m[r], sum);
      float factor = attn::row_norm(a.m[r], sum, lse_r);
      make_nan_if(!items.length_ok, factor, lse_r);
      // A sink joins the finished row's denominator: it scales the output and the lse includes it.
      if (extras.mods.sinks != nullptr) {
        factor *= attn::fold_sink(lse_r, extras.mods.sink<float>(rows.group_head(items.g, row)));
      }
      store_lane_row<T, kD>(out + out_row * d, a.o, r, lane.quad, d, factor);
      if (lane.quad == 0) lse[out_row] = lse_r;
    }
  }
};

// A consumer thread: the block's items in turn.
template <typename T, int kD, bool kPlain>
__device__ __forceinline__ void consume_items(ForwardItems<kPlain, Layout<kD>::kKeys>& items,
                                              const ForwardSmem<kD>& smem, T* out, float* lse, int d, float scale,
                                              const ScoreExtras& extras, const RowOrder& order,
                                              const ConsumerLane& lane) {
  using Consumer = ForwardConsumer<T, kD, kPlain>;
  const WorkItems& work = items.work;
  const Turns turns(lane.consumer);
  if (kPlain && lane.consumer == 1) turns.your_turn();
  int64_t first = 0;
  int32_t served = 0;
  for (int32_t round = 0; round < items.kRounds && work.item(round) < work.count(); ++round) {
    const auto block = items.find(work.item(round));
    if (block.empty()) continue;
    const LaneRows<Consumer::kKeys> my_rows(block, order, items.rows, items.mask, lane);
    const FullTiles<kPlain, Consumer::kKeys> full(my_rows);
    const Consumer c{smem, items, block, my_rows, full, lane, extras, scale, first};
    typename Consumer::Acc a;
#pragma unroll
    for (float& x : a.o) x = 0.f;
#pragma unroll
    for (int r = 0; r < 2; ++r) a.m[r] = -Consumer::kInf, a.l[r] = 0.f;
    hopper::mbarrier_wait(smem.kv.ring.q_full, static_cast<unsigned>(served) & 1u);
    if constexpr (kPlain) {
      c.overlapped_tiles(a, turns);
    } else {
      c.serial_tiles(a);
    }
    c.store_rows(a, out, lse, d);
    first += block.n_tiles;
    ++served;
  }
}

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
  const hk::ForwardSmem<kD> smem(dynamic_shared<unsigned char>());
  const int tid = threadIdx.x;
  if (tid == 0) smem.kv.ring.init();
  __syncthreads();
  // Uniform across each warp as the compiler can see: the products of a
  // branch it takes for divergent are serialised.
  const int warpgroup = __shfl_sync(kFullMask, tid / 128, 0);
  hk::ForwardItems<kPlain, hk::Layout<kD>::kKeys> items(work, rows, seqs, mask_all);

  if (warpgroup == 0) {  // producer
    hopper::setmaxnreg<24, false>();
    if (tid == 0) hk::produce_items<kD>(items, smem, map_q, map_k, map_v, heads_inner, order);
    return;
  }
  hopper::setmaxnreg<240, true>();
  const hk::ConsumerLane lane(tid - 128 * warpgroup, warpgroup - 1);
  hk::consume_items<T, kD>(items, smem, out, lse, d, scale, extras, order, lane);
}

FUSEDLLM_ATTENTION_KERNEL_NOTE(attention_hopper_forward_kernel,
                               "wgmma and TMA: bfloat16/float16, head dims up to 128, 256 in plain calls, sm_90a")

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
