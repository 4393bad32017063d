// Vector load/store helpers for the CPU kernels. Included only by *_kernel.cpp
// files, which CMake compiles once per instruction set; everything here lives in
// the CPU_CAPABILITY inline namespace so the variants never collide.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <type_traits>

#if defined(__AVX512BF16__) || defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace fusedllm::cpu {
inline namespace CPU_CAPABILITY {

using at::vec::Vectorized;

// exp of float vectors as 2^t, t = x log2(e) = n + f (n = round(t), |f| <=
// 1/2), 2^f by a polynomial of degree 5 (1 + f q(f), q fitted for the least
// largest relative error on [-1/2, 1/2]: 9e-8, 1.9e-7 evaluated in float32,
// where Taylor's of degree 6 had 2.4e-7) and 2^n applied to its exponent:
// relative error about 2e-7 + |x| 9e-8 from t's
// rounding (below 1e-6 for x > -9, where the probabilities of a softmax that
// matter lie), exp(0) = 1 exactly, inf above 88.72, NaN for NaN, 0 below -87
// (AVX2) or a subnormal down to -103 (AVX-512, where vscalefps applies 2^n).
// ATen's exp_u20 (about 1e-6 everywhere) takes 19 instructions with three
// conversions where this takes 11: a 96 x 96 tile's softmax ran 1.17x (AVX-512)
// and 1.03x (AVX2) as fast on a Zen 4 with 12 (Taylor's degree 6). The
// DEFAULT variant keeps exp_u20.
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// 2^f's polynomial, coefficients of f^5 down to f^0
inline constexpr float kExp2Poly[6] = {1.3264631852507591e-3f, 9.671486914157867e-3f, 5.550733581185341e-2f,
                                       0.24022242426872253f, 0.6931470036506653f, 1.0f};
#endif
#if defined(CPU_CAPABILITY_AVX512)
inline __m512 exp_fast(__m512 x) {
  // min / max return their second operand when either is NaN: NaN passes
  __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  t = _mm512_min_ps(_mm512_set1_ps(129.0f), _mm512_max_ps(_mm512_set1_ps(-151.0f), t));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_scalef_ps(p, n);
}
#endif
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
inline __m256 exp_fast(__m256 x) {
  __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  t = _mm256_min_ps(_mm256_set1_ps(128.0f), _mm256_max_ps(_mm256_set1_ps(-126.0f), t));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  // 2 p 2^(n - 1), 2^(n - 1) from its exponent bits: finite up to exp(88.72)
  // (n = 128), 0 for n = -126
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(126)), 23);
  return _mm256_mul_ps(_mm256_add_ps(p, p), _mm256_castsi256_ps(bits));
}
#endif

template <typename AV>
inline AV vec_exp(const AV& x) {
  if constexpr (std::is_same_v<typename AV::value_type, float>) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    return AV(exp_fast(x));
#else
    return x.exp_u20();
#endif
  } else {
    return x.exp();
  }
}

// exp and tanh on vectors: the `Math` of fusedllm/activations.h for the
// activations and the soft-capped logits.
template <typename AV>
struct VecMath {
  static AV exp(const AV& x) { return vec_exp(x); }
  static AV tanh(const AV& x) { return x.tanh(); }
};

// Moves `kStep` elements of dtype T to and from `kParts` vectors of its
// accumulation type (float for bfloat16/float16, T itself otherwise).
// The overloads with `count` handle the tail of a row (count < kStep):
// loads fill the missing lanes with zeros.
template <typename T, typename Enable = void>
struct VecIO {
  using acc_t = T;
  using AV = Vectorized<T>;
  static constexpr int kParts = 1;
  static constexpr int64_t kStep = AV::size();

  static void load(const T* p, AV (&out)[kParts]) { out[0] = AV::loadu(p); }
  static void load(const T* p, int64_t count, AV (&out)[kParts]) { out[0] = AV::loadu(p, count); }
  static void store(T* p, const AV (&v)[kParts]) { v[0].store(p); }
  static void store(T* p, const AV (&v)[kParts], int64_t count) { v[0].store(p, count); }
  static AV round(AV v) { return v; }
};

template <typename T>
struct VecIO<T, std::enable_if_t<std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>>> {
  using acc_t = float;
  using AV = Vectorized<float>;
  using TV = Vectorized<T>;
  static constexpr int kParts = 2;
  static constexpr int64_t kStep = TV::size();

