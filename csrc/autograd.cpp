// Autograd for the fusedllm operators, one kernel per op for every device. In
// C++ rather than Python so that a call costs a few microseconds above the
// kernel: a Python autograd kernel ran on every call, with or without grad.
// Each forward calls the op below autograd; each backward calls the matching
// backward op. The backward ops have no derivatives of their own: building a
// graph through them (double backward) is an error rather than a silent zero.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/jit/runtime/operator.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

#include "fusedllm/cross_entropy_op.h"

namespace fusedllm {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;

template <typename Fn>
auto op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

at::Tensor value_or_undefined(const OptTensor& t) { return t.has_value() ? *t : at::Tensor(); }
OptTensor as_optional(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// The one refusal of a second derivative, after the operator's name.
constexpr const char* kNoSecondDerivative =
    " has no derivative: a second derivative (create_graph=True, double backward) through "
    "fusedllm's ops is not supported";

// --- rms_norm / fused_add_rms_norm ----------------------------------------------------

using RmsNormBackwardFn = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, double,
    c10::string_view, const OptTensor&, bool);

// Shared by both norms: `x` is the normalized input (h for the fused add), and
// the weight's gradient is computed only when asked for.
std::tuple<at::Tensor, at::Tensor> rms_norm_grads(AutogradContext* ctx, const at::Tensor& grad_out,
                                                  const at::Tensor& grad_residual,
                                                  size_t weight_edge) {
  const auto saved = ctx->get_saved_variables();
  const at::Tensor& x = saved[0];
  const at::Tensor& weight = saved[1];
  const at::Tensor& rstd = saved[2];
  const bool want_dw = weight.defined() && ctx->needs_input_grad(weight_edge);
  static auto backward = op<RmsNormBackwardFn>("fusedllm::rms_norm_backward");
  auto [grad_input, grad_weight] =
      backward.call(grad_out, x, rstd, as_optional(weight), ctx->saved_data["offset"].toDouble(),
                    ctx->saved_data["casting"].toStringRef(), as_optional(grad_residual), want_dw);
  return {grad_input, want_dw ? grad_weight : at::Tensor()};
}

struct RmsNormFunction : torch::autograd::Function<RmsNormFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, const OptTensor& weight,
                               double eps, double offset, c10::string_view casting) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fn = op<std::tuple<at::Tensor, at::Tensor>(
        const at::Tensor&, const OptTensor&, double, double, c10::string_view)>("fusedllm::rms_norm");
    auto [out, rstd] = fn.call(input, weight, eps, offset, casting);
    ctx->save_for_backward({input, value_or_undefined(weight), rstd});
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["casting"] = std::string(casting);
    ctx->mark_non_differentiable({rstd});
    return {out, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto [grad_input, grad_weight] = rms_norm_grads(ctx, grads[0], at::Tensor(), 1);
    return {grad_input, grad_weight, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct FusedAddRmsNormFunction : torch::autograd::Function<FusedAddRmsNormFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& residual,
                               const OptTensor& weight, double eps, double offset,
                               c10::string_view casting) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fn = op<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
        const at::Tensor&, const at::Tensor&, const OptTensor&, double, double, c10::string_view)>(
        "fusedllm::fused_add_rms_norm");
    auto [out, residual_out, rstd] = fn.call(input, residual, weight, eps, offset, casting);
    ctx->save_for_backward({residual_out, value_or_undefined(weight), rstd});
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["casting"] = std::string(casting);
    ctx->mark_non_differentiable({rstd});
    return {out, residual_out, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // h = input + residual: both receive the gradient that reaches h.
    auto [grad_h, grad_weight] = rms_norm_grads(ctx, grads[0], grads[1], 2);
    return {grad_h, grad_h, grad_weight, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// --- swiglu ----------------------------------------------------------------------------

// Only the inputs are saved: backward recomputes the activation.
struct SwigluFunction : torch::autograd::Function<SwigluFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up,
                            c10::string_view activation) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fn = op<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view)>(
        "fusedllm::swiglu");
    ctx->save_for_backward({gate, up});
    ctx->saved_data["activation"] = std::string(activation);
    return fn.call(gate, up, activation);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto fn = op<std::tuple<at::Tensor, at::Tensor>(
        const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view)>(
        "fusedllm::swiglu_backward");
    const auto saved = ctx->get_saved_variables();
    auto [grad_gate, grad_up] =
        fn.call(grads[0], saved[0], saved[1], ctx->saved_data["activation"].toStringRef());
    return {grad_gate, grad_up, at::Tensor()};
  }
};

