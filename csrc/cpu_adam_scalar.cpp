// CPU Adam kernels, portable scalar level (W = 1): the reference every SIMD level must match
// bit for bit. std::fma is a correctly rounded fused multiply-add on every platform.
#include <cmath>

#include "cpu_adam.h"

namespace offload {
namespace cpu_adam {
namespace scalar {
namespace {

struct V {
  using reg = float;
  using dacc = double;
  static constexpr size_t W = 1;
  static inline reg load(const float* p) { return *p; }
  static inline void store(float* p, reg x) { *p = x; }
  static inline reg set1(float x) { return x; }
  static inline reg add(reg a, reg b) { return a + b; }
  static inline reg sub(reg a, reg b) { return a - b; }
  static inline reg mul(reg a, reg b) { return a * b; }
  static inline reg div(reg a, reg b) { return a / b; }
  static inline reg fmadd(reg a, reg b, reg c) { return std::fma(a, b, c); }
  static inline reg sqrt(reg a) { return std::sqrt(a); }
  // Keeps a product from being contracted into a following add (see cpu_adam_body.h).
  static inline reg keep(reg a) {
#if defined(__x86_64__) || defined(_M_X64)
    __asm__("" : "+x"(a));
#elif defined(__aarch64__)
    __asm__("" : "+w"(a));
#else
    volatile float t = a;
    a = t;
#endif
    return a;
  }
  static inline reg load_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
  static inline reg load_f16(const uint16_t* p) { return f16_to_f32(*p); }
  static inline void prefetch(const void*) {}  // one element a step: nothing to gain
  static constexpr bool kHasNT = false;  // streaming stores need vectors
  template <bool NT>
  static inline void store_f32_out(float* p, reg x) {
    *p = x;
  }
  template <bool NT>
  static inline void store_bf16(uint16_t* p, reg x) {
    *p = f32_to_bf16(x);
  }
  template <bool NT>
  static inline void store_f16(uint16_t* p, reg x) {
    *p = f32_to_f16(x);
  }
  static inline void store_fence() {}
  static inline dacc dzero() { return 0.0; }
  static inline dacc dacc_sq(dacc s, reg x) {
    double d = x;
    return s + d * d;  // exact product: a float has 24 significant bits
  }
  static inline double dsum(dacc s) { return s; }
};

}  // namespace

#define OFFLOAD_KTARGET
#include "cpu_adam_body.h"
#undef OFFLOAD_KTARGET

}  // namespace scalar
}  // namespace cpu_adam
}  // namespace offload
