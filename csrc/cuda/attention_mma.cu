// The tensor-core attention forward (bfloat16 / float16; float16 on sm_75), FlashAttention-2
// style: a block holds 64 query rows (position, head) of one kv head and
// sequence, numbered as the SIMT kernel numbers them (QueryRows), so every
// K/V tile it stages serves all query heads of the group; each of its 4 warps
// owns 16 rows. K/V tiles are double-buffered (cp.async for the next tile
// while the tensor cores work on this one). Per tile: S = Q K^T on the tensor
// cores, the online softmax on S's accumulator fragments in registers (row
// statistics over a quad of lanes), P rounded to 16 bits straight into A
// fragments and O += P V. Key tiles outside the block's causal / window
// bounds are never staged; a plain call (no score modifier, no tensor mask)
// tests each score's visibility only in the tiles that a bound cuts.
#include "attention_mma.cuh"

namespace fusedllm::cuda {
namespace {

// This lane's rows of a forward block: r = 2 m + half is row `group` + 8 half
// of the warp's m-tile m. Their head, position and key range are worked out
// where needed (tiles a bound cuts, the end) rather than held through the loop:
// 4 rows' 64-bit values took the registers the accumulators need. Element e
// of an n-tile of m-tile mt belongs to lane row 2 mt + e / 2.
template <class Tl>
struct ForwardLaneRows {
  static constexpr int kM = Tl::kFwdM, kKeys = Tl::kKeys, kN = Tl::kNTiles;
  static constexpr int kLaneRows = 2 * kM;  // this lane's rows: `group` and group + 8 of each m-tile
  struct Row {
    int64_t row, head, pos, lo, hi;  // lo == hi == 0 past the end: no key
  };

  const tc::BlockPlace& place;
  const tc::QueryBlock<Tl::kFwdRows, kKeys>& block;
  const attn::QueryRows& rows;
  const Mask& mask;

  __device__ __forceinline__ Row row(int r) const {
    Row x;
    x.row = block.row0 + (place.warp * kM + r / 2) * 16 + place.group + 8 * (r % 2);
    x.head = rows.group_head(place.g, x.row);
    x.pos = rows.group_pos(x.row);
    const bool valid = x.row < block.rows_total;
    x.lo = valid ? attn::key_begin(mask, x.pos) : 0;
    x.hi = valid ? attn::key_end(mask, x.pos) : 0;
    return x;
  }

  // The keys [lo, hi) all of this lane's rows see.
  __device__ __forceinline__ void common_keys(int64_t& lo, int64_t& hi) const {
    lo = 0, hi = std::numeric_limits<int64_t>::max();
#pragma unroll
    for (int r = 0; r < kLaneRows; ++r) {
      const Row x = row(r);
      lo = x.lo > lo ? x.lo : lo;
      hi = x.hi < hi ? x.hi : hi;
    }
  }

  // The scores of the tile of keys from j0 where a causal / window bound cuts
  // the tile or scores are modified: -inf where a key is not visible, each
  // score modified; their row maxima in tile_max.
  __device__ __forceinline__ void cut_scores(mma::FragC (&s)[kM][kKeys / 8], int64_t j0, bool plain, float scale,
                                             const ScoreExtras& extras, float (&tile_max)[kLaneRows]) const {
#pragma unroll
    for (int r = 0; r < kLaneRows; ++r) tile_max[r] = -std::numeric_limits<float>::infinity();
#pragma unroll
    for (int r = 0; r < kLaneRows; ++r) {
      const Row x = row(r);
      const int mt = r / 2;
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
        for (int e = 2 * (r % 2); e < 2 * (r % 2) + 2; ++e) {
          const int64_t key = j0 + n * 8 + 2 * place.quad + (e % 2);
          const bool visible = key >= x.lo && key < x.hi;
          const float z = tc::score(s[mt][n].r[e], visible, plain, scale, extras, mask, place.b, x.head, x.pos,
                                    key, nullptr);
          s[mt][n].r[e] = z;
          tile_max[r] = fmaxf(tile_max[r], z);
        }
      }
    }
  }

  // The dropout of the tile's probabilities p (keys from j0).
  __device__ __forceinline__ void drop(mma::FragC (&p)[kM][kKeys / 8], int64_t j0, const ScoreExtras& extras) const {
#pragma unroll
    for (int r = 0; r < kLaneRows; ++r) {
      const Row x = row(r);
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
        for (int e = 2 * (r % 2); e < 2 * (r % 2) + 2; ++e) {
          float& pe = p[r / 2][n].r[e];
          const int64_t key = j0 + n * 8 + 2 * place.quad + (e % 2);
          if (pe > 0.f) pe *= extras.keep_factor<float>(place.b, x.head, x.pos, key);
        }
      }
    }
  }

