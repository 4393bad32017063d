// Host-side argument checks and layout for the attention ops, shared by the
// CPU and CUDA implementations so both reject the same inputs with the same words.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "fusedllm/attention.h"
#include "fusedllm/checks.h"
#include "fusedllm/dropout.h"

namespace fusedllm {

// fusedllm._limits.MAX_HEAD_DIM (tests/test_limits.py).
constexpr int64_t kAttentionMaxHeadDim = 256;

struct AttentionShape {
  int64_t batch = 0, q_heads = 0, kv_heads = 0, sq = 0, sk = 0, head_dim = 0;
  int64_t group() const { return kv_heads > 0 ? q_heads / kv_heads : 0; }
};

inline AttentionShape check_attention_args(const char* op, const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, double scale, int64_t window) {
  TORCH_CHECK_VALUE(q.dim() == 4, op, ": q must be 4-D [batch, q_heads, q_len, head_dim], got shape ",
                    q.sizes());
  TORCH_CHECK_VALUE(k.dim() == 4, op, ": k must be 4-D [batch, kv_heads, kv_len, head_dim], got shape ",
                    k.sizes());
  TORCH_CHECK_VALUE(v.dim() == 4, op, ": v must be 4-D [batch, kv_heads, kv_len, head_dim], got shape ",
                    v.sizes());
  check_float_tensor(q, op, "q");
  check_same(q, "q", k, "k", op);
  check_same(q, "q", v, "v", op);
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), op, ": k and v must have the same shape, got ", k.sizes(),
                    " and ", v.sizes());
  AttentionShape s;
  s.batch = q.size(0);
  s.q_heads = q.size(1);
  s.sq = q.size(2);
  s.head_dim = q.size(3);
  s.kv_heads = k.size(1);
  s.sk = k.size(2);
  TORCH_CHECK_VALUE(k.size(0) == s.batch, op, ": q and k/v must have the same batch size, got ",
                    s.batch, " and ", k.size(0));
  TORCH_CHECK_VALUE(k.size(3) == s.head_dim, op, ": q and k/v must have the same head_dim, got ",
                    s.head_dim, " and ", k.size(3));
  TORCH_CHECK_VALUE(s.kv_heads > 0 ? s.q_heads % s.kv_heads == 0 : s.q_heads == 0, op,
                    ": the number of query heads (", s.q_heads,
                    ") must be a multiple of the number of key/value heads (", s.kv_heads, ")");
  TORCH_CHECK_VALUE(s.head_dim >= 1 && s.head_dim <= kAttentionMaxHeadDim, op,
                    ": head_dim must be between 1 and ", kAttentionMaxHeadDim, ", got ", s.head_dim);
  TORCH_CHECK_VALUE(std::isfinite(scale), op, ": scale must be a finite number, got ", scale);
  TORCH_CHECK_VALUE(window == -1 || window >= 1, op,
                    ": window must be -1 (no window) or a number of keys >= 1, got ", window);
  return s;
}

