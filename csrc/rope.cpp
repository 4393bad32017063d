// rope and rope_: their schemas (defined in fusedllm/rope_op.h), their CPU operators
// (checked plans handed to the kernel variant for the running CPU,
// cpu/rope_kernel.cpp) and rope's autograd.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "fusedllm/autograd.h"
#include "fusedllm/macros.h"
#include "fusedllm/rope.h"
#include "fusedllm/rope_op.h"

FUSEDLLM_DEFINE_OPS(fusedllm, define_rope_ops)

namespace fusedllm::cpu {

FUSEDLLM_DEFINE_CPU_KERNEL_TABLE(RopeFn, rope_kernels, "rope");

namespace {

RopeTensorArgs tensor_args(const RopeOperand& o) {
  return {o.in.size(1),
          o.in.data_ptr(), o.in.stride(0), o.in.stride(1), o.in.stride(2),
          o.out.data_ptr(), o.out.stride(0), o.out.stride(1), o.out.stride(2)};
}

struct CpuRope {
  static void check(const RopePlan& p) { check_positions(p); }
  static void run(const RopePlan& p) {
    RopeArgs a{};
    a.dtype = p.q.in.scalar_type();
    a.batch = p.batch;
    a.seq = p.seq;
    a.head_dim = p.head_dim;
    a.rotary_dim = p.rotary_dim;
    a.interleaved = p.interleaved;
    a.inverse = p.inverse;
    a.q = tensor_args(p.q);
    a.k = tensor_args(p.k);
    a.cos = p.cos.data_ptr();
    a.sin = p.sin.data_ptr();
    a.table_b = p.cos.stride(0);
    a.table_row = p.cos.stride(1);
    a.table_rows = p.cos.size(1);
    a.positions = p.positions.defined() ? p.positions.const_data_ptr<int64_t>() : nullptr;
    a.positions_b = p.positions.defined() ? p.positions.stride(0) : 0;
    a.offset = p.offset;
    rope_kernels.get()(a);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fusedllm, CPU, m) { FUSEDLLM_IMPL_ROPE_OPS(m, CpuRope); }

}  // namespace fusedllm::cpu

// --- autograd, for every device (fusedllm/autograd.h) ----------------------------------------

namespace fusedllm::autograd {
namespace {

// The tables are constants: the gradient of a rotation is the inverse rotation.
struct RopeFunction : torch::autograd::Function<RopeFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& cos, const at::Tensor& sin,
                               const OptTensor& position_ids, int64_t offset, bool interleaved,
                               int64_t rotary_dim, bool inverse) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fn = op<decltype(RopeOps<void>::rope)>("fusedllm::rope");
    auto [q_out, k_out] = fn.call(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse);
    ctx->save_for_backward({cos, sin, value_or_undefined(position_ids)});
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["rotary_dim"] = rotary_dim;
    ctx->saved_data["inverse"] = inverse;
    return {q_out, k_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto fn = op<decltype(RopeOps<void>::rope)>("fusedllm::rope");
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

std::tuple<at::Tensor, at::Tensor> rope_autograd(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& cos, const at::Tensor& sin,
                                                 const OptTensor& position_ids, int64_t offset,
                                                 bool interleaved, int64_t rotary_dim, bool inverse) {
  auto r = RopeFunction::apply(q, k, cos, sin, position_ids, offset, interleaved, rotary_dim, inverse);
  return {r[0], r[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusedllm, Autograd, m) {
  m.impl("rope", &rope_autograd);
}

}  // namespace fusedllm::autograd