  // The finished rows: O normalized by the sum l (over the quad), the sink
  // folded in, O and the lse stored; NaN rows where the sequence's key length
  // could not be read (!length_ok).
  template <typename T>
  __device__ __forceinline__ void store(const mma::FragC (&o)[kM][kN], const float (&m)[kLaneRows],
                                        const float (&l)[kLaneRows], T* out, float* lse, const ScoreExtras& extras,
                                        int d, bool length_ok) const {
#pragma unroll
    for (int r = 0; r < kLaneRows; ++r) {
      const float sum = quad_reduce_sum(l[r]);
      const Row x = row(r);
      if (x.row >= block.rows_total) continue;
      const int64_t out_row = rows.row_of_group_row(place.b, place.g, x.row);
      float lse_r = attn::row_lse(m[r], sum);
      float factor = attn::row_norm(m[r], sum, lse_r);
      make_nan_if(!length_ok, factor, lse_r);
      // A sink joins the finished row's denominator: it scales the output and the lse includes it.
      if (extras.mods.sinks != nullptr) factor *= attn::fold_sink(lse_r, extras.mods.sink<float>(x.head));
      tc::store_acc_row<T, kN>(out + out_row * d, o[r / 2], r % 2, factor, place.quad, d);
      if (place.quad == 0) lse[out_row] = lse_r;
    }
  }
};

// The scores of a tile every key of which all of this lane's rows see, in a
// plain call: scaled, no test per score; their row maxima in tile_max.
template <int kM, int kKeys>
__device__ __forceinline__ void interior_scores(mma::FragC (&s)[kM][kKeys / 8], float scale,
                                                float (&tile_max)[2 * kM]) {
#pragma unroll
  for (int r = 0; r < 2 * kM; ++r) tile_max[r] = -std::numeric_limits<float>::infinity();
#pragma unroll
  for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[mt][n].r[e] *= scale;
        tile_max[2 * mt + e / 2] = fmaxf(tile_max[2 * mt + e / 2], s[mt][n].r[e]);
      }
    }
  }
}

// The online softmax over one tile: each row's running max m takes in the
// tile's maxima (over the quad of lanes holding the row), O and the sum l are
// rescaled to it, and the scores s become the probabilities exp(s - shift),
// added to l.
template <int kM, int kN, int kKeys>
__device__ __forceinline__ void softmax_step(mma::FragC (&o)[kM][kN], float (&m)[2 * kM], float (&l)[2 * kM],
                                             mma::FragC (&s)[kM][kKeys / 8], const float (&tile_max)[2 * kM]) {
  float shift[2 * kM];
#pragma unroll
  for (int r = 0; r < 2 * kM; ++r) {
    const float alpha =
        attn::online_softmax_step(m[r], quad_reduce_max(tile_max[r]), shift[r], attn::ScalarOps<float>{});
    l[r] *= alpha;
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      o[r / 2][n].r[2 * (r % 2)] *= alpha;
      o[r / 2][n].r[2 * (r % 2) + 1] *= alpha;
    }
  }
#pragma unroll
  for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = 2 * mt + e / 2;
        const float p = tc::exp_of_difference(s[mt][n].r[e], shift[r]);
        l[r] += p;  // the sum (and so the lse) is that of the probabilities before dropout
        s[mt][n].r[e] = p;
      }
    }
  }
}

