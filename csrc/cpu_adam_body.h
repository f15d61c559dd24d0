// CPU Adam kernel bodies, written once over a vector-traits type `V`.
//
// No include guard on purpose: each cpu_adam_<level>.cpp defines `V` (W lanes of float with
// load/store/arithmetic and the dtype conversions) and OFFLOAD_KTARGET (its target attribute),
// then includes this file inside its own namespace. The scalar level is the same code with
// W = 1, so every level runs the identical operation sequence (see the Note in cpu_adam.h).
//
// Note (no contraction): GCC's default -ffp-contract=fast may fuse a multiply whose result feeds
// an add into one FMA, which rounds once instead of twice and would make the levels (and torch)
// disagree. V::keep() is an empty asm barrier that pins such a product in a register; it is used
// exactly where a product feeds an addition (g*scale - m, p*decay + update).
//
// Tails: a range whose length is not a multiple of W finishes with one vector step over small
// zero-padded stack copies, so the tail runs the same arithmetic as the body at any alignment.

namespace {

using reg = typename V::reg;

// Note (stores): param, exp_avg and exp_avg_sq are read and written in place, so their lines
// are already cached when written and ordinary stores cost no extra traffic (streaming stores
// measured slower there). The copy-out buffer is write-only: an ordinary store first reads each
// line (write-allocate, +2 B/param for bf16), a streaming store does not, so large ranges use
// streaming stores for it (then a store fence, before the pool reports the range done). Short
// ranges keep ordinary stores: their output is likely to be read again from cache soon.
constexpr size_t kStreamOutMin = size_t{1} << 16;  // elements per range

// Note (prefetch): each input stream is prefetched kPrefetchAhead elements (2 KiB of fp32)
// ahead. With five concurrent streams the hardware prefetcher alone left the step at ~87% of
// the streaming kernel on the development machine (Xeon, AVX-512); with this it reaches the
// streaming kernel. Prefetch instructions never fault, so running past the end is harmless;
// the address is formed in integers to stay clear of out-of-bounds pointer arithmetic.
constexpr size_t kPrefetchAhead = 512;

template <class T>
OFFLOAD_KTARGET inline void prefetch_ahead(const T* base, size_t i) {
  V::prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(base) +
                                            (i + kPrefetchAhead) * sizeof(T)));
}

struct Coef {
  reg scale, decay, l2, w, wm1, beta2, c2, bc2, eps, nstep;
};

template <int DT>
struct Elem;
template <>
struct Elem<kF32> {
  using type = float;
};
template <>
struct Elem<kBF16> {
  using type = uint16_t;
};
template <>
struct Elem<kF16> {
  using type = uint16_t;
};
template <>
struct Elem<kNone> {
  using type = uint16_t;  // never touched
};

template <int G>
OFFLOAD_KTARGET inline reg load_as_f32(const void* base, size_t i) {
  if constexpr (G == kF32) {
    return V::load(static_cast<const float*>(base) + i);
  } else if constexpr (G == kBF16) {
    return V::load_bf16(static_cast<const uint16_t*>(base) + i);
  } else {
    return V::load_f16(static_cast<const uint16_t*>(base) + i);
  }
}

// NT: non-temporal (streaming) store, for the write-only copy-out (see the Note on stores).
template <int O, bool NT>
OFFLOAD_KTARGET inline void store_from_f32(void* base, size_t i, reg x) {
  if constexpr (O == kF32) {
    V::template store_f32_out<NT>(static_cast<float*>(base) + i, x);
  } else if constexpr (O == kBF16) {
    V::template store_bf16<NT>(static_cast<uint16_t*>(base) + i, x);
  } else if constexpr (O == kF16) {
    V::template store_f16<NT>(static_cast<uint16_t*>(base) + i, x);
  }
}

