// The tensor-core attention backward (bfloat16 / float16; float16 on sm_75), FlashAttention-2
// style, in two kernels that share nothing but delta = rowsum(dO * O) (computed
// first, on the tensor cores as they compute dP):
//
//   dQ: a block holds 64 query rows (position, head) of one kv head, as the
//       forward does, with their Q and dO rows; K/V tiles stream through it
//       double-buffered. Per tile: S = Q K^T and dP = dO V^T on the tensor
//       cores, P = exp(S - lse) and dS = P (dP - delta) on the accumulator
//       fragments, dS rounded to 16 bits straight into A fragments and
//       dQ += dS K.
//   dK, dV: a block holds 64 keys of one kv head; tiles of the query rows (of
//       every head of the group) that see them stream through it, with their
//       lse and delta. Per tile: S^T = K Q^T and dP^T = V dO^T, P^T and dS^T on
//       the fragments, then dV += P^T dO and dK += dS^T Q. The block sums over
//       the whole group in registers: deterministic, no atomics. At head dim
//       256 two blocks share a key block, each with half of dK's and dV's
//       columns (Tile::kDkdvCols).
//
// Scores follow the forward exactly (scale, soft-capping with its slope dcap,
// ALiBi, masks, the dropout draws of the same Philox stream).
#include "attention_mma.cuh"

