// attention backward on CUDA (SIMT), first part: delta = rowsum(dO * O), then dQ.
#include "attention.cuh"

namespace fusedllm::cuda {
namespace {

// delta = rowsum(dO * O) of a tile of rows (position, head) of kv head g,
// staged and summed as the dQ and dK/dV kernels stage and sum dP = dO . v
// (smem_dot): a row whose output is one key's value row (that key alone
// visible) gets dP - delta = 0 exactly, and so dQ and dK exactly 0.
template <typename T, int kDL>
__global__ void attention_delta_kernel(const T* __restrict__ grad_out, Strides gs, const T* __restrict__ out,
                                       Strides os, at::opmath_type<T>* __restrict__ delta, attn::QueryRows rows,
                                       attn::Seqs seqs, int d) {
  using acc_t = at::opmath_type<T>;
  using C = Cfg<acc_t, kDL>;
  acc_t* do_s = dynamic_shared<acc_t>();
  acc_t* o_s = do_s + C::kDqRows * C::kLd;
  const int64_t g = blockIdx.y, b = blockIdx.z;
  const int64_t rows_total = seqs.q_len(b) * rows.group;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * C::kDqRows;
  if (row0 >= rows_total) return;  // past this (packed) sequence's end
  const int64_t q_start = seqs.q_start(b);
  stage_rows<T, acc_t, C::kD, C::kLd>(do_s, C::kDqRows, grad_out + b * gs.b + q_start * gs.s, gs, rows, g, row0,
                                       rows_total, d, acc_t(1));
  stage_rows<T, acc_t, C::kD, C::kLd>(o_s, C::kDqRows, out + b * os.b + q_start * os.s, os, rows, g, row0,
                                       rows_total, d, acc_t(1));
  __syncthreads();
  const int64_t row = row0 + threadIdx.x;
  if (threadIdx.x < C::kDqRows && row < rows_total) {
    const int d_vec = (d + C::kVec - 1) / C::kVec * C::kVec;
    delta[rows.row_of_group_row(b, g, row)] =
        smem_dot<acc_t, C::kVec>(do_s + threadIdx.x * C::kLd, o_s + threadIdx.x * C::kLd, d_vec);
  }
}

FUSEDLLM_ATTENTION_KERNEL_NOTE(attention_delta_kernel, "SIMT")

// dQ for a tile of rows (position, head) of kv head g over every key they see.
template <typename T, int kDL, bool kNarrow>
__global__ void __launch_bounds__(Cfg<at::opmath_type<T>, kDL>::kDqWarps * kWarpSize, 1)
attention_dq_kernel(const T* __restrict__ grad_out, Strides gs, const T* __restrict__ q, Strides qs,
                    const T* __restrict__ k, Strides ks, const T* __restrict__ v, Strides vs,
                    const at::opmath_type<T>* __restrict__ lse,
                    const at::opmath_type<T>* __restrict__ delta, T* __restrict__ grad_q,
                    attn::QueryRows rows, attn::Seqs seqs, int d, at::opmath_type<T> scale,
                    Mask mask_all, ScoreExtras extras) {
  using acc_t = at::opmath_type<T>;
  using C = Cfg<acc_t, kDL, kNarrow>;
  using Ops = attn::ScalarOps<acc_t>;
  constexpr int RW = C::kDqRowsPerWarp;
  acc_t* q_s = dynamic_shared<acc_t>();
  acc_t* do_s = q_s + C::kDqRows * C::kLd;
  acc_t* k_s = do_s + C::kDqRows * C::kLd;
  acc_t* v_s = k_s + C::kKeys * C::kLd;

  const int64_t g = blockIdx.y, b = blockIdx.z;
  const int64_t sq = seqs.q_len(b);
  const int64_t rows_total = sq * rows.group;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * C::kDqRows;
  if (row0 >= rows_total) return;  // past this (packed) sequence's end: the whole block
  const Mask mask = mask_all.of_lengths(sq, seqs.k_len(b));
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int d_vec = (d + C::kVec - 1) / C::kVec * C::kVec;
  const int64_t q_start = seqs.q_start(b), k_start = seqs.k_start(b);
  const T* kb_ptr = k + b * ks.b + g * ks.h + k_start * ks.s;
  const T* vb_ptr = v + b * vs.b + g * vs.h + k_start * vs.s;

  stage_rows<T, acc_t, C::kD, C::kLd>(q_s, C::kDqRows, q + b * qs.b + q_start * qs.s, qs, rows, g, row0,
                                       rows_total, d, scale);
  stage_rows<T, acc_t, C::kD, C::kLd>(do_s, C::kDqRows, grad_out + b * gs.b + q_start * gs.s, gs, rows,
                                       g, row0, rows_total, d, acc_t(1));

  acc_t dq[RW][kDL], shift[RW], dlt[RW];
  int64_t lo[RW], hi[RW];
#pragma unroll
  for (int r = 0; r < RW; ++r) {
    const int64_t row = row0 + warp * RW + r;
    const bool valid = row < rows_total;
    const int64_t lrow = valid ? rows.row_of_group_row(b, g, row) : 0;
#pragma unroll
    for (int t = 0; t < kDL; ++t) dq[r][t] = 0;
    shift[r] = valid ? Ops::finite_or_zero(lse[lrow]) : acc_t(0);
    dlt[r] = valid ? delta[lrow] : acc_t(0);
    lo[r] = valid ? attn::key_begin(mask, rows.group_pos(row)) : 0;
    hi[r] = valid ? attn::key_end(mask, rows.group_pos(row)) : 0;
  }
  const int64_t last_row = (row0 + C::kDqRows < rows_total ? row0 + C::kDqRows : rows_total) - 1;
  const int64_t key_lo = attn::key_begin(mask, rows.group_pos(row0));
  const int64_t key_hi = attn::key_end(mask, rows.group_pos(last_row));

  for (int64_t j0 = key_lo; j0 < key_hi; j0 += C::kKeys) {
    __syncthreads();
    stage_keys<T, acc_t, C::kD, C::kLd, C::kKeys>(k_s, kb_ptr, ks.s, j0, key_hi, d);
    stage_keys<T, acc_t, C::kD, C::kLd, C::kKeys>(v_s, vb_ptr, vs.s, j0, key_hi, d);
    __syncthreads();

    const int64_t key = j0 + lane;
    acc_t ds[RW];
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      const bool visible = lane < C::kKeys && key >= lo[r] && key < hi[r];
      acc_t p = 0, dp = 0, dcap = 1;
      if (visible) {
        const int64_t row = row0 + warp * RW + r;
        const int64_t h = rows.group_head(g, row), pos = rows.group_pos(row);
        const acc_t s = extras.masked(
            extras.modified<acc_t>(smem_dot<acc_t, C::kVec>(q_s + (warp * RW + r) * C::kLd,
                                                            k_s + lane * C::kLd, d_vec),
                                   b, h, pos + mask.offset, key, &dcap),
            b, h, pos, key);
        dp = smem_dot<acc_t, C::kVec>(do_s + (warp * RW + r) * C::kLd, v_s + lane * C::kLd, d_vec) *
             extras.keep_factor<acc_t>(b, h, pos, key);
        p = Ops::exp(s - shift[r]);
      }
      // Through the cap: d score / d (scale q . k) = dcap (1 without one).
      ds[r] = attn::score_grad(p, dp, dlt[r]) * dcap;
    }
    // This tile's dS K from zero, then added to dQ (see kSumChunk).
    acc_t dq_tile[RW][kDL];
#pragma unroll
    for (int r = 0; r < RW; ++r) {
#pragma unroll
      for (int t = 0; t < kDL; ++t) dq_tile[r][t] = 0;
    }
    for (int jj = 0; jj < C::kKeys; ++jj) {
      acc_t kj[kDL];
#pragma unroll
      for (int t = 0; t < kDL; ++t) kj[t] = k_s[jj * C::kLd + lane + kWarpSize * t];
#pragma unroll
      for (int r = 0; r < RW; ++r) {
        const acc_t dsj = warp_broadcast(ds[r], jj);
#pragma unroll
        for (int t = 0; t < kDL; ++t) dq_tile[r][t] += dsj * kj[t];
      }
    }
#pragma unroll
    for (int r = 0; r < RW; ++r) {
#pragma unroll
      for (int t = 0; t < kDL; ++t) dq[r][t] += dq_tile[r][t];
    }
  }

#pragma unroll
  for (int r = 0; r < RW; ++r) {
    const int64_t row = row0 + warp * RW + r;
    if (row >= rows_total) continue;
    const int64_t out_row = rows.row_of_group_row(b, g, row);
#pragma unroll
    for (int t = 0; t < kDL; ++t) {
      const int c = lane + kWarpSize * t;
      if (c < d) grad_q[out_row * d + c] = static_cast<T>(dq[r][t] * scale);
    }
  }
}

FUSEDLLM_ATTENTION_KERNEL_NOTE(attention_dq_kernel, "SIMT")

}  // namespace

