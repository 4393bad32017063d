// What the attention kernels share besides the GEMM (attention_gemm.h): the
// tiling, staging of operand tiles, masks, dropout draws and the scratch
// arena. Masks and the transpose are compiled once per instruction set in
// attention_tile_kernel.cpp; the rest are templates over the operand type.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "fusedllm/attention.h"
#include "fusedllm/dropout.h"
#include "fusedllm/kv_quant.h"
#include "vec.h"

namespace fusedllm::cpu {
inline namespace CPU_CAPABILITY {
namespace flash {

using attn::Mask;

template <typename acc_t>
constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// ---------------------------------------------------------------------------
// Vector operations for the shared online-softmax template.
// ---------------------------------------------------------------------------

template <typename acc_t>
struct VecOps {
  using V = Vectorized<acc_t>;
  static V max(V a, V b) { return at::vec::maximum(a, b); }
  static V exp(V x) { return vec_exp(x); }
  static V finite_or_zero(V x) { return V::blendv(x, V(acc_t(0)), x == V(kNegInf<acc_t>)); }
  static V tanh(V x) {
    if constexpr (std::is_same_v<acc_t, float>) {
      // tanh(x) = x P(x^2) / Q(x^2), a rational fit of degrees 9 / 8 on
      // |x| <= 7.9 and +-1 beyond (tanh(7.9) = 1 - 3e-7): no exponential, an
      // absolute error below 4e-7 in float32 arithmetic.
      const V c = at::vec::clamp(x, V(-kTanhClamp), V(kTanhClamp));
      const V u = c * c;
      V p(kTanhP[4]), q(kTanhQ[4]);
      for (int i = 3; i >= 0; --i) {
        p = at::vec::fmadd(p, u, V(kTanhP[i]));
        q = at::vec::fmadd(q, u, V(kTanhQ[i]));
      }
      return c * p / q;
    } else {
      return x.tanh();
    }
  }
  static constexpr float kTanhClamp = 7.9f;
  static constexpr float kTanhP[5] = {0.9999999989562627f, 0.13505435926198753f, 0.003645318126613887f,
                                      2.3183012783041523e-05f, 1.7223298093282935e-08f};
  static constexpr float kTanhQ[5] = {1.0f, 0.46838768540045134f, 0.026441226393895293f,
                                      0.0003534766194183076f, 9.289842762688627e-07f};
};

// ---------------------------------------------------------------------------
// Row conversion helpers (T <-> accumulator type).
// ---------------------------------------------------------------------------

// dst[0, n) = src[0, n) * scale in the accumulator type; dst[n, n_pad) = 0.
template <typename T>
inline void load_row(const T* src, int64_t n, int64_t n_pad, typename VecIO<T>::acc_t scale,
                     typename VecIO<T>::acc_t* dst) {
  using IO = VecIO<T>;
  using AV = typename IO::AV;
  constexpr int P = IO::kParts;
  const AV s(scale);
  int64_t j = 0;
  for (; j < n; j += IO::kStep) {
    const int64_t c = std::min<int64_t>(IO::kStep, n - j);
    AV v[P];
    load_step<IO>(src + j, c, v);
    for (int q = 0; q < P; ++q) v[q] = v[q] * s;
    store_acc<IO>(dst + j, c, v);
  }
  for (j = n; j < n_pad; ++j) dst[j] = 0;
}

// dst[0, n) = T(src[0, n) * scale).
template <typename T>
inline void store_row(const typename VecIO<T>::acc_t* src, int64_t n,
                      typename VecIO<T>::acc_t scale, T* dst) {
  using IO = VecIO<T>;
  using AV = typename IO::AV;
  constexpr int P = IO::kParts;
  const AV s(scale);
  for (int64_t j = 0; j < n; j += IO::kStep) {
    const int64_t c = std::min<int64_t>(IO::kStep, n - j);
    AV v[P];
    load_acc<IO>(src + j, c, v);
    for (int q = 0; q < P; ++q) v[q] = v[q] * s;
    store_step<IO>(dst + j, c, v);
  }
}

// ---------------------------------------------------------------------------
// Tiling: shared by forward and backward, a function of the shape only.
// ---------------------------------------------------------------------------

constexpr int64_t kRowsPerTile = 96;  // query rows (positions x group heads) per tile
constexpr int64_t kKeysPerTile = 96;
constexpr int64_t kMaxKeysPerTile = 2 * kKeysPerTile;  // the AMX forward's prefill tiles
// Query rows up to which a tile's scores are computed with the keys along the
// vector lanes (S = Q K^T, scores_along_keys; transposed only for the score
// modifications and masks): the S^T = K Q^T product puts the rows along the
// lanes, 16 of which hold a decoding step's 4 or 8 rows. The backward scores
// such tiles the same way, so that it recomputes the forward's scores exactly.
constexpr int64_t kNarrowRows = 8;
constexpr int64_t kMinTasks = 8;      // split further below this many independent tasks

// The head dim at which the AMX variant takes a bfloat16 call whose head dim
// is not a multiple of 32 (its tiles multiply whole steps of 32): the next
// multiple, up to 128, where the call has prefill tiles (more than
// kNarrowRows rows of a kv head) and K and V are dense rows of q's dtype;
// else its own. Measured on a Xeon (family 6 model 207), bfloat16, B1, 32/8
// heads, S = 2048, causal, the forward on zero-padded copies against the same
// call on vdpbf16ps: 3.3x as fast at head dim 80, 3.2x at 48, 2.4x at 40,
// 4.3x at 112, 2.1x at 24, 2.3x at 16, 1.2-1.45x at 2, 4 and 8. float16
// keeps the float path: its split products at head dim 16 so padded missed
// test_float16_within_units' gradient bound (3.5 units against 3).
inline int64_t amx_head_dim(const AttentionCallArgs& a, bool cache) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  const int64_t padded = round_up(a.head_dim, 32);
  if (a.dtype == at::kBFloat16 && !cache && padded != a.head_dim && padded <= 128 &&
      a.sq * (a.q_heads / std::max<int64_t>(a.kv_heads, 1)) > kNarrowRows) {
    return padded;
  }
#endif
  return a.head_dim;
}
constexpr int64_t kMaxPartialBytes = int64_t(256) << 20;  // cap on split-partial scratch
// Multiply-adds of QK^T below which a call runs on the calling thread: waking
// the other threads costs more than such a call (a few microseconds; a
// decoding step over a short cache). Measured on a 2-core Zen 4: 2^21 kept
// decoding steps of 100-500 us (float32, head dim 32-128) on one thread,
// where SDPA used both.
constexpr int64_t kMinParallelWork = int64_t(1) << 16;

// Slots for a call: threads when the work is large enough, else one.
inline int64_t work_slots(int64_t n_tasks, int64_t work) {
  if (work < kMinParallelWork) return 1;
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_tasks));
}

