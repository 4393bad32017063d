// Host-side argument checks and layout for the attention ops, shared by the
// CPU and CUDA implementations so both reject the same inputs with the same words.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "fusedllm/attention.h"
#include "fusedllm/checks.h"
#include "fusedllm/dropout.h"
#include "fusedllm/kv_quant_op.h"

namespace fusedllm {

// The schemas of attention's operators, for torch.ops.fusedllm (csrc/attention.cpp) and the
// emulated torch.ops.fusedllm_simt (csrc/cuda/attention.cu).
inline void define_attention_ops(torch::Library& m) {
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
}

// fusedllm._limits.MAX_HEAD_DIM (tests/test_limits.py).
constexpr int64_t kAttentionMaxHeadDim = 256;

struct AttentionShape {
  int64_t batch = 0, q_heads = 0, kv_heads = 0, sq = 0, sk = 0, head_dim = 0;
  // Packed sequences: batch is their number, sq / sk the longest lengths.
  bool packed = false;
  int64_t total_q = 0, total_k = 0;
  int64_t group() const { return kv_heads > 0 ? q_heads / kv_heads : 0; }
};

// What both ops take besides the tensors they differentiate, as passed.
struct AttentionArgs {
  c10::optional<at::Tensor> mask;
  double scale = 1.0;
  bool causal = false;
  int64_t window = -1, window_right = -1;
  double dropout_p = 0.0;
  c10::optional<at::Tensor> seed;
  double softcap = 0.0;
  c10::optional<at::Tensor> sinks, alibi_slopes, cu_seqlens_q, cu_seqlens_k;
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;
  // int8 / float8_e4m3fn k and v: float32 scales, one per position and kv head (forward only).
  c10::optional<at::Tensor> k_scale, v_scale;
  // A KV cache of sequences of different lengths, dense or paged (forward only).
  c10::optional<at::Tensor> kv_lens, block_table;
  // Whether the kernels test kv_lens and block_table entries as they read them
  // (check_kv_lens), not the host.
  bool lengths_on_device = false;
};

inline bool given(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// k and v in q's dtype, or both int8 / both float8_e4m3fn with their scales
// (an inference cache).
inline void check_kv_dtypes(const char* op, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const AttentionArgs& a) {
  kvq::Code code_k, code_v;
  const bool k8 = kv_code(k.scalar_type(), code_k), v8 = kv_code(v.scalar_type(), code_v);
  if (!k8 && !v8 && !given(a.k_scale) && !given(a.v_scale)) {
    check_same(q, "q", k, "k", op);
    check_same(q, "q", v, "v", op);
    return;
  }
  TORCH_CHECK_VALUE(k8 || v8, op, ": k_scale / v_scale are the scales of int8 (or float8_e4m3fn) k and v, "
                    "but k and v are ", dtype_name(k.scalar_type()));
  TORCH_CHECK_VALUE(k8 && v8 && code_k == code_v, op, ": k and v are int8 (or float8_e4m3fn) together or "
                    "not at all, got k ", dtype_name(k.scalar_type()), " and v ", dtype_name(v.scalar_type()));
  TORCH_CHECK_VALUE(given(a.k_scale) && given(a.v_scale), op, ": ", dtype_name(k.scalar_type()),
                    " k and v need k_scale and v_scale (float32, one scale per position and kv head)");
  const at::ScalarType dt = q.scalar_type();
  TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op, ": with ",
                    dtype_name(k.scalar_type()), " k and v, q must be float32, bfloat16 or float16, got ",
                    dtype_name(dt));
  const auto on_q = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.device() == q.device(), op, ": ", name, " is on ", t.device(), " but q is on ",
                      q.device());
  };
  on_q(k, "k");
  on_q(v, "v");
  on_q(*a.k_scale, "k_scale");
  on_q(*a.v_scale, "v_scale");
}

inline void check_qkv_dims(const char* op, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, bool packed) {
  if (packed) {
    TORCH_CHECK_VALUE(q.dim() == 3, op, ": with cu_seqlens, q must be 3-D [total_q, q_heads, head_dim], "
                      "got shape ", q.sizes());
    TORCH_CHECK_VALUE(k.dim() == 3, op, ": with cu_seqlens, k must be 3-D [total_k, kv_heads, head_dim], "
                      "got shape ", k.sizes());
    TORCH_CHECK_VALUE(v.dim() == 3, op, ": with cu_seqlens, v must be 3-D [total_k, kv_heads, head_dim], "
                      "got shape ", v.sizes());
    return;
  }
  TORCH_CHECK_VALUE(q.dim() == 4, op, ": q must be 4-D [batch, q_heads, q_len, head_dim], got shape ",
                    q.sizes());
  TORCH_CHECK_VALUE(k.dim() == 4, op, ": k must be 4-D [batch, kv_heads, kv_len, head_dim], got shape ",
                    k.sizes());
  TORCH_CHECK_VALUE(v.dim() == 4, op, ": v must be 4-D [batch, kv_heads, kv_len, head_dim], got shape ",
                    v.sizes());
}

