// The CUDA-runtime touch points of the kernels' host code, in one place: the
// launch, device properties, the stream, the device guard, the dynamic
// shared-memory attribute and the operator registration. Under nvcc they are
// the CUDA runtime and ATen's CUDA context; in the emulated build
// (FUSEDLLM_SIMT, the host compiler) they are the SIMT emulator's
// (csrc/simt/simt.h), so the same kernel sources and host code run on the CPU.
#pragma once

#include <algorithm>
#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

#include "fusedllm/macros.h"

#if defined(FUSEDLLM_SIMT)
#include "simt/simt.h"

// The emulated kernels take CPU tensors and register as fusedllm_simt::<op>,
// whose schemas each op's .cu defines too.
#define FUSEDLLM_CUDA_OPS_IMPL(m) TORCH_LIBRARY_IMPL(fusedllm_simt, CPU, m)
#define FUSEDLLM_CUDA_OPS_DEFINE(define_fn) FUSEDLLM_DEFINE_OPS(fusedllm_simt, define_fn)

namespace fusedllm::cuda {

struct Stream {};
inline Stream current_stream() { return {}; }

struct DeviceGuard {
  explicit DeviceGuard(c10::Device device) {
    TORCH_CHECK(device.is_cpu(), "fusedllm simt: the emulated CUDA kernels run on CPU tensors, got ",
                device);
  }
};

inline const simt::DeviceProperties& device_properties() { return simt::device_properties(); }

template <typename... Params>
void allow_dynamic_shared_memory(void (*kernel)(Params...), size_t bytes) {
  simt::set_max_dynamic_shared_memory(reinterpret_cast<const void*>(kernel), bytes);
}

// Blocks of `threads` threads that one multiprocessor holds at once. The
// emulator has no register file: a multiprocessor's 2048 threads bound it.
template <typename... Params>
int resident_blocks(void (*)(Params...), int threads, size_t /*smem*/) {
  return std::clamp(2048 / threads, 1, 32);
}

// kernel<<<grid, block, smem, stream>>>(args...), then the launch check.
template <typename... Params, typename... Args>
void launch(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, Stream,
            Args&&... args) {
  // Converted once, as a launch converts its arguments; each thread gets its own copies.
  const std::tuple<std::decay_t<Params>...> params(std::forward<Args>(args)...);
  simt::launch(name, reinterpret_cast<const void*>(kernel), grid, block, smem,
               [&] { std::apply(kernel, params); });
}

}  // namespace fusedllm::cuda

#else
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <map>
#include <mutex>

#define FUSEDLLM_CUDA_OPS_IMPL(m) TORCH_LIBRARY_IMPL(fusedllm, CUDA, m)
#define FUSEDLLM_CUDA_OPS_DEFINE(define_fn)  // torch.ops.fusedllm's schemas: csrc/<op>.cpp

namespace fusedllm::cuda {

using Stream = cudaStream_t;
inline Stream current_stream() { return at::cuda::getCurrentCUDAStream(); }

using DeviceGuard = c10::cuda::CUDAGuard;

inline const cudaDeviceProp& device_properties() { return *at::cuda::getCurrentDeviceProperties(); }

template <typename... Params>
void allow_dynamic_shared_memory(void (*kernel)(Params...), size_t bytes) {
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(bytes)));
}

// Blocks of `threads` threads that one multiprocessor holds at once, given
// the kernel's registers and shared memory (a grid sized by threads alone can
// leave a second, short wave). The calculator asks the driver; its answers are
// kept per kernel, block, shared memory and device, so a launch pays a lookup.
template <typename... Params>
int resident_blocks(void (*kernel)(Params...), int threads, size_t smem) {
  using Key = std::tuple<const void*, int, size_t, c10::DeviceIndex>;
  static std::mutex mutex;
  static std::map<Key, int> known;
  const Key key{reinterpret_cast<const void*>(kernel), threads, smem, c10::cuda::current_device()};
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = known.find(key);
  if (it == known.end()) {
    int blocks = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem));
    it = known.emplace(key, std::max(blocks, 1)).first;
  }
  return it->second;
}

// kernel<<<grid, block, smem, stream>>>(args...), then the launch check.
template <typename... Params, typename... Args>
void launch(const char* /*name*/, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
            Stream stream, Args&&... args) {
  kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace fusedllm::cuda
#endif
