// Attention math shared by the CPU kernels (scalar and Vectorized<float/double>
// lanes) and the CUDA kernels: where a query row lives, which keys a query
// sees, the online-softmax update, the log-sum-exp of a finished row, merging
// partial results and the score gradient. Functions templated on `V` take an
// `Ops` policy for max / exp / select, so the CPU kernels can run them on whole
// vectors of rows.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "fusedllm/macros.h"

namespace fusedllm::attn {

// Where a query row lives. The [B, Hq, Sq] rows (outputs, log-sum-exp, delta,
// dropout draws) are numbered row-major; the kernels walk the rows of one
// (batch, kv head g) pair in (position, query head) order, so one K/V tile
// serves the whole group: group row r is position r / group of query head
// g * group + r % group. Query head h reads kv head h / group (GQA).
struct QueryRows {
  int64_t q_heads = 0;
  int64_t group = 1;  // query heads per kv head
  int64_t sq = 0;

  // Flat [B, Hq, Sq] row of (batch b, query head h, position pos), and back.
  FUSEDLLM_HOST_DEVICE int64_t row(int64_t b, int64_t h, int64_t pos) const {
    return (b * q_heads + h) * sq + pos;
  }
  FUSEDLLM_HOST_DEVICE int64_t batch(int64_t row) const { return row / sq / q_heads; }
  FUSEDLLM_HOST_DEVICE int64_t head(int64_t row) const { return row / sq % q_heads; }
  FUSEDLLM_HOST_DEVICE int64_t pos(int64_t row) const { return row % sq; }
  FUSEDLLM_HOST_DEVICE int64_t kv_head(int64_t h) const { return h / group; }

  // Rows of one (batch, kv head) pair: sq positions times the group's heads.
  FUSEDLLM_HOST_DEVICE int64_t group_rows() const { return sq * group; }
  FUSEDLLM_HOST_DEVICE int64_t group_pos(int64_t r) const { return r / group; }
  FUSEDLLM_HOST_DEVICE int64_t group_head(int64_t g, int64_t r) const { return g * group + r % group; }
  // First group row of position pos (its rows are [pos * group, (pos + 1) * group)).
  FUSEDLLM_HOST_DEVICE int64_t group_row(int64_t pos) const { return pos * group; }
  // Flat row of group row r of kv head g in batch b.
  FUSEDLLM_HOST_DEVICE int64_t row_of_group_row(int64_t b, int64_t g, int64_t r) const {
    return row(b, group_head(g, r), group_pos(r));
  }
};

// Visibility of key j to query i. Query i sits at absolute position
// p = i + offset with offset = Sk - Sq (queries are the last Sq positions of
// the Sk keys: bottom-right alignment, what decoding with a KV cache needs).
//   causal:     j <= p
//   window w:   j >  p - w   (w keys up to and including p; -1: no window)
struct Mask {
  int64_t sk = 0;
  int64_t offset = 0;
  int64_t window = -1;
  bool causal = false;
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
  if (m.window < 0) return 0;
  return clamp_index(i + m.offset - m.window + 1, 0, m.sk);
}

FUSEDLLM_HOST_DEVICE int64_t key_end(const Mask& m, int64_t i) {
  if (!m.causal) return m.sk;
  return clamp_index(i + m.offset + 1, 0, m.sk);
}

// Queries [query_begin, query_end) of [0, sq) that see at least one key of
// [j0, j1) (j0 < j1): used to skip query tiles a key tile cannot affect.
FUSEDLLM_HOST_DEVICE int64_t query_begin(const Mask& m, int64_t j0, int64_t sq) {
  if (!m.causal) return 0;
  return clamp_index(j0 - m.offset, 0, sq);
}

FUSEDLLM_HOST_DEVICE int64_t query_end(const Mask& m, int64_t j1, int64_t sq) {
  if (m.window < 0) return sq;
  return clamp_index(j1 - 1 + m.window - m.offset, 0, sq);
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

// 1 / sum, or 0 for a row that saw no key (so its output is 0, never NaN).
template <typename acc_t>
FUSEDLLM_HOST_DEVICE acc_t row_inv_sum(acc_t sum) {
  return sum > acc_t(0) ? acc_t(1) / sum : acc_t(0);
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

}  // namespace fusedllm::attn
