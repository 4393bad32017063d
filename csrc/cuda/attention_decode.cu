// The decoding kernel: the few query rows of a kv head (one new token of each
// of its query heads, or a short draft: at most kDecodeMaxRows) over a long
// bfloat16 / float16 cache, or one of int8 / float8 codes with a float32 scale
// per row, dense or paged, head dims up to 128.
//
// A block serves up to 8 query rows of one (kv head, sequence) pair (a tile
// of them; the tiles of one slice are neighbours in the grid, so the second
// reads the cache from L2) over one slice of the keys (key_slices; merged
// after by attention_merge_kernel). Its
// warps take the slice's 32-key tiles in turn and never wait for one another
// until the end, where their softmax states are merged in shared memory. In a
// tile, lane j reads key j's whole row with 16-byte loads, all in flight
// together, and scores it against every query row (held scaled in shared
// memory, read as broadcasts); for P·V each lane owns head_dim / 32
// consecutive columns and reads them from each key's V row, the V rows of the
// next keys in flight while the current ones are summed. Codes are converted
// in registers, their K scale applied to the score and their V scale folded
// into the probability. Only the query rows are staged in shared memory; the
// cache is read once, straight into registers.
//
// On sm_80+ the calls it serves take attention_decode_mma_kernel instead
// (below): the scores and P·V on the tensor cores, the query rows padded to
// one 16-row m-tile. The kernel above spends about 50 instructions a key and
// lane on them (a 16-byte K load feeds 32 multiply-adds, each q value a
// shared-memory read), so on an H200 it read the cache at a third of the copy
// rate, not bound by memory; it serves sm_75 and FUSEDLLM_CUDA_ATTENTION=simt.
#include "attention_mma.cuh"

namespace fusedllm::cuda {
namespace {

constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = kDecodeWarps * kWarpSize;
constexpr int64_t kDecodeMaxRows = 16;
constexpr int kDecodeTileRows = 8;

// What the cache holds: the query's dtype, or int8 / float8 e4m3 codes.
enum class Stored { kPlain, kInt8, kFloat8 };

template <typename T, Stored kS, int kD, int kRows>
struct Decode {
  using S = std::conditional_t<kS == Stored::kPlain, T, uint8_t>;
  static constexpr int kPerLoad = 16 / sizeof(S);     // elements of a 16-byte load
  static constexpr int kKLoads = kD / kPerLoad;       // a K row's 16-byte loads
  static constexpr int kCols = kD / kWarpSize;        // V columns a lane owns
  static constexpr int kVBytes = kCols * sizeof(S);   // of a V row, per lane: 2, 4 or 8
  static constexpr int kVWords = (kVBytes + 3) / 4;
  // V rows read ahead of their use: 128 bytes of each lane's columns (64
  // where 8 rows' accumulators take the registers).
  static constexpr int kAhead = (kRows <= 4 ? 32 : 16) / kVWords;
  static_assert(kRows % 4 == 0, "probabilities are read four rows at a time");

  // Shared memory: the scaled query rows [kRows, kD] and each warp's tile of
  // probabilities [kDecodeWarps, 32 keys, kRows]; at the end, reused for the
  // warps' accumulators [kDecodeWarps, kRows, kD] and (max, sum) pairs.
  static constexpr size_t smem() {
    const size_t loop = sizeof(float) * (kRows * kD + kDecodeWarps * kWarpSize * kRows);
    const size_t merge = sizeof(float) * kDecodeWarps * kRows * (kD + 2);
    return loop > merge ? loop : merge;
  }
};

// Codes 2 pair and 2 pair + 1 of a word of float8 e4m3 codes as a float16
// pair (the first code's in the low half), exact, over kFloat8Unit: from sm_89
// on one conversion instruction gives their values; before it (and emulated)
// each code's bits placed in a float16's are its value over 2^8, subnormal
// codes too, with no branch: a byte permute puts the codes in the halves' high
// bytes, a shift right by one puts magnitude bits at 13-7 with the sign at 14,
// adding the sign bit to itself moves it to 15, and the NaN codes (magnitude
// 0x7f, the only ones whose magnitude plus 1 carries into bit 14) get bit 14,
// which makes their exponent all ones.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
constexpr float kFloat8Unit = 1.f;
#else
constexpr float kFloat8Unit = 256.f;
#endif
__device__ __forceinline__ uint32_t float8_pair_half2(uint32_t word, int pair) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(static_cast<uint16_t>(pair ? word >> 16 : word)));
  return h;
#else
  const uint32_t y = byte_perm(word, 0u, pair ? 0x3424u : 0x1404u) >> 1;
  const uint32_t h = y + (y & 0x40004000u);
  return h | ((h + 0x00800080u) & 0x40004000u);
#endif
}

// Codes 2 pair and 2 pair + 1 of a word of int8 codes as a float16 pair (the
// first in the low half), exact: one byte permute puts each code with its top
// bit flipped (code + 128) under the high byte 0x64, the float16 1024 + code +
// 128 (a float16's unit is 1 there), and one subtraction of 1152 leaves the code.
__device__ __forceinline__ uint32_t int8_pair_half2(uint32_t word, int pair) {
  const uint32_t biased = byte_perm(word ^ 0x80808080u, 0x64646464u, pair ? 0x4342u : 0x4140u);
#if defined(FUSEDLLM_SIMT)
  float lo, hi;
  mma::unpack<c10::Half>(biased, lo, hi);
  return mma::pack2(c10::Half(lo - 1152.f), c10::Half(hi - 1152.f));
#else
  uint32_t h;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(h) : "r"(biased), "r"(0x64806480u));
  return h;
#endif
}

// Element e of stored elements held as 32-bit words, as float: the value, or
// the code's value before its row's scale (a float8 code's over kFloat8Unit).
template <typename T, Stored kS>
__device__ __forceinline__ float stored_value(const uint32_t* words, int e) {
  if constexpr (kS == Stored::kPlain) {
    const uint32_t w = words[e / 2];
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      return kvq::float_of_bits(e % 2 ? w & 0xffff0000u : w << 16);
    } else {
      float lo, hi;
      mma::unpack<T>(w, lo, hi);
      return e % 2 ? hi : lo;
    }
  } else {
    if constexpr (kS == Stored::kInt8) {
      // 2^23 + code + 128 as a float's bits, less 2^23 + 128: exact, and cheaper
      // than an integer conversion (on sm_90 an eighth of a float addition's
      // rate). The bits come from one byte permute of the word with its codes'
      // top bits flipped (one flip for the word's four codes) rather than a
      // shift, a mask and an OR a code (docs/decode-cuda.md).
      return kvq::float_of_bits(byte_perm(words[e / 4] ^ 0x80808080u, 0x4B000000u, 0x7440u + e % 4)) - 8388736.f;
    } else {
      float lo, hi;
      mma::unpack<c10::Half>(float8_pair_half2(words[e / 4], e % 4 / 2), lo, hi);
      return e % 2 ? hi : lo;
    }
  }
}