template <typename T, class Tl>
__global__ void __launch_bounds__(tc::kThreads, 1)
attention_mma_forward_kernel(const T* __restrict__ q, Strides qs, const T* __restrict__ k, Strides ks,
                             const T* __restrict__ v, Strides vs, T* __restrict__ out,
                             float* __restrict__ lse, attn::QueryRows rows, attn::Seqs seqs, int d,
                             float scale, Mask mask_all, ScoreExtras extras, bool q_chunks,
                             bool kv_chunks) {
  if constexpr (!tc::kBuiltHere<T, Tl::kArch>) {
    __trap();  // dispatch never launches it on this GPU
  } else {
    constexpr int kD = Tl::kD;
    constexpr int kKeys = Tl::kKeys, kStride = Tl::kStride, kN = Tl::kNTiles;
    constexpr int kM = Tl::kFwdM, kRows = Tl::kFwdRows;
    constexpr int kLaneRows = ForwardLaneRows<Tl>::kLaneRows;
    constexpr float kInf = std::numeric_limits<float>::infinity();
    T* q_s = dynamic_shared<T>();        // [kRows][kStride]
    T* k_s = q_s + kRows * kStride;      // [2][kKeys][kStride]
    T* v_s = k_s + 2 * kKeys * kStride;  // [2][kKeys][kStride]

    const tc::BlockPlace place;
    const int64_t g = place.g, b = place.b;
    const int warp = place.warp;
    const int64_t sq = seqs.q_len(b);
    tc::QueryBlock<kRows, kKeys> block(rows, sq);
    if (block.empty()) return;  // past this (packed) sequence's end: the whole block
    const bool length_ok = seqs.k_len_ok(b);  // else no keys, NaN rows (make_nan_if)
    const Mask mask = mask_all.of_lengths(sq, length_ok ? seqs.k_len(b) : 0);
    block.find_keys(mask, rows);
    const T* q_b = place.query_side(q, qs, seqs);
    const T* k_b = place.key_side(k, ks, seqs);
    const T* v_b = place.key_side(v, vs, seqs);

    tc::stage_group_rows<T, kD, kRows>(q_s, q_b, qs, rows, g, block.row0, block.rows_total, d, q_chunks);
    const auto stage_kv = [&](int64_t tile) {
      const int buffer = static_cast<int>(tile % 2);
      tc::stage_key_rows<T, kD, kKeys>(k_s + buffer * kKeys * kStride, v_s + buffer * kKeys * kStride, k_b,
                                       ks.s, v_b, vs.s, block.key_lo + tile * kKeys, block.key_hi, d, kv_chunks);
    };
    tc::pipeline_start(block.n_tiles, stage_kv);

    const ForwardLaneRows<Tl> lanes{place, block, rows, mask};
    int64_t all_lo, all_hi;  // keys all of this lane's rows see
    lanes.common_keys(all_lo, all_hi);
    const bool plain = !extras.mods.any_score_mod() && !extras.mask.present();

    mma::FragC o[kM][kN];
    float m[kLaneRows], l[kLaneRows];  // running max, this lane's sum
#pragma unroll
    for (int r = 0; r < kLaneRows; ++r) m[r] = -kInf, l[r] = 0.f;
    for (int64_t tile = 0; tile < block.n_tiles; ++tile) {
      tc::pipeline_next(tile, block.n_tiles, stage_kv);
      const int buffer = static_cast<int>(tile % 2);
      const int64_t j0 = block.key_lo + tile * kKeys;

      mma::FragC s[kM][kKeys / 8];
      tc::mma_rows_rows<T, kM, kD, kKeys, kStride>(s, q_s + warp * kM * 16 * kStride,
                                                   k_s + buffer * kKeys * kStride);
      // Scores, -inf where a key is not visible, and their row maxima.
      float tile_max[kLaneRows];
      if (plain && j0 >= all_lo && j0 + kKeys <= all_hi) {
        interior_scores<kM, kKeys>(s, scale, tile_max);
      } else {
        lanes.cut_scores(s, j0, plain, scale, extras, tile_max);
      }
      softmax_step<kM, kN, kKeys>(o, m, l, s, tile_max);
      if (extras.drop.enabled) lanes.drop(s, j0, extras);  // tested once per tile, not per score
      mma::FragA pa[kM][kKeys / 16];
#pragma unroll
      for (int mt = 0; mt < kM; ++mt) tc::to_a_frags<T, kKeys>(pa[mt], s[mt]);
      tc::mma_frags_rows<T, kM, kKeys, kD, kStride>(o, pa, v_s + buffer * kKeys * kStride);
      __syncthreads();  // every warp is done with this buffer before it is staged again
    }
    lanes.store(o, m, l, out, lse, extras, d, length_ok);
  }
}

FUSEDLLM_ATTENTION_KERNEL_NOTE(attention_mma_forward_kernel,
                               "tensor cores: bfloat16/float16 on sm_80+, float16 on sm_75")

}  // namespace

void launch_attention_mma_forward(const AttentionForwardPlan& p, Stream stream) {
  const AttentionShape& s = p.shape;
  const attn::QueryRows rows = rows_of(p);
  const bool q_chunks = tc::chunks_aligned(p.q.const_data_ptr(), strides_of(p.q));
  const bool kv_chunks = tc::chunks_aligned(p.k.const_data_ptr(), strides_of(p.k)) &&
                         tc::chunks_aligned(p.v.const_data_ptr(), strides_of(p.v));
  tc::with_mma_tiles(p.q.scalar_type(), s.head_dim, [&](auto dtype_tag, auto tiles) {
    using T = decltype(dtype_tag);
    using Tl = decltype(tiles);
    auto kernel = attention_mma_forward_kernel<T, Tl>;
    const size_t smem = Tl::forward_smem(sizeof(T));
    allow_shared_memory(kernel, smem);
    const dim3 grid(static_cast<unsigned>((rows.group_rows() + Tl::kFwdRows - 1) / Tl::kFwdRows),
                    static_cast<unsigned>(s.kv_heads), static_cast<unsigned>(s.batch));
    launch("attention_mma_forward_kernel", kernel, grid, tc::kThreads, smem, stream,
           p.q.const_data_ptr<T>(), strides_of(p.q), p.k.const_data_ptr<T>(), strides_of(p.k),
           p.v.const_data_ptr<T>(), strides_of(p.v), p.out.mutable_data_ptr<T>(),
           p.lse.mutable_data_ptr<float>(), rows, p.seqs, static_cast<int>(s.head_dim),
           static_cast<float>(p.scale), p.mask, extras_of(p), q_chunks, kv_chunks);
  });
}

}  // namespace fusedllm::cuda
