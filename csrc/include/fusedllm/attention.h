// Attention math shared by the CPU kernels (scalar and Vectorized<float/double>
// lanes) and the CUDA kernels: where a query row lives, which keys a query
// sees, the online-softmax update, the log-sum-exp of a finished row, merging
// partial results and the score gradient. Functions templated on `V` take an
// `Ops` policy for max / exp / select, so the CPU kernels can run them on whole
// vectors of rows. Last, the CPU kernels' interface and the layout of their work.
#pragma once

#include <c10/core/ScalarType.h>
#include <cmath>
#include <cstdint>
#include <limits>

#include "fusedllm/cpu_dispatch.h"
#include "fusedllm/dropout.h"
#include "fusedllm/macros.h"

namespace fusedllm::attn {

// The sequences of a call. Dense: `batch` sequences of sq queries and sk
// keys each. Packed (varlen, cu_q / cu_k set): sequence b's queries are rows
// [cu_q[b], cu_q[b + 1]) of the packed q and its keys rows [cu_k[b],
// cu_k[b + 1]) of the packed k / v; sq and sk are then the longest lengths
// (tile counts come from them; tiles past a sequence's end do nothing).
// With k_lens (a KV cache of sequences of different lengths), sequence b has
// the first k_lens[b] keys of its rows and sk is the longest.
struct Seqs {
  const int32_t* cu_q = nullptr;
  const int32_t* cu_k = nullptr;
  const int32_t* k_lens = nullptr;
  int64_t sq = 0, sk = 0;
  int64_t k_capacity = 0;  // with k_lens: the most keys a sequence's rows hold

  // Whether sequence b's k_lens entry is a length its rows hold (true without
  // k_lens). Kernels that read the lengths where they lie (not checked on the
  // host) test it before using the length.
  FUSEDLLM_HOST_DEVICE bool k_len_ok(int64_t b) const {
    return k_lens == nullptr || (k_lens[b] >= 0 && k_lens[b] <= k_capacity);
  }

  FUSEDLLM_HOST_DEVICE bool packed() const { return cu_q != nullptr; }
  FUSEDLLM_HOST_DEVICE int64_t q_start(int64_t b) const { return cu_q ? cu_q[b] : 0; }
  FUSEDLLM_HOST_DEVICE int64_t k_start(int64_t b) const { return cu_k ? cu_k[b] : 0; }
  FUSEDLLM_HOST_DEVICE int64_t q_len(int64_t b) const { return cu_q ? cu_q[b + 1] - cu_q[b] : sq; }
  FUSEDLLM_HOST_DEVICE int64_t k_len(int64_t b) const {
    return k_lens ? k_lens[b] : cu_k ? cu_k[b + 1] - cu_k[b] : sk;
  }
};

// Keys and values stored in pages (a paged KV cache): key j of sequence b is
// row j % page_size of page table[b * table_stride + j / page_size]. A page
// is what the batch index addresses in a dense operand, so a row's offset
// takes the operand's batch (page) and sequence (row) strides. Null table:
// dense rows, row j at j * row_stride.
struct Pages {
  const int32_t* table = nullptr;
  int64_t table_stride = 0, page_size = 1;
  int64_t num_pages = 0;  // pages of the operands: table entries in [0, num_pages)

