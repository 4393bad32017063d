// Flash attention CPU kernels, compiled once per instruction set (see CMakeLists.txt).
//
// Layout of the work. A task owns one (batch, kv head) pair and a tile of
// query positions; its rows are the `group` query heads of that kv head at
// each position of the tile, ordered (position, head), so K/V tiles are read
// once for the whole group. Scores are computed transposed, S^T = K Q^T
// (keys x rows), so the per-row softmax statistics are vectors across rows
// and need no horizontal reductions. Both products (K Q^T and P V) run on a
// register-blocked micro-kernel over float32 (float64) tiles; bfloat16 and
// float16 operands are converted to float32 tiles once per tile.
//
// Backward: a task owns the dK/dV rows of one (batch, kv head) pair (or of a
// strided subset of its key tiles when there are few pairs) and walks every
// query tile of the group, recomputing P from the saved log-sum-exp. dQ of a
// query tile is complete when its task has seen every key tile; with several
// key subsets each writes a partial dQ that is summed in a fixed order after
// the tasks, so the result never depends on the thread count or schedule.
#include "attention_kernel.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <cmath>
#include <type_traits>
#include <vector>

#include "fusedllm/dropout.h"
#include "vec.h"

namespace fusedllm::cpu {
inline namespace CPU_CAPABILITY {
namespace {

using attn::Mask;

template <typename acc_t>
constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// ---------------------------------------------------------------------------
// GEMM core: C (+)= A B on accumulator-type tiles.
//
// A(i, k) is a[i * lda + k] (row-major) or a[k * lda + i] (column-major, how
// the kernels read P and dS out of the transposed score tile); B is row-major
// with leading dimension ldb and N a multiple of the vector width (callers
// pad). The micro-kernel keeps an MR x (NV vectors) block of C in registers:
// per k it loads NV vectors of B and broadcasts MR values of A, for MR * NV
// fused multiply-adds.
//
// The K loop runs in chunks of kKC: each chunk sums from zero in registers
// and is then added to C (the previous chunks, or the rescaled old C). One
// sequential chain of fused multiply-adds over the whole K rounds every term
// at the size of the running sum: over a 256-wide head dim that made the
// scores, and through them outputs and gradients, 2-3x less accurate than
// SDPA's; starting from the old C did the same to dK/dV sums over many query
// tiles. Chunking costs an add per accumulator per kKC steps (with AVX-512's
// 32 registers; a load and store of the C block with fewer).
// ---------------------------------------------------------------------------

enum class ALayout { kRowMajor, kColMajor };

constexpr int kMR = 6;         // rows per micro-kernel
constexpr int kNV = 2;         // vectors of columns per micro-kernel
constexpr int64_t kKC = 32;    // terms summed in registers before they join C

// acc[i][v] += sum over k in [k0, k0 + n) of A(i, k) B(k, v), from zero
// (kN > 0: n is the constant kN, so the loop unrolls without a remainder).
template <typename acc_t, int MR, int NV, ALayout kA, int kN>
inline void chunk_sum(Vectorized<acc_t> (&acc)[MR][NV], int64_t k0, int64_t n,
                      const acc_t* __restrict a, int64_t lda, const acc_t* __restrict b,
                      int64_t ldb) {
  using V = Vectorized<acc_t>;
  constexpr int W = V::size();
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = V(acc_t(0));
  }
  const int64_t count = kN > 0 ? kN : n;
#pragma GCC unroll 4
  for (int64_t kk = 0; kk < count; ++kk) {
    const int64_t k = k0 + kk;
    V bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = V::loadu(b + k * ldb + v * W);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const V ai(kA == ALayout::kRowMajor ? a[i * lda + k] : a[k * lda + i]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = at::vec::fmadd(ai, bv[v], acc[i][v]);
    }
  }
}

// C[MR x NV*W] = (kLoadC ? diag(row_scale) C : 0) + A[MR x K] B[K x NV*W]
// (row_scale may be null: no rescale). The chunks' sums are added up in
// registers where the ISA has enough of them (AVX-512's 32), else in C.
template <typename acc_t, int MR, int NV, ALayout kA, bool kLoadC>
inline void micro_kernel(int64_t K, const acc_t* __restrict a, int64_t lda,
                         const acc_t* __restrict b, int64_t ldb, acc_t* __restrict c, int64_t ldc,
                         const acc_t* __restrict row_scale) {
  using V = Vectorized<acc_t>;
  constexpr int W = V::size();
  constexpr bool kTotalsInRegisters = W * sizeof(acc_t) == 64;
  V total[MR][NV], part[MR][NV];
  // First chunk (possibly short): from zero, plus the rescaled old C.
  const int64_t first = std::min(K, kKC);
  chunk_sum<acc_t, MR, NV, kA, 0>(total, 0, first, a, lda, b, ldb);
  if constexpr (kLoadC) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const V scale_i = row_scale != nullptr ? V(row_scale[i]) : V(acc_t(1));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        total[i][v] = at::vec::fmadd(V::loadu(c + i * ldc + v * W), scale_i, total[i][v]);
      }
    }
  }
  if (K > first) {
    if constexpr (!kTotalsInRegisters) {
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) total[i][v].store(c + i * ldc + v * W);
      }
    }
    for (int64_t k0 = first; k0 < K; k0 += kKC) {
      if (k0 + kKC <= K) {
        chunk_sum<acc_t, MR, NV, kA, kKC>(part, k0, kKC, a, lda, b, ldb);
      } else {
        chunk_sum<acc_t, MR, NV, kA, 0>(part, k0, K - k0, a, lda, b, ldb);
      }
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) {
          if constexpr (kTotalsInRegisters) {
            total[i][v] = total[i][v] + part[i][v];
          } else {
            (V::loadu(c + i * ldc + v * W) + part[i][v]).store(c + i * ldc + v * W);
          }
        }
      }
    }
    if constexpr (!kTotalsInRegisters) return;
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) total[i][v].store(c + i * ldc + v * W);
  }
}

