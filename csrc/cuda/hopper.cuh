// Hopper's asynchronous units (sm_90a): mbarriers with phases and transaction
// counts, TMA tile copies (cp.async.bulk.tensor, 1-D to 5-D) from a tensor
// map the host encodes, and warpgroup matrix products (wgmma.mma_async
// m64nNk16, bfloat16 / float16 in, float32 accumulators) reading shared memory
// through matrix descriptors.
//
// Each wrapper is the PTX instruction on an sm_90a GPU and the SIMT
// emulator's twin in the emulated build (csrc/simt/hopper.inc), which also
// checks the rules a GPU leaves undefined (see there). Elsewhere (sm_75 to
// sm_90 without the `a` features) they trap: dispatch launches their kernels
// only where the sm_90a image exists.
//
// Layouts, for the 128 threads of a warpgroup, thread t = 32 w + 4 g + q
// (warp w 0..3, group g 0..7, quad q 0..3):
//   D (64 x N, float32), N / 2 registers: d[4j + 2h + c] = D[16w + g + 8h][8j + 2q + c]
//   A from registers (64 x 16): the m16n8k16 A fragment of mma.cuh for rows 16w..16w+15;
//     float8 (64 x 32): r[i] holds row 16w + g + 8 (i % 2), elements 16 (i / 2) + 4q .. + 3
//     (the first in the low byte), as mma.sync m16n8k32's A fragment
// Shared-memory operands: A is 64 x 16 and B is N x 16 (x 32 for float8: the
// same 32 bytes a row; row n of B holds column n of the product's right
// operand), each K-major (a row's elements together) or
// MN-major (consecutive rows' elements together), described by
// make_descriptor (start, leading and stride byte offsets, swizzle); see
// operand_offset in csrc/simt/hopper.inc for the canonical layouts. A swizzled
// tile must start on a multiple of 8 x its swizzle span in shared_address
// terms for TMA and wgmma to agree on its rows (kernels align their tiles with
// shared_address, which the emulator counts from the dynamic shared memory).
#pragma once

#include <cstdint>

#include "mma.cuh"

#include <c10/util/Float8_e4m3fn.h>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL) && !defined(FUSEDLLM_SIMT)
#define FUSEDLLM_HAS_SM90A 1
#else
#define FUSEDLLM_HAS_SM90A 0
#endif

#if defined(FUSEDLLM_SIMT)
#include <source_location>
#define FUSEDLLM_GRID_CONSTANT
#else
#include <cuda.h>
#include <cudaTypedefs.h>
#define FUSEDLLM_GRID_CONSTANT __grid_constant__
#endif

