// Flash attention forward on CPU, compiled once per instruction set (see
// CMakeLists.txt; the layout of the work is described in attention_kernel.h).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_amx.h"
#include "attention_gemm.h"
#include "attention_lanes.h"
#include "attention_pair_words.h"
#include "attention_pairs.h"
#include "attention_tile.h"
#include "fusedllm/attention.h"

namespace fusedllm::cpu {
inline namespace CPU_CAPABILITY {
namespace flash {
namespace {

// Keys per tile of a decoding step (at most kNarrowRows query rows per kv
// head), so that the tile's packed K and V (float32 copies on the float32
// path) stay in the level-1 cache beside the scores: a budget of head dims x
// keys, in multiples of 16 keys. Measured on a Zen 4 (32 KiB L1d), 32/8
// heads of 128 over 2k-32k keys, batch 1 and 8, against 96 keys: float32
// tiles best at 16 keys (1.3-1.5x as fast), bfloat16 pair words at 32
// (1.6-1.7x), int8 and float8 codes at 64 (1.03-1.06x); at head dim 32,
// bfloat16 best at 64 or more keys. (The float32 budget predates reading K,
// and V at head dims up to 64, where they lie. A budget of 4096 together
// with V read where it lies at every head dim ran faster on cached tiles
// and slower over 8k keys at batch 4; not measured apart.)
template <typename T>
int64_t decoding_keys_per_tile(const AttentionForwardArgs& a) {
  const bool codes = a.k_scale.data != nullptr && a.v_scale.data != nullptr;
  const int64_t budget = !kPairProducts<T> ? 2048 : (codes ? 8192 : 4096);
  return std::clamp<int64_t>(budget / std::max<int64_t>(a.head_dim, 1) / 16 * 16, 16, kKeysPerTile);
}

// Keys per prefill tile on the AMX tiles (bfloat16, and float16 K and V
// that are not codes; head dims that are multiples of 32 up to 128) and of
// float32 at head dims up to 128, 0 elsewhere (the Tiling's): twice the
// default, so that P V loads and stores its accumulators once per 192 keys
// and the per-tile steps (the softmax's running statistics, the rescale) run
// half as often. Measured on a Xeon (family 6 model 207), B1, 32/8 heads,
// D128, causal: on the AMX tiles 1.10-1.14x as fast as 96 keys at S = 2048
// and 8192 (128 and 160 in between); float32 1.03x at S = 2048 and 4096.
template <typename T>
int64_t prefill_keys_per_tile(const AttentionForwardArgs& a) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  const bool codes = a.k_scale.data != nullptr || a.v_scale.data != nullptr;
  if ((kPairProducts<T> || (kSplitProducts<T> && !codes)) && a.head_dim % 32 == 0 && a.head_dim <= 128) {
    return kMaxKeysPerTile;
  }
#endif
  if (std::is_same_v<T, float> && a.head_dim <= 128) return kMaxKeysPerTile;
  return 0;
}

// Pieces of the next key tile prefetched during the current one: at its
// start, after the K packing, after QK^T, after the softmax, after the V
// packing (a decoding step over 32k bfloat16 or int8 keys: 5 pieces took
// 0.8 and 0.67 of the time of one burst at the start). Not on the AMX
// tiles' prefill tiles nor on the float path's: without it they ran
// 1.04-1.05x as fast (AMX) and as fast or 1.10x (float32, S = 2048 / 4096)
// on a Xeon (family 6 model 207), as fast on a Zen 4 (float32), the
// hardware prefetcher streaming K's and V's rows.
constexpr int kPrefetchParts = 5;

// Per-slot scratch of the forward pass; split: float16 on the AMX tiles.
template <typename acc_t>
struct ForwardScratch {
  acc_t *qt, *s, *sr, *o, *kbuf, *vbuf, *row_max, *row_sum, *alpha, *cols, *q_scale, *p_scale;
  acc_t* p_low;  // the low parts' pair words of P (split only)
  ForwardScratch(const Tiling<acc_t>& t, bool split, Arena& m)
      : qt(m.take<acc_t>(t.d * t.rows_pad)),
        s(m.take<acc_t>(t.block_k * t.rows_pad)),
        sr(m.take<acc_t>(16 * round_up(t.block_k, 16))),
        o(m.take<acc_t>(t.rows_pad * t.d_pad)),
        kbuf(m.take<acc_t>(kbuf_words(t))),
        vbuf(m.take<acc_t>(t.block_k * t.d_pad)),
        row_max(m.take<acc_t>(t.rows_pad)),
        row_sum(m.take<acc_t>(t.rows_pad)),
        alpha(m.take<acc_t>(t.rows_pad)),
        cols(m.take<acc_t>(2 * t.rows_pad)),
        q_scale(m.take<acc_t>(t.rows_pad)),
        p_scale(m.take<acc_t>(t.rows_pad)),
        p_low(m.take<acc_t>(split ? p_words(t) : 0)) {}
  static int64_t bytes(const Tiling<acc_t>& t, bool split) {
    Arena m;
    static_cast<void>(ForwardScratch(t, split, m));
    return m.bytes();
  }
  // P's row-major pair words of a tile on the AMX tiles (rows x key pairs).
  static int64_t p_words(const Tiling<acc_t>& t) { return t.rows_pad * round_up(ceil_div(t.block_k, 2), 16); }
  // kbuf: a key tile's rows, then on the AMX tiles P's pair words (more than
  // K's at small head dims: 96 x 96 words against 192 x 32 at head dim 32).
  static int64_t kbuf_words(const Tiling<acc_t>& t) { return std::max(t.block_k * t.d_pad, p_words(t)); }
};

// The pair words of one (batch, kv head) pair's V across keys packed once a
// call (pack_values), a block_k of keys at a time; float16's high parts,
// then its low parts, this many each.
template <typename acc_t>
int64_t values_pair_words(const Tiling<acc_t>& t) {
  return round_up(t.sk, t.block_k) / 2 * t.d_pad;
}

// How a call is cut into tasks: a function of the shape and thread count.
template <typename acc_t>
struct ForwardPlan {
  Tiling<acc_t> t;
  int64_t pairs, n_rows, splits = 1, n_tasks, slots;
  bool split;  // float16 on the AMX tiles (kSplitProducts)
  // On the AMX tiles with several query tiles: each (batch, kv head) pair's V
  // across keys (P V's right operand) packed once a call, v_pair_words words
  // a pair, not once per query and key tile; 0: packed per tile. Measured on
  // a Xeon (family 6 model 207), B1, 32/8, D128, causal, bfloat16:
  // 1.05-1.12x as fast as packing per tile in four of five interleaved runs
  // at S = 2048-8192 (0.98x in the fifth). (float16's K split once a call
  // as well measured 1.01-1.05x, for K's size twice over in memory: not
  // kept.)
  int64_t v_pair_words = 0;

  ForwardPlan(const AttentionForwardArgs& a, int64_t decoding_keys, int64_t prefill_keys, bool split)
      : t(a), split(split) {
    if (t.rows <= kNarrowRows) {
      t.set_keys_per_tile(std::min(t.block_k, decoding_keys));
    } else if (prefill_keys > 0) {
      t.set_keys_per_tile(prefill_keys);
    }
    pairs = t.batch * t.kv_heads;
    n_rows = a.rows.count(t.batch);
    const int64_t base_tasks = pairs * t.q_tiles;
    // Few tasks (decoding, small batch): also split the keys; each split
    // writes normalized partial rows and their log-sum-exp, merged after.
    const int64_t work = t.batch * a.q_heads * t.sq * t.sk * t.d;
    if (base_tasks < kMinTasks && t.k_tiles > 1 && work >= kMinParallelWork) {
      splits = std::min(ceil_div(kMinTasks, base_tasks), t.k_tiles);
      const int64_t per_split = n_rows * (t.d_pad + 1) * int64_t(sizeof(acc_t));
      splits = std::max<int64_t>(1, std::min(splits, kMaxPartialBytes / std::max<int64_t>(per_split, 1)));
    }
    n_tasks = base_tasks * splits;
    slots = work_slots(n_tasks, work);
    if (prefill_keys > 0 && t.rows > kNarrowRows && t.q_tiles > 1) {
      const int64_t words = (split ? 2 : 1) * values_pair_words(t);
      if (pairs * words * int64_t(sizeof(uint32_t)) <= kMaxPartialBytes) v_pair_words = words;
    }
  }
};

// The call's workspace: a ForwardScratch per slot; per slot the task's
// output rows in the accumulator type (before the cast to T) and their lse;
// with splits, every split's rows and lse.
template <typename acc_t>
struct ForwardWorkspace {
  int64_t scratch_stride, rows_stride;  // bytes, elements
  bool split;
  char* scratch;
  acc_t *rows, *partial_o, *partial_lse;
  uint32_t* v_words;  // ForwardPlan::v_pair_words a pair, or null

  ForwardWorkspace(const ForwardPlan<acc_t>& p, Arena& zeroed, Arena& plain)
      : scratch_stride(ForwardScratch<acc_t>::bytes(p.t, p.split)),
        rows_stride(p.t.rows_pad * p.t.d_pad + p.t.rows_pad),
        split(p.split),
        scratch(zeroed.take<char>(p.slots * scratch_stride)),
        rows(plain.take<acc_t>(p.slots * rows_stride)),
        partial_o(p.splits > 1 ? plain.take<acc_t>(p.splits * p.n_rows * p.t.d_pad) : nullptr),
        partial_lse(p.splits > 1 ? plain.take<acc_t>(p.splits * p.n_rows) : nullptr),
        v_words(p.v_pair_words > 0 ? plain.take<uint32_t>(p.pairs * p.v_pair_words) : nullptr) {}

  ForwardScratch<acc_t> slot(const Tiling<acc_t>& t, int64_t i) const {
    Arena m(scratch + i * scratch_stride);
    return ForwardScratch<acc_t>(t, split, m);
  }
};

// The maximum over nk rows of the W columns at col (rows ld apart), on four
// running maxima: one chain of NaN-propagating maxima (compare, max, or) was
// bound by its latency (measured on a Sapphire Rapids).
template <typename acc_t>
Vectorized<acc_t> column_max(const acc_t* col, int64_t ld, int64_t nk, const VecOps<acc_t>& ops) {
  using V = Vectorized<acc_t>;
  V m0(kNegInf<acc_t>), m1(kNegInf<acc_t>), m2(kNegInf<acc_t>), m3(kNegInf<acc_t>);
  int64_t j4 = 0;
  for (; j4 + 4 <= nk; j4 += 4) {
    m0 = ops.max(m0, V::loadu(col + j4 * ld));
    m1 = ops.max(m1, V::loadu(col + (j4 + 1) * ld));
    m2 = ops.max(m2, V::loadu(col + (j4 + 2) * ld));
    m3 = ops.max(m3, V::loadu(col + (j4 + 3) * ld));
  }
  for (; j4 < nk; ++j4) m0 = ops.max(m0, V::loadu(col + j4 * ld));
  return ops.max(ops.max(m0, m1), ops.max(m2, m3));
}

// Online softmax over one transposed score tile s[j * ld + col] (nk keys,
// ld columns): turns scores into exp(score - shift) in place and updates the
// per-row running max and sum; alpha[col] rescales the output rows. kScaled:
// the tile holds the products unscaled, the scores being scale (> 0) times
// them (one rounding less, and no pass over the tile to scale it).
template <typename acc_t, bool kScaled = false>
void softmax_tile(acc_t* s, int64_t ld, int64_t nk, acc_t* row_max, acc_t* row_sum, acc_t* alpha,
                  acc_t scale = acc_t(1)) {
  using V = Vectorized<acc_t>;
  constexpr int64_t W = V::size();
  const VecOps<acc_t> ops;
  const V sv(scale);
  for (int64_t c = 0; c < ld; c += W) {
    acc_t* col = s + c;
    V tile_max = column_max(col, ld, nk, ops);
    if constexpr (kScaled) tile_max = tile_max * sv;
    V running_max = V::loadu(row_max + c);
    V shift;
    const V a = attn::online_softmax_step(running_max, tile_max, shift, ops);
    const auto arg = [&](int64_t j) {
      if constexpr (kScaled) {
        return at::vec::fmadd(V::loadu(col + j * ld), sv, V(acc_t(0)) - shift);
      } else {
        return V::loadu(col + j * ld) - shift;
      }
    };
    V sum0(acc_t(0)), sum1(acc_t(0));
    int64_t j = 0;
    for (; j + 2 <= nk; j += 2) {
      const V p0 = ops.exp(arg(j));
      const V p1 = ops.exp(arg(j + 1));
      p0.store(col + j * ld);
      p1.store(col + (j + 1) * ld);
      sum0 = sum0 + p0;
      sum1 = sum1 + p1;
    }
    if (j < nk) {
      const V p0 = ops.exp(arg(j));
      p0.store(col + j * ld);
      sum0 = sum0 + p0;
    }
    (V::loadu(row_sum + c) * a + (sum0 + sum1)).store(row_sum + c);
    running_max.store(row_max + c);
    a.store(alpha + c);
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// softmax_tile<float, true> fused with pack_tile_rows_amx: the probabilities
// of the unscaled tile s (nk keys x ld columns) rounded to bfloat16 and
// written as P's row-major pair words, word (col, p) at out[col * ldo + p]
// for p < round_up(ceil(nk / 2), 16) (zero past the keys), without storing
// them in s. The statistics, the probabilities and their sums are
// softmax_tile's, term for term.
inline void softmax_rows_amx(const float* s, int64_t ld, int64_t nk, float* row_max, float* row_sum, float* alpha,
                             float scale, uint32_t* out, int64_t ldo) {
  using V = Vectorized<float>;
  const VecOps<float> ops;
  const int64_t np16 = round_up(ceil_div(nk, 2), 16);
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t c = 0; c < ld; c += 16) {
    const float* col = s + c;
    const V tile_max = column_max(col, ld, nk, ops) * V(scale);
    V running_max = V::loadu(row_max + c);
    V shift;
    const V a = attn::online_softmax_step(running_max, tile_max, shift, ops);
    const __m512 neg_shift = _mm512_sub_ps(_mm512_setzero_ps(), __m512(shift));
    __m512 sums[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};  // even and odd keys
    const auto probability = [&](int64_t j, int odd) {
      const __m512 e = exp_fast(_mm512_fmadd_ps(_mm512_loadu_ps(col + j * ld), sv, neg_shift));
      sums[odd] = _mm512_add_ps(sums[odd], e);
      return e;
    };
    for (int64_t p0 = 0; p0 < np16; p0 += 16) store_pair_rows_amx(probability, nk, p0, c, out, ldo);
    (V::loadu(row_sum + c) * a + (V(sums[0]) + V(sums[1]))).store(row_sum + c);
    running_max.store(row_max + c);
    a.store(alpha + c);
  }
}
#endif

#if defined(__AVX512BF16__)
// softmax_tile for the first 8 columns only (a decoding tile's rows): 256-bit
// vectors, twice the throughput of 512-bit ones on CPUs that split the latter.
inline void softmax_tile_8(float* s, int64_t ld, int64_t nk, float* row_max, float* row_sum, float* alpha) {
  const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
  __m256 tile_max = neg_inf;
  for (int64_t j = 0; j < nk; ++j) tile_max = _mm256_max_ps(tile_max, _mm256_loadu_ps(s + j * ld));
  const __m256 running = _mm256_loadu_ps(row_max);
  const __m256 new_max = _mm256_max_ps(running, tile_max);
  // a row with no visible key so far keeps shift 0, so exp(-inf - shift) = 0
  const __m256 shift = _mm256_blendv_ps(new_max, _mm256_setzero_ps(), _mm256_cmp_ps(new_max, neg_inf, _CMP_EQ_OQ));
  const __m256 a = exp_fast(_mm256_sub_ps(running, shift));
  __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 2 <= nk; j += 2) {
    const __m256 p0 = exp_fast(_mm256_sub_ps(_mm256_loadu_ps(s + j * ld), shift));
    const __m256 p1 = exp_fast(_mm256_sub_ps(_mm256_loadu_ps(s + (j + 1) * ld), shift));
    _mm256_storeu_ps(s + j * ld, p0);
    _mm256_storeu_ps(s + (j + 1) * ld, p1);
    sum0 = _mm256_add_ps(sum0, p0);
    sum1 = _mm256_add_ps(sum1, p1);
  }
  if (j < nk) {
    const __m256 p0 = exp_fast(_mm256_sub_ps(_mm256_loadu_ps(s + j * ld), shift));
    _mm256_storeu_ps(s + j * ld, p0);
    sum0 = _mm256_add_ps(sum0, p0);
  }
  _mm256_storeu_ps(row_sum, _mm256_fmadd_ps(_mm256_loadu_ps(row_sum), a, _mm256_add_ps(sum0, sum1)));
  _mm256_storeu_ps(row_max, new_max);
  _mm256_storeu_ps(alpha, a);
}

// A decoding tile with the keys along the lanes: s[i * ld + j] (i < rows,
// j < nk) holds query row i's score against key j, but for the key's scale
// ks[j] (null: none). Runs the online softmax step of each row and leaves
// P diag(vs) (vs null: P) in place as pair words along the row (word p of row i
// at reinterpret_cast<uint32_t*>(s)[i * ld + p]): bfloat16, or int16 with each
// row scaled so that its largest value is 32767, the scale back in p_scale[i]
// (NaN for a row holding a NaN). ks and vs are read up to round_up(nk, 16)
// (zeros past nk). Against the transposed tile (keys x rows), whose 16 lanes
// hold the 4 or 8 rows, this needs no transpose, and its exponentials,
// scalings and roundings shrink by the rows' share of the lanes.
template <Pairs kP>
inline void softmax_rows(float* s, int64_t ld, int64_t rows, int64_t nk, const float* ks, const float* vs,
                         float* row_max, float* row_sum, float* alpha, float* p_scale) {
  const int64_t n16 = round_up(nk, 16);
  for (int64_t i = 0; i < rows; ++i) {
    float* r = s + i * ld;
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n16; j += 16) {
      const __mmask16 live = j + 16 <= nk ? __mmask16(0xFFFF) : __mmask16((1u << (nk - j)) - 1);
      const __m512 x = _mm512_loadu_ps(r + j);
      const __m512 y = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), live, x,
                                          ks != nullptr ? _mm512_loadu_ps(ks + j) : _mm512_set1_ps(1.0f));
      _mm512_storeu_ps(r + j, y);
      m = _mm512_max_ps(m, y);
    }
    const float new_max = std::max(row_max[i], _mm512_reduce_max_ps(m));
    // a row with no visible key so far keeps shift 0, so exp(-inf - shift) = 0
    const float shift = new_max == -INFINITY ? 0.0f : new_max;
    const float a = _mm256_cvtss_f32(exp_fast(_mm256_set1_ps(row_max[i] - shift)));
    const __m256 sh = _mm256_set1_ps(shift);
    __m256 sum = _mm256_setzero_ps(), top = _mm256_setzero_ps();  // P diag(vs) >= 0: its max from 0
    __mmask8 nan = 0;
    for (int64_t j = 0; j < n16; j += 8) {
      const __m256 p = exp_fast(_mm256_sub_ps(_mm256_loadu_ps(r + j), sh));
      sum = _mm256_add_ps(sum, p);
      const __m256 y = vs != nullptr ? _mm256_mul_ps(p, _mm256_loadu_ps(vs + j)) : p;
      if constexpr (kP == Pairs::kInt16) {
        nan |= _mm256_cmp_ps_mask(y, y, _CMP_UNORD_Q);
        top = _mm256_max_ps(top, y);
      }
      _mm256_storeu_ps(r + j, y);
    }
    row_sum[i] = row_sum[i] * a + _mm512_reduce_add_ps(_mm512_zextps256_ps512(sum));
    row_max[i] = new_max;
    alpha[i] = a;
    // words [j / 2, j / 2 + 8) lie at or before floats [j, j + 16), already read
    __m256i* words = reinterpret_cast<__m256i*>(r);
    if constexpr (kP == Pairs::kInt16) {
      const float largest = _mm512_reduce_max_ps(_mm512_zextps256_ps512(top));
      const bool usable = nan == 0 && largest > 0.0f && largest < INFINITY;
      p_scale[i] = nan != 0 ? NAN : largest * (1.0f / 32767.0f);
      const __m512 inv = _mm512_set1_ps(usable ? 32767.0f / largest : 0.0f);
      for (int64_t j = 0; j < n16; j += 16) {
        _mm256_storeu_si256(words + j / 16, _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(r + j), inv))));
      }
    } else {
      for (int64_t j = 0; j < n16; j += 16) {
        _mm256_storeu_si256(words + j / 16, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(r + j)));
      }
    }
  }
}
#endif