namespace fusedllm::cuda {
namespace {

// delta = rowsum(dO * O) of 64 query rows (position, head) of one kv head:
// each warp's 16 rows as the diagonal of dO O^T, the same tensor-core products
// in the same order as dP = dO V^T below, so that a row whose output is one
// key's value row (that key alone visible) gets dP - delta = 0 exactly, and so
// dQ and dK exactly 0.
template <typename T, class Tl>
__global__ void __launch_bounds__(tc::kThreads, 1)
attention_mma_delta_kernel(const T* __restrict__ grad_out, Strides gs, const T* __restrict__ out, Strides os,
                           float* __restrict__ delta, attn::QueryRows rows, attn::Seqs seqs, int d, bool chunks) {
  if constexpr (!tc::kBuiltHere<T, Tl::kArch>) {
    __trap();  // dispatch never launches it on this GPU
  } else {
    constexpr int kD = Tl::kD;
    constexpr int kStride = Tl::kStride;
    T* do_s = dynamic_shared<T>();         // [kRows][kStride]
    T* o_s = do_s + tc::kRows * kStride;   // [kRows][kStride]
    const tc::BlockPlace place;
    const int64_t g = place.g, b = place.b;
    const int warp = place.warp, group = place.group, quad = place.quad;
    const tc::QueryBlock<tc::kRows, 1> block(rows, seqs.q_len(b));
    if (block.empty()) return;  // past this (packed) sequence's end: the whole block
    tc::stage_group_rows<T, kD, tc::kRows>(do_s, place.query_side(grad_out, gs, seqs), gs, rows, g, block.row0,
                                           block.rows_total, d, chunks);
    tc::stage_group_rows<T, kD, tc::kRows>(o_s, place.query_side(out, os, seqs), os, rows, g, block.row0,
                                           block.rows_total, d, chunks);
    mma::cp_async_commit();
    mma::cp_async_wait<0>();
    __syncthreads();
    mma::FragC c[2];  // [16 rows, 16 rows]
    tc::mma_rows_rows<T, kD, 16, kStride>(c, do_s + warp * 16 * kStride, o_s + warp * 16 * kStride);
    // (row, row) for rows `group` (n-tile 0) and group + 8 (n-tile 1) lies in
    // the lane of this group whose quad holds column `group`.
    if (quad != group / 2) return;
    const float diagonal[2] = {group % 2 != 0 ? c[0].r[1] : c[0].r[0], group % 2 != 0 ? c[1].r[3] : c[1].r[2]};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = block.row0 + warp * 16 + group + 8 * half;
      if (row < block.rows_total) delta[rows.row_of_group_row(b, g, row)] = diagonal[half];
    }
  }
}

FUSEDLLM_ATTENTION_KERNEL_NOTE(attention_mma_delta_kernel,
                               "tensor cores: bfloat16/float16 on sm_80+, float16 on sm_75")

template <typename T, class Tl>
__global__ void __launch_bounds__(tc::kThreads, 1)
attention_mma_dq_kernel(const T* __restrict__ grad_out, Strides gs, const T* __restrict__ q, Strides qs,
                        const T* __restrict__ k, Strides ks, const T* __restrict__ v, Strides vs,
                        const float* __restrict__ lse, const float* __restrict__ delta,
                        T* __restrict__ grad_q, attn::QueryRows rows, attn::Seqs seqs, int d, float scale,
                        Mask mask_all, ScoreExtras extras, bool q_chunks, bool kv_chunks) {
  if constexpr (!tc::kBuiltHere<T, Tl::kArch>) {
    __trap();  // dispatch never launches it on this GPU
  } else {
    constexpr int kD = Tl::kD;
    constexpr int kKeys = Tl::kBwdTile, kStride = Tl::kStride, kN = Tl::kNTiles;
    T* q_s = dynamic_shared<T>();               // [kRows][kStride]
    T* do_s = q_s + tc::kRows * kStride;        // [kRows][kStride]
    T* k_s = do_s + tc::kRows * kStride;        // [2][kKeys][kStride]
    T* v_s = k_s + 2 * kKeys * kStride;         // [2][kKeys][kStride]

    const tc::BlockPlace place;
    const int64_t g = place.g, b = place.b;
    const int warp = place.warp, group = place.group, quad = place.quad;
    const int64_t sq = seqs.q_len(b);
    tc::QueryBlock<tc::kRows, kKeys> block(rows, sq);
    if (block.empty()) return;  // past this (packed) sequence's end: the whole block
    const Mask mask = mask_all.of_lengths(sq, seqs.k_len(b));
    block.find_keys(mask, rows);
    const T* q_b = place.query_side(q, qs, seqs);
    const T* g_b = place.query_side(grad_out, gs, seqs);
    const T* k_b = place.key_side(k, ks, seqs);
    const T* v_b = place.key_side(v, vs, seqs);

    tc::stage_group_rows<T, kD, tc::kRows>(q_s, q_b, qs, rows, g, block.row0, block.rows_total, d, q_chunks);
    tc::stage_group_rows<T, kD, tc::kRows>(do_s, g_b, gs, rows, g, block.row0, block.rows_total, d, q_chunks);
    const auto stage_kv = [&](int64_t tile) {
      const int buffer = static_cast<int>(tile % 2);
      tc::stage_key_rows<T, kD, kKeys, kD <= 128 || tc::kUnrollWideDqStaging>(
          k_s + buffer * kKeys * kStride, v_s + buffer * kKeys * kStride, k_b, ks.s, v_b, vs.s,
          block.key_lo + tile * kKeys, block.key_hi, d, kv_chunks);
    };
    tc::pipeline_start(block.n_tiles, stage_kv);

    // This lane's two rows (half 0: row `group` of the warp's 16, half 1: group + 8).
    int64_t head[2], pos[2], lo[2], hi[2];
    float lse_row[2], dlt[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = block.row0 + warp * 16 + group + 8 * half;
      const bool valid = row < block.rows_total;
      const int64_t lrow = valid ? rows.row_of_group_row(b, g, row) : 0;
      head[half] = rows.group_head(g, row);
      pos[half] = rows.group_pos(row);
      lo[half] = valid ? attn::key_begin(mask, pos[half]) : 0;
      hi[half] = valid ? attn::key_end(mask, pos[half]) : 0;
      lse_row[half] = valid ? attn::ScalarOps<float>::finite_or_zero(lse[lrow]) : 0.f;
      dlt[half] = valid ? delta[lrow] : 0.f;
    }
    const bool unmodified = !extras.mods.any_score_mod() && !extras.mask.present();
    const bool plain = unmodified && !extras.drop.enabled;
    // Keys both of this lane's rows see (rows past the end see none).
    const int64_t all_lo = lo[0] > lo[1] ? lo[0] : lo[1], all_hi = hi[0] < hi[1] ? hi[0] : hi[1];

    mma::FragC dq[kN];
    for (int64_t tile = 0; tile < block.n_tiles; ++tile) {
      tc::pipeline_next(tile, block.n_tiles, stage_kv);
      const int buffer = static_cast<int>(tile % 2);
      const int64_t j0 = block.key_lo + tile * kKeys;
      const T* k_tile = k_s + buffer * kKeys * kStride;

      mma::FragC s[kKeys / 8], dp[kKeys / 8];
      tc::mma_rows_rows<T, kD, kKeys, kStride>(s, q_s + warp * 16 * kStride, k_tile);
      tc::mma_rows_rows<T, kD, kKeys, kStride>(dp, do_s + warp * 16 * kStride, v_s + buffer * kKeys * kStride);
      // Every key visible to both rows: no test per score (not at head dim 256,
      // where the second copy of the loop spilled on sm_80).
      if (kD <= 128 && plain && j0 >= all_lo && j0 + kKeys <= all_hi) {
#pragma unroll
        for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float p = tc::exp_of_difference(s[n].r[e] * scale, lse_row[e / 2]);
            s[n].r[e] = attn::score_grad(p, dp[n].r[e], dlt[e / 2]);
          }
        }
      } else {
#pragma unroll
        for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int half = e / 2;
            const int64_t key = j0 + n * 8 + 2 * quad + (e % 2);
            const bool visible = key >= lo[half] && key < hi[half];
            float dcap;
            const float x = tc::score(s[n].r[e], visible, unmodified, scale, extras, mask, b, head[half], pos[half],
                                      key, &dcap);
            const float p = tc::exp_of_difference(x, lse_row[half]);
            float dpe = visible ? dp[n].r[e] : 0.f;
            if (extras.drop.enabled && visible) dpe *= extras.keep_factor<float>(b, head[half], pos[half], key);
            // Through the cap: d score / d (scale q . k) = dcap (1 without one).
            s[n].r[e] = attn::score_grad(p, dpe, dlt[half]) * dcap;
          }
        }
      }
      mma::FragA ds[kKeys / 16];
      tc::to_a_frags<T, kKeys>(ds, s);
      tc::mma_frags_rows<T, kKeys, kD, kStride>(dq, ds, k_tile);
      __syncthreads();  // every warp is done with this buffer before it is staged again
    }

