// Device primitives shared by every CUDA kernel: warp/block reductions, vector
// memory access, dynamic shared memory. One place to port (e.g. to 64-wide
// wavefronts) or to emulate.
#pragma once

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <utility>

#include "runtime.cuh"

namespace fusedllm::cuda {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

template <typename T>
__device__ __forceinline__ T warp_reduce_sum(T v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(kFullMask, v, offset);
  }
  return v;
}

// `warp_reduce` over the block, returned to every thread; lanes past the last
// warp contribute `pad` (the reduction's identity). `scratch` holds one value
// per warp (at most 32 warps). Contains __syncthreads: every thread must call it.
template <typename T, typename WarpReduce>
__device__ __forceinline__ T block_reduce(T v, T* scratch, WarpReduce warp_reduce, T pad) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = (blockDim.x + kWarpSize - 1) / kWarpSize;
  v = warp_reduce(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return warp_reduce(lane < num_warps ? scratch[lane] : pad);
}

// Sum over the block, returned to every thread; as block_reduce.
template <typename T>
__device__ __forceinline__ T block_reduce_sum(T v, T* scratch) {
  return block_reduce(v, scratch, [](T x) { return warp_reduce_sum(x); }, T(0));
}

// Grid-stride loop over a [rows, cols] index space: body(row, col) once per
// element, consecutive threads on consecutive columns (coalesced rows). Index
// spaces below 2^31 divide in 32 bits: a 64-bit division is a long subroutine,
// which made the per-element kernels that do little else instruction-bound.
template <typename Body>
__device__ __forceinline__ void grid_stride_2d(int64_t rows, int64_t cols, Body&& body) {
  const int64_t total = rows * cols;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if (total <= std::numeric_limits<int32_t>::max()) {
    const uint32_t c = static_cast<uint32_t>(cols);
    for (uint32_t i = static_cast<uint32_t>(first); i < static_cast<uint32_t>(total);
         i += static_cast<uint32_t>(step)) {
      const uint32_t r = i / c;
      body(static_cast<int64_t>(r), static_cast<int64_t>(i - r * c));
    }
    return;
  }
  for (int64_t i = first; i < total; i += step) {
    const int64_t r = i / cols;
    body(r, i - r * cols);
  }
}

// kN consecutive elements moved as one aligned access.
template <typename T, int kN>
struct alignas(sizeof(T) * kN) Pack {
  T v[kN];
};

template <typename T, int kN>
__device__ __forceinline__ Pack<T, kN> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, kN>*>(p);
}

template <typename T, int kN>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, kN>& pack) {
  *reinterpret_cast<Pack<T, kN>*>(p) = pack;
}

// store_pack for a 16-byte pack of 2- or 4-byte values filled lane by lane,
// as one 16-byte store: nvcc splits such a store into 2- or 4-byte ones (a
// copy through 32-bit words did not change that; st.v4.b32 does).
template <typename T, int kN>
__device__ __forceinline__ void store_pack_words(T* p, const Pack<T, kN>& pack) {
  if constexpr (sizeof(T) * kN == 16 && (sizeof(T) == 2 || sizeof(T) == 4)) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (sizeof(T) == 2) {
        w[i] = static_cast<uint32_t>(pack.v[2 * i].x) | static_cast<uint32_t>(pack.v[2 * i + 1].x) << 16;
      } else {
        memcpy(&w[i], &pack.v[i], sizeof(uint32_t));
      }
    }
#if defined(FUSEDLLM_SIMT)
    store_pack<uint32_t, 4>(reinterpret_cast<uint32_t*>(p), Pack<uint32_t, 4>{{w[0], w[1], w[2], w[3]}});
#else
    asm volatile("st.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
                 : "memory");
#endif
  } else {
    store_pack<T, kN>(p, pack);
  }
}

// True when `p` can be read in packs of kN elements.
template <typename T, int kN>
inline bool pack_aligned(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % (sizeof(T) * kN) == 0;
}