struct SwigluPackedFunction : torch::autograd::Function<SwigluPackedFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate_up, c10::string_view activation) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fn = op<at::Tensor(const at::Tensor&, c10::string_view)>("fusedllm::swiglu_packed");
    ctx->save_for_backward({gate_up});
    ctx->saved_data["activation"] = std::string(activation);
    return fn.call(gate_up, activation);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto fn = op<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view)>(
        "fusedllm::swiglu_packed_backward");
    const auto saved = ctx->get_saved_variables();
    return {fn.call(grads[0], saved[0], ctx->saved_data["activation"].toStringRef()), at::Tensor()};
  }
};

// --- rope --------------------------------------------------------------------------------

using RopeFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  const at::Tensor&, const OptTensor&, int64_t, bool,
                                                  int64_t, bool);

// The tables are constants: the gradient of a rotation is the inverse rotation.
struct RopeFunction : torch::autograd::Function<RopeFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& cos, const at::Tensor& sin,
                               const OptTensor& position_ids, int64_t offset, bool interleaved,
                               int64_t rotary_dim, bool inverse) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fn = op<RopeFn>("fusedllm::rope");
    auto [q_out, k_out] = fn.call(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse);
    ctx->save_for_backward({cos, sin, value_or_undefined(position_ids)});
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["rotary_dim"] = rotary_dim;
    ctx->saved_data["inverse"] = inverse;
    return {q_out, k_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto fn = op<RopeFn>("fusedllm::rope");
    const auto saved = ctx->get_saved_variables();
    auto [grad_q, grad_k] =
        fn.call(grads[0], grads[1], saved[0], saved[1], as_optional(saved[2]),
                ctx->saved_data["offset"].toInt(), ctx->saved_data["interleaved"].toBool(),
                ctx->saved_data["rotary_dim"].toInt(), !ctx->saved_data["inverse"].toBool());
    variable_list out(9);
    out[0] = grad_q;
    out[1] = grad_k;
    return out;
  }
};

// --- attention ---------------------------------------------------------------------------

struct AttentionFunction : torch::autograd::Function<AttentionFunction> {
  using ForwardFn = std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, double, bool, int64_t,
      double, const OptTensor&, int64_t, double, const OptTensor&, const OptTensor&, const OptTensor&,
      const OptTensor&, int64_t, int64_t, const OptTensor&, const OptTensor&, const OptTensor&,
      const OptTensor&);
  using BackwardFn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const OptTensor&, double, bool, int64_t, double, const OptTensor&, int64_t,
      double, const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, int64_t, int64_t);

  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const OptTensor& sinks, const OptTensor& mask,
                               double scale, bool causal, int64_t window, double dropout_p,
                               const OptTensor& seed, int64_t window_right, double softcap,
                               const OptTensor& alibi_slopes, const OptTensor& cu_seqlens_q,
                               const OptTensor& cu_seqlens_k, int64_t max_seqlen_q,
                               int64_t max_seqlen_k) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fn = op<ForwardFn>("fusedllm::attention");
    auto [out, lse] = fn.call(q, k, v, mask, scale, causal, window, dropout_p, seed, window_right,
                              softcap, sinks, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                              max_seqlen_k, std::nullopt, std::nullopt, std::nullopt, std::nullopt);
    ctx->save_for_backward({q, k, v, out, lse, value_or_undefined(mask), value_or_undefined(seed),
                            value_or_undefined(sinks), value_or_undefined(alibi_slopes),
                            value_or_undefined(cu_seqlens_q), value_or_undefined(cu_seqlens_k)});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["window"] = window;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["window_right"] = window_right;
    ctx->saved_data["softcap"] = softcap;
    ctx->saved_data["max_seqlen_q"] = max_seqlen_q;
    ctx->saved_data["max_seqlen_k"] = max_seqlen_k;
    // lse is returned for the backward op (and for inspection): no gradient.
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto fn = op<BackwardFn>("fusedllm::attention_backward");
    const auto s = ctx->get_saved_variables();
    const auto& d = ctx->saved_data;
    auto [grad_q, grad_k, grad_v, grad_sinks] = fn.call(
        grads[0], s[0], s[1], s[2], s[3], s[4], as_optional(s[5]), d.at("scale").toDouble(),
        d.at("causal").toBool(), d.at("window").toInt(), d.at("dropout_p").toDouble(),
        as_optional(s[6]), d.at("window_right").toInt(), d.at("softcap").toDouble(),
        as_optional(s[7]), as_optional(s[8]), as_optional(s[9]), as_optional(s[10]),
        d.at("max_seqlen_q").toInt(), d.at("max_seqlen_k").toInt());
    variable_list out(17);
    out[0] = ctx->needs_input_grad(0) ? grad_q : at::Tensor();
    out[1] = ctx->needs_input_grad(1) ? grad_k : at::Tensor();
    out[2] = ctx->needs_input_grad(2) ? grad_v : at::Tensor();
    // needs_input_grad counts tensor inputs present: sinks is the fourth when given.
    out[3] = s[7].defined() && ctx->needs_input_grad(3) ? grad_sinks : at::Tensor();
    return out;
  }
};

