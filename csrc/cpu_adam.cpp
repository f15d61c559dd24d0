// CPU Adam/AdamW kernel family (placeholder until the CPU Adam issue lands).
#include <pybind11/pybind11.h>

namespace offload {
void register_cpu_adam(pybind11::module_& /*m*/) {}
}  // namespace offload