namespace fusedllm::cuda::hopper {

// Where an emulated wrapper was called from, for the emulator's errors.
#if defined(FUSEDLLM_SIMT)
struct Site {
  const char* file;
  int line;
  Site(std::source_location s = std::source_location::current())
      : file(s.file_name()), line(static_cast<int>(s.line())) {}
};
#else
struct Site {};
#endif

// Device code without sm_90a features: the wrappers' kernels never launch there.
#if !FUSEDLLM_HAS_SM90A && !defined(FUSEDLLM_SIMT) && defined(__CUDA_ARCH__)
#define FUSEDLLM_HOPPER_UNAVAILABLE() __trap()
#else
#define FUSEDLLM_HOPPER_UNAVAILABLE() ((void)0)
#endif

enum class Swizzle : int { kNone = 0, k32B = 32, k64B = 64, k128B = 128 };
enum class Major : int { kK = 0, kMN = 1 };

// wgmma's operand types: bfloat16 and float16 (k16 a step), and float8 e4m3
// (k32 a step: the same 32 bytes of a row; K-major operands only).
template <typename T>
constexpr bool kIsE4m3 = std::is_same_v<T, c10::Float8_e4m3fn>;
template <typename T>
constexpr bool kWgmmaType = mma::kIs16Bit<T> || kIsE4m3<T>;
template <typename T>
constexpr int kWgmmaK = kIsE4m3<T> ? 32 : 16;

// ---------------------------------------------------------------------------
// Tensor maps (host)
// ---------------------------------------------------------------------------

// A CUtensorMap on a GPU; the emulator's image of one in the emulated build.
// Kernels take it by value as a FUSEDLLM_GRID_CONSTANT (__grid_constant__) parameter.
struct alignas(64) TensorMap {
  unsigned char bytes[128];
};

// The tiled tensor map of a tensor at `global`: `rank` dimensions (1 to 5) of
// `dims` elements, innermost first, dimension d > 0 `strides[d-1]` bytes apart
// (each past the extent of the dimension inside it); copies a box of `box` elements per dimension into shared memory
// as a dense row-major tile (swizzled: its rows are the swizzle span, 32, 64 or
// 128 bytes); elements outside the tensor read as zero and are not written.
inline TensorMap encode_tensor_map(const void* global, int element_bytes, int rank, const int64_t* dims,
                                   const int64_t* strides, const int* box, Swizzle swizzle) {
  TORCH_CHECK_VALUE(rank >= 1 && rank <= 5, "encode_tensor_map: rank must be 1 to 5, got ", rank);
  TORCH_CHECK_VALUE(element_bytes == 1 || element_bytes == 2 || element_bytes == 4,
                    "encode_tensor_map: elements of 1, 2 or 4 bytes, got ", element_bytes);
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(global) % 16 == 0,
                    "encode_tensor_map: the global address must be 16-byte aligned");
  for (int d = 0; d < rank; ++d) {
    TORCH_CHECK_VALUE(dims[d] >= 1 && dims[d] <= (int64_t{1} << 32), "encode_tensor_map: dimension ", d,
                      " must have 1 to 2^32 elements, got ", dims[d]);
    TORCH_CHECK_VALUE(box[d] >= 1 && box[d] <= 256, "encode_tensor_map: box dimension ", d,
                      " must be 1 to 256 elements, got ", box[d]);
    if (d > 0) {
      TORCH_CHECK_VALUE(strides[d - 1] > 0 && strides[d - 1] % 16 == 0 && strides[d - 1] < (int64_t{1} << 40),
                        "encode_tensor_map: the stride of dimension ", d,
                        " must be a positive multiple of 16 bytes below 2^40, got ", strides[d - 1]);
    }
  }
  // Each dimension's stride reaches past the extent of the one inside it, as
  // the driver describes tensors.
  for (int d = 1; d < rank; ++d) {
    const int64_t inner = d == 1 ? dims[0] * element_bytes : strides[d - 2] * dims[d - 1];
    TORCH_CHECK_VALUE(strides[d - 1] >= inner, "encode_tensor_map: the stride of dimension ", d, " (",
                      strides[d - 1], " bytes) must reach past dimension ", d - 1, " (", inner, " bytes)");
  }
  const int inner_bytes = box[0] * element_bytes;
  TORCH_CHECK_VALUE(inner_bytes % 16 == 0, "encode_tensor_map: the box's inner dimension must be a multiple of 16 "
                    "bytes, got ", inner_bytes);
  TORCH_CHECK_VALUE(swizzle == Swizzle::kNone || inner_bytes == static_cast<int>(swizzle),
                    "encode_tensor_map: a swizzled box's inner dimension must be the swizzle span (",
                    static_cast<int>(swizzle), " bytes), got ", inner_bytes, " bytes");
  TensorMap map{};
#if defined(FUSEDLLM_SIMT)
  simt::detail::TensorMapImage image{};
  image.magic = simt::detail::kTensorMapMagic;
  image.rank = static_cast<uint8_t>(rank);
  image.element_bytes = static_cast<uint8_t>(element_bytes);
  image.swizzle_bytes = static_cast<uint8_t>(swizzle);
  image.global = global;
  for (int d = 0; d < rank; ++d) {
    image.dims[d] = static_cast<uint64_t>(dims[d]);
    image.box[d] = static_cast<uint16_t>(box[d]);
    if (d > 0) image.strides[d - 1] = static_cast<uint64_t>(strides[d - 1]);
  }
  static_assert(sizeof(image) <= sizeof(map.bytes), "the emulator's tensor map fits a CUtensorMap");
  std::memcpy(map.bytes, &image, sizeof(image));
#else
  static_assert(sizeof(CUtensorMap) == sizeof(TensorMap), "TensorMap is a CUtensorMap");
  // The driver's encoder, found through the runtime (no link against libcuda).
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
#else  // CUDA 12.0-12.4: no ByVersion; the one version of cuTensorMapEncodeTiled is 12000's
    C10_CUDA_CHECK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found));
