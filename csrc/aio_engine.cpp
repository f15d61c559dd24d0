// Async file IO engine: see aio_engine.h for the design.
#include "aio_engine.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <linux/aio_abi.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <utility>

namespace offload {
namespace aio {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// ---- test-only fault injection ---------------------------------------------------------
std::mutex g_fault_mu;
int g_fault_op = 0, g_fault_err = 0, g_fault_count = 0;

// kind: 1 read, 2 write, 3 O_DIRECT open. Returns the errno to fail with, or 0.
int take_fault(int kind) {
  std::lock_guard<std::mutex> lk(g_fault_mu);
  if (g_fault_count <= 0 || g_fault_err == 0) return 0;
  if (!(g_fault_op == kind || (g_fault_op == 0 && kind != 3))) return 0;
  --g_fault_count;
  return g_fault_err;
}

// ---- Linux AIO through raw syscalls (no libaio dependency) ------------------------------
long sys_io_setup(unsigned nr, aio_context_t* ctx) { return syscall(SYS_io_setup, nr, ctx); }
long sys_io_destroy(aio_context_t ctx) { return syscall(SYS_io_destroy, ctx); }
long sys_io_submit(aio_context_t ctx, long n, struct iocb** cbs) {
  return syscall(SYS_io_submit, ctx, n, cbs);
}
long sys_io_getevents(aio_context_t ctx, long min_nr, long nr, struct io_event* ev) {
  return syscall(SYS_io_getevents, ctx, min_nr, nr, ev, nullptr);
}

// ---- kernel AIO contexts kept between engines (aio_engine.h) -----------------------------
struct IdleContexts {
  std::mutex mu;
  pid_t pid = ::getpid();
  std::vector<std::pair<aio_context_t, unsigned>> idle;  // (context, events it was set up for)
  uint64_t made = 0;  // contexts this process set up (contexts_made)
};

// Locked: the list is this process's. A forked child's starts empty (its parent's contexts
// are not its own): the fork handlers below empty it, and a child forked without them (a raw
// clone()) empties it at its first use.
void own_contexts(IdleContexts& c) {
  if (c.pid == ::getpid()) return;
  c.idle.clear();
  c.made = 0;
  c.pid = ::getpid();
}

IdleContexts& idle_contexts() {
  // leaked: an engine's threads may still return a context while the process exits
  static IdleContexts* c = [] {
    auto* fresh = new IdleContexts;
    // a fork while a thread holds the lock must not leave it held in the child
    ::pthread_atfork([] { idle_contexts().mu.lock(); }, [] { idle_contexts().mu.unlock(); },
                     [] {
                       IdleContexts& mine = idle_contexts();
                       own_contexts(mine);
                       mine.mu.unlock();
                     });
    return fresh;
  }();
  return *c;
}

// A context of at least `nr` events: the smallest idle one, or a new one; 0 when none can be had.
aio_context_t open_context(unsigned nr) {
  IdleContexts& c = idle_contexts();
  {
    std::lock_guard<std::mutex> lk(c.mu);
    own_contexts(c);
    auto best = c.idle.end();
    for (auto it = c.idle.begin(); it != c.idle.end(); ++it) {
      if (it->second >= nr && (best == c.idle.end() || it->second < best->second)) best = it;
    }
    if (best != c.idle.end()) {
      aio_context_t ctx = best->first;
      c.idle.erase(best);
      return ctx;
    }
  }
  aio_context_t ctx = 0;
  if (sys_io_setup(nr, &ctx) != 0) return 0;
  std::lock_guard<std::mutex> lk(c.mu);
  own_contexts(c);
  ++c.made;
  return ctx;
}

// `ctx` (set up for `nr` events, nothing in flight) is kept for the next engine; with the list
// full, the smallest of it and the idle ones is destroyed (a larger context serves more depths).
void close_context(aio_context_t ctx, unsigned nr) {
  IdleContexts& c = idle_contexts();
  {
    std::lock_guard<std::mutex> lk(c.mu);
    own_contexts(c);
    if (c.idle.size() < kIdleContexts) {
      c.idle.emplace_back(ctx, nr);
      return;
    }
    auto smallest = std::min_element(
        c.idle.begin(), c.idle.end(),
        [](const std::pair<aio_context_t, unsigned>& a,
           const std::pair<aio_context_t, unsigned>& b) { return a.second < b.second; });
    if (smallest->second < nr) {  // kept in its place; the smaller one goes
      std::swap(smallest->first, ctx);
      std::swap(smallest->second, nr);
    }
  }
  sys_io_destroy(ctx);
}

// Whether Linux AIO works here; a refusal is asked again by the next engine (it may be the
// system's fs.aio-max-nr, reached for now), a success is not. The probe's context is kept.
bool kernel_aio_available() {
  static std::atomic<bool> works{false};
  if (works.load()) return true;
  aio_context_t probe = open_context(1);
  if (probe == 0) return false;
  close_context(probe, 1);
  works.store(true);
  return true;
}

// "<why> (in the write of N bytes at file offset X)": Python puts the whole request first
std::string piece_error(const Request& r, size_t len, off_t foff, const char* why) {
  return std::string(why) + " (in the " + (r.is_write ? "write" : "read") + " of " +
         std::to_string(len) + " bytes at file offset " +
         std::to_string(static_cast<long long>(foff)) + ")";
}

}  // namespace

Bounce::~Bounce() { std::free(ptr_); }

char* Bounce::get() {
  if (ptr_ == nullptr) {
    void* p = nullptr;
    if (posix_memalign(&p, kAlign, bytes_) == 0) ptr_ = static_cast<char*>(p);
  }
  return ptr_;  // nullptr when out of memory: the caller fails the request with ENOMEM
}

uint64_t contexts_made() {
  IdleContexts& c = idle_contexts();
  std::lock_guard<std::mutex> lk(c.mu);
  own_contexts(c);
  return c.made;
}

void inject_fault(int op, int err, int count) {
  std::lock_guard<std::mutex> lk(g_fault_mu);
  g_fault_op = op;
  g_fault_err = err;
  g_fault_count = count;
}

// ---- Request ----------------------------------------------------------------------------
bool Request::wait(double timeout_s) {
  std::unique_lock<std::mutex> lk(mu);
  if (timeout_s < 0) {
    cv.wait(lk, [this] { return finished; });
    return true;
  }
  return cv.wait_for(lk, std::chrono::duration<double>(timeout_s), [this] { return finished; });
}

bool Request::done() {
  std::lock_guard<std::mutex> lk(mu);
  return finished;
}

std::string Request::message() {
  std::lock_guard<std::mutex> lk(mu);
  return msg;
}

void Request::fail(int e, const std::string& m) {
  std::lock_guard<std::mutex> lk(mu);
  if (err.load() == 0) {
    msg = m;
    err.store(e);
  }
}

int Request::buffered_fd() {
  std::lock_guard<std::mutex> lk(mu);
  if (fd_buffered < 0)
    fd_buffered = ::open(path.c_str(), (is_write ? O_WRONLY : O_RDONLY) | O_CLOEXEC);
  return fd_buffered;
}

// ---- Engine -----------------------------------------------------------------------------
Engine::Engine(size_t block_size, int queue_depth, int thread_count, bool direct_io)
    : block_size_(block_size < kAlign ? kAlign : block_size / kAlign * kAlign),
      queue_depth_(queue_depth < 1 ? 1 : queue_depth),
      direct_io_(direct_io),
      owner_pid_(::getpid()) {
  if (thread_count < 1) thread_count = 1;
  kernel_aio_ = kernel_aio_available();
  for (int i = 0; i < thread_count; ++i) {
    // queue_depth is shared out over the threads (each gets at least one slot)
    int depth = queue_depth_ / thread_count + (i < queue_depth_ % thread_count ? 1 : 0);
    if (depth < 1) depth = 1;
    threads_.emplace_back([this, depth] {
      if (kernel_aio_)
        worker(depth);
      else
        worker_sync();
    });
  }
}

Engine::~Engine() { close(); }

std::shared_ptr<Request> Engine::submit(bool is_write, const std::string& path, uintptr_t addr,
                                        size_t nbytes, off_t offset, bool urgent) {
  auto r = std::make_shared<Request>();
  r->is_write = is_write;
  r->urgent = urgent;
  r->path = path;
  r->buf = reinterpret_cast<char*>(addr);
  r->nbytes = nbytes;
  r->offset = offset;
  r->t0 = now_s();
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) throw std::runtime_error("AsyncIO engine is closed");
    ++outstanding_;
  }

  std::vector<Piece> pieces;
  auto plan = [&](bool direct) {
    pieces.clear();
    auto add = [&](size_t start, size_t len, Mode m) {
      for (size_t pos = start; pos < start + len; pos += block_size_) {
        size_t n = std::min(block_size_, start + len - pos);
        pieces.push_back(Piece{r, pos, offset + static_cast<off_t>(pos), n, m});
      }
    };
    size_t head = std::min((kAlign - static_cast<size_t>(offset) % kAlign) % kAlign, nbytes);
    size_t body = direct ? (nbytes - head) / kAlign * kAlign : 0;
    if (body == 0) {
      add(0, nbytes, Mode::kBuffered);
    } else {
      bool congruent = addr % kAlign == static_cast<uintptr_t>(offset) % kAlign;
      add(0, head, Mode::kBuffered);
      add(head, body, congruent ? Mode::kDirect : Mode::kBounce);
      add(head + body, nbytes - head - body, Mode::kBuffered);
    }
  };
  plan(direct_io_);

  int flags = (is_write ? (O_WRONLY | O_CREAT) : O_RDONLY) | O_CLOEXEC;
  bool need_direct = false, need_buffered = pieces.empty();
  for (auto& p : pieces) (p.mode != Mode::kBuffered ? need_direct : need_buffered) = true;
  if (need_direct) {
    int f = take_fault(3);
    r->fd_direct = f ? (errno = f, -1) : ::open(path.c_str(), flags | O_DIRECT, 0600);
    if (r->fd_direct < 0) {
      if (errno == EINVAL) {
        r->direct_refused = true;  // filesystem without O_DIRECT (ramfs, some network fs)
        need_buffered = true;
        plan(false);
      } else {
        r->fail(errno, std::string("cannot open the file: ") + std::strerror(errno));
      }
    }
  }
  if (!r->err.load() && need_buffered) {
    r->fd_buffered = ::open(path.c_str(), flags, 0600);
    if (r->fd_buffered < 0) r->fail(errno, std::string("cannot open the file: ") + std::strerror(errno));
  }
  if (r->err.load() || pieces.empty()) {
    complete(*r);
    return r;
  }
  r->remaining.store(pieces.size());
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto& q = urgent ? urgent_ : queue_;
    for (auto& p : pieces) q.push_back(std::move(p));
  }
  cv_work_.notify_all();
  return r;
}

