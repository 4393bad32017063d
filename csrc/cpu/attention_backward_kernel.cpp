// Flash attention backward on CPU, compiled once per instruction set (see
// CMakeLists.txt; the layout of the work is described in attention_kernel.h).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
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

// Per-slot scratch of the backward pass; key_words: room for a sequence's K
// across keys (BackwardPlan::key_words). split (float16 on the AMX tiles):
// parts, a query tile's rows split into bfloat16 parts (stage_split_rows).
template <typename acc_t>
struct BackwardScratch {
  acc_t *qt, *dot, *ot, *qs, *dor, *orows, *q_along, *dq, *s, *sr, *dp, *kbuf, *vbuf, *shift, *delta, *z,
      *cap_slope, *cols, *edge, *parts, *k_keys;
  BackwardScratch(const Tiling<acc_t>& t, int64_t key_words, bool split, Arena& m)
      : qt(m.take<acc_t>(t.d * t.rows_pad)),
        dot(m.take<acc_t>(t.d * t.rows_pad)),
        ot(m.take<acc_t>(t.d_pad * t.rows_pad)),
        qs(m.take<acc_t>(t.rows_pad * t.d_pad)),
        dor(m.take<acc_t>(t.rows_pad * t.d_pad)),
        orows(m.take<acc_t>(t.rows_pad * t.d_pad)),
        q_along(m.take<acc_t>(t.rows_pad * t.d_pad)),
        dq(m.take<acc_t>(t.rows_pad * t.d_pad)),
        s(m.take<acc_t>(t.block_k * t.rows_pad)),
        sr(m.take<acc_t>(16 * round_up(t.block_k, 16))),
        dp(m.take<acc_t>(t.block_k * t.rows_pad)),
        kbuf(m.take<acc_t>(t.block_k * t.d_pad)),
        vbuf(m.take<acc_t>(t.block_k * t.d_pad)),
        shift(m.take<acc_t>(t.rows_pad)),
        delta(m.take<acc_t>(t.rows_pad)),
        z(m.take<acc_t>(t.block_k * t.rows_pad)),
        cap_slope(m.take<acc_t>(t.block_k * t.rows_pad)),
        cols(m.take<acc_t>(2 * t.rows_pad)),
        edge(m.take<acc_t>(16 * t.d_pad)),
        parts(m.take<acc_t>(split ? t.rows_pad * t.d_pad : 0)),
        k_keys(m.take<acc_t>(key_words)) {}
  static int64_t bytes(const Tiling<acc_t>& t, int64_t key_words, bool split) {
    Arena m;
    static_cast<void>(BackwardScratch(t, key_words, split, m));
    return m.bytes();
  }
};

// Whether a call's products run on the AMX tiles (the AMX variant, bfloat16
// and float16): whole 16-word steps along the head dim, and key tiles of
// whole 32 keys so that dQ's steps over a tile's key pairs stay in the
// buffers. Query tiles then pad their rows to 32: dK's and dV's sums over
// rows in 16-word steps.
template <typename T, typename acc_t>
bool amx_products(const Tiling<acc_t>& t) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return (kPairProducts<T> || kSplitProducts<T>) && t.d % 32 == 0 && t.block_k % 32 == 0;
#else
  static_cast<void>(t);
  return false;
#endif
}

// The words of a sequence's K across keys, packed once (BackwardPlan::key_words).
template <typename acc_t>
int64_t sequence_key_words(const Tiling<acc_t>& t) {
  return round_up(t.sk, 32) / 2 * t.d_pad;
}

// How a call is cut into tasks: a function of the shape and thread count.
template <typename T>
struct BackwardPlan {
  using acc_t = typename VecIO<T>::acc_t;
  Tiling<acc_t> t;
  int64_t pairs, n_q_rows, kv_rows, chunks = 1, n_tasks, slots;
  // dK/dV accumulate in the accumulator type with rows padded to d_pad;
  // when that is exactly the output layout they accumulate in place.
  bool in_place;
  // dK accumulates without the scale (the AMX products), applied at its store
  bool dk_unscaled;
  bool split;  // float16 on the AMX tiles (kSplitProducts)
  // On the AMX tiles, a task packs its sequence's K across keys (dQ's right
  // operand) once, not once per query and key tile, where that takes at most
  // kMaxKeyWordsBytes a slot: words for round_up(sk, 32) keys (float16: for
  // its high, then its low parts, sequence_key_words each), else 0.
  int64_t key_words = 0;
  static constexpr int64_t kMaxKeyWordsBytes = int64_t(8) << 20;