// Stored elements 2p and 2p + 1 as a pair of T (the first in the low half),
// codes' values before their rows' scales, as stored_value gives them.
template <typename T, Stored kS>
__device__ __forceinline__ uint32_t stored_pair(const uint32_t* words, int p) {
  if constexpr (kS == Stored::kInt8 && std::is_same_v<T, c10::Half>) {
    return int8_pair_half2(words[p / 2], p % 2);
  } else if constexpr (kS == Stored::kFloat8) {
    const uint32_t h = float8_pair_half2(words[p / 2], p % 2);
    if constexpr (std::is_same_v<T, c10::Half>) return h;
    float lo, hi;
    mma::unpack<c10::Half>(h, lo, hi);
    return mma::pack2(T(lo), T(hi));
  } else {
    return mma::pack2(T(stored_value<T, kS>(words, 2 * p)), T(stored_value<T, kS>(words, 2 * p + 1)));
  }
}

// kBytes (2, 4 or 8) bytes at p as 32-bit words (the last one's high half 0 for 2).
template <int kBytes>
__device__ __forceinline__ void load_words(const void* p, uint32_t (&w)[(kBytes + 3) / 4]) {
  if constexpr (kBytes == 8) {
    const Pack<uint32_t, 2> x = load_pack<uint32_t, 2>(static_cast<const uint32_t*>(p));
    w[0] = x.v[0];
    w[1] = x.v[1];
  } else if constexpr (kBytes == 4) {
    w[0] = *static_cast<const uint32_t*>(p);
  } else {
    w[0] = *static_cast<const uint16_t*>(p);
  }
}

// A lane's key in the cache: its page and row there (dense: the sequence and
// the key's position in it).
struct KeyPlace {
  int64_t page, row;
};

__device__ __forceinline__ KeyPlace key_place(const attn::Pages& pages, int64_t b, int64_t start,
                                              int64_t key) {
  if (!pages.paged()) return {b, start + key};
  // 32-bit division where it fits: a 64-bit one is a long subroutine.
  int64_t page, row;
  if (key <= std::numeric_limits<int32_t>::max() && pages.page_size <= std::numeric_limits<int32_t>::max()) {
    const uint32_t k32 = static_cast<uint32_t>(key), size = static_cast<uint32_t>(pages.page_size);
    page = k32 / size;
    row = k32 - static_cast<uint32_t>(page) * size;
  } else {
    page = key / pages.page_size;
    row = key - page * pages.page_size;
  }
  return {pages.table[b * pages.table_stride + page], row};
}

// v's 64-bit value at lane `src`.
__device__ __forceinline__ int64_t broadcast64(int64_t v, int src) {
  const uint32_t lo = warp_broadcast(static_cast<uint32_t>(v), src);
  const uint32_t hi = warp_broadcast(static_cast<uint32_t>(static_cast<uint64_t>(v) >> 32), src);
  return static_cast<int64_t>(static_cast<uint64_t>(hi) << 32 | lo);
}

// A 64-row tile's row pointers held across a warp's lanes, lane l rows l and
// l + 32: each row's place (a block-table read on a paged cache) is worked
// out once a tile by one lane, and any row's pointer is then two shuffles. Per
// 16-byte copy, that place had cost a dependent table load and 64-bit products.
template <typename S>
struct LaneRows {
  const S* low;   // row lane
  const S* high;  // row lane + 32

  // Row r's pointer (nullptr: not readable). A warp-wide call: every lane
  // calls it, all with r below 32 or all with r from 32 on.
  __device__ __forceinline__ const S* row(int r) const {
    const S* mine = r < kWarpSize ? low : high;
    return reinterpret_cast<const S*>(broadcast64(reinterpret_cast<int64_t>(mine), r % kWarpSize));
  }
};

// A lane's key of a tile: whether it is read, where its V row starts, and the
// scales of its rows (1 where the cache holds T).
struct DecodeKey {
  bool present;
  int64_t v_off;
  float k_scale, v_scale;
};

// The steps of attention_decode_kernel's loop over a warp's tiles, and its
// merge of the warps' states at the end. The kernel keeps the state arrays
// and the shared memory; these take them by reference or pointer.
template <typename T, Stored kS, int kD, int kRows>
struct DecodeSteps {
  using C = Decode<T, kS, kD, kRows>;
  using S = typename C::S;
  using Ops = attn::ScalarOps<float>;
  static constexpr float kInf = std::numeric_limits<float>::infinity();
  static constexpr bool kCodes = kS != Stored::kPlain;

  // The softmax state before the first key: no maximum, nothing summed.
  static __device__ __forceinline__ void start(float (&m)[kRows], float (&l)[kRows], float (&o)[kRows][C::kCols]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      m[r] = -kInf;
      l[r] = 0;
#pragma unroll
      for (int c = 0; c < C::kCols; ++c) o[r][c] = 0;
    }
  }

  // Key `key`'s place and scales, and its row of K into kw.
  static __device__ __forceinline__ DecodeKey load_key(const KvSource& k, const KvSource& v, int64_t b,
                                                      int64_t k_start, int64_t key, int64_t key_hi,
                                                      const S* k_base, const float* k_scale_base,
                                                      const float* v_scale_base, int d, int& unreadable,
                                                      uint32_t (&kw)[C::kKLoads][4]) {
    // This lane's key: in the block's range, and on a page of the operands.
    bool present = key < key_hi;
    KeyPlace place{0, 0};
    if (present) {
      place = key_place(k.pages, b, k_start, key);
      if (k.pages.paged() && (place.page < 0 || place.page >= k.pages.num_pages)) {
        unreadable = 1;
        present = false;
        place = {0, 0};
      }
    }
    const int64_t v_off = present ? place.page * v.st.b + place.row * v.st.s : -1;  // -1: not read

    // Key `key`'s row, every 16-byte load issued before any is used.
    const S* k_row = k_base + place.page * k.st.b + place.row * k.st.s;
#pragma unroll
    for (int i = 0; i < C::kKLoads; ++i) {
      Pack<uint32_t, 4> x{{0, 0, 0, 0}};
      if (present && i * C::kPerLoad < d) x = load_pack<uint32_t, 4>(reinterpret_cast<const uint32_t*>(k_row + i * C::kPerLoad));
#pragma unroll
      for (int w = 0; w < 4; ++w) kw[i][w] = x.v[w];
    }
    float k_scale = 1, v_scale = 1;
    if constexpr (kCodes) {
      if (present) {
        constexpr float kUnit = kS == Stored::kFloat8 ? kFloat8Unit : 1.f;
        k_scale = k_scale_base[place.page * k.scale_st.b + place.row * k.scale_st.s] * kUnit;
        v_scale = v_scale_base[place.page * v.scale_st.b + place.row * v.scale_st.s] * kUnit;
      }
    }
    return {present, v_off, k_scale, v_scale};
  }

  // The V columns of keys [a0, a0 + kAhead) of the tile (v_off: each lane's key's).
  static __device__ __forceinline__ void load_v(const S* v_base, int64_t v_off, int col0, bool my_cols, int a0,
                                                uint32_t (&vw)[C::kAhead][C::kVWords]) {
#pragma unroll
    for (int a = 0; a < C::kAhead; ++a) {
      const int64_t off = broadcast64(v_off, a0 + a);
#pragma unroll
      for (int w = 0; w < C::kVWords; ++w) vw[a][w] = 0;
      if (my_cols && off >= 0) load_words<C::kVBytes>(v_base + off + col0, vw[a]);
    }
  }

  // The online-softmax step of each row over the tile at j0 (this lane's key
  // j0 + lane): its state rescaled, and the lane's probability, times its V
  // scale, into the warp's probabilities p_warp [32 keys][kRows]. It takes j0
  // and the inner tiles' bounds, not the key and a flag: so nvcc compiles the
  // tests as it does inline.
  static __device__ __forceinline__ void add_scores(const float (&dot)[kRows][2], const DecodeKey& lane_key, int64_t j0,
                                                    int lane, int64_t inner_lo, int64_t inner_hi, int rows_here,
                                                    const int64_t* row_lo, const int64_t* row_hi,
                                                    const int64_t* row_head, const int64_t* row_pos,
                                                    bool extras_on, const ScoreExtras& extras, int64_t b,
                                                    const Mask& mask, float* p_warp, float (&m)[kRows],
                                                    float (&l)[kRows], float (&o)[kRows][C::kCols]) {
    const int64_t key = j0 + lane;
    const bool inner = j0 >= inner_lo && j0 + kWarpSize <= inner_hi;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r >= rows_here) break;
      float s = (dot[r][0] + dot[r][1]) * lane_key.k_scale;
      const bool visible = lane_key.present && (inner || (key >= row_lo[r] && key < row_hi[r]));
      if (visible && extras_on) {
        const int64_t h = row_head[r], pos = row_pos[r];
        s = extras.masked(extras.modified<float>(s, b, h, pos + mask.offset, key, nullptr), b, h, pos, key);
      }
      if (!visible) s = -kInf;
      float shift;
      const float alpha = attn::online_softmax_step(m[r], warp_reduce_max(s), shift, Ops{});
      const float p = visible ? Ops::exp(s - shift) : 0.f;
      l[r] = l[r] * alpha + p;
