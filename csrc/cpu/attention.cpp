// attention ops on CPU: checked plans (fusedllm/attention_op.h) handed to the
// kernel variant for the running CPU.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "attention_kernel.h"
#include "fusedllm/attention_op.h"

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
  a.dtype = p.q.scalar_type();
  a.batch = p.shape.batch;
  a.q_heads = p.shape.q_heads;
  a.kv_heads = p.shape.kv_heads;
  a.sq = p.shape.sq;
  a.sk = p.shape.sk;
  a.head_dim = p.shape.head_dim;
  a.scale = p.scale;
  a.mask = p.mask;
  a.tensor_mask = p.tensor_mask;
  a.mods = p.mods;
  a.seqs = p.seqs;
  a.rows = p.rows;
  a.key_rows = p.key_rows;
  a.dropout = p.dropout;
}

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
    const at::Tensor workspace = allocate(kernel->workspace(a));
    a.workspace = workspace.data_ptr();
    kernel->run(a);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fusedllm, CPU, m) { FUSEDLLM_IMPL_ATTENTION_OPS(m, CpuAttention); }

}  // namespace fusedllm::cpu
