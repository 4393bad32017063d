// The interface between the attention ops (attention.cpp) and their per-ISA
// kernels (attention_kernel.cpp). Plain pointers and strides, no tensors.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "fusedllm/attention.h"
#include "fusedllm/cpu_dispatch.h"
#include "fusedllm/dropout.h"

namespace fusedllm::cpu {

// A [batch, heads, seq, head_dim] operand with unit stride along head_dim.
struct AttentionOperand {
  const void* data = nullptr;
  int64_t batch_stride = 0, head_stride = 0, seq_stride = 0;  // in elements
};

// What forward and backward kernels share: dtype, sizes, scale and masks.
struct AttentionCallArgs {
  at::ScalarType dtype;
  int64_t batch, q_heads, kv_heads, sq, sk, head_dim;
  double scale;
  attn::Mask mask;
  attn::TensorMask tensor_mask;
  dropout::Dropout dropout;
};

struct AttentionForwardArgs : AttentionCallArgs {
  AttentionOperand q, k, v;
  void* out;  // contiguous [B, Hq, Sq, D]
  void* lse;  // contiguous [B, Hq, Sq], float32 (float64 for float64 inputs)
};

struct AttentionBackwardArgs : AttentionCallArgs {
  AttentionOperand grad_out, q, k, v, out;
  const void* lse;  // contiguous [B, Hq, Sq]
  void* grad_q;     // contiguous [B, Hq, Sq, D]
  void* grad_k;     // contiguous [B, Hkv, Sk, D]
  void* grad_v;     // contiguous [B, Hkv, Sk, D]
};

using AttentionForwardFn = void (*)(const AttentionForwardArgs&);
using AttentionBackwardFn = void (*)(const AttentionBackwardArgs&);

extern KernelTable<AttentionForwardFn> attention_forward_kernels;
extern KernelTable<AttentionBackwardFn> attention_backward_kernels;

}  // namespace fusedllm::cpu
