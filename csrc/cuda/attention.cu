// The attention ops on CUDA: checks, scratch, and the kernels' launches in
// order (attention.cuh says what each kernel does).
#include "attention.cuh"

namespace fusedllm::cuda {
namespace {

void check_grid(const AttentionShape& s) {
  TORCH_CHECK(s.batch <= 65535 && s.kv_heads <= 65535,
              "fusedllm.attention (CUDA): batch and kv_heads must be at most 65535, got ", s.batch,
              " and ", s.kv_heads);
}

struct CudaAttention {
  static void forward(const AttentionForwardPlan& p) {
    const DeviceGuard guard(p.q.device());
    check_grid(p.shape);
    launch_attention_forward(p, current_stream());
  }

  static void backward(const AttentionBackwardPlan& p) {
    const DeviceGuard guard(p.q.device());
    check_grid(p.shape);
    const Stream stream = current_stream();
    const AttentionShape& s = p.shape;
    at::Tensor delta = at::empty({s.batch * s.q_heads * s.sq}, p.q.options().dtype(lse_dtype(p.q)));
    launch_attention_dq(p, delta, stream);
    launch_attention_dkdv(p, delta, stream);
  }
};

}  // namespace

FUSEDLLM_CUDA_OPS_IMPL(m) { FUSEDLLM_IMPL_ATTENTION_OPS(m, CudaAttention); }

}  // namespace fusedllm::cuda