template <typename acc_t>
struct Tiling {
  int64_t batch, kv_heads, group, sq, sk, d, d_pad;
  int64_t block_q, rows, rows_pad, block_k;
  int64_t q_tiles, k_tiles;
  attn::QueryRows query_rows;

  // sq and sk: every sequence's lengths, or the longest of packed sequences.
  explicit Tiling(const AttentionCallArgs& a)
      : batch(a.batch), kv_heads(a.kv_heads), group(a.q_heads / a.kv_heads), sq(a.sq), sk(a.sk),
        d(a.head_dim), query_rows(a.rows) {
    constexpr int64_t W = Vectorized<acc_t>::size();
    d_pad = round_up(d, W);
    const int64_t target_rows = d > 128 ? kRowsPerTile * 2 / 3 : kRowsPerTile;
    block_q = std::clamp<int64_t>(target_rows / group, 1, std::max<int64_t>(sq, 1));
    rows = block_q * group;
    rows_pad = round_up(rows, W);
    block_k = d > 128 ? kKeysPerTile * 2 / 3 : kKeysPerTile;
    q_tiles = ceil_div(sq, block_q);
    k_tiles = ceil_div(sk, block_k);
  }
  void set_keys_per_tile(int64_t n) {
    block_k = n;
    k_tiles = ceil_div(sk, block_k);
  }