#endif
    TORCH_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr,
                "encode_tensor_map: the CUDA driver has no cuTensorMapEncodeTiled (a Hopper driver is needed)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  cuuint64_t g_dims[5], g_strides[4];
  cuuint32_t b_dims[5], e_strides[5];
  for (int d = 0; d < rank; ++d) {
    g_dims[d] = static_cast<cuuint64_t>(dims[d]);
    b_dims[d] = static_cast<cuuint32_t>(box[d]);
    e_strides[d] = 1;
    if (d > 0) g_strides[d - 1] = static_cast<cuuint64_t>(strides[d - 1]);
  }
  const CUtensorMapDataType type = element_bytes == 1   ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                   : element_bytes == 2 ? CU_TENSOR_MAP_DATA_TYPE_UINT16
                                                        : CU_TENSOR_MAP_DATA_TYPE_UINT32;
  const CUtensorMapSwizzle mode = swizzle == Swizzle::k128B  ? CU_TENSOR_MAP_SWIZZLE_128B
                                  : swizzle == Swizzle::k64B ? CU_TENSOR_MAP_SWIZZLE_64B
                                  : swizzle == Swizzle::k32B ? CU_TENSOR_MAP_SWIZZLE_32B
                                                             : CU_TENSOR_MAP_SWIZZLE_NONE;
  const CUresult result = encode(reinterpret_cast<CUtensorMap*>(map.bytes), type, static_cast<cuuint32_t>(rank),
                                 const_cast<void*>(global), g_dims, g_strides, b_dims, e_strides,
                                 CU_TENSOR_MAP_INTERLEAVE_NONE, mode, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(result == CUDA_SUCCESS, "encode_tensor_map: cuTensorMapEncodeTiled failed with CUresult ",
              static_cast<int>(result));
#endif
  return map;
}

// ---------------------------------------------------------------------------
// Shared addresses, mbarriers, the async proxy
// ---------------------------------------------------------------------------

// The shared-state-space address of a pointer into shared memory.
__device__ __forceinline__ uint32_t shared_address(const void* p) {
#if defined(FUSEDLLM_SIMT)
  return simt::detail::shared_address(p);
#else
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
#endif
}

// A barrier of `count` arrivals per phase, in shared memory (8 bytes). One
// thread initialises it, then mbarrier_init_fence and a __syncthreads before
// others (and the TMA unit) use it.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, unsigned count, Site site = {}) {
#if defined(FUSEDLLM_SIMT)
  simt::detail::mbarrier_init(bar, count, site.file, site.line);
#elif FUSEDLLM_HAS_SM90A
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(bar)), "r"(count) : "memory");
#else
  FUSEDLLM_HOPPER_UNAVAILABLE();
#endif
}

// Makes the initialising thread's mbarrier_init visible to the async proxy.
__device__ __forceinline__ void mbarrier_init_fence() {
#if FUSEDLLM_HAS_SM90A
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// One arrival on the barrier.
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar, Site site = {}) {
#if defined(FUSEDLLM_SIMT)
  simt::detail::mbarrier_arrive(bar, 0, site.file, site.line);
#elif FUSEDLLM_HAS_SM90A
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(shared_address(bar))
               : "memory");
#else
  FUSEDLLM_HOPPER_UNAVAILABLE();
#endif
}

// One arrival that also announces `bytes` of transactions (TMA copies) this
// phase must see complete.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes, Site site = {}) {
#if defined(FUSEDLLM_SIMT)
  simt::detail::mbarrier_arrive(bar, bytes, site.file, site.line);
#elif FUSEDLLM_HAS_SM90A
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(
                   shared_address(bar)),
               "r"(bytes)
               : "memory");
#else
  FUSEDLLM_HOPPER_UNAVAILABLE();
#endif
}

// Returns once the barrier's phase of parity `parity` has completed. A fresh
// barrier is in phase 0: waiting on parity 1 returns at once.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, unsigned parity, Site site = {}) {
#if defined(FUSEDLLM_SIMT)
  simt::detail::mbarrier_wait(bar, parity, site.file, site.line);
#elif FUSEDLLM_HAS_SM90A
  const uint32_t address = shared_address(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(address), "r"(parity)
        : "memory");
  } while (!done);