void launch_attention_delta(const AttentionBackwardPlan& p, const at::Tensor& delta, Stream stream) {
  const AttentionShape& s = p.shape;
  const attn::QueryRows rows = rows_of(p);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, p.q.scalar_type(), "fusedllm_attention_delta_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    with_head_dim(s.head_dim, [&](auto DL) {
      constexpr int kDL = decltype(DL)::value;
      using C = Cfg<acc_t, kDL>;
      const size_t smem = sizeof(acc_t) * C::kLd * 2 * C::kDqRows;
      const dim3 grid(static_cast<unsigned>((rows.group_rows() + C::kDqRows - 1) / C::kDqRows),
                      static_cast<unsigned>(s.kv_heads), static_cast<unsigned>(s.batch));
      launch("attention_delta_kernel", attention_delta_kernel<scalar_t, kDL>, grid, C::kDqWarps * kWarpSize, smem,
             stream, p.grad_out.const_data_ptr<scalar_t>(), strides_of(p.grad_out),
             p.out.const_data_ptr<scalar_t>(), strides_of(p.out), delta.mutable_data_ptr<acc_t>(), rows, p.seqs,
             static_cast<int>(s.head_dim));
    });
  });
}

void launch_attention_dq(const AttentionBackwardPlan& p, const at::Tensor& delta, Stream stream) {
  const AttentionShape& s = p.shape;
  const attn::QueryRows rows = rows_of(p);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, p.q.scalar_type(), "fusedllm_attention_dq_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    with_cfg<acc_t>(s.head_dim, [](auto c) { return decltype(c)::dq_smem(); }, [&](auto cfg) {
      using C = decltype(cfg);
      auto dq_kernel = attention_dq_kernel<scalar_t, C::kDL, C::kNarrow>;
      allow_shared_memory(dq_kernel, C::dq_smem());
      const dim3 dq_grid(static_cast<unsigned>((rows.group_rows() + C::kDqRows - 1) / C::kDqRows),
                         static_cast<unsigned>(s.kv_heads), static_cast<unsigned>(s.batch));
      launch("attention_dq_kernel", dq_kernel, dq_grid, C::kDqWarps * kWarpSize, C::dq_smem(),
          stream, p.grad_out.const_data_ptr<scalar_t>(), strides_of(p.grad_out),
          p.q.const_data_ptr<scalar_t>(), strides_of(p.q), p.k.const_data_ptr<scalar_t>(),
          strides_of(p.k), p.v.const_data_ptr<scalar_t>(), strides_of(p.v),
          p.lse.const_data_ptr<acc_t>(), delta.const_data_ptr<acc_t>(),
          p.grad_q.mutable_data_ptr<scalar_t>(), rows, p.seqs, static_cast<int>(s.head_dim),
          static_cast<acc_t>(p.scale), p.mask, extras_of(p));
    });
  });
}

}  // namespace fusedllm::cuda