  // Column i of a tile of kv head g starting at position p0: query head,
  // position, and flat [B, Hq, Sq] row in batch b.
  int64_t head_of(int64_t g, int64_t i) const { return query_rows.group_head(g, i); }
  int64_t pos_of(int64_t p0, int64_t i) const { return p0 + query_rows.group_pos(i); }
  int64_t row_of(int64_t b, int64_t g, int64_t p0, int64_t i) const {
    return query_rows.row_of_group_row(b, g, query_rows.group_row(p0) + i);
  }
  // Column i's row of a [heads, seq, d] operand at base.
  template <typename T>
  const T* row_in(const T* base, int64_t head_stride, int64_t seq_stride, int64_t g, int64_t p0,
                  int64_t i) const {
    return base + head_of(g, i) * head_stride + pos_of(p0, i) * seq_stride;
  }
};

// Runs fn(task, slot) for every task in [0, n_tasks) on `slots` threads (from
// work_slots); tasks are handed out in index order from a shared counter (so
// uneven tasks balance), and `slot` identifies the caller's scratch space.

template <typename F>
void run_tasks(int64_t n_tasks, int64_t slots, const F& fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, slots, 1, [&](int64_t begin, int64_t end) {
    for (int64_t slot = begin; slot < end; ++slot) {
      for (int64_t t = next.fetch_add(1); t < n_tasks; t = next.fetch_add(1)) fn(t, slot);
    }
  });
}

// Sets the scores of keys a row cannot see to -inf in a transposed tile
// s[j * ld + col] (keys j0 + [0, nk), columns of positions p0 + [0, npos)).
template <typename acc_t>
void mask_tile(acc_t* s, int64_t ld, int64_t nk, int64_t j0, int64_t p0, int64_t npos,
               int64_t group, const Mask mask);

// Whether nothing reads a tile's scores between their product and the
// softmax but the masks' -inf, which a positive scale keeps: then the scale
// can wait for the exponent's argument.
template <typename Args>
bool scale_can_wait(const Args& a) {
  return a.scale > 0 && !a.mods.any_score_mod() && !a.tensor_mask.present();
}

// Position p0 + [0, npos) and its group's heads as the columns of a
// transposed tile: where the caller's mask and the dropout pattern are read.
struct TileRows {
  int64_t b, g, group, p0, npos, j0, nk;
  int64_t head(int64_t col) const { return g * group + col % group; }
  int64_t pos(int64_t col) const { return p0 + col / group; }
  int64_t cols() const { return npos * group; }
};

// Soft-capping and ALiBi (attn::ScoreMods) on a transposed score tile
// s[j * ld + col] of the caller's scaled scores, before the masks. Under a
// cap, cap_slope (when not null) receives ds/dz of each score, what backward
// multiplies the score gradients by. offset: the sequence's Sk - Sq.
// col_buf: scratch of 2 * ld.
template <typename acc_t>
void apply_score_mods(acc_t* s, int64_t ld, const TileRows& t, const attn::ScoreMods& mods,
                      int64_t offset, acc_t* cap_slope, acc_t* col_buf);

// Applies the caller's mask to a transposed score tile s[j * ld + col]: bool
// False -> -inf, float masks added to the (already scaled) scores.
template <typename acc_t>
void apply_tensor_mask(acc_t* s, int64_t ld, const TileRows& t, const attn::TensorMask& m);

// Calls f(j, col, kept) for every key j of the tile and column col < t.cols():
// whether dropout keeps probability (b, head, pos, j0 + j). One Philox call
// serves four consecutive keys of a row.
template <typename F>
void for_each_dropout_draw(const TileRows& t, const attn::QueryRows& rows, int64_t sk,
                           const dropout::Dropout& dr, const F& f) {
  for (int64_t col = 0; col < t.cols(); ++col) {
    uint64_t n = static_cast<uint64_t>(rows.row(t.b, t.head(col), t.pos(col)) * sk + t.j0);
    dropout::Words w = dropout::philox(dr.seed, n >> 2);
    for (int64_t j = 0; j < t.nk; ++j, ++n) {
      if ((n & 3) == 0 && j > 0) w = dropout::philox(dr.seed, n >> 2);
      f(j, col, dropout::kept(w.w[n & 3], dr.threshold));
    }
  }
}