// One column panel of NV vectors for all M rows.
template <typename acc_t, int NV, ALayout kA, bool kLoadC>
inline void gemm_panel(int64_t M, int64_t K, const acc_t* a, int64_t lda, const acc_t* b,
                       int64_t ldb, acc_t* c, int64_t ldc, const acc_t* row_scale) {
  const auto a_rows = [lda](const acc_t* base, int64_t i) {
    return kA == ALayout::kRowMajor ? base + i * lda : base + i;
  };
  int64_t i = 0;
  for (; i + kMR <= M; i += kMR) {
    micro_kernel<acc_t, kMR, NV, kA, kLoadC>(K, a_rows(a, i), lda, b, ldb, c + i * ldc, ldc,
                                             row_scale ? row_scale + i : nullptr);
  }
  const acc_t* ai = a_rows(a, i);
  acc_t* ci = c + i * ldc;
  const acc_t* si = row_scale ? row_scale + i : nullptr;
  switch (M - i) {
    case 1: micro_kernel<acc_t, 1, NV, kA, kLoadC>(K, ai, lda, b, ldb, ci, ldc, si); break;
    case 2: micro_kernel<acc_t, 2, NV, kA, kLoadC>(K, ai, lda, b, ldb, ci, ldc, si); break;
    case 3: micro_kernel<acc_t, 3, NV, kA, kLoadC>(K, ai, lda, b, ldb, ci, ldc, si); break;
    case 4: micro_kernel<acc_t, 4, NV, kA, kLoadC>(K, ai, lda, b, ldb, ci, ldc, si); break;
    case 5: micro_kernel<acc_t, 5, NV, kA, kLoadC>(K, ai, lda, b, ldb, ci, ldc, si); break;
    default: break;
  }
}

// C[M x N] = (kLoadC ? diag(row_scale) C : 0) + A[M x K] B[K x N], N a multiple of
// the vector width. Column panels outside, so each panel of B stays in L1
// while every row block of A streams past it.
template <typename acc_t, ALayout kA, bool kLoadC>
void gemm(int64_t M, int64_t N, int64_t K, const acc_t* a, int64_t lda, const acc_t* b,
          int64_t ldb, acc_t* c, int64_t ldc, const acc_t* row_scale = nullptr) {
  constexpr int64_t W = Vectorized<acc_t>::size();
  int64_t j = 0;
  for (; j + kNV * W <= N; j += kNV * W) {
    gemm_panel<acc_t, kNV, kA, kLoadC>(M, K, a, lda, b + j, ldb, c + j, ldc, row_scale);
  }
  for (; j < N; j += W) {
    gemm_panel<acc_t, 1, kA, kLoadC>(M, K, a, lda, b + j, ldb, c + j, ldc, row_scale);
  }
}

// ---------------------------------------------------------------------------
// Vector operations for the shared online-softmax template.
// ---------------------------------------------------------------------------

template <typename acc_t>
struct VecOps {
  using V = Vectorized<acc_t>;
  static V max(V a, V b) { return at::vec::maximum(a, b); }
  static V exp(V x) {
    if constexpr (std::is_same_v<acc_t, float>) {
      return x.exp_u20();  // ~1e-6 relative error, several times faster than exp()
    } else {
      return x.exp();
    }
  }
  static V finite_or_zero(V x) { return V::blendv(x, V(acc_t(0)), x == V(kNegInf<acc_t>)); }
};

// ---------------------------------------------------------------------------
// Row conversion helpers (T <-> accumulator type).
// ---------------------------------------------------------------------------

// dst[0, n) = src[0, n) * scale in the accumulator type; dst[n, n_pad) = 0.
template <typename T>
inline void load_row(const T* src, int64_t n, int64_t n_pad, typename VecIO<T>::acc_t scale,
                     typename VecIO<T>::acc_t* dst) {
  using IO = VecIO<T>;
  using AV = typename IO::AV;
  constexpr int P = IO::kParts;
  const AV s(scale);
  int64_t j = 0;
  for (; j < n; j += IO::kStep) {
    const int64_t c = std::min<int64_t>(IO::kStep, n - j);
    AV v[P];
    load_step<IO>(src + j, c, v);
    for (int q = 0; q < P; ++q) v[q] = v[q] * s;
    store_acc<IO>(dst + j, c, v);
  }
  for (j = n; j < n_pad; ++j) dst[j] = 0;
}

// dst[0, n) = T(src[0, n) * scale).
template <typename T>
inline void store_row(const typename VecIO<T>::acc_t* src, int64_t n,
                      typename VecIO<T>::acc_t scale, T* dst) {
  using IO = VecIO<T>;
  using AV = typename IO::AV;
  constexpr int P = IO::kParts;
  const AV s(scale);
  for (int64_t j = 0; j < n; j += IO::kStep) {
    const int64_t c = std::min<int64_t>(IO::kStep, n - j);
    AV v[P];
    load_acc<IO>(src + j, c, v);
    for (int q = 0; q < P; ++q) v[q] = v[q] * s;
    store_step<IO>(dst + j, c, v);
  }
}

// ---------------------------------------------------------------------------
// Tiling: shared by forward and backward, a function of the shape only.
// ---------------------------------------------------------------------------

constexpr int64_t kRowsPerTile = 96;  // query rows (positions x group heads) per tile
constexpr int64_t kKeysPerTile = 96;
constexpr int64_t kMinTasks = 8;      // split further below this many independent tasks
constexpr int64_t kMaxPartialBytes = int64_t(256) << 20;  // cap on split-partial scratch
// Multiply-adds of QK^T below which a call runs on the calling thread: waking
// other threads (and, on a loaded machine, waiting for them to be scheduled)
// costs more than such a call (a decoding step over a short cache).
constexpr int64_t kMinParallelWork = int64_t(1) << 21;

// Slots for a call: threads when the work is large enough, else one.
inline int64_t work_slots(int64_t n_tasks, int64_t work) {
  if (work < kMinParallelWork) return 1;
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_tasks));
}

template <typename acc_t>
struct Tiling {
  int64_t batch, kv_heads, group, sq, sk, d, d_pad;
  int64_t block_q, rows, rows_pad, block_k;
  int64_t q_tiles, k_tiles;

