// The attention ops on CUDA and the general SIMT forward kernel (one block per
// tile of (position, head) rows of a kv head and sequence, and per slice of the
// keys when those blocks alone would leave most of the GPU idle). Decoding's
// shapes have a kernel of their own, attention_decode.cu.
// The SIMT backward kernels are in attention_dq.cu and attention_dkdv.cu, what
// they share in attention.cuh; the tensor-core kernels in attention_mma*.cu,
// chosen per call by choose_attention_kernel (attention_mma.cuh).
#include "attention_mma.cuh"

namespace fusedllm::cuda {
namespace {

// stage_kv for K and V (o = 0, 1) with kPack stored elements of type S per
// load, each made acc_t by value(element, its row's scale). A thread's loads
// of both are in flight together before it stores any. A key whose page is
// not a page of the operands is read as zeros and raises *unreadable.
template <typename S, int kPack, typename acc_t, int kD, int kLd, int kKeys, int kThreads, typename Value>
__device__ __forceinline__ void stage_kv_packs(acc_t* const (&dst)[2], const KvSource (&src)[2],
                                               const S* const (&data)[2], const float* const (&scale)[2],
                                               int64_t b, int64_t j0, int64_t end, int d, Value value,
                                               int* unreadable) {
  constexpr int kPerRow = kD / kPack, kPieces = kKeys * kPerRow;
  constexpr int kPerThread = (kPieces + kThreads - 1) / kThreads;
  constexpr int kBatch = kPerThread < kLoadsInFlight ? kPerThread : kLoadsInFlight;
  for (int i0 = threadIdx.x; i0 < kPieces; i0 += kBatch * kThreads) {
    Pack<S, kPack> x[2][kBatch];
    float row_scale[2][kBatch];
#pragma unroll
    for (int o = 0; o < 2; ++o) {
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int idx = i0 + i * kThreads, c = idx % kPerRow * kPack;
        const int64_t key = j0 + idx / kPerRow;
        const attn::Pages& pages = src[o].pages;
        row_scale[o][i] = 0;
        const bool wanted = idx < kPieces && key < end && c < d;
        const bool readable = wanted && pages.readable(b, key);
        if (wanted && !readable) *unreadable = 1;
        if (readable) {
          x[o][i] = load_pack<S, kPack>(data[o] + pages.row_offset(b, key, src[o].st.b, src[o].st.s) + c);
          if (scale[o] != nullptr) {
            row_scale[o][i] = scale[o][pages.row_offset(b, key, src[o].scale_st.b, src[o].scale_st.s)];
          }
        } else {
#pragma unroll
          for (int e = 0; e < kPack; ++e) x[o][i].v[e] = S(0);
        }
      }
    }
#pragma unroll
    for (int o = 0; o < 2; ++o) {
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int idx = i0 + i * kThreads;
        if (idx >= kPieces) break;
        acc_t* row = dst[o] + idx / kPerRow * kLd + idx % kPerRow * kPack;
#pragma unroll
        for (int e = 0; e < kPack; ++e) row[e] = value(x[o][i].v[e], row_scale[o][i]);
      }
    }
  }
}

