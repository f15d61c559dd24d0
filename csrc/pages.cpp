// Moving anonymous pages to another address, for offload/device/pages.py's recycled and lent
// pages (its Notes): a released unit's resident huge pages are moved aside and later moved under
// the next unit's storage, so the next gather writes into pages that are already there instead of
// faulting fresh zeroed ones in; and a swap buffer's pages holding a piece just read are moved
// under the unit's storage instead of being copied there. Python's mmap module cannot move
// pages to a chosen address, and mremap is variadic (a ctypes call of it is not portable),
// hence this one function.
#include <pybind11/pybind11.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace py = pybind11;

namespace offload {

namespace {

[[noreturn]] void raise_errno(int err, const std::string& what) {
  PyErr_SetObject(PyExc_OSError,
                  py::make_tuple(err, what + ": " + std::strerror(err)).ptr());
  throw py::error_already_set();
}

#ifdef __linux__
// Fresh anonymous read-write memory at [at, at + nbytes), asked for as huge pages.
bool map_fresh(void* at, size_t nbytes) {
  if (::mmap(at, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) ==
      MAP_FAILED)
    return false;
#ifdef MADV_HUGEPAGE
  ::madvise(at, nbytes, MADV_HUGEPAGE);  // advice only: where THP is off it does nothing
#endif
  return true;
}
#endif

// Moves the pages of [src, src + nbytes) to [dst, dst + nbytes) (whatever was mapped there is
// replaced), then maps fresh anonymous read-write memory at src (it reads as zeros, holds no
// pages until written; asked for as huge pages). Both ranges must lie in mappings of their
// own kind: anonymous, private, page aligned. Tensors point into src when src_is_viewed and
// into dst when dst_is_viewed (both, for pages lent from a swap buffer to a unit's storage);
// whatever fails, a viewed range stays mapped: a refused mremap may already have unmapped dst
// (fresh memory is mapped there again when it is viewed, or when src is not), and when the new
// mapping at src is refused the pages are moved back to a viewed src (and a viewed dst gets
// fresh memory again). A range nobody views may be left unmapped: the caller never uses it
// again.
//
// `where` (a list, or None): once the pages are at dst, where[0] = dst, before this returns.
// Python raises a KeyboardInterrupt that arrived during the call as soon as it returns, before
// the caller's next statement; a record the caller keeps in Python after the call can then miss
// a move that happened, and a record kept before it can claim one that did not. Written here,
// the record and the move cannot be told apart by an interrupt (offload/device/pages.py,
// Note on lent pages).
void move_pages(uintptr_t src, uintptr_t dst, size_t nbytes, bool src_is_viewed,
                bool dst_is_viewed, const py::object& where) {
#ifdef __linux__
  void* s = reinterpret_cast<void*>(src);
  void* d = reinterpret_cast<void*>(dst);
  if (::mremap(s, nbytes, nbytes, MREMAP_MAYMOVE | MREMAP_FIXED, d) == MAP_FAILED) {
    int err = errno;
    if (!src_is_viewed || dst_is_viewed) map_fresh(d, nbytes);
    raise_errno(err, "move_pages: mremap of " + std::to_string(nbytes) + " bytes");
  }
  if (!map_fresh(s, nbytes)) {
    int err = errno;
    if (src_is_viewed &&
        ::mremap(d, nbytes, nbytes, MREMAP_MAYMOVE | MREMAP_FIXED, s) != MAP_FAILED &&
        dst_is_viewed)
      map_fresh(d, nbytes);
    raise_errno(err, "move_pages: mapping the source range again");
  }
  if (!where.is_none()) where[py::int_(0)] = py::int_(dst);
#else
  (void)src;
  (void)dst;
  (void)nbytes;
  (void)src_is_viewed;
  (void)dst_is_viewed;
  (void)where;
  raise_errno(ENOSYS, "move_pages: Linux only");
#endif
}

}  // namespace

void register_pages(py::module_& m) {
  m.def("move_pages", &move_pages, py::arg("src"), py::arg("dst"), py::arg("nbytes"),
        py::arg("src_is_viewed"), py::arg("dst_is_viewed") = false, py::arg("where") = py::none(),
        "Move the anonymous pages at src to dst (nbytes, page aligned; dst's old mapping is "
        "replaced) and map fresh zero memory at src (Linux mremap); then where[0] = dst when "
        "where is a list. See csrc/pages.cpp for what a failure leaves.");
}

}  // namespace offload