// --- linear cross-entropy -----------------------------------------------------------------

using CrossEntropyPassFn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const OptTensor&, const at::Tensor&, const OptTensor&,
    int64_t, double, double, double, std::array<bool, 3>);

// With a mean or a sum, the gradients are formed in the forward pass itself
// (the logits are made once) and backward scales them by the incoming scalar;
// per-token losses ("none") take per-token weights, so backward runs the pass
// again with them.
struct LinearCrossEntropyFunction : torch::autograd::Function<LinearCrossEntropyFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const OptTensor& bias, const at::Tensor& target, int64_t ignore_index,
                            c10::string_view reduction, double smoothing, double softcap,
                            double z_loss, bool want_hidden, bool want_weight, bool want_bias) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto pass = op<CrossEntropyPassFn>("fusedllm::linear_cross_entropy_pass");
    const Reduction r = parse_reduction(reduction, "fusedllm.linear_cross_entropy");
    const bool early = r != Reduction::kNone && (want_hidden || want_weight || want_bias);
    auto [loss, grad_hidden, grad_weight, grad_bias] =
        pass.call(hidden, weight, bias, target, std::nullopt, ignore_index, smoothing, softcap,
                  z_loss, {early && want_hidden, early && want_weight, early && want_bias});
    at::Tensor out = reduce_losses(loss, target, ignore_index, r);
    if (early) {
      // d(mean)/d(loss_i) = 1 / (tokens not ignored); when none is, the saved
      // gradients are zeros and stay so (as cross_entropy's).
      at::Tensor factor =
          r == Reduction::kMean
              ? 1.0 / (target != ignore_index).sum().clamp_min(1).to(loss.scalar_type())
              : at::ones({}, loss.options());
      ctx->save_for_backward({grad_hidden, grad_weight, grad_bias, factor});
    } else {
      ctx->save_for_backward({hidden, weight, value_or_undefined(bias), target});
    }
    ctx->saved_data["early"] = early;
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["smoothing"] = smoothing;
    ctx->saved_data["softcap"] = softcap;
    ctx->saved_data["z_loss"] = z_loss;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // Its gradients were formed in the forward: no backward op to refuse it.
    TORCH_CHECK(!(at::GradMode::is_enabled() && grads[0].requires_grad()),
                "fusedllm::linear_cross_entropy", kNoSecondDerivative);
    const auto s = ctx->get_saved_variables();
    variable_list out(12);
    if (ctx->saved_data["early"].toBool()) {
      // Scaled in place (no second weight-sized tensor) unless the graph is
      // kept for another backward, which needs them unscaled.
      const bool in_place = !torch::autograd::get_current_graph_task_keep_graph();
      const at::Tensor factor = converted(grads[0], s[3].scalar_type()) * s[3];
      for (int i = 0; i < 3; ++i) {
        if (ctx->needs_input_grad(i)) out[i] = in_place ? s[i].mul_(factor) : s[i] * factor;
      }
      return out;
    }
    static auto pass = op<CrossEntropyPassFn>("fusedllm::linear_cross_entropy_pass");
    const at::Tensor& hidden = s[0];
    auto [loss, grad_hidden, grad_weight, grad_bias] = pass.call(
        hidden, s[1], as_optional(s[2]), s[3], grads[0], ctx->saved_data["ignore_index"].toInt(),
        ctx->saved_data["smoothing"].toDouble(), ctx->saved_data["softcap"].toDouble(),
        ctx->saved_data["z_loss"].toDouble(),
        {ctx->needs_input_grad(0), ctx->needs_input_grad(1), s[2].defined() && ctx->needs_input_grad(2)});
    out[0] = ctx->needs_input_grad(0) ? grad_hidden : at::Tensor();
    out[1] = ctx->needs_input_grad(1) ? grad_weight : at::Tensor();
    out[2] = s[2].defined() && ctx->needs_input_grad(2) ? grad_bias : at::Tensor();
    return out;
  }
};