// Keys [j0, j0 + kKeys) of kv head g of sequence b (position 0 at `start`) into
// k_s and v_s, dequantized when int8 / float8; zeros past `end` and past d
// (where a 16-byte load holds only columns < d or only columns >= d: wide).
template <typename T, typename acc_t, int kD, int kLd, int kKeys, int kThreads>
__device__ __forceinline__ void stage_kv(acc_t* k_s, acc_t* v_s, const KvSource& k, const KvSource& v,
                                         int64_t b, int64_t g, int64_t start, int64_t j0, int64_t end, int d,
                                         int* unreadable) {
  acc_t* const dst[2] = {k_s, v_s};
  const KvSource src[2] = {k, v};
  const auto first = [&](const KvSource& x, Strides st) {
    return g * st.h + (x.pages.paged() ? 0 : b * st.b + start * st.s);
  };
  const bool wide = k.wide && v.wide;
  if (k.scale == nullptr) {
    const T* const data[2] = {static_cast<const T*>(k.data) + first(k, k.st),
                              static_cast<const T*>(v.data) + first(v, v.st)};
    const float* const scale[2] = {nullptr, nullptr};
    const auto value = [](T x, float) { return static_cast<acc_t>(x); };
    if (wide) {
      stage_kv_packs<T, 16 / sizeof(T), acc_t, kD, kLd, kKeys, kThreads>(dst, src, data, scale, b, j0, end, d,
        value, unreadable);
    } else {
      stage_kv_packs<T, 1, acc_t, kD, kLd, kKeys, kThreads>(dst, src, data, scale, b, j0, end, d,
        value, unreadable);
    }
    return;
  }
  const uint8_t* const data[2] = {static_cast<const uint8_t*>(k.data) + first(k, k.st),
                                  static_cast<const uint8_t*>(v.data) + first(v, v.st)};
  const float* const scale[2] = {k.scale + first(k, k.scale_st), v.scale + first(v, v.scale_st)};
  const kvq::Code code = k.code;
  const auto value = [code](uint8_t x, float row_scale) {
    const float c = code == kvq::Code::kInt8 ? static_cast<float>(static_cast<int8_t>(x)) : kvq::float8_value(x);
    return static_cast<acc_t>(c * row_scale);
  };
  if (wide) {
    stage_kv_packs<uint8_t, 16, acc_t, kD, kLd, kKeys, kThreads>(dst, src, data, scale, b, j0, end, d,
        value, unreadable);
  } else {
    stage_kv_packs<uint8_t, 1, acc_t, kD, kLd, kKeys, kThreads>(dst, src, data, scale, b, j0, end, d,
        value, unreadable);
  }
}

// A warp's rows of a forward block (rows row0 + r kFwdWarps + warp, r < RW;
// those before rows_total exist) and its lane.
template <typename T, int kDL, bool kNarrow>
struct WarpRows {
  using acc_t = at::opmath_type<T>;
  using C = Cfg<acc_t, kDL, kNarrow>;
  static constexpr int RW = C::kFwdRowsPerWarp;
  const attn::QueryRows& rows;
  const Mask& mask;
  int64_t g, b, row0, rows_total;
  int warp, lane;

  // The running max, sum and output of every row from zero, and the keys
  // [lo, hi) of the slice [slice_lo, slice_hi) it sees.
  __device__ __forceinline__ void start(acc_t (&m)[RW], acc_t (&l)[RW], acc_t (&o)[RW][kDL], int64_t (&lo)[RW],
                                        int64_t (&hi)[RW], int64_t slice_lo, int64_t slice_hi) const {
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      const int64_t row = row0 + r * C::kFwdWarps + warp;
      m[r] = -std::numeric_limits<acc_t>::infinity();
      l[r] = 0;
#pragma unroll
      for (int t = 0; t < kDL; ++t) o[r][t] = 0;
      lo[r] = row < rows_total ? std::max(attn::key_begin(mask, rows.group_pos(row)), slice_lo) : 0;
      hi[r] = row < rows_total ? std::min(attn::key_end(mask, rows.group_pos(row)), slice_hi) : 0;
    }
  }

  // The online softmax over a key tile for the first `busy` rows, from this
  // lane's dot products with its key `key` (none for lanes past the tile's
  // keys): the running max m and sum l taken on, this lane's probability in
  // p (after dropout) and the rescaling of the output in alpha. `key` is
  // bound by reference: taken by value, its comparisons compiled mirrored
  // and the kernel's register allocation changed.
  __device__ __forceinline__ void probabilities(const acc_t (&dots)[RW], const int64_t& key, int busy,
                                                const int64_t (&lo)[RW], const int64_t (&hi)[RW],
                                                const ScoreExtras& extras, acc_t (&m)[RW], acc_t (&l)[RW],
                                                acc_t (&p)[RW], acc_t (&alpha)[RW]) const {
    using Ops = attn::ScalarOps<acc_t>;
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      if (r >= busy) break;
      acc_t s = lane < C::kKeys ? dots[r] : acc_t(0);
      const bool visible = lane < C::kKeys && key >= lo[r] && key < hi[r];
      const int64_t row = row0 + r * C::kFwdWarps + warp;
      const int64_t h = rows.group_head(g, row), pos = rows.group_pos(row);
      if (visible) {
        s = extras.masked(extras.modified<acc_t>(s, b, h, pos + mask.offset, key, nullptr), b, h, pos,
                          key);
      } else {
        s = -std::numeric_limits<acc_t>::infinity();
      }
      acc_t shift;
      alpha[r] = attn::online_softmax_step(m[r], warp_reduce_max(s), shift, Ops{});
      p[r] = visible ? Ops::exp(s - shift) : acc_t(0);
      // The row sum (and so the lse) is that of the probabilities before dropout.
      l[r] = l[r] * alpha[r] + warp_reduce_sum(p[r]);
      if (visible) p[r] *= extras.keep_factor<acc_t>(b, h, pos, key);
    }
  }

  // The finished rows: the output normalized (NaN rows where a length or
  // page could not be read), with the sink, and the lse; with key slices,
  // this slice's normalized output and lse (the sink joins in the merge).
  __device__ __forceinline__ void store(const acc_t (&m)[RW], const acc_t (&l)[RW], const acc_t (&o)[RW][kDL],
                                        bool nan_rows, T* out, acc_t* lse, const KeySlices<acc_t>& slices,
                                        int64_t slice, const ScoreExtras& extras, int d) const {
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      const int64_t row = row0 + r * C::kFwdWarps + warp;
      if (row >= rows_total) continue;
      const int64_t out_row = rows.row_of_group_row(b, g, row);
      acc_t lse_r = attn::row_lse(m[r], l[r]);
      acc_t factor = attn::row_norm(m[r], l[r], lse_r);
      make_nan_if(nan_rows, factor, lse_r);
      if (slices.count > 1) {  // this slice's normalized output and lse; the sink joins in the merge
        acc_t* part = slices.out + (slice * slices.rows + out_row) * d;
#pragma unroll
        for (int t = 0; t < kDL; ++t) {
          const int c = lane + kWarpSize * t;
          if (c < d) part[c] = o[r][t] * factor;
        }
        if (lane == 0) slices.lse[slice * slices.rows + out_row] = lse_r;
        continue;
      }
      // A sink joins the finished row's denominator: it scales the output and the lse includes it.
      if (extras.mods.sinks != nullptr) {
        factor *= attn::fold_sink(lse_r, extras.mods.sink<acc_t>(rows.group_head(g, row)));
      }
#pragma unroll
      for (int t = 0; t < kDL; ++t) {
        const int c = lane + kWarpSize * t;
        if (c < d) out[out_row * d + c] = static_cast<T>(o[r][t] * factor);
      }
      if (lane == 0) lse[out_row] = lse_r;
    }
  }
};

