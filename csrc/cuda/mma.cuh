// Tensor-core building blocks: the m16n8k16 matrix product on 16-bit inputs
// with float32 accumulators, ldmatrix fragment loads from shared memory, and
// cp.async copies from global to shared memory.
//
// Each has two forms: the PTX instruction, and a portable form built from warp
// shuffles and plain loads that follows the fragment layouts of the PTX ISA
// ("Matrix Fragments for mma.m16n8k16", "... for mma.m16n8k8", "Warp-level
// matrix load instruction: ldmatrix"). sm_80 and newer have all three. sm_75
// (Turing) has ldmatrix and, for float16 only, mma.m16n8k8: there the m16n8k16
// product is two of them, one per half of k, and cp.async is the portable
// copy (a 16-byte load, then a 16-byte store). The emulated build
// (FUSEDLLM_SIMT) runs the portable forms (an m16n8k16 product as its two
// m16n8k8 halves, as sm_75 runs it); `kPortable = true` selects
// them on any GPU, which is how a test on a GPU compares them with the
// hardware. Under the emulator the portable ldmatrix and cp.async also report
// their shared-memory rows, whose bank conflicts fusedllm.simt counts.
//
// Layouts, for lane = 4 * group + quad (group 0..7, quad 0..3):
//   A (16x16, row-major): r[0] = A[group][2q, 2q+1], r[1] = A[group+8][2q, 2q+1],
//                         r[2] = A[group][2q+8, 2q+9], r[3] = A[group+8][2q+8, 2q+9]
//   B (16x8, k x n):      r[0] = B[2q, 2q+1][group], r[1] = B[2q+8, 2q+9][group]
//   C (16x8, float32):    r[0..1] = C[group][2q, 2q+1], r[2..3] = C[group+8][2q, 2q+1]
// where each 32-bit register holds two 16-bit elements, the lower index in the
// low half. m16n8k8's A (16x8) is {r[0], r[1]} and its B (8x8) r[0] of these,
// its C the same: A's r[2], r[3] and B's r[1] are the second k8 product's.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#include "primitives.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(FUSEDLLM_SIMT)
#define FUSEDLLM_HAS_MMA_SM80 1
#else
#define FUSEDLLM_HAS_MMA_SM80 0
#endif

// sm_75 machine code: ldmatrix and the float16 mma.m16n8k8.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750 && !defined(FUSEDLLM_SIMT)
#define FUSEDLLM_HAS_MMA_SM75 1
#else
#define FUSEDLLM_HAS_MMA_SM75 0
#endif

// Device code for a GPU below sm_80 (sm_75 builds): the tensor-core kernels
// that dispatch never launches there compile to a trap, since their portable
// form would only cost build time.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800 && !defined(FUSEDLLM_SIMT)
#define FUSEDLLM_BELOW_SM80 1
#else
#define FUSEDLLM_BELOW_SM80 0
#endif

