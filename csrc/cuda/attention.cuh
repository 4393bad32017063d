// attention ops on CUDA: SIMT kernels with float32 (float64) accumulation.
//
// Rows of one (batch, kv head) pair are ordered (position, query head), as on
// the CPU, so a block that loads a K/V tile into shared memory serves every
// query head of the group. Scores: lane j of a warp owns key j of the tile and
// computes q . k_j for the warp's rows from shared memory; softmax statistics
// are warp reductions; for P V (and dS K) each lane owns head_dim entries
// lane, lane + 32, ... and takes p_j from lane j by shuffle. The online-softmax
// step, masks, ALiBi distance, sink folding and score gradient come from
// fusedllm/attention.h and soft-capping from fusedllm/activations.h: the code
// the CPU kernels run too.
//
// Packed sequences: a block serves one sequence b (grid sized by the longest),
// reads its rows from the sequence's start (Seqs) and returns at once when its
// tile lies past that sequence's end; rows are numbered by the plan's
// QueryRows / KeyRows.
//
// Backward: delta = rowsum(dO * O) once; dQ by a kernel shaped like the
// forward (one block per tile of rows, every key tile); dK/dV by a kernel with
// one block per key tile that walks every query row of the group. Nothing is
// accumulated with atomics, so the gradients are deterministic.
//
// This header is what the kernels share. The op and the forward kernel
// (attention.cu), delta and dQ (attention_dq.cu), and dK/dV (attention_dkdv.cu)
// are separate translation units, so that nvcc compiles them in parallel.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "fusedllm/activations.h"
#include "fusedllm/attention.h"
#include "fusedllm/attention_op.h"
#include "fusedllm/dropout.h"
#include "primitives.cuh"

namespace fusedllm::cuda {

// The SIMT backward kernels' launches on `stream`, for the plan's dtype and
// head dim: delta = rowsum(dO * O) into `delta` (the tensor-core backward's
// too), dQ, and dK and dV.
void launch_attention_delta(const AttentionBackwardPlan& p, const at::Tensor& delta, Stream stream);
void launch_attention_dq(const AttentionBackwardPlan& p, const at::Tensor& delta, Stream stream);
void launch_attention_dkdv(const AttentionBackwardPlan& p, const at::Tensor& delta, Stream stream);
// The decoding kernel (attention_decode.cu) on `stream`, when it serves the
// plan (few query rows per kv head; see there); false, launching nothing, when not.
bool launch_attention_decode(const AttentionForwardPlan& p, Stream stream);

// The attention kernels this build holds, as their launches name them, each
// with what it serves (build_info): FUSEDLLM_ATTENTION_KERNEL_NOTE beside each
// kernel adds its line when the library loads.
std::vector<std::string> attention_kernels();
struct AttentionKernelNote {
  explicit AttentionKernelNote(std::string line);
};
#define FUSEDLLM_ATTENTION_KERNEL_NOTE(kernel, what) \
  const ::fusedllm::cuda::AttentionKernelNote kernel##_note(#kernel " (" what ")");

namespace {

using attn::Mask;

struct Strides {
  int64_t b, h, s;
};

Strides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// Tile shapes for head dims up to 32 * kDL, in accumulator type acc_t.
// kNarrow: half the keys a tile (half the lanes idle in the dot products), for
// head dims past 128 where the full tiles' shared memory does not fit the GPU
// (sm_75 blocks have 64 KiB; the full tiles take 83 KB at head dim 256).
template <typename acc_t, int kDL_, bool kNarrow_ = false>
struct Cfg {
  static constexpr int kDL = kDL_;
  static constexpr bool kNarrow = kNarrow_;
  static constexpr int kD = kWarpSize * kDL;                 // padded head dim
  static constexpr int kVec = 16 / sizeof(acc_t);            // elements per 16-byte access
  static constexpr int kLd = kD + kVec;                      // shared row stride: lanes reading
                                                             // different rows hit different banks
  // keys per tile, one per lane
  static constexpr int kKeys = (sizeof(acc_t) == 8 ? 16 : 32) / (kNarrow ? 2 : 1);
  static constexpr bool kWide = sizeof(acc_t) == 8;