// Checks cumulative sequence lengths (int32 [n + 1] from 0, non-decreasing, up
// to total) and returns the longest length; max_len > 0 must be at least that.
// CUDA tensors are read through one copy to the host.
inline int64_t check_cu_seqlens(const char* op, const char* name, const at::Tensor& cu,
                                const at::Tensor& q, int64_t total, const char* total_name,
                                int64_t max_len, const char* max_name) {
  TORCH_CHECK_VALUE(cu.scalar_type() == at::kInt, op, ": ", name, " must be int32, got ",
                    dtype_name(cu.scalar_type()));
  TORCH_CHECK_VALUE(cu.dim() == 1 && cu.numel() >= 1, op, ": ", name,
                    " must be 1-D [num_seqs + 1], got shape ", cu.sizes());
  TORCH_CHECK_VALUE(cu.device() == q.device(), op, ": ", name, " is on ", cu.device(),
                    " but q is on ", q.device());
  const at::Tensor host = cu.device().is_cpu() ? cu.contiguous() : cu.to(at::kCPU);
  const int32_t* c = host.data_ptr<int32_t>();
  const int64_t n = host.numel();
  TORCH_CHECK_VALUE(c[0] == 0, op, ": ", name, " must start at 0, got ", c[0]);
  int64_t longest = 0;
  for (int64_t i = 1; i < n; ++i) {
    TORCH_CHECK_VALUE(c[i] >= c[i - 1], op, ": ", name, " must be non-decreasing, got ", c[i - 1],
                      " then ", c[i], " at index ", i);
    longest = std::max<int64_t>(longest, c[i] - c[i - 1]);
  }
  TORCH_CHECK_VALUE(c[n - 1] == total, op, ": ", name, " must end at ", total_name, " = ", total,
                    ", got ", c[n - 1]);
  TORCH_CHECK_VALUE(max_len >= 0, op, ": ", max_name, " must be >= 0 (0: the longest), got ", max_len);
  TORCH_CHECK_VALUE(max_len == 0 || max_len >= longest, op, ": ", max_name, " is ", max_len, " but ",
                    name, " has a sequence of length ", longest);
  return max_len > 0 ? max_len : longest;
}