// --- mixture of experts ---------------------------------------------------------------------

// The router's gradient flows to its logits only (the correction bias steers the choice).
struct MoeRouteFunction : torch::autograd::Function<MoeRouteFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits, int64_t top_k,
                               c10::string_view scoring, bool normalize, const OptTensor& bias,
                               int64_t groups, int64_t top_groups, double scaling) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fn = op<std::tuple<at::Tensor, at::Tensor>(
        const at::Tensor&, int64_t, c10::string_view, bool, const OptTensor&, int64_t, int64_t,
        double)>("fusedllm::moe_route");
    auto [weights, indices] =
        fn.call(logits, top_k, scoring, normalize, bias, groups, top_groups, scaling);
    ctx->save_for_backward({logits, indices});
    ctx->saved_data["scoring"] = std::string(scoring);
    ctx->saved_data["normalize"] = normalize;
    ctx->saved_data["scaling"] = scaling;
    ctx->mark_non_differentiable({indices});
    return {weights, indices};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto fn = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   c10::string_view, bool, double)>("fusedllm::moe_route_backward");
    const auto s = ctx->get_saved_variables();
    variable_list out(8);
    if (ctx->needs_input_grad(0) && grads[0].defined()) {
      out[0] = fn.call(grads[0], s[0], s[1], ctx->saved_data["scoring"].toStringRef(),
                       ctx->saved_data["normalize"].toBool(), ctx->saved_data["scaling"].toDouble());
    }
    return out;
  }
};

using MoeExpertsBackwardFn =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
        const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
        const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
        const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view,
        std::array<bool, 4>, const OptTensor&, const OptTensor&, bool, bool, double, double,
        std::array<bool, 2>);