// One task of the forward: the output rows (normalized) and log-sum-exp of the
// tile of positions [p0, p0 + npos) of kv head g in batch b, over its key
// tiles split, split + splits, ... A prefill tile (more than kNarrowRows rows)
// computes its scores transposed (keys x rows) on the micro-GEMMs; a decoding
// tile (a step's few heads of one kv head) scores with the keys along the
// lanes, reading K (and V) where they lie (decode_scores, decode_values).
//
// bfloat16 on vdpbf16ps where the variant has it: Q^T as pair words (the
// scale applied to the products), K as pair words along its rows, P and V
// packed per tile (attention_pair_words.h). int8 / float8 K/V: their codes as
// bfloat16 (exact), the key scales applied to the scores and the value scales
// to the probabilities; float32 tiles dequantize as they load. Decoding over
// int8 K (V): the codes as int16 on vpdpwssd instead, against Q (P) rounded to
// int16 with one scale per row (per row and tile): the codes widen in one
// instruction where bfloat16 takes five, and the rounding (2^-16 of the row's
// largest value) is finer than bfloat16's. Decoding tiles read K and V as
// they lie, widened in registers: the scores summed across lanes
// (scores_along_keys), V's rows interleaved into pair words inside the
// product (RowsB); packing them cost more (stores, reloads, K's 16 x 16
// transposes) than the products themselves.
template <typename T, bool kDecoding>
struct ForwardTask {
  using acc_t = typename VecIO<T>::acc_t;
  static constexpr bool kPairs = kPairProducts<T>;
  // float16 prefill tiles' products on the AMX tiles as bfloat16 high and
  // low parts (split_row): Q's parts staged once a task, K's split per tile,
  // V's once a call (or per tile), P's packed from the tile.
  static constexpr bool kSplit = kSplitProducts<T>;
  // float32 products of a decoding tile (float32, or 16-bit without
  // vdpbf16ps): the scores along the keys too (FloatKeyLanes), against the
  // scaled Q rows in kbuf (K is read where it lies), then transposed into
  // the tile the rest of the float32 path reads. Q's rows in the lanes
  // (rows x keys as keys x rows) used 4 or 8 of 16 (8) lanes.
  static constexpr bool kFloatLanes = kFloatKeyLanes<T>;
  // A decoding task (at most kNarrowRows rows, on the pair or float lanes:
  // DecodeTask) or a prefill task (PrefillTask): each instantiation compiles
  // only its own steps.
  static constexpr bool decoding = kDecoding;
  static_assert(!kDecoding || kPairs || kFloatLanes, "decoding tiles run on the pair or float lanes");