#pragma unroll
      for (int c = 0; c < C::kCols; ++c) o[r][c] *= alpha;
      p_warp[lane * kRows + r] = p * lane_key.v_scale;
    }
  }

  // P·V: key by key, the probabilities of four rows in one shared read;
  // the next kAhead V rows load while these are summed.
  static __device__ __forceinline__ void add_values(const float* p_warp, const S* v_base, int64_t v_off, int col0,
                                                    bool my_cols, uint32_t (&v_now)[C::kAhead][C::kVWords],
                                                    float (&o)[kRows][C::kCols]) {
#pragma unroll
    for (int a0 = 0; a0 < kWarpSize; a0 += C::kAhead) {
      uint32_t v_next[C::kAhead][C::kVWords];
      if (a0 + C::kAhead < kWarpSize) load_v(v_base, v_off, col0, my_cols, a0 + C::kAhead, v_next);
#pragma unroll
      for (int a = 0; a < C::kAhead; ++a) {
        float vv[C::kCols];
#pragma unroll
        for (int c = 0; c < C::kCols; ++c) vv[c] = stored_value<T, kS>(v_now[a], c);
#pragma unroll
        for (int r4 = 0; r4 < kRows; r4 += 4) {
          const Pack<float, 4> p4 = load_pack<float, 4>(p_warp + (a0 + a) * kRows + r4);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int c = 0; c < C::kCols; ++c) o[r4 + i][c] += p4.v[i] * vv[c];
          }
        }
      }
      if (a0 + C::kAhead < kWarpSize) {
#pragma unroll
        for (int a = 0; a < C::kAhead; ++a) {
#pragma unroll
          for (int w = 0; w < C::kVWords; ++w) v_now[a][w] = v_next[a][w];
        }
      }
    }
  }

  // The warps' states into one per row: weights exp(max_w - max), sums and
  // outputs added in warp order; then each row's output (or this slice's
  // part of it) and lse. The states go through q_s, free by then.
  static __device__ __forceinline__ void finish(float* q_s, const int& unreadable, int warp, int lane, int col0,
                                                int rows_here, const attn::QueryRows& rows, int64_t b, int64_t g,
                                                int64_t row0, const KeySlices<float>& slices, int64_t slice,
                                                const ScoreExtras& extras, const int64_t* row_head, T* out,
                                                float* lse, int d, const float (&m)[kRows], float (&l)[kRows],
                                                const float (&o)[kRows][C::kCols]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) l[r] = warp_reduce_sum(l[r]);
    __syncthreads();
    const bool nan_rows = unreadable != 0;
    float* o_s = q_s;                                      // [warps][kRows][kD]
    float* ml_s = o_s + kDecodeWarps * kRows * kD;         // [warps][kRows][2]
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int c = 0; c < C::kCols; ++c) o_s[(warp * kRows + r) * kD + col0 + c] = o[r][c];
      if (lane == 0) {
        ml_s[(warp * kRows + r) * 2] = m[r];
        ml_s[(warp * kRows + r) * 2 + 1] = l[r];
      }
    }
    __syncthreads();
    for (int r = warp; r < rows_here; r += kDecodeWarps) {
      float top = -kInf;
#pragma unroll
      for (int w = 0; w < kDecodeWarps; ++w) top = std::max(top, ml_s[(w * kRows + r) * 2]);
      const float shift = Ops::finite_or_zero(top);
      float sum = 0, acc[C::kCols] = {};
#pragma unroll
      for (int w = 0; w < kDecodeWarps; ++w) {
        const float weight = Ops::exp(ml_s[(w * kRows + r) * 2] - shift);
        sum += weight * ml_s[(w * kRows + r) * 2 + 1];
#pragma unroll
        for (int c = 0; c < C::kCols; ++c) acc[c] += weight * o_s[(w * kRows + r) * kD + col0 + c];
      }
      const int64_t out_row = rows.row_of_group_row(b, g, row0 + r);
      float lse_r = attn::row_lse(top, sum);
      float factor = attn::row_norm(top, sum, lse_r);
      make_nan_if(nan_rows, factor, lse_r);
      if (slices.count > 1) {  // this slice's normalized output and lse; the sink joins in the merge
        float* part = slices.out + (slice * slices.rows + out_row) * d;
#pragma unroll
        for (int c = 0; c < C::kCols; ++c) {
          if (col0 + c < d) part[col0 + c] = acc[c] * factor;
        }
        if (lane == 0) slices.lse[slice * slices.rows + out_row] = lse_r;
        continue;
      }
      if (extras.mods.sinks != nullptr) factor *= attn::fold_sink(lse_r, extras.mods.sink<float>(row_head[r]));
#pragma unroll
      for (int c = 0; c < C::kCols; ++c) {
        if (col0 + c < d) out[out_row * d + col0 + c] = static_cast<T>(acc[c] * factor);
      }
      if (lane == 0) lse[out_row] = lse_r;
    }
  }
};

