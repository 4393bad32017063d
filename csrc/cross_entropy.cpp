// linear_cross_entropy: its schemas (defined in fusedllm/cross_entropy_op.h), its CPU
// operators (the chunked pass of fusedllm/cross_entropy_op.h with the multiplies of
// cpu/matmul.h and the row kernel variant for the running CPU, in place on the
// logits chunk) and its autograd.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <limits>
#include <optional>

#include "cpu/matmul.h"
#include "fusedllm/autograd.h"
#include "fusedllm/cross_entropy.h"
#include "fusedllm/cross_entropy_op.h"
#include "fusedllm/macros.h"

FUSEDLLM_DEFINE_OPS(fusedllm, define_cross_entropy_ops)

namespace fusedllm::cpu {

FUSEDLLM_DEFINE_CPU_KERNEL_TABLE(CrossEntropyRowFn, cross_entropy_row_kernels, "cross_entropy_rows");

namespace {

struct CpuCrossEntropy {
  // A half-precision weight's gradient over several chunks is always made by
  // slabs: one rounding, at the cost of a fourth multiply.
  static constexpr int64_t kHalfWeightSumFromRows = std::numeric_limits<int64_t>::max();

  static void matmul(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                     const std::optional<at::Tensor>& bias) {
    matrix_product(out, a, b, bias);
  }

  // Only float32 / float64 weights' gradients are summed over chunks here.
  static void matmul_add(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
    out.addmm_(a, b);
  }

  static void rows(const CrossEntropyRows& r) {
    CrossEntropyRowArgs a{};
    a.dtype = r.logits.scalar_type();
    a.options = r.options;
    a.ignore_index = r.ignore_index;
    a.rows = r.logits.size(0);
    a.vocab = r.logits.size(1);
    a.logits = r.logits.data_ptr();
    a.logits_stride = r.logits.stride(0);
    a.target = r.target.const_data_ptr<int64_t>();
    a.loss = r.loss.data_ptr();
    a.lse = r.lse.data_ptr();
    a.scale = r.scale.defined() ? r.scale.const_data_ptr() : nullptr;
    a.grad = r.grad;
    a.slab = r.slab;
    a.column0 = r.column0;
    cross_entropy_row_kernels.get()(a);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fusedllm, CPU, m) { FUSEDLLM_IMPL_CROSS_ENTROPY_OPS(m, CpuCrossEntropy); }

}  // namespace fusedllm::cpu

// --- autograd, for every device (fusedllm/autograd.h) ----------------------------------------

namespace fusedllm::autograd {
namespace {

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
    static auto pass = op<decltype(CrossEntropyOps<void>::pass)>("fusedllm::linear_cross_entropy_pass");
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
    static auto pass = op<decltype(CrossEntropyOps<void>::pass)>("fusedllm::linear_cross_entropy_pass");
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

}  // namespace

TORCH_LIBRARY_IMPL(fusedllm, Autograd, m) {
  refuse_second_derivative(m, "linear_cross_entropy_pass");
  m.impl("linear_cross_entropy", &linear_cross_entropy_autograd);
}

}  // namespace fusedllm::autograd