bool Engine::pop(Piece* out, bool block) {
  std::unique_lock<std::mutex> lk(mu_);
  if (block) cv_work_.wait(lk, [this] { return stop_ || !urgent_.empty() || !queue_.empty(); });
  auto& q = urgent_.empty() ? queue_ : urgent_;
  if (q.empty()) return false;
  *out = std::move(q.front());
  q.pop_front();
  return true;
}

// Runs one piece with blocking syscalls; finishes short O_DIRECT transfers on the buffered fd.
void Engine::run_sync(Piece& p, Bounce* bounce) {
  Request& r = *p.req;
  if (r.err.load()) return;  // the request already failed: skip the rest
  bool direct = p.mode != Mode::kBuffered && !r.direct_refused;
  char* user = r.buf + p.boff;
  // staged pieces move through the bounce buffer while direct, the caller's memory otherwise
  char* stage = (direct && p.mode == Mode::kBounce) ? bounce->get() : nullptr;
  if (direct && p.mode == Mode::kBounce && stage == nullptr) {
    r.fail(ENOMEM, piece_error(r, p.len, p.foff, "no memory for the bounce buffer"));
    return;
  }
  if (stage != nullptr && r.is_write) std::memcpy(stage, user, p.len);
  int fd = direct ? r.fd_direct : r.buffered_fd();
  size_t done = 0;
  auto leave_direct = [&] {  // continue the rest of this piece buffered
    if (stage != nullptr && !r.is_write) std::memcpy(user, stage, done);
    stage = nullptr;
    fd = r.buffered_fd();
    direct = false;
  };
  while (done < p.len) {
    char* b = (stage != nullptr ? stage : user) + done;
    int f = take_fault(r.is_write ? 2 : 1);
    ssize_t n;
    if (f) {
      n = -1;
      errno = f;
    } else {
      n = r.is_write ? ::pwrite(fd, b, p.len - done, p.foff + done)
                     : ::pread(fd, b, p.len - done, p.foff + done);
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EINVAL && direct && !f) {  // O_DIRECT accepted at open, refused at IO
        leave_direct();
        continue;
      }
      r.fail(errno, piece_error(r, p.len, p.foff, std::strerror(errno)));
      return;
    }
    if (n == 0) {
      if (r.is_write)
        r.fail(EIO, piece_error(r, p.len, p.foff, "pwrite wrote 0 bytes"));
      else
        r.fail(ENODATA, piece_error(r, p.len, p.foff, "file ends before the requested range"));
      return;
    }
    done += static_cast<size_t>(n);
    // a short O_DIRECT transfer leaves an unaligned rest: finish it buffered
    if (direct && (n % static_cast<ssize_t>(kAlign)) && done < p.len) leave_direct();
  }
  if (stage != nullptr && !r.is_write) std::memcpy(user, stage, p.len);
  if (r.direct_refused) ::posix_fadvise(fd, p.foff, p.len, POSIX_FADV_DONTNEED);
}

