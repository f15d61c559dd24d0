// A small fixed-size thread pool for data-parallel kernels (CPU Adam, gradient accumulation),
// used when torch's OpenMP team cannot be (compute_threads.h says when and why).
//
// Not compiled with OpenMP on purpose: that would load a second OpenMP runtime next to a torch
// built on another one, which oversubscribes the cores and can crash. The caller's thread takes
// part in every parallel_for, so a pool of N threads uses N-1 workers plus the caller. The
// thread count (used by both backends) comes from Python (config), never from the machine.
//
// Note (lifetime of the process-wide pool): callers hold the pool through a shared_ptr for the
// length of a call, so set_num_threads() or shutdown_compute_pool() never frees a pool that a
// parallel_for on another thread is still using; the last holder joins its workers. The slot
// that holds the current pool is never destroyed: at static-destruction time (after Python has
// finalized) a daemon thread may still be inside parallel_for, and a std::thread destroyed while
// joinable calls std::terminate. The bindings register shutdown_compute_pool() with Python's
// atexit, so the workers are stopped and joined before the interpreter tears down.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace offload {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Runs fn(task) for task in [0, num_tasks), spread over the pool and the calling thread: each
  // thread takes the next task from a shared counter when it finishes one, so a thread that has
  // lost its core for a while simply takes fewer. Returns when all have finished; the first
  // exception thrown by a task is rethrown here.
  void parallel_for(size_t num_tasks, const std::function<void(size_t)>& fn);

 private:
  void worker_loop();
  void run_tasks();

  int num_threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_start_;
  std::condition_variable cv_done_;
  std::mutex run_mu_;  // serialises parallel_for callers
  const std::function<void(size_t)>* job_ = nullptr;
  size_t num_tasks_ = 0;
  size_t next_task_ = 0;
  size_t tasks_done_ = 0;
  unsigned long generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

// The process-wide compute pool used by the kernels (made on first use); resized by
// set_num_threads(). Hold the returned pointer for the whole call (see the Note).
std::shared_ptr<ThreadPool> compute_pool();
void set_num_threads(int n);
int get_num_threads();
// Stops and joins the pool's workers once no call uses it (at interpreter exit); a later
// compute_pool() makes a new one.
void shutdown_compute_pool();

// Splits [0, n) into `parts` contiguous chunks whose boundaries are multiples of `align`
// elements (so SIMD bodies stay aligned to each other); returns the chunk [begin, end).
inline void chunk_range(size_t n, size_t parts, size_t part, size_t align, size_t* begin,
                        size_t* end) {
  size_t blocks = (n + align - 1) / align;
  size_t per = blocks / parts, extra = blocks % parts;
  size_t b = part * per + (part < extra ? part : extra);
  size_t e = b + per + (part < extra ? 1 : 0);
  *begin = b * align < n ? b * align : n;
  *end = e * align < n ? e * align : n;
}

}  // namespace offload
