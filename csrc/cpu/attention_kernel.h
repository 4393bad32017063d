// The interface between the attention ops (attention.cpp) and their per-ISA
// kernels. Plain pointers and strides, no tensors.
//
// The kernels: attention_forward_kernel.cpp and attention_backward_kernel.cpp
// on the micro-GEMMs of attention_gemm.h (float) and attention_pairs.h, the
// decoding scores of attention_lanes.h and the tile helpers of
// attention_tile.h (masks and the transpose in attention_tile_kernel.cpp).
//
// Layout of the work. A task owns one (batch, kv head) pair and a tile of
// query positions; its rows are the `group` query heads of that kv head at
// each position of the tile, ordered (position, head), so K/V tiles are read
// once for the whole group. Scores are computed transposed, S^T = K Q^T
// (keys x rows), so the per-row softmax statistics are vectors across rows
// and need no horizontal reductions. Both products (K Q^T and P V) run on a
// register-blocked micro-kernel over float32 (float64) tiles; bfloat16 and
// float16 operands are converted to float32 tiles once per tile, except
// bfloat16 in the AVX512_BF16 variant, whose products run on vdpbf16ps over
// operands packed as bfloat16 pairs (attention_pairs.h, attention_pair_words.h).
//
// Backward: a task owns the dK/dV rows of one (batch, kv head) pair (or of a
// strided subset of its key tiles when there are few pairs) and walks every
// query tile of the group, recomputing P from the saved log-sum-exp. dQ of a
// query tile is complete when its task has seen every key tile; with several
// key subsets each writes a partial dQ that is summed in a fixed order after
// the tasks, so the result never depends on the thread count or schedule.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "fusedllm/attention.h"
#include "fusedllm/cpu_dispatch.h"
#include "fusedllm/dropout.h"

namespace fusedllm::cpu {

// A [batch, heads, seq, head_dim] operand with unit stride along head_dim;
// sequence b's rows start at seq_stride * its Seqs start (batch stride 0 when
// packed).
struct AttentionOperand {
  const void* data = nullptr;
  int64_t batch_stride = 0, head_stride = 0, seq_stride = 0;  // in elements
};

// What forward and backward kernels share: dtype, sizes, scale, masks, score
// modifiers and where each sequence's rows lie. batch counts the sequences;
// with packed sequences sq and sk are the longest lengths.
struct AttentionCallArgs {
  at::ScalarType dtype;
  int64_t batch, q_heads, kv_heads, sq, sk, head_dim;
  double scale;
  attn::Mask mask;
  attn::TensorMask tensor_mask;
  attn::ScoreMods mods;
  attn::Seqs seqs;
  attn::QueryRows rows;
  attn::KeyRows key_rows;
  dropout::Dropout dropout;
  // The scratch of the call, `bytes` of the variant's AttentionWorkspace.
  void* workspace;
};

// Scratch memory a call needs, 64-byte aligned: the first `zeroed` bytes
// must be zero on entry, the rest may hold anything.
struct AttentionWorkspace {
  int64_t zeroed = 0, bytes = 0;
};

// The float32 scale of each key row of int8 or float8 K or V; data null for float K/V.
struct AttentionScales {
  const float* data = nullptr;
  int64_t batch_stride = 0, head_stride = 0, seq_stride = 0;
  bool float8 = false;  // the rows hold float8 e4m3 codes (else int8)
};

struct AttentionForwardArgs : AttentionCallArgs {
  AttentionOperand q, k, v;
  AttentionScales k_scale, v_scale;  // int8 / float8 k and v (then q is float32, bfloat16 or float16)
  attn::Pages pages;                 // paged k and v (and scales): their batch index is the page
  void* out;  // row r (QueryRows) at out + r * D
  void* lse;  // row r at lse[r], float32 (float64 for float64 inputs)
};

struct AttentionBackwardArgs : AttentionCallArgs {
  AttentionOperand grad_out, q, k, v, out;
  const void* lse;  // row r (QueryRows) at lse[r]
  void* grad_q;     // row r at grad_q + r * D
  void* grad_k;     // key row r (KeyRows) at grad_k + r * D
  void* grad_v;     // key row r at grad_v + r * D
};

// A variant: the workspace a call needs (a function of the arguments and
// the thread count), and the call on that workspace.
template <typename Args>
struct AttentionKernel {
  AttentionWorkspace (*workspace)(const Args&);
  void (*run)(const Args&);
};
using AttentionForwardKernel = AttentionKernel<AttentionForwardArgs>;
using AttentionBackwardKernel = AttentionKernel<AttentionBackwardArgs>;
using AttentionForwardFn = const AttentionForwardKernel*;
using AttentionBackwardFn = const AttentionBackwardKernel*;

extern KernelTable<AttentionForwardFn> attention_forward_kernels;
extern KernelTable<AttentionBackwardFn> attention_backward_kernels;

}  // namespace fusedllm::cpu
