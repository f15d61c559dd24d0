#include "simd.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace offload {

namespace {
std::atomic<int> g_level{-1};

SimdLevel parse_level(const std::string& name) {
  if (name == "scalar") return SimdLevel::kScalar;
  if (name == "avx2") return SimdLevel::kAvx2;
  if (name == "avx512") return SimdLevel::kAvx512;
  if (name == "neon") return SimdLevel::kNeon;
  throw std::invalid_argument("unknown SIMD level '" + name +
                              "'; allowed: scalar, avx2, avx512, neon");
}
}  // namespace

SimdLevel detect_simd_level() {
#if OFFLOAD_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return SimdLevel::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return SimdLevel::kAvx2;
  return SimdLevel::kScalar;
#elif OFFLOAD_NEON
  return SimdLevel::kNeon;
#else
  return SimdLevel::kScalar;
#endif
}

bool simd_level_supported(SimdLevel level) {
  SimdLevel best = detect_simd_level();
  if (level == SimdLevel::kScalar) return true;
  if (level == SimdLevel::kNeon) return best == SimdLevel::kNeon;
  if (best == SimdLevel::kNeon) return false;
  return static_cast<int>(level) <= static_cast<int>(best);
}

SimdLevel simd_level() {
  int cur = g_level.load(std::memory_order_relaxed);
  if (cur >= 0) return static_cast<SimdLevel>(cur);
  SimdLevel lvl = detect_simd_level();
  if (const char* env = std::getenv("OFFLOAD_SIMD")) {
    std::string name(env);
    if (!name.empty() && name != "auto") {
      SimdLevel want = parse_level(name);
      if (simd_level_supported(want)) lvl = want;
    }
  }
  g_level.store(static_cast<int>(lvl), std::memory_order_relaxed);
  return lvl;
}

void set_simd_level(const std::string& name) {
  SimdLevel want = name == "auto" ? detect_simd_level() : parse_level(name);
  if (!simd_level_supported(want))
    throw std::invalid_argument(std::string("SIMD level '") + name +
                                "' is not supported on this CPU; best is '" +
                                simd_level_name(detect_simd_level()) + "'");
  g_level.store(static_cast<int>(want), std::memory_order_relaxed);
}

const char* simd_level_name(SimdLevel level) {
  switch (level) {
    case SimdLevel::kScalar: return "scalar";
    case SimdLevel::kAvx2: return "avx2";
    case SimdLevel::kAvx512: return "avx512";
    case SimdLevel::kNeon: return "neon";
  }
  return "unknown";
}

}  // namespace offload
