// attention: its schemas (defined in fusedllm/attention_op.h), its CPU operators
// (checked plans handed to the kernel variant for the running CPU, cpu/attention_*)
// and its autograd.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "fusedllm/attention.h"
#include "fusedllm/attention_op.h"
#include "fusedllm/autograd.h"
#include "fusedllm/macros.h"

FUSEDLLM_DEFINE_OPS(fusedllm, define_attention_ops)

namespace fusedllm::cpu {

FUSEDLLM_DEFINE_CPU_KERNEL_TABLE(AttentionForwardFn, attention_forward_kernels, "attention_forward");
FUSEDLLM_DEFINE_CPU_KERNEL_TABLE(AttentionBackwardFn, attention_backward_kernels, "attention_backward");

namespace {

AttentionOperand operand(const at::Tensor& t) {
  AttentionOperand o;
  o.data = t.data_ptr();
  o.batch_stride = t.stride(0);
  o.head_stride = t.stride(1);
  o.seq_stride = t.stride(2);
  return o;
}

AttentionScales scales(const at::Tensor& t, kvq::Code code) {
  if (!t.defined()) return {};
  return {t.const_data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2), code == kvq::Code::kFloat8};
}

// Scratch of one kernel call as the variant describes it.
at::Tensor allocate(const AttentionWorkspace& w) {
  at::Tensor t = at::empty({w.bytes}, at::TensorOptions(at::kByte));
  if (w.zeroed > 0) t.narrow(0, 0, w.zeroed).zero_();
  return t;
}

// Plan: AttentionForwardPlan or AttentionBackwardPlan (both hold the checked q).
template <typename Plan>
void fill_call_args(const Plan& p, AttentionCallArgs& a) {
  static_cast<attn::CallTerms&>(a) = p;
  a.dtype = p.q.scalar_type();
  a.batch = p.shape.batch;
  a.q_heads = p.shape.q_heads;
  a.kv_heads = p.shape.kv_heads;
  a.sq = p.shape.sq;
  a.sk = p.shape.sk;
  a.head_dim = p.shape.head_dim;
}

// An operand with its head dim zero-padded to d; packed, its batch stride
// stays 0 (its sequences' rows lie at their starts, as_operand).
at::Tensor padded(const at::Tensor& t, int64_t d, bool packed) {
  const at::Tensor wide = at::constant_pad_nd(t, {0, d - t.size(-1)});
  if (!packed) return wide;
  return wide.as_strided(wide.sizes(), {0, wide.stride(1), wide.stride(2), wide.stride(3)});
}

// The first columns of t, as many as `to` has, into `to`.
void copy_columns(const at::Tensor& to, const at::Tensor& t) { to.copy_(t.narrow(-1, 0, to.size(-1))); }

struct CpuAttention {
  // kv_lens and block_table are host memory: checked before the kernels run.
  static constexpr bool kLengthsOnDevice = false;

  static void forward(const AttentionForwardPlan& p) {
    AttentionForwardArgs a{};
    fill_call_args(p, a);
    a.q = operand(p.q);
    a.k = operand(p.k);
    a.v = operand(p.v);
    a.k_scale = scales(p.k_scale, p.code);
    a.v_scale = scales(p.v_scale, p.code);
    a.pages = p.pages;
    a.out = p.out.data_ptr();
    a.lse = p.lse.data_ptr();
    const AttentionForwardKernel* kernel = attention_forward_kernels.get();
    if (const int64_t d = kernel->head_dim(a); d != p.shape.head_dim) {
      AttentionForwardPlan wide = p;
      wide.shape.head_dim = d;
      wide.q = padded(p.q, d, p.shape.packed);
      wide.k = padded(p.k, d, p.shape.packed);
      wide.v = padded(p.v, d, p.shape.packed);
      wide.out = new_rows(wide.q, wide.shape, wide.shape.q_heads, false);
      forward(wide);
      copy_columns(p.out, wide.out);
      return;
    }
    const at::Tensor workspace = allocate(kernel->workspace(a));
    a.workspace = workspace.data_ptr();
    kernel->run(a);
  }

  static void backward(const AttentionBackwardPlan& p) {
    AttentionBackwardArgs a{};
    fill_call_args(p, a);
    a.grad_out = operand(p.grad_out);
    a.q = operand(p.q);
    a.k = operand(p.k);
    a.v = operand(p.v);
    a.out = operand(p.out);
    a.lse = p.lse.data_ptr();
    a.grad_q = p.grad_q.data_ptr();
    a.grad_k = p.grad_k.data_ptr();
    a.grad_v = p.grad_v.data_ptr();
    const AttentionBackwardKernel* kernel = attention_backward_kernels.get();
    if (const int64_t d = kernel->head_dim(a); d != p.shape.head_dim) {
      AttentionBackwardPlan wide = p;
      wide.shape.head_dim = d;
      for (at::Tensor* t : {&wide.grad_out, &wide.q, &wide.k, &wide.v, &wide.out}) *t = padded(*t, d, p.shape.packed);
      wide.grad_q = new_rows(wide.q, wide.shape, wide.shape.q_heads, false);
      wide.grad_k = new_rows(wide.k, wide.shape, wide.shape.kv_heads, true);
      wide.grad_v = new_rows(wide.v, wide.shape, wide.shape.kv_heads, true);
      backward(wide);
      copy_columns(p.grad_q, wide.grad_q);
      copy_columns(p.grad_k, wide.grad_k);
      copy_columns(p.grad_v, wide.grad_v);
      return;
    }
    const at::Tensor workspace = allocate(kernel->workspace(a));
    a.workspace = workspace.data_ptr();
    kernel->run(a);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fusedllm, CPU, m) { FUSEDLLM_IMPL_ATTENTION_OPS(m, CpuAttention); }

}  // namespace fusedllm::cpu

// --- autograd, for every device (fusedllm/autograd.h) ----------------------------------------

namespace fusedllm::autograd {
namespace {

struct AttentionFunction : torch::autograd::Function<AttentionFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const OptTensor& sinks, const OptTensor& mask,
                               double scale, bool causal, int64_t window, double dropout_p,
                               const OptTensor& seed, int64_t window_right, double softcap,
                               const OptTensor& alibi_slopes, const OptTensor& cu_seqlens_q,
                               const OptTensor& cu_seqlens_k, int64_t max_seqlen_q,
                               int64_t max_seqlen_k) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fn = op<decltype(AttentionOps<void>::attention)>("fusedllm::attention");
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
    static auto fn = op<decltype(AttentionOps<void>::attention_backward)>("fusedllm::attention_backward");
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
    static auto fn = op<decltype(AttentionOps<void>::attention)>("fusedllm::attention");
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

}  // namespace

TORCH_LIBRARY_IMPL(fusedllm, Autograd, m) {
  refuse_second_derivative(m, "attention_backward");
  m.impl("attention", &attention_autograd);
}

}  // namespace fusedllm::autograd
