// The fusedllm operator schemas, the only place they are written. Defined
// for torch.ops.fusedllm (csrc/ops.cpp) and, with the same words, for
// torch.ops.fusedllm_simt, the emulated CUDA kernels (csrc/simt/module.cpp).
#pragma once

#include <torch/library.h>

#include "fusedllm/macros.h"

namespace fusedllm {

inline void define_ops(torch::Library& m) {
  // y = x * rstd * (offset + weight); also returns rstd per row (float32,
  // float64 for float64 input) for the backward op.
  m.def("rms_norm(Tensor input, Tensor? weight, float eps, float offset, str casting)"
        " -> (Tensor out, Tensor rstd)");
  // h = input + residual; y = rms_norm(h). Returns y, h and rstd.
  m.def("fused_add_rms_norm(Tensor input, Tensor residual, Tensor? weight, float eps, "
        "float offset, str casting) -> (Tensor out, Tensor residual_out, Tensor rstd)");
  // Gradients of both ops in one pass: grad_input (plus grad_residual, the
  // gradient reaching fused_add_rms_norm's residual_out) and grad_weight
  // (an empty tensor unless compute_weight_grad and a weight is given).
  m.def("rms_norm_backward(Tensor grad_out, Tensor input, Tensor rstd, Tensor? weight, "
        "float offset, str casting, Tensor? grad_residual, bool compute_weight_grad)"
        " -> (Tensor grad_input, Tensor grad_weight)");

  // h = act(gate) * up with act in {"silu", "gelu_tanh"}; float32 math inside.
  m.def("swiglu(Tensor gate, Tensor up, str activation) -> Tensor");
  // The same from one [..., 2F] tensor laid out [gate | up] (one fused projection).
  m.def("swiglu_packed(Tensor gate_up, str activation) -> Tensor");
  // Backward ops recompute the activation from the inputs.
  m.def("swiglu_backward(Tensor grad_out, Tensor gate, Tensor up, str activation)"
        " -> (Tensor grad_gate, Tensor grad_up)");
  m.def("swiglu_packed_backward(Tensor grad_out, Tensor gate_up, str activation) -> Tensor");

  // Rotates q [B, Hq, S, D] and k [B, Hkv, S, D] by the angles of cos/sin tables
  // ([positions, rotary_dim / 2] looked up at position_ids or offset + s, or
  // per-token [B, S, rotary_dim / 2]); the first rotary_dim features rotate.
  // inverse=True rotates back (the backward pass).
  m.def("rope(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? position_ids, int offset, "
        "bool interleaved, int rotary_dim, bool inverse) -> (Tensor q_out, Tensor k_out)");
  // The same, writing into q and k.
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, Tensor? position_ids, "
        "int offset, bool interleaved, int rotary_dim, bool inverse) -> ()");

  // Grouped-query flash attention: q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D]; causal is
  // bottom-right aligned; window (a key count, left bound + 1) and window_right
  // bound the keys a query sees, -1 meaning none. mask: bool keep-mask or additive
  // float mask broadcastable to [B, Hq, Sq, Sk]. softcap > 0 caps the scaled
  // scores at softcap * tanh(s / softcap); alibi_slopes [Hq] or [B, Hq] add
  // -slope * |i - j|; sinks [Hq] join each row's softmax denominator. Packed
  // sequences: with cu_seqlens_q/k (int32 [n + 1]) q is [total_q, Hq, D] and k/v
  // [total_k, Hkv, D], each sequence attending within itself (max_seqlen_q/k:
  // the longest, 0 to compute them); out is then [total_q, Hq, D] and lse
  // [Hq, total_q]. dropout_p > 0 drops probabilities with a counter-based RNG
  // keyed by seed (int64 [1], on the CPU). Returns out and the per-row lse (of
  // the probabilities before dropout, sink included). k and v may be int8 with
  // k_scale / v_scale (float32 [B, Hkv, Sk], packed [total_k, Hkv]): key row j
  // is k[j] * k_scale[j], applied as the kernels load its tile (no gradient).
  // A KV cache of sequences of different lengths: kv_lens (int32 [B]) gives
  // each sequence's number of keys; with block_table (int32 [B, max_pages]) k
  // and v are pages [num_pages, Hkv, page_size, D] (scales [num_pages, Hkv,
  // page_size]) and key j of sequence b is row j % page_size of page
  // block_table[b, j / page_size] (no gradient).
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool causal, "
        "int window, float dropout_p, Tensor? seed, int window_right=-1, float softcap=0., "
        "Tensor? sinks=None, Tensor? alibi_slopes=None, Tensor? cu_seqlens_q=None, "
        "Tensor? cu_seqlens_k=None, int max_seqlen_q=0, int max_seqlen_k=0, Tensor? k_scale=None, "
        "Tensor? v_scale=None, Tensor? kv_lens=None, Tensor? block_table=None) -> (Tensor out, Tensor lse)");
  // Gradients of attention from the saved out and lse (probabilities and the
  // dropout mask recomputed); grad_sinks is [0] without sinks.
  m.def("attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
        "Tensor lse, Tensor? mask, float scale, bool causal, int window, float dropout_p, "
        "Tensor? seed, int window_right=-1, float softcap=0., Tensor? sinks=None, "
        "Tensor? alibi_slopes=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
        "int max_seqlen_q=0, int max_seqlen_k=0) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, "
        "Tensor grad_sinks)");

  // Symmetric quantization of key / value rows, written into a cache: each
  // row x of the last dim (one position of one kv head) gets scale =
  // max|x| / L and values round_half_even(x / scale): int8 in [-127, 127]
  // (L = 127) or float8_e4m3fn (L = 448), as values' dtype says (a row with
  // a non-finite entry: scale NaN). x [..., D] (up to 4-D), values of x's
  // shape and scales float32 [...], any strides.
  m.def("quantize_kv(Tensor x, Tensor(a!) values, Tensor(b!) scales) -> ()");

  // Cross-entropy of the logits hidden [N, H] @ weight[V, H]^T (+ bias) against
  // target [N] (int64; ignore_index skipped), without the [N, V] logits: chunks
  // of tokens, float32 (float64) math. softcap 0 means no cap. reduction is
  // "mean" (over tokens not ignored), "sum" or "none" (per-token, 0 where
  // ignored); the result is float32 (float64 for float64 inputs).
  m.def("linear_cross_entropy(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
        "int ignore_index, str reduction, float label_smoothing, float softcap, float z_loss)"
        " -> Tensor");
  // The pass behind it: per-token losses (float32, float64 for float64) and, as
  // output_mask asks, the gradients of sum(grad_scale * loss) (grad_scale
  // absent: 1) for hidden, weight and bias, formed chunk by chunk in the same pass.
  m.def("linear_cross_entropy_pass(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
        "Tensor? grad_scale, int ignore_index, float label_smoothing, float softcap, "
        "float z_loss, bool[3] output_mask) -> (Tensor loss, Tensor grad_hidden, "
        "Tensor grad_weight, Tensor grad_bias)");

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

}  // namespace fusedllm