// kv_lens (int32 [batch]): sequence b has the first kv_lens[b] keys of its
// rows. With block_table (int32 [batch, max_pages]) k and v are pages
// [num_pages, kv_heads, page_size, head_dim] and sequence b's key j is row
// j % page_size of page block_table[b, j / page_size]; entries past a
// sequence's last page are not read. Returns the longest length, read on the
// host; or, with values_on_device (the CUDA kernels, which test each entry as
// they read it: a copy to the host would wait for the GPU and keep CUDA graphs
// from capturing the call), the most keys a sequence can have.
inline int64_t check_kv_lens(const char* op, const at::Tensor& q, const at::Tensor& k,
                             const AttentionArgs& a, int64_t batch, bool values_on_device) {
  const bool paged = given(a.block_table);
  TORCH_CHECK_VALUE(given(a.kv_lens), op, ": block_table needs kv_lens (int32 [batch], the number of "
                    "keys of each sequence)");
  TORCH_CHECK_VALUE(!a.cu_seqlens_q.has_value(), op, ": kv_lens / block_table take q as [batch, q_heads, "
                    "q_len, head_dim], not packed sequences (cu_seqlens)");
  TORCH_CHECK_VALUE(!given(a.mask), op, ": mask is not supported with kv_lens / block_table; each "
                    "sequence's keys end at its kv_lens entry, bounded by causal / window");
  TORCH_CHECK_VALUE(a.dropout_p == 0.0, op, ": kv_lens / block_table read a KV cache for inference; "
                    "dropout_p must be 0, got ", a.dropout_p);
  const auto on_q = [&](const at::Tensor& t, const char* name, int64_t dims, const char* shape) {
    TORCH_CHECK_VALUE(t.scalar_type() == at::kInt, op, ": ", name, " must be int32, got ",
                      dtype_name(t.scalar_type()));
    TORCH_CHECK_VALUE(t.device() == q.device(), op, ": ", name, " is on ", t.device(), " but q is on ",
                      q.device());
    TORCH_CHECK_VALUE(t.dim() == dims && t.size(0) == batch, op, ": ", name, " must be ", shape,
                      " with batch = ", batch, ", got shape ", t.sizes());
  };
  on_q(*a.kv_lens, "kv_lens", 1, "[batch]");
  const int64_t page_size = k.size(2);
  int64_t capacity = k.size(2), pages = 0;
  at::Tensor table;
  if (paged) {
    on_q(*a.block_table, "block_table", 2, "[batch, max_pages]");
    TORCH_CHECK_VALUE(page_size >= 1, op, ": with block_table, k and v are pages [num_pages, kv_heads, "
                      "page_size, head_dim] with page_size >= 1, got shape ", k.sizes());
    pages = a.block_table->size(1);
    capacity = pages * page_size;
  }
  if (values_on_device) return capacity;
  if (paged) table = a.block_table->to(at::kCPU).contiguous();
  const at::Tensor lens = a.kv_lens->to(at::kCPU).contiguous();
  const int32_t* len = lens.data_ptr<int32_t>();
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(len[b] >= 0 && len[b] <= capacity, op, ": kv_lens[", b, "] = ", len[b],
                      " is not in [0, ", capacity, "] (",
                      paged ? "block_table's max_pages * page_size" : "k's kv_len", ")");
    longest = std::max<int64_t>(longest, len[b]);
    if (!paged) continue;
    const int32_t* row = table.data_ptr<int32_t>() + b * pages;
    for (int64_t i = 0; i < (len[b] + page_size - 1) / page_size; ++i) {
      TORCH_CHECK_VALUE(row[i] >= 0 && row[i] < k.size(0), op, ": block_table[", b, ", ", i, "] = ",
                        row[i], " is not a page of k / v (num_pages = ", k.size(0), "); sequence ", b,
                        " has ", len[b], " keys, so its first ", (len[b] + page_size - 1) / page_size,
                        " entries are read");
    }
  }
  return longest;
}

inline AttentionShape check_attention_args(const char* op, const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, const AttentionArgs& a) {
  const bool packed = a.cu_seqlens_q.has_value() || a.cu_seqlens_k.has_value();
  TORCH_CHECK_VALUE(a.cu_seqlens_q.has_value() == a.cu_seqlens_k.has_value(), op,
                    ": cu_seqlens_q and cu_seqlens_k go together: pass both or neither");
  check_qkv_dims(op, q, k, v, packed);
  check_float_tensor(q, op, "q");
  check_kv_dtypes(op, q, k, v, a);
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), op, ": k and v must have the same shape, got ", k.sizes(),
                    " and ", v.sizes());
  AttentionShape s;
  s.packed = packed;
  const int64_t hd = q.dim() - 1, hk = q.dim() - 3 + (packed ? 1 : 0);
  s.q_heads = q.size(hk);
  s.kv_heads = k.size(hk);
  s.head_dim = q.size(hd);
  TORCH_CHECK_VALUE(k.size(hd) == s.head_dim, op, ": q and k/v must have the same head_dim, got ",
                    s.head_dim, " and ", k.size(hd));
  if (packed) {
    s.total_q = q.size(0);
    s.total_k = k.size(0);
    TORCH_CHECK_VALUE(a.cu_seqlens_q->numel() == a.cu_seqlens_k->numel(), op,
                      ": cu_seqlens_q and cu_seqlens_k must have the same length (num_seqs + 1), got ",
                      a.cu_seqlens_q->numel(), " and ", a.cu_seqlens_k->numel());
    s.sq = check_cu_seqlens(op, "cu_seqlens_q", *a.cu_seqlens_q, q, s.total_q, "total_q",
                            a.max_seqlen_q, "max_seqlen_q");
    s.sk = check_cu_seqlens(op, "cu_seqlens_k", *a.cu_seqlens_k, q, s.total_k, "total_k",
                            a.max_seqlen_k, "max_seqlen_k");
    s.batch = a.cu_seqlens_q->numel() - 1;
    TORCH_CHECK_VALUE(!a.mask.has_value() || !a.mask->defined(), op,
                      ": mask is not supported with packed sequences (cu_seqlens); each sequence "
                      "attends within itself, with causal / window bounds");
  } else {
    s.batch = q.size(0);
    s.sq = q.size(2);
    s.sk = k.size(2);
    TORCH_CHECK_VALUE(given(a.block_table) || k.size(0) == s.batch, op,
                      ": q and k/v must have the same batch size, got ", s.batch, " and ", k.size(0));
    TORCH_CHECK_VALUE(a.max_seqlen_q == 0 && a.max_seqlen_k == 0, op,
                      ": max_seqlen_q / max_seqlen_k are for packed sequences (cu_seqlens) only");
  }
  if (given(a.kv_lens) || given(a.block_table)) s.sk = check_kv_lens(op, q, k, a, s.batch, a.lengths_on_device);
  TORCH_CHECK_VALUE(s.kv_heads > 0 ? s.q_heads % s.kv_heads == 0 : s.q_heads == 0, op,
                    ": the number of query heads (", s.q_heads,
                    ") must be a multiple of the number of key/value heads (", s.kv_heads, ")");
  TORCH_CHECK_VALUE(s.head_dim >= 1 && s.head_dim <= kAttentionMaxHeadDim, op,
                    ": head_dim must be between 1 and ", kAttentionMaxHeadDim, ", got ", s.head_dim);
  TORCH_CHECK_VALUE(std::isfinite(a.scale), op, ": scale must be a finite number, got ", a.scale);
  TORCH_CHECK_VALUE(a.window == -1 || a.window >= 1, op,
                    ": window must be -1 (no window) or a number of keys >= 1, got ", a.window);
  TORCH_CHECK_VALUE(a.window_right >= -1, op,
                    ": window_right must be -1 (no bound) or a number of keys >= 0, got ", a.window_right);
  TORCH_CHECK_VALUE(std::isfinite(a.softcap) && a.softcap >= 0, op,
                    ": softcap must be 0 (none) or a positive number, got ", a.softcap);
  return s;
}