// A key tile's P V for the first `busy` rows of a warp (P: each lane's
// probability of its key; this lane's output columns lane + 32 t), summed
// from zero. The caller holds pv and adds it to O: with pv local to this
// function, the forward compiled to other registers.
template <typename acc_t, int kDL, int RW, int kKeys, int kLd>
__device__ __forceinline__ void tile_pv(acc_t (&pv)[RW][kDL], const acc_t (&p)[RW], const acc_t* v_s, int busy,
                                        int lane) {
#pragma unroll
  for (int r = 0; r < RW; ++r) {
#pragma unroll
    for (int t = 0; t < kDL; ++t) pv[r][t] = 0;
  }
  for (int jj = 0; jj < kKeys; ++jj) {
    acc_t vj[kDL];
#pragma unroll
    for (int t = 0; t < kDL; ++t) vj[t] = v_s[jj * kLd + lane + kWarpSize * t];
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      if (r >= busy) break;
      const acc_t pj = warp_broadcast(p[r], jj);
#pragma unroll
      for (int t = 0; t < kDL; ++t) pv[r][t] += pj * vj[t];
    }
  }
}

template <typename T, int kDL, bool kNarrow>
__global__ void __launch_bounds__(Cfg<at::opmath_type<T>, kDL>::kFwdWarps * kWarpSize,
                                  Cfg<at::opmath_type<T>, kDL>::kFwdBlocks)
