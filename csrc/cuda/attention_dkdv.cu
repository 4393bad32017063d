// attention backward on CUDA, second part: dK and dV, reduced over the query-head group.
#include "attention.cuh"

namespace fusedllm::cuda {
namespace {

// dK and dV for one tile of keys of kv head g, summed over every query row of
// the group that sees them (the group reduction happens here, in registers).
template <typename T, int kDL>
__global__ void __launch_bounds__(Cfg<at::opmath_type<T>, kDL>::kKvWarps * kWarpSize, 1)
attention_dkdv_kernel(const T* __restrict__ grad_out, Strides gs, const T* __restrict__ q, Strides qs,
                      const T* __restrict__ k, Strides ks, const T* __restrict__ v, Strides vs,
                      const at::opmath_type<T>* __restrict__ lse,
                      const at::opmath_type<T>* __restrict__ delta, T* __restrict__ grad_k,
                      T* __restrict__ grad_v, attn::QueryRows rows, attn::KeyRows key_rows,
                      attn::Seqs seqs, int d, at::opmath_type<T> scale, Mask mask_all,
                      ScoreExtras extras) {
  using acc_t = at::opmath_type<T>;
  using C = Cfg<acc_t, kDL>;
  using Ops = attn::ScalarOps<acc_t>;
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
  const auto fold = [&] {
#pragma unroll
    for (int kk = 0; kk < KW; ++kk) {
#pragma unroll
      for (int t = 0; t < kDL; ++t) {
        dk[kk][t] += dk_part[kk][t];
        dv[kk][t] += dv_part[kk][t];
        dk_part[kk][t] = dv_part[kk][t] = 0;
      }
    }
  };
  constexpr int kChunksPerSum = kSumChunk / RC > 0 ? kSumChunk / RC : 1;
  int chunks_in_sum = 0;

  // Rows (position, head) of the positions that see any key of this tile.
  const int64_t rows_begin = rows.group_row(attn::query_begin(mask, j0, sq));
  const int64_t rows_end = rows.group_row(attn::query_end(mask, j_end, sq));
  const T* qb_ptr = q + b * qs.b + q_start * qs.s;
  const T* gb_ptr = grad_out + b * gs.b + q_start * gs.s;
  const int64_t key = j0 + lane;

  for (int64_t r0 = rows_begin; r0 < rows_end; r0 += RC) {
    __syncthreads();  // the previous chunk is no longer read
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
    __syncthreads();

    // P and dS of the chunk: warp w takes row w, lane j takes key j.
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
    __syncthreads();

    // dV += P^T dO and dK += dS^T (Q * scale) for this warp's keys.
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
    if (++chunks_in_sum == kChunksPerSum) {
      fold();
      chunks_in_sum = 0;
    }
  }
  fold();

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

}  // namespace

void launch_attention_dkdv(const AttentionBackwardPlan& p, const at::Tensor& delta, Stream stream) {
  const AttentionShape& s = p.shape;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, p.q.scalar_type(), "fusedllm_attention_dkdv_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    with_head_dim(s.head_dim, [&](auto DL) {
      constexpr int kDL = decltype(DL)::value;
      using C = Cfg<acc_t, kDL>;
      auto kv_kernel = attention_dkdv_kernel<scalar_t, kDL>;
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