// `t` as a [batch, heads, seq, head_dim] operand with unit stride along
// head_dim (a copy only when it has none). Packed [total, heads, head_dim]
// tensors become [1, heads, total, head_dim] views with batch stride 0 (a
// sequence's rows start at its cu_seqlens entry).
inline at::Tensor as_operand(const at::Tensor& t, bool packed) {
  const at::Tensor u = (t.size(-1) > 1 && t.stride(-1) != 1) ? t.contiguous() : t;
  if (!packed) return u;
  return u.as_strided({1, u.size(1), u.size(0), u.size(2)}, {0, u.stride(1), u.stride(0), u.stride(2)});
}

// A fresh [*, heads, seq, head_dim] output in the rows' order: contiguous
// [B, H, S, D], or [H, total, D] storage seen as [total, H, D] when packed.
inline at::Tensor new_rows(const at::Tensor& like, const AttentionShape& s, int64_t heads, bool keys) {
  const auto opts = like.options().memory_format(at::MemoryFormat::Contiguous);
  if (s.packed) {
    return at::empty({heads, keys ? s.total_k : s.total_q, s.head_dim}, opts).permute({1, 0, 2});
  }
  return at::empty({s.batch, heads, keys ? s.sk : s.sq, s.head_dim}, opts);
}

inline std::vector<int64_t> lse_shape(const AttentionShape& s) {
  if (s.packed) return {s.q_heads, s.total_q};
  return {s.batch, s.q_heads, s.sq};
}

inline attn::Mask make_mask(const AttentionShape& s, bool causal, int64_t window, int64_t window_right) {
  attn::Mask m;
  m.sk = s.sk;
  m.offset = s.sk - s.sq;
  m.left = window < 0 ? -1 : window - 1;
  m.right = causal ? 0 : window_right;
  return m;
}