// One vector of W elements at offset i.
template <int G, int O, bool NT = false>
OFFLOAD_KTARGET inline void adam_vec(const Coef& c, bool l2, bool lerp_hi, bool bc, float* p_,
                                     const void* g_, float* m_, float* v_, void* o_, size_t i) {
  prefetch_ahead(static_cast<const typename Elem<G>::type*>(g_), i);
  prefetch_ahead(p_, i);
  prefetch_ahead(m_, i);
  prefetch_ahead(v_, i);
  reg g = V::keep(V::mul(load_as_f32<G>(g_, i), c.scale));
  reg p = V::load(p_ + i);
  reg m = V::load(m_ + i);
  reg v = V::load(v_ + i);
  if (l2) g = V::fmadd(p, c.l2, g);            // Adam: grad.add(param, alpha=wd)
  p = V::keep(V::mul(p, c.decay));             // AdamW: param.mul_(1 - lr*wd)
  reg d = V::sub(g, m);                        // exp_avg.lerp_(grad, 1 - beta1)
  m = lerp_hi ? V::fmadd(c.wm1, d, g) : V::fmadd(c.w, d, m);
  v = V::mul(v, c.beta2);                      // exp_avg_sq.mul_(beta2)
  v = V::fmadd(V::mul(c.c2, g), g, v);         //   .addcmul_(grad, grad, 1 - beta2)
  reg den = V::sqrt(v);                        // (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
  if (bc) den = V::div(den, c.bc2);
  den = V::add(den, c.eps);
  p = V::add(p, V::div(V::mul(c.nstep, m), den));  // param.addcdiv_(exp_avg, denom, -step)
  V::store(p_ + i, p);
  V::store(m_ + i, m);
  V::store(v_ + i, v);
  store_from_f32<O, NT>(o_, i, p);
}

template <int G, int O>
OFFLOAD_KTARGET void adam_typed(const AdamArgs& a, size_t begin, size_t end) {
  using GT = typename Elem<G>::type;
  using OT = typename Elem<O>::type;
  constexpr size_t W = V::W;
  Coef c;
  c.scale = V::set1(a.grad_scale);
  c.decay = V::set1(a.decay);
  c.l2 = V::set1(a.l2);
  c.w = V::set1(a.w1);
  c.wm1 = V::sub(c.w, V::set1(1.0f));  // torch computes weight - 1 in float
  c.beta2 = V::set1(a.beta2);
  c.c2 = V::set1(a.c2);
  c.bc2 = V::set1(a.bc2_sqrt);
  c.eps = V::set1(a.eps);
  c.nstep = V::set1(a.neg_step);
  const bool l2 = a.l2 != 0.0f;
  const bool hi = !(a.w1 < 0.5f && a.w1 > -0.5f);
  const bool bc = a.bc2_sqrt != 1.0f;
  size_t i = begin;
  // Streaming stores need each vector's slice of `out` aligned to its own size.
  const bool nt =
      O != kNone && V::kHasNT && end - begin >= kStreamOutMin &&
      reinterpret_cast<uintptr_t>(static_cast<OT*>(a.out) + begin) % (W * sizeof(OT)) == 0;
  if (nt) {
    for (; i + W <= end; i += W)
      adam_vec<G, O, true>(c, l2, hi, bc, a.param, a.grad, a.exp_avg, a.exp_avg_sq, a.out, i);
    V::store_fence();
  } else {
    for (; i + W <= end; i += W)
      adam_vec<G, O>(c, l2, hi, bc, a.param, a.grad, a.exp_avg, a.exp_avg_sq, a.out, i);
  }
  if (i < end) {
    const size_t r = end - i;
    alignas(64) float p[W] = {}, m[W] = {}, v[W] = {};
    alignas(64) GT g[W] = {};
    alignas(64) OT o[W] = {};
    std::memcpy(p, a.param + i, r * sizeof(float));
    std::memcpy(m, a.exp_avg + i, r * sizeof(float));
    std::memcpy(v, a.exp_avg_sq + i, r * sizeof(float));
    std::memcpy(g, static_cast<const GT*>(a.grad) + i, r * sizeof(GT));
    adam_vec<G, O>(c, l2, hi, bc, p, g, m, v, o, 0);
    std::memcpy(a.param + i, p, r * sizeof(float));
    std::memcpy(a.exp_avg + i, m, r * sizeof(float));
    std::memcpy(a.exp_avg_sq + i, v, r * sizeof(float));
    if (O != kNone) std::memcpy(static_cast<OT*>(a.out) + i, o, r * sizeof(OT));
  }
}

template <int G>
OFFLOAD_KTARGET void adam_by_out(const AdamArgs& a, size_t begin, size_t end) {
  switch (a.out_dtype) {
    case kNone: return adam_typed<G, kNone>(a, begin, end);
    case kF32: return adam_typed<G, kF32>(a, begin, end);
    case kBF16: return adam_typed<G, kBF16>(a, begin, end);
    default: return adam_typed<G, kF16>(a, begin, end);
  }
}

