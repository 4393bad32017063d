// The mixture-of-experts ops, shared by the CPU and CUDA implementations:
// argument checks and the flow of the experts op. The rows of the (token,
// choice) pairs are put in expert order by a stable counting sort, each
// expert's rows go through its gate/up multiply (plus its bias), the gated
// activation (the swiglu op; moe::gated_row for interleaved gate/up and
// gpt-oss's clamped SwiGLU) and its down multiply (plus its bias) as grouped
// products over contiguous row ranges, and each token's outputs are summed in
// choice order. Backward runs the same products transposed, recomputing the
// activation from the saved gate/up rows; a bias's gradient is the sum of its
// expert's rows of the product's output gradient.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "fusedllm/checks.h"
#include "fusedllm/moe.h"
#include "fusedllm/swiglu_op.h"

namespace fusedllm {

// The schemas of moe's operators, for torch.ops.fusedllm (csrc/moe.cpp) and the
// emulated torch.ops.fusedllm_simt (csrc/cuda/moe.cu).
inline void define_moe_ops(torch::Library& m) {
  // Mixture-of-experts routing: router_logits [T, E] to the top_k experts of
  // each token and their weights (float32, float64 for float64 logits; int64
  // indices), scoring "softmax" or "sigmoid", correction_bias steering the
  // choice only, num_groups / top_groups the group-limited choice.
  m.def("moe_route(Tensor router_logits, int top_k, str scoring, bool normalize, "
        "Tensor? correction_bias, int num_groups, int top_groups, float scaling)"
        " -> (Tensor weights, Tensor indices)");
  m.def("moe_route_backward(Tensor grad_weights, Tensor router_logits, Tensor indices, "
        "str scoring, bool normalize, float scaling) -> Tensor");
  // Each token of hidden [T, H] through its experts indices [T, k] (gate_up_proj
  // [E, 2I, H], the gated activation, down_proj [E, H, I]), summed with weights
  // [T, k]. Also returns what backward needs, in expert order: order and
  // position (the permutation of the T * k pairs and its inverse), offsets
  // [E + 1] (each expert's rows), gate_up [T * k, 2I] and expert_out [T * k, H].
  // Without save_for_backward, gate_up is [0, 2I] and expert_out [0, H]:
  // neither is ever whole (what inference needs). gate_up_bias [E, 2I] and
  // down_bias [E, H] are added to each expert's products; transposed: the
  // weights are gate_up_proj [E, H, 2I] and down_proj [E, I, H] (gpt-oss);
  // interleaved: gate and up alternate along 2I (gate at even columns)
  // instead of [gate | up]; activation "silu", "gelu_tanh", or "gpt_oss"
  // (gate clamped above at limit, up to [-limit, limit],
  // (up + 1) * gate * sigmoid(alpha * gate)).
  m.def("moe_experts(Tensor hidden, Tensor indices, Tensor weights, Tensor gate_up_proj, "
        "Tensor down_proj, str activation, bool save_for_backward, Tensor? gate_up_bias=None, "
        "Tensor? down_bias=None, bool transposed=False, bool interleaved=False, "
        "float alpha=" FUSEDLLM_STRING(FUSEDLLM_GPT_OSS_ALPHA) ", "
        "float limit=" FUSEDLLM_STRING(FUSEDLLM_GPT_OSS_LIMIT) ") -> (Tensor out, "
        "Tensor order, Tensor position, Tensor offsets, Tensor gate_up, Tensor expert_out)");
  // Gradients as output_mask asks (hidden, weights, gate_up_proj, down_proj)
  // and bias_mask (gate_up_bias, down_bias, where given); [0] for the others.
  m.def("moe_experts_backward(Tensor grad_out, Tensor hidden, Tensor indices, Tensor weights, "
        "Tensor gate_up_proj, Tensor down_proj, Tensor order, Tensor position, Tensor offsets, "
        "Tensor gate_up, Tensor expert_out, str activation, bool[4] output_mask, "
        "Tensor? gate_up_bias=None, Tensor? down_bias=None, bool transposed=False, "
        "bool interleaved=False, float alpha=" FUSEDLLM_STRING(FUSEDLLM_GPT_OSS_ALPHA) ", "
        "float limit=" FUSEDLLM_STRING(FUSEDLLM_GPT_OSS_LIMIT) ", "
        "bool[2] bias_mask=[False, False]) -> (Tensor grad_hidden, Tensor grad_weights, "
        "Tensor grad_gate_up_proj, Tensor grad_down_proj, Tensor grad_gate_up_bias, "
        "Tensor grad_down_bias)");
}

using moe::GroupedProduct;

// Scorings: fusedllm._limits.MOE_SCORINGS (tests/test_limits.py).
inline moe::Scoring parse_scoring(std::string_view scoring, const char* op) {
  if (scoring == "softmax") return moe::Scoring::kSoftmax;
  if (scoring == "sigmoid") return moe::Scoring::kSigmoid;
  TORCH_CHECK_VALUE(false, op, ": scoring must be 'softmax' or 'sigmoid', got '",
                    std::string(scoring), "'");
}

inline moe::RouteOptions check_moe_route(const char* op, const at::Tensor& logits, int64_t top_k,
                                         std::string_view scoring, bool normalize,
                                         const std::optional<at::Tensor>& bias, int64_t groups,
                                         int64_t top_groups, double scaling) {
  check_float_tensor(logits, op, "router_logits");
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.size(1) >= 1, op,
                    ": router_logits must be [tokens, num_experts], got shape ", logits.sizes());
  const int64_t experts = logits.size(1);
  TORCH_CHECK_VALUE(top_k >= 1 && top_k <= experts, op, ": top_k must be in [1, num_experts = ",
                    experts, "], got ", top_k);
  moe::RouteOptions o;
  o.scoring = parse_scoring(scoring, op);
  if (bias.has_value()) {
    check_float_tensor(*bias, op, "correction_bias");
    TORCH_CHECK_VALUE(bias->device() == logits.device(), op, ": correction_bias is on ",
                      bias->device(), " but router_logits is on ", logits.device());
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == experts, op,
                      ": correction_bias must be [", experts, "] (one per expert), got shape ",
                      bias->sizes());
  }
  TORCH_CHECK_VALUE(groups >= 1 && experts % groups == 0, op,
                    ": num_groups must be a positive divisor of num_experts = ", experts, ", got ",
                    groups);
  TORCH_CHECK_VALUE(top_groups >= 1 && top_groups <= groups, op,
                    ": top_groups must be in [1, num_groups = ", groups, "], got ", top_groups);
  TORCH_CHECK_VALUE(top_k <= top_groups * (experts / groups), op, ": top_k = ", top_k,
                    " is more than the ", top_groups * (experts / groups),
                    " experts of the top_groups = ", top_groups, " groups kept");
  TORCH_CHECK_VALUE(std::isfinite(scaling), op, ": scaling must be finite, got ", scaling);
  o.normalize = normalize;
  o.experts = experts;
  o.top_k = top_k;
  o.groups = groups;
  o.top_groups = top_groups;
  o.scaling = scaling;
  return o;
}