// The caller's mask as a [B, Hq, Sq, Sk] broadcast view (no copy).
inline attn::TensorMask check_tensor_mask(const char* op, const c10::optional<at::Tensor>& mask,
                                          const at::Tensor& q, const AttentionShape& s,
                                          at::Tensor& keep_alive) {
  attn::TensorMask m;
  if (!mask.has_value() || !mask->defined()) return m;
  const at::Tensor& t = *mask;
  TORCH_CHECK_VALUE(t.device() == q.device(), op, ": mask is on ", t.device(), " but q is on ",
                    q.device());
  switch (t.scalar_type()) {
    case at::kBool: m.kind = attn::MaskKind::kBool; break;
    case at::kFloat: m.kind = attn::MaskKind::kFloat; break;
    case at::kDouble: m.kind = attn::MaskKind::kDouble; break;
    case at::kBFloat16: m.kind = attn::MaskKind::kBFloat16; break;
    case at::kHalf: m.kind = attn::MaskKind::kHalf; break;
    default:
      TORCH_CHECK_VALUE(false, op, ": mask must be a bool keep-mask or a float32, float64, "
                        "bfloat16 or float16 additive mask, got ", dtype_name(t.scalar_type()));
  }
  const std::vector<int64_t> target{s.batch, s.q_heads, s.sq, s.sk};
  bool ok = t.dim() <= 4;
  for (int64_t d = 1; ok && d <= t.dim(); ++d) {
    const int64_t size = t.size(t.dim() - d);
    ok = size == 1 || size == target[4 - d];
  }
  TORCH_CHECK_VALUE(ok, op, ": mask of shape ", t.sizes(),
                    " does not broadcast to [batch, q_heads, q_len, kv_len] = ", at::IntArrayRef(target));
  keep_alive = t.expand(target);
  m.data = keep_alive.data_ptr();
  m.batch_stride = keep_alive.stride(0);
  m.head_stride = keep_alive.stride(1);
  m.q_stride = keep_alive.stride(2);
  m.k_stride = keep_alive.stride(3);
  return m;
}

inline dropout::Dropout check_dropout(const char* op, double p, const c10::optional<at::Tensor>& seed) {
  TORCH_CHECK_VALUE(p >= 0.0 && p < 1.0, op, ": dropout_p must be in [0, 1), got ", p);
  dropout::Dropout d;
  if (p == 0.0) return d;
  TORCH_CHECK_VALUE(seed.has_value() && seed->defined() && seed->scalar_type() == at::kLong &&
                        seed->numel() == 1 && seed->device().is_cpu(),
                    op, ": dropout_p > 0 needs seed, a one-element int64 CPU tensor");
  d.enabled = true;
  d.seed = static_cast<uint64_t>(seed->item<int64_t>());
  d.threshold = dropout::keep_threshold(p);
  d.scale = 1.0 / (1.0 - p);
  return d;
}

// sinks [Hq] and alibi_slopes [Hq] / [B, Hq], checked, as contiguous tensors
// of the accumulator type in `keep` (the kernels read them as such).
inline void check_score_mods(const char* op, const AttentionArgs& a, const at::Tensor& q,
                             const AttentionShape& s, attn::ScoreMods& mods, at::Tensor& sinks_keep,
                             at::Tensor& alibi_keep) {
  mods.softcap = a.softcap;
  const at::ScalarType acc = accumulation_dtype(q);
  if (a.sinks.has_value() && a.sinks->defined()) {
    const at::Tensor& t = *a.sinks;
    check_float_tensor(t, op, "sinks");
    TORCH_CHECK_VALUE(t.device() == q.device(), op, ": sinks is on ", t.device(), " but q is on ",
                      q.device());
    TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == s.q_heads, op,
                      ": sinks must be 1-D [q_heads] = [", s.q_heads, "], got shape ", t.sizes());
    sinks_keep = t.to(acc).contiguous();
    mods.sinks = sinks_keep.data_ptr();
  }
  if (a.alibi_slopes.has_value() && a.alibi_slopes->defined()) {
    const at::Tensor& t = *a.alibi_slopes;
    TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, op,
                      ": alibi_slopes must be float32 or float64, got ", dtype_name(t.scalar_type()));
    TORCH_CHECK_VALUE(t.device() == q.device(), op, ": alibi_slopes is on ", t.device(),
                      " but q is on ", q.device());
    TORCH_CHECK_VALUE((t.dim() == 1 && t.size(0) == s.q_heads) ||
                          (t.dim() == 2 && t.size(0) == s.batch && t.size(1) == s.q_heads),
                      op, ": alibi_slopes must be [q_heads] = [", s.q_heads, "] or [", s.packed ? "num_seqs" : "batch",
                      ", q_heads] = [", s.batch, ", ", s.q_heads, "], got shape ", t.sizes());
    alibi_keep = t.to(acc).contiguous();
    mods.alibi = alibi_keep.data_ptr();
    mods.alibi_batch_stride = t.dim() == 2 ? s.q_heads : 0;
  }
}

// What forward and backward calls share, checked: the shape, the causal /
// window mask, the caller's mask (a broadcast view kept alive here), the
// score modifiers, the sequences, dropout and scale.
struct AttentionParams : attn::CallTerms {
  AttentionShape shape;
  at::Tensor mask_view, sinks, alibi, cu_q, cu_k;
};