inline at::ScalarType lse_dtype(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// `t` with unit stride along head_dim (a copy only when it has none); the
// batch, head and sequence strides are used as they are.
inline at::Tensor unit_last_stride(const at::Tensor& t) {
  return (t.size(3) > 1 && t.stride(3) != 1) ? t.contiguous() : t;
}

inline attn::Mask make_mask(const AttentionShape& s, bool causal, int64_t window) {
  attn::Mask m;
  m.sk = s.sk;
  m.offset = s.sk - s.sq;
  m.window = window;
  m.causal = causal;
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

// What forward and backward calls share, checked: the shape, the causal /
// window mask, the caller's mask (a broadcast view kept alive here), dropout
// and scale.
struct AttentionParams {
  AttentionShape shape;
  attn::Mask mask;
  attn::TensorMask tensor_mask;
  dropout::Dropout dropout;
  at::Tensor mask_view;
  double scale = 1.0;
};

inline void check_attention_params(AttentionParams& p, const char* op, const at::Tensor& q,
                                   const at::Tensor& k, const at::Tensor& v,
                                   const c10::optional<at::Tensor>& mask, double scale, bool causal,
                                   int64_t window, double dropout_p,
                                   const c10::optional<at::Tensor>& seed) {
  p.shape = check_attention_args(op, q, k, v, scale, window);
  p.mask = make_mask(p.shape, causal, window);
  p.tensor_mask = check_tensor_mask(op, mask, q, p.shape, p.mask_view);
  p.dropout = check_dropout(op, dropout_p, seed);
  p.scale = scale;
}

// Checked operands and fresh outputs of a forward call. q, k, v have unit
// stride along head_dim; out is contiguous [B, Hq, Sq, D], lse [B, Hq, Sq].
struct AttentionForwardPlan : AttentionParams {
  at::Tensor q, k, v;
  at::Tensor out, lse;
  bool has_work = false;  // false: outputs are already final (empty, or no keys)
};

inline AttentionForwardPlan plan_attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v,
                                                   const c10::optional<at::Tensor>& mask,
                                                   double scale, bool causal, int64_t window,
                                                   double dropout_p,
                                                   const c10::optional<at::Tensor>& seed) {
  const char* op = "fusedllm.attention";
  AttentionForwardPlan p;
  check_attention_params(p, op, q, k, v, mask, scale, causal, window, dropout_p, seed);
  p.out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  p.lse = at::empty({p.shape.batch, p.shape.q_heads, p.shape.sq}, q.options().dtype(lse_dtype(q)));
  if (p.out.numel() == 0) return p;
  if (p.shape.sk == 0) {
    // No keys: every row is empty, so out = 0 and lse = -inf.
    p.out.zero_();
    p.lse.fill_(-std::numeric_limits<double>::infinity());
    return p;
  }
  p.q = unit_last_stride(q);
  p.k = unit_last_stride(k);
  p.v = unit_last_stride(v);
  p.has_work = true;
  return p;
}

// Checked operands and outputs of a backward call; grad_q/k/v are contiguous.
struct AttentionBackwardPlan : AttentionParams {
  at::Tensor grad_out, q, k, v, out, lse;
  at::Tensor grad_q, grad_k, grad_v;
  bool has_work = false;
};

inline AttentionBackwardPlan plan_attention_backward(const at::Tensor& grad_out, const at::Tensor& q,
                                                     const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& out, const at::Tensor& lse,
                                                     const c10::optional<at::Tensor>& mask,
                                                     double scale, bool causal, int64_t window,
                                                     double dropout_p,
                                                     const c10::optional<at::Tensor>& seed) {
  const char* op = "fusedllm.attention_backward";
  AttentionBackwardPlan p;
  check_attention_params(p, op, q, k, v, mask, scale, causal, window, dropout_p, seed);
  check_same(q, "q", grad_out, "grad_out", op);
  check_same(q, "q", out, "out", op);
  TORCH_CHECK_VALUE(grad_out.sizes() == q.sizes(), op, ": grad_out must have the shape of q ",
                    q.sizes(), ", got ", grad_out.sizes());
  TORCH_CHECK_VALUE(out.sizes() == q.sizes(), op, ": out must have the shape of q ", q.sizes(),
                    ", got ", out.sizes());
  TORCH_CHECK_VALUE(lse.scalar_type() == lse_dtype(q) && lse.device() == q.device() &&
                        lse.dim() == 3 && lse.size(0) == p.shape.batch &&
                        lse.size(1) == p.shape.q_heads && lse.size(2) == p.shape.sq,
                    op, ": lse must be the ", dtype_name(lse_dtype(q)), " [batch, q_heads, q_len] = [",
                    p.shape.batch, ", ", p.shape.q_heads, ", ", p.shape.sq,
                    "] tensor returned by the forward op, got ", dtype_name(lse.scalar_type()), " ",
                    lse.sizes());
  const auto contiguous = q.options().memory_format(at::MemoryFormat::Contiguous);
  p.grad_q = at::empty(q.sizes(), contiguous);
  p.grad_k = at::empty(k.sizes(), contiguous);
  p.grad_v = at::empty(v.sizes(), contiguous);
  if (p.grad_q.numel() == 0 || p.shape.sk == 0) {
    // No query or no key: nothing flows anywhere.
    p.grad_q.zero_();
    p.grad_k.zero_();
    p.grad_v.zero_();
    return p;
  }
  p.grad_out = unit_last_stride(grad_out);
  p.q = unit_last_stride(q);
  p.k = unit_last_stride(k);
  p.v = unit_last_stride(v);
  p.out = unit_last_stride(out);
  p.lse = lse.contiguous();
  p.has_work = true;
  return p;
}

// The two operators for one device. `Impl` provides
//   static void forward(const AttentionForwardPlan&);
//   static void backward(const AttentionBackwardPlan&);
// which run the kernels on plans with work.
template <typename Impl>
struct AttentionOps {
  static std::tuple<at::Tensor, at::Tensor> attention(
      const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
      const c10::optional<at::Tensor>& mask, double scale, bool causal, int64_t window,
      double dropout_p, const c10::optional<at::Tensor>& seed) {
    auto p = plan_attention_forward(q, k, v, mask, scale, causal, window, dropout_p, seed);
    if (p.has_work) Impl::forward(p);
    return {p.out, p.lse};
  }

  static std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
      const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
      const at::Tensor& out, const at::Tensor& lse, const c10::optional<at::Tensor>& mask,
      double scale, bool causal, int64_t window, double dropout_p,
      const c10::optional<at::Tensor>& seed) {
    auto p = plan_attention_backward(grad_out, q, k, v, out, lse, mask, scale, causal, window,
                                     dropout_p, seed);
    if (p.has_work) Impl::backward(p);
    return {p.grad_q, p.grad_k, p.grad_v};
  }
};

}  // namespace fusedllm

// Registers the attention operators of one dispatch key; use inside TORCH_LIBRARY_IMPL.
#define FUSEDLLM_IMPL_ATTENTION_OPS(m, Impl)                                             \
  do {                                                                                  \
    (m).impl("attention", &::fusedllm::AttentionOps<Impl>::attention);                  \
    (m).impl("attention_backward", &::fusedllm::AttentionOps<Impl>::attention_backward); \
  } while (0)