// Three blocks a SM where the registers allow it without spilling.
template <typename T, Stored kS, int kD, int kRows>
__global__ void __launch_bounds__(kDecodeThreads, kD <= 64 && kRows <= 4 ? 3 : 2)
attention_decode_kernel(const T* __restrict__ q, Strides qs, KvSource k, KvSource v, T* __restrict__ out,
                        float* __restrict__ lse, attn::QueryRows rows, attn::Seqs seqs, int d,
                        float scale, Mask mask_all, ScoreExtras extras, KeySlices<float> slices) {
  using C = Decode<T, kS, kD, kRows>;
  using S = typename C::S;
  using Step = DecodeSteps<T, kS, kD, kRows>;
  constexpr bool kCodes = kS != Stored::kPlain;
  float* q_s = dynamic_shared<float>();
  float* p_s = q_s + kRows * kD;
  __shared__ int64_t row_lo[kRows], row_hi[kRows], row_head[kRows], row_pos[kRows];

  const int64_t g = blockIdx.y, b = blockIdx.z;
  const int64_t tiles = (rows.group_rows() + kRows - 1) / kRows;
  const int64_t slice = blockIdx.x / tiles, row0 = blockIdx.x % tiles * kRows;
  const int64_t sq = seqs.q_len(b);
  const int64_t rows_total = sq * rows.group;
  if (row0 >= rows_total) return;
  const int rows_here = static_cast<int>(std::min<int64_t>(kRows, rows_total - row0));
  const bool length_ok = seqs.k_len_ok(b);  // else no keys, NaN rows (make_nan_if)
  const Mask mask = mask_all.of_lengths(sq, length_ok ? seqs.k_len(b) : 0);
  const int64_t slice_lo = slice * slices.keys, slice_hi = slice_lo + slices.keys;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;

  stage_rows<T, float, kD, kD>(q_s, kRows, q + b * qs.b + seqs.q_start(b) * qs.s, qs, rows, g, row0,
                               rows_total, d, scale);
  for (int i = threadIdx.x; i < kDecodeWarps * kWarpSize * kRows; i += blockDim.x) p_s[i] = 0;
  __shared__ int unreadable;  // a length or page that cannot be read: NaN rows (make_nan_if)
  if (threadIdx.x == 0) unreadable = !length_ok;
  if (threadIdx.x < kRows) {
    const int r = threadIdx.x;
    const int64_t pos = r < rows_here ? rows.group_pos(row0 + r) : 0;
    row_pos[r] = pos;
    row_head[r] = rows.group_head(g, row0 + r);
    row_lo[r] = r < rows_here ? std::max(attn::key_begin(mask, pos), slice_lo) : 0;
    row_hi[r] = r < rows_here ? std::min(attn::key_end(mask, pos), slice_hi) : 0;
  }
  __syncthreads();
  // The block's keys: every row's, in one range; tiles inside every row's
  // range skip the per-row test.
  int64_t key_lo = std::numeric_limits<int64_t>::max(), key_hi = std::numeric_limits<int64_t>::min();
  int64_t inner_lo = key_hi, inner_hi = key_lo;
  for (int r = 0; r < rows_here; ++r) {
    key_lo = std::min(key_lo, row_lo[r]);
    key_hi = std::max(key_hi, row_hi[r]);
    inner_lo = std::max(inner_lo, row_lo[r]);
    inner_hi = std::min(inner_hi, row_hi[r]);
  }
  const bool extras_on = extras.mods.any_score_mod() || extras.mask.present();
  const S* k_base = static_cast<const S*>(k.data) + g * k.st.h;
  const S* v_base = static_cast<const S*>(v.data) + g * v.st.h;
  const float* k_scale_base = kCodes ? k.scale + g * k.scale_st.h : nullptr;
  const float* v_scale_base = kCodes ? v.scale + g * v.scale_st.h : nullptr;
  const int64_t k_start = seqs.k_start(b);
  const int col0 = lane * C::kCols;
  const bool my_cols = col0 < d;

  // This warp's softmax state per row: running max (the warp's), its lanes'
  // sums of exp(s - max), and the output accumulator of its columns.
  float m[kRows], l[kRows], o[kRows][C::kCols];
  Step::start(m, l, o);
  float* p_warp = p_s + warp * kWarpSize * kRows;

  for (int64_t j0 = key_lo + warp * kWarpSize; j0 < key_hi; j0 += kDecodeWarps * kWarpSize) {
    uint32_t kw[C::kKLoads][4];
    const DecodeKey lane_key = Step::load_key(k, v, b, k_start, j0 + lane, key_hi, k_base, k_scale_base,
                                              v_scale_base, d, unreadable, kw);
    uint32_t v_now[C::kAhead][C::kVWords];
    Step::load_v(v_base, lane_key.v_off, col0, my_cols, 0, v_now);

    // Scores: q_r . k over head-dim chunks, two partial sums a row. (Inline:
    // as a step, the loop compiled to up to 2% more instructions on sm_90.)
    float dot[kRows][2];
#pragma unroll
    for (int r = 0; r < kRows; ++r) dot[r][0] = dot[r][1] = 0;
#pragma unroll
    for (int i = 0; i < C::kKLoads; ++i) {
      if (i * C::kPerLoad >= d) break;
      float kv[C::kPerLoad];
#pragma unroll
      for (int e = 0; e < C::kPerLoad; ++e) kv[e] = stored_value<T, kS>(kw[i], e);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int e = 0; e < C::kPerLoad; e += 4) {
          const Pack<float, 4> qv = load_pack<float, 4>(q_s + r * kD + i * C::kPerLoad + e);
          dot[r][i % 2] += qv.v[0] * kv[e] + qv.v[1] * kv[e + 1] + qv.v[2] * kv[e + 2] + qv.v[3] * kv[e + 3];
        }
      }
    }
    Step::add_scores(dot, lane_key, j0, lane, inner_lo, inner_hi, rows_here, row_lo, row_hi, row_head, row_pos,
                     extras_on, extras, b, mask, p_warp, m, l, o);
    __syncwarp();
    Step::add_values(p_warp, v_base, lane_key.v_off, col0, my_cols, v_now, o);
    __syncwarp();  // the probabilities are read before the next tile writes them
  }
  Step::finish(q_s, unreadable, warp, lane, col0, rows_here, rows, b, g, row0, slices, slice, extras, row_head, out,
               lse, d, m, l, o);
}

FUSEDLLM_ATTENTION_KERNEL_NOTE(attention_decode_kernel,
                               "SIMT: bfloat16/float16 queries, up to 16 rows a kv head, head dims up to 128")

// The decoding kernel on the tensor cores: a block serves every query row of
// one (kv head, sequence) pair (at most 16, zero rows past them) over one key
// slice. Its 4 warps stage 64-key K/V tiles together (cp.async into double
// buffers, each key's row from its page where the cache is paged), and each
// warp computes on 16 keys of every tile: S = Q K^T and O += P V on mma.sync
// with its own online softmax on the accumulator fragments (as the forward
// kernel's); at the end the warps' states merge in shared memory. int8 /
// float8 codes land in byte tiles and each warp converts its 16 keys' rows to
// 16 bits in shared memory before its products; their scales multiply the
// scores (K) and the probabilities (V).
constexpr int kDecodeMmaKeys = 64;                                // a block's tile
constexpr int kDecodeMmaWarpKeys = kDecodeMmaKeys / tc::kWarps;  // a warp's: one A fragment of P
constexpr int kDecodeMmaRows = 16;                               // one m-tile
// Blocks a multiprocessor holds (registers and shared memory at head dim 128,
// sm_90): a call whose blocks fall short of one for each takes as many key
// slices as fill them once, whole slices a block (the last wave no fuller).
constexpr int kDecodeMmaBlocksPerSm = 3;
// The blocks its registers are held to: that many on sm_90; 2 below, where an
// A100's 164 KB of shared memory holds no more at head dim 128 (with 3, sm_80
// spilled).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr int kDecodeMmaMinBlocks = 2;
#else
constexpr int kDecodeMmaMinBlocks = kDecodeMmaBlocksPerSm;
#endif