inline void check_attention_params(AttentionParams& p, const char* op, const at::Tensor& q,
                                   const at::Tensor& k, const at::Tensor& v, const AttentionArgs& a) {
  p.shape = check_attention_args(op, q, k, v, a);
  const AttentionShape& s = p.shape;
  p.mask = make_mask(s, a.causal, a.window, a.window_right);
  p.tensor_mask = check_tensor_mask(op, a.mask, q, s, p.mask_view);
  check_score_mods(op, a, q, s, p.mods, p.sinks, p.alibi);
  p.dropout = check_dropout(op, a.dropout_p, a.seed);
  p.scale = a.scale;
  p.seqs.sq = s.sq;
  p.seqs.sk = s.sk;
  p.rows = attn::QueryRows{s.q_heads, s.group(), s.sq};
  p.key_rows = attn::KeyRows{s.kv_heads, s.sk};
  if (s.packed) {
    p.cu_q = a.cu_seqlens_q->contiguous();
    p.cu_k = a.cu_seqlens_k->contiguous();
    p.seqs.cu_q = p.rows.cu_q = p.cu_q.data_ptr<int32_t>();
    p.seqs.cu_k = p.key_rows.cu_k = p.cu_k.data_ptr<int32_t>();
    p.rows.total_q = s.total_q;
    p.rows.n_seqs = s.batch;
    p.key_rows.total_k = s.total_k;
  }
}

// Checked operands and fresh outputs of a forward call. q, k, v have unit
// stride along head_dim (packed ones as [1, H, total, D] views); out holds
// its rows in QueryRows order, lse is [B, Hq, Sq] ([Hq, total_q] packed).
struct AttentionForwardPlan : AttentionParams {
  at::Tensor q, k, v;
  // int8 / float8 k and v: their scales as [B, Hkv, Sk] views ([1, Hkv, total_k] packed);
  // else undefined. code: what k and v hold then.
  at::Tensor k_scale, v_scale;
  kvq::Code code = kvq::Code::kInt8;
  // A paged cache: k and v (and their scales) are pages, read through `pages`.
  attn::Pages pages;
  at::Tensor kv_lens, block_table;
  at::Tensor out, lse;
  bool has_work = false;  // false: outputs are already final (empty, or no keys)
};

// A float32 scale per key row of int8 / float8 k or v, shaped like k without head_dim:
// [batch, kv_heads, kv_len], [num_pages, kv_heads, page_size] paged, or
// [total_k, kv_heads] packed (seen as [1, kv_heads, total_k]); any strides.
inline at::Tensor check_kv_scale(const char* op, const char* name, const at::Tensor& t,
                                 const at::Tensor& k, const AttentionArgs& a) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
                    dtype_name(t.scalar_type()));
  const at::IntArrayRef want = k.sizes().slice(0, k.dim() - 1);
  const char* dims = a.cu_seqlens_q.has_value() ? "[total_k, kv_heads]"
                     : given(a.block_table)     ? "[num_pages, kv_heads, page_size]"
                                                : "[batch, kv_heads, kv_len]";
  TORCH_CHECK_VALUE(t.sizes() == want, op, ": ", name, " must be ", dims, " = ", want, ", got shape ",
                    t.sizes());
  if (t.dim() == 2) return t.as_strided({1, t.size(1), t.size(0)}, {0, t.stride(1), t.stride(0)});
  return t;
}

inline AttentionForwardPlan plan_attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v, const AttentionArgs& a) {
  // Packed sequences are what fusedllm.attention_varlen passes: its errors carry its name.
  const bool packed = a.cu_seqlens_q.has_value() || a.cu_seqlens_k.has_value();
  const char* op = packed ? "fusedllm.attention_varlen" : "fusedllm.attention";
  AttentionForwardPlan p;
  check_attention_params(p, op, q, k, v, a);
  const AttentionShape& s = p.shape;
  if (given(a.k_scale)) {
    p.k_scale = check_kv_scale(op, "k_scale", *a.k_scale, k, a);
    p.v_scale = check_kv_scale(op, "v_scale", *a.v_scale, v, a);
    kv_code(k.scalar_type(), p.code);
  }
  if (given(a.kv_lens)) {
    p.kv_lens = a.kv_lens->contiguous();
    p.seqs.k_lens = p.kv_lens.const_data_ptr<int32_t>();
    p.seqs.k_capacity = s.sk;  // with lengths_on_device; else the longest length, not exceeded
  }
  if (given(a.block_table)) {
    p.block_table = a.block_table->contiguous();
    p.pages = attn::Pages{p.block_table.const_data_ptr<int32_t>(), p.block_table.size(1), k.size(2), k.size(0)};
  }
  p.out = new_rows(q, s, s.q_heads, false);
  p.lse = at::empty(lse_shape(s), q.options().dtype(accumulation_dtype(q)));
  if (p.out.numel() == 0) return p;
  if ((s.packed ? s.total_k : s.sk) == 0) {
    // No keys: every row is empty, so out = 0 and lse = -inf (the sink's logit with sinks).
    p.out.zero_();
    if (p.sinks.defined()) {
      p.lse.copy_(s.packed ? p.sinks.unsqueeze(1).expand(lse_shape(s))
                           : p.sinks.view({1, -1, 1}).expand(lse_shape(s)));
    } else {
      p.lse.fill_(-std::numeric_limits<double>::infinity());
    }
    return p;
  }
  p.q = as_operand(q, s.packed);
  p.k = as_operand(k, s.packed);
  p.v = as_operand(v, s.packed);
  p.has_work = true;
  return p;
}