#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = block.row0 + warp * 16 + group + 8 * half;
      if (row >= block.rows_total) continue;
      tc::store_acc_row<T, kN>(grad_q + rows.row_of_group_row(b, g, row) * d, dq, half, scale, quad, d);
    }
  }
}

FUSEDLLM_ATTENTION_KERNEL_NOTE(attention_mma_dq_kernel,
                               "tensor cores: bfloat16/float16 on sm_80+, float16 on sm_75")

// The lse and delta of a dK/dV block's staged rows, [2 buffers][kTile] each,
// in the padding columns of its K rows (16 bytes a row that no product
// reads): at head dim 256 a separate array would take the block 256 bytes
// past the 99 KiB sm_86/89 GPUs give one. Lanes of a quad read 4 rows' values
// from distinct banks; the groups read the same ones.
template <typename T, class Tl>
struct RowStats {
  static constexpr int kTile = Tl::kBwdTile;
  static constexpr int kRowFloats = Tl::kStride * sizeof(T) / sizeof(float);  // a K row
  static_assert((Tl::kStride - Tl::kD) * sizeof(T) == 4 * sizeof(float) && kTile % 4 == 0 && kTile <= tc::kRows,
                "4 statistics a K row, 4 kTile in all");
  float* first;  // K row 0's padding

  __device__ __forceinline__ explicit RowStats(T* k_s) : first(reinterpret_cast<float*>(k_s + Tl::kD)) {}

  // Statistic `which` (0: lse, 1: delta) of row `row` of a buffer's tile:
  // slot (2 which + buffer) kTile + row, 4 slots a K row.
  __device__ __forceinline__ float& at(int which, int buffer, int row) const {
    return in_row(which, buffer, row / 4, row % 4);
  }
  // at(which, buffer, 8 n + 2 quad + e): the tile row of element e (0 or 1)
  // of n-tile n in this lane's accumulator fragments, its K row and place
  // split so that only the buffer's offset is computed in the loop.
  __device__ __forceinline__ float of_lane(int which, int buffer, int n, int e, int quad) const {
    return in_row(which, buffer, 2 * n + quad / 2, 2 * (quad % 2) + e);
  }

 private:
  __device__ __forceinline__ float& in_row(int which, int buffer, int k_row, int place) const {
    return first[((2 * which + buffer) * (kTile / 4) + k_row) * kRowFloats + place];
  }
};