void Engine::worker_sync() {
  Bounce bounce(block_size_);
  Piece p;
  while (pop(&p, true)) {
    run_sync(p, &bounce);
    piece_done(p);
  }
}

void Engine::worker(int depth) {
  const unsigned nr = static_cast<unsigned>(depth);
  aio_context_t ctx = open_context(nr);
  if (ctx == 0) {
    worker_sync();
    return;
  }
  std::vector<struct iocb> cbs(depth);
  std::vector<Piece> slots(depth);
  std::vector<std::unique_ptr<Bounce>> bounces;  // one per slot, for staged pieces
  for (int i = 0; i < depth; ++i) bounces.emplace_back(new Bounce(block_size_));
  std::vector<int> free_slots;
  for (int i = depth - 1; i >= 0; --i) free_slots.push_back(i);
  std::vector<struct iocb*> batch;
  std::vector<int> batch_slots;
  std::vector<struct io_event> events(depth);
  int inflight = 0;

  for (;;) {
    // 1. take pieces until every slot is busy (blocking only when nothing is in flight)
    batch.clear();
    batch_slots.clear();
    bool stop_now = false;
    while (!free_slots.empty()) {
      Piece p;
      if (!pop(&p, inflight == 0 && batch.empty())) {
        std::lock_guard<std::mutex> lk(mu_);
        stop_now = stop_ && urgent_.empty() && queue_.empty() && inflight == 0 && batch.empty();
        break;
      }
      Request& r = *p.req;
      if (r.err.load() || p.mode == Mode::kBuffered || r.direct_refused) {
        run_sync(p, bounces[0].get());  // buffered pieces; skips pieces of failed requests
        piece_done(p);
        continue;
      }
      int f = take_fault(r.is_write ? 2 : 1);
      if (f) {
        r.fail(f, piece_error(r, p.len, p.foff, std::strerror(f)));
        piece_done(p);
        continue;
      }
      int s = free_slots.back();
      free_slots.pop_back();
      struct iocb& cb = cbs[s];
      std::memset(&cb, 0, sizeof(cb));
      cb.aio_fildes = static_cast<uint32_t>(r.fd_direct);
      cb.aio_lio_opcode = r.is_write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
      char* mem = r.buf + p.boff;
      if (p.mode == Mode::kBounce) {
        mem = bounces[s]->get();
        if (mem == nullptr) {
          r.fail(ENOMEM, piece_error(r, p.len, p.foff, "no memory for the bounce buffer"));
          piece_done(p);
          free_slots.push_back(s);
          continue;
        }
        if (r.is_write) std::memcpy(mem, r.buf + p.boff, p.len);
      }
      cb.aio_buf = reinterpret_cast<uint64_t>(mem);
      cb.aio_nbytes = p.len;
      cb.aio_offset = p.foff;
      cb.aio_data = static_cast<uint64_t>(s);
      slots[s] = std::move(p);
      batch.push_back(&cb);
      batch_slots.push_back(s);
    }
    if (stop_now) break;

    // 2. submit; anything the kernel does not take runs synchronously
    size_t submitted = 0;
    while (submitted < batch.size()) {
      long n = sys_io_submit(ctx, static_cast<long>(batch.size() - submitted),
                             batch.data() + submitted);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      submitted += static_cast<size_t>(n);
    }
    inflight += static_cast<int>(submitted);
    for (size_t i = submitted; i < batch.size(); ++i) {
      int s = batch_slots[i];
      run_sync(slots[s], bounces[s].get());
      piece_done(slots[s]);
      slots[s] = Piece{};
      free_slots.push_back(s);
    }

    // 3. reap at least one completion when anything is in flight
    if (inflight == 0) continue;
    long got = sys_io_getevents(ctx, 1, depth, events.data());
    if (got < 0) {
      if (errno == EINTR) continue;
      got = 0;  // cannot happen with a valid context; keep the loop alive
    }
    for (long i = 0; i < got; ++i) {
      int s = static_cast<int>(events[i].data);
      Piece& p = slots[s];
      Request& r = *p.req;
      long long res = static_cast<long long>(events[i].res);
      bool staged = p.mode == Mode::kBounce;
      if (res < 0) {
        if (res == -EINVAL) {
          p.mode = Mode::kBuffered;  // refused at IO time: redo this piece buffered
          run_sync(p, nullptr);
        } else {
          int e = static_cast<int>(-res);
          r.fail(e, piece_error(r, p.len, p.foff, std::strerror(e)));
        }
      } else {
        size_t got_bytes = static_cast<size_t>(res);
        if (staged && !r.is_write) std::memcpy(r.buf + p.boff, bounces[s]->get(), got_bytes);
        if (got_bytes < p.len) {
          Piece rest{p.req, p.boff + got_bytes, p.foff + static_cast<off_t>(got_bytes),
                     p.len - got_bytes, Mode::kBuffered};
          run_sync(rest, nullptr);  // short transfer (end of file): finish or report it
        }
      }
      piece_done(p);
      p = Piece{};
      free_slots.push_back(s);
      --inflight;
    }
  }
  close_context(ctx, nr);  // nothing in flight: the loop ends only then
}

