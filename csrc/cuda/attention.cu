// attention ops on CUDA: SIMT kernels with float32 (float64) accumulation.
//
// Rows of one (batch, kv head) pair are ordered (position, query head), as on
// the CPU, so a block that loads a K/V tile into shared memory serves every
// query head of the group. Scores: lane j of a warp owns key j of the tile and
// computes q . k_j for the warp's rows from shared memory; softmax statistics
// are warp reductions; for P V (and dS K) each lane owns head_dim entries
// lane, lane + 32, ... and takes p_j from lane j by shuffle. The online-softmax
// step, masks and score gradient come from fusedllm/attention.h, the code the
// CPU kernels run too.
//
// Backward: delta = rowsum(dO * O) once; dQ by a kernel shaped like the
// forward (one block per tile of rows, every key tile); dK/dV by a kernel with
// one block per key tile that walks every query row of the group. Nothing is
// accumulated with atomics, so the gradients are deterministic.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <limits>
#include <type_traits>

#include "fusedllm/attention.h"
#include "fusedllm/attention_op.h"
#include "fusedllm/dropout.h"
#include "primitives.cuh"

namespace fusedllm::cuda {
namespace {

using attn::Mask;

struct Strides {
  int64_t b, h, s;
};

Strides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// Tile shapes for head dims up to 32 * kDL, in accumulator type acc_t.
template <typename acc_t, int kDL>
struct Cfg {
  static constexpr int kD = kWarpSize * kDL;                 // padded head dim
  static constexpr int kVec = 16 / sizeof(acc_t);            // elements per 16-byte access
  static constexpr int kLd = kD + kVec;                      // shared row stride: lanes reading
                                                             // different rows hit different banks
  static constexpr int kKeys = sizeof(acc_t) == 8 ? 16 : 32;  // keys per tile, one per lane
  static constexpr bool kWide = sizeof(acc_t) == 8;

  // forward: 4 warps, each owning kFwdRowsPerWarp rows
  static constexpr int kFwdWarps = 4;
  static constexpr int kFwdRowsPerWarp = kWide ? 2 : 4;
  static constexpr int kFwdRows = kFwdWarps * kFwdRowsPerWarp;
  static constexpr size_t fwd_smem() { return sizeof(acc_t) * kLd * (kFwdRows + 2 * kKeys); }

  // dQ: like the forward with dO rows as well
  static constexpr int kDqWarps = 4;
  static constexpr int kDqRowsPerWarp = kWide ? 1 : 2;
  static constexpr int kDqRows = kDqWarps * kDqRowsPerWarp;
  static constexpr size_t dq_smem() { return sizeof(acc_t) * kLd * (2 * kDqRows + 2 * kKeys); }

  // dK/dV: 8 warps, each owning kKeys / 8 keys; rows staged kChunk at a time
  static constexpr int kKvWarps = 8;
  static constexpr int kKeysPerWarp = kKeys / kKvWarps;
  static constexpr int kChunk = kWide ? 4 : 8;
  static constexpr size_t kv_smem() {
    return sizeof(acc_t) * (kLd * (2 * kKeys + 2 * kChunk) + 2 * kChunk * kKeys + 2 * kChunk);
  }
};

// Copies `n_rows` rows of head_dim d starting at row0 of the (position, head)
// ordering of kv head g into shared rows of stride kLd, times `scale`; zeros
// past d and past the last row.
template <typename T, typename acc_t, int kD, int kLd>
__device__ __forceinline__ void stage_rows(acc_t* dst, int n_rows, const T* base, Strides st,
                                           int64_t g, int64_t group, int64_t row0, int64_t rows_total,
                                           int d, acc_t scale) {
  for (int idx = threadIdx.x; idx < n_rows * kD; idx += blockDim.x) {
    const int r = idx / kD, c = idx % kD;
    const int64_t row = row0 + r;
    acc_t val = 0;
    if (row < rows_total && c < d) {
      const int64_t pos = row / group, h = g * group + row % group;
      val = static_cast<acc_t>(base[h * st.h + pos * st.s + c]) * scale;
    }
    dst[r * kLd + c] = val;
  }
}

// Copies keys [j0, j0 + kKeys) of one kv head (zeros past `end` and past d).
template <typename T, typename acc_t, int kD, int kLd, int kKeys>
__device__ __forceinline__ void stage_keys(acc_t* dst, const T* base, int64_t seq_stride, int64_t j0,
                                           int64_t end, int d) {
  for (int idx = threadIdx.x; idx < kKeys * kD; idx += blockDim.x) {
    const int jj = idx / kD, c = idx % kD;
    const int64_t key = j0 + jj;
    dst[jj * kLd + c] = (key < end && c < d) ? static_cast<acc_t>(base[key * seq_stride + c]) : acc_t(0);
  }
}

// a . b over the first n (a multiple of kVec) entries of two shared rows.
template <typename acc_t, int kVec>
__device__ __forceinline__ acc_t smem_dot(const acc_t* a, const acc_t* b, int n) {
  acc_t sum = 0;
#pragma unroll 4
  for (int c = 0; c < n; c += kVec) {
    const Pack<acc_t, kVec> x = load_pack<acc_t, kVec>(a + c);
    const Pack<acc_t, kVec> y = load_pack<acc_t, kVec>(b + c);
#pragma unroll
    for (int e = 0; e < kVec; ++e) sum += x.v[e] * y.v[e];
  }
  return sum;
}

// What a score sees besides causal/window: the caller's mask (added, or -inf
// where a bool mask is False) and the dropout of its probability.
struct ScoreExtras {
  attn::TensorMask mask;
  dropout::Dropout drop;
  int64_t q_heads = 0, sq = 0, sk = 0;