  FUSEDLLM_HOST_DEVICE bool paged() const { return table != nullptr; }
  // Whether key j of sequence b lies on a page of the operands (dense rows:
  // always). Kernels that read the table where it lies test each key with it.
  FUSEDLLM_HOST_DEVICE bool readable(int64_t b, int64_t j) const {
    if (table == nullptr) return true;
    const int32_t page = table[b * table_stride + j / page_size];
    return page >= 0 && page < num_pages;
  }
  FUSEDLLM_HOST_DEVICE int64_t row_offset(int64_t b, int64_t j, int64_t page_stride,
                                          int64_t row_stride) const {
    if (table == nullptr) return j * row_stride;
    return static_cast<int64_t>(table[b * table_stride + j / page_size]) * page_stride +
           (j % page_size) * row_stride;
  }
  // Keys from j on that share j's page (all of them for dense rows).
  FUSEDLLM_HOST_DEVICE int64_t run(int64_t j, int64_t n) const {
    if (table == nullptr) return n;
    const int64_t left = page_size - j % page_size;
    return left < n ? left : n;
  }
};

// Where a query row lives. The rows (outputs, log-sum-exp, delta, dropout
// draws) are numbered row-major over [B, Hq, Sq], or over [Hq, total_q] for
// packed sequences (row h * total_q + cu_q[b] + pos; out and lse are stored
// in that order). The kernels walk the rows of one (sequence b, kv head g)
// pair in (position, query head) order, so one K/V tile serves the whole
// group: group row r is position r / group of query head g * group + r %
// group. Query head h reads kv head h / group (GQA).
struct QueryRows {
  int64_t q_heads = 0;
  int64_t group = 1;  // query heads per kv head
  int64_t sq = 0;     // dense: every sequence's length; packed: the longest
  const int32_t* cu_q = nullptr;  // packed sequences' starts (null: dense)
  int64_t total_q = 0;            // packed: all sequences' queries
  int64_t n_seqs = 0;             // packed: the number of sequences

  // Flat row of (sequence b, query head h, position pos), and back.
  FUSEDLLM_HOST_DEVICE int64_t row(int64_t b, int64_t h, int64_t pos) const {
    return cu_q ? h * total_q + cu_q[b] + pos : (b * q_heads + h) * sq + pos;
  }
  FUSEDLLM_HOST_DEVICE int64_t batch(int64_t row) const {
    if (!cu_q) return row / sq / q_heads;
    // The last sequence starting at or before the packed row (empty ones skipped).
    const int64_t packed = row % total_q;
    int64_t lo = 0, hi = n_seqs;
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (cu_q[mid] <= packed) lo = mid; else hi = mid;
    }
    return lo;
  }
  FUSEDLLM_HOST_DEVICE int64_t head(int64_t row) const {
    return cu_q ? row / total_q : row / sq % q_heads;
  }
  FUSEDLLM_HOST_DEVICE int64_t pos(int64_t row) const {
    return cu_q ? row % total_q - cu_q[batch(row)] : row % sq;
  }
  FUSEDLLM_HOST_DEVICE int64_t kv_head(int64_t h) const { return h / group; }
  // All rows of the call.
  FUSEDLLM_HOST_DEVICE int64_t count(int64_t batch) const {
    return cu_q ? q_heads * total_q : batch * q_heads * sq;
  }

  // Rows of one (sequence, kv head) pair: its positions times the group's heads.
  FUSEDLLM_HOST_DEVICE int64_t group_rows() const { return sq * group; }
  FUSEDLLM_HOST_DEVICE int64_t group_pos(int64_t r) const { return r / group; }
  FUSEDLLM_HOST_DEVICE int64_t group_head(int64_t g, int64_t r) const { return g * group + r % group; }
  // First group row of position pos (its rows are [pos * group, (pos + 1) * group)).
  FUSEDLLM_HOST_DEVICE int64_t group_row(int64_t pos) const { return pos * group; }
  // Flat row of group row r of kv head g in sequence b.
  FUSEDLLM_HOST_DEVICE int64_t row_of_group_row(int64_t b, int64_t g, int64_t r) const {
    return row(b, group_head(g, r), group_pos(r));
  }
};