  explicit BackwardPlan(const AttentionBackwardArgs& a) : t(a) {
    dk_unscaled = amx_products<T>(t);
    split = kSplitProducts<T> && dk_unscaled;
    if (dk_unscaled) t.rows_pad = round_up(t.rows, 32);
    const int64_t words = (kSplitProducts<T> ? 2 : 1) * sequence_key_words(t);
    if (dk_unscaled && t.q_tiles > 1 && words * int64_t(sizeof(uint32_t)) <= kMaxKeyWordsBytes) key_words = words;
    pairs = t.batch * t.kv_heads;
    n_q_rows = a.rows.count(t.batch);
    kv_rows = a.key_rows.count(t.batch);
    // Few (batch, kv head) pairs: split each pair's key tiles into chunks
    // (a function of the shape only), each with its own partial dQ.
    const int64_t work = t.batch * a.q_heads * t.sq * t.sk * t.d;
    if (pairs < kMinTasks && t.k_tiles > 1 && work >= kMinParallelWork) {
      chunks = std::min(ceil_div(kMinTasks, pairs), t.k_tiles);
      const int64_t per_chunk = n_q_rows * t.d_pad * int64_t(sizeof(acc_t));
      chunks = std::max<int64_t>(1, std::min(chunks, kMaxPartialBytes / std::max<int64_t>(per_chunk, 1)));
    }
    in_place = std::is_same_v<T, acc_t> && t.d == t.d_pad && !dk_unscaled;
    n_tasks = pairs * chunks;
    slots = work_slots(n_tasks, work);
  }
};

// The call's workspace: dK/dV rows unless they accumulate in place; with
// chunks, every chunk's partial dQ; a BackwardScratch per slot.
template <typename T>
struct BackwardWorkspace {
  using acc_t = typename VecIO<T>::acc_t;
  acc_t *dk, *dv, *dq_partial;
  int64_t key_words, scratch_stride;  // scratch_stride in bytes
  bool split;
  char* scratch;

  BackwardWorkspace(const BackwardPlan<T>& p, Arena& zeroed, Arena& /*plain*/)
      : dk(p.in_place ? nullptr : zeroed.take<acc_t>(p.kv_rows * p.t.d_pad)),
        dv(p.in_place ? nullptr : zeroed.take<acc_t>(p.kv_rows * p.t.d_pad)),
        dq_partial(p.chunks > 1 ? zeroed.take<acc_t>(p.chunks * p.n_q_rows * p.t.d_pad) : nullptr),
        key_words(p.key_words),
        scratch_stride(BackwardScratch<acc_t>::bytes(p.t, p.key_words, p.split)),
        split(p.split),
        scratch(zeroed.take<char>(p.slots * scratch_stride)) {}

  BackwardScratch<acc_t> slot(const Tiling<acc_t>& t, int64_t i) const {
    Arena m(scratch + i * scratch_stride);
    return BackwardScratch<acc_t>(t, key_words, split, m);
  }
};

// P = exp(s * scale - shift) (scale 1 where s is scaled already: the same
// bits as scaling first) and dS = P (dP - delta), in place of s and dp.
template <bool kDropout, typename acc_t>
void probs_and_score_grads(acc_t* s, acc_t* dp, const acc_t* z, int64_t ld, int64_t nk,
                           const acc_t* shift, const acc_t* delta, acc_t scale) {
  using V = Vectorized<acc_t>;
  constexpr int64_t W = V::size();
  const VecOps<acc_t> ops;
  const V sc(scale);
  for (int64_t c = 0; c < ld; c += W) {
    const V sh = V::loadu(shift + c);
    const V de = V::loadu(delta + c);
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t e = j * ld + c;
      const V p = ops.exp(V::loadu(s + e) * sc - sh);
      if constexpr (kDropout) {
        const V zz = V::loadu(z + e);
        attn::score_grad(p, V::loadu(dp + e) * zz, de).store(dp + e);
        (p * zz).store(s + e);
      } else {
        attn::score_grad(p, V::loadu(dp + e), de).store(dp + e);
        p.store(s + e);
      }
    }
  }
}

// One backward task: kv head g of batch b, key tiles chunk, chunk + chunks,
// ...; accumulates dK (already scaled) and dV rows into dk/dv (leading dim
// d_pad) and writes dQ of every query tile (scaled into grad_q when chunks ==
// 1, else unscaled into this chunk's partial rows). bfloat16 on vdpbf16ps
// where the variant has it: every product's operands as pair words
// (attention_pair_words.h), in the other path's buffers.
template <typename T>
struct BackwardTask {
  using acc_t = typename VecIO<T>::acc_t;
  static constexpr bool kPairs = kPairProducts<T>;
  static constexpr bool kFloatLanes = kFloatKeyLanes<T>;
  // float16's wide tiles on the AMX tiles: every operand split into two
  // bfloat16 parts (split_row), each product three products of parts.
  static constexpr bool kSplit = kSplitProducts<T>;

  // A tile of query positions [p0, p0 + npos) and its rows (positions x the
  // group's heads). Tiles the forward scored with the keys along the lanes
  // (narrow) are scored so here too: the same sums, so the recomputed
  // probabilities are the forward's (a query seeing one key gets exactly 1).
  struct QueryTile {
    int64_t p0, npos, rows, ld;
    bool narrow;
  };

  const AttentionBackwardArgs& a;
  const Tiling<acc_t>& t;
  const BackwardScratch<acc_t> w;
  const int64_t b, g, kss, vss;
  const T *q, *go, *out, *k, *v;
  const int64_t sq;
  const Mask mask;
  const acc_t scale;
  const int64_t d, d_pad, group, sr_ld;
  const bool amx;  // the wide tiles' products on the AMX tiles (amx_products)
  const bool keys_packed;  // K across keys for the whole sequence in w.k_keys
  const bool defer_scale;  // the AMX products leave S^T unscaled (scale_can_wait)