// Stages row tile `tile` of a dK/dV block into buffer tile % 2: the Q and dO
// rows from begin + tile kTile (zeros from `end` on) and each row's lse and delta.
template <typename T, class Tl>
struct RowTiles {
  static constexpr int kD = Tl::kD, kTile = Tl::kBwdTile, kStride = Tl::kStride;
  T* q_s;   // [2][kTile][kStride]
  T* do_s;  // [2][kTile][kStride]
  RowStats<T, Tl> stats;
  const T* q_b;
  const T* g_b;
  const Strides& qs;
  const Strides& gs;
  const float* lse;
  const float* delta;
  const attn::QueryRows& rows;
  int64_t g, b, begin, end;
  int d;
  bool chunks;

  __device__ __forceinline__ void operator()(int64_t tile) const {
    const int64_t r0 = begin + tile * kTile;
    const int buffer = static_cast<int>(tile % 2);
    // Unrolled at every head dim: dK/dV's accumulators leave the registers.
    tc::stage_group_rows<T, kD, kTile, true>(q_s + buffer * kTile * kStride, q_b, qs, rows, g, r0, end, d, chunks);
    tc::stage_group_rows<T, kD, kTile, true>(do_s + buffer * kTile * kStride, g_b, gs, rows, g, r0, end, d, chunks);
    if (threadIdx.x < kTile) {
      const int64_t row = r0 + threadIdx.x;
      float ls = 0.f, de = 0.f;
      if (row < end) {
        const int64_t lrow = rows.row_of_group_row(b, g, row);
        ls = attn::ScalarOps<float>::finite_or_zero(lse[lrow]);
        de = delta[lrow];
      }
      stats.at(0, buffer, threadIdx.x) = ls;
      stats.at(1, buffer, threadIdx.x) = de;
    }
  }
};

// This lane's two keys `key` of a dK/dV block (whose keys end at j_end)
// against a staged row tile (rows from rows_end on do not exist): P^T into s
// and dS^T into dp from S^T and dP^T there, [16 keys, kTile rows]
// accumulators whose element e of n-tile n is key e / 2 and row
// n * 8 + 2 quad + e % 2 of the tile.
template <typename T, class Tl>
struct KeyLanes {
  static constexpr int kTile = Tl::kBwdTile, kN = Tl::kDkdvCols / 8;
  const tc::BlockPlace& place;
  const attn::QueryRows& rows;
  const Mask& mask;
  const int64_t (&key)[2];
  int64_t j_end, rows_end;
  RowStats<T, Tl> stats;

  // A tile every row of which sees both keys, in a plain call: no test per score.
  __device__ __forceinline__ void interior_grads(mma::FragC (&s)[kTile / 8], mma::FragC (&dp)[kTile / 8],
                                                 int buffer, float scale) const {
#pragma unroll
    for (int n = 0; n < kTile / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = tc::exp_of_difference(s[n].r[e] * scale, stats.of_lane(0, buffer, n, e % 2, place.quad));
        dp[n].r[e] = attn::score_grad(p, dp[n].r[e], stats.of_lane(1, buffer, n, e % 2, place.quad));
        s[n].r[e] = p;
      }
    }
  }

  // Any other tile (rows r0 on): each score's visibility, modifiers and dropout.
  __device__ __forceinline__ void cut_grads(mma::FragC (&s)[kTile / 8], mma::FragC (&dp)[kTile / 8], int buffer,
                                            int64_t r0, bool unmodified, float scale,
                                            const ScoreExtras& extras) const {
#pragma unroll
    for (int n = 0; n < kTile / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = n * 8 + 2 * place.quad + (e % 2);
        const int64_t row = r0 + col, j = key[e / 2];
        const int64_t p_row = rows.group_pos(row), h = rows.group_head(place.g, row);
        const bool visible = row < rows_end && j < j_end && j >= attn::key_begin(mask, p_row) &&
                             j < attn::key_end(mask, p_row);
        float dcap;
        const float x = tc::score(s[n].r[e], visible, unmodified, scale, extras, mask, place.b, h, p_row, j, &dcap);
        const float p = tc::exp_of_difference(x, stats.of_lane(0, buffer, n, e % 2, place.quad));
        float keep = 1.f;
        if (extras.drop.enabled && visible) keep = extras.keep_factor<float>(place.b, h, p_row, j);
        const float dpe = visible ? dp[n].r[e] * keep : 0.f;
        // Through the cap: d score / d (scale q . k) = dcap (1 without one).
        dp[n].r[e] = attn::score_grad(p, dpe, stats.of_lane(1, buffer, n, e % 2, place.quad)) * dcap;
        s[n].r[e] = p * keep;  // dV sees the probabilities after dropout
      }
    }
  }

  // dK (times the scale) and dV of this lane's keys before j_end, columns
  // col0 on (those before d).
  __device__ __forceinline__ void store(const mma::FragC (&dk)[kN], const mma::FragC (&dv)[kN], T* grad_k,
                                        T* grad_v, const attn::KeyRows& key_rows, float scale, int col0,
                                        int d) const {
    const int64_t kv_row0 = key_rows.row(place.b, place.g, 0);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (key[half] >= j_end) continue;
      T* dk_row = grad_k + (kv_row0 + key[half]) * d + col0;
      T* dv_row = grad_v + (kv_row0 + key[half]) * d + col0;
      const int cols = d - col0;
#pragma unroll
      for (int n = 0; n < kN; ++n) {
        const int c = n * 8 + 2 * place.quad;
        if (c < cols) {
          dk_row[c] = T(dk[n].r[2 * half] * scale);
          dv_row[c] = T(dv[n].r[2 * half]);
        }
        if (c + 1 < cols) {
          dk_row[c + 1] = T(dk[n].r[2 * half + 1] * scale);
          dv_row[c + 1] = T(dv[n].r[2 * half + 1]);
        }
      }
    }
  }
};