// Elements per access for [rows, n] operands given as (pointer, row stride):
// a 16-byte pack when n, every stride and every pointer allow it, else 1.
// Null pointers (absent operands) are ignored.
template <typename T>
inline int pack_width(int64_t n, std::initializer_list<std::pair<const void*, int64_t>> operands) {
  constexpr int kWide = 16 / sizeof(T);
  if (n % kWide != 0) return 1;
  for (const auto& [ptr, stride] : operands) {
    if (ptr != nullptr && (!pack_aligned<T, kWide>(ptr) || stride % kWide != 0)) return 1;
  }
  return kWide;
}

// The block's dynamic shared memory as an array of T (size set at launch).
template <typename T>
__device__ __forceinline__ T* dynamic_shared() {
#if defined(FUSEDLLM_SIMT)
  return reinterpret_cast<T*>(simt::detail::dynamic_shared_base());
#else
  extern __shared__ __align__(16) unsigned char fusedllm_dynamic_smem[];
  return reinterpret_cast<T*>(fusedllm_dynamic_smem);
#endif
}

// e^x as ex2.approx.ftz(x log2(e)): two instructions (a multiply and the MUFU
// one), where __expf and exp2f, compiled without -ftz, add four that keep
// subnormal results (probabilities below 2^-126 lose nothing as zeros). The
// emulated build computes it as __expf (device_math.h) and flushes what the
// GPU flushes.
__device__ __forceinline__ float exp_ftz(float x) {
#if defined(FUSEDLLM_SIMT)
  const float y = __expf(x);
  return y < 1.17549435e-38f ? 0.f : y;
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.44269504088896341f));
  return y;
#endif
}

// Maximum over the warp, returned to every lane.
template <typename T>
__device__ __forceinline__ T warp_reduce_max(T v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const T other = __shfl_xor_sync(kFullMask, v, offset);
    v = other > v ? other : v;
  }
  return v;
}

// Maximum over the block (floating point), returned to every thread; as block_reduce.
template <typename T>
__device__ __forceinline__ T block_reduce_max(T v, T* scratch) {
  return block_reduce(v, scratch, [](T x) { return warp_reduce_max(x); },
                      -std::numeric_limits<T>::infinity());
}

// Maximum / sum over the 4 lanes of this lane's quad (lanes 4g .. 4g+3, which
// together hold one row of a tensor-core accumulator fragment, mma.cuh).
template <typename T>
__device__ __forceinline__ T quad_reduce_max(T v) {
#pragma unroll
  for (int offset = 1; offset < 4; offset *= 2) {
    const T other = __shfl_xor_sync(kFullMask, v, offset);
    v = other > v ? other : v;
  }
  return v;
}

template <typename T>
__device__ __forceinline__ T quad_reduce_sum(T v) {
#pragma unroll
  for (int offset = 1; offset < 4; offset *= 2) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// Lane `src`'s value of v, to every lane.
template <typename T>
__device__ __forceinline__ T warp_broadcast(T v, int src) {
  return __shfl_sync(kFullMask, v, src);
}

// The bytes of the pair (y, x), x's bytes 0-3 and y's 4-7, that the four
// nibbles of `selector` pick, lowest first (one PRMT).
__device__ __forceinline__ uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t selector) {
#if defined(FUSEDLLM_SIMT)
  const uint64_t bytes = uint64_t(y) << 32 | x;
  uint32_t out = 0;
  for (int n = 0; n < 4; ++n) out |= uint32_t(bytes >> (8 * (selector >> (4 * n) & 7u)) & 0xffu) << (8 * n);
  return out;
#else
  return __byte_perm(x, y, selector);
#endif
}

// How many lanes below this one have `flag` set (over the lanes of `mask`),
// and through `total` how many in all.
__device__ __forceinline__ int lanes_below(bool flag, unsigned mask, int& total) {
  const unsigned votes = __ballot_sync(mask, flag);
  const unsigned below = votes & ((1u << (threadIdx.x % kWarpSize)) - 1u);
#if defined(FUSEDLLM_SIMT)
  total = __builtin_popcount(votes);
  return __builtin_popcount(below);
#else
  total = __popc(votes);
  return __popc(below);
#endif
}

}  // namespace fusedllm::cuda