// The accumulation type of rows of T.
template <typename T>
using MoeAcc = std::conditional_t<std::is_same_v<T, double>, double, float>;

// fn(the weights' data) for routing weights in the rows' dtype T or in their
// accumulation dtype; fn(null) for none (every weight 1).
template <typename T, typename Fn>
void with_moe_weights(const at::Tensor& weights, Fn&& fn) {
  if (!weights.defined()) {
    fn(static_cast<const T*>(nullptr));
  } else if (weights.scalar_type() == c10::CppTypeToScalarType<T>::value) {
    fn(weights.const_data_ptr<T>());
  } else {
    fn(weights.const_data_ptr<MoeAcc<T>>());
  }
}

struct MoeShape {
  int64_t tokens = 0, hidden = 0, top_k = 0, experts = 0, inter = 0;
};

// Activations of the experts: fusedllm._limits.MOE_ACTIVATIONS (tests/test_limits.py).
inline moe::Gate parse_moe_activation(std::string_view activation, const char* op) {
  if (activation == "silu") return moe::Gate::kSilu;
  if (activation == "gelu_tanh") return moe::Gate::kGeluTanh;
  if (activation == "gpt_oss") return moe::Gate::kGptOss;
  TORCH_CHECK_VALUE(false, op, ": activation must be 'silu', 'gelu_tanh' or 'gpt_oss', got '",
                    std::string(activation), "'");
}