// The biases follow down_proj so that the tensor inputs present number the
// edges: hidden 0, indices 1, weights 2, gate_up_proj 3, down_proj 4, then
// gate_up_bias and down_bias where given.
struct MoeExpertsFunction : torch::autograd::Function<MoeExpertsFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden,
                               const at::Tensor& indices, const at::Tensor& weights,
                               const at::Tensor& gate_up_proj, const at::Tensor& down_proj,
                               const OptTensor& gate_up_bias, const OptTensor& down_bias,
                               c10::string_view activation, bool save_for_backward,
                               bool transposed, bool interleaved, double alpha, double limit) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fn = op<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                   at::Tensor>(
        const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
        const at::Tensor&, c10::string_view, bool, const OptTensor&, const OptTensor&, bool, bool,
        double, double)>("fusedllm::moe_experts");
    auto [out, order, position, offsets, gate_up, expert_out] =
        fn.call(hidden, indices, weights, gate_up_proj, down_proj, activation, save_for_backward,
                gate_up_bias, down_bias, transposed, interleaved, alpha, limit);
    ctx->save_for_backward({hidden, indices, weights, gate_up_proj, down_proj, order, position,
                            offsets, gate_up, expert_out, value_or_undefined(gate_up_bias),
                            value_or_undefined(down_bias)});
    ctx->saved_data["activation"] = std::string(activation);
    ctx->saved_data["transposed"] = transposed;
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["limit"] = limit;
    ctx->mark_non_differentiable({order, position, offsets, gate_up, expert_out});
    return {out, order, position, offsets, gate_up, expert_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto fn = op<MoeExpertsBackwardFn>("fusedllm::moe_experts_backward");
    const auto s = ctx->get_saved_variables();
    const at::Tensor& gate_up_bias = s[10];
    const at::Tensor& down_bias = s[11];
    variable_list out(13);
    const std::array<bool, 4> mask = {ctx->needs_input_grad(0), ctx->needs_input_grad(2),
                                      ctx->needs_input_grad(3), ctx->needs_input_grad(4)};
    const size_t down_bias_edge = gate_up_bias.defined() ? 6 : 5;
    const std::array<bool, 2> bias_mask = {
        gate_up_bias.defined() && ctx->needs_input_grad(5),
        down_bias.defined() && ctx->needs_input_grad(down_bias_edge)};
    if (!grads[0].defined() || !(mask[0] || mask[1] || mask[2] || mask[3] || bias_mask[0] ||
                                 bias_mask[1])) {
      return out;
    }
    auto [grad_hidden, grad_weights, grad_gate_up, grad_down, grad_gu_bias, grad_down_bias] =
        fn.call(grads[0], s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], s[9],
                ctx->saved_data["activation"].toStringRef(), mask, as_optional(gate_up_bias),
                as_optional(down_bias), ctx->saved_data["transposed"].toBool(),
                ctx->saved_data["interleaved"].toBool(), ctx->saved_data["alpha"].toDouble(),
                ctx->saved_data["limit"].toDouble(), bias_mask);
    if (mask[0]) out[0] = grad_hidden;
    if (mask[1]) out[2] = grad_weights;
    if (mask[2]) out[3] = grad_gate_up;
    if (mask[3]) out[4] = grad_down;
    if (bias_mask[0]) out[5] = grad_gu_bias;
    if (bias_mask[1]) out[6] = grad_down_bias;
    return out;
  }
};

