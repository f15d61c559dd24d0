// Run-time SIMD dispatch.
//
// The extension is compiled for the baseline ISA of the target (x86-64 or armv8). Wider code
// paths are written as functions carrying __attribute__((target(...))) (see OFFLOAD_TARGET_*),
// and kernels pick one at call time from simd_level(). So a wheel built on one machine runs on
// another, and tests can force each level (OFFLOAD_SIMD=scalar|avx2|avx512, or set_simd_level).
#pragma once

#include <string>

namespace offload {

enum class SimdLevel : int {
  kScalar = 0,  // portable C++; the reference every other path must match
  kAvx2 = 1,    // x86 AVX2 + FMA + F16C
  kAvx512 = 2,  // x86 AVX-512 F/BW/VL/DQ
  kNeon = 3,    // Arm NEON (aarch64)
};

// Best level this CPU and OS support.
SimdLevel detect_simd_level();
// Level kernels use now: detected, or lowered by OFFLOAD_SIMD / set_simd_level.
SimdLevel simd_level();
// Forces a level (must be supported); throws std::invalid_argument naming what is allowed.
void set_simd_level(const std::string& name);
const char* simd_level_name(SimdLevel level);
bool simd_level_supported(SimdLevel level);

}  // namespace offload

#if defined(__x86_64__) || defined(_M_X64)
#define OFFLOAD_X86 1
#define OFFLOAD_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define OFFLOAD_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#else
#define OFFLOAD_X86 0
#endif

#if defined(__aarch64__)
#define OFFLOAD_NEON 1
#else
#define OFFLOAD_NEON 0
#endif
