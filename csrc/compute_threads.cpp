#include "compute_threads.h"

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>

#include <atomic>
#include <cstring>
#include <exception>
#include <mutex>
#include <stdexcept>

#include "thread_pool.h"

namespace offload {
namespace {

// void GOMP_parallel(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags)
using GompParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);

struct Gomp {
  GompParallel parallel = nullptr;
  std::string path;
};

// The loaded libgomp, if any: "libgomp.so.1" or a wheel's renamed "libgomp-<hash>.so.1".
// RTLD_NOLOAD: a handle to the copy already in the process, never a new load.
int find_loaded_gomp(struct dl_phdr_info* info, size_t, void* out) {
  const char* name = info->dlpi_name;
  if (name == nullptr || *name == '\0') return 0;
  const char* slash = std::strrchr(name, '/');
  const char* base = slash ? slash + 1 : name;
  if (std::strncmp(base, "libgomp", 7) != 0) return 0;
  void* handle = ::dlopen(name, RTLD_NOW | RTLD_NOLOAD);
  if (handle == nullptr) return 0;
  auto fn = reinterpret_cast<GompParallel>(::dlsym(handle, "GOMP_parallel"));
  if (fn == nullptr) return 0;  // a libgomp older than GCC 4.9: keep looking, else the pool
  auto* gomp = static_cast<Gomp*>(out);
  gomp->parallel = fn;
  gomp->path = name;
  return 1;
}

// Heap objects, never destroyed (as thread_pool.cpp's: a daemon thread may call in at exit).
std::mutex* g_mu = new std::mutex;
bool g_pool_only = false;  // set_compute_backend("pool")
bool g_forked = false;     // this is a forked child: the pool, always (see the header's Note)
thread_local bool t_pool_only = false;  // use_pool_in_this_thread()
Gomp* g_gomp = new Gomp;  // set once, when found
bool g_searched_for_kernel = false;  // a kernel call looked and found none: the pool for good

// In a forked child g_mu may be held by a parent thread: a new one (the old one leaked).
void forget_team_in_child() {
  g_mu = new std::mutex;
  g_forked = true;
}
[[maybe_unused]] const int g_atfork = pthread_atfork(nullptr, nullptr, forget_team_in_child);

// The libgomp to run on, or nullptr for the pool. Found once and kept (a loaded library stays
// loaded). A kernel call has torch loaded (its arguments are tensors' pointers), so when one
// finds none, none is looked for again: a torch on another OpenMP would otherwise walk every
// loaded object on every call. A query (kernel false) before `import torch` finds none
// and decides nothing.
const Gomp* gomp_for_this_call(bool kernel) {
  std::lock_guard<std::mutex> lk(*g_mu);
  if (g_pool_only || g_forked || t_pool_only) return nullptr;
  if (g_gomp->parallel == nullptr && !g_searched_for_kernel) {
    ::dl_iterate_phdr(find_loaded_gomp, g_gomp);
    g_searched_for_kernel = kernel;
  }
  return g_gomp->parallel ? g_gomp : nullptr;
}

struct TeamJob {
  const std::function<void(size_t)>* fn;
  size_t num_tasks;
  std::atomic<size_t> next{0};
  std::mutex mu;
  std::exception_ptr error;
};

// Every thread of the team runs this (exceptions must not cross libgomp's C frames).
void run_team_tasks(void* arg) {
  auto* job = static_cast<TeamJob*>(arg);
  for (size_t t; (t = job->next.fetch_add(1)) < job->num_tasks;) {
    try {
      (*job->fn)(t);
    } catch (...) {
      std::lock_guard<std::mutex> lk(job->mu);
      if (!job->error) job->error = std::current_exception();
      job->next.store(job->num_tasks);  // the tasks not started are skipped
    }
  }
}

}  // namespace

void compute_parallel_for(size_t num_tasks, const std::function<void(size_t)>& fn) {
  if (num_tasks == 0) return;
  int threads = get_num_threads();
  if (num_tasks == 1 || threads == 1) {
    for (size_t i = 0; i < num_tasks; ++i) fn(i);
    return;
  }
  if (const Gomp* gomp = gomp_for_this_call(/*kernel=*/true)) {
    TeamJob job;
    job.fn = &fn;
    job.num_tasks = num_tasks;
    gomp->parallel(run_team_tasks, &job, static_cast<unsigned>(threads), 0);
    if (job.error) std::rethrow_exception(job.error);
    return;
  }
  std::shared_ptr<ThreadPool> pool = compute_pool();  // kept alive across a set_num_threads
  pool->parallel_for(num_tasks, fn);
}

void set_compute_backend(const std::string& name) {
  if (name != "auto" && name != "pool" && name != "openmp") {
    throw std::invalid_argument("compute backend '" + name +
                                "' is not known; allowed: 'auto', 'openmp', 'pool'");
  }
  {
    std::lock_guard<std::mutex> lk(*g_mu);
    g_pool_only = name == "pool";
  }
  if (name == "openmp" && gomp_for_this_call(/*kernel=*/false) == nullptr) {
    throw std::invalid_argument(
        "compute backend 'openmp' needs GNU OpenMP (libgomp) loaded in this process, as torch "
        "built on it loads it (and not in a forked child); none is: use 'auto' or 'pool'");
  }
}

void use_pool_in_this_thread() { t_pool_only = true; }

std::string compute_backend() { return gomp_for_this_call(/*kernel=*/false) ? "openmp" : "pool"; }

std::string compute_backend_library() {
  const Gomp* gomp = gomp_for_this_call(/*kernel=*/false);
  return gomp ? gomp->path : std::string();
}

}  // namespace offload