  Tiling(int64_t batch_, int64_t q_heads, int64_t kv_heads_, int64_t sq_, int64_t sk_, int64_t d_)
      : batch(batch_), kv_heads(kv_heads_), group(q_heads / kv_heads_), sq(sq_), sk(sk_), d(d_) {
    constexpr int64_t W = Vectorized<acc_t>::size();
    d_pad = round_up(d, W);
    const int64_t target_rows = d > 128 ? kRowsPerTile * 2 / 3 : kRowsPerTile;
    block_q = std::clamp<int64_t>(target_rows / group, 1, std::max<int64_t>(sq, 1));
    rows = block_q * group;
    rows_pad = round_up(rows, W);
    block_k = d > 128 ? kKeysPerTile * 2 / 3 : kKeysPerTile;
    q_tiles = ceil_div(sq, block_q);
    k_tiles = ceil_div(sk, block_k);
  }

  // Column i of a tile starting at position p0: query head and position.
  int64_t head_of(int64_t g, int64_t i) const { return g * group + i % group; }
  int64_t pos_of(int64_t p0, int64_t i) const { return p0 + i / group; }
};

// Runs fn(task, slot) for every task in [0, n_tasks) on `slots` threads (from
// work_slots); tasks are handed out in index order from a shared counter (so
// uneven tasks balance), and `slot` identifies the caller's scratch space.

template <typename F>
void run_tasks(int64_t n_tasks, int64_t slots, const F& fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, slots, 1, [&](int64_t begin, int64_t end) {
    for (int64_t slot = begin; slot < end; ++slot) {
      for (int64_t t = next.fetch_add(1); t < n_tasks; t = next.fetch_add(1)) fn(t, slot);
    }
  });
}

// Sets the scores of keys a row cannot see to -inf in a transposed tile
// s[j * ld + col] (keys j0 + [0, nk), columns of positions p0 + [0, npos)).
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

// Position p0 + [0, npos) and its group's heads as the columns of a
// transposed tile: where the caller's mask and the dropout pattern are read.
struct TileRows {
  int64_t b, g, group, p0, npos, j0, nk;
  int64_t head(int64_t col) const { return g * group + col % group; }
  int64_t pos(int64_t col) const { return p0 + col / group; }
  int64_t cols() const { return npos * group; }
};

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

// Applies the caller's mask to a transposed score tile s[j * ld + col]: bool
// False -> -inf, float masks added to the (already scaled) scores.
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

// Calls f(j, col, kept) for every key j of the tile and column col < t.cols():
// whether dropout keeps probability (b, head, pos, j0 + j). One Philox call
// serves four consecutive keys of a row.
template <typename F>
void for_each_dropout_draw(const TileRows& t, int64_t q_heads, int64_t sq, int64_t sk,
                           const dropout::Dropout& dr, const F& f) {
  for (int64_t col = 0; col < t.cols(); ++col) {
    uint64_t n = static_cast<uint64_t>(((t.b * q_heads + t.head(col)) * sq + t.pos(col)) * sk + t.j0);
    dropout::Words w = dropout::philox(dr.seed, n >> 2);
    for (int64_t j = 0; j < t.nk; ++j, ++n) {
      if ((n & 3) == 0 && j > 0) w = dropout::philox(dr.seed, n >> 2);
      f(j, col, (w.w[n & 3] >> 8) >= dr.threshold);
    }
  }
}

// True when every row of positions [p0, p1) sees every key of [j0, j0 + nk).
inline bool tile_fully_visible(const Mask& mask, int64_t p0, int64_t p1, int64_t j0, int64_t nk) {
  return attn::key_begin(mask, p1 - 1) <= j0 && attn::key_end(mask, p0) >= j0 + nk;
}

// The key tiles a query tile visits: keys [begin, end) (the union of what
// its rows see) cut into tiles of `block` keys. Aligned to the end, the last
// tile stops at the last visible key, so under a causal mask only about half a
// tile of the diagonal is computed and masked. Aligned to the global grid
// (tile i is global tile first + i, clipped to [begin, end)), every query tile
// uses the same tiles: what a backward task needs when it owns a subset of them.
struct KeyTiles {
  int64_t begin = 0, end = 0, block = 1, count = 0, first = 0;
  bool global = false;

  KeyTiles(const Mask& mask, int64_t p0, int64_t p1, int64_t block_, bool global_)
      : begin(attn::key_begin(mask, p0)), end(attn::key_end(mask, p1 - 1)), block(block_),
        global(global_) {
    if (begin >= end) return;
    if (global) {
      first = begin / block;
      count = (end - 1) / block - first + 1;
    } else {
      count = ceil_div(end - begin, block);
    }
  }
  int64_t start(int64_t i) const {
    return std::max(begin, global ? (first + i) * block : end - (count - i) * block);
  }
  int64_t stop(int64_t i) const {
    return global ? std::min(end, (first + i + 1) * block) : end - (count - 1 - i) * block;
  }
};

// A [rows, d] tile of K or V as a contiguous, zero-padded accumulator-type
// copy in `buf` (leading dimension d_pad). Copied even when the tensor already
// has the accumulator type: the sequential copy streams the tile into cache
// once, where the products would otherwise fetch it row by row, several rows at
// a time (measured faster for float32 inputs).
template <typename T, typename acc_t>
inline const acc_t* kv_tile(const T* src, int64_t seq_stride, int64_t nk, int64_t d, int64_t d_pad,
                            acc_t* buf, int64_t& ld) {
  for (int64_t j = 0; j < nk; ++j) load_row(src + j * seq_stride, d, d_pad, acc_t(1), buf + j * d_pad);
  ld = d_pad;
  return buf;
}

// Rows of a tile, row-major with leading dimension d_pad (zero padding).
template <typename T, typename acc_t>
void gather_rows(const T* base, int64_t head_stride, int64_t seq_stride, const Tiling<acc_t>& t,
                 int64_t g, int64_t p0, int64_t rows, acc_t scale, acc_t* dst) {
  for (int64_t i = 0; i < rows; ++i) {
    const T* row = base + t.head_of(g, i) * head_stride + t.pos_of(p0, i) * seq_stride;
    load_row(row, t.d, t.d_pad, scale, dst + i * t.d_pad);
  }
}