template <typename T, class Tl>
__global__ void __launch_bounds__(tc::kThreads, 1)
attention_mma_dkdv_kernel(const T* __restrict__ grad_out, Strides gs, const T* __restrict__ q, Strides qs,
                          const T* __restrict__ k, Strides ks, const T* __restrict__ v, Strides vs,
                          const float* __restrict__ lse, const float* __restrict__ delta,
                          T* __restrict__ grad_k, T* __restrict__ grad_v, attn::QueryRows rows,
                          attn::KeyRows key_rows, attn::Seqs seqs, int d, float scale, Mask mask_all,
                          ScoreExtras extras, bool q_chunks, bool kv_chunks) {
  if constexpr (!tc::kBuiltHere<T, Tl::kArch>) {
    __trap();  // dispatch never launches it on this GPU
  } else {
    constexpr int kD = Tl::kD;
    constexpr int kTile = Tl::kBwdTile, kStride = Tl::kStride, kCols = Tl::kDkdvCols;
    T* k_s = dynamic_shared<T>();               // [kRows][kStride] (this block's keys)
    T* v_s = k_s + tc::kRows * kStride;         // [kRows][kStride]
    T* q_s = v_s + tc::kRows * kStride;         // [2][kTile][kStride]
    T* do_s = q_s + 2 * kTile * kStride;        // [2][kTile][kStride]
    const RowStats<T, Tl> stats(k_s);  // each staged row's lse and delta

    const tc::BlockPlace place;
    const int64_t g = place.g, b = place.b;
    const int warp = place.warp, group = place.group;
    const int64_t sq = seqs.q_len(b), sk = seqs.k_len(b);
    // Key block blockIdx.x / kDkdvSplits; its dK/dV columns col0 to col0 + kCols.
    const int64_t j0 = static_cast<int64_t>(blockIdx.x / Tl::kDkdvSplits) * tc::kRows;
    const int col0 = static_cast<int>(blockIdx.x % Tl::kDkdvSplits) * kCols;
    if (j0 >= sk) return;  // past this (packed) sequence's end: the whole block
    const int64_t j_end = j0 + tc::kRows < sk ? j0 + tc::kRows : sk;
    const Mask mask = mask_all.of_lengths(sq, sk);
    const T* q_b = place.query_side(q, qs, seqs);
    const T* g_b = place.query_side(grad_out, gs, seqs);
    const T* k_b = place.key_side(k, ks, seqs);
    const T* v_b = place.key_side(v, vs, seqs);

    tc::stage_key_rows<T, kD, tc::kRows>(k_s, v_s, k_b, ks.s, v_b, vs.s, j0, j_end, d, kv_chunks);

    // Rows (position, head) of the positions that see any key of this block.
    const int64_t rows_begin = rows.group_row(attn::query_begin(mask, j0, sq));
    const int64_t rows_end = rows.group_row(attn::query_end(mask, j_end, sq));
    const int64_t n_tiles = rows_end > rows_begin ? (rows_end - rows_begin + kTile - 1) / kTile : 0;
    const RowTiles<T, Tl> stage_rows{q_s, do_s, stats, q_b, g_b, qs, gs, lse, delta, rows, g, b,
                                     rows_begin, rows_end, d, q_chunks};
    tc::pipeline_start(n_tiles, stage_rows);

    // This lane's two keys (half 0: key `group` of the warp's 16, half 1: group + 8).
    int64_t key[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) key[half] = j0 + warp * 16 + group + 8 * half;
    const KeyLanes<T, Tl> lanes{place, rows, mask, key, j_end, rows_end, stats};
    const bool unmodified = !extras.mods.any_score_mod() && !extras.mask.present();
    const bool plain = unmodified && !extras.drop.enabled;
    // This warp's 16 keys (the key range of a row grows with its position).
    const int64_t warp_j0 = j0 + warp * 16, warp_j1 = warp_j0 + 16;

    mma::FragC dk[kCols / 8], dv[kCols / 8];
    for (int64_t tile = 0; tile < n_tiles; ++tile) {
      tc::pipeline_next(tile, n_tiles, stage_rows);
      const int buffer = static_cast<int>(tile % 2);
      const int64_t r0 = rows_begin + tile * kTile;
      const T* q_tile = q_s + buffer * kTile * kStride;
      const T* do_tile = do_s + buffer * kTile * kStride;

      mma::FragC s[kTile / 8], dp[kTile / 8];  // S^T and dP^T: [16 keys, kTile rows]
      tc::mma_rows_rows<T, kD, kTile, kStride>(s, k_s + warp * 16 * kStride, q_tile);
      tc::mma_rows_rows<T, kD, kTile, kStride>(dp, v_s + warp * 16 * kStride, do_tile);
      // Every row of the tile sees every key of this warp: its first row's
      // range ends after them and its last row's begins before them.
      const bool inside = plain && r0 + kTile <= rows_end && warp_j1 <= j_end &&
                          warp_j1 <= attn::key_end(mask, rows.group_pos(r0)) &&
                          warp_j0 >= attn::key_begin(mask, rows.group_pos(r0 + kTile - 1));
      if (inside) {
        lanes.interior_grads(s, dp, buffer, scale);
      } else {
        lanes.cut_grads(s, dp, buffer, r0, unmodified, scale, extras);
      }
      mma::FragA pa[kTile / 16], dsa[kTile / 16];
      tc::to_a_frags<T, kTile>(pa, s);
      tc::mma_frags_rows<T, kTile, kCols, kStride>(dv, pa, do_tile + col0);
      tc::to_a_frags<T, kTile>(dsa, dp);
      tc::mma_frags_rows<T, kTile, kCols, kStride>(dk, dsa, q_tile + col0);
      __syncthreads();  // every warp is done with this buffer before it is staged again
    }
    lanes.store(dk, dv, grad_k, grad_v, key_rows, scale, col0, d);
  }
}

