// Cross-entropy row kernel on CPU, compiled once per instruction set, in place
// on a chunk of logits of the input dtype (float32 math): per row, one pass for
// the cap, the maximum and the sum of s, one for the sum of exponentials, and,
// for the gradient, one writing it over the logits (a row of a 128k vocabulary
// is 256-512 KB: it stays in L2 between the passes). A slab of a row's columns
// (the weight gradient's pass) takes the row's lse and writes the gradient only.
#include "cross_entropy_kernel.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "vec.h"

namespace fusedllm::cpu {
inline namespace CPU_CAPABILITY {
namespace {

template <typename A>
struct ScalarMath {
  static A tanh(A x) { return std::tanh(x); }
};

// Caps the row in place when capping (the capped values rounded to T, as an
// eager soft-cap in T stores them); returns the maximum and the sum of s.
template <typename T, typename A>
void cap_max_sum(T* row, int64_t n, const ce::Options& o, A& max_out, A& sum_out) {
  using IO = VecIO<T>;
  using AV = typename IO::AV;
  constexpr int P = IO::kParts;
  const bool capped = o.softcap > 0.f;
  const AV cap(A(o.softcap));
  AV vmax(-std::numeric_limits<A>::infinity()), vsum(A(0));
  int64_t j = 0;
  for (; j + IO::kStep <= n; j += IO::kStep) {
    AV v[P];
    IO::load(row + j, v);
    if (capped) {
      for (int q = 0; q < P; ++q) v[q] = IO::round(ce::capped<VecMath<AV>>(v[q], cap));
      IO::store(row + j, v);
    }
    for (int q = 0; q < P; ++q) {
      vmax = at::vec::maximum(vmax, v[q]);
      vsum = vsum + v[q];
    }
  }
  A m = at::vec::vec_reduce_all<A>([](AV& a, AV& b) { return at::vec::maximum(a, b); }, vmax);
  A total = reduce_sum(vsum);
  for (; j < n; ++j) {
    if (capped) row[j] = static_cast<T>(ce::capped<ScalarMath<A>>(static_cast<A>(row[j]), A(o.softcap)));
    const A v = static_cast<A>(row[j]);
    m = std::max(m, v);
    total += v;
  }
  max_out = m;
  sum_out = total;
}

// Caps the row in place (the capped values rounded to T).
template <typename T, typename A>
void cap_row(T* row, int64_t n, const ce::Options& o) {
  using IO = VecIO<T>;
  using AV = typename IO::AV;
  constexpr int P = IO::kParts;
  const AV cap(A(o.softcap));
  row_for_each<IO>(n, [&](int64_t j, int64_t c) {
    AV v[P];
    load_step<IO>(row + j, c, v);
    for (int q = 0; q < P; ++q) v[q] = IO::round(ce::capped<VecMath<AV>>(v[q], cap));
    store_step<IO>(row + j, c, v);
  });
}

template <typename T, typename A>
A sum_exp(const T* row, int64_t n, A m) {
  using IO = VecIO<T>;
  using AV = typename IO::AV;
  constexpr int P = IO::kParts;
  const AV vm(m);
  AV acc[2] = {AV(A(0)), AV(A(0))};
  int64_t j = 0;
  for (; j + IO::kStep <= n; j += IO::kStep) {
    AV v[P];
    IO::load(row + j, v);
    for (int q = 0; q < P; ++q) acc[q % 2] = acc[q % 2] + VecMath<AV>::exp(v[q] - vm);
  }
  A total = reduce_sum(acc[0] + acc[1]);
  for (; j < n; ++j) total += std::exp(static_cast<A>(row[j]) - m);
  return total;
}

// d[j] = (p_scale * exp(s[j] - lse) - off) * ds/dz[j], over s in place; the
// target's term is added by the caller.
template <typename T, typename A>
void write_grad(T* row, int64_t n, A lse, const ce::RowGrad<A>& g, const ce::Options& o) {
  using IO = VecIO<T>;
  using AV = typename IO::AV;
  constexpr int P = IO::kParts;
  const AV vlse(lse), vp(g.p_scale), voff(g.off);
  const bool capped = o.softcap > 0.f;
  const AV inv_cap(capped ? A(1) / A(o.softcap) : A(0));
  row_for_each<IO>(n, [&](int64_t j, int64_t c) {
    AV v[P];
    load_step<IO>(row + j, c, v);
    for (int q = 0; q < P; ++q) {
      AV d = vp * VecMath<AV>::exp(v[q] - vlse) - voff;
      v[q] = capped ? d * ce::cap_slope(v[q], inv_cap) : d;
    }
    store_step<IO>(row + j, c, v);
  });
}

template <typename T>
void rows_typed(const CrossEntropyRowArgs& a) {
  using A = typename VecIO<T>::acc_t;
  const ce::Options o = a.options;
  at::parallel_for(0, a.rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = static_cast<T*>(a.logits) + r * a.logits_stride;
      const int64_t t = a.target[r];
      const bool ignored = t == a.ignore_index;
      // The target's column in this row's logits, if they hold it.
      const int64_t tc = t - a.column0;
      const bool has_target = !ignored && tc >= 0 && tc < a.vocab;
      A lse;
      if (a.slab) {
        // Only the cap, when capping: the row's statistics are known.
        if (o.softcap > 0.f) cap_row<T, A>(row, a.vocab, o);
        lse = static_cast<const A*>(a.lse)[r];
      } else {
        A m, s_sum;
        cap_max_sum<T, A>(row, a.vocab, o, m, s_sum);
        lse = m + std::log(sum_exp<T, A>(row, a.vocab, m));
        static_cast<A*>(a.lse)[r] = lse;
        static_cast<A*>(a.loss)[r] =
            ignored ? A(0) : ce::row_loss<A>(o, lse, static_cast<A>(row[tc]), s_sum);
      }
      if (!a.grad) continue;
      if (ignored) {
        std::fill(row, row + a.vocab, T(0));
        continue;
      }
      const A s_t = has_target ? static_cast<A>(row[tc]) : A(0);
      const A scale = a.scale ? static_cast<const A*>(a.scale)[r] : A(1);
      const ce::RowGrad<A> g = ce::row_grad<A>(o, lse, scale);
      write_grad<T, A>(row, a.vocab, lse, g, o);
      if (!has_target) continue;
      A d_t = g.p_scale * std::exp(s_t - lse) - g.off - g.on;
      if (o.softcap > 0.f) d_t *= ce::cap_slope(s_t, A(1) / A(o.softcap));
      row[tc] = static_cast<T>(d_t);
    }
  });
}

void cross_entropy_rows(const CrossEntropyRowArgs& a) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.dtype, "fusedllm_cross_entropy_cpu",
                                  [&] { rows_typed<scalar_t>(a); });
}

}  // namespace

FUSEDLLM_REGISTER_CPU_KERNEL(cross_entropy_row_kernels, &cross_entropy_rows);

}  // namespace CPU_CAPABILITY
}  // namespace fusedllm::cpu