// Shared memory: the query rows [kDecodeMmaRows][kStride] of T, then a cache
// of T's K and V tiles [2][kDecodeMmaKeys][kStride] each; or codes' K and V
// rows as each warp converted them [kWarps][kDecodeMmaWarpKeys][kStride] each,
// the K and V codes [2][kDecodeMmaKeys][kD] bytes each and their scales
// [2][kDecodeMmaKeys] floats each. At the end the warps' accumulators reuse it.
template <Stored kS, int kD>
constexpr size_t decode_mma_smem(size_t elem) {
  constexpr size_t kStride = tc::Tile<kD>::kStride, kKeys = kDecodeMmaKeys;
  const size_t tiles = kS == Stored::kPlain ? elem * kStride * 4 * kKeys
                                            : elem * kStride * 2 * tc::kWarps * kDecodeMmaWarpKeys +
                                                  2 * 2 * kKeys * kD + sizeof(float) * 2 * 2 * kKeys;
  const size_t loop = elem * kStride * kDecodeMmaRows + tiles;
  const size_t merge = sizeof(float) * tc::kWarps * kDecodeMmaRows * kD;
  return loop > merge ? loop : merge;
}

// Where the keys of a block of attention_decode_mma_kernel lie in the cache,
// and the staging of their tiles: tile t's cp.async copies into buffer t % 2
// of the rows of T (k_s, v_s) or of the codes (kc_s, vc_s). k and v are the
// kernel's parameters, held by reference: not copied.
template <typename T, Stored kS, int kD>
struct DecodeMmaTiles {
  static constexpr int kKeys = kDecodeMmaKeys;
  static constexpr bool kCodes = kS != Stored::kPlain;
  using S = std::conditional_t<kCodes, uint8_t, T>;  // what the cache holds
  const KvSource& k;
  const KvSource& v;
  int& unreadable;
  int64_t g, b, k_start, key_lo, key_hi;
  int lane, d;
  bool kv_chunks;
  T* k_s;
  T* v_s;
  uint8_t* kc_s;
  uint8_t* vc_s;

  // Where key `key` lies in the cache (page -1 past the block's keys or off the operands' pages).
  __device__ __forceinline__ KeyPlace place_of(const KvSource& src, int64_t key) const {
    if (key >= key_hi) return {-1, 0};
    const KeyPlace place = key_place(src.pages, b, k_start, key);
    if (src.pages.paged() && (place.page < 0 || place.page >= src.pages.num_pages)) {
      unreadable = 1;
      return {-1, 0};
    }
    return place;
  }
  // Key `key`'s row of K or V (nullptr where place_of gives no page).
  __device__ __forceinline__ const S* key_row(const KvSource& src, int64_t key) const {
    const KeyPlace place = place_of(src, key);
    if (place.page < 0) return nullptr;
    return static_cast<const S*>(src.data) + place.page * src.st.b + g * src.st.h + place.row * src.st.s;
  }
  // Codes: this thread's scale of a tile's keys (K: threads < kKeys, else V),
  // loaded as the tile is staged and stored once this iteration's products are done.
  __device__ __forceinline__ float scale_of(int64_t tile) const {
    constexpr float kUnit = kS == Stored::kFloat8 ? kFloat8Unit : 1.f;
    // (Fields chosen one by one: a reference to k or v would copy both to local memory.)
    const bool is_v = threadIdx.x >= kKeys;
    const int64_t key = key_lo + tile * kKeys + threadIdx.x % kKeys;
    const KeyPlace place = is_v ? place_of(v, key) : place_of(k, key);
    const float* scales = is_v ? v.scale : k.scale;
    const Strides st = is_v ? v.scale_st : k.scale_st;
    return place.page < 0 ? 0.f : scales[place.page * st.b + g * st.h + place.row * st.s] * kUnit;
  }
  // The rows of keys [j0, j0 + kKeys) of K or V over this warp's lanes.
  static_assert(kKeys == 2 * kWarpSize, "LaneRows holds two rows a lane");
  __device__ __forceinline__ LaneRows<S> lane_rows(const KvSource& src, int64_t j0) const {
    return LaneRows<S>{key_row(src, j0 + lane), key_row(src, j0 + lane + kWarpSize)};
  }
  __device__ __forceinline__ void stage(int64_t tile) const {
    const int buffer = static_cast<int>(tile % 2);
    const int64_t j0 = key_lo + tile * kKeys;
    if constexpr (kCodes) {
      // Whole 16-byte chunks (`wide` rows: launch_attention_decode), thread
      // t's at row t / kChunks + i kRowStep.
      constexpr int kChunks = kD / 16, kRowStep = tc::kThreads / kChunks;
      const int row = threadIdx.x / kChunks, col = threadIdx.x % kChunks * 16;
      uint8_t* k_to = kc_s + (buffer * kKeys + row) * kD + col;
      uint8_t* v_to = vc_s + (buffer * kKeys + row) * kD + col;
      if (k.pages.paged()) {
        // A thread's rows lie in the same half of the tile across its warp
        // (row < 16 at head dim 128, < 32 at 64), as LaneRows::row asks.
        const LaneRows<S> k_rows = lane_rows(k, j0), v_rows = lane_rows(v, j0);
#pragma unroll 1
        for (int i = 0; i < kKeys / kRowStep; ++i) {
          const int r = row + i * kRowStep;
          const uint8_t* kr = k_rows.row(r);
          const uint8_t* vr = v_rows.row(r);
          if (col >= d) kr = vr = nullptr;
          mma::cp_async_16_or_zero(k_to + i * kRowStep * kD, kr != nullptr ? kr + col : k_to, kr != nullptr);
          mma::cp_async_16_or_zero(v_to + i * kRowStep * kD, vr != nullptr ? vr + col : v_to, vr != nullptr);
        }
      } else {
        // Dense rows: one source pointer a thread, stepping by kRowStep rows.
        const int n = static_cast<int>(std::min<int64_t>(kKeys, key_hi - j0));
        const uint8_t* kr = key_row(k, j0) + row * k.st.s + col;
        const uint8_t* vr = key_row(v, j0) + row * v.st.s + col;
#pragma unroll 1
        for (int i = 0; i < kKeys / kRowStep; ++i) {
          const bool inside = row + i * kRowStep < n && col < d;
          mma::cp_async_16_or_zero(k_to + i * kRowStep * kD, inside ? kr : k_to, inside);
          mma::cp_async_16_or_zero(v_to + i * kRowStep * kD, inside ? vr : v_to, inside);
          kr += kRowStep * k.st.s;
          vr += kRowStep * v.st.s;
        }
      }
    } else {
      constexpr int kStride = tc::Tile<kD>::kStride;
      T* k_to = k_s + buffer * kKeys * kStride;
      T* v_to = v_s + buffer * kKeys * kStride;
      if (k.pages.paged()) {
        // stage_tile asks each row of every lane of a warp at once, from one
        // half of the tile; its loop, not unrolled: the unrolled copies' 16
        // addresses spilled at head dim 128 (sm_90).
        const LaneRows<S> k_rows = lane_rows(k, j0), v_rows = lane_rows(v, j0);
        tc::stage_tile<T, kD, kKeys, false>(k_to, [k_rows](int r) { return k_rows.row(r); }, d, kv_chunks);
        tc::stage_tile<T, kD, kKeys, false>(v_to, [v_rows](int r) { return v_rows.row(r); }, d, kv_chunks);
      } else {
        const int n = static_cast<int>(std::min<int64_t>(kKeys, key_hi - j0));
        tc::stage_strided_rows<T, kD, kKeys>(k_to, key_row(k, j0), k.st.s, n, d, kv_chunks);
        tc::stage_strided_rows<T, kD, kKeys>(v_to, key_row(v, j0), v.st.s, n, d, kv_chunks);
      }
    }
  }
};

