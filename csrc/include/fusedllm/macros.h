// Shared by the C++ (CPU) and CUDA translation units.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FUSEDLLM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FUSEDLLM_HOST_DEVICE inline
#endif

// The emulated build of the CUDA kernels gets the device math functions
// (__expf ...) the GPU path of these headers calls.
#if defined(FUSEDLLM_SIMT)
#include "simt/device_math.h"
#endif