// True when every row of positions [p0, p1) sees every key of [j0, j0 + nk).
inline bool tile_fully_visible(const Mask& mask, int64_t p0, int64_t p1, int64_t j0, int64_t nk) {
  return attn::key_begin(mask, p1 - 1) <= j0 && attn::key_end(mask, p0) >= j0 + nk;
}

// The key tiles a query tile visits: keys [begin, end) (the union of what
// its rows see) cut into tiles of `block` keys. Aligned to the end, the last
// tile stops at the last visible key, so under a causal mask only about half a
// tile of the diagonal is computed and masked. Aligned to the global grid
// (tile i is global tile first + i, clipped to [begin, end)), every query tile
// uses the same tiles: what a backward task needs when it owns a subset of them.
struct KeyTiles {
  int64_t begin = 0, end = 0, block = 1, count = 0, first = 0;
  bool global = false;

  KeyTiles(const Mask& mask, int64_t p0, int64_t p1, int64_t block_, bool global_)
      : begin(attn::key_begin(mask, p0)), end(attn::key_end(mask, p1 - 1)), block(block_),
        global(global_) {
    if (begin >= end) return;
    if (global) {
      first = begin / block;
      count = (end - 1) / block - first + 1;
    } else {
      count = ceil_div(end - begin, block);
    }
  }
  int64_t start(int64_t i) const {
    return std::max(begin, global ? (first + i) * block : end - (count - i) * block);
  }
  int64_t stop(int64_t i) const {
    return global ? std::min(end, (first + i + 1) * block) : end - (count - 1 - i) * block;
  }
};

// A [rows, d] tile of K or V as a contiguous, zero-padded accumulator-type
// copy in `buf` (leading dimension d_pad). Copied even when the tensor already
// has the accumulator type: the sequential copy streams the tile into cache
// once, where the products would otherwise fetch it row by row, several rows at
// a time (measured faster for float32 inputs).
// src's nk rows where they lie, as an accumulator tile (leading dimension d),
// where they already are one: stored as acc_t, d_pad wide and back to back
// (seq_stride == d); else null. Measured on a Zen 4 (float32, d 128, 32/8
// heads, causal attention): read so, 3-7% faster than through a copy on
// [B, H, S, D] tensors; rows of [B, S, H, D] ones read in place ran 5% slower
// (4 KiB apart, they share cache sets), so those are still copied.
template <typename T, typename acc_t>
inline const acc_t* rows_in_place(const T* src, int64_t seq_stride, int64_t d, int64_t d_pad) {
  if constexpr (std::is_same_v<T, acc_t>) {
    if (d == d_pad && seq_stride == d) return src;
  }
  return nullptr;
}

template <typename T, typename acc_t>
inline const acc_t* kv_tile(const T* src, int64_t seq_stride, int64_t nk, int64_t d, int64_t d_pad,
                            acc_t* buf, int64_t& ld) {
  for (int64_t j = 0; j < nk; ++j) load_row(src + j * seq_stride, d, d_pad, acc_t(1), buf + j * d_pad);
  ld = d_pad;
  return buf;
}

// dst[0, n) = src[0, n) * scale (a row of an int8 cache); dst[n, n_pad) = 0.
// Each entry is float(src) * scale rounded once, what every path computes.
template <typename acc_t>
inline void dequantize_row(const int8_t* src, int64_t n, int64_t n_pad, float scale, acc_t* dst) {
  int64_t j = 0;
  if constexpr (std::is_same_v<acc_t, float>) {
#if defined(CPU_CAPABILITY_AVX512)
    const __m512 s = _mm512_set1_ps(scale);
    for (; j + 16 <= n; j += 16) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j));
      _mm512_storeu_ps(dst + j, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), s));
    }
#elif defined(CPU_CAPABILITY_AVX2)
    const __m256 s = _mm256_set1_ps(scale);
    for (; j + 8 <= n; j += 8) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + j));
      _mm256_storeu_ps(dst + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), s));
    }
#endif
  }
  for (; j < n; ++j) dst[j] = static_cast<acc_t>(static_cast<float>(src[j]) * scale);
  for (j = n; j < n_pad; ++j) dst[j] = 0;
}