// The steps of attention_decode_mma_kernel on a warp's 16 keys of a tile
// (codes converted, scores, online softmax) and its merge of the warps' states
// at the end. The kernel keeps the state arrays and the shared memory.
template <typename T, Stored kS, int kD>
struct DecodeMmaSteps {
  static constexpr int kN = tc::Tile<kD>::kNTiles;
  static constexpr int kWarpKeys = kDecodeMmaWarpKeys, kRows = kDecodeMmaRows;
  static constexpr float kInf = std::numeric_limits<float>::infinity();
  static constexpr bool kCodes = kS != Stored::kPlain;

  // Codes: this warp's keys in the tile buffers (from `at`) converted to its
  // 16 rows of K and V as T, and the scales of this lane's keys.
  static __device__ __forceinline__ void convert_codes(const uint8_t* kc_s, const uint8_t* vc_s, const float* ks_s,
                                                       const float* vs_s, T* k_s, T* v_s, int at, int warp,
                                                       int lane, int quad, float (&k_scale)[kWarpKeys / 8][2],
                                                       float (&v_scale)[kWarpKeys / 8][2]) {
    constexpr int kChunks = kD / 16, kStride = tc::Tile<kD>::kStride;
#pragma unroll
    for (int u = lane; u < 2 * kWarpKeys * kChunks; u += kWarpSize) {
      const bool is_v = u >= kWarpKeys * kChunks;
      const int r = u % (kWarpKeys * kChunks) / kChunks, c = u % kChunks * 16;
      const Pack<uint32_t, 4> w =
          load_pack<uint32_t, 4>(reinterpret_cast<const uint32_t*>((is_v ? vc_s : kc_s) + (at + r) * kD + c));
      Pack<uint32_t, 4> lo, hi;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        lo.v[e] = stored_pair<T, kS>(w.v, e);
        hi.v[e] = stored_pair<T, kS>(w.v, e + 4);
      }
      T* to = (is_v ? v_s : k_s) + (warp * kWarpKeys + r) * kStride + c;
      store_pack<uint32_t, 4>(reinterpret_cast<uint32_t*>(to), lo);
      store_pack<uint32_t, 4>(reinterpret_cast<uint32_t*>(to + 8), hi);
    }
#pragma unroll
    for (int n = 0; n < kWarpKeys / 8; ++n) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        k_scale[n][c] = ks_s[at + n * 8 + 2 * quad + c];
        v_scale[n][c] = vs_s[at + n * 8 + 2 * quad + c];
      }
    }
    __syncwarp();
  }

  // The scores of the warp's keys at j0 from their products s = Q K^T (codes:
  // times the K scales), -inf where a key is not visible, and each row's
  // maximum; element e of an n-tile belongs to row r = e / 2 (this lane's
  // rows: group + 8 r). A plain call's tiles inside both rows' key ranges
  // [all_lo, all_hi) skip the per-score test.
  static __device__ __forceinline__ void score(mma::FragC (&s)[kWarpKeys / 8], float (&tile_max)[2],
                                               const float (&k_scale)[kWarpKeys / 8][2], int64_t j0,
                                               const tc::BlockPlace& place, bool plain, int64_t all_lo,
                                               int64_t all_hi, const int64_t* row_lo, const int64_t* row_hi,
                                               float scale, const attn::QueryRows& rows, const ScoreExtras& extras,
                                               const Mask& mask) {
    if constexpr (kCodes) {
#pragma unroll
      for (int n = 0; n < kWarpKeys / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n].r[e] *= k_scale[n][e % 2];
      }
    }
    tile_max[0] = tile_max[1] = -kInf;
    if (plain && j0 >= all_lo && j0 + kWarpKeys <= all_hi) {
#pragma unroll
      for (int n = 0; n < kWarpKeys / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[n].r[e] *= scale;
          tile_max[e / 2] = fmaxf(tile_max[e / 2], s[n].r[e]);
        }
      }
    } else {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = place.group + 8 * r;
        const int64_t lo = row_lo[row], hi = row_hi[row];
        const int64_t head = plain ? 0 : rows.group_head(place.g, row), pos = plain ? 0 : rows.group_pos(row);
#pragma unroll
        for (int n = 0; n < kWarpKeys / 8; ++n) {
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            const int64_t key = j0 + n * 8 + 2 * place.quad + (e % 2);
            const float z = tc::score(s[n].r[e], key >= lo && key < hi, plain, scale, extras, mask, place.b, head,
                                      pos, key, nullptr);
            s[n].r[e] = z;
            tile_max[r] = fmaxf(tile_max[r], z);
          }
        }
      }
    }
  }

  // The online-softmax step of this lane's rows over the warp's keys: the
  // state rescaled, and the scores turned into probabilities (codes: times
  // their keys' V scales).
  static __device__ __forceinline__ void add_scores(mma::FragC (&s)[kWarpKeys / 8], const float (&tile_max)[2],
                                                    const float (&v_scale)[kWarpKeys / 8][2], float (&m)[2],
                                                    float (&l)[2], mma::FragC (&o)[kN]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float shift;
      const float alpha =
          attn::online_softmax_step(m[r], quad_reduce_max(tile_max[r]), shift, attn::ScalarOps<float>{});
      l[r] *= alpha;
#pragma unroll
      for (int n = 0; n < kN; ++n) {
        o[n].r[2 * r] *= alpha;
        o[n].r[2 * r + 1] *= alpha;
      }
#pragma unroll
      for (int n = 0; n < kWarpKeys / 8; ++n) {
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          const float p = tc::exp_of_difference(s[n].r[e], shift);
          l[r] += p;
          s[n].r[e] = kCodes ? p * v_scale[n][e % 2] : p;
        }
      }
    }
  }

  // The warps' states into one per row: weights exp(max_w - max), sums and
  // outputs added in warp order; then each row's output (or the slice's part
  // of it) and lse. ml_s: [warps][kRows] (max, sum); the warps' outputs take
  // the shared memory from q_s on.
  static __device__ __forceinline__ void finish(float* ml_s, T* q_s, const tc::BlockPlace& place,
                                                int64_t rows_total, const int& unreadable,
                                                const attn::QueryRows& rows, const KeySlices<float>& slices,
                                                int64_t slice, const ScoreExtras& extras, T* out, float* lse, int d,
                                                const float (&m)[2], const float (&l)[2],
                                                const mma::FragC (&o)[kN]) {
    const int64_t g = place.g, b = place.b;
    const int warp = place.warp, lane = place.lane, group = place.group, quad = place.quad;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = quad_reduce_sum(l[r]);
      if (quad == 0) {
        ml_s[(warp * kRows + group + 8 * r) * 2] = m[r];
        ml_s[(warp * kRows + group + 8 * r) * 2 + 1] = sum;
      }
    }
    __syncthreads();  // the tiles' buffers are free (every copy has landed): reused
    float* o_s = reinterpret_cast<float*>(q_s);  // [warps][kRows][kD]
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = group + 8 * r;
#pragma unroll
      for (int n = 0; n < kN; ++n) {
        o_s[(warp * kRows + row) * kD + n * 8 + 2 * quad] = o[n].r[2 * r];
        o_s[(warp * kRows + row) * kD + n * 8 + 2 * quad + 1] = o[n].r[2 * r + 1];
      }
    }
    __syncthreads();
    const bool nan_rows = unreadable != 0;
    for (int row = warp; row < rows_total; row += tc::kWarps) {
      float top = -kInf;
#pragma unroll
      for (int w = 0; w < tc::kWarps; ++w) top = std::max(top, ml_s[(w * kRows + row) * 2]);
      const float shift = attn::ScalarOps<float>::finite_or_zero(top);
      float weight[tc::kWarps], sum = 0;
#pragma unroll
      for (int w = 0; w < tc::kWarps; ++w) {
        weight[w] = tc::exp_of_difference(ml_s[(w * kRows + row) * 2], shift);
        sum += weight[w] * ml_s[(w * kRows + row) * 2 + 1];
      }
      const int64_t out_row = rows.row_of_group_row(b, g, row);
      float lse_r = attn::row_lse(top, sum);
      float factor = attn::row_norm(top, sum, lse_r);
      make_nan_if(nan_rows, factor, lse_r);
      const bool sliced = slices.count > 1;  // this slice's normalized output and lse; the sink joins in the merge
      if (!sliced && extras.mods.sinks != nullptr) {
        factor *= attn::fold_sink(lse_r, extras.mods.sink<float>(rows.group_head(g, row)));
      }
      for (int c = lane; c < d; c += kWarpSize) {
        float acc = 0;
#pragma unroll
        for (int w = 0; w < tc::kWarps; ++w) acc += weight[w] * o_s[(w * kRows + row) * kD + c];
        if (sliced) {
          slices.out[(slice * slices.rows + out_row) * d + c] = acc * factor;
        } else {
          out[out_row * d + c] = static_cast<T>(acc * factor);
        }
      }
      if (lane == 0) (sliced ? slices.lse[slice * slices.rows + out_row] : lse[out_row]) = lse_r;
    }
  }
};

