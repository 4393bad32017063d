// attention backward on CUDA, second part: dK and dV, reduced over the query-head group.
#include "attention.cuh"

namespace fusedllm::cuda {
namespace {

// A block of the dK/dV kernel (kv head g of sequence b): its keys' K and V
// rows in k_s and v_s, and the chunk of RC query rows it works on (rows
// before rows_end exist): their Q (times the scale) and dO rows, lse (the
// softmax shift) and delta, and their P and dS against the keys. The keys
// [j0, j_end) come as arguments: read from members, chunk_scores' test of
// a key's visibility compiled to other branches.
template <typename T, int kDL, bool kNarrow>
struct KeyBlock {
  using acc_t = at::opmath_type<T>;
  using C = Cfg<acc_t, kDL, kNarrow>;
  static constexpr int KW = C::kKeysPerWarp;
  static constexpr int RC = C::kChunk;
  acc_t* k_s;
  acc_t* v_s;
  acc_t* q_s;
  acc_t* do_s;
  acc_t* p_s;
  acc_t* ds_s;
  acc_t* shift_s;
  acc_t* delta_s;
  const attn::QueryRows& rows;
  const Mask& mask;
  int64_t g, b, rows_end;
  int warp, lane;

  // Stages the chunk of rows from r0 (qb_ptr, gb_ptr: Q and dO of sequence b).
  __device__ __forceinline__ void stage_chunk(int64_t r0, const T* qb_ptr, Strides qs, const T* gb_ptr,
                                              Strides gs, const acc_t* lse, const acc_t* delta, int d,
                                              acc_t scale) const {
    using Ops = attn::ScalarOps<acc_t>;
    stage_rows<T, acc_t, C::kD, C::kLd>(q_s, RC, qb_ptr, qs, rows, g, r0, rows_end, d, scale);
    stage_rows<T, acc_t, C::kD, C::kLd>(do_s, RC, gb_ptr, gs, rows, g, r0, rows_end, d, acc_t(1));
    if (threadIdx.x < RC) {
      const int64_t row = r0 + threadIdx.x;
      acc_t sh = 0, de = 0;
      if (row < rows_end) {
        const int64_t lrow = rows.row_of_group_row(b, g, row);
        sh = Ops::finite_or_zero(lse[lrow]);
        de = delta[lrow];
      }
      shift_s[threadIdx.x] = sh;
      delta_s[threadIdx.x] = de;
    }
  }

  // P and dS of the chunk from r0 against keys [j0, j_end): warp w takes row
  // w, lane j takes key j0 + j.
  __device__ __forceinline__ void chunk_scores(int64_t r0, int64_t j0, int64_t j_end, const ScoreExtras& extras,
                                               int d_vec) const {
    using Ops = attn::ScalarOps<acc_t>;
    const int64_t key = j0 + lane;
    if (warp < RC && lane < C::kKeys) {
      const int64_t row = r0 + warp;
      acc_t p = 0, ds = 0;
      if (row < rows_end) {
        const int64_t pos = rows.group_pos(row);
        if (key >= attn::key_begin(mask, pos) && key < attn::key_end(mask, pos) && key < j_end) {
          const int64_t h = rows.group_head(g, row);
          acc_t dcap = 1;
          const acc_t s = extras.masked(
              extras.modified<acc_t>(
                  smem_dot<acc_t, C::kVec>(q_s + warp * C::kLd, k_s + lane * C::kLd, d_vec), b, h,
                  pos + mask.offset, key, &dcap),
              b, h, pos, key);
          const acc_t dp = smem_dot<acc_t, C::kVec>(do_s + warp * C::kLd, v_s + lane * C::kLd, d_vec);
          const acc_t z = extras.keep_factor<acc_t>(b, h, pos, key);
          const acc_t p_kept = Ops::exp(s - shift_s[warp]);
          // Through the cap: d score / d (scale q . k) = dcap (1 without one).
          ds = attn::score_grad(p_kept, dp * z, delta_s[warp]) * dcap;
          p = p_kept * z;  // dV sees the probabilities after dropout
        }
      }
      p_s[warp * C::kKeys + lane] = p;
      ds_s[warp * C::kKeys + lane] = ds;
    }
  }

