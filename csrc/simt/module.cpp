// fusedllm._simt: the emulated CUDA kernels as torch.ops.fusedllm_simt.<op>
// (the schemas of torch.ops.fusedllm, on CPU tensors; the kernels register
// from the csrc/cuda sources compiled with FUSEDLLM_SIMT) and the emulator's
// settings and counters.
#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/library.h>

#include "simt/simt.h"

// Each op adds its schemas to the library (FUSEDLLM_CUDA_OPS_DEFINE in csrc/cuda/<op>.cu).
TORCH_LIBRARY(fusedllm_simt, m) {}

namespace fusedllm::simt {
std::vector<float> run_selftest(const std::string& name);  // selftest.cpp
}
namespace fusedllm::cuda {
std::vector<std::string> attention_kernels();  // csrc/cuda/attention.cu
}

namespace py = pybind11;
namespace simt = fusedllm::simt;

PYBIND11_MODULE(_simt, m) {
  m.doc() = "fusedllm's CUDA kernels executed on the CPU by a SIMT emulator";
  m.def("set_schedule", [](const std::string& name) {
    simt::Schedule s;
    TORCH_CHECK_VALUE(simt::parse_schedule(name, s), "fusedllm.simt: schedule must be one of ",
                      "lockstep, reverse, random, warp, warp-reverse, warp-random; got '", name, "'");
    simt::set_schedule(s);
  });
  m.def("schedule", [] { return std::string(simt::schedule_name(simt::schedule())); });
  m.def("set_workers", &simt::set_workers);
  m.def("workers", &simt::workers);
  m.def("set_random_seed", &simt::set_random_seed);
  m.def("stats", [] {
    const simt::Stats s = simt::stats();
    py::dict d;
    d["launches"] = s.launches;
    d["blocks"] = s.blocks;
    d["threads"] = s.threads;
    d["barriers"] = s.barriers;
    d["collectives"] = s.collectives;
    d["ldmatrix"] = s.ldmatrix;
    d["ldmatrix_conflicts"] = s.ldmatrix_conflicts;
    d["cp_async"] = s.cp_async;
    d["cp_async_conflicts"] = s.cp_async_conflicts;
    py::dict kernels;
    for (const auto& [name, count] : s.kernel_launches) kernels[py::str(name)] = count;
    d["kernel_launches"] = kernels;
    return d;
  });
  m.def("reset_stats", &simt::reset_stats);
  m.def("attention_kernels", &fusedllm::cuda::attention_kernels,
        "The attention kernels of the emulated build, as their launches name them.");
  m.def("run_selftest", &simt::run_selftest, "Runs one of the deliberately broken test kernels.");
  m.def("device_properties", [] {
    const simt::DeviceProperties& p = simt::device_properties();
    py::dict d;
    d["name"] = std::string(p.name);
    d["multi_processor_count"] = p.multiProcessorCount;
    d["shared_mem_per_block"] = p.sharedMemPerBlock;
    d["shared_mem_per_block_optin"] = p.sharedMemPerBlockOptin;
    d["max_threads_per_block"] = p.maxThreadsPerBlock;
    d["warp_size"] = p.warpSize;
    d["major"] = p.major;
    d["minor"] = p.minor;
    return d;
  });
}