// The experts' weights as the kernels read them. Not transposed (Mixtral and
// most): gate_up_proj [E, 2I, H], down_proj [E, H, I]; transposed (gpt-oss):
// gate_up_proj [E, H, 2I], down_proj [E, I, H], each read where it lies.
// gate_up_bias [E, 2I] and down_bias [E, H] (contiguous) are added to the
// products' rows of their expert; undefined when absent.
struct MoeExpertWeights {
  at::Tensor gate_up_proj, down_proj, gate_up_bias, down_bias;
  bool transposed = false;
  moe::Gating gating;
  std::string activation;  // the name, for the swiglu ops

  // The product of rows by the gate/up (down) weights, and the one of rows
  // by their transposes (the input gradients).
  GroupedProduct forward_product() const {
    return transposed ? GroupedProduct::kRowsTimesWeight : GroupedProduct::kRowsTimesWeightT;
  }
  GroupedProduct gradient_product() const {
    return transposed ? GroupedProduct::kRowsTimesWeightT : GroupedProduct::kRowsTimesWeight;
  }
  // Gates the swiglu ops compute ([gate | up] halves, silu or gelu_tanh).
  bool swiglu_layout() const { return !gating.interleaved && gating.gate != moe::Gate::kGptOss; }
};

inline MoeShape check_moe_experts(const char* op, const at::Tensor& hidden,
                                  const at::Tensor& indices, const at::Tensor& weights,
                                  const at::Tensor& gate_up_proj, const at::Tensor& down_proj,
                                  std::string_view activation,
                                  const std::optional<at::Tensor>& gate_up_bias = std::nullopt,
                                  const std::optional<at::Tensor>& down_bias = std::nullopt,
                                  bool transposed = false, double alpha = FUSEDLLM_GPT_OSS_ALPHA,
                                  double limit = FUSEDLLM_GPT_OSS_LIMIT) {
  check_float_tensor(hidden, op, "hidden");
  TORCH_CHECK_VALUE(hidden.dim() == 2, op, ": hidden must be [tokens, hidden_size], got shape ",
                    hidden.sizes());
  MoeShape s;
  s.tokens = hidden.size(0);
  s.hidden = hidden.size(1);
  TORCH_CHECK_VALUE(indices.scalar_type() == at::kLong, op,
                    ": indices must hold int64 expert indices, got ",
                    dtype_name(indices.scalar_type()));
  TORCH_CHECK_VALUE(indices.device() == hidden.device(), op, ": indices is on ", indices.device(),
                    " but hidden is on ", hidden.device());
  TORCH_CHECK_VALUE(indices.dim() == 2 && indices.size(0) == s.tokens && indices.size(1) >= 1, op,
                    ": indices must be [", s.tokens, ", top_k] (hidden's tokens), got shape ",
                    indices.sizes());
  s.top_k = indices.size(1);
  const at::ScalarType acc = accumulation_dtype(hidden.scalar_type());
  TORCH_CHECK_VALUE(weights.scalar_type() == hidden.scalar_type() || weights.scalar_type() == acc,
                    op, ": weights must have hidden's dtype ", dtype_name(hidden.scalar_type()),
                    acc == hidden.scalar_type() ? "" : " or " + dtype_name(acc), ", got ",
                    dtype_name(weights.scalar_type()));
  TORCH_CHECK_VALUE(weights.device() == hidden.device(), op, ": weights is on ", weights.device(),
                    " but hidden is on ", hidden.device());
  TORCH_CHECK_VALUE(weights.sizes() == indices.sizes(), op, ": weights must have indices' shape ",
                    indices.sizes(), ", got ", weights.sizes());
  check_same(hidden, "hidden", gate_up_proj, "gate_up_proj", op);
  check_same(hidden, "hidden", down_proj, "down_proj", op);
  // gate_up_proj [E, 2I, H], or [E, H, 2I] transposed.
  const int64_t gu_in = transposed ? 1 : 2, gu_out = transposed ? 2 : 1;
  TORCH_CHECK_VALUE(gate_up_proj.dim() == 3 && gate_up_proj.size(0) >= 1 &&
                        gate_up_proj.size(gu_out) % 2 == 0 && gate_up_proj.size(gu_in) == s.hidden,
                    op, ": gate_up_proj must be ",
                    transposed ? "[num_experts, " : "[num_experts, 2 * intermediate, ",
                    transposed ? std::to_string(s.hidden) + ", 2 * intermediate]"
                               : std::to_string(s.hidden) + "]",
                    " (hidden's last dim", transposed ? "; transposed=True" : "", "), got shape ",
                    gate_up_proj.sizes());
  s.experts = gate_up_proj.size(0);
  s.inter = gate_up_proj.size(gu_out) / 2;
  const auto down_shape = transposed ? std::vector<int64_t>{s.experts, s.inter, s.hidden}
                                     : std::vector<int64_t>{s.experts, s.hidden, s.inter};
  TORCH_CHECK_VALUE(down_proj.sizes() == at::IntArrayRef(down_shape), op, ": down_proj must be ",
                    at::IntArrayRef(down_shape),
                    transposed ? " (num_experts, intermediate, hidden_size; transposed=True)"
                               : " (num_experts, hidden_size, intermediate)",
                    ", got shape ", down_proj.sizes());
  if (gate_up_bias.has_value()) {
    check_same(hidden, "hidden", *gate_up_bias, "gate_up_bias", op);
    TORCH_CHECK_VALUE(gate_up_bias->sizes() == at::IntArrayRef({s.experts, 2 * s.inter}), op,
                      ": gate_up_bias must be [", s.experts, ", ", 2 * s.inter,
                      "] (num_experts, 2 * intermediate), got shape ", gate_up_bias->sizes());
  }
  if (down_bias.has_value()) {
    check_same(hidden, "hidden", *down_bias, "down_bias", op);
    TORCH_CHECK_VALUE(down_bias->sizes() == at::IntArrayRef({s.experts, s.hidden}), op,
                      ": down_bias must be [", s.experts, ", ", s.hidden,
                      "] (num_experts, hidden_size), got shape ", down_bias->sizes());
  }
  parse_moe_activation(activation, op);
  TORCH_CHECK_VALUE(std::isfinite(alpha), op, ": alpha must be finite, got ", alpha);
  TORCH_CHECK_VALUE(limit > 0, op, ": limit must be positive (inf: no clamp), got ", limit);
  // An index out of range would read past the weights: refused here where the
  // check costs no device synchronisation; on CUDA that token's output is NaN.
  if (!indices.is_cuda() && indices.numel() > 0) {
    const at::Tensor bad = (indices < 0) | (indices >= s.experts);
    if (bad.any().item<bool>()) {
      const at::Tensor first = bad.nonzero()[0];
      const int64_t t = first[0].item<int64_t>(), j = first[1].item<int64_t>();
      TORCH_CHECK_VALUE(false, op, ": indices[", t, ", ", j, "] = ", indices[t][j].item<int64_t>(),
                        " is not an expert index in [0, ", s.experts, ")");
    }
  }
  return s;
}