  // dV += P^T dO and dK += dS^T (Q * scale) for this warp's keys, into the partial sums.
  __device__ __forceinline__ void accumulate(acc_t (&dk_part)[KW][kDL], acc_t (&dv_part)[KW][kDL]) const {
    for (int r = 0; r < RC; ++r) {
      acc_t dor[kDL], qr[kDL];
#pragma unroll
      for (int t = 0; t < kDL; ++t) {
        dor[t] = do_s[r * C::kLd + lane + kWarpSize * t];
        qr[t] = q_s[r * C::kLd + lane + kWarpSize * t];
      }
#pragma unroll
      for (int kk = 0; kk < KW; ++kk) {
        const acc_t p = p_s[r * C::kKeys + warp * KW + kk];
        const acc_t ds = ds_s[r * C::kKeys + warp * KW + kk];
#pragma unroll
        for (int t = 0; t < kDL; ++t) {
          dv_part[kk][t] += p * dor[t];
          dk_part[kk][t] += ds * qr[t];
        }
      }
    }
  }

  // dK and dV of this warp's keys of [j0, j_end).
  __device__ __forceinline__ void store(const acc_t (&dk)[KW][kDL], const acc_t (&dv)[KW][kDL], T* grad_k,
                                        T* grad_v, const attn::KeyRows& key_rows, int64_t j0, int64_t j_end,
                                        int d) const {
    const int64_t kv_row0 = key_rows.row(b, g, 0);
#pragma unroll
    for (int kk = 0; kk < KW; ++kk) {
      const int64_t key_out = j0 + warp * KW + kk;
      if (key_out >= j_end) continue;
#pragma unroll
      for (int t = 0; t < kDL; ++t) {
        const int c = lane + kWarpSize * t;
        if (c < d) {
          grad_k[(kv_row0 + key_out) * d + c] = static_cast<T>(dk[kk][t]);
          grad_v[(kv_row0 + key_out) * d + c] = static_cast<T>(dv[kk][t]);
        }
      }
    }
  }
};

// The partial sums added to the totals, and zeroed.
template <typename acc_t, int KW, int kDL>
__device__ __forceinline__ void fold(acc_t (&dk)[KW][kDL], acc_t (&dv)[KW][kDL], acc_t (&dk_part)[KW][kDL],
                                     acc_t (&dv_part)[KW][kDL]) {
#pragma unroll
  for (int kk = 0; kk < KW; ++kk) {
#pragma unroll
    for (int t = 0; t < kDL; ++t) {
      dk[kk][t] += dk_part[kk][t];
      dv[kk][t] += dv_part[kk][t];
      dk_part[kk][t] = dv_part[kk][t] = 0;
    }
  }
}

// dK and dV for one tile of keys of kv head g, summed over every query row of
// the group that sees them (the group reduction happens here, in registers).
template <typename T, int kDL, bool kNarrow>
__global__ void __launch_bounds__(Cfg<at::opmath_type<T>, kDL>::kKvWarps * kWarpSize, 1)
attention_dkdv_kernel(const T* __restrict__ grad_out, Strides gs, const T* __restrict__ q, Strides qs,
                      const T* __restrict__ k, Strides ks, const T* __restrict__ v, Strides vs,
                      const at::opmath_type<T>* __restrict__ lse,
                      const at::opmath_type<T>* __restrict__ delta, T* __restrict__ grad_k,
                      T* __restrict__ grad_v, attn::QueryRows rows, attn::KeyRows key_rows,
                      attn::Seqs seqs, int d, at::opmath_type<T> scale, Mask mask_all,
                      ScoreExtras extras) {
  using acc_t = at::opmath_type<T>;
  using C = Cfg<acc_t, kDL, kNarrow>;
  constexpr int KW = C::kKeysPerWarp;
  constexpr int RC = C::kChunk;
  acc_t* k_s = dynamic_shared<acc_t>();
  acc_t* v_s = k_s + C::kKeys * C::kLd;
  acc_t* q_s = v_s + C::kKeys * C::kLd;
  acc_t* do_s = q_s + RC * C::kLd;
  acc_t* p_s = do_s + RC * C::kLd;
  acc_t* ds_s = p_s + RC * C::kKeys;
  acc_t* shift_s = ds_s + RC * C::kKeys;
  acc_t* delta_s = shift_s + RC;

  const int64_t g = blockIdx.y, b = blockIdx.z;
  const int64_t sq = seqs.q_len(b), sk = seqs.k_len(b);
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * C::kKeys;
  if (j0 >= sk) return;  // past this (packed) sequence's end: the whole block
  const int64_t j_end = j0 + C::kKeys < sk ? j0 + C::kKeys : sk;
  const Mask mask = mask_all.of_lengths(sq, sk);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int d_vec = (d + C::kVec - 1) / C::kVec * C::kVec;
  const int64_t q_start = seqs.q_start(b), k_start = seqs.k_start(b);

  stage_keys<T, acc_t, C::kD, C::kLd, C::kKeys>(k_s, k + b * ks.b + g * ks.h + k_start * ks.s, ks.s, j0,
                                                 j_end, d);
  stage_keys<T, acc_t, C::kD, C::kLd, C::kKeys>(v_s, v + b * vs.b + g * vs.h + k_start * vs.s, vs.s, j0,
                                                 j_end, d);

  // Totals, and the sums of the latest kSumChunk rows, added to them when full.
  acc_t dk[KW][kDL], dv[KW][kDL], dk_part[KW][kDL], dv_part[KW][kDL];
#pragma unroll
  for (int kk = 0; kk < KW; ++kk) {
#pragma unroll
    for (int t = 0; t < kDL; ++t) dk[kk][t] = dv[kk][t] = dk_part[kk][t] = dv_part[kk][t] = 0;
  }
  constexpr int kChunksPerSum = kSumChunk / RC > 0 ? kSumChunk / RC : 1;
  int chunks_in_sum = 0;

  // Rows (position, head) of the positions that see any key of this tile.
  const int64_t rows_begin = rows.group_row(attn::query_begin(mask, j0, sq));
  const int64_t rows_end = rows.group_row(attn::query_end(mask, j_end, sq));
  const T* qb_ptr = q + b * qs.b + q_start * qs.s;
  const T* gb_ptr = grad_out + b * gs.b + q_start * gs.s;
  const KeyBlock<T, kDL, kNarrow> block{k_s, v_s, q_s, do_s, p_s, ds_s, shift_s, delta_s, rows, mask, g, b, rows_end,
                               warp, lane};

  for (int64_t r0 = rows_begin; r0 < rows_end; r0 += RC) {
    __syncthreads();  // the previous chunk is no longer read
    block.stage_chunk(r0, qb_ptr, qs, gb_ptr, gs, lse, delta, d, scale);
    __syncthreads();
    block.chunk_scores(r0, j0, j_end, extras, d_vec);
    __syncthreads();
    block.accumulate(dk_part, dv_part);
    if (++chunks_in_sum == kChunksPerSum) {
      fold(dk, dv, dk_part, dv_part);
      chunks_in_sum = 0;
    }
  }
  fold(dk, dv, dk_part, dv_part);
  block.store(dk, dv, grad_k, grad_v, key_rows, j0, j_end, d);
}

FUSEDLLM_ATTENTION_KERNEL_NOTE(attention_dkdv_kernel, "SIMT")

}  // namespace

void launch_attention_dkdv(const AttentionBackwardPlan& p, const at::Tensor& delta, Stream stream) {
  const AttentionShape& s = p.shape;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, p.q.scalar_type(), "fusedllm_attention_dkdv_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    with_cfg<acc_t>(s.head_dim, [](auto c) { return decltype(c)::kv_smem(); }, [&](auto cfg) {
      using C = decltype(cfg);
      auto kv_kernel = attention_dkdv_kernel<scalar_t, C::kDL, C::kNarrow>;
      allow_shared_memory(kv_kernel, C::kv_smem());
      // Sized by the longest sequence's keys (packed); shorter ones return early.
      const dim3 kv_grid(static_cast<unsigned>((s.sk + C::kKeys - 1) / C::kKeys),
                         static_cast<unsigned>(s.kv_heads), static_cast<unsigned>(s.batch));
      launch("attention_dkdv_kernel", kv_kernel, kv_grid, C::kKvWarps * kWarpSize, C::kv_smem(),
          stream, p.grad_out.const_data_ptr<scalar_t>(), strides_of(p.grad_out),
          p.q.const_data_ptr<scalar_t>(), strides_of(p.q), p.k.const_data_ptr<scalar_t>(),
          strides_of(p.k), p.v.const_data_ptr<scalar_t>(), strides_of(p.v),
          p.lse.const_data_ptr<acc_t>(), delta.const_data_ptr<acc_t>(),
          p.grad_k.mutable_data_ptr<scalar_t>(), p.grad_v.mutable_data_ptr<scalar_t>(), rows_of(p),
          p.key_rows, p.seqs, static_cast<int>(s.head_dim),
          static_cast<acc_t>(p.scale), p.mask, extras_of(p));
    });
  });
}

}  // namespace fusedllm::cuda
