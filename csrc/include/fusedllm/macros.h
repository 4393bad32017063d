// Shared by the C++ (CPU) and CUDA translation units.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FUSEDLLM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FUSEDLLM_HOST_DEVICE inline
#endif