// Where the gradient row of key j of kv head g in sequence b lives: [B, Hkv,
// Sk] row-major, or [Hkv, total_k] for packed sequences.
struct KeyRows {
  int64_t kv_heads = 0;
  int64_t sk = 0;
  const int32_t* cu_k = nullptr;
  int64_t total_k = 0;
  FUSEDLLM_HOST_DEVICE int64_t row(int64_t b, int64_t g, int64_t j) const {
    return cu_k ? g * total_k + cu_k[b] + j : (b * kv_heads + g) * sk + j;
  }
  // All rows of the call (the gradients' first dimensions flattened).
  FUSEDLLM_HOST_DEVICE int64_t count(int64_t batch) const {
    return cu_k ? kv_heads * total_k : batch * kv_heads * sk;
  }
};

// Visibility of key j to query i. Query i sits at absolute position
// p = i + offset with offset = Sk - Sq (queries are the last Sq positions of
// the Sk keys: bottom-right alignment, what decoding with a KV cache needs;
// per sequence for packed sequences). Key j is visible when
//   p - left <= j   (left >= 0; -1: no bound)
//   j <= p + right  (right >= 0; -1: no bound; causal attention is right = 0)
struct Mask {
  int64_t sk = 0;
  int64_t offset = 0;
  int64_t left = -1;
  int64_t right = -1;

  // The same bounds for a sequence of sq_b queries over sk_b keys.
  FUSEDLLM_HOST_DEVICE Mask of_lengths(int64_t sq_b, int64_t sk_b) const {
    Mask m = *this;
    m.sk = sk_b;
    m.offset = sk_b - sq_b;
    return m;
  }
};

// A caller's mask tensor, read where it lies: element (b, h, i, j) of its
// [B, Hq, Sq, Sk] broadcast view is data[b * batch_stride + h * head_stride +
// i * q_stride + j * k_stride] (stride 0 along broadcast dimensions).
// kBool: False masks the score; the float kinds are added to the scaled score,
// except that the most negative finite value of the mask's dtype (what Hugging
// Face and most notebooks write for "masked") counts as -inf: a row masked
// entirely that way gets zeros, as with a bool mask, instead of a softmax over
// scores whose differences were rounded away (whose gradient through the
// log-sum-exp would be wrong).
enum class MaskKind : int { kNone = 0, kBool, kFloat, kDouble, kBFloat16, kHalf };

// The most negative finite value of each float mask dtype, as a double.
FUSEDLLM_HOST_DEVICE double mask_lowest(MaskKind kind) {
  switch (kind) {
    case MaskKind::kFloat: return -3.4028234663852886e+38;
    case MaskKind::kDouble: return -1.7976931348623157e+308;
    case MaskKind::kBFloat16: return -3.3895313892515355e+38;
    case MaskKind::kHalf: return -65504.0;
    default: return 0.0;
  }
}

struct TensorMask {
  const void* data = nullptr;
  MaskKind kind = MaskKind::kNone;
  int64_t batch_stride = 0, head_stride = 0, q_stride = 0, k_stride = 0;
  FUSEDLLM_HOST_DEVICE bool present() const { return kind != MaskKind::kNone; }
  FUSEDLLM_HOST_DEVICE int64_t offset(int64_t b, int64_t h, int64_t i) const {
    return b * batch_stride + h * head_stride + i * q_stride;
  }
};