// dst[c * ld_dst + r] = src[r * ld_src + c] for r < rows, c < cols: 8 x 8
// blocks through ATen's vector transpose, scalar edges.
template <typename acc_t>
void transpose(const acc_t* src, int64_t ld_src, int64_t rows, int64_t cols, acc_t* dst,
               int64_t ld_dst) {
  const int64_t rows8 = rows / 8 * 8, cols8 = cols / 8 * 8;
  for (int64_t r = 0; r < rows8; r += 8) {
    for (int64_t c = 0; c < cols8; c += 8) {
      at::vec::transpose_mxn<acc_t, 8, 8>(src + r * ld_src + c, ld_src, dst + c * ld_dst + r, ld_dst);
    }
    for (int64_t c = cols8; c < cols; ++c) {
      for (int64_t i = r; i < r + 8; ++i) dst[c * ld_dst + i] = src[i * ld_src + c];
    }
  }
  for (int64_t i = rows8; i < rows; ++i) {
    for (int64_t c = 0; c < cols; ++c) dst[c * ld_dst + i] = src[i * ld_src + c];
  }
}

// Rows of a tile (times scale) both row-major in `rows_dst` (leading dim
// d_pad) and transposed in `t_dst` (d x ld); rows [rows, ld) are zero in both.
template <typename T, typename acc_t>
void gather_both(const T* base, int64_t head_stride, int64_t seq_stride, const Tiling<acc_t>& t,
                 int64_t g, int64_t p0, int64_t rows, int64_t ld, acc_t scale, acc_t* rows_dst,
                 acc_t* t_dst) {
  gather_rows(base, head_stride, seq_stride, t, g, p0, rows, scale, rows_dst);
  std::fill(rows_dst + rows * t.d_pad, rows_dst + ld * t.d_pad, acc_t(0));
  transpose(rows_dst, t.d_pad, ld, t.d, t_dst, ld);
}

// ---------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------

// Per-slot scratch of the forward pass, in accumulator-type elements.
template <typename acc_t>
struct ForwardScratch {
  acc_t *qt, *s, *o, *kbuf, *vbuf, *row_max, *row_sum, *alpha;
  static int64_t size(const Tiling<acc_t>& t) {
    return t.d * t.rows_pad + t.block_k * t.rows_pad + t.rows_pad * t.d_pad +
           2 * t.block_k * t.d_pad + 3 * t.rows_pad;
  }
  ForwardScratch(acc_t* p, const Tiling<acc_t>& t) {
    qt = p;
    s = qt + t.d * t.rows_pad;
    o = s + t.block_k * t.rows_pad;
    kbuf = o + t.rows_pad * t.d_pad;
    vbuf = kbuf + t.block_k * t.d_pad;
    row_max = vbuf + t.block_k * t.d_pad;
    row_sum = row_max + t.rows_pad;
    alpha = row_sum + t.rows_pad;
  }
};

// Online softmax over one transposed score tile s[j * ld + col] (nk keys,
// ld columns): turns scores into exp(score - shift) in place and updates the
// per-row running max and sum; alpha[col] rescales the output rows.
template <typename acc_t>
void softmax_tile(acc_t* s, int64_t ld, int64_t nk, acc_t* row_max, acc_t* row_sum, acc_t* alpha) {
  using V = Vectorized<acc_t>;
  constexpr int64_t W = V::size();
  const VecOps<acc_t> ops;
  for (int64_t c = 0; c < ld; c += W) {
    acc_t* col = s + c;
    V tile_max(kNegInf<acc_t>);
    for (int64_t j = 0; j < nk; ++j) tile_max = ops.max(tile_max, V::loadu(col + j * ld));
    V running_max = V::loadu(row_max + c);
    V shift;
    const V a = attn::online_softmax_step(running_max, tile_max, shift, ops);
    V sum0(acc_t(0)), sum1(acc_t(0));
    int64_t j = 0;
    for (; j + 2 <= nk; j += 2) {
      const V p0 = ops.exp(V::loadu(col + j * ld) - shift);
      const V p1 = ops.exp(V::loadu(col + (j + 1) * ld) - shift);
      p0.store(col + j * ld);
      p1.store(col + (j + 1) * ld);
      sum0 = sum0 + p0;
      sum1 = sum1 + p1;
    }
    if (j < nk) {
      const V p0 = ops.exp(V::loadu(col + j * ld) - shift);
      p0.store(col + j * ld);
      sum0 = sum0 + p0;
    }
    (V::loadu(row_sum + c) * a + (sum0 + sum1)).store(row_sum + c);
    running_max.store(row_max + c);
    a.store(alpha + c);
  }
}

template <typename T>
struct ForwardKernel {
  using acc_t = typename VecIO<T>::acc_t;