#else
  FUSEDLLM_HOPPER_UNAVAILABLE();
#endif
}

// Orders this thread's ordinary shared-memory stores before later reads of
// the async proxy (wgmma operands, TMA stores).
__device__ __forceinline__ void fence_proxy_async() {
#if defined(FUSEDLLM_SIMT)
  simt::detail::fence_proxy_async();
#elif FUSEDLLM_HAS_SM90A
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#else
  FUSEDLLM_HOPPER_UNAVAILABLE();
#endif
}

// ---------------------------------------------------------------------------
// TMA
// ---------------------------------------------------------------------------

// The box of `map` at element coordinates `coords` (innermost first; may lie
// partly outside the tensor) into shared `dst` (128-byte aligned), completing
// its bytes on `bar`; one thread issues it.
template <int kRank>
__device__ __forceinline__ void tma_load(void* dst, const TensorMap& map, uint64_t* bar,
                                         const int32_t (&coords)[kRank], Site site = {}) {
  static_assert(kRank >= 1 && kRank <= 5, "tensor maps have 1 to 5 dimensions");
#if defined(FUSEDLLM_SIMT)
  simt::detail::tma_load(dst, &map, bar, coords, site.file, site.line);
#elif FUSEDLLM_HAS_SM90A
  const uint32_t to = shared_address(dst), b = shared_address(bar);
  const auto m = reinterpret_cast<uint64_t>(&map);
  if constexpr (kRank == 1) {
    asm volatile(
        "cp.async.bulk.tensor.1d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3}], [%2];\n"
                 ::"r"(to), "l"(m), "r"(b), "r"(coords[0]) : "memory");
  } else if constexpr (kRank == 2) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4}], [%2];\n"
                 ::"r"(to), "l"(m), "r"(b), "r"(coords[0]), "r"(coords[1]) : "memory");
  } else if constexpr (kRank == 3) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5}], [%2];\n"
                 ::"r"(to), "l"(m), "r"(b), "r"(coords[0]), "r"(coords[1]), "r"(coords[2]) : "memory");
  } else if constexpr (kRank == 4) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
                 ::"r"(to), "l"(m), "r"(b), "r"(coords[0]), "r"(coords[1]), "r"(coords[2]), "r"(coords[3]) : "memory");
  } else {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n"
                 ::"r"(to), "l"(m), "r"(b), "r"(coords[0]), "r"(coords[1]), "r"(coords[2]), "r"(coords[3]),
                 "r"(coords[4]) : "memory");
  }
#else
  FUSEDLLM_HOPPER_UNAVAILABLE();
#endif
}

// Shared `src` (a box of `map`) to the tensor at `coords`; elements outside
// the tensor are not written. Complete (the source free again) after
// tma_store_commit and tma_store_wait<0>.
template <int kRank>
__device__ __forceinline__ void tma_store(const TensorMap& map, const void* src, const int32_t (&coords)[kRank],
                                          Site site = {}) {
  static_assert(kRank >= 1 && kRank <= 5, "tensor maps have 1 to 5 dimensions");
#if defined(FUSEDLLM_SIMT)
  simt::detail::tma_store(&map, src, coords, site.file, site.line);
#elif FUSEDLLM_HAS_SM90A
  const uint32_t from = shared_address(src);
  const auto m = reinterpret_cast<uint64_t>(&map);
  if constexpr (kRank == 1) {
    asm volatile(
        "cp.async.bulk.tensor.1d.global.shared::cta.tile.bulk_group [%0, {%2}], [%1];\n"
                 ::"l"(m), "r"(from), "r"(coords[0]) : "memory");
  } else if constexpr (kRank == 2) {
    asm volatile(
        "cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%2, %3}], [%1];\n"
                 ::"l"(m), "r"(from), "r"(coords[0]), "r"(coords[1]) : "memory");
  } else if constexpr (kRank == 3) {
    asm volatile(
        "cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n"
                 ::"l"(m), "r"(from), "r"(coords[0]), "r"(coords[1]), "r"(coords[2]) : "memory");
  } else if constexpr (kRank == 4) {
    asm volatile(
        "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
                 ::"l"(m), "r"(from), "r"(coords[0]), "r"(coords[1]), "r"(coords[2]), "r"(coords[3]) : "memory");
  } else {
    asm volatile(
        "cp.async.bulk.tensor.5d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5, %6}], [%1];\n"
                 ::"l"(m), "r"(from), "r"(coords[0]), "r"(coords[1]), "r"(coords[2]), "r"(coords[3]), "r"(coords[4])
                 : "memory");
  }
#else
  FUSEDLLM_HOPPER_UNAVAILABLE();
#endif
}

