// rope ops on CPU: checked plans (fusedllm/rope_op.h) handed to the kernel
// variant for the running CPU.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "fusedllm/rope_op.h"
#include "rope_kernel.h"

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
