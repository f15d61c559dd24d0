#include "thread_pool.h"

#include <pthread.h>

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
// Never destroyed (see the Note in thread_pool.h): heap objects, so static destruction at
// process exit leaves them alone.
std::mutex* g_mu = new std::mutex;
auto* g_slot = new std::shared_ptr<ThreadPool>;
int g_threads = 0;

std::mutex& pool_mu() { return *g_mu; }
std::shared_ptr<ThreadPool>& pool_slot() { return *g_slot; }

// In a forked child the pool's workers do not exist and g_mu may be held by a parent thread:
// forget both (leaked, never joined); the child's first kernel call makes a new pool.
void forget_pool_in_child() {
  g_mu = new std::mutex;
  g_slot = new std::shared_ptr<ThreadPool>;
}
[[maybe_unused]] const int g_atfork = pthread_atfork(nullptr, nullptr, forget_pool_in_child);

int default_threads() {
  unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}
}  // namespace

std::shared_ptr<ThreadPool> compute_pool() {
  std::lock_guard<std::mutex> lk(pool_mu());
  std::shared_ptr<ThreadPool>& slot = pool_slot();
  if (!slot) {
    g_threads = g_threads > 0 ? g_threads : default_threads();
    slot = std::make_shared<ThreadPool>(g_threads);
  }
  return slot;
}

void set_num_threads(int n) {
  if (n < 1) throw std::invalid_argument("num_threads must be >= 1, got " + std::to_string(n));
  std::shared_ptr<ThreadPool> old;  // released outside the lock: its destructor joins threads
  {
    std::lock_guard<std::mutex> lk(pool_mu());
    std::shared_ptr<ThreadPool>& slot = pool_slot();
    if (slot && g_threads == n) return;
    old = std::move(slot);
    g_threads = n;
    slot = std::make_shared<ThreadPool>(n);
  }
}

int get_num_threads() {
  std::lock_guard<std::mutex> lk(pool_mu());
  return g_threads > 0 ? g_threads : default_threads();
}

void shutdown_compute_pool() {
  std::shared_ptr<ThreadPool> old;
  {
    std::lock_guard<std::mutex> lk(pool_mu());
    old = std::move(pool_slot());
  }
  // joined here, or by the parallel_for still holding it when that call returns
}

}  // namespace offload