  // The next key tile's rows, asked for in kPrefetchParts pieces spread over
  // this tile's work (all at once, the requests fill the core's miss queue
  // and the prefetches wait on memory; measured).
  struct NextTile {
    const KvRows<T>& k;
    const KvRows<T>& v;
    int64_t start, count, d;  // count 0: no next tile
    bool enabled;
    void part(int i) const {
      if (count == 0 || !enabled) return;
      const int64_t from = count * i / kPrefetchParts, to = count * (i + 1) / kPrefetchParts;
      k.prefetch(start + from, to - from, d);
      v.prefetch(start + from, to - from, d);
    }
  };

  const AttentionForwardArgs& a;
  const Tiling<acc_t>& t;
  const ForwardScratch<acc_t> w;
  const int64_t b, g, p0, npos;
  const T* q;
  const KvRows<T> k, v;
  const Mask mask;
  const int64_t d, d_pad, group, rows, ld;
  const acc_t scale;
  const int64_t sr_ld;  // of the rows x keys scores of a decoding tile in w.sr
  bool int_k = false, int_v = false;  // decoding over int8 codes on int16 pairs
  bool amx = false;  // a prefill tile's products on the AMX tiles (the AMX variant)
  const uint32_t* v_words;  // the pair's V across keys, packed once a call (or null)
  bool scale_in_softmax = false;  // S^T left unscaled, softmax_tile<kScaled> applies the scale
  bool packed_in_softmax = false;  // P's pair words written by softmax_rows_amx, not s