// --- registration ------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> rms_norm_autograd(const at::Tensor& input, const OptTensor& weight,
                                                     double eps, double offset, c10::string_view casting) {
  auto r = RmsNormFunction::apply(input, weight, eps, offset, casting);
  return {r[0], r[1]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_autograd(
    const at::Tensor& input, const at::Tensor& residual, const OptTensor& weight, double eps,
    double offset, c10::string_view casting) {
  auto r = FusedAddRmsNormFunction::apply(input, residual, weight, eps, offset, casting);
  return {r[0], r[1], r[2]};
}

at::Tensor swiglu_autograd(const at::Tensor& gate, const at::Tensor& up, c10::string_view activation) {
  return SwigluFunction::apply(gate, up, activation);
}

at::Tensor swiglu_packed_autograd(const at::Tensor& gate_up, c10::string_view activation) {
  return SwigluPackedFunction::apply(gate_up, activation);
}

std::tuple<at::Tensor, at::Tensor> rope_autograd(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& cos, const at::Tensor& sin,
                                                 const OptTensor& position_ids, int64_t offset,
                                                 bool interleaved, int64_t rotary_dim, bool inverse) {
  auto r = RopeFunction::apply(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse);
  return {r[0], r[1]};
}

std::tuple<at::Tensor, at::Tensor> attention_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& mask, double scale,
    bool causal, int64_t window, double dropout_p, const OptTensor& seed, int64_t window_right,
    double softcap, const OptTensor& sinks, const OptTensor& alibi_slopes, const OptTensor& cu_seqlens_q,
    const OptTensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    const OptTensor& k_scale, const OptTensor& v_scale, const OptTensor& kv_lens,
    const OptTensor& block_table) {
  const bool quantized = k_scale.has_value() || v_scale.has_value();
  if (quantized || kv_lens.has_value() || block_table.has_value()) {
    // A KV cache (quantized, of several lengths, paged) is read for inference:
    // nothing to differentiate through.
    const auto wants = [](const OptTensor& t) { return t.has_value() && t->requires_grad(); };
    TORCH_CHECK_VALUE(!at::GradMode::is_enabled() ||
                          !(q.requires_grad() || k.requires_grad() || v.requires_grad() || wants(sinks) ||
                            wants(k_scale) || wants(v_scale)),
                      "fusedllm.attention: ",
                      quantized ? "quantized k and v (k_scale / v_scale)" : "kv_lens / block_table",
                      " read a KV cache for inference and have no backward; run under torch.no_grad() "
                      "or torch.inference_mode(), or detach q, k and v");
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fn = op<AttentionFunction::ForwardFn>("fusedllm::attention");
    return fn.call(q, k, v, mask, scale, causal, window, dropout_p, seed, window_right, softcap, sinks,
                   alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, k_scale, v_scale,
                   kv_lens, block_table);
  }
  // sinks goes fourth: apply() differentiates the leading tensor arguments.
  auto r = AttentionFunction::apply(q, k, v, sinks, mask, scale, causal, window, dropout_p, seed,
                                    window_right, softcap, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k);
  return {r[0], r[1]};
}

at::Tensor linear_cross_entropy_autograd(const at::Tensor& hidden, const at::Tensor& weight,
                                         const OptTensor& bias, const at::Tensor& target,
                                         int64_t ignore_index, c10::string_view reduction,
                                         double smoothing, double softcap, double z_loss) {
  // Which gradients the forward pass should form (it runs with grad mode off).
  const bool on = at::GradMode::is_enabled();
  return LinearCrossEntropyFunction::apply(
      hidden, weight, bias, target, ignore_index, reduction, smoothing, softcap, z_loss,
      on && hidden.requires_grad(), on && weight.requires_grad(),
      on && bias.has_value() && bias->requires_grad());
}

std::tuple<at::Tensor, at::Tensor> moe_route_autograd(const at::Tensor& logits, int64_t top_k,
                                                      c10::string_view scoring, bool normalize,
                                                      const OptTensor& bias, int64_t groups,
                                                      int64_t top_groups, double scaling) {
  auto r = MoeRouteFunction::apply(logits, top_k, scoring, normalize, bias, groups, top_groups,
                                   scaling);
  return {r[0], r[1]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
moe_experts_autograd(const at::Tensor& hidden, const at::Tensor& indices, const at::Tensor& weights,
                     const at::Tensor& gate_up_proj, const at::Tensor& down_proj,
                     c10::string_view activation, bool save_for_backward,
                     const OptTensor& gate_up_bias, const OptTensor& down_bias, bool transposed,
                     bool interleaved, double alpha, double limit) {
  // Backward needs the gate/up rows whenever a gradient will be asked for.
  const auto wants = [](const OptTensor& t) { return t.has_value() && t->requires_grad(); };
  const bool grads = at::GradMode::is_enabled() &&
                     (hidden.requires_grad() || weights.requires_grad() ||
                      gate_up_proj.requires_grad() || down_proj.requires_grad() ||
                      wants(gate_up_bias) || wants(down_bias));
  auto r = MoeExpertsFunction::apply(hidden, indices, weights, gate_up_proj, down_proj,
                                     gate_up_bias, down_bias, activation,
                                     save_for_backward || grads, transposed, interleaved, alpha,
                                     limit);
  return {r[0], r[1], r[2], r[3], r[4], r[5]};
}

// Autograd kernel of the backward ops: runs them, unless a graph would be built
// through them.
void refuse_double_backward(const c10::OperatorHandle& handle, c10::DispatchKeySet keys,
                            torch::jit::Stack* stack) {
  const auto& schema = handle.schema();
  if (at::GradMode::is_enabled()) {
    for (const auto& arg : torch::jit::last(*stack, schema.arguments().size())) {
      TORCH_CHECK(!(arg.isTensor() && arg.toTensor().requires_grad()), schema.name(),
                  kNoSecondDerivative);
    }
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  handle.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedllm, Autograd, m) {
  for (const char* name : {"rms_norm_backward", "swiglu_backward", "swiglu_packed_backward",
                           "attention_backward", "linear_cross_entropy_pass",
                           "moe_route_backward", "moe_experts_backward"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&refuse_double_backward>());
  }
  m.impl("rms_norm", &rms_norm_autograd);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm_autograd);
  m.impl("swiglu", &swiglu_autograd);
  m.impl("swiglu_packed", &swiglu_packed_autograd);
  m.impl("rope", &rope_autograd);
  m.impl("attention", &attention_autograd);
  m.impl("linear_cross_entropy", &linear_cross_entropy_autograd);
  m.impl("moe_route", &moe_route_autograd);
  m.impl("moe_experts", &moe_experts_autograd);
}

}  // namespace fusedllm