__device__ __forceinline__ void tma_store_commit() {
#if FUSEDLLM_HAS_SM90A
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most kPending committed store groups still read shared memory.
template <int kPending>
__device__ __forceinline__ void tma_store_wait() {
#if FUSEDLLM_HAS_SM90A
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
#endif
}

// ---------------------------------------------------------------------------
// wgmma
// ---------------------------------------------------------------------------

// The matrix descriptor of a shared-memory operand at `tile` (16-byte aligned):
// leading and stride byte offsets as the layout needs them (operand_offset in
// csrc/simt/hopper.inc), the swizzle the tile was written with.
__device__ __forceinline__ uint64_t make_descriptor(const void* tile, Swizzle swizzle, uint32_t leading_bytes,
                                                   uint32_t stride_bytes) {
  const uint64_t mode = swizzle == Swizzle::k128B ? 1 : swizzle == Swizzle::k64B ? 2 : swizzle == Swizzle::k32B ? 3 : 0;
  return static_cast<uint64_t>((shared_address(tile) >> 4) & 0x3fffu) |
         static_cast<uint64_t>((leading_bytes >> 4) & 0x3fffu) << 16 |
         static_cast<uint64_t>((stride_bytes >> 4) & 0x3fffu) << 32 | mode << 62;
}

// The descriptor of the operand `bytes` (a multiple of 16) further along
// shared memory: only the start address field moves (shared addresses fit in
// it, so nothing carries out), one add where a descriptor made afresh costs
// several instructions.
__device__ __forceinline__ uint64_t advance_descriptor(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

// Before a warpgroup's first wgmma and after any access of the registers a
// wgmma reads or writes (after each wgmma_wait): every thread of the warpgroup.
__device__ __forceinline__ void wgmma_fence(Site site = {}) {
#if defined(FUSEDLLM_SIMT)
  simt::detail::wgmma_fence(site.file, site.line);
#elif FUSEDLLM_HAS_SM90A
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#else
  FUSEDLLM_HOPPER_UNAVAILABLE();
#endif
}

// Keeps the compiler from moving reads or writes of these registers across
// the wgmma instructions around it: it sees a product's accumulators written
// when the product is issued, but they arrive at the wait. Around every
// issue and after every wait, on the accumulators and A fragments involved.
template <int kN>
__device__ __forceinline__ void fence_operand(float (&r)[kN]) {
#if FUSEDLLM_HAS_SM90A
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(r[i])::"memory");
#else
  (void)r;
#endif
}
__device__ __forceinline__ void fence_operand(mma::FragA& a) {
#if FUSEDLLM_HAS_SM90A
#pragma unroll
  for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a.r[i])::"memory");
#else
  (void)a;
#endif
}

// Closes the group of wgmma operations issued since the last commit.
__device__ __forceinline__ void wgmma_commit(Site site = {}) {
#if defined(FUSEDLLM_SIMT)
  simt::detail::wgmma_commit(site.file, site.line);
#elif FUSEDLLM_HAS_SM90A
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#else
  FUSEDLLM_HOPPER_UNAVAILABLE();
#endif
}

// Waits until at most kPending committed groups are in flight; their
// accumulators are then this thread's to read.
template <int kPending>
__device__ __forceinline__ void wgmma_wait(Site site = {}) {
#if defined(FUSEDLLM_SIMT)
  simt::detail::wgmma_wait(kPending, site.file, site.line);
#elif FUSEDLLM_HAS_SM90A
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#else
  FUSEDLLM_HOPPER_UNAVAILABLE();
#endif
}