  ForwardTask(const AttentionForwardArgs& a, const Tiling<acc_t>& t, ForwardScratch<acc_t> w, int64_t b,
              int64_t g, int64_t p0, int64_t npos, const uint32_t* v_words)
      : a(a), t(t), w(w), b(b), g(g), p0(p0), npos(npos), v_words(v_words),
        q(static_cast<const T*>(a.q.data) + b * a.q.batch_stride + a.seqs.q_start(b) * a.q.seq_stride),
        k(a.k, a.k_scale, a.pages, b, g, a.seqs.k_start(b)),
        v(a.v, a.v_scale, a.pages, b, g, a.seqs.k_start(b)),
        mask(a.mask.of_lengths(a.seqs.q_len(b), a.seqs.k_len(b))),
        d(t.d), d_pad(t.d_pad), group(t.group), rows(npos * t.group),
        ld(round_up(rows, Vectorized<acc_t>::size())), scale(static_cast<acc_t>(a.scale)),
        sr_ld(round_up(t.block_k, 16)) {
#if defined(__AVX512BF16__)
    if constexpr (kPairs) {
      int_k = decoding && k.quantized() && !k.float8;
      int_v = decoding && v.quantized() && !v.float8;
    }
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    // Whole tiles of 32 head dims (16 pair words) and key tiles of whole
    // 16-row tiles (P's row-major pair words go where K's were: kbuf_words):
    // other shapes stay on vdpbf16ps.
    if constexpr (kPairs) {
      amx = !decoding && d % 32 == 0 && t.block_k % 32 == 0;
      // nothing reads the scores between the product and the softmax but the
      // masks' -inf, which a positive scale keeps
      scale_in_softmax = amx && !k.quantized() && scale_can_wait(a);
      // and nothing changes P between the softmax and P V
      packed_in_softmax = scale_in_softmax && !a.dropout.enabled && !v.quantized();
    }
    if constexpr (kSplit) {
      amx = !decoding && d % 32 == 0 && t.block_k % 32 == 0 && !k.quantized() && !v.quantized();
      scale_in_softmax = amx && scale_can_wait(a);
    }
#endif
  }

  void run(int64_t split, int64_t splits) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    TileConfig tiles_before;
    if (amx) tiles_before = configure_tiles();
#endif
    stage_queries();
    std::fill(w.o, w.o + ld * d_pad, acc_t(0));
    std::fill(w.row_max, w.row_max + ld, kNegInf<acc_t>);
    std::fill(w.row_sum, w.row_sum + ld, acc_t(0));
    // S's rows past `rows` stay zero
    if constexpr (decoding) std::fill(w.sr + rows * sr_ld, w.sr + ld * sr_ld, acc_t(0));
    const KeyTiles tiles(mask, p0, p0 + npos, t.block_k, false);
    const bool prefetch = !amx && (decoding || kPairs);  // see kPrefetchParts
    for (int64_t i = split; i < tiles.count; i += splits) {
      const int64_t j0 = tiles.start(i), nk = tiles.stop(i) - j0;
      const bool last = i + splits >= tiles.count;
      const NextTile next{k, v, last ? 0 : tiles.start(i + splits),
                          last ? 0 : tiles.stop(i + splits) - tiles.start(i + splits), d, prefetch};
      next.part(0);
      if constexpr (decoding) {
        if (decode_scores(j0, nk, next)) continue;  // the whole tile done on the rows x keys scores
      } else {
        prefill_scores(j0, nk, next);
      }
      next.part(2);
      probabilities(j0, nk);
      next.part(3);
      if constexpr (decoding) {
        decode_values(j0, nk, next);
      } else {
        prefill_values(j0, nk, next);
      }
    }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx) release_tiles(tiles_before);