FUSEDLLM_HOST_DEVICE int64_t clamp_index(int64_t x, int64_t lo, int64_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// First key query i sees (keys [key_begin, key_end) are visible; empty when begin >= end).
FUSEDLLM_HOST_DEVICE int64_t key_begin(const Mask& m, int64_t i) {
  if (m.left < 0) return 0;
  return clamp_index(i + m.offset - m.left, 0, m.sk);
}

FUSEDLLM_HOST_DEVICE int64_t key_end(const Mask& m, int64_t i) {
  if (m.right < 0) return m.sk;
  return clamp_index(i + m.offset + m.right + 1, 0, m.sk);
}

// Queries [query_begin, query_end) of [0, sq) that see at least one key of
// [j0, j1) (j0 < j1): used to skip query tiles a key tile cannot affect.
FUSEDLLM_HOST_DEVICE int64_t query_begin(const Mask& m, int64_t j0, int64_t sq) {
  if (m.right < 0) return 0;
  return clamp_index(j0 - m.offset - m.right, 0, sq);
}

FUSEDLLM_HOST_DEVICE int64_t query_end(const Mask& m, int64_t j1, int64_t sq) {
  if (m.left < 0) return sq;
  return clamp_index(j1 + m.left - m.offset, 0, sq);
}

// What changes a score besides the masks: soft-capping and ALiBi, applied in
// that order to the scaled score s = scale * q . k of query position i (at
// absolute position i + offset) and key j, before the masks.
struct ScoreMods {
  double softcap = 0;  // > 0: s -> softcap * tanh(s / softcap)
  // ALiBi: s -= slope(b, h) * |i + offset - j|; slopes in the accumulator
  // type at alibi[b * alibi_batch_stride + h] (null: none).
  const void* alibi = nullptr;
  int64_t alibi_batch_stride = 0;
  // Per query head logits joining every row's softmax denominator (the
  // accumulator type; null: none).
  const void* sinks = nullptr;

  FUSEDLLM_HOST_DEVICE bool any_score_mod() const { return softcap > 0 || alibi != nullptr; }
  template <typename acc_t>
  FUSEDLLM_HOST_DEVICE acc_t slope(int64_t b, int64_t h) const {
    return static_cast<const acc_t*>(alibi)[b * alibi_batch_stride + h];
  }
  template <typename acc_t>
  FUSEDLLM_HOST_DEVICE acc_t sink(int64_t h) const {
    return static_cast<const acc_t*>(sinks)[h];
  }
};

// -|p - j| as the accumulator type: what an ALiBi slope multiplies.
template <typename acc_t>
FUSEDLLM_HOST_DEVICE acc_t alibi_distance(int64_t p, int64_t j) {
  return static_cast<acc_t>(p > j ? j - p : p - j);
}

// Folds a sink logit into a finished row whose keys gave log-sum-exp `lse`
// (-inf: no key seen): returns the factor on the row's output, and lse
// becomes that of the keys and the sink. A -inf sink changes nothing.
template <typename acc_t>
FUSEDLLM_HOST_DEVICE acc_t fold_sink(acc_t& lse, acc_t sink) {
  using std::exp;
  using std::log;
  constexpr acc_t kInf = std::numeric_limits<acc_t>::infinity();
  if (sink == -kInf) return acc_t(1);
  if (lse == -kInf) {
    lse = sink;
    return acc_t(0);
  }
  const acc_t m = lse > sink ? lse : sink;
  const acc_t total = m + log(exp(lse - m) + exp(sink - m));
  const acc_t factor = exp(lse - total);
  lse = total;
  return factor;
}

// Scalar operations for the templates below (CUDA kernels, CPU scalar code).
template <typename acc_t>
struct ScalarOps {
  FUSEDLLM_HOST_DEVICE static acc_t max(acc_t a, acc_t b) { return a > b ? a : b; }
  FUSEDLLM_HOST_DEVICE static acc_t exp(acc_t x) {
#if defined(__CUDA_ARCH__) || defined(FUSEDLLM_SIMT)  // device code, run or emulated
    if constexpr (sizeof(acc_t) == 4) {
      return __expf(x);
    } else {
      return ::exp(x);
    }
#else
    return std::exp(x);
#endif
  }
  // x, or 0 where x is -inf (a row that has not seen any key yet).
  FUSEDLLM_HOST_DEVICE static acc_t finite_or_zero(acc_t x) {
    return x == -std::numeric_limits<acc_t>::infinity() ? acc_t(0) : x;
  }
};

// One online-softmax step for a row (or a vector of rows) that has seen
// scores with maximum `running_max` (-inf: none yet) and now sees a tile of
// scores with maximum `tile_max`. Updates running_max, sets `shift` to the
// value to subtract from this tile's scores before exp, and returns the
// factor that rescales the previous sum of exps and the output accumulator.
// A row with no visible key so far keeps shift 0 so exp(-inf - shift) = 0
// instead of NaN.
template <typename V, typename Ops>
FUSEDLLM_HOST_DEVICE V online_softmax_step(V& running_max, V tile_max, V& shift, Ops ops) {
  const V new_max = ops.max(running_max, tile_max);
  shift = ops.finite_or_zero(new_max);
  const V alpha = ops.exp(running_max - shift);
  running_max = new_max;
  return alpha;
}

// log(sum of exp(score)) of a finished row from its running max and sum of
// exp(score - max); -inf for a row that saw no key (its output is 0).
template <typename acc_t>
FUSEDLLM_HOST_DEVICE acc_t row_lse(acc_t running_max, acc_t sum) {
  using std::log;
  return sum > acc_t(0) ? running_max + log(sum) : -std::numeric_limits<acc_t>::infinity();
}

// The factor that turns a finished row's sum of exp(score - max) * value
// into its output: exp(max - lse), lse the log-sum-exp of the row's keys (a
// sink folds in after, fold_sink), or 0 for a row that saw no key (so its
// output is 0, never NaN).
// The backward recomputes each probability as exp(score - lse): this keeps the
// forward's probabilities those to rounding whatever the scores' size (1 / sum
// leaves them off by lse's own rounding, |lse| * 2^-24 in float32), and one
// visible key gives exactly 1 in both.
template <typename acc_t>
FUSEDLLM_HOST_DEVICE acc_t row_norm(acc_t running_max, acc_t sum, acc_t lse) {
  return sum > acc_t(0) ? ScalarOps<acc_t>::exp(running_max - lse) : acc_t(0);
}

// Weight of a partial result with log-sum-exp `part_lse` in a row whose total
// log-sum-exp is `total_lse` (both -inf when the row saw no key at all).
template <typename acc_t>
FUSEDLLM_HOST_DEVICE acc_t merge_weight(acc_t part_lse, acc_t total_lse) {
  using std::exp;
  return total_lse == -std::numeric_limits<acc_t>::infinity() ? acc_t(0) : exp(part_lse - total_lse);
}

// dScore = P * (dP - rowsum(dO * O)), with dP = dO . v_j.
template <typename V>
FUSEDLLM_HOST_DEVICE V score_grad(V p, V dp, V delta) {
  return p * (dp - delta);
}

// What a call's kernels read besides its tensors and sizes: the scale, the
// masks and score modifiers, where each sequence's rows lie, and dropout.
// The op's checked plans (AttentionParams) and the CPU kernels' arguments
// (AttentionCallArgs) both hold one.
struct CallTerms {
  double scale = 1.0;
  Mask mask;
  TensorMask tensor_mask;
  ScoreMods mods;
  Seqs seqs;
  QueryRows rows;
  KeyRows key_rows;
  dropout::Dropout dropout;
};

}  // namespace fusedllm::attn