  template <typename acc_t>
  __device__ __forceinline__ acc_t masked(acc_t s, int64_t b, int64_t h, int64_t pos,
                                          int64_t key) const {
    if (!mask.present()) return s;
    const int64_t off = mask.offset(b, h, pos) + key * mask.k_stride;
    if (mask.kind == attn::MaskKind::kBool) {
      return static_cast<const bool*>(mask.data)[off] ? s : -std::numeric_limits<acc_t>::infinity();
    }
    double x = 0;  // exact for every float mask dtype
    switch (mask.kind) {
      case attn::MaskKind::kFloat: x = static_cast<const float*>(mask.data)[off]; break;
      case attn::MaskKind::kDouble: x = static_cast<const double*>(mask.data)[off]; break;
      case attn::MaskKind::kBFloat16:
        x = static_cast<float>(static_cast<const c10::BFloat16*>(mask.data)[off]);
        break;
      case attn::MaskKind::kHalf: x = static_cast<float>(static_cast<const c10::Half*>(mask.data)[off]); break;
      default: break;
    }
    // The dtype's most negative finite value means "masked" (see attention.h).
    return x <= attn::mask_lowest(mask.kind) ? -std::numeric_limits<acc_t>::infinity()
                                             : s + static_cast<acc_t>(x);
  }