  BackwardTask(const AttentionBackwardArgs& a, const Tiling<acc_t>& t, BackwardScratch<acc_t> w, int64_t b,
               int64_t g, bool keys_packed)
      : a(a), t(t), w(w), b(b), g(g), kss(a.k.seq_stride), vss(a.v.seq_stride),
        q(static_cast<const T*>(a.q.data) + b * a.q.batch_stride + a.seqs.q_start(b) * a.q.seq_stride),
        go(static_cast<const T*>(a.grad_out.data) + b * a.grad_out.batch_stride +
           a.seqs.q_start(b) * a.grad_out.seq_stride),
        out(static_cast<const T*>(a.out.data) + b * a.out.batch_stride + a.seqs.q_start(b) * a.out.seq_stride),
        k(static_cast<const T*>(a.k.data) + b * a.k.batch_stride + g * a.k.head_stride + a.seqs.k_start(b) * kss),
        v(static_cast<const T*>(a.v.data) + b * a.v.batch_stride + g * a.v.head_stride + a.seqs.k_start(b) * vss),
        sq(a.seqs.q_len(b)), mask(a.mask.of_lengths(sq, a.seqs.k_len(b))), scale(static_cast<acc_t>(a.scale)),
        d(t.d), d_pad(t.d_pad), group(t.group), sr_ld(round_up(t.block_k, 16)), amx(amx_products<T>(t)),
        keys_packed(amx && keys_packed),
        defer_scale(amx && scale_can_wait(a)) {}

  void run(int64_t chunk, int64_t chunks, acc_t* dk, acc_t* dv, acc_t* dq_partial) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    TileConfig tiles_before;
    if (amx) tiles_before = configure_tiles();
    if constexpr (kPairs) {
      if (keys_packed) pack_rows_across([&](int64_t j) { return key_row(j); }, a.seqs.k_len(b), d, words(w.k_keys), d_pad);
    }
    if constexpr (kSplit) {
      if (keys_packed) {
        pack_split_rows_across([&](int64_t j) { return key_row(j); }, a.seqs.k_len(b), d, words(w.k_keys),
                               words(w.k_keys) + sequence_key_words(t), d_pad);
      }
    }
#endif
    for (int64_t p0 = 0; p0 < sq; p0 += t.block_q) {
      const int64_t npos = std::min(t.block_q, sq - p0), rows = npos * group;
      const bool narrow = (kPairs || kFloatLanes) && rows <= kNarrowRows;
      const QueryTile qt{p0, npos, rows, round_up(rows, amx && !narrow ? 32 : Vectorized<acc_t>::size()), narrow};
      if (qt.narrow) std::fill(w.sr + rows * sr_ld, w.sr + qt.ld * sr_ld, acc_t(0));  // rows past `rows` transpose to 0
      // With several chunks each owns the global key tiles chunk, chunk + chunks, ...
      const KeyTiles tiles(mask, p0, p0 + npos, t.block_k, chunks > 1);
      int64_t i0 = 0;
      if (chunks > 1) i0 = ((chunk - tiles.first % chunks) % chunks + chunks) % chunks;
      const bool any = i0 < tiles.count;
      if (!any && chunks > 1) continue;  // the partial rows stay zero
      std::fill(w.dq, w.dq + rows * d_pad, acc_t(0));
      if (any) stage_rows(qt);
      for (int64_t i = i0; i < tiles.count; i += chunks) {
        const int64_t j0 = tiles.start(i), nk = tiles.stop(i) - j0;
        int64_t k_ld = 0;
        const acc_t* kp = scores(qt, j0, nk, k_ld);
        score_grads(qt, j0, nk);
        accumulate(qt, j0, nk, kp, k_ld, dk, dv);
      }
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t row = t.row_of(b, g, p0, i);
        if (chunks == 1) {
          store_row<T>(w.dq + i * d_pad, d, scale, static_cast<T*>(a.grad_q) + row * d);
        } else {
          std::memcpy(dq_partial + row * d_pad, w.dq + i * d_pad, sizeof(acc_t) * d);
        }
      }
    }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx) release_tiles(tiles_before);
#endif
  }

 private:
  const T* key_row(int64_t j) const { return k + j * kss; }
#if defined(__AVX512BF16__)
  int64_t dp() const { return (d + 1) / 2; }
  uint32_t* words(acc_t* buffer) const { return reinterpret_cast<uint32_t*>(buffer); }
  uint32_t* k_across() const { return words(w.kbuf) + t.block_k * d_pad / 2; }
#endif
  // The scale the probabilities apply: S^T's, where its product left it out.
  acc_t pending_scale(const QueryTile& qt) const { return defer_scale && !qt.narrow ? scale : acc_t(1); }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  // Whether the key tile's K across keys is the sequence's, packed once.
  bool keys_from_sequence(int64_t j0, int64_t nk) const { return keys_packed && tile_in_sequence_pairs(j0, nk); }
