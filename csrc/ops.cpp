// The fusedllm operator library (each op defines its schemas, in csrc/<op>.cpp)
// and the Python module `fusedllm._C`, which reports how the extension was built.
#include <Python.h>
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include "fusedllm/cpu_dispatch.h"

// Each op adds its schemas to the library (FUSEDLLM_DEFINE_OPS in csrc/<op>.cpp).
TORCH_LIBRARY(fusedllm, m) {}

namespace py = pybind11;

namespace {

py::list split_list(const std::string& s) {
  py::list out;
  size_t start = 0;
  while (start < s.size()) {
    size_t end = s.find(',', start);
    if (end == std::string::npos) end = s.size();
    if (end > start) out.append(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

}  // namespace

#ifdef FUSEDLLM_WITH_CUDA
namespace fusedllm::cuda {
std::vector<std::string> attention_kernels();  // csrc/cuda/attention.cu
}
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "fusedllm compiled kernels";
  m.def("build_info", [] {
    py::dict info;
    info["torch_version"] = FUSEDLLM_TORCH_VERSION;
#ifdef FUSEDLLM_WITH_CUDA
    info["cuda"] = true;
#else
    info["cuda"] = false;
#endif
    info["cuda_archs"] = split_list(FUSEDLLM_CUDA_ARCHS);
    info["cpu_isas"] = split_list(FUSEDLLM_CPU_ISA_LIST);
    info["cpu_isa_active"] = fusedllm::cpu::isa_name(fusedllm::cpu::active_isa());
    py::dict ran;
    for (const auto& [table, isa] : fusedllm::cpu::kernels_ran()) ran[py::str(table)] = isa;
    info["cpu_kernels_ran"] = ran;
    py::list attention;
#ifdef FUSEDLLM_WITH_CUDA
    for (const std::string& name : fusedllm::cuda::attention_kernels()) attention.append(name);
#endif
    info["cuda_attention_kernels"] = attention;
    return info;
  }, "How this extension was built: torch version, CUDA kernels and architectures, CPU variants "
     "(compiled, active, and the one each CPU kernel called so far in this process ran), the CUDA "
     "attention kernels.");
}
