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

// gpt-oss's clamped SwiGLU (act::gpt_oss_gated): the default alpha and limit
// of the moe_experts ops, written into their schemas (moe_op.h) and the
// Gating defaults (moe.h) from here; tests/test_limits.py checks the schemas
// against fusedllm._limits.
#define FUSEDLLM_GPT_OSS_ALPHA 1.702
#define FUSEDLLM_GPT_OSS_LIMIT 7.0
#define FUSEDLLM_STRING_(x) #x
#define FUSEDLLM_STRING(x) FUSEDLLM_STRING_(x)

// Defines an op's schemas (fusedllm::define_fn(m)) in torch library `library`,
// whose fake kernels python/fusedllm/_fake.py registers: torch.ops.fusedllm's
// in csrc/<op>.cpp, the emulated torch.ops.fusedllm_simt's in csrc/cuda/<op>.cu.
#define FUSEDLLM_DEFINE_OPS(library, define_fn) \
  TORCH_LIBRARY_FRAGMENT(library, m) {          \
    m.set_python_module("fusedllm._fake");      \
    ::fusedllm::define_fn(m);                   \
  }
