// Which threads run a kernel's tasks: torch's OpenMP team when torch runs on GNU OpenMP
// (libgomp, already in the process), offload's own ThreadPool otherwise.
//
// Note (why torch's team): in training the optimizer step starts the moment backward returns,
// while torch's OpenMP workers still spin on their cores after backward's last parallel region
// (libgomp's default wait policy). A pool of our own then wakes a worker onto a core a spinner
// holds, and the call waits for it; a region on torch's team hands the tasks to those spinning
// workers instead. Measured, engine's step right after backward (bench_adam_phase, 30 reps, per
// rep the pool's time minus the team's): +3.3 and +2.8 ms (team faster in 21 and 25 of 30)
// where two rows both on the pool differ by +1.2 and -0.5 ms; after an idle gap the two are
// level (benchmarks/README.md has the five-run table). DeepSpeedCPUAdam gets the same
// by compiling with -fopenmp. We do not: a -fopenmp build makes libgomp a load-time dependency,
// which loads a second OpenMP runtime beside a torch built on LLVM or Intel OpenMP (conda) or
// on a libgomp whose soname the wheel renamed (libgomp-<hash>.so.1) - the oversubscription and
// crashes ../DESIGN.md rules out. So the team is joined only if a libgomp is loaded already
// (torch loads its own at import), found among the process's loaded objects and called through
// GOMP_parallel, the entry point every -fopenmp binary since GCC 4.9 calls for
// `#pragma omp parallel` (libgomp's stable GOMP_4.0 ABI). No libgomp loaded: the pool.
//
// Only the training thread joins it. libgomp gives every thread that starts a region a team of
// its own, whose workers spin after each region as torch's do; offload's update worker (the
// "offload-step" thread, which runs beside the training thread's backward) on a team of its own
// made the step in backward 11% slower (benchmarks/ab_roots.py, five pairs: 1.235 -> 1.374 s a
// step; the update after the backward and the recipes level), its spinners taking the cores the
// backward's compute needs. So that thread calls use_pool_in_this_thread() and keeps to the
// pool's workers, which sleep when idle.
//
// libgomp's teams are not fork-safe (a forked child that starts a region after its parent
// used the team waits forever for threads that do not exist; torch's own ops do the same), so a
// forked child always uses the pool (thread_pool.cpp forgets the parent's pool at fork).
//
// Results do not depend on the backend: callers cut their work by size alone and combine
// per-task partials in task order (cpu_adam.cpp, Note on threading).
#pragma once

#include <cstddef>
#include <functional>
#include <string>

namespace offload {

// Runs fn(task) for task in [0, num_tasks) on the compute threads (the caller's included), each
// thread taking the next task from a shared counter; returns when all have run. The first
// exception thrown by a task is rethrown here (the tasks not yet started are skipped).
void compute_parallel_for(size_t num_tasks, const std::function<void(size_t)>& fn);

// "openmp" (torch's libgomp team), "pool" (offload's ThreadPool) or "auto" (the default: openmp
// when a libgomp is loaded and this is not a forked child). Throws std::invalid_argument for
// another name, or for "openmp" when no libgomp is loaded.
void set_compute_backend(const std::string& name);

// The calling thread's kernels run on the pool from now on, whatever the process's setting (a
// background thread that runs beside the training thread's compute: see the Note).
void use_pool_in_this_thread();

// The backend the calling thread's next call uses ("openmp" or "pool") and, for openmp, the
// library's path.
std::string compute_backend();
std::string compute_backend_library();

}  // namespace offload