// Checked operands and outputs of a backward call; grad_q/k/v hold their rows
// in QueryRows / KeyRows order (packed: [H, total, D] storage seen as
// [total, H, D]).
struct AttentionBackwardPlan : AttentionParams {
  at::Tensor grad_out, q, k, v, out, lse;
  at::Tensor grad_q, grad_k, grad_v, grad_sinks;
  bool has_work = false;
};

inline AttentionBackwardPlan plan_attention_backward(const at::Tensor& grad_out, const at::Tensor& q,
                                                     const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& out, const at::Tensor& lse,
                                                     const AttentionArgs& a) {
  const char* op = "fusedllm.attention_backward";
  AttentionBackwardPlan p;
  check_attention_params(p, op, q, k, v, a);
  const AttentionShape& s = p.shape;
  check_same(q, "q", grad_out, "grad_out", op);
  check_same(q, "q", out, "out", op);
  TORCH_CHECK_VALUE(grad_out.sizes() == q.sizes(), op, ": grad_out must have the shape of q ",
                    q.sizes(), ", got ", grad_out.sizes());
  TORCH_CHECK_VALUE(out.sizes() == q.sizes(), op, ": out must have the shape of q ", q.sizes(),
                    ", got ", out.sizes());
  const std::vector<int64_t> want = lse_shape(s);
  TORCH_CHECK_VALUE(lse.scalar_type() == accumulation_dtype(q) && lse.device() == q.device() &&
                        lse.sizes() == at::IntArrayRef(want),
                    op, ": lse must be the ", dtype_name(accumulation_dtype(q)), " ", at::IntArrayRef(want),
                    " tensor returned by the forward op, got ", dtype_name(lse.scalar_type()), " ",
                    lse.sizes());
  p.grad_q = new_rows(q, s, s.q_heads, false);
  p.grad_k = new_rows(k, s, s.kv_heads, true);
  p.grad_v = new_rows(v, s, s.kv_heads, true);
  p.grad_sinks = a.sinks.has_value() && a.sinks->defined() ? at::zeros_like(*a.sinks)
                                                           : at::empty({0}, q.options());
  if (p.grad_q.numel() == 0 || (s.packed ? s.total_k : s.sk) == 0) {
    // No query or no key: nothing flows to q, k or v.
    p.grad_q.zero_();
    p.grad_k.zero_();
    p.grad_v.zero_();
  } else {
    p.grad_out = as_operand(grad_out, s.packed);
    p.q = as_operand(q, s.packed);
    p.k = as_operand(k, s.packed);
    p.v = as_operand(v, s.packed);
    p.out = as_operand(out, s.packed);
    p.lse = lse.contiguous();
    p.has_work = true;
  }
  if (p.sinks.defined() && grad_out.numel() > 0) {
    // d loss / d sink_h = -sum over h's rows of p_sink * rowsum(dO * O), with
    // p_sink = exp(sink_h - lse) (lse includes the sink).
    const at::ScalarType acc = accumulation_dtype(q);
    at::Tensor delta = (grad_out.to(acc) * out.to(acc)).sum(-1);  // [B, Hq, Sq] or [total_q, Hq]
    if (s.packed) delta = delta.t();
    const at::Tensor sink = s.packed ? p.sinks.view({-1, 1}) : p.sinks.view({1, -1, 1});
    at::Tensor terms = (sink - lse).exp() * delta;
    terms = s.packed ? terms.sum(1) : terms.sum(at::IntArrayRef{0, 2});
    p.grad_sinks.copy_(terms.neg());
  }
  return p;
}