  // 1 / (1 - p) where probability (b, h, pos, key) is kept, else 0; 1 without dropout.
  template <typename acc_t>
  __device__ __forceinline__ acc_t keep_factor(int64_t b, int64_t h, int64_t pos, int64_t key) const {
    if (!drop.enabled) return acc_t(1);
    const uint64_t n = static_cast<uint64_t>(((b * q_heads + h) * sq + pos) * sk + key);
    return dropout::keep(drop.seed, n, drop.threshold) ? static_cast<acc_t>(drop.scale) : acc_t(0);
  }
};

// ---------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------

// Every kernel below declares one resident block per SM as its minimum, so
// ptxas may use the registers the unrolled row/column arrays need instead of
// spilling them to reach a higher occupancy target.

template <typename T, int kDL>
__global__ void __launch_bounds__(Cfg<at::opmath_type<T>, kDL>::kFwdWarps * kWarpSize, 1)
attention_forward_kernel(const T* __restrict__ q, Strides qs, const T* __restrict__ k, Strides ks,
                         const T* __restrict__ v, Strides vs, T* __restrict__ out,
                         at::opmath_type<T>* __restrict__ lse, int64_t q_heads, int64_t group,
                         int64_t sq, int d, at::opmath_type<T> scale, Mask mask, ScoreExtras extras) {
  using acc_t = at::opmath_type<T>;
  using C = Cfg<acc_t, kDL>;
  using Ops = attn::ScalarOps<acc_t>;
  constexpr int RW = C::kFwdRowsPerWarp;
  acc_t* q_s = dynamic_shared<acc_t>();
  acc_t* k_s = q_s + C::kFwdRows * C::kLd;
  acc_t* v_s = k_s + C::kKeys * C::kLd;

  const int64_t g = blockIdx.y, b = blockIdx.z;
  const int64_t rows_total = sq * group;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * C::kFwdRows;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int d_vec = (d + C::kVec - 1) / C::kVec * C::kVec;
  const T* kb_ptr = k + b * ks.b + g * ks.h;
  const T* vb_ptr = v + b * vs.b + g * vs.h;

  stage_rows<T, acc_t, C::kD, C::kLd>(q_s, C::kFwdRows, q + b * qs.b, qs, g, group, row0, rows_total,
                                       d, scale);

  acc_t m[RW], l[RW], o[RW][kDL];
  int64_t lo[RW], hi[RW];
#pragma unroll
  for (int r = 0; r < RW; ++r) {
    const int64_t row = row0 + warp * RW + r;
    m[r] = -std::numeric_limits<acc_t>::infinity();
    l[r] = 0;
#pragma unroll
    for (int t = 0; t < kDL; ++t) o[r][t] = 0;
    lo[r] = row < rows_total ? attn::key_begin(mask, row / group) : 0;
    hi[r] = row < rows_total ? attn::key_end(mask, row / group) : 0;
  }
  const int64_t last_row = (row0 + C::kFwdRows < rows_total ? row0 + C::kFwdRows : rows_total) - 1;
  const int64_t key_lo = attn::key_begin(mask, row0 / group);
  const int64_t key_hi = attn::key_end(mask, last_row / group);

  for (int64_t j0 = key_lo; j0 < key_hi; j0 += C::kKeys) {
    __syncthreads();  // the previous tile (and, first time, nothing) is no longer read
    stage_keys<T, acc_t, C::kD, C::kLd, C::kKeys>(k_s, kb_ptr, ks.s, j0, key_hi, d);
    stage_keys<T, acc_t, C::kD, C::kLd, C::kKeys>(v_s, vb_ptr, vs.s, j0, key_hi, d);
    __syncthreads();

    const int64_t key = j0 + lane;
    acc_t p[RW];
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      acc_t s = lane < C::kKeys ? smem_dot<acc_t, C::kVec>(q_s + (warp * RW + r) * C::kLd,
                                                           k_s + lane * C::kLd, d_vec)
                                : acc_t(0);
      const bool visible = lane < C::kKeys && key >= lo[r] && key < hi[r];
      const int64_t row = row0 + warp * RW + r;
      const int64_t h = g * group + row % group, pos = row / group;
      s = visible ? extras.masked(s, b, h, pos, key) : -std::numeric_limits<acc_t>::infinity();
      acc_t shift;
      const acc_t alpha = attn::online_softmax_step(m[r], warp_reduce_max(s), shift, Ops{});
      p[r] = visible ? Ops::exp(s - shift) : acc_t(0);
      // The row sum (and so the lse) is that of the probabilities before dropout.
      l[r] = l[r] * alpha + warp_reduce_sum(p[r]);
      if (visible) p[r] *= extras.keep_factor<acc_t>(b, h, pos, key);
#pragma unroll
      for (int t = 0; t < kDL; ++t) o[r][t] *= alpha;
    }
    for (int jj = 0; jj < C::kKeys; ++jj) {
      acc_t vj[kDL];
#pragma unroll
      for (int t = 0; t < kDL; ++t) vj[t] = v_s[jj * C::kLd + lane + kWarpSize * t];
#pragma unroll
      for (int r = 0; r < RW; ++r) {
        const acc_t pj = warp_broadcast(p[r], jj);
#pragma unroll
        for (int t = 0; t < kDL; ++t) o[r][t] += pj * vj[t];
      }
    }
  }

#pragma unroll
  for (int r = 0; r < RW; ++r) {
    const int64_t row = row0 + warp * RW + r;
    if (row >= rows_total) continue;
    const int64_t h = g * group + row % group, pos = row / group;
    const int64_t out_row = (b * q_heads + h) * sq + pos;
    const acc_t inv = attn::row_inv_sum(l[r]);
#pragma unroll
    for (int t = 0; t < kDL; ++t) {
      const int c = lane + kWarpSize * t;
      if (c < d) out[out_row * d + c] = static_cast<T>(o[r][t] * inv);
    }
    if (lane == 0) lse[out_row] = attn::row_lse(m[r], l[r]);
  }
}

// ---------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------

// delta[row] = sum(dO * O) over head_dim, one warp per row of [B, Hq, Sq].
template <typename T>
__global__ void attention_delta_kernel(const T* __restrict__ grad_out, Strides gs,
                                       const T* __restrict__ out, Strides os,
                                       at::opmath_type<T>* __restrict__ delta, int64_t q_heads,
                                       int64_t sq, int64_t n_rows, int d) {
  using acc_t = at::opmath_type<T>;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps_per_block = blockDim.x / kWarpSize;
  for (int64_t row = blockIdx.x * warps_per_block + threadIdx.x / kWarpSize; row < n_rows;
       row += static_cast<int64_t>(gridDim.x) * warps_per_block) {
    const int64_t pos = row % sq, bh = row / sq;
    const int64_t h = bh % q_heads, b = bh / q_heads;
    const T* g = grad_out + b * gs.b + h * gs.h + pos * gs.s;
    const T* o = out + b * os.b + h * os.h + pos * os.s;
    acc_t sum = 0;
    for (int c = lane; c < d; c += kWarpSize) sum += static_cast<acc_t>(g[c]) * static_cast<acc_t>(o[c]);
    sum = warp_reduce_sum(sum);
    if (lane == 0) delta[row] = sum;
  }
}

// dQ for a tile of rows (position, head) of kv head g over every key they see.
template <typename T, int kDL>
__global__ void __launch_bounds__(Cfg<at::opmath_type<T>, kDL>::kDqWarps * kWarpSize, 1)
attention_dq_kernel(const T* __restrict__ grad_out, Strides gs, const T* __restrict__ q, Strides qs,
                    const T* __restrict__ k, Strides ks, const T* __restrict__ v, Strides vs,
                    const at::opmath_type<T>* __restrict__ lse,
                    const at::opmath_type<T>* __restrict__ delta, T* __restrict__ grad_q,
                    int64_t q_heads, int64_t group, int64_t sq, int d, at::opmath_type<T> scale,
                    Mask mask, ScoreExtras extras) {
  using acc_t = at::opmath_type<T>;
  using C = Cfg<acc_t, kDL>;
  using Ops = attn::ScalarOps<acc_t>;
  constexpr int RW = C::kDqRowsPerWarp;
  acc_t* q_s = dynamic_shared<acc_t>();
  acc_t* do_s = q_s + C::kDqRows * C::kLd;
  acc_t* k_s = do_s + C::kDqRows * C::kLd;
  acc_t* v_s = k_s + C::kKeys * C::kLd;

  const int64_t g = blockIdx.y, b = blockIdx.z;
  const int64_t rows_total = sq * group;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * C::kDqRows;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int d_vec = (d + C::kVec - 1) / C::kVec * C::kVec;
  const T* kb_ptr = k + b * ks.b + g * ks.h;
  const T* vb_ptr = v + b * vs.b + g * vs.h;

  stage_rows<T, acc_t, C::kD, C::kLd>(q_s, C::kDqRows, q + b * qs.b, qs, g, group, row0, rows_total,
                                       d, scale);
  stage_rows<T, acc_t, C::kD, C::kLd>(do_s, C::kDqRows, grad_out + b * gs.b, gs, g, group, row0,
                                       rows_total, d, acc_t(1));

  acc_t dq[RW][kDL], shift[RW], dlt[RW];
  int64_t lo[RW], hi[RW];
#pragma unroll
  for (int r = 0; r < RW; ++r) {
    const int64_t row = row0 + warp * RW + r;
    const bool valid = row < rows_total;
    const int64_t lrow = valid ? (b * q_heads + g * group + row % group) * sq + row / group : 0;
#pragma unroll
    for (int t = 0; t < kDL; ++t) dq[r][t] = 0;
    shift[r] = valid ? Ops::finite_or_zero(lse[lrow]) : acc_t(0);
    dlt[r] = valid ? delta[lrow] : acc_t(0);
    lo[r] = valid ? attn::key_begin(mask, row / group) : 0;
    hi[r] = valid ? attn::key_end(mask, row / group) : 0;
  }
  const int64_t last_row = (row0 + C::kDqRows < rows_total ? row0 + C::kDqRows : rows_total) - 1;
  const int64_t key_lo = attn::key_begin(mask, row0 / group);
  const int64_t key_hi = attn::key_end(mask, last_row / group);

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
      acc_t p = 0, dp = 0;
      if (visible) {
        const int64_t row = row0 + warp * RW + r;
        const int64_t h = g * group + row % group, pos = row / group;
        const acc_t s = extras.masked(
            smem_dot<acc_t, C::kVec>(q_s + (warp * RW + r) * C::kLd, k_s + lane * C::kLd, d_vec), b,
            h, pos, key);
        dp = smem_dot<acc_t, C::kVec>(do_s + (warp * RW + r) * C::kLd, v_s + lane * C::kLd, d_vec) *
             extras.keep_factor<acc_t>(b, h, pos, key);
        p = Ops::exp(s - shift[r]);
      }
      ds[r] = attn::score_grad(p, dp, dlt[r]);
    }
    for (int jj = 0; jj < C::kKeys; ++jj) {
      acc_t kj[kDL];
#pragma unroll
      for (int t = 0; t < kDL; ++t) kj[t] = k_s[jj * C::kLd + lane + kWarpSize * t];
#pragma unroll
      for (int r = 0; r < RW; ++r) {
        const acc_t dsj = warp_broadcast(ds[r], jj);
#pragma unroll
        for (int t = 0; t < kDL; ++t) dq[r][t] += dsj * kj[t];
      }
    }
  }

