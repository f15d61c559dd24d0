// Async file IO engine behind offload.io.AsyncIO (bindings in aio.cpp; no Python here).
//
// A request (path, buffer, bytes, file offset) is split into pieces: the part of the file range
// that is 4096-aligned (the body) goes through an O_DIRECT descriptor in block_size pieces, the
// unaligned head/tail through a buffered one. When the buffer address is congruent with the
// file offset modulo 4096 the body moves straight from/to the caller's memory; otherwise each
// body piece is staged through an aligned bounce buffer (one memcpy, far cheaper than the disk). The engine owns thread_count IO threads (not the
// compute pool: IO threads sleep in the kernel and must not steal compute slots). Each thread
// keeps up to its share of queue_depth O_DIRECT pieces in flight with Linux AIO
// (io_setup/io_submit/io_getevents, raw syscalls, no libaio needed); where Linux AIO is not
// available it falls back to blocking pread/pwrite. Buffered pieces always use pread/pwrite.
//
// Lifetime: close() (and the destructor) waits for every submitted request, then stops and joins
// the IO threads; Python closes every engine still open at exit (offload/io/lifecycle.py). In a
// process forked from the one that made the engine its threads do not exist, so there close()
// only marks it closed and leaves the thread handles alone (never joined, never destroyed: a
// joinable std::thread destroyed calls std::terminate).
//
// Kernel AIO contexts are kept, not destroyed: io_destroy waits for an RCU grace period (measured
// 2026-12-06: AsyncIO() took 34 ms, its probe's io_setup + io_destroy, and close() 38 ms, the
// threads' io_destroy, on an engine that moved nothing). A thread's context goes to a small
// process-wide list when its engine closes and the next engine's thread takes it (one of at
// least its depth), so opening and closing an engine costs thread starts and joins. The list
// holds at most kIdleContexts, the largest (each holds its events against the system's
// fs.aio-max-nr, as it did while its engine was open); the kernel frees them at exit. A forked child starts with an
// empty list: its parent's contexts are not its own (an mm's contexts are not inherited).
//
// Errors are recorded on the request (errno + message, the path is on the request) and raised
// by Python when the handle is waited on. If open(O_DIRECT) is refused with EINVAL the request
// is served buffered, each piece followed by posix_fadvise(DONTNEED), and direct_refused is set
// so Python can say so once.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace offload {
namespace aio {

constexpr size_t kAlign = 4096;
constexpr size_t kIdleContexts = 4;  // kernel AIO contexts kept for the next engine (above)

class Engine;

struct Request {
  bool is_write = false;
  bool urgent = false;  // queued ahead of every request that is not (see Engine::submit)
  std::string path;
  char* buf = nullptr;
  size_t nbytes = 0;
  off_t offset = 0;
  int fd_direct = -1;
  int fd_buffered = -1;
  bool direct_refused = false;
  double t0 = 0;
  std::atomic<size_t> remaining{0};
  std::atomic<int> err{0};
  std::string msg;  // guarded by mu
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;  // guarded by mu

  // Waits up to timeout_s seconds (< 0: forever); true when the request has completed.
  bool wait(double timeout_s);
  bool done();
  int error() const { return err.load(); }
  std::string message();
  void fail(int e, const std::string& m);
  int buffered_fd();  // opens the buffered descriptor on demand
};

// How a piece moves: buffered descriptor; O_DIRECT straight from/to the caller's buffer; or
// O_DIRECT through an aligned bounce buffer (file side aligned, buffer address not).
enum class Mode : int { kBuffered = 0, kDirect = 1, kBounce = 2 };

struct Piece {
  std::shared_ptr<Request> req;
  size_t boff = 0;  // offset in the buffer (bytes)
  off_t foff = 0;   // offset in the file (bytes)
  size_t len = 0;   // bytes
  Mode mode = Mode::kBuffered;
};

// A block_size, 4096-aligned scratch buffer owned by one IO thread (or one AIO slot).
class Bounce {
 public:
  explicit Bounce(size_t bytes) : bytes_(bytes) {}
  ~Bounce();
  Bounce(const Bounce&) = delete;
  Bounce& operator=(const Bounce&) = delete;
  char* get();  // allocated on first use

 private:
  size_t bytes_;
  char* ptr_ = nullptr;
};

struct Stats {
  uint64_t bytes_read = 0, bytes_written = 0, reads = 0, writes = 0;
  double read_seconds = 0, write_seconds = 0;
};

class Engine {
 public:
  Engine(size_t block_size, int queue_depth, int thread_count, bool direct_io);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Never throws for IO errors: a failed open is recorded on the returned request. An urgent
  // request's pieces go ahead of every queued piece of a request that is not (first in, first
  // out within each class); pieces already handed to the kernel are not overtaken.
  std::shared_ptr<Request> submit(bool is_write, const std::string& path, uintptr_t addr,
                                  size_t nbytes, off_t offset, bool urgent = false);
  Stats stats();
  void close();  // waits for every submitted request, then joins the threads
  bool uses_kernel_aio() const { return kernel_aio_; }

 private:
  friend struct Request;
  void worker(int depth);
  void worker_sync();
  void run_sync(Piece& p, Bounce* bounce);
  void piece_done(Piece& p);
  void complete(Request& r);
  bool pop(Piece* out, bool block);

  size_t block_size_;
  int queue_depth_;
  bool direct_io_;
  bool kernel_aio_ = false;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_work_, cv_idle_;
  std::deque<Piece> urgent_, queue_;  // pieces not yet taken by a thread, by class
  size_t outstanding_ = 0;
  bool stop_ = false;
  bool closed_ = false;
  pid_t owner_pid_;  // the process whose threads threads_ holds
  Stats stats_;
};

// Kernel AIO contexts this process set up (io_setup) so far, its probe's included; a forked
// child counts its own from 0 (the Note on kept contexts above).
uint64_t contexts_made();

// Test-only fault injection: the next `count` syscalls of kind `op` (0 any read/write, 1 read,
// 2 write, 3 open with O_DIRECT) fail with errno `err`.
void inject_fault(int op, int err, int count);

}  // namespace aio
}  // namespace offload