// The interface between the attention ops (attention.cpp) and their per-ISA
// kernels. Plain pointers and strides, no tensors.
//
// The kernels: attention_forward_kernel.cpp and attention_backward_kernel.cpp
// on the micro-GEMMs of attention_gemm.h (float) and attention_pairs.h, the
// decoding scores of attention_lanes.h and the tile helpers of
// attention_tile.h (masks and the transpose in attention_tile_kernel.cpp).
//
// Layout of the work. A task owns one (batch, kv head) pair and a tile of
// query positions; its rows are the `group` query heads of that kv head at
// each position of the tile, ordered (position, head), so K/V tiles are read
// once for the whole group. Scores are computed transposed, S^T = K Q^T
// (keys x rows), so the per-row softmax statistics are vectors across rows
// and need no horizontal reductions. Both products (K Q^T and P V) run on a
// register-blocked micro-kernel over float32 (float64) tiles; bfloat16 and
// float16 operands are converted to float32 tiles once per tile, except
// bfloat16 in the AVX512_BF16 variant, whose products run on vdpbf16ps over
// operands packed as bfloat16 pairs (attention_pairs.h, attention_pair_words.h).
//
// Backward: a task owns the dK/dV rows of one (batch, kv head) pair (or of a
// strided subset of its key tiles when there are few pairs) and walks every
// query tile of the group, recomputing P from the saved log-sum-exp. dQ of a
// query tile is complete when its task has seen every key tile; with several
// key subsets each writes a partial dQ that is summed in a fixed order after
// the tasks, so the result never depends on the thread count or schedule.