// Asks for the cache line at p (into L2 and outer caches). GCC 12 deletes a
// __builtin_prefetch whose address it computed from loads (a paged row's
// table entry, here: measured, the decoding step lost its prefetches and 15%),
// so on x86 the instruction is written out.
inline void prefetch_line(const char* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht2 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 1);
#endif
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// 16 float8 e4m3 codes as the float16 bits of code * 2^-8: exponent and
// mantissa move up 7 bits, the sign 8. float16's exponent bias is 8 above
// e4m3's and its subnormals hold e4m3's, so this is exact; the NaN codes
// (magnitude 0x7F, which would read as 480) become all ones, a NaN.
inline __m256i float8_half_bits(__m128i codes) {
  const __m256i w = _mm256_cvtepu8_epi16(codes);
  const __m256i magnitude = _mm256_and_si256(w, _mm256_set1_epi16(0x7F));
  const __m256i bits = _mm256_or_si256(_mm256_slli_epi16(magnitude, 7),
                                       _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
  return _mm256_or_si256(bits, _mm256_cmpeq_epi16(magnitude, _mm256_set1_epi16(0x7F)));
}
#endif

// dequantize_row for float8 e4m3 codes: each entry is value(code) * scale
// rounded once, as kvq::float8_value(code) * scale.
template <typename acc_t>
inline void dequantize_row(const c10::Float8_e4m3fn* src, int64_t n, int64_t n_pad, float scale, acc_t* dst) {
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(src);
  int64_t j = 0;
  if constexpr (std::is_same_v<acc_t, float>) {
#if defined(CPU_CAPABILITY_AVX512)
    const __m512 s = _mm512_set1_ps(scale * 256.0f);  // 2^8 undoes float8_half_bits' 2^-8, exactly
    for (; j + 16 <= n; j += 16) {
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j));
      _mm512_storeu_ps(dst + j, _mm512_mul_ps(_mm512_cvtph_ps(float8_half_bits(c)), s));
    }
#elif defined(CPU_CAPABILITY_AVX2)
    const __m256 s = _mm256_set1_ps(scale * 256.0f);
    for (; j + 16 <= n; j += 16) {
      const __m256i h = float8_half_bits(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j)));
      _mm256_storeu_ps(dst + j, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), s));
      _mm256_storeu_ps(dst + j + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), s));
    }
#endif
  }
  for (; j < n; ++j) dst[j] = static_cast<acc_t>(kvq::float8_value(codes[j]) * scale);
  for (j = n; j < n_pad; ++j) dst[j] = 0;
}

// The K or V rows of one (batch, kv head) pair: T, or int8 / float8 e4m3
// codes with a float32 scale per row; dense, or in pages (attn::Pages).
template <typename T>
struct KvRows {
  using acc_t = typename VecIO<T>::acc_t;
  const char* data;  // row 0 of a dense pair; kv head g of page 0 when paged
  int64_t seq_stride, page_stride, elem_size;  // strides in elements
  const float* scale = nullptr;  // set: int8 or float8 rows
  bool float8 = false;           // the codes are float8 e4m3 (else int8)
  int64_t scale_stride = 0, scale_page_stride = 0;
  attn::Pages pages;
  int64_t b;

