// Python bindings of the async IO engine (aio_engine.h): offload._C.AioEngine / AioRequest.
// Python (offload/io/async_io.py) turns a request's errno + message into OSError(errno, msg,
// path); every wait releases the GIL through without_gil (gil.h: safe at interpreter exit).
#include <pybind11/pybind11.h>

#include <memory>
#include <string>

#include "aio_engine.h"
#include "gil.h"

namespace py = pybind11;

namespace offload {

void register_aio(py::module_& m) {
  using aio::Engine;
  using aio::Request;
  py::class_<Request, std::shared_ptr<Request>>(m, "AioRequest",
                                                 "One in-flight read or write of AioEngine.")
      .def(
          "wait",
          [](Request& r, double timeout_s) { return without_gil([&] { return r.wait(timeout_s); }); },
          py::arg("timeout_s"), "Block up to timeout_s seconds (< 0: forever); True once completed.")
      .def("done", &Request::done)
      .def("error", &Request::error, "errno of the first failure, 0 if none.")
      .def("message", &Request::message, "What failed, e.g. 'read of N bytes at offset X ...'.")
      .def_property_readonly("direct_refused",
                             [](const Request& r) { return r.direct_refused; })
      .def_property_readonly("path", [](const Request& r) { return r.path; });

  py::class_<Engine>(m, "AioEngine",
                     "O_DIRECT async file IO on its own threads (Linux AIO or pread/pwrite).")
      .def(py::init<size_t, int, int, bool>(), py::arg("block_size"), py::arg("queue_depth"),
           py::arg("thread_count"), py::arg("direct_io"))
      .def(
          "submit",
          [](Engine& e, bool is_write, const std::string& path, uintptr_t addr, size_t nbytes,
             off_t offset, bool urgent) {
            return without_gil(
                [&] { return e.submit(is_write, path, addr, nbytes, offset, urgent); });
          },
          py::arg("is_write"), py::arg("path"), py::arg("addr"), py::arg("nbytes"),
          py::arg("offset"), py::arg("urgent") = false,
          "Queue a read/write of nbytes at addr <-> path[offset:] (urgent: ahead of every queued "
          "request that is not); IO errors land on the request.")
      .def("stats",
           [](Engine& e) {
             aio::Stats s = e.stats();
             py::dict d;
             d["bytes_read"] = s.bytes_read;
             d["bytes_written"] = s.bytes_written;
             d["reads"] = s.reads;
             d["writes"] = s.writes;
             d["read_seconds"] = s.read_seconds;
             d["write_seconds"] = s.write_seconds;
             return d;
           })
      .def_property_readonly("uses_kernel_aio", &Engine::uses_kernel_aio)
      .def(
          "close", [](Engine& e) { without_gil([&] { e.close(); }); },
          "Wait for every submitted request, then stop the threads.");

  m.def("aio_contexts_made", &aio::contexts_made,
        "Kernel AIO contexts this process set up so far (engines reuse those closed engines "
        "left: aio_engine.h); a forked child counts its own.");
  m.def("aio_inject_fault", &aio::inject_fault, py::arg("op"), py::arg("err"), py::arg("count"),
        "Test only: the next `count` syscalls of kind op (0 any, 1 read, 2 write, 3 O_DIRECT "
        "open) fail with errno err.");
}

}  // namespace offload
