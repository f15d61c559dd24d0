// CPU Adam kernels, AVX2 + FMA + F16C level (W = 8), chosen at run time (no -march flags).
#include "cpu_adam.h"
#include "simd.h"

#if OFFLOAD_X86
#include <immintrin.h>

namespace offload {
namespace cpu_adam {
namespace avx2 {
namespace {

#define T OFFLOAD_TARGET_AVX2 static inline
struct V {
  using reg = __m256;
  using dacc = __m256d;
  static constexpr size_t W = 8;
  T reg load(const float* p) { return _mm256_loadu_ps(p); }
  T void store(float* p, reg x) { _mm256_storeu_ps(p, x); }
  T reg set1(float x) { return _mm256_set1_ps(x); }
  T reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  T reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  T reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  T reg div(reg a, reg b) { return _mm256_div_ps(a, b); }
  T reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  T reg sqrt(reg a) { return _mm256_sqrt_ps(a); }
  T reg keep(reg a) {
    __asm__("" : "+x"(a));
    return a;
  }
  T reg load_bf16(const uint16_t* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  T reg load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  T void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
  static constexpr bool kHasNT = true;
  template <bool NT>
  T void store_f32_out(float* p, reg x) {
    if (NT) {
      _mm256_stream_ps(p, x);
    } else {
      _mm256_storeu_ps(p, x);
    }
  }
  template <bool NT>
  T void store_128(uint16_t* p, __m128i x) {
    if (NT) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(p), x);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), x);
    }
  }
  T void store_fence() { _mm_sfence(); }
  // Round to nearest even with the rounding bias; NaN -> 0xFFFF (as torch).
  template <bool NT>
  T void store_bf16(uint16_t* p, reg x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF));
    __m256i t = _mm256_srli_epi32(_mm256_add_epi32(bias, u), 16);
    __m256i ord = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_ORD_Q));
    t = _mm256_blendv_epi8(_mm256_set1_epi32(0xFFFF), t, ord);
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(t, t), 0x08);
    store_128<NT>(p, _mm256_castsi256_si128(packed));
  }
  template <bool NT>
  T void store_f16(uint16_t* p, reg x) {
    store_128<NT>(p, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  T dacc dzero() { return _mm256_setzero_pd(); }
  T dacc dacc_sq(dacc s, reg x) {
    __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    return _mm256_fmadd_pd(hi, hi, _mm256_fmadd_pd(lo, lo, s));
  }
  T double dsum(dacc s) {
    alignas(32) double t[4];
    _mm256_store_pd(t, s);
    return (t[0] + t[1]) + (t[2] + t[3]);
  }
};
#undef T

}  // namespace

#define OFFLOAD_KTARGET OFFLOAD_TARGET_AVX2
#include "cpu_adam_body.h"
#undef OFFLOAD_KTARGET

}  // namespace avx2
}  // namespace cpu_adam
}  // namespace offload

#else  // not x86: never selected (simd_level_supported says so); keep the symbols defined.

namespace offload {
namespace cpu_adam {
namespace avx2 {
void adam_range(const AdamArgs& a, size_t b, size_t e) { scalar::adam_range(a, b, e); }
double accumulate_range(const AccumArgs& a, size_t b, size_t e) {
  return scalar::accumulate_range(a, b, e);
}
void stream_range(const StreamArgs& a, size_t b, size_t e) { scalar::stream_range(a, b, e); }
}  // namespace avx2
}  // namespace cpu_adam
}  // namespace offload

#endif