  // Output rows (normalized) and log-sum-exp of one task: the tile of
  // positions [p0, p0 + npos) of kv head g in batch b, over its key tiles
  // split, split + splits, ...
  static void task(const AttentionForwardArgs& a, const Tiling<acc_t>& t, ForwardScratch<acc_t> w,
                   int64_t b, int64_t g, int64_t p0, int64_t npos, int64_t split, int64_t splits,
                   acc_t* o_out, int64_t o_ld, acc_t* lse_out) {
    const T* q = static_cast<const T*>(a.q.data) + b * a.q.batch_stride;
    const T* k = static_cast<const T*>(a.k.data) + b * a.k.batch_stride + g * a.k.head_stride;
    const T* v = static_cast<const T*>(a.v.data) + b * a.v.batch_stride + g * a.v.head_stride;
    const int64_t kss = a.k.seq_stride, vss = a.v.seq_stride;
    const Mask mask = a.mask;
    const int64_t d = t.d, d_pad = t.d_pad, group = t.group;
    const int64_t rows = npos * group;
    const int64_t ld = round_up(rows, Vectorized<acc_t>::size());

    // (Q * scale)^T, staged row-major in the output buffer first.
    gather_both(q, a.q.head_stride, a.q.seq_stride, t, g, p0, rows, ld, static_cast<acc_t>(a.scale),
                w.o, w.qt);
    std::fill(w.o, w.o + ld * d_pad, acc_t(0));
    std::fill(w.row_max, w.row_max + ld, kNegInf<acc_t>);
    std::fill(w.row_sum, w.row_sum + ld, acc_t(0));

    const KeyTiles tiles(mask, p0, p0 + npos, t.block_k, false);
    for (int64_t i = split; i < tiles.count; i += splits) {
      const int64_t j0 = tiles.start(i);
      const int64_t nk = tiles.stop(i) - j0;
      int64_t k_ld, v_ld;
      const acc_t* kp = kv_tile(k + j0 * kss, kss, nk, d, d_pad, w.kbuf, k_ld);
      // S^T = K (Q * scale)^T: keys x rows.
      gemm<acc_t, ALayout::kRowMajor, false>(nk, ld, d, kp, k_ld, w.qt, ld, w.s, ld);
      if (!tile_fully_visible(mask, p0, p0 + npos, j0, nk)) {
        mask_tile(w.s, ld, nk, j0, p0, npos, group, mask);
      }
      const TileRows tile{b, g, group, p0, npos, j0, nk};
      apply_tensor_mask(w.s, ld, tile, a.tensor_mask);
      // The row sums (and so the lse) are those of the probabilities before dropout.
      softmax_tile(w.s, ld, nk, w.row_max, w.row_sum, w.alpha);
      if (a.dropout.enabled) {
        // P = P z in place, z = 1 / (1 - p) where kept, else 0.
        const acc_t kept = static_cast<acc_t>(a.dropout.scale);
        for_each_dropout_draw(tile, a.q_heads, t.sq, t.sk, a.dropout, [&](int64_t j, int64_t col, bool keep) {
          acc_t& p = w.s[j * ld + col];
          p = keep ? p * kept : acc_t(0);
        });
      }
      const acc_t* vp = kv_tile(v + j0 * vss, vss, nk, d, d_pad, w.vbuf, v_ld);
      // O = diag(alpha) O + P V, P read column-major out of the transposed tile.
      gemm<acc_t, ALayout::kColMajor, true>(rows, d_pad, nk, w.s, ld, vp, v_ld, w.o, d_pad,
                                            w.alpha);
    }

    for (int64_t i = 0; i < rows; ++i) {
      const acc_t inv = attn::row_inv_sum(w.row_sum[i]);
      const acc_t* src = w.o + i * d_pad;
      acc_t* dst = o_out + i * o_ld;
      for (int64_t c = 0; c < d; ++c) dst[c] = src[c] * inv;
      lse_out[i] = attn::row_lse(w.row_max[i], w.row_sum[i]);
    }
  }

  static void run(const AttentionForwardArgs& a) {
    const Tiling<acc_t> t(a.batch, a.q_heads, a.kv_heads, a.sq, a.sk, a.head_dim);
    const int64_t pairs = t.batch * t.kv_heads;
    const int64_t base_tasks = pairs * t.q_tiles;
    // Few tasks (decoding, small batch): also split the keys; each split
    // writes normalized partial rows and their log-sum-exp, merged below.
    const int64_t work = t.batch * a.q_heads * t.sq * t.sk * t.d;
    int64_t splits = 1;
    if (base_tasks < kMinTasks && t.k_tiles > 1 && work >= kMinParallelWork) {
      splits = std::min(ceil_div(kMinTasks, base_tasks), t.k_tiles);
      const int64_t per_split = t.batch * a.q_heads * t.sq * (t.d_pad + 1) * int64_t(sizeof(acc_t));
      splits = std::max<int64_t>(1, std::min(splits, kMaxPartialBytes / std::max<int64_t>(per_split, 1)));
    }
    const int64_t n_tasks = base_tasks * splits;
    const int64_t slots = work_slots(n_tasks, work);
    const auto acc_dtype = std::is_same_v<acc_t, double> ? at::kDouble : at::kFloat;
    at::Tensor scratch = at::zeros({slots, ForwardScratch<acc_t>::size(t)}, at::TensorOptions(acc_dtype));
    at::Tensor partial_o, partial_lse;
    // Row-major output rows of a task, in accumulator type, before the cast to T.
    at::Tensor rows_out = at::empty({slots, t.rows_pad * t.d_pad + t.rows_pad}, at::TensorOptions(acc_dtype));
    if (splits > 1) {
      partial_o = at::empty({splits, t.batch, a.q_heads, t.sq, t.d_pad}, at::TensorOptions(acc_dtype));
      partial_lse = at::empty({splits, t.batch, a.q_heads, t.sq}, at::TensorOptions(acc_dtype));
    }
    acc_t* scratch_p = scratch.data_ptr<acc_t>();
    acc_t* rows_p = rows_out.data_ptr<acc_t>();
    acc_t* po = splits > 1 ? partial_o.data_ptr<acc_t>() : nullptr;
    acc_t* pl = splits > 1 ? partial_lse.data_ptr<acc_t>() : nullptr;
    const int64_t scratch_stride = scratch.size(1), rows_stride = rows_out.size(1);

    run_tasks(n_tasks, slots, [&](int64_t index, int64_t slot) {
      // Latest query tiles first: under a causal mask they see the most keys.
      const int64_t split = index % splits;
      const int64_t rest = index / splits;
      const int64_t pair = rest % pairs;
      const int64_t qt = t.q_tiles - 1 - rest / pairs;
      const int64_t b = pair / t.kv_heads, g = pair % t.kv_heads;
      const int64_t p0 = qt * t.block_q;
      const int64_t npos = std::min(t.block_q, t.sq - p0);
      const int64_t rows = npos * t.group;
      ForwardScratch<acc_t> w(scratch_p + slot * scratch_stride, t);
      acc_t* o_rows = rows_p + slot * rows_stride;
      acc_t* lse_rows = o_rows + t.rows_pad * t.d_pad;
      task(a, t, w, b, g, p0, npos, split, splits, o_rows, t.d_pad, lse_rows);
      // Scatter the (position, head) rows to [B, Hq, Sq, ...].
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t h = t.head_of(g, i), pos = t.pos_of(p0, i);
        const int64_t row = (b * a.q_heads + h) * t.sq + pos;
        if (splits == 1) {
          store_row<T>(o_rows + i * t.d_pad, t.d, acc_t(1), static_cast<T*>(a.out) + row * t.d);
          static_cast<acc_t*>(a.lse)[row] = lse_rows[i];
        } else {
          const int64_t prow = split * t.batch * a.q_heads * t.sq + row;
          std::memcpy(po + prow * t.d_pad, o_rows + i * t.d_pad, sizeof(acc_t) * t.d);
          pl[prow] = lse_rows[i];
        }
      }
    });
    if (splits == 1) return;