#endif
  }

  void finish(acc_t* o_out, int64_t o_ld, acc_t* lse_out) const {
    for (int64_t i = 0; i < rows; ++i) {
      const acc_t lse = attn::row_lse(w.row_max[i], w.row_sum[i]);
      const acc_t norm = attn::row_norm(w.row_max[i], w.row_sum[i], lse);
      const acc_t* src = w.o + i * d_pad;
      acc_t* dst = o_out + i * o_ld;
      for (int64_t c = 0; c < d; ++c) dst[c] = src[c] * norm;
      lse_out[i] = lse;
    }
  }

 private:
  // Keys [0, half) and [half, nk) of a decoding tile are worked in two parts
  // with a prefetch between (half even).
  static int64_t half_of(int64_t nk) { return std::min(nk, round_up(ceil_div(nk, 2), 16)); }
#if defined(__AVX512BF16__)
  const T* q_row(int64_t i) const { return t.row_in(q, a.q.head_stride, a.q.seq_stride, g, p0, i); }
  uint32_t* q_words() const { return reinterpret_cast<uint32_t*>(w.qt); }
#endif

  void stage_queries() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if constexpr (kSplit) {
      if (amx) return stage_split_queries();
    }
#endif
    if constexpr (kPairs) {
#if defined(__AVX512BF16__)
      const int64_t dp = (d + 1) / 2;
      if constexpr (decoding) {  // Q as pair words along its rows
        for (int64_t i = 0; i < rows; ++i) {
          if (int_k) {
            w.q_scale[i] = pack_row_int16(q_row(i), d, q_words() + i * dp);
          } else {
            pack_rows_along(q_row(i), 0, 1, d, q_words() + i * dp, dp);
          }
        }
      } else {
        pack_rows_transposed([&](int64_t i) { return q_row(i); }, rows, ld, d, q_words());
      }
#endif
    } else if constexpr (decoding) {  // rows of Q * scale, in kbuf
      gather_rows(q, a.q.head_stride, a.q.seq_stride, t, g, p0, rows, scale, w.kbuf);
    } else {  // (Q * scale)^T, staged row-major in the output buffer first
      gather_both(q, a.q.head_stride, a.q.seq_stride, t, g, p0, rows, ld, scale, w.o, w.qt);
    }
  }

  // S^T = K (Q * scale)^T, keys x rows.
  void prefill_scores(int64_t j0, int64_t nk, const NextTile& next) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if constexpr (kSplit) {
      if (amx) return split_scores(j0, nk);
    }
#endif
    if constexpr (kPairs) {
#if defined(__AVX512BF16__)
      const int64_t dp = (d + 1) / 2;
      uint32_t* const kp = reinterpret_cast<uint32_t*>(w.kbuf);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if (amx && !k.quantized() && k_in_one_run(j0, nk)) return;
#endif
      k.with_rows(j0, nk, [&](const auto& row) {
        k.runs(j0, nk, [&](int64_t i, int64_t n) { pack_rows_along(row(i), k.seq_stride, n, d, kp + i * dp, dp); });
      });
      next.part(1);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if (amx) {  // rows [nk, round_up(nk, 16)) of S^T are computed from stale kbuf rows, never read
        gemm_amx<false>(round_up(nk, 16), ld, dp, kp, dp, q_words(), ld, w.s, ld);
        if (!scale_in_softmax) scale_tile(w.s, ld, nk, scale);
      } else
#endif
      gemm_pairs<ALayout::kRowMajor, false>(nk, ld, dp, kp, dp, q_words(), ld, w.s, ld, nullptr, scale);
      if (k.quantized()) k.scale_rows(w.s, ld, j0, nk);
#endif
    } else {
      int64_t k_ld;
      const acc_t* kp = k.in_place(j0, nk, d, d_pad, k_ld);
      if (kp == nullptr) kp = k.tile(j0, nk, d, d_pad, w.kbuf, k_ld);
      next.part(1);
      gemm<acc_t, ALayout::kRowMajor, false>(nk, ld, d, kp, k_ld, w.qt, ld, w.s, ld);
    }
  }

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  // Q's rows split into bfloat16 rows in w.o (free until the first tile),
  // then each part's Q^T as pair words: the high parts' at q_words(), the
  // low parts' d / 2 * ld words on.
  void stage_split_queries() {
    auto* hi = reinterpret_cast<c10::BFloat16*>(w.o);
    c10::BFloat16* lo = hi + rows * d;
    split_rows([&](int64_t i) { return q_row(i); }, rows, d, hi, lo);
    pack_rows_transposed([&](int64_t i) { return hi + i * d; }, rows, ld, d, q_words());
    pack_rows_transposed([&](int64_t i) { return lo + i * d; }, rows, ld, d, q_words() + d / 2 * ld);
  }

  // S^T = K Q^T of float16 operands, each product as three of their parts'.
  void split_scores(int64_t j0, int64_t nk) {
    const int64_t n16 = round_up(nk, 16), dp = d / 2;
    auto* hi = reinterpret_cast<c10::BFloat16*>(w.kbuf);
    c10::BFloat16* lo = hi + n16 * d;
    k.with_rows(j0, nk, [&](const auto& row) {
      if constexpr (std::is_same_v<decltype(row(0)), const T*>) split_rows(row, nk, d, hi, lo);
    });
    const auto* kh = reinterpret_cast<const uint32_t*>(hi);
    const auto* kl = reinterpret_cast<const uint32_t*>(lo);
    const uint32_t* qh = q_words();
    const uint32_t* ql = qh + dp * ld;
    // rows [nk, n16) of S^T come from stale rows of kbuf, never read as scores
    gemm_amx<false, 3>(n16, ld, dp, {kh, kl, kh}, dp, {qh, qh, ql}, ld, w.s, ld);
    if (!scale_in_softmax) scale_tile(w.s, ld, nk, scale);
  }

  // O = diag(alpha) O + P V of float16 V, each product as three of the
  // parts' of P and V.
  void split_values(int64_t j0, int64_t nk) {
    const int64_t np = (nk + 1) / 2, np16 = round_up(np, 16);
    const uint32_t *vh, *vl;
    if (v_words != nullptr && tile_in_sequence_pairs(j0, nk)) {
      vh = v_words + j0 / 2 * d_pad;
      vl = vh + values_pair_words(t);
    } else {
      uint32_t* const h = reinterpret_cast<uint32_t*>(w.vbuf);
      uint32_t* const l = h + np16 * d_pad;
      v.with_rows(j0, nk, [&](const auto& row) {
        if constexpr (std::is_same_v<decltype(row(0)), const T*>) pack_split_rows_across(row, nk, d, h, l, d_pad);
      });
      std::fill(h + np * d_pad, h + np16 * d_pad, 0u);
      std::fill(l + np * d_pad, l + np16 * d_pad, 0u);
      vh = h;
      vl = l;
    }
    uint32_t* const ph = reinterpret_cast<uint32_t*>(w.kbuf);  // K's words are spent
    uint32_t* const pl = reinterpret_cast<uint32_t*>(w.p_low);
    pack_tile_rows_amx(w.s, ld, nk, ph, np16);
    pack_tile_rows_amx<true>(w.s, ld, nk, pl, np16);
    scale_rows_by(w.o, d_pad, ld, d_pad, w.alpha);
    gemm_amx<true, 3>(ld, d_pad, np16, {ph, ph, pl}, np16, {vh, vl, vh}, d_pad, w.o, d_pad);
  }

  // S^T = K Q^T on the tiles where the tile's rows are one run seq_stride
  // apart (K's whole 16-row blocks read where they lie where they can be,
  // rows_times_amx); false (nothing done) where they are not (pages).
  bool k_in_one_run(int64_t j0, int64_t nk) {
    bool done = false;
    k.with_rows(j0, nk, [&](const auto& row) {
      if constexpr (std::is_same_v<decltype(row(0)), const T*>) {
        if (row(nk - 1) != row(0) + (nk - 1) * k.seq_stride) return;
        rows_times_amx(row(0), k.seq_stride, nk, d / 2, q_words(), ld, w.s, reinterpret_cast<uint32_t*>(w.kbuf));
        if (!scale_in_softmax) scale_tile(w.s, ld, nk, scale);
        done = true;
      }
    });
    return done;
  }