namespace fusedllm::cuda::mma {

// Whether this compilation has a tensor-core product for T: sm_80 and newer
// for both 16-bit types, sm_75 for float16 (mma.m16n8k8); the emulator and
// the host pass say yes (the host checks the device before it launches).
template <typename T>
constexpr bool kProductFor =
#if defined(__CUDA_ARCH__) && !defined(FUSEDLLM_SIMT)
    __CUDA_ARCH__ >= 800 || (__CUDA_ARCH__ >= 750 && std::is_same_v<T, c10::Half>);
#else
    true;
#endif

struct FragA {
  uint32_t r[4];
};
struct FragB {
  uint32_t r[2];
};
struct FragC {
  float r[4] = {0.f, 0.f, 0.f, 0.f};
};

template <typename T>
constexpr bool kIs16Bit = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;

// The two 16-bit elements of a register as floats (low half first).
template <typename T>
__device__ __forceinline__ void unpack(uint32_t bits, float& lo, float& hi) {
  static_assert(kIs16Bit<T>, "tensor-core fragments hold bfloat16 or float16");
  lo = static_cast<float>(T(static_cast<uint16_t>(bits & 0xffffu), T::from_bits()));
  hi = static_cast<float>(T(static_cast<uint16_t>(bits >> 16), T::from_bits()));
}

// Two elements in one register, the first in the low half.
template <typename T>
__device__ __forceinline__ uint32_t pack2(T lo, T hi) {
  static_assert(kIs16Bit<T>, "tensor-core fragments hold bfloat16 or float16");
  return static_cast<uint32_t>(lo.x) | (static_cast<uint32_t>(hi.x) << 16);
}

// d = a * b + d for one half of k (m16n8k8): A's registers a0 (row group)
// and a1 (row group + 8), B's b0, the portable form.
template <typename T>
__device__ __forceinline__ void mma_1688_portable(FragC& d, uint32_t a0, uint32_t a1, uint32_t b0) {
  const int lane = threadIdx.x % kWarpSize;
  const int group = lane / 4, quad = lane % 4;
  float acc[4] = {d.r[0], d.r[1], d.r[2], d.r[3]};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    // A[group][2q, 2q+1] and A[group+8][2q, 2q+1], from lane 4*group + q.
    const int a_lane = group * 4 + q;
    float a_top[2], a_bottom[2];
    unpack<T>(__shfl_sync(kFullMask, a0, a_lane), a_top[0], a_top[1]);
    unpack<T>(__shfl_sync(kFullMask, a1, a_lane), a_bottom[0], a_bottom[1]);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float bk[2];  // B[2q, 2q+1][2*quad + c], from lane 4 (2*quad + c) + q
      unpack<T>(__shfl_sync(kFullMask, b0, (2 * quad + c) * 4 + q), bk[0], bk[1]);
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        acc[c] = fmaf(a_top[k], bk[k], acc[c]);
        acc[2 + c] = fmaf(a_bottom[k], bk[k], acc[2 + c]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) d.r[i] = acc[i];
}

// d = a * b + d, the portable form: the two halves of k as two m16n8k8
// products (what sm_75 runs), each lane gathering the rows of A and the
// columns of B its four outputs need from the lanes that hold them.
template <typename T>
__device__ __forceinline__ void mma_16816_portable(FragC& d, const FragA& a, const FragB& b) {
  mma_1688_portable<T>(d, a.r[0], a.r[1], b.r[0]);
  mma_1688_portable<T>(d, a.r[2], a.r[3], b.r[1]);
}

// d = a * b + d on the tensor cores: mma.sync.m16n8k16 (sm_80+), or two
// float16 mma.sync.m16n8k8 (sm_75), float32 accumulators.
template <typename T, bool kPortable = false>
__device__ __forceinline__ void mma_16816(FragC& d, const FragA& a, const FragB& b) {
#if FUSEDLLM_HAS_MMA_SM80
  if constexpr (!kPortable) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
          "{%8,%9}, {%0,%1,%2,%3};\n"
          : "+f"(d.r[0]), "+f"(d.r[1]), "+f"(d.r[2]), "+f"(d.r[3])
          : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]));
    } else {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
          "{%8,%9}, {%0,%1,%2,%3};\n"
          : "+f"(d.r[0]), "+f"(d.r[1]), "+f"(d.r[2]), "+f"(d.r[3])
          : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]));
    }
    return;
  }
#elif FUSEDLLM_HAS_MMA_SM75
  if constexpr (!kPortable) {
    if constexpr (std::is_same_v<T, c10::Half>) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        asm volatile(
            "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(d.r[0]), "+f"(d.r[1]), "+f"(d.r[2]), "+f"(d.r[3])
            : "r"(a.r[2 * h]), "r"(a.r[2 * h + 1]), "r"(b.r[h]));
      }
    } else {
      __trap();  // no bfloat16 tensor-core product before sm_80: dispatch never asks for one
    }
    return;
  }
#endif
#if defined(FUSEDLLM_SIMT)
  // An emulated sm_75 has float16 products only (dispatch never asks it for bfloat16).
  CUDA_KERNEL_ASSERT((std::is_same_v<T, c10::Half> || simt::device_properties().major >= 8) &&
                     "no bfloat16 tensor-core product before sm_80");
