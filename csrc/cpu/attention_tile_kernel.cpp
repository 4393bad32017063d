// The attention kernels' mask and transpose helpers (attention_tile.h),
// compiled once per instruction set.
#include <ATen/cpu/vec/vec.h>

#include <type_traits>

#include "attention_tile.h"
#include "fusedllm/activations.h"

namespace fusedllm::cpu {
inline namespace CPU_CAPABILITY {
namespace flash {

template <typename acc_t>
void mask_tile(acc_t* s, int64_t ld, int64_t nk, int64_t j0, int64_t p0, int64_t npos,
               int64_t group, const Mask mask) {
  for (int64_t pi = 0; pi < npos; ++pi) {
    const int64_t lo = std::clamp<int64_t>(attn::key_begin(mask, p0 + pi) - j0, 0, nk);
    const int64_t hi = std::clamp<int64_t>(attn::key_end(mask, p0 + pi) - j0, lo, nk);
    for (int64_t r = 0; r < group; ++r) {
      acc_t* col = s + pi * group + r;
      for (int64_t j = 0; j < lo; ++j) col[j * ld] = kNegInf<acc_t>;
      for (int64_t j = hi; j < nk; ++j) col[j * ld] = kNegInf<acc_t>;
    }
  }
}

template <typename acc_t>
void apply_score_mods(acc_t* s, int64_t ld, const TileRows& t, const attn::ScoreMods& mods,
                      int64_t offset, acc_t* cap_slope, acc_t* col_buf) {
  using V = Vectorized<acc_t>;
  constexpr int64_t W = V::size();
  const bool capped = mods.softcap > 0, alibi = mods.alibi != nullptr;
  const V cap(static_cast<acc_t>(mods.softcap));
  const V inv_cap(capped ? acc_t(1) / static_cast<acc_t>(mods.softcap) : acc_t(0));
  // Per column: the ALiBi slope and the absolute position (exact as acc_t
  // below 2^24 positions), so a vector runs along a key's row of the tile.
  acc_t* slope = col_buf;
  acc_t* pos = col_buf + ld;
  if (alibi) {
    for (int64_t c = 0; c < ld; ++c) {
      const bool real = c < t.cols();
      slope[c] = real ? mods.slope<acc_t>(t.b, t.head(c)) : acc_t(0);
      pos[c] = real ? static_cast<acc_t>(t.pos(c) + offset) : acc_t(0);
    }
  }
  for (int64_t j = 0; j < t.nk; ++j) {
    const V key(static_cast<acc_t>(t.j0 + j));
    for (int64_t c = 0; c < ld; c += W) {
      V x = V::loadu(s + j * ld + c);
      if (capped) {
        x = act::capped<VecOps<acc_t>>(x, cap);
        if (cap_slope != nullptr) act::cap_slope(x, inv_cap).store(cap_slope + j * ld + c);
      }
      if (alibi) x = x - V::loadu(slope + c) * (V::loadu(pos + c) - key).abs();
      x.store(s + j * ld + c);
    }
  }
}

template <typename M, typename acc_t>
void apply_tensor_mask_typed(acc_t* s, int64_t ld, const TileRows& t, const attn::TensorMask& m) {
  const M* base = static_cast<const M*>(m.data) + t.j0 * m.k_stride;
  const int64_t ks = m.k_stride;
  // Compared in the mask's own precision (double for double masks).
  using cmp_t = std::conditional_t<std::is_same_v<M, double>, double, float>;
  const cmp_t lowest = static_cast<cmp_t>(attn::mask_lowest(m.kind));
  for (int64_t col = 0; col < t.cols(); ++col) {
    const M* row = base + m.offset(t.b, t.head(col), t.pos(col));
    acc_t* sc = s + col;
    for (int64_t j = 0; j < t.nk; ++j) {
      if constexpr (std::is_same_v<M, bool>) {
        if (!row[j * ks]) sc[j * ld] = kNegInf<acc_t>;
      } else {
        const cmp_t x = static_cast<cmp_t>(row[j * ks]);
        sc[j * ld] = x <= lowest ? kNegInf<acc_t> : sc[j * ld] + static_cast<acc_t>(x);
      }
    }
  }
}

template <typename acc_t>
void apply_tensor_mask(acc_t* s, int64_t ld, const TileRows& t, const attn::TensorMask& m) {
  switch (m.kind) {
    case attn::MaskKind::kNone: break;
    case attn::MaskKind::kBool: apply_tensor_mask_typed<bool>(s, ld, t, m); break;
    case attn::MaskKind::kFloat: apply_tensor_mask_typed<float>(s, ld, t, m); break;
    case attn::MaskKind::kDouble: apply_tensor_mask_typed<double>(s, ld, t, m); break;
    case attn::MaskKind::kBFloat16: apply_tensor_mask_typed<c10::BFloat16>(s, ld, t, m); break;
    case attn::MaskKind::kHalf: apply_tensor_mask_typed<c10::Half>(s, ld, t, m); break;
  }
}

template <typename acc_t>
void transpose(const acc_t* src, int64_t ld_src, int64_t rows, int64_t cols, acc_t* dst,
               int64_t ld_dst) {
  // Blocks of a whole register of floats under AVX-512: its 8 x 8 blocks go
  // through ATen's 16 x 16 kernel with masks, four times the work.
#if defined(__AVX512F__)
  constexpr int64_t B = std::is_same_v<acc_t, float> ? 16 : 8;
#else
  constexpr int64_t B = 8;
#endif
  const int64_t rows_b = rows / B * B, cols_b = cols / B * B;
  for (int64_t r = 0; r < rows_b; r += B) {
    for (int64_t c = 0; c < cols_b; c += B) {
      at::vec::transpose_mxn<acc_t, B, B>(src + r * ld_src + c, ld_src, dst + c * ld_dst + r, ld_dst);
    }
    for (int64_t c = cols_b; c < cols; ++c) {
      for (int64_t i = r; i < r + B; ++i) dst[c * ld_dst + i] = src[i * ld_src + c];
    }
  }
  for (int64_t i = rows_b; i < rows; ++i) {
    for (int64_t c = 0; c < cols; ++c) dst[c * ld_dst + i] = src[i * ld_src + c];
  }
}

#define FUSEDLLM_INSTANTIATE(acc_t)                                                             \
  template void mask_tile<acc_t>(acc_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, \
                                 const Mask);                                                  \
  template void apply_tensor_mask<acc_t>(acc_t*, int64_t, const TileRows&,                     \
                                         const attn::TensorMask&);                             \
  template void apply_score_mods<acc_t>(acc_t*, int64_t, const TileRows&,                      \
                                        const attn::ScoreMods&, int64_t, acc_t*, acc_t*);      \
  template void transpose<acc_t>(const acc_t*, int64_t, int64_t, int64_t, acc_t*, int64_t)
FUSEDLLM_INSTANTIATE(float);
FUSEDLLM_INSTANTIATE(double);
#undef FUSEDLLM_INSTANTIATE

}  // namespace flash
}  // namespace CPU_CAPABILITY
}  // namespace fusedllm::cpu