#endif

  // The scores of a decoding tile, K read where it lies: S = Q K^T (rows x
  // keys) in w.sr, transposed into w.s as the prefill path leaves them. With
  // nothing between the scores and the softmax, the pair path runs the whole
  // tile on the rows x keys scores instead and returns true.
  bool decode_scores(int64_t j0, int64_t nk, const NextTile& next) {
    if constexpr (kPairs) {
#if defined(__AVX512BF16__)
      const int64_t dp = (d + 1) / 2, half = half_of(nk);
      k.with_rows(j0, nk, [&](const auto& row) {
        for (const auto [from, to] : {std::pair<int64_t, int64_t>{0, half}, {half, nk}}) {
          const auto key = [&](int64_t j) { return row(from + j); };
          if constexpr (kInt8Rows<decltype(row(0))>) {  // int_k
            scores_along_keys<KeyLanes<Pairs::kInt16>>(key, to - from, d, q_words(), dp, rows, w.sr + from, sr_ld,
                                                       scale, w.q_scale);
          } else {
            scores_along_keys<KeyLanes<Pairs::kBf16>>(key, to - from, d, q_words(), dp, rows, w.sr + from, sr_ld,
                                                      scale, nullptr);
          }
          if (from == 0) next.part(1);
        }
      });
      const bool plain_scores = !a.mods.any_score_mod() && !a.tensor_mask.present() && !a.dropout.enabled;
      if (plain_scores && tile_fully_visible(mask, p0, p0 + npos, j0, nk)) {
        float* const ks = k.quantized() ? w.s : nullptr;
        float* const vs = v.quantized() ? w.s + sr_ld : nullptr;
        if (ks != nullptr) k.gather_scales(j0, nk, sr_ld, ks);
        if (vs != nullptr) v.gather_scales(j0, nk, sr_ld, vs);
        next.part(2);
        if (int_v) {
          softmax_rows<Pairs::kInt16>(w.sr, sr_ld, rows, nk, ks, vs, w.row_max, w.row_sum, w.alpha, w.p_scale);
        } else {
          softmax_rows<Pairs::kBf16>(w.sr, sr_ld, rows, nk, ks, vs, w.row_max, w.row_sum, w.alpha, nullptr);
        }
        next.part(3);
        values_on_pairs<ALayout::kRowMajor>(reinterpret_cast<const uint32_t*>(w.sr), sr_ld, j0, nk, next);
        return true;
      }
      transpose_16_rows(w.sr, sr_ld, nk, w.s);
      if (k.quantized()) k.scale_rows(w.s, ld, j0, nk);
#endif
    } else if constexpr (kFloatLanes) {
#if defined(__AVX2__)
      const int64_t half = half_of(nk);
      k.with_rows(j0, nk, [&](const auto& row) {
        for (const auto [from, to] : {std::pair<int64_t, int64_t>{0, half}, {half, nk}}) {
          const auto key = [&](int64_t j) { return row(from + j); };
          scores_along_keys<FloatKeyLanes>(key, to - from, d, w.kbuf, d_pad, rows, w.sr + from, sr_ld, 1.0f,
                                           nullptr);
          if (from == 0) next.part(1);
        }
      });
#if defined(__AVX512F__)
      transpose_16_rows(w.sr, sr_ld, nk, w.s);
#else
      transpose(w.sr, sr_ld, ld, round_up(nk, ld), w.s, ld);
#endif
      if (k.quantized()) k.scale_rows(w.s, ld, j0, nk);  // the codes' products times their scales
#endif
    }
    return false;
  }

  // Score mods, masks, the online softmax step and dropout on the transposed
  // tile: w.s becomes P, w.alpha the rescale of the output rows.
  void probabilities(int64_t j0, int64_t nk) {
    const TileRows tile{b, g, group, p0, npos, j0, nk};
    if (a.mods.any_score_mod()) apply_score_mods<acc_t>(w.s, ld, tile, a.mods, mask.offset, nullptr, w.cols);
    if (!tile_fully_visible(mask, p0, p0 + npos, j0, nk)) mask_tile(w.s, ld, nk, j0, p0, npos, group, mask);
    apply_tensor_mask(w.s, ld, tile, a.tensor_mask);
    // The row sums (and so the lse) are those of the probabilities before dropout.
    bool eight = false;  // a decoding tile's rows on 8 lanes
#if defined(__AVX512BF16__)
    if constexpr (kPairs) {
      if constexpr (decoding) softmax_tile_8(w.s, ld, nk, w.row_max, w.row_sum, w.alpha);
      eight = decoding;
    }
#endif
    if (packed_in_softmax) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      // into kbuf (K's pair words are spent), as prefill_values reads them
      if constexpr (kPairs) {
        softmax_rows_amx(w.s, ld, nk, w.row_max, w.row_sum, w.alpha, scale, reinterpret_cast<uint32_t*>(w.kbuf),
                         round_up(ceil_div(nk, 2), 16));
      }
#endif
    } else if (scale_in_softmax) {
      softmax_tile<acc_t, true>(w.s, ld, nk, w.row_max, w.row_sum, w.alpha, scale);
    } else if (!eight) {
      softmax_tile(w.s, ld, nk, w.row_max, w.row_sum, w.alpha);
    }
    if (a.dropout.enabled) {
      // P = P z in place, z = 1 / (1 - p) where kept, else 0.
      const acc_t kept = static_cast<acc_t>(a.dropout.scale);
      for_each_dropout_draw(tile, t.query_rows, t.sk, a.dropout, [&](int64_t j, int64_t col, bool keep) {
        acc_t& p = w.s[j * ld + col];
        p = keep ? p * kept : acc_t(0);
      });
    }
  }

  // O = diag(alpha) O + P V, P read column-major out of the transposed tile.
  void prefill_values(int64_t j0, int64_t nk, const NextTile& next) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if constexpr (kSplit) {
      if (amx) return split_values(j0, nk);
    }