FUSEDLLM_ATTENTION_KERNEL_NOTE(attention_mma_dkdv_kernel,
                               "tensor cores: bfloat16/float16 on sm_80+, float16 on sm_75; past head dim 128 "
                               "two blocks a key block, a column half each")

}  // namespace

void launch_attention_mma_delta(const AttentionBackwardPlan& p, const at::Tensor& delta, Stream stream) {
  const AttentionShape& s = p.shape;
  const attn::QueryRows rows = rows_of(p);
  const bool chunks = tc::chunks_aligned(p.grad_out.const_data_ptr(), strides_of(p.grad_out)) &&
                      tc::chunks_aligned(p.out.const_data_ptr(), strides_of(p.out));
  tc::with_mma_tiles(p.q.scalar_type(), s.head_dim, [&](auto dtype_tag, auto tiles) {
    using T = decltype(dtype_tag);
    using Tl = decltype(tiles);
    auto kernel = attention_mma_delta_kernel<T, Tl>;
    const size_t smem = sizeof(T) * Tl::kStride * 2 * tc::kRows;
    allow_shared_memory(kernel, smem);
    const dim3 grid(static_cast<unsigned>((rows.group_rows() + tc::kRows - 1) / tc::kRows),
                    static_cast<unsigned>(s.kv_heads), static_cast<unsigned>(s.batch));
    launch("attention_mma_delta_kernel", kernel, grid, tc::kThreads, smem, stream, p.grad_out.const_data_ptr<T>(),
           strides_of(p.grad_out), p.out.const_data_ptr<T>(), strides_of(p.out), delta.mutable_data_ptr<float>(),
           rows, p.seqs, static_cast<int>(s.head_dim), chunks);
  });
}

