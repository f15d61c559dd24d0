// The module offload._C: thin bindings only. Each kernel family registers its own functions
// (register_cpu_adam in cpu_adam.cpp, register_aio in aio.cpp, register_pages in pages.cpp);
// this file adds the shared runtime controls. No torch headers anywhere: Python passes
// data_ptr(), counts, dtype codes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "compute_threads.h"
#include "simd.h"
#include "thread_pool.h"

namespace py = pybind11;

namespace offload {
void register_cpu_adam(py::module_& m);
void register_aio(py::module_& m);
void register_pages(py::module_& m);
}  // namespace offload

PYBIND11_MODULE(_C, m) {
  m.doc() = "offload native core: CPU Adam, async IO engine, compute threads (no torch headers)";
  m.attr("ABI_VERSION") = 1;
  m.def("simd_level", [] { return std::string(offload::simd_level_name(offload::simd_level())); },
        "SIMD level the kernels use now: scalar, avx2, avx512 or neon.");
  m.def("detect_simd_level",
        [] { return std::string(offload::simd_level_name(offload::detect_simd_level())); },
        "Best SIMD level this CPU supports.");
  m.def("supported_simd_levels", [] {
    std::vector<std::string> out;
    for (auto l : {offload::SimdLevel::kScalar, offload::SimdLevel::kAvx2,
                   offload::SimdLevel::kAvx512, offload::SimdLevel::kNeon})
      if (offload::simd_level_supported(l)) out.emplace_back(offload::simd_level_name(l));
    return out;
  });
  m.def("set_simd_level", &offload::set_simd_level, py::arg("name"),
        "Force a SIMD level ('auto' restores detection).");
  m.def("set_num_threads", &offload::set_num_threads, py::arg("n"),
        "Threads of the compute pool (CPU Adam, gradient kernels), including the caller.");
  m.def("get_num_threads", &offload::get_num_threads);
  m.def("set_compute_backend", &offload::set_compute_backend, py::arg("name"),
        "Threads the kernels run on: 'openmp' (torch's libgomp team), 'pool' (offload's own) "
        "or 'auto' (openmp when a libgomp is loaded; csrc/compute_threads.h).");
  m.def("use_pool_in_this_thread", &offload::use_pool_in_this_thread,
        "The calling thread's kernels run on offload's pool from now on (a background thread).");
  m.def("compute_backend", &offload::compute_backend,
        "'openmp' or 'pool': what the calling thread's next kernel call uses.");
  m.def("compute_backend_library", &offload::compute_backend_library,
        "The path of the libgomp the kernels run on ('' for the pool).");
  m.def("shutdown_compute_pool", &offload::shutdown_compute_pool,
        "Stop and join the compute pool's threads (a later kernel call makes a new pool).");
  offload::register_cpu_adam(m);
  offload::register_aio(m);
  offload::register_pages(m);
  // the compute pool's workers are joined before the interpreter tears down (thread_pool.h)
  py::module_::import("atexit").attr("register")(m.attr("shutdown_compute_pool"));
}