#endif
    if constexpr (kPairs) {
#if defined(__AVX512BF16__)
      if (v.quantized()) v.scale_rows(w.s, ld, j0, nk);  // P diag(v_scale) V8 = P V
      uint32_t* const vp = reinterpret_cast<uint32_t*>(w.vbuf);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      // the call's V across keys where the tile reads them there
      const bool packed = amx && v_words != nullptr && tile_in_sequence_pairs(j0, nk);
#else
      const bool packed = false;
#endif
      if (!packed) v.with_rows(j0, nk, [&](const auto& row) { pack_rows_across(row, nk, d, vp, d_pad); });
      next.part(4);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if (amx) {  // O = diag(alpha) O, then O += P V over whole 16-word tiles, zero past the keys
        const int64_t np = (nk + 1) / 2, np16 = round_up(np, 16);
        if (!packed) std::fill(vp + np * d_pad, vp + np16 * d_pad, 0u);
        uint32_t* const pr = reinterpret_cast<uint32_t*>(w.kbuf);  // K's pair words are spent
        if (!packed_in_softmax) pack_tile_rows_amx(w.s, ld, nk, pr, np16);
        scale_rows_by(w.o, d_pad, ld, d_pad, w.alpha);
        gemm_amx<true>(ld, d_pad, np16, pr, np16, packed ? v_words + j0 / 2 * d_pad : vp, d_pad, w.o, d_pad);
        return;
      }
#endif
      const uint32_t* pp = pack_tile_pairs(w.s, ld, nk, reinterpret_cast<uint32_t*>(w.s));
      gemm_pairs<ALayout::kColMajor, true>(rows, d_pad, (nk + 1) / 2, pp, ld, vp, d_pad, w.o, d_pad, w.alpha);
#endif
    } else {
      int64_t v_ld;
      const acc_t* vp = v.in_place(j0, nk, d, d_pad, v_ld);
      if (vp == nullptr) vp = v.tile(j0, nk, d, d_pad, w.vbuf, v_ld);
      next.part(4);
      gemm<acc_t, ALayout::kColMajor, true>(rows, d_pad, nk, w.s, ld, vp, v_ld, w.o, d_pad, w.alpha);
    }
  }

  void decode_values(int64_t j0, int64_t nk, const NextTile& next) {
    if constexpr (kPairs) {
#if defined(__AVX512BF16__)
      if (v.quantized()) v.scale_rows(w.s, ld, j0, nk);  // P diag(v_scale) V8 = P V
      uint32_t* const words = reinterpret_cast<uint32_t*>(w.s);
      values_on_pairs<ALayout::kColMajor>(
          int_v ? pack_tile_pairs_int16(w.s, ld, nk, words, w.p_scale) : pack_tile_pairs(w.s, ld, nk, words), ld,
          j0, nk, next);
#endif
    } else {
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, float>) {
        // V's rows as they lie, run by run, at head dims of one or two
        // column panels of the micro-kernel. Measured on a Zen 4 against the
        // tile copy: 1.1-1.15x as fast at head dims 32 and 64 (up to 8k
        // keys, batch 4); at 128, faster on cached tiles but up to 1.2x
        // slower in some runs over 8k keys at batch 4 (each row is read in
        // four column panels).
        if (!v.quantized() && d == d_pad && d <= 64) {
          next.part(4);
          v.with_rows(j0, nk, [&](const auto& row) {
            if constexpr (std::is_same_v<decltype(row(0)), const T*>) {
              v.runs(j0, nk, [&](int64_t i, int64_t n) {
                gemm<acc_t, ALayout::kColMajor, true>(rows, d_pad, n, w.s + i * ld, ld, row(i), v.seq_stride, w.o,
                                                      d_pad, i == 0 ? w.alpha : nullptr);
              });
            }
          });
          return;
        }
      }
#endif
      // V streamed from memory once, its copy then serving the micro-kernel's
      // column panels from L1 (V read in place there was up to 1.2x slower
      // at head dim 128, above)
      int64_t v_ld;
      const acc_t* vp = v.tile(j0, nk, d, d_pad, w.vbuf, v_ld);
      next.part(4);
      gemm<acc_t, ALayout::kColMajor, true>(rows, d_pad, nk, w.s, ld, vp, v_ld, w.o, d_pad, w.alpha);
    }
  }

#if defined(__AVX512BF16__)
  // O = diag(alpha) O + P V on a decoding tile, V's rows read as they lie
  // (P's pair words row-major in pp, or column-major out of the transposed
  // tile): keys [0, half), a prefetch, then keys [half, nk).
  template <ALayout kA>
  void values_on_pairs(const uint32_t* pp, int64_t lda, int64_t j0, int64_t nk, const NextTile& next) {
    const int64_t half = half_of(nk);
    v.with_rows(j0, nk, [&](const auto& row) {
      for (const auto [from, to] : {std::pair<int64_t, int64_t>{0, half}, {half, nk}}) {
        const auto part = [&](int64_t j) { return row(from + j); };
        using Part = std::decay_t<decltype(part)>;
        const uint32_t* pa = kA == ALayout::kRowMajor ? pp + from / 2 : pp + from / 2 * lda;
        const float* alpha = from == 0 ? w.alpha : nullptr;  // O rescaled once
        if constexpr (kInt8Rows<decltype(row(0))>) {  // int_v: P in int16, one scale per row
          gemm_pairs<kA, true, Pairs::kInt16>(rows, d_pad, (to - from + 1) / 2, pa, lda,
                                              RowsB<Pairs::kInt16, Part>(part, to - from, d), w.o, d_pad, alpha,
                                              1.0f, w.p_scale);
        } else {
          gemm_pairs<kA, true>(rows, d_pad, (to - from + 1) / 2, pa, lda, RowsB<Pairs::kBf16, Part>(part, to - from, d),
                               w.o, d_pad, alpha);
        }
        if (from == 0) next.part(4);
      }
    });
  }
#endif
};

template <typename T>
using PrefillTask = ForwardTask<T, false>;
template <typename T>
using DecodeTask = ForwardTask<T, true>;

template <typename T>
struct ForwardKernel {
  using acc_t = typename VecIO<T>::acc_t;

  // A block of query rows over its key tiles: a decoding task where the
  // rows fit the narrow lanes, else a prefill task.
  static void task(const AttentionForwardArgs& a, const Tiling<acc_t>& t, ForwardScratch<acc_t> w,
                   int64_t b, int64_t g, int64_t p0, int64_t npos, int64_t split, int64_t splits,
                   acc_t* o_out, int64_t o_ld, acc_t* lse_out, const uint32_t* v_words) {
    if constexpr (kPairProducts<T> || kFloatKeyLanes<T>) {
      if (npos * t.group <= kNarrowRows) {
        DecodeTask<T> task(a, t, w, b, g, p0, npos, v_words);
        task.run(split, splits);
        return task.finish(o_out, o_ld, lse_out);
      }
    }
    PrefillTask<T> task(a, t, w, b, g, p0, npos, v_words);
    task.run(split, splits);
    task.finish(o_out, o_ld, lse_out);
  }