#endif
  // Whether a query tile's products are float16's on the AMX tiles.
  bool split_tile(const QueryTile& qt) const { return kSplit && amx && !qt.narrow; }

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  // The high and low parts of rows [0, rows) of a float16 operand (row(i)),
  // split into w.parts: bfloat16 rows of d terms, the high parts' at hi(),
  // the low parts' at lo(); rows [rows, ld) zero.
  c10::BFloat16* hi() const { return reinterpret_cast<c10::BFloat16*>(w.parts); }
  c10::BFloat16* lo(const QueryTile& qt) const { return hi() + qt.ld * d; }
  template <typename Row>
  void split_tile_rows(const QueryTile& qt, const Row& row) {
    split_rows(row, qt.rows, d, hi(), lo(qt));
    std::fill(hi() + qt.rows * d, hi() + qt.ld * d, c10::BFloat16(0.0f));
    std::fill(lo(qt) + qt.rows * d, lo(qt) + qt.ld * d, c10::BFloat16(0.0f));
  }

  // stage_rows for a float16 tile on the AMX tiles: Q's and dO's parts as
  // pair words along the head dim, transposed (S^T's and dP^T's right
  // operands: high parts, then low parts dp() * ld words on), and across
  // rows (dK's and dV's: ld / 2 * d_pad words a part); delta the diagonal of
  // O dO^T taken as dP^T = V dO^T takes its products, so summed as dP^T
  // sums its element of the same row of values and column of dO.
  void stage_split_rows(const QueryTile& qt) {
    const int64_t ld = qt.ld, part = ld / 2 * d_pad;
    const auto high = [&](int64_t i) -> const c10::BFloat16* { return hi() + i * d; };
    const auto low = [&](int64_t i) -> const c10::BFloat16* { return lo(qt) + i * d; };
    const auto stage = [&](const T* base, int64_t head_stride, int64_t seq_stride, acc_t* transposed, acc_t* across) {
      split_tile_rows(qt, [&](int64_t i) { return t.row_in(base, head_stride, seq_stride, g, qt.p0, i); });
      pack_rows_transposed(high, ld, ld, d, words(transposed));
      pack_rows_transposed(low, ld, ld, d, words(transposed) + dp() * ld);
      pack_rows_across(high, ld, d, words(across), d_pad);
      pack_rows_across(low, ld, d, words(across) + part, d_pad);
    };
    stage(q, a.q.head_stride, a.q.seq_stride, w.qt, w.qs);
    stage(go, a.grad_out.head_stride, a.grad_out.seq_stride, w.dot, w.dor);
    split_tile_rows(qt, [&](int64_t i) { return t.row_in(out, a.out.head_stride, a.out.seq_stride, g, qt.p0, i); });
    const uint32_t* doh = words(w.dot);
    const uint32_t* oh = reinterpret_cast<const uint32_t*>(hi());
    const uint32_t* ol = reinterpret_cast<const uint32_t*>(lo(qt));
    diagonal_amx<3>(ld, dp(), {oh, ol, oh}, dp(), {doh, doh, doh + dp() * ld}, ld, w.delta, w.edge);
  }

  // S^T = K Q^T and dP^T = V dO^T of a float16 tile from the parts (K's and
  // V's rows split in turn into vbuf; rows past nk stale, never read as
  // scores), and K across keys for dQ where the tile cannot read the
  // sequence's: both parts in kbuf, zero pairs up to the whole 16.
  void split_scores(const QueryTile& qt, int64_t j0, int64_t nk) {
    const int64_t ld = qt.ld, n16 = round_up(nk, 16);
    auto* high = reinterpret_cast<c10::BFloat16*>(w.vbuf);
    c10::BFloat16* low = high + n16 * d;
    const uint32_t* h = reinterpret_cast<const uint32_t*>(high);
    const uint32_t* l = reinterpret_cast<const uint32_t*>(low);
    const auto split = [&](const T* rows, int64_t stride) {
      split_rows([&](int64_t j) { return rows + j * stride; }, nk, d, high, low);
    };
    const uint32_t* qh = words(w.qt);
    const uint32_t* doh = words(w.dot);
    split(k + j0 * kss, kss);
    gemm_amx<false, 3>(n16, ld, dp(), {h, l, h}, dp(), {qh, qh, qh + dp() * ld}, ld, w.s, ld);
    if (!defer_scale) scale_tile(w.s, ld, nk, scale);
    split(v + j0 * vss, vss);
    gemm_amx<false, 3>(n16, ld, dp(), {h, l, h}, dp(), {doh, doh, doh + dp() * ld}, ld, w.dp, ld);
    if (!keys_from_sequence(j0, nk)) {
      const int64_t kp = (nk + 1) / 2, kp16 = round_up(kp, 16);
      uint32_t* const kh = words(w.kbuf);
      uint32_t* const kl = kh + kp16 * d_pad;
      pack_split_rows_across([&](int64_t j) { return key_row(j0 + j); }, nk, d, kh, kl, d_pad);
      std::fill(kh + kp * d_pad, kh + kp16 * d_pad, 0u);
      std::fill(kl + kp * d_pad, kl + kp16 * d_pad, 0u);
    }
  }

  // accumulate for a float16 tile on the AMX tiles: dS's parts as rows of key
  // pairs into z (high, then low parts ld * np16 words on), then P's and dS's
  // as rows of query-row pairs, high parts in place, low parts in cap_slope
  // (spent: the soft-cap's slope was applied), each product three of parts.
  void split_accumulate(const QueryTile& qt, int64_t j0, int64_t nk, acc_t* dk_rows, acc_t* dv_rows) {
    const int64_t ld = qt.ld, rp = ld / 2, part = rp * d_pad, np16 = round_up((nk + 1) / 2, 16);
    uint32_t* const dsk = words(w.z);
    pack_tile_rows_amx(w.dp, ld, nk, dsk, np16);
    pack_tile_rows_amx<true>(w.dp, ld, nk, dsk + ld * np16, np16);
    uint32_t* const p_low = words(w.cap_slope);
    uint32_t* const ds_low = p_low + round_up(nk, 16) * rp;
    const uint32_t* ph = pack_tile_rows_in_place(w.s, ld, nk, p_low);
    const uint32_t* dsh = pack_tile_rows_in_place(w.dp, ld, nk, ds_low);
    const uint32_t* doh = words(w.dor);
    const uint32_t* qh = words(w.qs);
    accumulate_rows_amx<3>(nk, d_pad, rp, {ph, ph, p_low}, rp, {doh, doh + part, doh}, d_pad, dv_rows, d_pad, w.edge);
    accumulate_rows_amx<3>(nk, d_pad, rp, {dsh, dsh, ds_low}, rp, {qh, qh + part, qh}, d_pad, dk_rows, d_pad, w.edge);
    const uint32_t* kh = keys_from_sequence(j0, nk) ? words(w.k_keys) + j0 / 2 * d_pad : words(w.kbuf);
    const uint32_t* kl = keys_from_sequence(j0, nk) ? kh + sequence_key_words(t) : kh + np16 * d_pad;
    gemm_amx<true, 3>(ld, d_pad, np16, {dsk, dsk, dsk + ld * np16}, np16, {kh, kl, kh}, d_pad, w.dq, d_pad);
  }
