// CPU Adam kernels, AVX-512 F/BW/VL/DQ level (W = 16), chosen at run time (no -march flags).
// bf16 rounding uses the integer bias trick, not VCVTNEPS2BF16 (which flushes subnormals and
// would not match torch's tensor.to(torch.bfloat16)).
#include "cpu_adam.h"
#include "simd.h"

#if OFFLOAD_X86
// GCC 12 reports -Wmaybe-uninitialized inside its own AVX-512 intrinsics (their
// _mm512_undefined_* placeholders) once they are inlined; a known false positive.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

namespace offload {
namespace cpu_adam {
namespace avx512 {
namespace {

#define T OFFLOAD_TARGET_AVX512 static inline
struct V {
  using reg = __m512;
  using dacc = __m512d;
  static constexpr size_t W = 16;
  T reg load(const float* p) { return _mm512_loadu_ps(p); }
  T void store(float* p, reg x) { _mm512_storeu_ps(p, x); }
  T reg set1(float x) { return _mm512_set1_ps(x); }
  T reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  T reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  T reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  T reg div(reg a, reg b) { return _mm512_div_ps(a, b); }
  T reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  T reg sqrt(reg a) { return _mm512_sqrt_ps(a); }
  T reg keep(reg a) {
    __asm__("" : "+v"(a));
    return a;
  }
  T reg load_bf16(const uint16_t* p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  T reg load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  T void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
  static constexpr bool kHasNT = true;
  template <bool NT>
  T void store_f32_out(float* p, reg x) {
    if (NT) {
      _mm512_stream_ps(p, x);
    } else {
      _mm512_storeu_ps(p, x);
    }
  }
  template <bool NT>
  T void store_256(uint16_t* p, __m256i x) {
    if (NT) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p), x);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x);
    }
  }
  T void store_fence() { _mm_sfence(); }
  // Round to nearest even with the rounding bias; NaN -> 0xFFFF (as torch).
  template <bool NT>
  T void store_bf16(uint16_t* p, reg x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
    __m512i t = _mm512_srli_epi32(_mm512_add_epi32(bias, u), 16);
    __mmask16 ord = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
    t = _mm512_mask_blend_epi32(ord, _mm512_set1_epi32(0xFFFF), t);
    store_256<NT>(p, _mm512_cvtepi32_epi16(t));
  }
  template <bool NT>
  T void store_f16(uint16_t* p, reg x) {
    store_256<NT>(p, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  T dacc dzero() { return _mm512_setzero_pd(); }
  T dacc dacc_sq(dacc s, reg x) {
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1));
    return _mm512_fmadd_pd(hi, hi, _mm512_fmadd_pd(lo, lo, s));
  }
  T double dsum(dacc s) {
    alignas(64) double t[8];
    _mm512_store_pd(t, s);
    return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
  }
};
#undef T

}  // namespace

#define OFFLOAD_KTARGET OFFLOAD_TARGET_AVX512
#include "cpu_adam_body.h"
#undef OFFLOAD_KTARGET

}  // namespace avx512
}  // namespace cpu_adam
}  // namespace offload

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#else  // not x86: never selected (simd_level_supported says so); keep the symbols defined.

namespace offload {
namespace cpu_adam {
namespace avx512 {
void adam_range(const AdamArgs& a, size_t b, size_t e) { scalar::adam_range(a, b, e); }
double accumulate_range(const AccumArgs& a, size_t b, size_t e) {
  return scalar::accumulate_range(a, b, e);
}
void stream_range(const StreamArgs& a, size_t b, size_t e) { scalar::stream_range(a, b, e); }
}  // namespace avx512
}  // namespace cpu_adam
}  // namespace offload

#endif