    // Merge the splits of each row in split order.
    const int64_t n_rows = t.batch * a.q_heads * t.sq;
    at::parallel_for(0, n_rows, std::max<int64_t>(1, 4096 / t.d_pad), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> acc(t.d_pad);
      for (int64_t row = begin; row < end; ++row) {
        acc_t m = kNegInf<acc_t>;
        for (int64_t s = 0; s < splits; ++s) m = std::max(m, pl[s * n_rows + row]);
        acc_t total = kNegInf<acc_t>;
        if (m != kNegInf<acc_t>) {
          acc_t sum = 0;
          for (int64_t s = 0; s < splits; ++s) sum += std::exp(pl[s * n_rows + row] - m);
          total = m + std::log(sum);
        }
        std::fill(acc.begin(), acc.end(), acc_t(0));
        for (int64_t s = 0; s < splits; ++s) {
          const acc_t wgt = attn::merge_weight(pl[s * n_rows + row], total);
          if (wgt == acc_t(0)) continue;
          const acc_t* src = po + (s * n_rows + row) * t.d_pad;
          for (int64_t c = 0; c < t.d; ++c) acc[c] += wgt * src[c];
        }
        store_row<T>(acc.data(), t.d, acc_t(1), static_cast<T*>(a.out) + row * t.d);
        static_cast<acc_t*>(a.lse)[row] = total;
      }
    });
  }
};

// ---------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------

template <typename acc_t>
struct BackwardScratch {
  acc_t *qt, *dot, *qs, *dor, *s, *dp, *dq, *kbuf, *vbuf, *shift, *delta, *z;
  static int64_t size(const Tiling<acc_t>& t) {
    return 2 * t.d * t.rows_pad + 3 * t.rows_pad * t.d_pad + 3 * t.block_k * t.rows_pad +
           2 * t.block_k * t.d_pad + 2 * t.rows_pad;
  }
  BackwardScratch(acc_t* p, const Tiling<acc_t>& t) {
    qt = p;
    dot = qt + t.d * t.rows_pad;
    qs = dot + t.d * t.rows_pad;
    dor = qs + t.rows_pad * t.d_pad;
    dq = dor + t.rows_pad * t.d_pad;
    s = dq + t.rows_pad * t.d_pad;
    dp = s + t.block_k * t.rows_pad;
    kbuf = dp + t.block_k * t.rows_pad;
    vbuf = kbuf + t.block_k * t.d_pad;
    shift = vbuf + t.block_k * t.d_pad;
    delta = shift + t.rows_pad;
    z = delta + t.rows_pad;
  }
};

// P = exp(S - shift) and dS = P * (dP - delta) over a transposed tile, in
// place (dS into dp, P into s). With dropout (kDropout; z: 1 / (1 - p) where
// kept, else 0) dS = P * (dP z - delta) and s gets the dropped P z.
template <bool kDropout, typename acc_t>
void probs_and_score_grads(acc_t* s, acc_t* dp, const acc_t* z, int64_t ld, int64_t nk,
                           const acc_t* shift, const acc_t* delta) {
  using V = Vectorized<acc_t>;
  constexpr int64_t W = V::size();
  const VecOps<acc_t> ops;
  for (int64_t c = 0; c < ld; c += W) {
    const V sh = V::loadu(shift + c);
    const V de = V::loadu(delta + c);
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t e = j * ld + c;
      const V p = ops.exp(V::loadu(s + e) - sh);
      if constexpr (kDropout) {
        const V zz = V::loadu(z + e);
        attn::score_grad(p, V::loadu(dp + e) * zz, de).store(dp + e);
        (p * zz).store(s + e);
      } else {
        attn::score_grad(p, V::loadu(dp + e), de).store(dp + e);
        p.store(s + e);
      }
    }
  }
}

template <typename T>
struct BackwardKernel {
  using acc_t = typename VecIO<T>::acc_t;

  // delta[row] = sum(dO * O) over head_dim, rows of [B, Hq, Sq].
  static void compute_delta(const AttentionBackwardArgs& a, acc_t* delta) {
    using IO = VecIO<T>;
    using AV = typename IO::AV;
    const int64_t n_rows = a.batch * a.q_heads * a.sq;
    const int64_t d = a.head_dim;
    at::parallel_for(0, n_rows, std::max<int64_t>(1, 8192 / d), [&](int64_t begin, int64_t end) {
      const T* go = static_cast<const T*>(a.grad_out.data);
      const T* out = static_cast<const T*>(a.out.data);
      const AttentionOperand g_op = a.grad_out, o_op = a.out;
      const int64_t hq = a.q_heads, sq = a.sq;
      for (int64_t row = begin; row < end; ++row) {
        const int64_t pos = row % sq, bh = row / sq;
        const int64_t h = bh % hq, b = bh / hq;
        const T* gr = go + b * g_op.batch_stride + h * g_op.head_stride + pos * g_op.seq_stride;
        const T* orow = out + b * o_op.batch_stride + h * o_op.head_stride + pos * o_op.seq_stride;
        delta[row] = row_sum<IO>(d, [=](int64_t j, int64_t c, AV(&acc)[IO::kParts]) {
          AV x[IO::kParts], y[IO::kParts];
          load_step<IO>(gr + j, c, x);
          load_step<IO>(orow + j, c, y);
          for (int q = 0; q < IO::kParts; ++q) acc[q] = at::vec::fmadd(x[q], y[q], acc[q]);
        });
      }
    });
  }