void Engine::piece_done(Piece& p) {
  if (p.req->remaining.fetch_sub(1) == 1) complete(*p.req);
}

void Engine::complete(Request& r) {
  for (int* fd : {&r.fd_direct, &r.fd_buffered}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
  // order: counters first (a waiter reads them right after), then the request's own flag,
  // then outstanding_ (close() returns only after every handle reports done)
  double dt = now_s() - r.t0;
  std::unique_lock<std::mutex> lk(mu_);
  if (!r.err.load()) {
    if (r.is_write) {
      stats_.bytes_written += r.nbytes;
      stats_.writes += 1;
      stats_.write_seconds += dt;
    } else {
      stats_.bytes_read += r.nbytes;
      stats_.reads += 1;
      stats_.read_seconds += dt;
    }
  }
  lk.unlock();
  {
    std::lock_guard<std::mutex> rl(r.mu);
    r.finished = true;
  }
  r.cv.notify_all();
  lk.lock();
  if (--outstanding_ == 0) cv_idle_.notify_all();
}

Stats Engine::stats() {
  std::lock_guard<std::mutex> lk(mu_);
  return stats_;
}

void Engine::close() {
  if (::getpid() != owner_pid_) {  // a forked child: see the header. mu_ may have been held
    closed_ = stop_ = true;         // by a parent thread at fork time, so it is not taken.
    new std::vector<std::thread>(std::move(threads_));  // deliberately leaked
    return;
  }
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (closed_) return;
    cv_idle_.wait(lk, [this] { return outstanding_ == 0; });
    closed_ = true;
    stop_ = true;
  }
  cv_work_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
}

}  // namespace aio
}  // namespace offload