  // Every pair's V across keys (pack_rows_across, a block_k of keys at a
  // time: pairs line up as the tiles' where those start at even keys);
  // float16's parts (pack_split_rows_across).
  static void pack_values(const AttentionForwardArgs& a, const ForwardPlan<acc_t>& p, uint32_t* words) {
    if constexpr (kPairProducts<T> || kSplitProducts<T>) {
      const Tiling<acc_t>& t = p.t;
      at::parallel_for(0, p.pairs, 1, [&](int64_t begin, int64_t end) {
        for (int64_t pair = begin; pair < end; ++pair) {
          const int64_t b = pair / t.kv_heads, g = pair % t.kv_heads, n = a.seqs.k_len(b);
          const KvRows<T> v(a.v, a.v_scale, a.pages, b, g, a.seqs.k_start(b));
          uint32_t* const dst = words + pair * p.v_pair_words;
          for (int64_t j0 = 0; j0 < n; j0 += t.block_k) {
            const int64_t nk = std::min(t.block_k, n - j0);
            uint32_t* at = dst + j0 / 2 * t.d_pad;
            v.with_rows(j0, nk, [&](const auto& row) {
              if constexpr (kPairProducts<T>) {
                pack_rows_across(row, nk, t.d, at, t.d_pad);
              } else if constexpr (std::is_same_v<decltype(row(0)), const T*>) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
                pack_split_rows_across(row, nk, t.d, at, at + values_pair_words(t), t.d_pad);
#endif
              }
            });
          }
        }
      });
    }
  }

  static ForwardPlan<acc_t> plan(const AttentionForwardArgs& a) {
    return ForwardPlan<acc_t>(a, decoding_keys_per_tile<T>(a), prefill_keys_per_tile<T>(a), kSplitProducts<T>);
  }

  static AttentionWorkspace workspace(const AttentionForwardArgs& a) {
    return measure<ForwardWorkspace<acc_t>>(plan(a));
  }

  static void run(const AttentionForwardArgs& a) {
    const ForwardPlan<acc_t> p = plan(a);
    const auto ws = place<ForwardWorkspace<acc_t>>(a.workspace, measure<ForwardWorkspace<acc_t>>(p), p);
    const Tiling<acc_t>& t = p.t;
    const int64_t pairs = p.pairs, splits = p.splits;
    acc_t* po = ws.partial_o;
    acc_t* pl = ws.partial_lse;
    if (ws.v_words != nullptr) pack_values(a, p, ws.v_words);

    run_tasks(p.n_tasks, p.slots, [&](int64_t index, int64_t slot) {
      // Latest query tiles first: under a causal mask they see the most keys.
      const int64_t split = index % splits;
      const int64_t rest = index / splits;
      const int64_t pair = rest % pairs;
      const int64_t qt = t.q_tiles - 1 - rest / pairs;
      const int64_t b = pair / t.kv_heads, g = pair % t.kv_heads;
      const int64_t p0 = qt * t.block_q;
      const int64_t npos = std::min(t.block_q, a.seqs.q_len(b) - p0);
      if (npos <= 0) return;  // past a packed sequence's end
      const int64_t rows = npos * t.group;
      const ForwardScratch<acc_t> w = ws.slot(t, slot);
      acc_t* o_rows = ws.rows + slot * ws.rows_stride;
      acc_t* lse_rows = o_rows + t.rows_pad * t.d_pad;
      task(a, t, w, b, g, p0, npos, split, splits, o_rows, t.d_pad, lse_rows,
           ws.v_words != nullptr ? ws.v_words + pair * p.v_pair_words : nullptr);
      // Scatter the (position, head) rows to [B, Hq, Sq, ...].
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t row = t.row_of(b, g, p0, i);
        if (splits == 1) {
          acc_t lse = lse_rows[i], factor = 1;
          if (a.mods.sinks != nullptr) factor = attn::fold_sink(lse, a.mods.sink<acc_t>(t.head_of(g, i)));
          store_row<T>(o_rows + i * t.d_pad, t.d, factor, static_cast<T*>(a.out) + row * t.d);
          static_cast<acc_t*>(a.lse)[row] = lse;
        } else {
          const int64_t prow = split * p.n_rows + row;
          std::memcpy(po + prow * t.d_pad, o_rows + i * t.d_pad, sizeof(acc_t) * t.d);
          pl[prow] = lse_rows[i];
        }
      }
    });
    if (splits == 1) return;

    // Merge the splits of each row in split order.
    const int64_t n_rows = p.n_rows;
    at::parallel_for(0, n_rows, std::max<int64_t>(1, 4096 / t.d_pad), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> acc(t.d_pad);
      for (int64_t row = begin; row < end; ++row) {
        acc_t m = kNegInf<acc_t>;
        bool nan = false;  // std::max would drop it: a NaN row stays NaN, as without splits
        for (int64_t s = 0; s < splits; ++s) {
          nan |= std::isnan(pl[s * n_rows + row]);
          m = std::max(m, pl[s * n_rows + row]);
        }
        acc_t total = kNegInf<acc_t>;
        if (nan) {
          total = std::numeric_limits<acc_t>::quiet_NaN();
        } else if (m != kNegInf<acc_t>) {
          acc_t sum = 0;
          for (int64_t s = 0; s < splits; ++s) sum += std::exp(pl[s * n_rows + row] - m);
          total = m + std::log(sum);
        }
        std::fill(acc.begin(), acc.end(), acc_t(0));
        for (int64_t s = 0; s < splits; ++s) {
          // A split that saw no key holds zeros, one whose sums were NaN
          // NaNs (its lse -inf either way): added as they are.
          const acc_t lse = pl[s * n_rows + row];
          const acc_t wgt = lse == kNegInf<acc_t> ? acc_t(1) : attn::merge_weight(lse, total);
          const acc_t* src = po + (s * n_rows + row) * t.d_pad;
          for (int64_t c = 0; c < t.d; ++c) acc[c] += wgt * src[c];
        }
        acc_t factor = 1;
        if (a.mods.sinks != nullptr) factor = attn::fold_sink(total, a.mods.sink<acc_t>(t.query_rows.head(row)));
        store_row<T>(acc.data(), t.d, factor, static_cast<T*>(a.out) + row * t.d);
        static_cast<acc_t*>(a.lse)[row] = total;
      }
    });
  }
};

void attention_forward(const AttentionForwardArgs& a) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.dtype, "fusedllm_attention_cpu", [&] {
    ForwardKernel<scalar_t>::run(a);
  });
}

AttentionWorkspace attention_forward_workspace(const AttentionForwardArgs& a) {
  AttentionWorkspace w;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.dtype, "fusedllm_attention_cpu", [&] {
    w = ForwardKernel<scalar_t>::workspace(a);
  });
  return w;
}

int64_t attention_forward_head_dim(const AttentionForwardArgs& a) {
  return amx_head_dim(a, a.k_scale.data != nullptr || a.v_scale.data != nullptr || a.pages.paged());
}

constexpr AttentionForwardKernel kForward{&attention_forward_workspace, &attention_forward,
                                          &attention_forward_head_dim};

}  // namespace
}  // namespace flash

FUSEDLLM_REGISTER_CPU_KERNEL(attention_forward_kernels, &flash::kForward);

}  // namespace CPU_CAPABILITY
}  // namespace fusedllm::cpu