attention_forward_kernel(const T* __restrict__ q, Strides qs, KvSource k, KvSource v, T* __restrict__ out,
                         at::opmath_type<T>* __restrict__ lse, attn::QueryRows rows, attn::Seqs seqs,
                         int d, at::opmath_type<T> scale, Mask mask_all, ScoreExtras extras,
                         KeySlices<at::opmath_type<T>> slices) {
  using acc_t = at::opmath_type<T>;
  using C = Cfg<acc_t, kDL, kNarrow>;
  constexpr int RW = C::kFwdRowsPerWarp;
  acc_t* q_s = dynamic_shared<acc_t>();
  acc_t* k_s = q_s + C::kFwdRows * C::kLd;
  acc_t* v_s = k_s + C::kKeys * C::kLd;

  const int64_t g = blockIdx.y, b = blockIdx.z;
  const int64_t sq = seqs.q_len(b);
  const int64_t rows_total = sq * rows.group;
  const int64_t slice = blockIdx.x % slices.count;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x / slices.count) * C::kFwdRows;
  // This block's keys: all, or its slice [slice_lo, slice_hi).
  const int64_t slice_lo = slice * slices.keys, slice_hi = slice_lo + slices.keys;
  if (row0 >= rows_total) return;  // past this (packed) sequence's end: the whole block
  // A length or page that cannot be read: no keys, NaN rows (make_nan_if).
  const bool length_ok = seqs.k_len_ok(b);
  __shared__ int unreadable;
  if (threadIdx.x == 0) unreadable = !length_ok;
  const Mask mask = mask_all.of_lengths(sq, length_ok ? seqs.k_len(b) : 0);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int d_vec = (d + C::kVec - 1) / C::kVec * C::kVec;
  const int64_t k_start = seqs.k_start(b);

  stage_rows<T, acc_t, C::kD, C::kLd>(q_s, C::kFwdRows, q + b * qs.b + seqs.q_start(b) * qs.s, qs, rows,
                                       g, row0, rows_total, d, scale);

  // Warp w owns the tile's rows w, w + kFwdWarps, ...: a decoding step's few
  // rows (a kv head's query heads) are spread over the warps. Its first
  // `busy` rows exist; it does no work for the others.
  const int64_t after = rows_total - row0 - warp;  // rows from this warp's first on
  const int busy = static_cast<int>(std::clamp<int64_t>((after + C::kFwdWarps - 1) / C::kFwdWarps, 0, RW));
  acc_t m[RW], l[RW], o[RW][kDL];
  int64_t lo[RW], hi[RW];
  const WarpRows<T, kDL, kNarrow> warp_rows{rows, mask, g, b, row0, rows_total, warp, lane};
  warp_rows.start(m, l, o, lo, hi, slice_lo, slice_hi);
  const int64_t last_row = (row0 + C::kFwdRows < rows_total ? row0 + C::kFwdRows : rows_total) - 1;
  const int64_t key_lo = std::max(attn::key_begin(mask, rows.group_pos(row0)), slice_lo);
  const int64_t key_hi = std::min(attn::key_end(mask, rows.group_pos(last_row)), slice_hi);

  for (int64_t j0 = key_lo; j0 < key_hi; j0 += C::kKeys) {
    __syncthreads();  // the previous tile (and, first time, nothing) is no longer read
    stage_kv<T, acc_t, C::kD, C::kLd, C::kKeys, C::kFwdWarps * kWarpSize>(k_s, v_s, k, v, b, g, k_start, j0,
                                                                          key_hi, d, &unreadable);
    __syncthreads();

    if (busy == 0) continue;
    const int64_t key = j0 + lane;
    acc_t p[RW], alpha[RW], dots[RW];
    if (lane < C::kKeys) {
      smem_dots<acc_t, C::kVec, RW>(q_s + warp * C::kLd, C::kFwdWarps * C::kLd, k_s + lane * C::kLd, d_vec,
                                    busy, dots);
    }
    warp_rows.probabilities(dots, key, busy, lo, hi, extras, m, l, p, alpha);
    // This tile's P V from zero, then O = alpha O + P V (see kSumChunk).
    acc_t pv[RW][kDL];
    tile_pv<acc_t, kDL, RW, C::kKeys, C::kLd>(pv, p, v_s, busy, lane);
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      if (r >= busy) break;
#pragma unroll
      for (int t = 0; t < kDL; ++t) o[r][t] = o[r][t] * alpha[r] + pv[r][t];
    }
  }

  __syncthreads();  // unreadable, as every thread's staging left it
  const bool nan_rows = unreadable != 0;
  warp_rows.store(m, l, o, nan_rows, out, lse, slices, slice, extras, d);
}

FUSEDLLM_ATTENTION_KERNEL_NOTE(attention_forward_kernel, "SIMT")

void check_grid(const AttentionShape& s) {
  TORCH_CHECK(s.batch <= 65535 && s.kv_heads <= 65535,
              "fusedllm.attention (CUDA): batch and kv_heads must be at most 65535, got ", s.batch,
              " and ", s.kv_heads);
}

