// without_gil(f): runs f() with the GIL released, for the bindings' blocking native calls.
//
// Note (interpreter exit): pybind11's gil_scoped_release takes the GIL back in its destructor.
// When the interpreter finalizes, CPython (before 3.14) ends every daemon thread that asks for
// the GIL with pthread_exit(), which unwinds that thread's stack with a forced unwind. A forced
// unwind that starts inside a destructor (implicitly noexcept) makes the C++ runtime call
// std::terminate: "terminate called without an active exception", exit status 134 - what a
// training script did when its background optimizer step was still waiting on an IO request
// as the script ended. without_gil() takes the GIL back in an ordinary frame, so the unwind
// passes through (pybind11's dispatcher rethrows abi::__forced_unwind) and the thread ends the
// way CPython intends. Nothing here may take the GIL back from a destructor.
#pragma once

#include <pybind11/pybind11.h>

#include <exception>
#include <optional>
#include <type_traits>
#include <utility>

namespace offload {

template <class F>
auto without_gil(F&& f) -> decltype(f()) {
  using R = decltype(f());
  std::exception_ptr error;
  PyThreadState* state = PyEval_SaveThread();
  if constexpr (std::is_void_v<R>) {
    try {
      f();
    } catch (...) {
      error = std::current_exception();
    }
    PyEval_RestoreThread(state);  // may end this thread at exit: see the Note
    if (error) std::rethrow_exception(error);
  } else {
    std::optional<R> out;
    try {
      out.emplace(f());
    } catch (...) {
      error = std::current_exception();
    }
    PyEval_RestoreThread(state);  // may end this thread at exit: see the Note
    if (error) std::rethrow_exception(error);
    return std::move(*out);
  }
}

}  // namespace offload