OFFLOAD_KTARGET void adam_impl(const AdamArgs& a, size_t begin, size_t end) {
  switch (a.grad_dtype) {
    case kF32: return adam_by_out<kF32>(a, begin, end);
    case kBF16: return adam_by_out<kBF16>(a, begin, end);
    default: return adam_by_out<kF16>(a, begin, end);
  }
}

// acc = (overwrite ? 0 : acc) + g*scale over W elements; folds the squares into `sq`.
template <int G>
OFFLOAD_KTARGET inline void accumulate_vec(const void* g_, float* acc, reg scale, bool overwrite,
                                           typename V::dacc& sq, size_t i) {
  prefetch_ahead(static_cast<const typename Elem<G>::type*>(g_), i);
  if (!overwrite) prefetch_ahead(acc, i);
  reg g = load_as_f32<G>(g_, i);
  reg x = overwrite ? V::mul(g, scale) : V::fmadd(g, scale, V::load(acc + i));
  V::store(acc + i, x);
  sq = V::dacc_sq(sq, x);
}

template <int G>
OFFLOAD_KTARGET double accumulate_typed(const AccumArgs& a, size_t begin, size_t end) {
  using GT = typename Elem<G>::type;
  constexpr size_t W = V::W;
  const reg scale = V::set1(a.scale);
  typename V::dacc s0 = V::dzero(), s1 = V::dzero();
  size_t i = begin;
  for (; i + 2 * W <= end; i += 2 * W) {
    accumulate_vec<G>(a.grad, a.acc, scale, a.overwrite, s0, i);
    accumulate_vec<G>(a.grad, a.acc, scale, a.overwrite, s1, i + W);
  }
  for (; i + W <= end; i += W) accumulate_vec<G>(a.grad, a.acc, scale, a.overwrite, s0, i);
  if (i < end) {
    const size_t r = end - i;
    alignas(64) float acc[W] = {};
    alignas(64) GT g[W] = {};
    std::memcpy(acc, a.acc + i, r * sizeof(float));
    std::memcpy(g, static_cast<const GT*>(a.grad) + i, r * sizeof(GT));
    accumulate_vec<G>(g, acc, scale, a.overwrite, s1, 0);  // padding adds 0 to the squares
    std::memcpy(a.acc + i, acc, r * sizeof(float));
  }
  return V::dsum(s0) + V::dsum(s1);
}

OFFLOAD_KTARGET double accumulate_impl(const AccumArgs& a, size_t begin, size_t end) {
  switch (a.grad_dtype) {
    case kF32: return accumulate_typed<kF32>(a, begin, end);
    case kBF16: return accumulate_typed<kBF16>(a, begin, end);
    default: return accumulate_typed<kF16>(a, begin, end);
  }
}

OFFLOAD_KTARGET void stream_impl(const StreamArgs& s, size_t begin, size_t end) {
  constexpr size_t W = V::W;
  const reg k = V::set1(s.k);
  size_t i = begin;
  for (; i + W <= end; i += W) {  // prefetched like adam_vec, so it stays a fair roof
    prefetch_ahead(s.a, i);
    prefetch_ahead(s.b, i);
    prefetch_ahead(s.c, i);
    prefetch_ahead(s.d, i);
    reg b = V::load(s.b + i);
    V::store(s.a + i, V::fmadd(b, k, V::load(s.a + i)));
    V::store(s.c + i, V::fmadd(V::load(s.c + i), k, b));
    V::store(s.d + i, V::fmadd(V::load(s.d + i), k, b));
  }
  for (; i < end; ++i) {
    float b = s.b[i];
    s.a[i] = s.a[i] + b * s.k;
    s.c[i] = s.c[i] * s.k + b;
    s.d[i] = s.d[i] * s.k + b;
  }
}

}  // namespace

// The entry points carry no target attribute (a second declaration with a different target
// would turn into GCC function multi-versioning); each is one call into the level's code.
void adam_range(const AdamArgs& a, size_t begin, size_t end) { adam_impl(a, begin, end); }
double accumulate_range(const AccumArgs& a, size_t begin, size_t end) {
  return accumulate_impl(a, begin, end);
}
void stream_range(const StreamArgs& a, size_t begin, size_t end) { stream_impl(a, begin, end); }