#endif
  mma_16816_portable<T>(d, a, b);
}

// ldmatrix .x4 (sm_75+): four 8x8 matrices of 16-bit elements from shared memory. Lanes
// 8i..8i+7 pass the addresses of rows 0..7 of matrix i (16-byte aligned); r[i]
// receives this lane's register of matrix i: row group, columns 2q and 2q+1
// (with kTrans, rows 2q and 2q+1 of column group: the transposed matrix).
template <bool kTrans, bool kPortable = false>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#if FUSEDLLM_HAS_MMA_SM75
  if constexpr (!kPortable) {
    const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(row));
    if constexpr (kTrans) {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                   : "r"(address));
    } else {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                   : "r"(address));
    }
    return;
  }
#endif
#if defined(FUSEDLLM_SIMT)
  simt::detail::record_shared_access(simt::detail::SharedAccess::kLdmatrix, row);
#endif
  const int lane = threadIdx.x % kWarpSize;
  const int group = lane / 4, quad = lane % 4;
  const auto mine = static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(row));
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (!kTrans) {
      const auto source = __shfl_sync(kFullMask, mine, 8 * i + group);
      r[i] = reinterpret_cast<const uint32_t*>(static_cast<uintptr_t>(source))[quad];
    } else {
      const auto first = __shfl_sync(kFullMask, mine, 8 * i + 2 * quad);
      const auto second = __shfl_sync(kFullMask, mine, 8 * i + 2 * quad + 1);
      const uint16_t lo = reinterpret_cast<const uint16_t*>(static_cast<uintptr_t>(first))[group];
      const uint16_t hi = reinterpret_cast<const uint16_t*>(static_cast<uintptr_t>(second))[group];
      r[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
  }
}

// 16 bytes from global to shared memory without passing through registers
// (cp.async.cg, sm_80+; below, the portable copy through registers); visible
// to this thread after cp_async_wait, to the block after that and a
// __syncthreads. The portable form copies at once (the emulator does
// not model the copy's delay: a missing wait goes unnoticed there).
template <bool kPortable = false>
__device__ __forceinline__ void cp_async_16(void* shared, const void* global) {
#if FUSEDLLM_HAS_MMA_SM80
  if constexpr (!kPortable) {
    const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(global));
    return;
  }
#elif FUSEDLLM_HAS_MMA_SM75
  if constexpr (!kPortable) {  // a read-only 16-byte global load, then the store
    *static_cast<uint4*>(shared) = __ldg(static_cast<const uint4*>(global));
    return;
  }
#endif
#if defined(FUSEDLLM_SIMT)
  simt::detail::record_shared_access(simt::detail::SharedAccess::kCpAsync, shared);
#endif
  *static_cast<Pack<uint32_t, 4>*>(shared) = *static_cast<const Pack<uint32_t, 4>*>(global);
}

// cp_async_16, or 16 zero bytes into `shared` when !valid (cp.async with a
// source size of 0: `global` is not read), so that every lane of a staging loop
// issues the same copies whether its chunk lies inside the operand or not.
template <bool kPortable = false>
__device__ __forceinline__ void cp_async_16_or_zero(void* shared, const void* global, bool valid) {
#if FUSEDLLM_HAS_MMA_SM80
  if constexpr (!kPortable) {
    const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
    const uint32_t bytes = valid ? 16u : 0u;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(global), "r"(bytes));
    return;
  }
#endif
  if (valid) {
    cp_async_16<kPortable>(shared, global);
    return;
  }
#if defined(FUSEDLLM_SIMT)
  simt::detail::record_shared_access(simt::detail::SharedAccess::kCpAsync, shared);
#endif
  *static_cast<Pack<uint32_t, 4>*>(shared) = Pack<uint32_t, 4>{{0u, 0u, 0u, 0u}};
}

// Closes the group of cp.async copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#if FUSEDLLM_HAS_MMA_SM80
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most kPending committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if FUSEDLLM_HAS_MMA_SM80
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
#endif
}

}  // namespace fusedllm::cuda::mma
