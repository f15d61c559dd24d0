// CPU Adam/AdamW kernel family: run-time SIMD dispatch, the split over the compute threads, and
// the Python bindings. The kernels themselves are in cpu_adam_body.h (one source, three levels).
//
// Note (threading): a call is cut into tasks of about kTaskElems elements (more, smaller ones for
// small calls so that up to kMinTasks threads can share them), boundaries on multiples of 64
// elements so no two tasks write the same cache line of any buffer (fp32, bf16 or fp16). The
// compute threads (torch's OpenMP team or offload's pool: compute_threads.h), the caller's
// included, take tasks in order from a shared counter until none is left. Why not one
// contiguous chunk per thread: in training the step runs right after torch work, and torch's
// OpenMP workers keep spinning ~5 ms on their cores after every parallel region (libgomp's
// default wait policy); with one chunk per thread, the pool thread that shares a core with a
// spinner finished ~5 ms late and the whole call waited for it (0.93x DeepSpeedCPUAdam, whose
// OpenMP loop runs on those same spinning threads, against 1.2x after an idle gap;
// benchmarks/README.md). With tasks, the threads that have a core take over the rest; on
// torch's team the spinners themselves take them. The cut depends on n only, never on the
// thread count or the backend, so results - including the per-task double partial sums of
// accumulate_grad, added in task order - are identical for any number of threads. Calls under
// 2 x kMinPerTask elements run as one task on the caller alone: waking a worker costs more
// than it saves.
#include "cpu_adam.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "compute_threads.h"
#include "gil.h"
#include "simd.h"
#include "thread_pool.h"

namespace py = pybind11;