  // forward: 4 warps, each owning kFwdRowsPerWarp rows; kFwdBlocks resident
  // per multiprocessor at least (a register budget: several blocks hide each
  // other's loads when decoding; float32 head dims up to 128 fit 168
  // registers, and spilled at 128)
  static constexpr int kFwdWarps = 4;
  static constexpr int kFwdRowsPerWarp = kWide ? 2 : 4;
  static constexpr int kFwdRows = kFwdWarps * kFwdRowsPerWarp;
  static constexpr int kFwdBlocks = kWide || kDL > 4 ? 1 : 3;
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

// Copies `n_rows` rows of head_dim d starting at group row row0 of kv head g
// of the sequence whose position 0 is at `base` into shared rows of stride
// kLd, times `scale`; zeros past d and past row rows_total. A warp per row:
// the row's place is found once, its lanes' loads are in flight together.
template <typename T, typename acc_t, int kD, int kLd>
__device__ __forceinline__ void stage_rows(acc_t* dst, int n_rows, const T* base, Strides st,
                                           const attn::QueryRows& rows, int64_t g, int64_t row0,
                                           int64_t rows_total, int d, acc_t scale) {
  constexpr int kPerLane = kD / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  for (int r = threadIdx.x / kWarpSize; r < n_rows; r += blockDim.x / kWarpSize) {
    const int64_t row = row0 + r;
    const bool present = row < rows_total;
    const T* src = present ? base + rows.group_head(g, row) * st.h + rows.group_pos(row) * st.s : base;
    acc_t x[kPerLane];
#pragma unroll
    for (int t = 0; t < kPerLane; ++t) {
      const int c = lane + t * kWarpSize;
      x[t] = present && c < d ? static_cast<acc_t>(src[c]) * scale : acc_t(0);
    }
#pragma unroll
    for (int t = 0; t < kPerLane; ++t) dst[r * kLd + lane + t * kWarpSize] = x[t];
  }
}

// Elements a thread loads before it stores any: a block that copied one at a
// time waited for global memory once per element (a decoding step over 32k
// keys read its cache at 4% of an H200's memory bandwidth).
constexpr int kLoadsInFlight = 8;

// Copies keys [j0, j0 + kKeys) of one kv head (zeros past `end` and past d).
template <typename T, typename acc_t, int kD, int kLd, int kKeys>
__device__ __forceinline__ void stage_keys(acc_t* dst, const T* base, int64_t seq_stride, int64_t j0,
                                           int64_t end, int d) {
  for (int idx0 = threadIdx.x; idx0 < kKeys * kD; idx0 += kLoadsInFlight * blockDim.x) {
    acc_t x[kLoadsInFlight];
#pragma unroll
    for (int i = 0; i < kLoadsInFlight; ++i) {
      const int idx = idx0 + i * blockDim.x, jj = idx / kD, c = idx % kD;
      const int64_t key = j0 + jj;
      x[i] = idx < kKeys * kD && key < end && c < d ? static_cast<acc_t>(base[key * seq_stride + c]) : acc_t(0);
    }
#pragma unroll
    for (int i = 0; i < kLoadsInFlight; ++i) {
      const int idx = idx0 + i * blockDim.x;
      if (idx < kKeys * kD) dst[idx / kD * kLd + idx % kD] = x[i];
    }
  }
}

// Terms a kernel sums in registers from zero before adding them to a running
// total (entries of a dot product, keys or rows of an accumulated product):
// one sequential running sum over a 256-wide head dim, or over every key of a
// long sequence, rounds each term at the size of the whole sum and was 2-3x
// less accurate than blocked sums (what SDPA does).
constexpr int kSumChunk = 32;

// out[r] = a_r . b over the first n (a multiple of kVec) entries, for the
// first `rows` of kRows shared rows a_r = a + r * a_ld (rows the same for
// the whole warp) and one shared row b (read once for all of them), summed
// kSumChunk entries at a time.
template <typename acc_t, int kVec, int kRows>
__device__ __forceinline__ void smem_dots(const acc_t* a, int a_ld, const acc_t* b, int n, int rows,
                                          acc_t (&out)[kRows]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) out[r] = 0;
  for (int c0 = 0; c0 < n; c0 += kSumChunk) {
    const int c1 = c0 + kSumChunk < n ? c0 + kSumChunk : n;
    // Two sums per row, of even and odd pack entries: a decoding warp's one
    // row is then not a single chain of dependent additions (a sum per pack
    // entry spilled registers at head dim 128 under the forward's budget).
    acc_t part[kRows][2];
#pragma unroll
    for (int r = 0; r < kRows; ++r) part[r][0] = part[r][1] = 0;
#pragma unroll 4
    for (int c = c0; c < c1; c += kVec) {
      const Pack<acc_t, kVec> y = load_pack<acc_t, kVec>(b + c);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (r >= rows) break;
        const Pack<acc_t, kVec> x = load_pack<acc_t, kVec>(a + r * a_ld + c);
#pragma unroll
        for (int e = 0; e < kVec; ++e) part[r][e % 2] += x.v[e] * y.v[e];
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) out[r] += part[r][0] + part[r][1];
  }
}

// a . b over the first n (a multiple of kVec) entries of two shared rows.
template <typename acc_t, int kVec>
__device__ __forceinline__ acc_t smem_dot(const acc_t* a, const acc_t* b, int n) {
  acc_t out[1];
  smem_dots<acc_t, kVec, 1>(a, 0, b, n, 1, out);
  return out[0];
}

// What a score sees besides causal/window: soft-capping and ALiBi, the
// caller's mask (added, or -inf where a bool mask is False) and the dropout of
// its probability.
struct ScoreExtras {
  attn::ScoreMods mods;
  attn::TensorMask mask;
  dropout::Dropout drop;
  attn::QueryRows rows;
  int64_t sk = 0;  // the longest sequence's keys: dropout counters