  KvRows(const AttentionOperand& o, const AttentionScales& s, const attn::Pages& pages_, int64_t b_,
         int64_t g, int64_t start)
      : seq_stride(o.seq_stride), page_stride(o.batch_stride),
        elem_size(s.data == nullptr ? int64_t(sizeof(T)) : 1), float8(s.float8),
        scale_page_stride(s.batch_stride), pages(pages_), b(b_) {
    const int64_t first = pages.paged() ? 0 : b * o.batch_stride + start * o.seq_stride;
    data = static_cast<const char*>(o.data) + (first + g * o.head_stride) * elem_size;
    if (s.data != nullptr) {
      scale = s.data + g * s.head_stride + (pages.paged() ? 0 : b * s.batch_stride + start * s.seq_stride);
      scale_stride = s.seq_stride;
    }
  }
  bool quantized() const { return scale != nullptr; }
  const char* row_bytes(int64_t j) const {
    return data + pages.row_offset(b, j, page_stride, seq_stride) * elem_size;
  }
  // f(rows) with rows(i) giving row j0 + i (i < nk <= kMaxKeysPerTile) typed as
  // stored: const T*, const int8_t* or const c10::Float8_e4m3fn* (the packers
  // take each). The tile's row addresses are worked out once, here: the
  // packers read a row several times, and a paged row's address takes a division.
  template <typename F>
  void with_rows(int64_t j0, int64_t nk, const F& f) const {
    const char* at[kMaxKeysPerTile];
    const int64_t step = seq_stride * elem_size;
    runs(j0, nk, [&](int64_t i, int64_t n) {
      const char* first = row_bytes(j0 + i);
      for (int64_t t = 0; t < n; ++t) at[i + t] = first + t * step;
    });
    if (!quantized()) {
      f([&at](int64_t i) { return reinterpret_cast<const T*>(at[i]); });
    } else if (float8) {
      f([&at](int64_t i) { return reinterpret_cast<const c10::Float8_e4m3fn*>(at[i]); });
    } else {
      f([&at](int64_t i) { return reinterpret_cast<const int8_t*>(at[i]); });
    }
  }
  // f(i, n) for each run [i, i + n) of rows [j0, j0 + nk) (relative to j0)
  // that lie seq_stride apart (one page; all of them when dense): a paged
  // row's address takes a division, so the helpers below take one per run.
  template <typename F>
  void runs(int64_t j0, int64_t nk, const F& f) const {
    for (int64_t i = 0; i < nk;) {
      const int64_t n = pages.run(j0 + i, nk - i);
      f(i, n);
      i += n;
    }
  }
  // Asks the caches for rows [j0, j0 + nk): a later tile's rows, requested
  // before they are read, load while the current tile's products run
  // (decoding reads the whole cache once per step).
  void prefetch(int64_t j0, int64_t nk, int64_t d) const {
    const int64_t bytes = d * elem_size, step = seq_stride * elem_size;
    runs(j0, nk, [&](int64_t i, int64_t n) {
      const char* first = row_bytes(j0 + i);
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t c = 0; c < bytes; c += 64) prefetch_line(first + t * step + c);
      }
      if (quantized()) {  // and their scales (the scaling loads stalled on them; measured)
        const char* s = reinterpret_cast<const char*>(scale + pages.row_offset(b, j0 + i, scale_page_stride, scale_stride));
        const int64_t s_step = scale_stride * int64_t(sizeof(float));
        if (s_step >= 64) {
          for (int64_t t = 0; t < n; ++t) prefetch_line(s + t * s_step);
        } else {
          const char* line = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(s) & ~uintptr_t(63));
          for (; line < s + n * s_step; line += 64) prefetch_line(line);
        }
      }
    });
  }
  // The scales of rows [j0, j0 + nk) as dst[0, nk), zero in [nk, n_pad).
  void gather_scales(int64_t j0, int64_t nk, int64_t n_pad, float* dst) const {
    runs(j0, nk, [&](int64_t i, int64_t n) {
      const float* s = scale + pages.row_offset(b, j0 + i, scale_page_stride, scale_stride);
      for (int64_t t = 0; t < n; ++t) dst[i + t] = s[t * scale_stride];
    });
    std::fill(dst + nk, dst + n_pad, 0.0f);
  }
  // acc[j * ld + c] *= the scale of row j0 + j, for j < nk and c < ld.
  void scale_rows(acc_t* acc, int64_t ld, int64_t j0, int64_t nk) const {
    const auto times = [&](int64_t j, acc_t s) {
      for (int64_t c = 0; c < ld; ++c) acc[j * ld + c] *= s;
    };
    runs(j0, nk, [&](int64_t i, int64_t n) {
      const float* s = scale + pages.row_offset(b, j0 + i, scale_page_stride, scale_stride);
      for (int64_t t = 0; t < n; ++t) times(i + t, s[t * scale_stride]);
    });
  }
  // Rows [j0, j0 + nk) where they lie (rows_in_place), or null.
  const acc_t* in_place(int64_t j0, int64_t nk, int64_t d, int64_t d_pad, int64_t& ld) const {
    if (quantized() || pages.run(j0, nk) != nk) return nullptr;
    ld = d;
    return rows_in_place<T, acc_t>(reinterpret_cast<const T*>(row_bytes(j0)), seq_stride, d, d_pad);
  }
  // Rows [j0, j0 + nk) as a contiguous, zero-padded accumulator tile (kv_tile).
  const acc_t* tile(int64_t j0, int64_t nk, int64_t d, int64_t d_pad, acc_t* buf, int64_t& ld) const {
    ld = d_pad;
    with_rows(j0, nk, [&](const auto& row) {
      if constexpr (std::is_same_v<decltype(row(0)), const T*>) {
        runs(j0, nk, [&](int64_t i, int64_t n) { kv_tile(row(i), seq_stride, n, d, d_pad, buf + i * d_pad, ld); });
      } else {
        runs(j0, nk, [&](int64_t i, int64_t n) {
          const float* s = scale + pages.row_offset(b, j0 + i, scale_page_stride, scale_stride);
          for (int64_t t = i; t < i + n; ++t) dequantize_row(row(t), d, d_pad, s[(t - i) * scale_stride], buf + t * d_pad);
        });
      }
    });
    return buf;
  }
};

