// A 64x64x64 matrix-product tile built from the tensor-core primitives of
// mma.cuh (cp.async staging, ldmatrix with and without .trans, mma.sync), the
// way attention and grouped GEMM kernels use them. It exists to check those
// primitives: under the emulator (fusedllm._simt.mma_tile) and on a GPU, where
// a test runs it with the hardware instructions and with their portable forms.
#pragma once

#include "mma.cuh"

namespace fusedllm::cuda::mma {

constexpr int kCheckDim = 64;
constexpr int kCheckStride = kCheckDim + 8;  // padded rows, still 16-byte aligned
constexpr int kCheckThreads = 128;           // four warps, 16 rows each

// c [64, 64] float32 = a [64 (m), 64 (k)] times b, where b is [64 (n), 64 (k)]
// (kBRowsAreN: c = a b^T, the scores' layout) or [64 (k), 64 (n)] (c = a b, the
// value product's layout, loaded with ldmatrix .trans). Row-major, contiguous.
template <typename T, bool kBRowsAreN, bool kPortable>
__global__ void __launch_bounds__(kCheckThreads) mma_tile_kernel(const T* a, const T* b, float* c) {
  T* sa = dynamic_shared<T>();
  T* sb = sa + kCheckDim * kCheckStride;
  constexpr int kChunks = kCheckDim * kCheckDim * static_cast<int>(sizeof(T)) / 16;
  constexpr int kChunksPerRow = kChunks / kCheckDim;
  constexpr int kElementsPerChunk = 16 / static_cast<int>(sizeof(T));
  for (int chunk = threadIdx.x; chunk < kChunks; chunk += blockDim.x) {
    const int row = chunk / kChunksPerRow, col = (chunk % kChunksPerRow) * kElementsPerChunk;
    cp_async_16<kPortable>(sa + row * kCheckStride + col, a + row * kCheckDim + col);
    cp_async_16<kPortable>(sb + row * kCheckStride + col, b + row * kCheckDim + col);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  const int lane = threadIdx.x % kWarpSize;
  const int m0 = (threadIdx.x / kWarpSize) * 16;
  const int matrix = lane / 8, matrix_row = lane % 8;  // which 8x8 matrix this lane addresses
  FragC acc[kCheckDim / 8];
  for (int k0 = 0; k0 < kCheckDim; k0 += 16) {
    FragA fa;
    ldmatrix_x4<false, kPortable>(
        fa.r, sa + (m0 + (matrix % 2) * 8 + matrix_row) * kCheckStride + k0 + (matrix / 2) * 8);
    for (int n0 = 0; n0 < kCheckDim; n0 += 16) {
      uint32_t r[4];  // two n-tiles of 8: {r[0], r[1]} and {r[2], r[3]}
      if constexpr (kBRowsAreN) {
        const int n = n0 + (matrix / 2) * 8 + matrix_row, k = k0 + (matrix % 2) * 8;
        ldmatrix_x4<false, kPortable>(r, sb + n * kCheckStride + k);
      } else {
        const int k = k0 + (matrix % 2) * 8 + matrix_row, n = n0 + (matrix / 2) * 8;
        ldmatrix_x4<true, kPortable>(r, sb + k * kCheckStride + n);
      }
      mma_16816<T, kPortable>(acc[n0 / 8], fa, FragB{{r[0], r[1]}});
      mma_16816<T, kPortable>(acc[n0 / 8 + 1], fa, FragB{{r[2], r[3]}});
    }
  }
  const int group = lane / 4, quad = lane % 4;
  for (int t = 0; t < kCheckDim / 8; ++t) {
    float* top = c + (m0 + group) * kCheckDim + t * 8 + 2 * quad;
    float* bottom = top + 8 * kCheckDim;
    top[0] = acc[t].r[0];
    top[1] = acc[t].r[1];
    bottom[0] = acc[t].r[2];
    bottom[1] = acc[t].r[3];
  }
}

template <typename T, bool kBRowsAreN, bool kPortable>
void launch_mma_tile_as(const T* a, const T* b, float* c, Stream stream) {
  const size_t smem = 2 * kCheckDim * kCheckStride * sizeof(T);
  launch("mma_tile_kernel", mma_tile_kernel<T, kBRowsAreN, kPortable>, 1, kCheckThreads, smem, stream,
         a, b, c);
}

template <typename T>
void launch_mma_tile(const T* a, const T* b, float* c, bool b_rows_are_n, bool portable, Stream stream) {
  if (b_rows_are_n) {
    portable ? launch_mma_tile_as<T, true, true>(a, b, c, stream)
             : launch_mma_tile_as<T, true, false>(a, b, c, stream);
  } else {
    portable ? launch_mma_tile_as<T, false, true>(a, b, c, stream)
             : launch_mma_tile_as<T, false, false>(a, b, c, stream);
  }
}

}  // namespace fusedllm::cuda::mma