void launch_attention_mma_dq(const AttentionBackwardPlan& p, const at::Tensor& delta, Stream stream) {
  const AttentionShape& s = p.shape;
  const attn::QueryRows rows = rows_of(p);
  const bool q_chunks = tc::chunks_aligned(p.q.const_data_ptr(), strides_of(p.q)) &&
                        tc::chunks_aligned(p.grad_out.const_data_ptr(), strides_of(p.grad_out));
  const bool kv_chunks = tc::chunks_aligned(p.k.const_data_ptr(), strides_of(p.k)) &&
                         tc::chunks_aligned(p.v.const_data_ptr(), strides_of(p.v));
  tc::with_mma_tiles(p.q.scalar_type(), s.head_dim, [&](auto dtype_tag, auto tiles) {
    using T = decltype(dtype_tag);
    using Tl = decltype(tiles);
    auto kernel = attention_mma_dq_kernel<T, Tl>;
    const size_t smem = Tl::dq_smem(sizeof(T));
    allow_shared_memory(kernel, smem);
    const dim3 grid(static_cast<unsigned>((rows.group_rows() + tc::kRows - 1) / tc::kRows),
                    static_cast<unsigned>(s.kv_heads), static_cast<unsigned>(s.batch));
    launch("attention_mma_dq_kernel", kernel, grid, tc::kThreads, smem, stream, p.grad_out.const_data_ptr<T>(),
           strides_of(p.grad_out), p.q.const_data_ptr<T>(), strides_of(p.q), p.k.const_data_ptr<T>(),
           strides_of(p.k), p.v.const_data_ptr<T>(), strides_of(p.v), p.lse.const_data_ptr<float>(),
           delta.const_data_ptr<float>(), p.grad_q.mutable_data_ptr<T>(), rows, p.seqs,
           static_cast<int>(s.head_dim), static_cast<float>(p.scale), p.mask, extras_of(p), q_chunks, kv_chunks);
  });
}

void launch_attention_mma_dkdv(const AttentionBackwardPlan& p, const at::Tensor& delta, Stream stream) {
  const AttentionShape& s = p.shape;
  const bool q_chunks = tc::chunks_aligned(p.q.const_data_ptr(), strides_of(p.q)) &&
                        tc::chunks_aligned(p.grad_out.const_data_ptr(), strides_of(p.grad_out));
  const bool kv_chunks = tc::chunks_aligned(p.k.const_data_ptr(), strides_of(p.k)) &&
                         tc::chunks_aligned(p.v.const_data_ptr(), strides_of(p.v));
  tc::with_mma_tiles(p.q.scalar_type(), s.head_dim, [&](auto dtype_tag, auto tiles) {
    using T = decltype(dtype_tag);
    using Tl = decltype(tiles);
    auto kernel = attention_mma_dkdv_kernel<T, Tl>;
    const size_t smem = Tl::dkdv_smem(sizeof(T));
    allow_shared_memory(kernel, smem);
    // Sized by the longest sequence's keys (packed); shorter ones return
    // early. The column halves of a key block are neighbours, so that they
    // run together and read the same Q and dO tiles through L2.
    const dim3 grid(static_cast<unsigned>((s.sk + tc::kRows - 1) / tc::kRows * Tl::kDkdvSplits),
                    static_cast<unsigned>(s.kv_heads), static_cast<unsigned>(s.batch));
    launch("attention_mma_dkdv_kernel", kernel, grid, tc::kThreads, smem, stream,
           p.grad_out.const_data_ptr<T>(), strides_of(p.grad_out), p.q.const_data_ptr<T>(),
           strides_of(p.q), p.k.const_data_ptr<T>(), strides_of(p.k), p.v.const_data_ptr<T>(),
           strides_of(p.v), p.lse.const_data_ptr<float>(), delta.const_data_ptr<float>(),
           p.grad_k.mutable_data_ptr<T>(), p.grad_v.mutable_data_ptr<T>(), rows_of(p), p.key_rows,
           p.seqs, static_cast<int>(s.head_dim), static_cast<float>(p.scale), p.mask, extras_of(p),
           q_chunks, kv_chunks);
  });
}

}  // namespace fusedllm::cuda