inline MoeExpertWeights moe_expert_weights(const at::Tensor& gate_up_proj, const at::Tensor& down_proj,
                                           const std::optional<at::Tensor>& gate_up_bias,
                                           const std::optional<at::Tensor>& down_bias,
                                           c10::string_view activation, bool transposed,
                                           bool interleaved, double alpha, double limit) {
  MoeExpertWeights w;
  w.gate_up_proj = gate_up_proj;
  w.down_proj = down_proj;
  w.gate_up_bias = gate_up_bias.has_value() ? gate_up_bias->contiguous() : at::Tensor();
  w.down_bias = down_bias.has_value() ? down_bias->contiguous() : at::Tensor();
  w.transposed = transposed;
  w.gating.gate = parse_moe_activation(activation, "fusedllm.moe_experts");
  w.gating.interleaved = interleaved;
  w.gating.alpha = alpha;
  w.gating.limit = limit;
  w.activation = std::string(activation);
  return w;
}

// Impl provides:
//   kOps: the operator namespace of its device ("fusedllm" or "fusedllm_simt"),
//     whose swiglu ops give the gated activation;
//   route(logits, bias (accumulation dtype) or undefined, options, weights, indices) and
//   route_backward(grad_weights, logits, indices, options, grad_logits): the
//     router rows (moe::route_row, moe::route_row_backward);
//   sort(flat_indices [S], experts, order [S], position [S], offsets [E + 1]):
//     order[p] = the pair (t * k + j) at expert-ordered row p, stable;
//     position its inverse; offsets the groups' bounds;
//   gather(dst [S, H], src [T, H], order, k, weights or undefined): dst[p] =
//     (weights[order[p]] or 1) * src[order[p] / k];
//   combine(dst [T, H], src [S, H], position, k, weights or undefined):
//     dst[t] = sum_j (weights[t, j] or 1) * src[position[t * k + j]];
//   weights_grad(grad [T, k] accumulation dtype, grad_out [T, H], src [S, H],
//     position): grad[t, j] = <grad_out[t], src[position[t * k + j]]>;
//   grouped_mm(out, a, b, offsets, GroupedProduct, bias): bias [E, N]
//     (contiguous) or undefined, added to the rows of each group (the row
//     products only);
//   group_sum(out [E, N], src [S, N], offsets): out[e] = the sum of group e's
//     rows (a bias gradient), zeros for an empty group;
//   gated(out [S, I], gate_up [S, 2I], gating) and gated_backward(grad_gate_up
//     [S, 2I], grad [S, I], gate_up, gating): the gated activation of
//     moe::gated_row for the gatings the swiglu ops do not compute;
//   expert_mlp(expert_out [S, H], gate_up [S, 2I] or [0, 2I], hidden [T, H],
//     order, offsets, k, MoeExpertWeights, rows): the experts' gated MLPs of
//     the expert-ordered rows (hidden[order[p] / k]), keeping the gate/up
//     rows when gate_up has them, each gathered row, gate/up row and
//     activation made about `rows` rows at a time;
//   expert_mlp_combined(out [T, H], hidden, order, position, offsets, k,
//     weights, MoeExpertWeights, rows): the same summed into out with the
//     routing weights (no backward to feed: the experts' output rows need
//     not all exist at once).
template <typename Impl>
struct MoeOps {
  static std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& logits, int64_t top_k,
                                                  c10::string_view scoring, bool normalize,
                                                  const std::optional<at::Tensor>& bias,
                                                  int64_t groups, int64_t top_groups,
                                                  double scaling) {
    const auto o = check_moe_route("fusedllm.moe_route", logits, top_k, scoring, normalize, bias,
                                   groups, top_groups, scaling);
    const int64_t tokens = logits.size(0);
    at::Tensor weights = at::empty({tokens, top_k},
                                   logits.options().dtype(accumulation_dtype(logits.scalar_type())));
    at::Tensor indices = at::empty({tokens, top_k}, logits.options().dtype(at::kLong));
    if (tokens == 0) return {weights, indices};
    // The bias (a few values) in the accumulation dtype, as the kernels read it.
    const at::Tensor b = bias.has_value() ? bias->to(weights.scalar_type()).contiguous() : at::Tensor();
    Impl::route(logits.contiguous(), b, o, weights, indices);
    return {weights, indices};
  }

  static at::Tensor route_backward(const at::Tensor& grad_weights, const at::Tensor& logits,
                                   const at::Tensor& indices, c10::string_view scoring,
                                   bool normalize, double scaling) {
    const char* op = "fusedllm.moe_route_backward";
    moe::RouteOptions o;
    o.scoring = parse_scoring(scoring, op);
    o.normalize = normalize;
    o.experts = logits.size(1);
    o.top_k = indices.size(1);
    o.scaling = scaling;
    TORCH_CHECK_VALUE(grad_weights.sizes() == indices.sizes() && indices.size(0) == logits.size(0),
                      op, ": grad_weights ", grad_weights.sizes(), " and indices ",
                      indices.sizes(), " must be [", logits.size(0), ", top_k]");
    at::Tensor grad = at::empty(logits.sizes(), logits.options());
    if (logits.size(0) == 0) return grad;
    Impl::route_backward(grad_weights.contiguous(), logits.contiguous(), indices.contiguous(), o,
                         grad);
    return grad;
  }

  // The gated activation of [S, 2I] rows: the device's swiglu ops for
  // [gate | up] silu and gelu_tanh, Impl::gated for the others.
  static at::Tensor gated(const at::Tensor& gate_up, const MoeExpertWeights& w) {
    if (!w.swiglu_layout()) {
      at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
      if (out.numel() > 0) Impl::gated(out, gate_up, w.gating);
      return out;
    }
    static auto fn = c10::Dispatcher::singleton()
                         .findSchemaOrThrow((std::string(Impl::kOps) + "::swiglu_packed").c_str(), "")
                         .typed<at::Tensor(const at::Tensor&, c10::string_view)>();
    return fn.call(gate_up, w.activation);
  }

  static at::Tensor gated_backward(const at::Tensor& grad, const at::Tensor& gate_up,
                                   const MoeExpertWeights& w) {
    if (!w.swiglu_layout()) {
      at::Tensor out = at::empty(gate_up.sizes(), gate_up.options());
      if (out.numel() > 0) Impl::gated_backward(out, grad, gate_up, w.gating);
      return out;
    }
    static auto fn =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow((std::string(Impl::kOps) + "::swiglu_packed_backward").c_str(), "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view)>();
    return fn.call(grad, gate_up, w.activation);
  }

  // Rows per part of the experts' products (expert_mlp): about 32 MiB of
  // gate/up rows and their activation, at least 256 rows.
  // FUSEDLLM_MOE_CHUNK_ROWS sets it (the tests use it to cross chunk
  // boundaries at small sizes).
  static int64_t chunk_rows(int64_t pairs, int64_t inter, int64_t element_size) {
    int64_t rows = std::max<int64_t>(256, (int64_t{32} << 20) / (3 * inter * element_size));
    if (const char* forced = std::getenv("FUSEDLLM_MOE_CHUNK_ROWS")) rows = std::atoll(forced);
    return std::clamp<int64_t>(rows, 1, std::max<int64_t>(pairs, 1));
  }

  // Returns out and what backward needs: order, position, offsets, and with
  // save_for_backward the gate/up rows [S, 2I] and the experts' outputs
  // [S, H] (unweighted), in expert order (else [0, 2I] and [0, H]). The
  // gathered rows and the activation (and without save_for_backward the
  // gate/up rows) exist a part of the rows at a time.
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
  experts(const at::Tensor& hidden_in, const at::Tensor& indices, const at::Tensor& weights_in,
          const at::Tensor& gate_up_proj, const at::Tensor& down_proj, c10::string_view activation,
          bool save_for_backward, const std::optional<at::Tensor>& gate_up_bias,
          const std::optional<at::Tensor>& down_bias, bool transposed, bool interleaved,
          double alpha, double limit) {
    const MoeShape s =
        check_moe_experts("fusedllm.moe_experts", hidden_in, indices, weights_in, gate_up_proj,
                          down_proj, activation, gate_up_bias, down_bias, transposed, alpha, limit);
    const MoeExpertWeights w = moe_expert_weights(gate_up_proj, down_proj, gate_up_bias, down_bias,
                                                  activation, transposed, interleaved, alpha, limit);
    const int64_t pairs = s.tokens * s.top_k;
    const auto long_opts = indices.options();
    at::Tensor order = at::empty({pairs}, long_opts), position = at::empty({pairs}, long_opts);
    at::Tensor offsets = at::empty({s.experts + 1}, long_opts);
    at::Tensor out = at::empty({s.tokens, s.hidden}, hidden_in.options());
    at::Tensor gate_up = at::empty({save_for_backward ? pairs : 0, 2 * s.inter}, hidden_in.options());
    at::Tensor expert_out = at::empty({save_for_backward ? pairs : 0, s.hidden}, hidden_in.options());
    if (pairs == 0) {
      offsets.zero_();
      return {out, order, position, offsets, gate_up, expert_out};
    }
    const at::Tensor hidden = hidden_in.contiguous();
    const at::Tensor weights = weights_in.contiguous();
    Impl::sort(indices.contiguous().view({-1}), s.experts, order, position, offsets);
    const int64_t rows = chunk_rows(pairs, s.inter, hidden.element_size());
    if (save_for_backward) {
      Impl::expert_mlp(expert_out, gate_up, hidden, order, offsets, s.top_k, w, rows);
      Impl::combine(out, expert_out, position, s.top_k, weights);
    } else {
      Impl::expert_mlp_combined(out, hidden, order, position, offsets, s.top_k, weights, w, rows);
    }
    return {out, order, position, offsets, gate_up, expert_out};
  }

  // Gradients for hidden, weights, gate_up_proj, down_proj, gate_up_bias and
  // down_bias, as output_mask and bias_mask ask (empty tensors for the
  // others; a bias's only where it is given).
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
  experts_backward(const at::Tensor& grad_out_in, const at::Tensor& hidden_in,
                   const at::Tensor& indices, const at::Tensor& weights_in,
                   const at::Tensor& gate_up_proj, const at::Tensor& down_proj,
                   const at::Tensor& order, const at::Tensor& position, const at::Tensor& offsets,
                   const at::Tensor& gate_up, const at::Tensor& expert_out,
                   c10::string_view activation, std::array<bool, 4> output_mask,
                   const std::optional<at::Tensor>& gate_up_bias,
                   const std::optional<at::Tensor>& down_bias, bool transposed, bool interleaved,
                   double alpha, double limit, std::array<bool, 2> bias_mask) {
    const char* op = "fusedllm.moe_experts_backward";
    const MoeShape s = check_moe_experts(op, hidden_in, indices, weights_in, gate_up_proj,
                                         down_proj, activation, gate_up_bias, down_bias,
                                         transposed, alpha, limit);
    const MoeExpertWeights w = moe_expert_weights(gate_up_proj, down_proj, gate_up_bias, down_bias,
                                                  activation, transposed, interleaved, alpha, limit);
    check_same(hidden_in, "hidden", grad_out_in, "grad_out", op);
    TORCH_CHECK_VALUE(grad_out_in.sizes() == hidden_in.sizes(), op,
                      ": grad_out must have hidden's shape ", hidden_in.sizes(), ", got ",
                      grad_out_in.sizes());
    const int64_t pairs = s.tokens * s.top_k;
    TORCH_CHECK_VALUE(gate_up.sizes() == at::IntArrayRef({pairs, 2 * s.inter}) &&
                          expert_out.sizes() == at::IntArrayRef({pairs, s.hidden}),
                      op, ": gate_up and expert_out must be the saved [", pairs, ", ", 2 * s.inter,
                      "] and [", pairs, ", ", s.hidden, "] rows (moe_experts with save_for_backward), got ",
                      gate_up.sizes(), " and ", expert_out.sizes());
    const auto [want_hidden, want_weights, want_gate_up, want_down] = output_mask;
    const bool want_gu_bias = bias_mask[0] && w.gate_up_bias.defined();
    const bool want_down_bias = bias_mask[1] && w.down_bias.defined();
    at::Tensor grad_hidden = hidden_in.new_empty({0}), grad_weights = hidden_in.new_empty({0});
    at::Tensor grad_gate_up = hidden_in.new_empty({0}), grad_down = hidden_in.new_empty({0});
    at::Tensor grad_gu_bias = hidden_in.new_empty({0}), grad_down_bias = hidden_in.new_empty({0});
    if (pairs == 0) {
      if (want_hidden) grad_hidden = at::zeros_like(hidden_in);
      if (want_weights) grad_weights = at::zeros_like(weights_in);
      if (want_gate_up) grad_gate_up = at::zeros_like(gate_up_proj);
      if (want_down) grad_down = at::zeros_like(down_proj);
      if (want_gu_bias) grad_gu_bias = at::zeros_like(w.gate_up_bias);
      if (want_down_bias) grad_down_bias = at::zeros_like(w.down_bias);
      return {grad_hidden, grad_weights, grad_gate_up, grad_down, grad_gu_bias, grad_down_bias};
    }
    const at::Tensor grad_out = grad_out_in.contiguous();
    const at::Tensor weights = weights_in.contiguous();
    if (want_weights) {
      at::Tensor g = at::empty({s.tokens, s.top_k},
                               weights.options().dtype(accumulation_dtype(hidden_in.scalar_type())));
      Impl::weights_grad(g, grad_out, expert_out, position);
      grad_weights = g.scalar_type() == weights.scalar_type() ? g : g.to(weights.scalar_type());
    }
    // What needs the gate/up rows' gradient.
    const bool through_gate_up = want_hidden || want_gate_up || want_gu_bias;
    if (!(through_gate_up || want_down || want_down_bias)) {
      return {grad_hidden, grad_weights, grad_gate_up, grad_down, grad_gu_bias, grad_down_bias};
    }
    at::Tensor grad_acted;
    {
      // The experts' output rows' gradient: each token's, times its weight.
      at::Tensor grad_rows = at::empty({pairs, s.hidden}, hidden_in.options());
      Impl::gather(grad_rows, grad_out, order, s.top_k, weights);
      if (want_down) {
        grad_down = at::empty(down_proj.sizes(), down_proj.options());
        const at::Tensor acted = gated(gate_up, w);
        if (transposed) {  // [E, I, H]: acted^T @ grad_rows
          Impl::grouped_mm(grad_down, acted, grad_rows, offsets, GroupedProduct::kWeightGradient,
                           at::Tensor());
        } else {  // [E, H, I]: grad_rows^T @ acted
          Impl::grouped_mm(grad_down, grad_rows, acted, offsets, GroupedProduct::kWeightGradient,
                           at::Tensor());
        }
      }
      if (want_down_bias) {
        grad_down_bias = at::empty(w.down_bias.sizes(), w.down_bias.options());
        Impl::group_sum(grad_down_bias, grad_rows, offsets);
      }
      if (through_gate_up) {
        grad_acted = at::empty({pairs, s.inter}, hidden_in.options());
        Impl::grouped_mm(grad_acted, grad_rows, down_proj, offsets, w.gradient_product(),
                         at::Tensor());
      }
    }
    if (!through_gate_up) {
      return {grad_hidden, grad_weights, grad_gate_up, grad_down, grad_gu_bias, grad_down_bias};
    }
    const at::Tensor grad_gu = gated_backward(grad_acted, gate_up, w);
    grad_acted = at::Tensor();
    if (want_gu_bias) {
      grad_gu_bias = at::empty(w.gate_up_bias.sizes(), w.gate_up_bias.options());
      Impl::group_sum(grad_gu_bias, grad_gu, offsets);
    }
    if (want_gate_up) {
      const at::Tensor hidden = hidden_in.contiguous();
      at::Tensor rows = at::empty({pairs, s.hidden}, hidden.options());
      Impl::gather(rows, hidden, order, s.top_k, at::Tensor());
      grad_gate_up = at::empty(gate_up_proj.sizes(), gate_up_proj.options());
      if (transposed) {  // [E, H, 2I]: rows^T @ grad_gu
        Impl::grouped_mm(grad_gate_up, rows, grad_gu, offsets, GroupedProduct::kWeightGradient,
                         at::Tensor());
      } else {  // [E, 2I, H]: grad_gu^T @ rows
        Impl::grouped_mm(grad_gate_up, grad_gu, rows, offsets, GroupedProduct::kWeightGradient,
                         at::Tensor());
      }
    }
    if (want_hidden) {
      at::Tensor grad_rows = at::empty({pairs, s.hidden}, hidden_in.options());
      Impl::grouped_mm(grad_rows, grad_gu, gate_up_proj, offsets, w.gradient_product(), at::Tensor());
      grad_hidden = at::empty({s.tokens, s.hidden}, hidden_in.options());
      Impl::combine(grad_hidden, grad_rows, position, s.top_k, at::Tensor());
    }
    return {grad_hidden, grad_weights, grad_gate_up, grad_down, grad_gu_bias, grad_down_bias};
  }
};

}  // namespace fusedllm

// Registers the mixture-of-experts operators of one dispatch key; use inside TORCH_LIBRARY_IMPL.
#define FUSEDLLM_IMPL_MOE_OPS(m, Impl)                                                 \
  do {                                                                                 \
    (m).impl("moe_route", &::fusedllm::MoeOps<Impl>::route);                           \
    (m).impl("moe_route_backward", &::fusedllm::MoeOps<Impl>::route_backward);         \
    (m).impl("moe_experts", &::fusedllm::MoeOps<Impl>::experts);                       \
    (m).impl("moe_experts_backward", &::fusedllm::MoeOps<Impl>::experts_backward);     \
  } while (0)