#define FUSEDLLM_WGMMA_D32 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define FUSEDLLM_WGMMA_D64 FUSEDLLM_WGMMA_D32 ", " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define FUSEDLLM_WGMMA_D128 FUSEDLLM_WGMMA_D64 ", " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define FUSEDLLM_F8(d, i) \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define FUSEDLLM_F32(d) FUSEDLLM_F8(d, 0), FUSEDLLM_F8(d, 8), FUSEDLLM_F8(d, 16), FUSEDLLM_F8(d, 24)
#define FUSEDLLM_F64(d) FUSEDLLM_F32(d), FUSEDLLM_F8(d, 32), FUSEDLLM_F8(d, 40), FUSEDLLM_F8(d, 48), FUSEDLLM_F8(d, 56)
#define FUSEDLLM_F128(d)                                                                                       \
  FUSEDLLM_F64(d), FUSEDLLM_F8(d, 64), FUSEDLLM_F8(d, 72), FUSEDLLM_F8(d, 80), FUSEDLLM_F8(d, 88),           \
      FUSEDLLM_F8(d, 96), FUSEDLLM_F8(d, 104), FUSEDLLM_F8(d, 112), FUSEDLLM_F8(d, 120)
// A and B from shared memory: operands after the N/2 accumulators are desc A,
// desc B, scale-d, trans A, trans B (indices I0..I4).
#define FUSEDLLM_WGMMA_SS(N, TY, DLIST, DOPS, I0, I1, I2, I3, I4)                                             \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" I2 ", 0;\n"                                              \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" DLIST "}, %" I0 ", %" I1  \
               ", p, 1, 1, %" I3 ", %" I4 ";\n}\n"                                                           \
               : DOPS                                                                                        \
               : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)), "n"(static_cast<int>(kTransA)), \
                 "n"(static_cast<int>(kTransB)))
// A from registers: a0..a3, desc B, scale-d, trans B (indices I0..I6).
#define FUSEDLLM_WGMMA_RS(N, TY, DLIST, DOPS, I0, I1, I2, I3, I4, I5, I6)                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" I5 ", 0;\n"                                              \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" DLIST "}, {%" I0 ", %" I1 \
               ", %" I2 ", %" I3 "}, %" I4 ", p, 1, 1, %" I6 ";\n}\n"                                        \
               : DOPS                                                                                        \
               : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "l"(desc_b),                           \
                 "r"(static_cast<int>(accumulate)), "n"(static_cast<int>(kTransB)))

// float8 (e4m3): no transposes; desc A, desc B, scale-d (I0..I2) / a0..a3, desc B, scale-d (I0..I5).
#define FUSEDLLM_WGMMA_SS8(N, DLIST, DOPS, I0, I1, I2)                                                      \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" I2 ", 0;\n"                                             \
               "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 {" DLIST "}, %" I0 ", %" I1         \
               ", p, 1, 1;\n}\n"                                                                            \
               : DOPS                                                                                       \
               : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)))
#define FUSEDLLM_WGMMA_RS8(N, DLIST, DOPS, I0, I1, I2, I3, I4, I5)                                          \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" I5 ", 0;\n"                                             \
               "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 {" DLIST "}, {%" I0 ", %" I1        \
               ", %" I2 ", %" I3 "}, %" I4 ", p, 1, 1;\n}\n"                                                 \
               : DOPS                                                                                       \
               : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "l"(desc_b),                          \
                 "r"(static_cast<int>(accumulate)))