  // One task: kv head g of batch b, key tiles chunk, chunk + chunks, ...;
  // accumulates dK (already scaled) and dV rows into dk/dv (leading dim d_pad)
  // and writes dQ of every query tile (scaled into grad_q when chunks == 1,
  // else unscaled into this chunk's partial rows).
  static void task(const AttentionBackwardArgs& a, const Tiling<acc_t>& t, BackwardScratch<acc_t> w,
                   int64_t b, int64_t g, int64_t chunk, int64_t chunks, const acc_t* delta_all,
                   acc_t* dk, acc_t* dv, acc_t* dq_partial) {
    const T* q = static_cast<const T*>(a.q.data) + b * a.q.batch_stride;
    const T* go = static_cast<const T*>(a.grad_out.data) + b * a.grad_out.batch_stride;
    const T* k = static_cast<const T*>(a.k.data) + b * a.k.batch_stride + g * a.k.head_stride;
    const T* v = static_cast<const T*>(a.v.data) + b * a.v.batch_stride + g * a.v.head_stride;
    const acc_t* lse = static_cast<const acc_t*>(a.lse);
    const int64_t kss = a.k.seq_stride, vss = a.v.seq_stride;
    const Mask mask = a.mask;
    const acc_t scale = static_cast<acc_t>(a.scale);
    const int64_t d = t.d, d_pad = t.d_pad, sq = t.sq;
    const int64_t group = t.group, hq = a.q_heads;

    for (int64_t qt = 0; qt < t.q_tiles; ++qt) {
      const int64_t p0 = qt * t.block_q;
      const int64_t npos = std::min(t.block_q, sq - p0);
      const int64_t rows = npos * group;
      const int64_t ld = round_up(rows, Vectorized<acc_t>::size());
      // With several chunks each owns the global key tiles chunk, chunk + chunks, ...
      const KeyTiles tiles(mask, p0, p0 + npos, t.block_k, chunks > 1);
      int64_t i0 = 0;
      if (chunks > 1) i0 = ((chunk - tiles.first % chunks) % chunks + chunks) % chunks;
      const bool any = i0 < tiles.count;
      if (!any && chunks > 1) continue;  // the partial rows stay zero

      std::fill(w.dq, w.dq + rows * d_pad, acc_t(0));
      if (any) {
        gather_both(q, a.q.head_stride, a.q.seq_stride, t, g, p0, rows, ld, scale, w.qs, w.qt);
        gather_both(go, a.grad_out.head_stride, a.grad_out.seq_stride, t, g, p0, rows, ld, acc_t(1),
                    w.dor, w.dot);
        for (int64_t i = 0; i < ld; ++i) {
          if (i < rows) {
            const int64_t row = (b * hq + t.head_of(g, i)) * sq + t.pos_of(p0, i);
            w.shift[i] = attn::ScalarOps<acc_t>::finite_or_zero(lse[row]);
            w.delta[i] = delta_all[row];
          } else {
            w.shift[i] = 0;
            w.delta[i] = 0;
          }
        }
      }

      for (int64_t i = i0; i < tiles.count; i += chunks) {
        const int64_t j0 = tiles.start(i);
        const int64_t nk = tiles.stop(i) - j0;
        int64_t k_ld, v_ld;
        const acc_t* kp = kv_tile(k + j0 * kss, kss, nk, d, d_pad, w.kbuf, k_ld);
        const acc_t* vp = kv_tile(v + j0 * vss, vss, nk, d, d_pad, w.vbuf, v_ld);
        // S^T = K (Q * scale)^T and dP^T = V dO^T: keys x rows.
        gemm<acc_t, ALayout::kRowMajor, false>(nk, ld, d, kp, k_ld, w.qt, ld, w.s, ld);
        gemm<acc_t, ALayout::kRowMajor, false>(nk, ld, d, vp, v_ld, w.dot, ld, w.dp, ld);
        if (!tile_fully_visible(mask, p0, p0 + npos, j0, nk)) {
          mask_tile(w.s, ld, nk, j0, p0, npos, group, mask);
        }
        const TileRows tile{b, g, group, p0, npos, j0, nk};
        apply_tensor_mask(w.s, ld, tile, a.tensor_mask);
        if (a.dropout.enabled) {
          // z = 1 / (1 - p) where kept, else 0; padding columns past the tile's rows 0.
          const acc_t kept = static_cast<acc_t>(a.dropout.scale);
          for_each_dropout_draw(tile, hq, sq, t.sk, a.dropout, [&](int64_t j, int64_t col, bool keep) {
            w.z[j * ld + col] = keep ? kept : acc_t(0);
          });
          for (int64_t j = 0; j < nk; ++j) std::fill(w.z + j * ld + tile.cols(), w.z + (j + 1) * ld, acc_t(0));
          probs_and_score_grads<true>(w.s, w.dp, w.z, ld, nk, w.shift, w.delta);
        } else {
          probs_and_score_grads<false>(w.s, w.dp, w.z, ld, nk, w.shift, w.delta);
        }
        // dV += P^T dO, dK += dS^T (Q * scale): the sum over the group's rows
        // is the inner dimension of these products.
        acc_t* dv_rows = dv + j0 * d_pad;
        acc_t* dk_rows = dk + j0 * d_pad;
        gemm<acc_t, ALayout::kRowMajor, true>(nk, d_pad, rows, w.s, ld, w.dor, d_pad, dv_rows, d_pad);
        gemm<acc_t, ALayout::kRowMajor, true>(nk, d_pad, rows, w.dp, ld, w.qs, d_pad, dk_rows, d_pad);
        // dQ (unscaled) += dS K, dS read column-major out of the transposed tile.
        gemm<acc_t, ALayout::kColMajor, true>(rows, d_pad, nk, w.dp, ld, kp, k_ld, w.dq, d_pad);
      }

      for (int64_t i = 0; i < rows; ++i) {
        const int64_t row = (b * hq + t.head_of(g, i)) * sq + t.pos_of(p0, i);
        if (chunks == 1) {
          store_row<T>(w.dq + i * d_pad, d, scale, static_cast<T*>(a.grad_q) + row * d);
        } else {
          std::memcpy(dq_partial + row * d_pad, w.dq + i * d_pad, sizeof(acc_t) * d);
        }
      }
    }
  }