#endif

  // Q (times scale), dO and O of the query tile staged for the products,
  // delta = rowsum(dO * O) summed as dP sums dO . v (a row whose output is
  // one key's value row, that key alone visible, gets dP - delta = 0
  // exactly, so dQ and dK exactly 0), and each row's lse as the shift.
  void stage_rows(const QueryTile& qt) {
    const int64_t p0 = qt.p0, rows = qt.rows, ld = qt.ld;
    if constexpr (kPairs) {
#if defined(__AVX512BF16__)
      // Q and dO as pair words twice: along head_dim, transposed (the
      // right operands of S^T and dP^T), and across rows (of dK and dV).
      const auto q_row = [&](int64_t i) { return t.row_in(q, a.q.head_stride, a.q.seq_stride, g, p0, i); };
      const auto go_row = [&](int64_t i) {
        return t.row_in(go, a.grad_out.head_stride, a.grad_out.seq_stride, g, p0, i);
      };
      uint32_t* const q_across = words(w.qs);
      uint32_t* const do_across = words(w.dor);
      pack_rows_transposed(q_row, rows, ld, d, words(w.qt));
      pack_rows_transposed(go_row, rows, ld, d, words(w.dot));
      pack_rows_across(q_row, rows, d, q_across, d_pad);
      pack_rows_across(go_row, rows, d, do_across, d_pad);
      const int64_t packed = (rows + 1) / 2 * d_pad;
      std::fill(q_across + packed, q_across + ld / 2 * d_pad, 0u);
      std::fill(do_across + packed, do_across + ld / 2 * d_pad, 0u);
      if (qt.narrow) {
        for (int64_t i = 0; i < rows; ++i) pack_rows_along(q_row(i), 0, 1, d, words(w.q_along) + i * dp(), dp());
      }
      const auto o_row = [&](int64_t i) { return t.row_in(out, a.out.head_stride, a.out.seq_stride, g, p0, i); };
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if (amx && !qt.narrow) {
        // delta as the diagonal of O dO^T, each summed as dP^T = V dO^T sums
        // its element of the same row of values and column of dO
        uint32_t* const o_words = words(w.orows);
        for (int64_t i = 0; i < rows; ++i) pack_rows_along(o_row(i), 0, 1, d, o_words + i * dp(), dp());
        std::fill(o_words + rows * dp(), o_words + ld * dp(), 0u);
        diagonal_amx<1>(ld, dp(), {o_words}, dp(), {words(w.dot)}, ld, w.delta, w.edge);
      } else
#endif
      {
        pack_rows_transposed(o_row, rows, ld, d, words(w.ot));
        column_dots_pairs(dp(), words(w.ot), words(w.dot), ld, w.delta);
      }
#endif
    } else if (split_tile(qt)) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if constexpr (kSplit) stage_split_rows(qt);
#endif
    } else {
      gather_both(q, a.q.head_stride, a.q.seq_stride, t, g, p0, rows, ld, scale, w.qs, w.qt);
      // dK's right operand unscaled where dK takes the scale at its store
      if (amx) gather_rows(q, a.q.head_stride, a.q.seq_stride, t, g, p0, rows, acc_t(1), w.q_along);
      gather_both(go, a.grad_out.head_stride, a.grad_out.seq_stride, t, g, p0, rows, ld, acc_t(1), w.dor, w.dot);
      gather_both(out, a.out.head_stride, a.out.seq_stride, t, g, p0, rows, ld, acc_t(1), w.orows, w.ot);
      column_dots(d, w.ot, w.dot, ld, w.delta);
    }
    const acc_t* lse = static_cast<const acc_t*>(a.lse);
    for (int64_t i = 0; i < ld; ++i) {
      w.shift[i] = i < rows ? attn::ScalarOps<acc_t>::finite_or_zero(lse[t.row_of(b, g, p0, i)]) : acc_t(0);
    }
  }

  // S^T = K (Q * scale)^T and dP^T = V dO^T: keys x rows. Returns K's tile as
  // dQ's right operand on the float path (k_ld its leading dimension).
  const acc_t* scores(const QueryTile& qt, int64_t j0, int64_t nk, int64_t& k_ld) {
    const int64_t rows = qt.rows, ld = qt.ld;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if constexpr (kSplit) {
      if (split_tile(qt)) {
        split_scores(qt, j0, nk);
        return nullptr;
      }
    }
#endif
    if constexpr (kPairs) {
#if defined(__AVX512BF16__)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if (amx && !qt.narrow) {
        rows_times_amx(k + j0 * kss, kss, nk, dp(), words(w.qt), ld, w.s, words(w.kbuf));
        if (!defer_scale) scale_tile(w.s, ld, nk, scale);
        rows_times_amx(v + j0 * vss, vss, nk, dp(), words(w.dot), ld, w.dp, words(w.vbuf));
        // K across keys for dQ where the tile cannot read the sequence's:
        // packed with zero pairs up to the whole 16
        if (!keys_from_sequence(j0, nk)) {
          const int64_t kp = (nk + 1) / 2;
          pack_rows_across([&](int64_t j) { return key_row(j0 + j); }, nk, d, k_across(), d_pad);
          std::fill(k_across() + kp * d_pad, k_across() + round_up(kp, 16) * d_pad, 0u);
        }
        return nullptr;
      }
#endif
      uint32_t* const k_pairs = words(w.kbuf);
      uint32_t* const v_pairs = words(w.vbuf);
      pack_rows_along(k + j0 * kss, kss, nk, d, k_pairs, dp());
      pack_rows_along(v + j0 * vss, vss, nk, d, v_pairs, dp());
      pack_rows_across([&](int64_t j) { return key_row(j0 + j); }, nk, d, k_across(), d_pad);
      if (qt.narrow) {
        scores_along_keys<KeyLanes<Pairs::kBf16>>([&](int64_t j) { return key_row(j0 + j); }, nk, d,
                                                  words(w.q_along), dp(), rows, w.sr, sr_ld, scale, nullptr);
        transpose_16_rows(w.sr, sr_ld, nk, w.s);
      } else {
        gemm_pairs<ALayout::kRowMajor, false>(nk, ld, dp(), k_pairs, dp(), words(w.qt), ld, w.s, ld, nullptr, scale);
      }
      gemm_pairs<ALayout::kRowMajor, false>(nk, ld, dp(), v_pairs, dp(), words(w.dot), ld, w.dp, ld);
#endif
      return nullptr;
    } else {
      const acc_t* kp = rows_in_place<T, acc_t>(k + j0 * kss, kss, d, d_pad);
      const acc_t* vp = rows_in_place<T, acc_t>(v + j0 * vss, vss, d, d_pad);
      int64_t v_ld = d;
      k_ld = d;
      if (kp == nullptr) kp = kv_tile(k + j0 * kss, kss, nk, d, d_pad, w.kbuf, k_ld);
      if (vp == nullptr) vp = kv_tile(v + j0 * vss, vss, nk, d, d_pad, w.vbuf, v_ld);
      bool scored = false;
#if defined(__AVX2__)
      if constexpr (kFloatLanes) {
        if (qt.narrow) {  // Q * scale rows in qs
          scores_along_keys<FloatKeyLanes>([&](int64_t j) { return key_row(j0 + j); }, nk, d, w.qs, d_pad, rows, w.sr,
                                           sr_ld, 1.0f, nullptr);
#if defined(__AVX512F__)
          transpose_16_rows(w.sr, sr_ld, nk, w.s);
#else
          transpose(w.sr, sr_ld, ld, round_up(nk, ld), w.s, ld);
#endif
          scored = true;
        }
      }
#endif
      if (!scored) gemm<acc_t, ALayout::kRowMajor, false>(nk, ld, d, kp, k_ld, w.qt, ld, w.s, ld);
      gemm<acc_t, ALayout::kRowMajor, false>(nk, ld, d, vp, v_ld, w.dot, ld, w.dp, ld);
      return kp;
    }
  }

  // The forward's probabilities recomputed into w.s and dS into w.dp: score
  // mods, masks, dropout, then through the soft-cap.
  void score_grads(const QueryTile& qt, int64_t j0, int64_t nk) {
    const int64_t ld = qt.ld;
    const bool capped = a.mods.softcap > 0;
    const TileRows tile{b, g, group, qt.p0, qt.npos, j0, nk};
    if (a.mods.any_score_mod()) {
      apply_score_mods<acc_t>(w.s, ld, tile, a.mods, mask.offset, capped ? w.cap_slope : nullptr, w.cols);
    }
    if (!tile_fully_visible(mask, qt.p0, qt.p0 + qt.npos, j0, nk)) {
      mask_tile(w.s, ld, nk, j0, qt.p0, qt.npos, group, mask);
    }
    apply_tensor_mask(w.s, ld, tile, a.tensor_mask);
    if (a.dropout.enabled) {
      // z = 1 / (1 - p) where kept, else 0; padding columns past the tile's rows 0.
      const acc_t kept = static_cast<acc_t>(a.dropout.scale);
      for_each_dropout_draw(tile, t.query_rows, t.sk, a.dropout, [&](int64_t j, int64_t col, bool keep) {
        w.z[j * ld + col] = keep ? kept : acc_t(0);
      });
      for (int64_t j = 0; j < nk; ++j) std::fill(w.z + j * ld + tile.cols(), w.z + (j + 1) * ld, acc_t(0));
      probs_and_score_grads<true>(w.s, w.dp, w.z, ld, nk, w.shift, w.delta, pending_scale(qt));
    } else {
      probs_and_score_grads<false>(w.s, w.dp, w.z, ld, nk, w.shift, w.delta, pending_scale(qt));
    }
    if (capped) {
      // Through the cap: dz = ds * (1 - (s / cap)^2).
      using V = Vectorized<acc_t>;
      for (int64_t e = 0; e < nk * ld; e += V::size()) (V::loadu(w.dp + e) * V::loadu(w.cap_slope + e)).store(w.dp + e);
    }
  }

  // dV += P^T dO, dK += dS^T (Q * scale): the sum over the group's rows is
  // the inner dimension of these products; dQ (unscaled) += dS K.
  void accumulate(const QueryTile& qt, int64_t j0, int64_t nk, const acc_t* kp, int64_t k_ld, acc_t* dk,
                  acc_t* dv) {
    const int64_t rows = qt.rows, ld = qt.ld;
    acc_t* dv_rows = dv + j0 * d_pad;
    acc_t* dk_rows = dk + j0 * d_pad;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if constexpr (kSplit) {
      if (split_tile(qt)) return split_accumulate(qt, j0, nk, dk_rows, dv_rows);
    }
#endif
    if constexpr (kPairs) {
#if defined(__AVX512BF16__)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if (amx && !qt.narrow) {
        // dS as rows of key pairs (dQ's left operand, zero past the keys)
        // into z, then P and dS as rows of query-row pairs in place: their
        // pairs past `rows` meet the zero rows of dO and Q across
        const int64_t np16 = round_up((nk + 1) / 2, 16);
        uint32_t* const ds_keys = words(w.z);
        pack_tile_rows_amx(w.dp, ld, nk, ds_keys, np16);
        const uint32_t* p_rows = pack_tile_rows_in_place(w.s, ld, nk);
        const uint32_t* ds_rows = pack_tile_rows_in_place(w.dp, ld, nk);
        accumulate_rows_amx<1>(nk, d_pad, ld / 2, {p_rows}, ld / 2, {words(w.dor)}, d_pad, dv_rows, d_pad, w.edge);
        accumulate_rows_amx<1>(nk, d_pad, ld / 2, {ds_rows}, ld / 2, {words(w.qs)}, d_pad, dk_rows, d_pad, w.edge);
        const uint32_t* k_cols = keys_from_sequence(j0, nk) ? words(w.k_keys) + j0 / 2 * d_pad : k_across();
        gemm_amx<true>(ld, d_pad, np16, ds_keys, np16, k_cols, d_pad, w.dq, d_pad);
        return;
      }
#endif
      // dS as column pairs (dQ's left operand) into z, then P and dS as row
      // pairs in place; the rows' pairs run to ceil(rows / 2), the right
      // operands' rows past `rows` being zero.
      const uint32_t* ds_cols = pack_tile_pairs(w.dp, ld, nk, words(w.z));
      const uint32_t* p_rows = pack_tile_rows_in_place(w.s, ld, nk);
      const uint32_t* ds_rows = pack_tile_rows_in_place(w.dp, ld, nk);
      const int64_t rp = (rows + 1) / 2;
      gemm_pairs<ALayout::kRowMajor, true>(nk, d_pad, rp, p_rows, ld / 2, words(w.dor), d_pad, dv_rows, d_pad);
      gemm_pairs<ALayout::kRowMajor, true>(nk, d_pad, rp, ds_rows, ld / 2, words(w.qs), d_pad, dk_rows, d_pad,
                                           nullptr, amx ? acc_t(1) : scale);
      gemm_pairs<ALayout::kColMajor, true>(rows, d_pad, (nk + 1) / 2, ds_cols, ld, k_across(), d_pad, w.dq, d_pad);
#endif
    } else {
      gemm<acc_t, ALayout::kRowMajor, true>(nk, d_pad, rows, w.s, ld, w.dor, d_pad, dv_rows, d_pad);
      gemm<acc_t, ALayout::kRowMajor, true>(nk, d_pad, rows, w.dp, ld, amx ? w.q_along : w.qs, d_pad, dk_rows, d_pad);
      // dS read column-major out of the transposed tile.
      gemm<acc_t, ALayout::kColMajor, true>(rows, d_pad, nk, w.dp, ld, kp, k_ld, w.dq, d_pad);
    }
  }
};