  // Soft-capping then ALiBi on the scaled score s of query head h at absolute
  // position p and key `key` of sequence b. Under a cap, *dcap (when given)
  // receives ds/dz, what the score gradient is multiplied by.
  template <typename acc_t>
  __device__ __forceinline__ acc_t modified(acc_t s, int64_t b, int64_t h, int64_t p, int64_t key,
                                            acc_t* dcap) const {
    if (mods.softcap > 0) {
      const acc_t cap = static_cast<acc_t>(mods.softcap);
      s = act::capped<act::ScalarMath>(s, cap);
      if (dcap != nullptr) *dcap = act::cap_slope(s, acc_t(1) / cap);
    }
    if (mods.alibi != nullptr) s += mods.slope<acc_t>(b, h) * attn::alibi_distance<acc_t>(p, key);
    return s;
  }

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
    const uint64_t n = static_cast<uint64_t>(rows.row(b, h, pos) * sk + key);
    return dropout::keep(drop.seed, n, drop.threshold) ? static_cast<acc_t>(drop.scale) : acc_t(0);
  }
};

// Every kernel but the float32 forward (Cfg::kFwdBlocks) declares one
// resident block per SM as its minimum, so ptxas may use the registers the
// unrolled row/column arrays need instead of spilling them to reach a higher
// occupancy target.

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

// Calls f(Cfg<acc_t, kDL, kNarrow>{}) for head dim d: the full tiles, or past
// head dim 128 the narrow ones where the full tiles' smem(Cfg{}) bytes exceed
// what a block of this GPU may have.
template <typename acc_t, typename Smem, typename F>
void with_cfg(int64_t d, Smem&& smem, F&& f) {
  with_head_dim(d, [&](auto DL) {
    constexpr int kDL = decltype(DL)::value;
    if constexpr (kDL == 8) {
      if (smem(Cfg<acc_t, kDL>{}) > device_properties().sharedMemPerBlockOptin) {
        f(Cfg<acc_t, kDL, true>{});
        return;
      }
    }
    f(Cfg<acc_t, kDL>{});
  });
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

// The plan's row numbering (packed-aware).
attn::QueryRows rows_of(const AttentionParams& p) { return p.rows; }

ScoreExtras extras_of(const AttentionParams& p) {
  ScoreExtras e;
  e.mods = p.mods;
  e.mask = p.tensor_mask;
  e.drop = p.dropout;
  e.rows = rows_of(p);
  e.sk = p.shape.sk;
  return e;
}


// K or V of the forward kernel: rows of T, or int8 / float8 e4m3 rows with a
// float32 scale per (batch, kv head, position) (a quantized cache); dense, or
// in pages (their batch index is the page).
struct KvSource {
  const void* data;
  Strides st;
  const float* scale;  // null: rows of T
  Strides scale_st;
  attn::Pages pages;
  kvq::Code code;
  bool wide;  // read 16 bytes at a time: pointer, strides and head_dim allow it
};

template <typename T>
KvSource kv_source(const at::Tensor& t, const at::Tensor& scale, const AttentionForwardPlan& p) {
  const Strides st = strides_of(t);
  const std::initializer_list<std::pair<const void*, int64_t>> rows = {
      {t.const_data_ptr(), st.b}, {t.const_data_ptr(), st.h}, {t.const_data_ptr(), st.s}};
  const int64_t d = p.shape.head_dim;
  if (!scale.defined()) return {t.const_data_ptr(), st, nullptr, {}, p.pages, p.code, pack_width<T>(d, rows) > 1};
  return {t.const_data_ptr(), st, scale.const_data_ptr<float>(), strides_of(scale), p.pages, p.code,
          pack_width<uint8_t>(d, rows) > 1};
}

// The keys of a call in `count` slices of `keys` keys, each slice a block of
// its own. With more than one, the forward blocks write each slice's
// normalized output and lse to out [count, rows, d] and lse [count, rows], and
// attention_merge_kernel makes them one.
template <typename acc_t>
struct KeySlices {
  int64_t count = 1;
  int64_t keys = std::numeric_limits<int64_t>::max() / 4;
  int64_t rows = 0;
  acc_t* out = nullptr;
  acc_t* lse = nullptr;
};

// A sequence whose kv_lens entry or block-table pages cannot be read (the
// CUDA kernels test them as they read them, not the host): it is given no
// keys, `unreadable` (a shared flag, set by any thread) is raised, and its
// rows' outputs and lse are made NaN by this factor at the end.
template <typename acc_t>
__device__ __forceinline__ void make_nan_if(bool unreadable, acc_t& factor, acc_t& lse) {
  if (unreadable) factor = lse = std::numeric_limits<acc_t>::quiet_NaN();
}

// Slices for `blocks` (row tile, kv head, sequence) blocks over up to sk keys,
// when the blocks alone fill fewer than one per multiprocessor (decoding: a
// block per kv head and sequence): about kBlocksPerSm blocks per
// multiprocessor, several at a time on each, each slice at least
// kMinSliceTiles key tiles. On an H200, batch 1 over 32k keys: 34 ms unsliced,
// 0.74 ms in 128 slices.
constexpr int64_t kMaxSlices = 256;

// With `resident` > 0 (the blocks a multiprocessor holds at once), as many
// slices as fill them once, rounded down: one wave, no partial second.
inline int64_t key_slice_count(int64_t blocks, int64_t sk, int64_t keys_per_tile, int64_t resident = 0) {
  constexpr int64_t kBlocksPerSm = 8, kMinSliceTiles = 4;
  const int64_t sms = device_properties().multiProcessorCount;
  if (blocks >= sms) return 1;
  const int64_t most = std::min(sk / (kMinSliceTiles * keys_per_tile), kMaxSlices);
  const int64_t want = resident > 0 ? resident * sms / blocks : (kBlocksPerSm * sms + blocks - 1) / blocks;
  return std::clamp<int64_t>(want, 1, std::max<int64_t>(most, 1));
}

// The key slices' outputs made one: each row's lse is the log-sum-exp of its
// slices' lse, its output their sum weighted by exp(slice lse - lse), then
// the sink folds in as in the forward kernel. A warp per row and 32 columns:
// its lanes over the slices for the lse and the weights, then one column
// each, the slices' loads several in flight (a warp per row walking slices and
// columns in turn took longer than the forward kernel).
constexpr int kMergeWarps = 4;

template <typename T>
__global__ void __launch_bounds__(kMergeWarps * kWarpSize)
attention_merge_kernel(T* __restrict__ out, at::opmath_type<T>* __restrict__ lse, attn::QueryRows rows,
                       attn::Seqs seqs, int d, ScoreExtras extras,
                       KeySlices<at::opmath_type<T>> slices) {
  using acc_t = at::opmath_type<T>;
  using std::exp;
  using std::log;
  constexpr acc_t kInf = std::numeric_limits<acc_t>::infinity();
  const int64_t g = blockIdx.y, b = blockIdx.z;
  const int column_tiles = (d + kWarpSize - 1) / kWarpSize;
  __shared__ acc_t weights[kMergeWarps][kMaxSlices];
  const int warp = threadIdx.x / kWarpSize;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kMergeWarps + warp;
  const int64_t row = item / column_tiles;
  if (row >= seqs.q_len(b) * rows.group) return;
  const int lane = threadIdx.x % kWarpSize;
  const int tile = static_cast<int>(item % column_tiles), c = tile * kWarpSize + lane;
  const int64_t out_row = rows.row_of_group_row(b, g, row);
  const int64_t count = slices.count, stride = slices.rows;
  const acc_t* part_lse = slices.lse + out_row;
  // A NaN in any slice (a NaN or infinite query, a NaN scale) makes the row NaN, as unsliced.
  acc_t top = -kInf;
  int nan = 0;
  for (int64_t i = lane; i < count; i += kWarpSize) {
    const acc_t x = part_lse[i * stride];
    nan |= x != x;
    top = x > top ? x : top;
  }
  top = warp_reduce_max(nan) != 0 ? std::numeric_limits<acc_t>::quiet_NaN() : warp_reduce_max(top);
  acc_t sum = 0;
  for (int64_t i = lane; top != -kInf && i < count; i += kWarpSize) sum += exp(part_lse[i * stride] - top);
  sum = warp_reduce_sum(sum);
  const acc_t total = top != -kInf ? top + log(sum) : -kInf;
  acc_t lse_r = total, factor = 1;
  if (extras.mods.sinks != nullptr) {
    factor = attn::fold_sink(lse_r, extras.mods.sink<acc_t>(rows.group_head(g, row)));
  }
  for (int64_t i = lane; i < count; i += kWarpSize) weights[warp][i] = attn::merge_weight(part_lse[i * stride], total);
  __syncwarp();
  if (c < d) {
    const acc_t* part = slices.out + out_row * d + c;
    acc_t acc = 0;
#pragma unroll 8
    for (int64_t i = 0; i < count; ++i) acc += weights[warp][i] * part[i * stride * d];
    out[out_row * d + c] = static_cast<T>(acc * factor);
  }
  if (lane == 0 && tile == 0) lse[out_row] = lse_r;
}


// Key slices for `blocks` (row tile, kv head, sequence) blocks of kernels
// that take `keys_per_tile` keys at a time: whole tiles a slice, the last
// maybe short; with more than one slice, part_out and part_lse hold the
// slices' partial results.
template <typename acc_t>
KeySlices<acc_t> key_slices(const AttentionForwardPlan& p, int64_t blocks, int64_t keys_per_tile,
                            at::Tensor& part_out, at::Tensor& part_lse, int64_t resident = 0) {
  const AttentionShape& s = p.shape;
  KeySlices<acc_t> slices;
  const int64_t count = key_slice_count(blocks, s.sk, keys_per_tile, resident);
  if (count > 1) {
    slices.keys = (s.sk + count * keys_per_tile - 1) / (count * keys_per_tile) * keys_per_tile;
    slices.count = (s.sk + slices.keys - 1) / slices.keys;
    slices.rows = p.rows.count(s.batch);
    part_out = at::empty({slices.count, slices.rows, s.head_dim}, p.q.options().dtype(p.lse.scalar_type()));
    part_lse = at::empty({slices.count, slices.rows}, p.lse.options());
    slices.out = part_out.mutable_data_ptr<acc_t>();
    slices.lse = part_lse.mutable_data_ptr<acc_t>();
  }
  return slices;
}

// The slices' partial results into the plan's out and lse.
template <typename T>
void merge_key_slices(const AttentionForwardPlan& p, const KeySlices<at::opmath_type<T>>& slices,
                      Stream stream) {
  const AttentionShape& s = p.shape;
  const attn::QueryRows rows = rows_of(p);
  const int64_t warps = rows.group_rows() * ((s.head_dim + kWarpSize - 1) / kWarpSize);
  const dim3 grid(static_cast<unsigned>((warps + kMergeWarps - 1) / kMergeWarps),
                  static_cast<unsigned>(s.kv_heads), static_cast<unsigned>(s.batch));
  launch("attention_merge_kernel", attention_merge_kernel<T>, grid, kMergeWarps * kWarpSize, 0, stream,
         p.out.mutable_data_ptr<T>(), p.lse.mutable_data_ptr<at::opmath_type<T>>(), rows, p.seqs,
         static_cast<int>(s.head_dim), extras_of(p), slices);
}

}  // namespace
}  // namespace fusedllm::cuda