#pragma unroll
  for (int r = 0; r < RW; ++r) {
    const int64_t row = row0 + warp * RW + r;
    if (row >= rows_total) continue;
    const int64_t out_row = (b * q_heads + g * group + row % group) * sq + row / group;
#pragma unroll
    for (int t = 0; t < kDL; ++t) {
      const int c = lane + kWarpSize * t;
      if (c < d) grad_q[out_row * d + c] = static_cast<T>(dq[r][t] * scale);
    }
  }
}

// dK and dV for one tile of keys of kv head g, summed over every query row of
// the group that sees them (the group reduction happens here, in registers).
template <typename T, int kDL>
__global__ void __launch_bounds__(Cfg<at::opmath_type<T>, kDL>::kKvWarps * kWarpSize, 1)
attention_dkdv_kernel(const T* __restrict__ grad_out, Strides gs, const T* __restrict__ q, Strides qs,
                      const T* __restrict__ k, Strides ks, const T* __restrict__ v, Strides vs,
                      const at::opmath_type<T>* __restrict__ lse,
                      const at::opmath_type<T>* __restrict__ delta, T* __restrict__ grad_k,
                      T* __restrict__ grad_v, int64_t q_heads, int64_t kv_heads, int64_t group,
                      int64_t sq, int64_t sk, int d, at::opmath_type<T> scale, Mask mask,
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
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * C::kKeys;
  const int64_t j_end = j0 + C::kKeys < sk ? j0 + C::kKeys : sk;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int d_vec = (d + C::kVec - 1) / C::kVec * C::kVec;

  stage_keys<T, acc_t, C::kD, C::kLd, C::kKeys>(k_s, k + b * ks.b + g * ks.h, ks.s, j0, j_end, d);
  stage_keys<T, acc_t, C::kD, C::kLd, C::kKeys>(v_s, v + b * vs.b + g * vs.h, vs.s, j0, j_end, d);

  acc_t dk[KW][kDL], dv[KW][kDL];
#pragma unroll
  for (int kk = 0; kk < KW; ++kk) {
#pragma unroll
    for (int t = 0; t < kDL; ++t) dk[kk][t] = dv[kk][t] = 0;
  }

  // Rows (position, head) of the positions that see any key of this tile.
  const int64_t rows_begin = attn::query_begin(mask, j0, sq) * group;
  const int64_t rows_end = attn::query_end(mask, j_end, sq) * group;
  const T* qb_ptr = q + b * qs.b;
  const T* gb_ptr = grad_out + b * gs.b;
  const int64_t key = j0 + lane;

  for (int64_t r0 = rows_begin; r0 < rows_end; r0 += RC) {
    __syncthreads();  // the previous chunk is no longer read
    stage_rows<T, acc_t, C::kD, C::kLd>(q_s, RC, qb_ptr, qs, g, group, r0, rows_end, d, scale);
    stage_rows<T, acc_t, C::kD, C::kLd>(do_s, RC, gb_ptr, gs, g, group, r0, rows_end, d, acc_t(1));
    if (threadIdx.x < RC) {
      const int64_t row = r0 + threadIdx.x;
      acc_t sh = 0, de = 0;
      if (row < rows_end) {
        const int64_t lrow = (b * q_heads + g * group + row % group) * sq + row / group;
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
        const int64_t pos = row / group;
        if (key >= attn::key_begin(mask, pos) && key < attn::key_end(mask, pos) && key < j_end) {
          const int64_t h = g * group + row % group;
          const acc_t s = extras.masked(
              smem_dot<acc_t, C::kVec>(q_s + warp * C::kLd, k_s + lane * C::kLd, d_vec), b, h, pos, key);
          const acc_t dp = smem_dot<acc_t, C::kVec>(do_s + warp * C::kLd, v_s + lane * C::kLd, d_vec);
          const acc_t z = extras.keep_factor<acc_t>(b, h, pos, key);
          const acc_t p_kept = Ops::exp(s - shift_s[warp]);
          ds = attn::score_grad(p_kept, dp * z, delta_s[warp]);
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
          dv[kk][t] += p * dor[t];
          dk[kk][t] += ds * qr[t];
        }
      }
    }
  }

  const int64_t kv_row0 = (b * kv_heads + g) * sk;
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

// ---------------------------------------------------------------------------
// Launch
// ---------------------------------------------------------------------------

// Calls f(std::integral_constant<int, kDL>) for the smallest 32 * kDL >= d.
template <typename F>
void with_head_dim(int64_t d, F&& f) {
  if (d <= 32) {
    f(std::integral_constant<int, 1>{});
  } else if (d <= 64) {
    f(std::integral_constant<int, 2>{});
  } else if (d <= 128) {
    f(std::integral_constant<int, 4>{});
  } else {
    f(std::integral_constant<int, 8>{});
  }
}

// Lets `kernel` use `bytes` of dynamic shared memory (above the 48 KiB default).
template <typename Kernel>
void allow_shared_memory(Kernel kernel, size_t bytes) {
  const auto& props = device_properties();
  TORCH_CHECK(bytes <= props.sharedMemPerBlockOptin, "fusedllm.attention: this head_dim and dtype need ",
              bytes, " bytes of shared memory per block; ", props.name, " allows ",
              props.sharedMemPerBlockOptin);
  if (bytes > 48 * 1024) allow_dynamic_shared_memory(kernel, bytes);
}

ScoreExtras extras_of(const AttentionParams& p) {
  ScoreExtras e;
  e.mask = p.tensor_mask;
  e.drop = p.dropout;
  e.q_heads = p.shape.q_heads;
  e.sq = p.shape.sq;
  e.sk = p.shape.sk;
  return e;
}

void check_grid(const AttentionShape& s) {
  TORCH_CHECK(s.batch <= 65535 && s.kv_heads <= 65535,
              "fusedllm.attention (CUDA): batch and kv_heads must be at most 65535, got ", s.batch,
              " and ", s.kv_heads);
}

struct CudaAttention {
  static void forward(const AttentionForwardPlan& p) {
    const DeviceGuard guard(p.q.device());
    const AttentionShape& s = p.shape;
    check_grid(s);
    const Stream stream = current_stream();
    const int64_t group = s.group();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, p.q.scalar_type(), "fusedllm_attention_cuda", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      with_head_dim(s.head_dim, [&](auto DL) {
        constexpr int kDL = decltype(DL)::value;
        using C = Cfg<acc_t, kDL>;
        auto kernel = attention_forward_kernel<scalar_t, kDL>;
        allow_shared_memory(kernel, C::fwd_smem());
        const dim3 grid(static_cast<unsigned>((s.sq * group + C::kFwdRows - 1) / C::kFwdRows),
                        static_cast<unsigned>(s.kv_heads), static_cast<unsigned>(s.batch));
        launch("attention_forward_kernel", kernel, grid, C::kFwdWarps * kWarpSize, C::fwd_smem(),
            stream, p.q.const_data_ptr<scalar_t>(), strides_of(p.q), p.k.const_data_ptr<scalar_t>(),
            strides_of(p.k), p.v.const_data_ptr<scalar_t>(), strides_of(p.v),
            p.out.mutable_data_ptr<scalar_t>(), p.lse.mutable_data_ptr<acc_t>(), s.q_heads, group,
            s.sq, static_cast<int>(s.head_dim), static_cast<acc_t>(p.scale), p.mask, extras_of(p));
      });
    });
  }

  static void backward(const AttentionBackwardPlan& p) {
    const DeviceGuard guard(p.q.device());
    const AttentionShape& s = p.shape;
    check_grid(s);
    const Stream stream = current_stream();
    const int64_t group = s.group();
    const int64_t n_rows = s.batch * s.q_heads * s.sq;
    at::Tensor delta = at::empty({n_rows}, p.q.options().dtype(lse_dtype(p.q)));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, p.q.scalar_type(), "fusedllm_attention_backward_cuda", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const int delta_threads = 256;
      const int64_t warps = delta_threads / kWarpSize;
      const int delta_blocks = static_cast<int>(std::min<int64_t>((n_rows + warps - 1) / warps, 65535));
      launch("attention_delta_kernel", attention_delta_kernel<scalar_t>, delta_blocks, delta_threads,
             0, stream, p.grad_out.const_data_ptr<scalar_t>(), strides_of(p.grad_out),
             p.out.const_data_ptr<scalar_t>(), strides_of(p.out), delta.mutable_data_ptr<acc_t>(),
             s.q_heads, s.sq, n_rows, static_cast<int>(s.head_dim));

      with_head_dim(s.head_dim, [&](auto DL) {
        constexpr int kDL = decltype(DL)::value;
        using C = Cfg<acc_t, kDL>;
        auto dq_kernel = attention_dq_kernel<scalar_t, kDL>;
        allow_shared_memory(dq_kernel, C::dq_smem());
        const dim3 dq_grid(static_cast<unsigned>((s.sq * group + C::kDqRows - 1) / C::kDqRows),
                           static_cast<unsigned>(s.kv_heads), static_cast<unsigned>(s.batch));
        launch("attention_dq_kernel", dq_kernel, dq_grid, C::kDqWarps * kWarpSize, C::dq_smem(),
            stream, p.grad_out.const_data_ptr<scalar_t>(), strides_of(p.grad_out),
            p.q.const_data_ptr<scalar_t>(), strides_of(p.q), p.k.const_data_ptr<scalar_t>(),
            strides_of(p.k), p.v.const_data_ptr<scalar_t>(), strides_of(p.v),
            p.lse.const_data_ptr<acc_t>(), delta.const_data_ptr<acc_t>(),
            p.grad_q.mutable_data_ptr<scalar_t>(), s.q_heads, group, s.sq,
            static_cast<int>(s.head_dim), static_cast<acc_t>(p.scale), p.mask, extras_of(p));

        auto kv_kernel = attention_dkdv_kernel<scalar_t, kDL>;
        allow_shared_memory(kv_kernel, C::kv_smem());
        const dim3 kv_grid(static_cast<unsigned>((s.sk + C::kKeys - 1) / C::kKeys),
                           static_cast<unsigned>(s.kv_heads), static_cast<unsigned>(s.batch));
        launch("attention_dkdv_kernel", kv_kernel, kv_grid, C::kKvWarps * kWarpSize, C::kv_smem(),
            stream, p.grad_out.const_data_ptr<scalar_t>(), strides_of(p.grad_out),
            p.q.const_data_ptr<scalar_t>(), strides_of(p.q), p.k.const_data_ptr<scalar_t>(),
            strides_of(p.k), p.v.const_data_ptr<scalar_t>(), strides_of(p.v),
            p.lse.const_data_ptr<acc_t>(), delta.const_data_ptr<acc_t>(),
            p.grad_k.mutable_data_ptr<scalar_t>(), p.grad_v.mutable_data_ptr<scalar_t>(), s.q_heads,
            s.kv_heads, group, s.sq, s.sk, static_cast<int>(s.head_dim),
            static_cast<acc_t>(p.scale), p.mask, extras_of(p));
      });
    });
  }
};

}  // namespace

FUSEDLLM_CUDA_OPS_IMPL(m) { FUSEDLLM_IMPL_ATTENTION_OPS(m, CudaAttention); }

}  // namespace fusedllm::cuda