template <typename T, Stored kS, int kD>
__global__ void __launch_bounds__(tc::kThreads, kDecodeMmaMinBlocks)
attention_decode_mma_kernel(const T* __restrict__ q, Strides qs, KvSource k, KvSource v, T* __restrict__ out,
                            float* __restrict__ lse, attn::QueryRows rows, attn::Seqs seqs, int d, float scale,
                            Mask mask_all, ScoreExtras extras, KeySlices<float> slices, bool q_chunks,
                            bool kv_chunks) {
#if FUSEDLLM_BELOW_SM80
  __trap();  // launch_attention_decode never launches it below sm_80
#else
  constexpr int kStride = tc::Tile<kD>::kStride, kN = tc::Tile<kD>::kNTiles;
  constexpr int kKeys = kDecodeMmaKeys, kWarpKeys = kDecodeMmaWarpKeys, kRows = kDecodeMmaRows;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  constexpr bool kCodes = kS != Stored::kPlain;
  using Step = DecodeMmaSteps<T, kS, kD>;
  constexpr int kTileRows = kCodes ? tc::kWarps * kWarpKeys : 2 * kKeys;
  T* q_s = dynamic_shared<T>();                // [kRows][kStride]
  T* k_s = q_s + kRows * kStride;              // [kTileRows][kStride]
  T* v_s = k_s + kTileRows * kStride;          // [kTileRows][kStride]
  uint8_t* kc_s = reinterpret_cast<uint8_t*>(v_s + kTileRows * kStride);  // codes: [2][kKeys][kD]
  uint8_t* vc_s = kc_s + 2 * kKeys * kD;
  float* ks_s = reinterpret_cast<float*>(vc_s + 2 * kKeys * kD);  // codes: [2][kKeys] scales
  float* vs_s = ks_s + 2 * kKeys;
  __shared__ int64_t row_lo[kRows], row_hi[kRows];
  __shared__ int unreadable;  // a length or page that cannot be read: NaN rows (make_nan_if)

  const tc::BlockPlace place;
  const int64_t g = place.g, b = place.b, slice = blockIdx.x;
  const int warp = place.warp, lane = place.lane, group = place.group, quad = place.quad;
  const int64_t sq = seqs.q_len(b);
  const int64_t rows_total = sq * rows.group;  // at most kRows (launch_attention_decode)
  if (rows_total <= 0) return;
  const bool length_ok = seqs.k_len_ok(b);
  const Mask mask = mask_all.of_lengths(sq, length_ok ? seqs.k_len(b) : 0);
  const int64_t slice_lo = slice * slices.keys, slice_hi = slice_lo + slices.keys;

  tc::stage_group_rows<T, kD, kRows>(q_s, place.query_side(q, qs, seqs), qs, rows, g, 0, rows_total, d, q_chunks);
  if (threadIdx.x == 0) unreadable = !length_ok;
  if (threadIdx.x < kRows) {
    const int r = threadIdx.x;
    const bool valid = r < rows_total;
    const int64_t pos = valid ? rows.group_pos(r) : 0;
    row_lo[r] = valid ? std::max(attn::key_begin(mask, pos), slice_lo) : 0;
    row_hi[r] = valid ? std::min(attn::key_end(mask, pos), slice_hi) : 0;
  }
  __syncthreads();
  // The block's keys: every row's, in one range. This lane's rows are `group`
  // and group + 8 (r = 0, 1); the tiles inside both of their ranges skip the
  // per-score test (rows past rows_total are zero padding: any keys do).
  int64_t key_lo = std::numeric_limits<int64_t>::max(), key_hi = std::numeric_limits<int64_t>::min();
  for (int r = 0; r < rows_total; ++r) {
    key_lo = std::min(key_lo, row_lo[r]);
    key_hi = std::max(key_hi, row_hi[r]);
  }
  int64_t all_lo = 0, all_hi = std::numeric_limits<int64_t>::max();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (group + 8 * r < rows_total) {
      all_lo = std::max(all_lo, row_lo[group + 8 * r]);
      all_hi = std::min(all_hi, row_hi[group + 8 * r]);
    }
  }
  const int64_t n_tiles = key_hi > key_lo ? (key_hi - key_lo + kKeys - 1) / kKeys : 0;
  const bool plain = !extras.mods.any_score_mod() && !extras.mask.present();
  const int64_t k_start = seqs.k_start(b);

  const DecodeMmaTiles<T, kS, kD> tiles{k, v, unreadable, g, b, k_start, key_lo, key_hi, lane, d, kv_chunks,
                                        k_s, v_s, kc_s, vc_s};
  const auto stage_kv = [&](int64_t tile) { tiles.stage(tile); };
  float* my_scales = (threadIdx.x < kKeys ? ks_s : vs_s) + threadIdx.x % kKeys;  // codes: buffer 0's entry
  tc::pipeline_start(n_tiles, stage_kv);
  if constexpr (kCodes) {
    if (n_tiles > 0) *my_scales = tiles.scale_of(0);
  }

  mma::FragC o[kN];
  float m[2] = {-kInf, -kInf}, l[2] = {0.f, 0.f};  // this lane's rows: running max, its sum
  for (int64_t tile = 0; tile < n_tiles; ++tile) {
    const float scale_next = kCodes && tile + 1 < n_tiles ? tiles.scale_of(tile + 1) : 0.f;
    tc::pipeline_next(tile, n_tiles, stage_kv);
    const int at = static_cast<int>(tile % 2) * kKeys + warp * kWarpKeys;  // this warp's keys in the tile buffers
    const int64_t j0 = key_lo + tile * kKeys + warp * kWarpKeys;
    // This warp's 16 rows of K and V as T: in the tile buffers, or its codes converted.
    const T* k_rows = k_s + (kCodes ? warp * kWarpKeys : at) * kStride;
    const T* v_rows = v_s + (kCodes ? warp * kWarpKeys : at) * kStride;
    float k_scale[kWarpKeys / 8][2], v_scale[kWarpKeys / 8][2];  // codes: of this lane's keys
    if constexpr (kCodes) {
      Step::convert_codes(kc_s, vc_s, ks_s, vs_s, k_s, v_s, at, warp, lane, quad, k_scale, v_scale);
    }
    mma::FragC s[kWarpKeys / 8];
    tc::mma_rows_rows<T, kD, kWarpKeys, kStride>(s, q_s, k_rows);
    float tile_max[2];
    Step::score(s, tile_max, k_scale, j0, place, plain, all_lo, all_hi, row_lo, row_hi, scale, rows, extras, mask);
    Step::add_scores(s, tile_max, v_scale, m, l, o);
    mma::FragA pa[kWarpKeys / 16];
    tc::to_a_frags<T, kWarpKeys>(pa, s);
    tc::mma_frags_rows<T, kWarpKeys, kD, kStride>(o, pa, v_rows);
    if constexpr (kCodes) {  // the next tile's buffer was last read in the previous iteration
      if (tile + 1 < n_tiles) my_scales[(tile + 1) % 2 * kKeys] = scale_next;
    }
    __syncthreads();  // every warp is done with this buffer before it is staged again
  }

  __shared__ float ml_s[tc::kWarps * kRows * 2];  // [warps][kRows] (max, sum)
  Step::finish(ml_s, q_s, place, rows_total, unreadable, rows, slices, slice, extras, out, lse, d, m, l, o);
