// Async IO engine (placeholder until the swapper issue lands).
#include <pybind11/pybind11.h>

namespace offload {
void register_aio(pybind11::module_& /*m*/) {}
}  // namespace offload