template <typename T>
struct BackwardKernel {
  using acc_t = typename VecIO<T>::acc_t;

  static void task(const AttentionBackwardArgs& a, const Tiling<acc_t>& t, BackwardScratch<acc_t> w,
                   int64_t b, int64_t g, int64_t chunk, int64_t chunks, acc_t* dk, acc_t* dv,
                   acc_t* dq_partial, bool keys_packed) {
    BackwardTask<T>(a, t, w, b, g, keys_packed).run(chunk, chunks, dk, dv, dq_partial);
  }

  static AttentionWorkspace workspace(const AttentionBackwardArgs& a) {
    return measure<BackwardWorkspace<T>>(BackwardPlan<T>(a));
  }

  static void run(const AttentionBackwardArgs& a) {
    const BackwardPlan<T> p(a);
    const auto ws = place<BackwardWorkspace<T>>(a.workspace, measure<BackwardWorkspace<T>>(p), p);
    const Tiling<acc_t>& t = p.t;
    const int64_t n_q_rows = p.n_q_rows, kv_rows = p.kv_rows, chunks = p.chunks;
    const bool in_place = p.in_place;

    acc_t* dk = ws.dk;
    acc_t* dv = ws.dv;
    if (in_place) {
      dk = reinterpret_cast<acc_t*>(a.grad_k);
      dv = reinterpret_cast<acc_t*>(a.grad_v);
      at::parallel_for(0, kv_rows, 1024, [&](int64_t begin, int64_t end) {
        std::fill(dk + begin * t.d_pad, dk + end * t.d_pad, acc_t(0));
        std::fill(dv + begin * t.d_pad, dv + end * t.d_pad, acc_t(0));
      });
    }
    acc_t* dq_p = ws.dq_partial;

    run_tasks(p.n_tasks, p.slots, [&](int64_t task_index, int64_t slot) {
      const int64_t chunk = task_index % chunks;
      const int64_t pair = task_index / chunks;
      const int64_t b = pair / t.kv_heads, g = pair % t.kv_heads;
      const BackwardScratch<acc_t> w = ws.slot(t, slot);
      acc_t* dq_rows = dq_p != nullptr ? dq_p + chunk * n_q_rows * t.d_pad : nullptr;
      const int64_t kv_row0 = a.key_rows.row(b, g, 0);
      task(a, t, w, b, g, chunk, chunks, dk + kv_row0 * t.d_pad, dv + kv_row0 * t.d_pad, dq_rows, p.key_words > 0);
    });

    if (!in_place) {
      const acc_t dk_scale = p.dk_unscaled ? static_cast<acc_t>(a.scale) : acc_t(1);
      at::parallel_for(0, kv_rows, std::max<int64_t>(1, 4096 / t.d_pad), [&](int64_t begin, int64_t end) {
        T* gk = static_cast<T*>(a.grad_k);
        T* gv = static_cast<T*>(a.grad_v);
        for (int64_t r = begin; r < end; ++r) {
          store_row<T>(dk + r * t.d_pad, t.d, dk_scale, gk + r * t.d);
          store_row<T>(dv + r * t.d_pad, t.d, acc_t(1), gv + r * t.d);
        }
      });
    }
    if (chunks > 1) {
      // dQ = scale * sum of the chunks' partials, in chunk order.
      at::parallel_for(0, n_q_rows, std::max<int64_t>(1, 4096 / t.d_pad), [&](int64_t begin, int64_t end) {
        std::vector<acc_t> acc(t.d_pad);
        T* gq = static_cast<T*>(a.grad_q);
        for (int64_t r = begin; r < end; ++r) {
          std::fill(acc.begin(), acc.end(), acc_t(0));
          for (int64_t c = 0; c < chunks; ++c) {
            const acc_t* src = dq_p + (c * n_q_rows + r) * t.d_pad;
            for (int64_t j = 0; j < t.d; ++j) acc[j] += src[j];
          }
          store_row<T>(acc.data(), t.d, static_cast<acc_t>(a.scale), gq + r * t.d);
        }
      });
    }
  }
};

void attention_backward(const AttentionBackwardArgs& a) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.dtype, "fusedllm_attention_backward_cpu", [&] {
    BackwardKernel<scalar_t>::run(a);
  });
}

AttentionWorkspace attention_backward_workspace(const AttentionBackwardArgs& a) {
  AttentionWorkspace w;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.dtype, "fusedllm_attention_backward_cpu", [&] {
    w = BackwardKernel<scalar_t>::workspace(a);
  });
  return w;
}

int64_t attention_backward_head_dim(const AttentionBackwardArgs& a) { return amx_head_dim(a, false); }

constexpr AttentionBackwardKernel kBackward{&attention_backward_workspace, &attention_backward,
                                            &attention_backward_head_dim};

}  // namespace
}  // namespace flash

FUSEDLLM_REGISTER_CPU_KERNEL(attention_backward_kernels, &flash::kBackward);

}  // namespace CPU_CAPABILITY
}  // namespace fusedllm::cpu