#endif
}

FUSEDLLM_ATTENTION_KERNEL_NOTE(attention_decode_mma_kernel,
                               "tensor cores: a bfloat16/float16, int8 or float8 cache, up to 16 rows a kv head, "
                               "head dims up to 128, sm_80+")

// Whether a call launch_attention_decode serves runs on the tensor cores: on
// sm_80+ (the emulated device by default), unless FUSEDLLM_CUDA_ATTENTION=simt.
bool decode_on_tensor_cores() { return !simt_attention_requested() && device_properties().major >= 8; }

template <typename T, Stored kS, int kD>
void launch_decode_mma(const AttentionForwardPlan& p, const KvSource& k, const KvSource& v, Stream stream) {
  const AttentionShape& s = p.shape;
  auto kernel = attention_decode_mma_kernel<T, kS, kD>;
  const size_t smem = decode_mma_smem<kS, kD>(sizeof(T));
  allow_shared_memory(kernel, smem);
  at::Tensor part_out, part_lse;
  const KeySlices<float> slices =
      key_slices<float>(p, s.kv_heads * s.batch, kDecodeMmaKeys, part_out, part_lse, kDecodeMmaBlocksPerSm);
  const dim3 grid(static_cast<unsigned>(slices.count), static_cast<unsigned>(s.kv_heads),
                  static_cast<unsigned>(s.batch));
  const bool q_chunks = tc::chunks_aligned(p.q.const_data_ptr(), strides_of(p.q));
  const bool kv_chunks = tc::chunks_aligned(k.data, k.st) && tc::chunks_aligned(v.data, v.st);
  launch("attention_decode_mma_kernel", kernel, grid, tc::kThreads, smem, stream, p.q.const_data_ptr<T>(),
         strides_of(p.q), k, v, p.out.mutable_data_ptr<T>(), p.lse.mutable_data_ptr<float>(), rows_of(p), p.seqs,
         static_cast<int>(s.head_dim), static_cast<float>(p.scale), p.mask, extras_of(p), slices, q_chunks,
         kv_chunks);
  if (slices.count > 1) merge_key_slices<T>(p, slices, stream);
}

// Calls f(Stored constant) for the plan's cache.
template <typename F>
void with_stored(const AttentionForwardPlan& p, F&& f) {
  if (!p.k_scale.defined()) {
    f(std::integral_constant<Stored, Stored::kPlain>{});
  } else if (p.code == kvq::Code::kInt8) {
    f(std::integral_constant<Stored, Stored::kInt8>{});
  } else {
    f(std::integral_constant<Stored, Stored::kFloat8>{});
  }
}

}  // namespace

bool launch_attention_decode(const AttentionForwardPlan& p, Stream stream) {
  const AttentionShape& s = p.shape;
  const at::ScalarType dtype = p.q.scalar_type();
  if (dtype != at::kBFloat16 && dtype != at::kHalf) return false;
  if (p.dropout.enabled || p.rows.group_rows() > kDecodeMaxRows || s.head_dim > 128) return false;
  bool served = false;
  AT_DISPATCH_REDUCED_FLOATING_TYPES(dtype, "fusedllm_attention_decode", [&] {
    with_stored(p, [&](auto stored) {
      constexpr Stored kS = decltype(stored)::value;
      const KvSource k = kv_source<scalar_t>(p.k, p.k_scale, p), v = kv_source<scalar_t>(p.v, p.v_scale, p);
      if (!k.wide || !v.wide) return;  // rows not in 16-byte pieces: the general kernel
      // `wide` rows of codes are whole 16-byte chunks, as the tensor-core kernel stages them.
      if (decode_on_tensor_cores()) {
        if (s.head_dim <= 64) {
          launch_decode_mma<scalar_t, kS, 64>(p, k, v, stream);
        } else {
          launch_decode_mma<scalar_t, kS, 128>(p, k, v, stream);
        }
        served = true;
        return;
      }
      const auto run = [&](auto D, auto R) {
        constexpr int kD = decltype(D)::value, kRows = decltype(R)::value;
        using C = Decode<scalar_t, kS, kD, kRows>;
        auto kernel = attention_decode_kernel<scalar_t, kS, kD, kRows>;
        allow_shared_memory(kernel, C::smem());
        at::Tensor part_out, part_lse;
        // Slices of at least 4 warp tiles (one a warp): short caches fill the GPU too.
        const KeySlices<float> slices = key_slices<float>(
            p, (p.rows.group_rows() + kRows - 1) / kRows * s.kv_heads * s.batch, kWarpSize, part_out, part_lse);
        const int64_t tiles = (p.rows.group_rows() + kRows - 1) / kRows;
        const dim3 grid(static_cast<unsigned>(slices.count * tiles), static_cast<unsigned>(s.kv_heads),
                        static_cast<unsigned>(s.batch));
        launch("attention_decode_kernel", kernel, grid, kDecodeThreads, C::smem(), stream,
               p.q.const_data_ptr<scalar_t>(), strides_of(p.q), k, v, p.out.mutable_data_ptr<scalar_t>(),
               p.lse.mutable_data_ptr<float>(), rows_of(p), p.seqs, static_cast<int>(s.head_dim),
               static_cast<float>(p.scale), p.mask, extras_of(p), slices);
        if (slices.count > 1) merge_key_slices<scalar_t>(p, slices, stream);
        served = true;
      };
      const auto by_rows = [&](auto D) {
        if (p.rows.group_rows() <= 4) {
          run(D, std::integral_constant<int, 4>{});
        } else {
          run(D, std::integral_constant<int, kDecodeTileRows>{});
        }
      };
      if (s.head_dim <= 64) {
        by_rows(std::integral_constant<int, 64>{});
      } else {
        by_rows(std::integral_constant<int, 128>{});
      }
    });
  });
  return served;
}

}  // namespace fusedllm::cuda
