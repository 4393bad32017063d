// Mixture-of-experts math shared by the CPU kernels and the CUDA kernels: the
// router of one token (scores, group-limited top-k choice, weights) and its
// gradient, and the row moves between token order and expert order.
//
// Routing one token with logits z over E experts:
//   scores  s = softmax(z) ("softmax") or sigmoid(z) ("sigmoid");
//   choice  c = s + bias (bias only steers the choice); with G > 1 groups of
//           E / G experts, each group is scored by the sum of its two best c
//           and only the best `top_groups` groups stay eligible;
//   picks   the k largest eligible c, larger first, the lower index first
//           among equals (a NaN is passed over while any number remains);
//   weights w_j = scaling * s[i_j] / D, D = sum_j s[i_j] (+ 1e-20 under a
//           sigmoid, as DeepSeek-V3) when normalizing, else D = 1.
// The gradient: dL/ds[i_j] = scaling * (g_j - sum_l g_l w_l / scaling) / D
// (normalizing; scaling * g_j otherwise), then through the scores: softmax
// dz = s * (ds - <ds, s>), sigmoid dz = ds * s * (1 - s).
#pragma once

#include <cstdint>
#include <limits>

#include "fusedllm/activations.h"
#include "fusedllm/macros.h"

namespace fusedllm::moe {

enum class Scoring : int { kSoftmax = 0, kSigmoid = 1 };

// The products of the experts' grouped multiplies (CPU: csrc/moe.cpp,
// CUDA: grouped_gemm.cuh); the rows of group e are offsets[e] .. offsets[e + 1].
enum class GroupedProduct {
  kRowsTimesWeightT,  // out[r] = a[r] @ b[e]^T            a [S, K], b [E, N, K], out [S, N]
  kRowsTimesWeight,   // out[r] = a[r] @ b[e]              a [S, K], b [E, K, N], out [S, N]
  kWeightGradient,    // out[e] = a[rows_e]^T @ b[rows_e]  a [S, M], b [S, N], out [E, M, N]
};

// The experts' gated activation of a gate/up row of 2I values into I values:
// gate and up as the halves [gate | up] or interleaved (gate at 2i, up at
// 2i + 1: gpt-oss); act(gate) * up with silu or gelu_tanh, or gpt-oss's
// clamped SwiGLU (act::gpt_oss_gated, with alpha and limit).
enum class Gate : int { kSilu = 0, kGeluTanh = 1, kGptOss = 2 };

struct Gating {
  Gate gate = Gate::kSilu;
  bool interleaved = false;
  double alpha = FUSEDLLM_GPT_OSS_ALPHA, limit = FUSEDLLM_GPT_OSS_LIMIT;
};

// Where the gate and the up value of output column c sit in a gate/up row.
FUSEDLLM_HOST_DEVICE int64_t gate_column(const Gating& o, int64_t c) {
  return o.interleaved ? 2 * c : c;
}
FUSEDLLM_HOST_DEVICE int64_t up_column(const Gating& o, int64_t c, int64_t inter) {
  return o.interleaved ? 2 * c + 1 : inter + c;
}

template <typename Math, typename A>
FUSEDLLM_HOST_DEVICE A gated_value(const Gating& o, A gate, A up) {
  switch (o.gate) {
    case Gate::kSilu: return act::gated<act::Activation::kSilu, Math>(gate, up);
    case Gate::kGeluTanh: return act::gated<act::Activation::kGeluTanh, Math>(gate, up);
    default: return act::gpt_oss_gated<Math>(gate, up, static_cast<A>(o.alpha), static_cast<A>(o.limit));
  }
}

template <typename Math, typename A>
FUSEDLLM_HOST_DEVICE void gated_value_grad(const Gating& o, A dh, A gate, A up, A& grad_gate,
                                           A& grad_up) {
  switch (o.gate) {
    case Gate::kSilu:
      act::gated_grad<act::Activation::kSilu, Math>(dh, gate, up, grad_gate, grad_up);
      break;
    case Gate::kGeluTanh:
      act::gated_grad<act::Activation::kGeluTanh, Math>(dh, gate, up, grad_gate, grad_up);
      break;
    default:
      act::gpt_oss_gated_grad<Math>(dh, gate, up, static_cast<A>(o.alpha), static_cast<A>(o.limit),
                                    grad_gate, grad_up);
  }
}

// Columns c = first, first + step, ... < inter of one row: out = the gated
// activation of the gate/up row gu (forward), or grad_gu = its gradient
// from the activation's gradient g (backward), in A.
template <typename Math, typename A, typename T>
FUSEDLLM_HOST_DEVICE void gated_row(const Gating& o, T* out, const T* gu, int64_t inter,
                                    int64_t first, int64_t step) {
  for (int64_t c = first; c < inter; c += step) {
    const A gate = static_cast<A>(gu[gate_column(o, c)]);
    const A up = static_cast<A>(gu[up_column(o, c, inter)]);
    out[c] = static_cast<T>(gated_value<Math>(o, gate, up));
  }
}

template <typename Math, typename A, typename T>
FUSEDLLM_HOST_DEVICE void gated_row_backward(const Gating& o, T* grad_gu, const T* g, const T* gu,
                                             int64_t inter, int64_t first, int64_t step) {
  for (int64_t c = first; c < inter; c += step) {
    const int64_t gc = gate_column(o, c), uc = up_column(o, c, inter);
    A grad_gate, grad_up;
    gated_value_grad<Math>(o, static_cast<A>(g[c]), static_cast<A>(gu[gc]), static_cast<A>(gu[uc]),
                           grad_gate, grad_up);
    grad_gu[gc] = static_cast<T>(grad_gate);
    grad_gu[uc] = static_cast<T>(grad_up);
  }
}

struct RouteOptions {
  Scoring scoring = Scoring::kSoftmax;
  bool normalize = true;
  int64_t experts = 0, top_k = 0, groups = 1, top_groups = 1;
  double scaling = 1.0;
};

// The index of the largest c[e] over e in [begin, end) with eligible(e), the
// lower index first among equals; -1 when none is eligible.
template <typename A, typename Eligible>
FUSEDLLM_HOST_DEVICE int64_t best_of(const A* c, int64_t begin, int64_t end, Eligible eligible) {
  int64_t best = -1;
  for (int64_t e = begin; e < end; ++e) {
    if (!eligible(e)) continue;
    // A NaN never wins against a number, and is taken only when nothing else is left.
    if (best < 0 || c[e] > c[best] || (c[best] != c[best] && c[e] == c[e])) best = e;
  }
  return best;
}

// One token's scores s[E] from its logits z: softmax or sigmoid.
template <typename Math, typename A, typename T>
FUSEDLLM_HOST_DEVICE void scores(const T* z, const RouteOptions& o, A* s) {
  const int64_t n = o.experts;
  if (o.scoring == Scoring::kSigmoid) {
    for (int64_t e = 0; e < n; ++e) s[e] = A(1) / (A(1) + Math::exp(-static_cast<A>(z[e])));
    return;
  }
  A m = static_cast<A>(z[0]);
  for (int64_t e = 1; e < n; ++e) m = static_cast<A>(z[e]) > m ? static_cast<A>(z[e]) : m;
  A sum = A(0);
  for (int64_t e = 0; e < n; ++e) {
    s[e] = Math::exp(static_cast<A>(z[e]) - m);
    sum += s[e];
  }
  for (int64_t e = 0; e < n; ++e) s[e] /= sum;
}

// Routes one token. `z` its logits (stride 1), `bias` [E] or null; `work`
// 2 * E values of scratch (scores, then the choice values); `taken` E bytes of
// scratch. Writes k weights and indices.
template <typename Math, typename A, typename T>
FUSEDLLM_HOST_DEVICE void route_row(const T* z, const A* bias, const RouteOptions& o, A* work,
                                    unsigned char* taken, A* weights, int64_t* indices) {
  const int64_t n = o.experts;
  A* s = work;
  A* c = work + n;
  scores<Math>(z, o, s);
  for (int64_t e = 0; e < n; ++e) {
    c[e] = bias ? s[e] + bias[e] : s[e];
    taken[e] = 0;
  }
  // taken: 0 eligible, 1 chosen, 2 in a group left out. The groups are kept
  // one at a time, the best remaining first.
  if (o.groups > 1) {
    const int64_t size = n / o.groups;
    for (int64_t e = 0; e < n; ++e) taken[e] = 2;
    for (int64_t round = 0; round < o.top_groups; ++round) {
      int64_t kept = -1;
      A kept_score = A(0);
      for (int64_t g = 0; g < o.groups; ++g) {
        const int64_t b = g * size, end = b + size;
        if (taken[b] == 0) continue;
        const int64_t first = best_of(c, b, end, [](int64_t) { return true; });
        const int64_t second = best_of(c, b, end, [&](int64_t e) { return e != first; });
        const A score = second < 0 ? c[first] : c[first] + c[second];
        if (kept < 0 || score > kept_score || (kept_score != kept_score && score == score)) {
          kept = g;
          kept_score = score;
        }
      }
      for (int64_t e = kept * size; e < (kept + 1) * size; ++e) taken[e] = 0;
    }
  }
  A total = A(0);
  for (int64_t j = 0; j < o.top_k; ++j) {
    const int64_t e = best_of(c, 0, n, [&](int64_t i) { return taken[i] == 0; });
    taken[e] = 1;
    indices[j] = e;
    weights[j] = s[e];
    total += s[e];
  }
  const A denominator =
      o.normalize ? total + (o.scoring == Scoring::kSigmoid ? A(1e-20) : A(0)) : A(1);
  const A factor = static_cast<A>(o.scaling) / denominator;
  for (int64_t j = 0; j < o.top_k; ++j) weights[j] *= factor;
}

// The gradient of one token's router logits from the gradient of its weights
// `g` [k]. `s` is E values of scratch (the scores); writes all E of dz.
template <typename Math, typename A, typename T, typename G>
FUSEDLLM_HOST_DEVICE void route_row_backward(const T* z, const int64_t* indices, const G* g,
                                             const RouteOptions& o, A* s, T* dz) {
  const int64_t n = o.experts;
  scores<Math>(z, o, s);
  const A scaling = static_cast<A>(o.scaling);
  A denominator = A(1), gw = A(0);
  if (o.normalize) {
    A total = A(0);
    for (int64_t j = 0; j < o.top_k; ++j) total += s[indices[j]];
    denominator = total + (o.scoring == Scoring::kSigmoid ? A(1e-20) : A(0));
    for (int64_t j = 0; j < o.top_k; ++j) gw += static_cast<A>(g[j]) * s[indices[j]];
    gw /= denominator;  // sum_l g_l w_l / scaling
  }
  // dL/ds at the chosen experts: ds_j; <ds, s> for the softmax.
  A dot = A(0);
  for (int64_t j = 0; j < o.top_k; ++j) {
    const A ds = scaling * (static_cast<A>(g[j]) - gw) / denominator;
    dot += ds * s[indices[j]];
  }
  for (int64_t e = 0; e < n; ++e) {
    dz[e] = static_cast<T>(o.scoring == Scoring::kSoftmax ? -s[e] * dot : A(0));
  }
  for (int64_t j = 0; j < o.top_k; ++j) {
    const int64_t e = indices[j];
    const A ds = scaling * (static_cast<A>(g[j]) - gw) / denominator;
    const A v = o.scoring == Scoring::kSoftmax ? s[e] * (ds - dot) : ds * s[e] * (A(1) - s[e]);
    dz[e] = static_cast<T>(v);
  }
}

// Row p of the expert-ordered rows: source row order[p] / k of `src`, scaled by
// weights[order[p]] when weights is given. Columns h = first, first + step, ...
template <typename A, typename T, typename W>
FUSEDLLM_HOST_DEVICE void gather_row(T* dst, const T* src_row, const W* weight, int64_t cols,
                                     int64_t first, int64_t step) {
  if (weight == nullptr) {
    for (int64_t h = first; h < cols; h += step) dst[h] = src_row[h];
  } else {
    const A w = static_cast<A>(*weight);
    for (int64_t h = first; h < cols; h += step) dst[h] = static_cast<T>(w * static_cast<A>(src_row[h]));
  }
}

// Token t's row: the sum over its k choices j, in order, of (weights[t, j] or
// 1) * src[position[t * k + j]], accumulated in A. A negative position marks
// an expert index out of range (the CUDA sort's; the CPU refuses them first):
// the row becomes NaN.
template <typename A, typename T, typename W>
FUSEDLLM_HOST_DEVICE void combine_row(T* dst, const T* src, int64_t src_stride,
                                      const int64_t* position, const W* weights, int64_t k,
                                      int64_t cols, int64_t first, int64_t step) {
  bool valid = true;
  for (int64_t j = 0; j < k; ++j) valid = valid && position[j] >= 0;
  for (int64_t h = first; h < cols; h += step) {
    A acc = A(0);
    for (int64_t j = 0; valid && j < k; ++j) {
      const A v = static_cast<A>(src[position[j] * src_stride + h]);
      acc += weights ? static_cast<A>(weights[j]) * v : v;
    }
    dst[h] = static_cast<T>(valid ? acc : std::numeric_limits<A>::quiet_NaN());
  }
}

}  // namespace fusedllm::moe