inline AttentionArgs attention_args(const c10::optional<at::Tensor>& mask, double scale, bool causal,
                                    int64_t window, double dropout_p,
                                    const c10::optional<at::Tensor>& seed, int64_t window_right,
                                    double softcap, const c10::optional<at::Tensor>& sinks,
                                    const c10::optional<at::Tensor>& alibi_slopes,
                                    const c10::optional<at::Tensor>& cu_seqlens_q,
                                    const c10::optional<at::Tensor>& cu_seqlens_k,
                                    int64_t max_seqlen_q, int64_t max_seqlen_k,
                                    const c10::optional<at::Tensor>& k_scale = c10::nullopt,
                                    const c10::optional<at::Tensor>& v_scale = c10::nullopt,
                                    const c10::optional<at::Tensor>& kv_lens = c10::nullopt,
                                    const c10::optional<at::Tensor>& block_table = c10::nullopt) {
  AttentionArgs a;
  a.mask = mask;
  a.scale = scale;
  a.causal = causal;
  a.window = window;
  a.dropout_p = dropout_p;
  a.seed = seed;
  a.window_right = window_right;
  a.softcap = softcap;
  a.sinks = sinks;
  a.alibi_slopes = alibi_slopes;
  a.cu_seqlens_q = cu_seqlens_q;
  a.cu_seqlens_k = cu_seqlens_k;
  a.max_seqlen_q = max_seqlen_q;
  a.max_seqlen_k = max_seqlen_k;
  a.k_scale = k_scale;
  a.v_scale = v_scale;
  a.kv_lens = kv_lens;
  a.block_table = block_table;
  return a;
}

// The two operators for one device. `Impl` provides
//   static void forward(const AttentionForwardPlan&);
//   static void backward(const AttentionBackwardPlan&);
// which run the kernels on plans with work, and
//   static constexpr bool kLengthsOnDevice: whether its kernels test kv_lens
//   and block_table entries as they read them (AttentionArgs).
template <typename Impl>
struct AttentionOps {
  static std::tuple<at::Tensor, at::Tensor> attention(
      const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
      const c10::optional<at::Tensor>& mask, double scale, bool causal, int64_t window,
      double dropout_p, const c10::optional<at::Tensor>& seed, int64_t window_right, double softcap,
      const c10::optional<at::Tensor>& sinks, const c10::optional<at::Tensor>& alibi_slopes,
      const c10::optional<at::Tensor>& cu_seqlens_q, const c10::optional<at::Tensor>& cu_seqlens_k,
      int64_t max_seqlen_q, int64_t max_seqlen_k, const c10::optional<at::Tensor>& k_scale,
      const c10::optional<at::Tensor>& v_scale, const c10::optional<at::Tensor>& kv_lens,
      const c10::optional<at::Tensor>& block_table) {
    AttentionArgs args = attention_args(mask, scale, causal, window, dropout_p, seed, window_right, softcap,
                                        sinks, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k, k_scale, v_scale, kv_lens, block_table);
    args.lengths_on_device = Impl::kLengthsOnDevice;
    auto p = plan_attention_forward(q, k, v, args);
    if (p.has_work) Impl::forward(p);
    return {p.out, p.lse};
  }

  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
      const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
      const at::Tensor& out, const at::Tensor& lse, const c10::optional<at::Tensor>& mask,
      double scale, bool causal, int64_t window, double dropout_p,
      const c10::optional<at::Tensor>& seed, int64_t window_right, double softcap,
      const c10::optional<at::Tensor>& sinks, const c10::optional<at::Tensor>& alibi_slopes,
      const c10::optional<at::Tensor>& cu_seqlens_q, const c10::optional<at::Tensor>& cu_seqlens_k,
      int64_t max_seqlen_q, int64_t max_seqlen_k) {
    auto p = plan_attention_backward(
        grad_out, q, k, v, out, lse,
        attention_args(mask, scale, causal, window, dropout_p, seed, window_right, softcap, sinks,
                       alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k));
    if (p.has_work) Impl::backward(p);
    return {p.grad_q, p.grad_k, p.grad_v, p.grad_sinks};
  }
};

}  // namespace fusedllm

// Registers the attention operators of one dispatch key; use inside TORCH_LIBRARY_IMPL.
#define FUSEDLLM_IMPL_ATTENTION_OPS(m, Impl)                                             \
  do {                                                                                  \
    (m).impl("attention", &::fusedllm::AttentionOps<Impl>::attention);                  \
    (m).impl("attention_backward", &::fusedllm::AttentionOps<Impl>::attention_backward); \
  } while (0)