  static void load(const T* p, AV (&out)[kParts]) { split(TV::loadu(p), out); }
  static void load(const T* p, int64_t count, AV (&out)[kParts]) {
    split(TV::loadu(p, count), out);
  }
  static void store(T* p, const AV (&v)[kParts]) { narrow(v).store(p); }
  static void store(T* p, const AV (&v)[kParts], int64_t count) { narrow(v).store(p, count); }
  // Round to T and back: what a value becomes once stored in a T tensor.
  static AV round(AV v) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      // Round to nearest even on the float bits, without packing to 16 bits
      // and back; NaN passes through unchanged.
      using IV = Vectorized<int32_t>;
      const IV bits = at::vec::cast<int32_t>(v);
      const IV lsb = (bits >> IV(16)) & IV(1);
      const IV rounded = (bits + IV(0x7FFF) + lsb) & IV(static_cast<int32_t>(0xFFFF0000u));
      return AV::blendv(at::vec::cast<float>(rounded), v, v.isnan());
    } else {
      auto [a, b] = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v));
      (void)b;
      return a;
    }
  }

 private:
  // float32 -> T, rounding to nearest even. With AVX512-BF16, bfloat16 takes
  // one vcvtne2ps2bf16 (ATen's conversion is integer arithmetic); float16
  // takes ATen's vcvtps2ph (F16C / AVX-512F) in every variant but DEFAULT.
  static TV narrow(const AV (&v)[kParts]) {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      // The instruction flushes float32 subnormals (nonzero, below 2^-126) to
      // zero, where torch keeps them as bfloat16 subnormals: such a vector
      // takes ATen's conversion.
      constexpr int kDenormal = 0x20;  // vfpclassps category: nonzero subnormal
      if ((_mm512_fpclass_ps_mask(v[0], kDenormal) | _mm512_fpclass_ps_mask(v[1], kDenormal)) == 0) {
        return TV((__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]));
      }
    }
#endif
    return at::vec::convert_from_float<T>(v[0], v[1]);
  }

  static void split(const TV& v, AV (&out)[kParts]) {
    auto [a, b] = at::vec::convert_to_float<T>(v);
    out[0] = a;
    out[1] = b;
  }
};

// Load/store `count` (<= kStep) accumulator values laid out like the parts of
// one VecIO step, for per-column float32/float64 buffers.
template <typename IO>
inline void load_acc(const typename IO::acc_t* p, int64_t count,
                     typename IO::AV (&out)[IO::kParts]) {
  using AV = typename IO::AV;
  for (int q = 0; q < IO::kParts; ++q) {
    const int64_t c = std::clamp<int64_t>(count - q * AV::size(), 0, AV::size());
    out[q] = c == AV::size() ? AV::loadu(p + q * AV::size()) : AV::loadu(p + q * AV::size(), c);
  }
}

template <typename IO>
inline void store_acc(typename IO::acc_t* p, int64_t count,
                      const typename IO::AV (&v)[IO::kParts]) {
  using AV = typename IO::AV;
  for (int q = 0; q < IO::kParts; ++q) {
    const int64_t c = std::clamp<int64_t>(count - q * AV::size(), 0, AV::size());
    if (c == AV::size()) {
      v[q].store(p + q * AV::size());
    } else if (c > 0) {
      v[q].store(p + q * AV::size(), c);
    }
  }
}

// Load a full step or the tail of a row.
template <typename IO, typename T>
inline void load_step(const T* p, int64_t count, typename IO::AV (&out)[IO::kParts]) {
  if (count == IO::kStep) {
    IO::load(p, out);
  } else {
    IO::load(p, count, out);
  }
}

template <typename IO, typename T>
inline void store_step(T* p, int64_t count, const typename IO::AV (&v)[IO::kParts]) {
  if (count == IO::kStep) {
    IO::store(p, v);
  } else {
    IO::store(p, v, count);
  }
}

template <typename AV>
inline typename AV::value_type reduce_sum(const AV& v) {
  return at::vec::vec_reduce_all<typename AV::value_type>(
      [](AV& a, AV& b) { return a + b; }, v);
}

// Calls `step(j, count)` over a row of n elements in kStep chunks (the last
// one shorter when n is not a multiple of kStep).
template <typename IO, typename Step>
inline void row_for_each(int64_t n, Step&& step) {
  int64_t j = 0;
  for (; j + IO::kStep <= n; j += IO::kStep) step(j, IO::kStep);
  if (j < n) step(j, n - j);
}

// Sum over a row of n elements: `step(j, count, acc)` adds the terms of
// elements [j, j + count) into `acc`. Four independent accumulator sets hide
// the add latency; they are combined in a fixed order (same bits every run).
template <typename IO, typename Step>
inline typename IO::acc_t row_sum(int64_t n, Step&& step) {
  using AV = typename IO::AV;
  constexpr int P = IO::kParts;
  constexpr int64_t S = IO::kStep;
  constexpr int kUnroll = 4;
  AV acc[kUnroll][P];
  for (int u = 0; u < kUnroll; ++u) {
    for (int q = 0; q < P; ++q) acc[u][q] = AV(typename IO::acc_t(0));
  }
  int64_t j = 0;
  for (; j + kUnroll * S <= n; j += kUnroll * S) {
    for (int u = 0; u < kUnroll; ++u) step(j + u * S, S, acc[u]);
  }
  for (; j < n; j += S) step(j, std::min(S, n - j), acc[0]);
  AV total = acc[0][0];
  for (int u = 0; u < kUnroll; ++u) {
    for (int q = 0; q < P; ++q) {
      if (u != 0 || q != 0) total = total + acc[u][q];
    }
  }
  return reduce_sum(total);
}

}  // namespace CPU_CAPABILITY
}  // namespace fusedllm::cpu