// Rows of a tile, row-major with leading dimension d_pad (zero padding).
template <typename T, typename acc_t>
void gather_rows(const T* base, int64_t head_stride, int64_t seq_stride, const Tiling<acc_t>& t,
                 int64_t g, int64_t p0, int64_t rows, acc_t scale, acc_t* dst) {
  for (int64_t i = 0; i < rows; ++i) {
    load_row(t.row_in(base, head_stride, seq_stride, g, p0, i), t.d, t.d_pad, scale, dst + i * t.d_pad);
  }
}

// dst[c * ld_dst + r] = src[r * ld_src + c] for r < rows, c < cols: 8 x 8
// blocks through ATen's vector transpose, scalar edges.
template <typename acc_t>
void transpose(const acc_t* src, int64_t ld_src, int64_t rows, int64_t cols, acc_t* dst,
               int64_t ld_dst);

// Rows of a tile (times scale) both row-major in `rows_dst` (leading dim
// d_pad) and transposed in `t_dst` (d x ld); rows [rows, ld) are zero in both.
template <typename T, typename acc_t>
void gather_both(const T* base, int64_t head_stride, int64_t seq_stride, const Tiling<acc_t>& t,
                 int64_t g, int64_t p0, int64_t rows, int64_t ld, acc_t scale, acc_t* rows_dst,
                 acc_t* t_dst) {
  gather_rows(base, head_stride, seq_stride, t, g, p0, rows, scale, rows_dst);
  std::fill(rows_dst + rows * t.d_pad, rows_dst + ld * t.d_pad, acc_t(0));
  transpose(rows_dst, t.d_pad, ld, t.d, t_dst, ld);
}
// ---------------------------------------------------------------------------
// Scratch
// ---------------------------------------------------------------------------

// Places buffers one after another in a block, each on its own cache line.
// Without a base it only measures: a layout is one constructor taking its
// buffers from arenas, run once without memory to size the block and once
// over it to place them, so sizes and offsets cannot disagree.
class Arena {
 public:
  static constexpr int64_t kAlign = 64;
  explicit Arena(void* base = nullptr) : base_(static_cast<char*>(base)) {}
  template <typename U>
  U* take(int64_t n) {
    const int64_t at = used_;
    used_ += round_up(n * static_cast<int64_t>(sizeof(U)), kAlign);
    return base_ != nullptr ? reinterpret_cast<U*>(base_ + at) : nullptr;
  }
  int64_t bytes() const { return used_; }

 private:
  char* base_;
  int64_t used_ = 0;
};

// A call's workspace: buffers that must start at zero from one arena, the
// rest from another placed after it (AttentionWorkspace).
template <typename Layout, typename... Args>
AttentionWorkspace measure(const Args&... args) {
  Arena zeroed, plain;
  Layout(args..., zeroed, plain);
  return {zeroed.bytes(), zeroed.bytes() + plain.bytes()};
}

template <typename Layout, typename... Args>
Layout place(void* workspace, const AttentionWorkspace& size, const Args&... args) {
  Arena zeroed(workspace), plain(static_cast<char*>(workspace) + size.zeroed);
  return Layout(args..., zeroed, plain);
}

}  // namespace flash
}  // namespace CPU_CAPABILITY
}  // namespace fusedllm::cpu
