// CPU Adam/AdamW kernel family: shared declarations.
//
// Every kernel works on one range [begin, end) of flat buffers; cpu_adam.cpp splits a call over
// offload::compute_pool() and picks the SIMD level at run time. The per-level kernels are the
// same source (cpu_adam_body.h) compiled three times with different vector traits, so the
// scalar, AVX2 and AVX-512 paths execute the same operations in the same order and agree bit
// for bit (the tests check this).
//
// Note (arithmetic order): the per-element sequence mirrors torch.optim.Adam/AdamW with
// foreach=False on CPU, including where torch's vectorised CPU kernels fuse a multiply-add:
//   g  = grad * grad_scale
//   g  = fma(p, wd, g)                          Adam (L2) mode, wd != 0   (add(alpha=wd))
//   p  = p * (1 - lr*wd)                        AdamW mode                 (mul_)
//   m  = fma(w, g - m, m)   or fma(w - 1, g - m, g) when w >= 0.5, w = 1 - beta1   (lerp_)
//   v  = v * beta2 ; v = fma((1 - beta2) * g, g, v)                       (mul_, addcmul_)
//   d  = sqrt(v) / sqrt(1 - beta2^t) + eps                                (sqrt, div, add_)
//   p  = p + (-(lr / (1 - beta1^t)) * m) / d                              (addcdiv_)
// The scalar coefficients are computed once per call in double (by the Python caller, exactly
// as torch computes them) and rounded to float, as torch does when it passes a Python scalar
// to a float kernel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace offload {
namespace cpu_adam {

// Element type codes shared with Python (offload/optim/_kernels.py).
enum DType : int {
  kNone = -1,  // no buffer (copy-out disabled)
  kF32 = 0,
  kBF16 = 1,
  kF16 = 2,
};

// One Adam call over flat buffers. All coefficients are already rounded to float.
struct AdamArgs {
  float* param = nullptr;
  const void* grad = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  void* out = nullptr;  // updated params in out_dtype, or nullptr
  int grad_dtype = kF32;
  int out_dtype = kNone;
  float grad_scale = 1.0f;
  float decay = 1.0f;     // AdamW: 1 - lr*wd (1 when off)
  float l2 = 0.0f;        // Adam: wd added to the gradient (0 when off)
  float w1 = 0.1f;        // 1 - beta1 (lerp weight)
  float beta2 = 0.999f;
  float c2 = 0.001f;      // 1 - beta2
  float bc2_sqrt = 1.0f;  // sqrt(1 - beta2^t); exactly 1 skips the division (bit-identical)
  float eps = 1e-8f;
  float neg_step = -1e-3f;  // -(lr / (1 - beta1^t))
};

// One gradient accumulation: acc = (overwrite ? 0 : acc) + grad * scale.
struct AccumArgs {
  float* acc = nullptr;
  const void* grad = nullptr;
  int grad_dtype = kF32;
  float scale = 1.0f;
  bool overwrite = false;
};

// 4-read/3-write streaming kernel (the bandwidth roof an Adam step can reach):
// a += b*k; c = c*k + b; d = d*k + b.
struct StreamArgs {
  float* a = nullptr;
  const float* b = nullptr;
  float* c = nullptr;
  float* d = nullptr;
  float k = 0.5f;
};

// Per-level kernels (each declared in its namespace; defined by cpu_adam_body.h).
#define OFFLOAD_CPU_ADAM_DECLARE(NS)                                                      \
  namespace NS {                                                                          \
  void adam_range(const AdamArgs& a, size_t begin, size_t end);                           \
  double accumulate_range(const AccumArgs& a, size_t begin, size_t end); /* sum of sq */ \
  void stream_range(const StreamArgs& a, size_t begin, size_t end);                       \
  }
OFFLOAD_CPU_ADAM_DECLARE(scalar)
OFFLOAD_CPU_ADAM_DECLARE(avx2)
OFFLOAD_CPU_ADAM_DECLARE(avx512)
#undef OFFLOAD_CPU_ADAM_DECLARE

// ---- portable bit-exact conversions (the scalar path; SIMD paths must agree) ----

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// Round to nearest even, as torch's float->bfloat16 copy: every NaN becomes 0xFFFF.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFF;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// IEEE half -> float, exact (F16C semantics: a NaN comes back quiet with its payload).
inline float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1Fu;
  uint32_t m = h & 0x3FFu;
  if (e == 0x1F) return bits_f32(sign | 0x7F800000u | (m << 13) | (m ? 0x400000u : 0u));
  if (e == 0) {
    if (m == 0) return bits_f32(sign);
    int shift = 0;
    while (!(m & 0x400u)) {
      m <<= 1;
      ++shift;
    }
    m &= 0x3FFu;
    return bits_f32(sign | (static_cast<uint32_t>(113 - shift) << 23) | (m << 13));
  }
  return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

// float -> IEEE half, round to nearest even (F16C semantics: NaN keeps sign and the top of its
// payload, with the quiet bit set; overflow gives inf; subnormals are rounded, never flushed).
inline uint16_t f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520: inf
  if (a >= 0x38800000u) {                                              // normal half
    uint32_t r = a + 0xFFFu + ((a >> 13) & 1u) - 0x38000000u;
    return static_cast<uint16_t>(sign | (r >> 13));
  }
  uint32_t e = a >> 23;
  if (e < 102) return sign;  // below 2^-25 (or exactly it: tie to even zero)
  uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  uint32_t shift = 126 - e;  // 14..24: units of 2^-24
  uint32_t q = m >> shift;
  uint32_t rem = m & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

}  // namespace cpu_adam
}  // namespace offload