// D (64 x N) = A B^T (+ D when `accumulate`): A (64 x K) and B (N x K), K =
// kWgmmaK<T>, in shared memory as their descriptors describe; K-major or
// MN-major each (K-major only for float8).
// Asynchronous: the accumulators are undefined until wgmma_wait, and neither
// they nor the shared operands may be touched before it. N: 64, 128 or 256.
template <typename T, int N, Major kMajorA, Major kMajorB>
__device__ __forceinline__ void wgmma(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, bool accumulate,
                                      Site site = {}) {
  static_assert(kWgmmaType<T>, "wgmma takes bfloat16, float16 or float8 (e4m3) operands");
  static_assert(!kIsE4m3<T> || (kMajorA == Major::kK && kMajorB == Major::kK),
                "float8 wgmma reads K-major operands only");
  static_assert(N == 64 || N == 128 || N == 256, "wgmma N must be 64, 128 or 256");
  constexpr bool kTransA = kMajorA == Major::kMN, kTransB = kMajorB == Major::kMN;
#if defined(FUSEDLLM_SIMT)
  simt::detail::WgmmaIssue op;
  op.n = N;
  op.bf16 = std::is_same_v<T, c10::BFloat16>;
  op.e4m3 = kIsE4m3<T>;
  op.trans_a = kTransA;
  op.trans_b = kTransB;
  op.accumulate = accumulate;
  op.desc_a = desc_a;
  op.desc_b = desc_b;
  op.d = d;
  simt::detail::wgmma_issue(op, site.file, site.line);
#elif FUSEDLLM_HAS_SM90A
  if constexpr (kIsE4m3<T>) {
    (void)kTransA, (void)kTransB;
    if constexpr (N == 64) FUSEDLLM_WGMMA_SS8(64, FUSEDLLM_WGMMA_D32, FUSEDLLM_F32(d), "32", "33", "34");
    if constexpr (N == 128) FUSEDLLM_WGMMA_SS8(128, FUSEDLLM_WGMMA_D64, FUSEDLLM_F64(d), "64", "65", "66");
    if constexpr (N == 256) FUSEDLLM_WGMMA_SS8(256, FUSEDLLM_WGMMA_D128, FUSEDLLM_F128(d), "128", "129", "130");
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if constexpr (N == 64)
      FUSEDLLM_WGMMA_SS(64, "bf16", FUSEDLLM_WGMMA_D32, FUSEDLLM_F32(d), "32",
                        "33", "34", "35", "36");
    if constexpr (N == 128)
      FUSEDLLM_WGMMA_SS(128, "bf16", FUSEDLLM_WGMMA_D64, FUSEDLLM_F64(d), "64",
                        "65", "66", "67", "68");
    if constexpr (N == 256)
      FUSEDLLM_WGMMA_SS(256, "bf16", FUSEDLLM_WGMMA_D128, FUSEDLLM_F128(d), "128",
                        "129", "130", "131", "132");
  } else {
    if constexpr (N == 64)
      FUSEDLLM_WGMMA_SS(64, "f16", FUSEDLLM_WGMMA_D32, FUSEDLLM_F32(d), "32",
                        "33", "34", "35", "36");
    if constexpr (N == 128)
      FUSEDLLM_WGMMA_SS(128, "f16", FUSEDLLM_WGMMA_D64, FUSEDLLM_F64(d), "64",
                        "65", "66", "67", "68");
    if constexpr (N == 256)
      FUSEDLLM_WGMMA_SS(256, "f16", FUSEDLLM_WGMMA_D128, FUSEDLLM_F128(d), "128",
                        "129", "130", "131", "132");
  }
#else
  (void)d, (void)desc_a, (void)desc_b, (void)accumulate, (void)kTransA, (void)kTransB;
  FUSEDLLM_HOPPER_UNAVAILABLE();
#endif
}