namespace offload {
namespace {

namespace ca = cpu_adam;

constexpr size_t kAlignElems = 64;
constexpr size_t kMinPerTask = size_t{1} << 15;  // 32K elements: below, a worker is not worth it
constexpr size_t kTaskElems = size_t{1} << 18;   // 256K elements: ~7 MB moved by an fp32 step
constexpr size_t kMinTasks = 16;                 // small calls still spread over 16 threads

using AdamFn = void (*)(const ca::AdamArgs&, size_t, size_t);
using AccumFn = double (*)(const ca::AccumArgs&, size_t, size_t);
using StreamFn = void (*)(const ca::StreamArgs&, size_t, size_t);

template <class Fn>
Fn pick(Fn scalar_fn, Fn avx2_fn, Fn avx512_fn) {
  switch (simd_level()) {
    case SimdLevel::kAvx512: return avx512_fn;
    case SimdLevel::kAvx2: return avx2_fn;
    default: return scalar_fn;
  }
}

// How many tasks a call over n elements is cut into (a function of n alone: see the Note).
size_t num_tasks(size_t n) {
  if (n < 2 * kMinPerTask) return 1;
  size_t by_size = (n + kTaskElems - 1) / kTaskElems;
  return std::max(by_size, std::min(kMinTasks, n / kMinPerTask));
}

// Runs f(task, begin, end) for every task of [0, n) (num_tasks(n) contiguous pieces) over the
// pool; returns the number of tasks.
template <class F>
size_t split(size_t n, const F& f) {
  size_t tasks = num_tasks(n);
  auto run = [&](size_t t) {
    size_t b, e;
    chunk_range(n, tasks, t, kAlignElems, &b, &e);
    if (b < e) f(t, b, e);
  };
  if (tasks == 1) {
    run(0);
    return 1;
  }
  compute_parallel_for(tasks, run);
  return tasks;
}

void check_dtype(const char* what, int code, bool allow_none) {
  if (code == ca::kF32 || code == ca::kBF16 || code == ca::kF16) return;
  if (allow_none && code == ca::kNone) return;
  throw std::invalid_argument(std::string(what) + " dtype code " + std::to_string(code) +
                              " is not supported; allowed: 0 (float32), 1 (bfloat16), 2 (float16)" +
                              (allow_none ? ", -1 (none)" : ""));
}

void check_ptr(const char* what, uintptr_t p, size_t n) {
  if (n > 0 && p == 0) throw std::invalid_argument(std::string(what) + " is a null pointer");
}

template <class T>
T* as_ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

// Several tensors with the same coefficients in one dispatch over the pool: the elements of all
// tensors form one index space [0, total), cut into one contiguous chunk per thread, each chunk
// walked tensor by tensor. One wake-up of the pool per call instead of one per tensor (a model's
// many small tensors made the per-tensor calls cost a third of the step).
void adam_step_multi(const std::vector<uintptr_t>& params, const std::vector<uintptr_t>& grads,
                     const std::vector<uintptr_t>& exp_avgs,
                     const std::vector<uintptr_t>& exp_avg_sqs, const std::vector<uintptr_t>& outs,
                     const std::vector<size_t>& ns, const std::vector<int>& grad_dtypes,
                     int out_dtype, float grad_scale, float decay, float l2, float w1, float beta2,
                     float c2, float bc2_sqrt, float eps, float neg_step) {
  const size_t k = params.size();
  if (grads.size() != k || exp_avgs.size() != k || exp_avg_sqs.size() != k || ns.size() != k ||
      grad_dtypes.size() != k || (out_dtype != ca::kNone && outs.size() != k))
    throw std::invalid_argument("adam_step_multi: argument lists differ in length");
  check_dtype("out", out_dtype, true);
  std::vector<ca::AdamArgs> args(k);
  std::vector<size_t> start(k + 1, 0);
  for (size_t i = 0; i < k; ++i) {
    check_dtype("grad", grad_dtypes[i], false);
    check_ptr("param", params[i], ns[i]);
    check_ptr("grad", grads[i], ns[i]);
    check_ptr("exp_avg", exp_avgs[i], ns[i]);
    check_ptr("exp_avg_sq", exp_avg_sqs[i], ns[i]);
    ca::AdamArgs& a = args[i];
    a.param = as_ptr<float>(params[i]);
    a.grad = as_ptr<const void>(grads[i]);
    a.exp_avg = as_ptr<float>(exp_avgs[i]);
    a.exp_avg_sq = as_ptr<float>(exp_avg_sqs[i]);
    if (out_dtype != ca::kNone) check_ptr("out", outs[i], ns[i]);
    a.out = out_dtype == ca::kNone ? nullptr : as_ptr<void>(outs[i]);
    a.grad_dtype = grad_dtypes[i];
    a.out_dtype = out_dtype;
    a.grad_scale = grad_scale;
    a.decay = decay;
    a.l2 = l2;
    a.w1 = w1;
    a.beta2 = beta2;
    a.c2 = c2;
    a.bc2_sqrt = bc2_sqrt;
    a.eps = eps;
    a.neg_step = neg_step;
    start[i + 1] = start[i] + ns[i];
  }
  AdamFn fn = pick<AdamFn>(ca::scalar::adam_range, ca::avx2::adam_range, ca::avx512::adam_range);
  without_gil([&] {
    split(start[k], [&](size_t, size_t b, size_t e) {
      // first tensor that ends after b
      size_t i =
          static_cast<size_t>(std::upper_bound(start.begin(), start.end(), b) - start.begin()) - 1;
      for (; i < k && start[i] < e; ++i) {
        size_t lo = std::max(b, start[i]) - start[i];
        size_t hi = std::min(e, start[i + 1]) - start[i];
        if (lo < hi) fn(args[i], lo, hi);
      }
    });
  });
}

void adam_step(uintptr_t param, uintptr_t grad, uintptr_t exp_avg, uintptr_t exp_avg_sq,
               size_t n, int grad_dtype, uintptr_t out, int out_dtype, float grad_scale,
               float decay, float l2, float w1, float beta2, float c2, float bc2_sqrt, float eps,
               float neg_step) {
  adam_step_multi({param}, {grad}, {exp_avg}, {exp_avg_sq}, {out}, {n}, {grad_dtype}, out_dtype,
                  grad_scale, decay, l2, w1, beta2, c2, bc2_sqrt, eps, neg_step);
}

py::tuple accumulate_grad(uintptr_t acc, uintptr_t grad, size_t n, int grad_dtype, float scale,
                          bool overwrite) {
  check_dtype("grad", grad_dtype, false);
  check_ptr("acc", acc, n);
  check_ptr("grad", grad, n);
  ca::AccumArgs a;
  a.acc = as_ptr<float>(acc);
  a.grad = as_ptr<const void>(grad);
  a.grad_dtype = grad_dtype;
  a.scale = scale;
  a.overwrite = overwrite;
  AccumFn fn = pick<AccumFn>(ca::scalar::accumulate_range, ca::avx2::accumulate_range,
                             ca::avx512::accumulate_range);
  double sumsq = without_gil([&] {
    double sum = 0.0;
    std::vector<double> partial(num_tasks(n), 0.0);
    split(n, [&](size_t task, size_t b, size_t e) { partial[task] = fn(a, b, e); });
    for (double x : partial) sum += x;  // in task order: the same for any thread count
    return sum;
  });
  // A square of a finite float is at most ~1.2e77, so the double sum of squares is finite
  // exactly when every element is finite: the inf/NaN check costs nothing extra.
  bool found_inf = !std::isfinite(sumsq);
  return py::make_tuple(found_inf, sumsq);
}

void stream_4r3w(uintptr_t a, uintptr_t b, uintptr_t c, uintptr_t d, size_t n, float k) {
  check_ptr("a", a, n);
  check_ptr("b", b, n);
  check_ptr("c", c, n);
  check_ptr("d", d, n);
  ca::StreamArgs s;
  s.a = as_ptr<float>(a);
  s.b = as_ptr<const float>(b);
  s.c = as_ptr<float>(c);
  s.d = as_ptr<float>(d);
  s.k = k;
  StreamFn fn =
      pick<StreamFn>(ca::scalar::stream_range, ca::avx2::stream_range, ca::avx512::stream_range);
  without_gil([&] { split(n, [&](size_t, size_t b0, size_t e0) { fn(s, b0, e0); }); });
}

}  // namespace

void register_cpu_adam(py::module_& m) {
  m.def("adam_step", &adam_step, py::arg("param"), py::arg("grad"), py::arg("exp_avg"),
        py::arg("exp_avg_sq"), py::arg("n"), py::arg("grad_dtype"), py::arg("out"),
        py::arg("out_dtype"), py::arg("grad_scale"), py::arg("decay"), py::arg("l2"),
        py::arg("w1"), py::arg("beta2"), py::arg("c2"), py::arg("bc2_sqrt"), py::arg("eps"),
        py::arg("neg_step"),
        "One Adam/AdamW step over n elements of flat fp32 param/exp_avg/exp_avg_sq (addresses), "
        "gradient of dtype code grad_dtype (0 fp32, 1 bf16, 2 fp16), optional copy-out of the "
        "updated params to `out` (out_dtype -1 = none). Coefficients are precomputed by the "
        "caller (offload.optim): decay = 1 - lr*wd (AdamW), l2 = wd (Adam), w1 = 1 - beta1, "
        "c2 = 1 - beta2, bc2_sqrt = sqrt(1 - beta2^t), neg_step = -lr / (1 - beta1^t).");
  m.def("adam_step_multi", &adam_step_multi, py::arg("params"), py::arg("grads"),
        py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("outs"), py::arg("ns"),
        py::arg("grad_dtypes"), py::arg("out_dtype"), py::arg("grad_scale"), py::arg("decay"),
        py::arg("l2"), py::arg("w1"), py::arg("beta2"), py::arg("c2"), py::arg("bc2_sqrt"),
        py::arg("eps"), py::arg("neg_step"),
        "adam_step over several tensors with the same coefficients, one pool dispatch.");
  m.def("accumulate_grad", &accumulate_grad, py::arg("acc"), py::arg("grad"), py::arg("n"),
        py::arg("grad_dtype"), py::arg("scale"), py::arg("overwrite"),
        "acc = (overwrite ? 0 : acc) + grad * scale over n fp32 elements in one pass; returns "
        "(found_inf_or_nan, sum of squares of the new acc, as a double).");
  m.def("stream_4r3w", &stream_4r3w, py::arg("a"), py::arg("b"), py::arg("c"), py::arg("d"),
        py::arg("n"), py::arg("k") = 0.5f,
        "Bandwidth reference with Adam's access pattern: reads a, b, c, d and writes a, c, d "
        "(n fp32 each) on the compute pool (a += b*k; c = c*k + b; d = d*k + b).");
}

}  // namespace offload