  static void run(const AttentionBackwardArgs& a) {
    const Tiling<acc_t> t(a.batch, a.q_heads, a.kv_heads, a.sq, a.sk, a.head_dim);
    const auto opts = at::TensorOptions(std::is_same_v<acc_t, double> ? at::kDouble : at::kFloat);
    const int64_t pairs = t.batch * t.kv_heads;
    const int64_t n_q_rows = t.batch * a.q_heads * t.sq;

    // Few (batch, kv head) pairs: split each pair's key tiles into chunks
    // (a function of the shape only), each with its own partial dQ.
    const int64_t work = t.batch * a.q_heads * t.sq * t.sk * t.d;
    int64_t chunks = 1;
    if (pairs < kMinTasks && t.k_tiles > 1 && work >= kMinParallelWork) {
      chunks = std::min(ceil_div(kMinTasks, pairs), t.k_tiles);
      const int64_t per_chunk = n_q_rows * t.d_pad * int64_t(sizeof(acc_t));
      chunks = std::max<int64_t>(1, std::min(chunks, kMaxPartialBytes / std::max<int64_t>(per_chunk, 1)));
    }

    at::Tensor delta = at::empty({n_q_rows}, opts);
    compute_delta(a, delta.data_ptr<acc_t>());

    // dK/dV accumulate in the accumulator type with rows padded to d_pad;
    // when that is exactly the output layout they accumulate in place.
    const bool in_place = std::is_same_v<T, acc_t> && t.d == t.d_pad;
    const int64_t kv_rows = pairs * t.sk;
    at::Tensor dk_buf, dv_buf;
    acc_t *dk, *dv;
    if (in_place) {
      dk = reinterpret_cast<acc_t*>(a.grad_k);
      dv = reinterpret_cast<acc_t*>(a.grad_v);
      at::parallel_for(0, kv_rows, 1024, [&](int64_t begin, int64_t end) {
        std::fill(dk + begin * t.d_pad, dk + end * t.d_pad, acc_t(0));
        std::fill(dv + begin * t.d_pad, dv + end * t.d_pad, acc_t(0));
      });
    } else {
      dk_buf = at::zeros({kv_rows, t.d_pad}, opts);
      dv_buf = at::zeros({kv_rows, t.d_pad}, opts);
      dk = dk_buf.data_ptr<acc_t>();
      dv = dv_buf.data_ptr<acc_t>();
    }
    at::Tensor dq_partial;
    acc_t* dq_p = nullptr;
    if (chunks > 1) {
      dq_partial = at::zeros({chunks, n_q_rows, t.d_pad}, opts);
      dq_p = dq_partial.data_ptr<acc_t>();
    }

    const int64_t n_tasks = pairs * chunks;
    const int64_t slots = work_slots(n_tasks, work);
    at::Tensor scratch = at::zeros({slots, BackwardScratch<acc_t>::size(t)}, opts);
    acc_t* scratch_p = scratch.data_ptr<acc_t>();
    const int64_t scratch_stride = scratch.size(1);
    const acc_t* delta_p = delta.data_ptr<acc_t>();

    run_tasks(n_tasks, slots, [&](int64_t task_index, int64_t slot) {
      const int64_t chunk = task_index % chunks;
      const int64_t pair = task_index / chunks;
      const int64_t b = pair / t.kv_heads, g = pair % t.kv_heads;
      BackwardScratch<acc_t> w(scratch_p + slot * scratch_stride, t);
      acc_t* dq_rows = dq_p != nullptr ? dq_p + chunk * n_q_rows * t.d_pad : nullptr;
      task(a, t, w, b, g, chunk, chunks, delta_p, dk + pair * t.sk * t.d_pad,
           dv + pair * t.sk * t.d_pad, dq_rows);
    });

    if (!in_place) {
      at::parallel_for(0, kv_rows, std::max<int64_t>(1, 4096 / t.d_pad), [&](int64_t begin, int64_t end) {
        T* gk = static_cast<T*>(a.grad_k);
        T* gv = static_cast<T*>(a.grad_v);
        for (int64_t r = begin; r < end; ++r) {
          store_row<T>(dk + r * t.d_pad, t.d, acc_t(1), gk + r * t.d);
          store_row<T>(dv + r * t.d_pad, t.d, acc_t(1), gv + r * t.d);
        }
      });
    }
    if (chunks > 1) {
      // dQ = scale * sum of the chunks' partials, in chunk order.
      at::parallel_for(0, n_q_rows, std::max<int64_t>(1, 4096 / t.d_pad), [&](int64_t begin, int64_t end) {
        std::vector<acc_t> acc(t.d_pad);
        T* gq = static_cast<T*>(a.grad_q);
        for (int64_t r = begin; r < end; ++r) {
          std::fill(acc.begin(), acc.end(), acc_t(0));
          for (int64_t c = 0; c < chunks; ++c) {
            const acc_t* src = dq_p + (c * n_q_rows + r) * t.d_pad;
            for (int64_t j = 0; j < t.d; ++j) acc[j] += src[j];
          }
          store_row<T>(acc.data(), t.d, static_cast<acc_t>(a.scale), gq + r * t.d);
        }
      });
    }
  }
};

void attention_forward(const AttentionForwardArgs& a) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.dtype, "fusedllm_attention_cpu", [&] {
    ForwardKernel<scalar_t>::run(a);
  });
}

void attention_backward(const AttentionBackwardArgs& a) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.dtype, "fusedllm_attention_backward_cpu", [&] {
    BackwardKernel<scalar_t>::run(a);
  });
}

}  // namespace

FUSEDLLM_REGISTER_CPU_KERNEL(attention_forward_kernels, &attention_forward);
FUSEDLLM_REGISTER_CPU_KERNEL(attention_backward_kernels, &attention_backward);

}  // namespace CPU_CAPABILITY
}  // namespace fusedllm::cpu