// As wgmma, with A (64 x 16, or 64 x 32 float8; K-major) from the
// warpgroup's registers: this thread's A fragment of rows 16w..16w+15 (above).
template <typename T, int N, Major kMajorB>
__device__ __forceinline__ void wgmma(float (&d)[N / 2], const mma::FragA& a, uint64_t desc_b, bool accumulate,
                                      Site site = {}) {
  static_assert(kWgmmaType<T>, "wgmma takes bfloat16, float16 or float8 (e4m3) operands");
  static_assert(!kIsE4m3<T> || kMajorB == Major::kK, "float8 wgmma reads K-major operands only");
  static_assert(N == 64 || N == 128 || N == 256, "wgmma N must be 64, 128 or 256");
  constexpr bool kTransB = kMajorB == Major::kMN;
#if defined(FUSEDLLM_SIMT)
  simt::detail::WgmmaIssue op;
  op.n = N;
  op.bf16 = std::is_same_v<T, c10::BFloat16>;
  op.e4m3 = kIsE4m3<T>;
  op.a_in_registers = true;
  op.trans_b = kTransB;
  op.accumulate = accumulate;
  op.desc_b = desc_b;
  for (int i = 0; i < 4; ++i) op.a[i] = a.r[i];
  op.d = d;
  simt::detail::wgmma_issue(op, site.file, site.line);
#elif FUSEDLLM_HAS_SM90A
  if constexpr (kIsE4m3<T>) {
    (void)kTransB;
    if constexpr (N == 64)
      FUSEDLLM_WGMMA_RS8(64, FUSEDLLM_WGMMA_D32, FUSEDLLM_F32(d), "32", "33", "34", "35", "36", "37");
    if constexpr (N == 128)
      FUSEDLLM_WGMMA_RS8(128, FUSEDLLM_WGMMA_D64, FUSEDLLM_F64(d), "64", "65", "66", "67", "68", "69");
    if constexpr (N == 256)
      FUSEDLLM_WGMMA_RS8(256, FUSEDLLM_WGMMA_D128, FUSEDLLM_F128(d), "128", "129", "130", "131", "132", "133");
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if constexpr (N == 64)
      FUSEDLLM_WGMMA_RS(64, "bf16", FUSEDLLM_WGMMA_D32, FUSEDLLM_F32(d), "32",
                        "33", "34", "35", "36", "37", "38");
    if constexpr (N == 128)
      FUSEDLLM_WGMMA_RS(128, "bf16", FUSEDLLM_WGMMA_D64, FUSEDLLM_F64(d), "64",
                        "65", "66", "67", "68", "69", "70");
    if constexpr (N == 256)
      FUSEDLLM_WGMMA_RS(256, "bf16", FUSEDLLM_WGMMA_D128, FUSEDLLM_F128(d), "128",
                        "129", "130", "131", "132", "133", "134");
  } else {
    if constexpr (N == 64)
      FUSEDLLM_WGMMA_RS(64, "f16", FUSEDLLM_WGMMA_D32, FUSEDLLM_F32(d), "32",
                        "33", "34", "35", "36", "37", "38");
    if constexpr (N == 128)
      FUSEDLLM_WGMMA_RS(128, "f16", FUSEDLLM_WGMMA_D64, FUSEDLLM_F64(d), "64",
                        "65", "66", "67", "68", "69", "70");
    if constexpr (N == 256)
      FUSEDLLM_WGMMA_RS(256, "f16", FUSEDLLM_WGMMA_D128, FUSEDLLM_F128(d), "128",
                        "129", "130", "131", "132", "133", "134");
  }
#else
  (void)d, (void)a, (void)desc_b, (void)accumulate, (void)kTransB;
  FUSEDLLM_HOPPER_UNAVAILABLE();
#endif
}

#undef FUSEDLLM_WGMMA_RS8
#undef FUSEDLLM_WGMMA_SS8
#undef FUSEDLLM_WGMMA_RS
#undef FUSEDLLM_WGMMA_SS
#undef FUSEDLLM_F128
#undef FUSEDLLM_F64
#undef FUSEDLLM_F32
#undef FUSEDLLM_F8
#undef FUSEDLLM_WGMMA_D128
#undef FUSEDLLM_WGMMA_D64
#undef FUSEDLLM_WGMMA_D32

// Named barrier `id` (1 to 15; 0 is __syncthreads') of `threads` threads (a
// multiple of 32): arrive and wait for the phase, or arrive only. Orders
// warpgroups against each other without stopping the whole block.
__device__ __forceinline__ void named_barrier_sync(int id, int threads, Site site = {}) {
#if defined(FUSEDLLM_SIMT)
  simt::detail::named_barrier(id, threads, true, site.file, site.line);
#else
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
#endif
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads, Site site = {}) {
#if defined(FUSEDLLM_SIMT)
  simt::detail::named_barrier(id, threads, false, site.file, site.line);
#else
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
#endif
}

// Moves the warpgroup's register allocation to kRegisters (a multiple of 8
// from 24 to 256): producers give registers up (kIncrease = false) so that
// consumers can take them. Every thread of the warpgroup.
template <int kRegisters, bool kIncrease>
__device__ __forceinline__ void setmaxnreg(Site site = {}) {
#if defined(FUSEDLLM_SIMT)
  simt::detail::setmaxnreg(kRegisters, site.file, site.line);
#elif FUSEDLLM_HAS_SM90A
  static_assert(kRegisters >= 24 && kRegisters <= 256 && kRegisters % 8 == 0,
                "setmaxnreg takes a multiple of 8 from 24 to 256");
  if constexpr (kIncrease) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
  } else {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
  }
#else
  FUSEDLLM_HOPPER_UNAVAILABLE();
#endif
}

#undef FUSEDLLM_HOPPER_UNAVAILABLE

}  // namespace fusedllm::cuda::hopper
