#include "thread_pool.h"

#include <memory>
#include <stdexcept>

namespace offload {

ThreadPool::ThreadPool(int num_threads) : num_threads_(num_threads < 1 ? 1 : num_threads) {
  for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_start_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_tasks() {
  for (;;) {
    size_t task;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (next_task_ >= num_tasks_) return;
      task = next_task_++;
    }
    try {
      (*job_)(task);
    } catch (...) {
      std::lock_guard<std::mutex> lk(mu_);
      if (!error_) error_ = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (++tasks_done_ == num_tasks_) cv_done_.notify_all();
    }
  }
}

void ThreadPool::worker_loop() {
  unsigned long seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_start_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    run_tasks();
  }
}

void ThreadPool::parallel_for(size_t num_tasks, const std::function<void(size_t)>& fn) {
  if (num_tasks == 0) return;
  if (num_tasks == 1 || workers_.empty()) {
    for (size_t i = 0; i < num_tasks; ++i) fn(i);
    return;
  }
  std::lock_guard<std::mutex> run_lk(run_mu_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    job_ = &fn;
    num_tasks_ = num_tasks;
    next_task_ = 0;
    tasks_done_ = 0;
    error_ = nullptr;
    ++generation_;
  }
  cv_start_.notify_all();
  run_tasks();
  std::exception_ptr err;
  {
    std::unique_lock<std::mutex> lk(mu_);
    cv_done_.wait(lk, [&] { return tasks_done_ == num_tasks_; });
    job_ = nullptr;
    err = error_;
  }
  if (err) std::rethrow_exception(err);
}

namespace {
std::mutex g_pool_mu;
std::unique_ptr<ThreadPool> g_pool;
int g_threads = 0;

int default_threads() {
  unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}
}  // namespace

ThreadPool& compute_pool() {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  if (!g_pool) {
    g_threads = g_threads > 0 ? g_threads : default_threads();
    g_pool = std::make_unique<ThreadPool>(g_threads);
  }
  return *g_pool;
}

void set_num_threads(int n) {
  if (n < 1) throw std::invalid_argument("num_threads must be >= 1, got " + std::to_string(n));
  std::lock_guard<std::mutex> lk(g_pool_mu);
  if (g_pool && g_threads == n) return;
  g_pool.reset();
  g_threads = n;
  g_pool = std::make_unique<ThreadPool>(n);
}

int get_num_threads() {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  return g_threads > 0 ? g_threads : default_threads();
}

}  // namespace offload