void launch_attention_forward(const AttentionForwardPlan& p, Stream stream) {
  const AttentionShape& s = p.shape;
  const attn::QueryRows rows = rows_of(p);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, p.q.scalar_type(), "fusedllm_attention_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    with_cfg<acc_t>(s.head_dim, [](auto c) { return decltype(c)::fwd_smem(); }, [&](auto cfg) {
      using C = decltype(cfg);
      auto kernel = attention_forward_kernel<scalar_t, C::kDL, C::kNarrow>;
      allow_shared_memory(kernel, C::fwd_smem());
      const int64_t tiles = (rows.group_rows() + C::kFwdRows - 1) / C::kFwdRows;
      at::Tensor part_out, part_lse;
      const KeySlices<acc_t> slices =
          key_slices<acc_t>(p, tiles * s.kv_heads * s.batch, C::kKeys, part_out, part_lse);
      const dim3 grid(static_cast<unsigned>(tiles * slices.count), static_cast<unsigned>(s.kv_heads),
                      static_cast<unsigned>(s.batch));
      launch("attention_forward_kernel", kernel, grid, C::kFwdWarps * kWarpSize, C::fwd_smem(),
          stream, p.q.const_data_ptr<scalar_t>(), strides_of(p.q), kv_source<scalar_t>(p.k, p.k_scale, p),
          kv_source<scalar_t>(p.v, p.v_scale, p), p.out.mutable_data_ptr<scalar_t>(),
          p.lse.mutable_data_ptr<acc_t>(), rows, p.seqs, static_cast<int>(s.head_dim),
          static_cast<acc_t>(p.scale), p.mask, extras_of(p), slices);
      if (slices.count > 1) merge_key_slices<scalar_t>(p, slices, stream);
    });
  });
}

struct CudaAttention {
  // kv_lens and block_table entries are tested by the kernels as they read
  // them: a sequence whose length or pages cannot be read gets NaN rows.
  static constexpr bool kLengthsOnDevice = true;

  static void forward(const AttentionForwardPlan& p) {
    const DeviceGuard guard(p.q.device());
    check_grid(p.shape);
    // At most 16 rows a kv head (decoding, a short draft): the decoding kernels
    // where they serve the call. int8 / float8 or paged K/V (a cache) take
    // them or the general SIMT kernel, never the tensor-core forward.
    if (launch_attention_decode(p, current_stream())) return;
    if (!p.k_scale.defined() && !p.pages.paged() &&
        choose_attention_kernel(p, p.q.scalar_type()) == AttentionKernel::kTensorCore) {
      if (!hopper_attention_available() || !launch_attention_hopper_forward(p, current_stream())) {
        launch_attention_mma_forward(p, current_stream());
      }
    } else {
      launch_attention_forward(p, current_stream());
    }
  }

  static void backward(const AttentionBackwardPlan& p) {
    const DeviceGuard guard(p.q.device());
    check_grid(p.shape);
    const Stream stream = current_stream();
    const AttentionShape& s = p.shape;
    // delta = rowsum(dO * O), summed as the kernels that read it sum dP = dO . v.
    const at::Tensor delta = at::empty({p.rows.count(s.batch)}, p.q.options().dtype(accumulation_dtype(p.q)));
    if (choose_attention_kernel(p, p.q.scalar_type()) == AttentionKernel::kTensorCore) {
      // The Hopper backward sums delta itself, as its dP.
      if (hopper_attention_available() && launch_attention_hopper_backward(p, delta, stream)) return;
      launch_attention_mma_delta(p, delta, stream);
      launch_attention_mma_dq(p, delta, stream);
      launch_attention_mma_dkdv(p, delta, stream);
    } else {
      launch_attention_delta(p, delta, stream);
      launch_attention_dq(p, delta, stream);
      launch_attention_dkdv(p, delta, stream);
    }
  }
};

std::vector<std::string>& kernel_notes() {
  static std::vector<std::string> notes;  // filled as the library's static objects are made
  return notes;
}

}  // namespace

AttentionKernelNote::AttentionKernelNote(std::string line) { kernel_notes().push_back(std::move(line)); }

std::vector<std::string> attention_kernels() {
  std::vector<std::string> names = kernel_notes();
  std::sort(names.begin(), names.end());
  return names;
}

FUSEDLLM_CUDA_OPS_DEFINE(define_attention_ops)
FUSEDLLM_CUDA_OPS_IMPL(m) { FUSEDLLM_IMPL_ATTENTION_OPS(m, CudaAttention); }

}  // namespace fusedllm::cuda