namespace fusedllm::cpu {

// A [batch, heads, seq, head_dim] operand with unit stride along head_dim;
// sequence b's rows start at seq_stride * its Seqs start (batch stride 0 when
// packed).
struct AttentionOperand {
  const void* data = nullptr;
  int64_t batch_stride = 0, head_stride = 0, seq_stride = 0;  // in elements
};

// What forward and backward kernels share: dtype, sizes and the call's terms
// (attn::CallTerms). batch counts the sequences; with packed sequences sq and
// sk are the longest lengths.
struct AttentionCallArgs : attn::CallTerms {
  at::ScalarType dtype;
  int64_t batch, q_heads, kv_heads, sq, sk, head_dim;
  // The scratch of the call, `bytes` of the variant's AttentionWorkspace.
  void* workspace;
};

// Scratch memory a call needs, 64-byte aligned: the first `zeroed` bytes
// must be zero on entry, the rest may hold anything.
struct AttentionWorkspace {
  int64_t zeroed = 0, bytes = 0;
};

// The float32 scale of each key row of int8 or float8 K or V; data null for float K/V.
struct AttentionScales {
  const float* data = nullptr;
  int64_t batch_stride = 0, head_stride = 0, seq_stride = 0;
  bool float8 = false;  // the rows hold float8 e4m3 codes (else int8)
};

struct AttentionForwardArgs : AttentionCallArgs {
  AttentionOperand q, k, v;
  AttentionScales k_scale, v_scale;  // int8 / float8 k and v (then q is float32, bfloat16 or float16)
  attn::Pages pages;                 // paged k and v (and scales): their batch index is the page
  void* out;  // row r (QueryRows) at out + r * D
  void* lse;  // row r at lse[r], float32 (float64 for float64 inputs)
};

struct AttentionBackwardArgs : AttentionCallArgs {
  AttentionOperand grad_out, q, k, v, out;
  const void* lse;  // row r (QueryRows) at lse[r]
  void* grad_q;     // row r at grad_q + r * D
  void* grad_k;     // key row r (KeyRows) at grad_k + r * D
  void* grad_v;     // key row r at grad_v + r * D
};

// A variant: the workspace a call needs (a function of the arguments and
// the thread count), the call on that workspace, and the head dim its
// products take the call at: its own, or a larger one where the variant's
// fast products need whole steps of it (the op then runs the call on copies
// of the operands zero-padded to it: zero columns add nothing to Q K^T, and
// the output's and gradients' extra columns are dropped).
template <typename Args>
struct AttentionKernel {
  AttentionWorkspace (*workspace)(const Args&);
  void (*run)(const Args&);
  int64_t (*head_dim)(const Args&);
};
using AttentionForwardKernel = AttentionKernel<AttentionForwardArgs>;
using AttentionBackwardKernel = AttentionKernel<AttentionBackwardArgs>;
using AttentionForwardFn = const AttentionForwardKernel*;
using AttentionBackwardFn = const AttentionBackwardKernel*;

extern KernelTable<AttentionForwardFn> attention_forward_kernels;
extern KernelTable<AttentionBackwardFn> attention_backward_kernels;

}  // namespace fusedllm::cpu
