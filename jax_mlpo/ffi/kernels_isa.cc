// The loops, compiled once per instruction set: CMake builds this file three times with
// JAX_MLPO_ISA_NS set to isa_base / isa_avx2 / isa_avx512 and the matching -m flags, always with
// -O3 -fno-math-errno (vectorized sqrtf) and -ffp-contract=off (no contraction: the operations,
// the float64 emulation of fma included, must be exactly the numpy reference's, on every ISA).
// Plain loops over __restrict pointers; GCC vectorizes all of them (check with -fopt-info-vec).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#include "kernels.h"

#ifndef JAX_MLPO_ISA_NS
#error "JAX_MLPO_ISA_NS must name the instruction-set namespace (isa_base, isa_avx2, isa_avx512)"
#endif
#define JAX_MLPO_STR2(x) #x
#define JAX_MLPO_STR(x) JAX_MLPO_STR2(x)

namespace jax_mlpo::JAX_MLPO_ISA_NS {

LionRangeFn LionLoopAt(int index);  // lion_isa.cc, compiled for the same instruction set
MomentumRangeFn MomentumLoopAt(int index);  // muon_isa.cc, likewise
ApplyRangeFn ApplyLoopAt(int index);
RuleRangeFn RuleLoop();  // rule_isa.cc

namespace {

#include "elementwise_isa.h"  // bf16 conversions, loads and stores, Fma64, the outputs

struct Scalars {
  float c1, b1, c2, b2, inv_bc1, inv_bc2, eps, wd, neg_lr, scale, b1_blend, inv_bc1_next;
};

// Division by the bias corrections is multiplication by their float32 reciprocals (IEEE
// division, no approximation), as in XLA:CPU and the reference.
inline Scalars ScalarsOf(const AdamWArgs& a) {
  return Scalars{a.c1,  a.b1, a.c2,     a.b2,       1.0f / a.bc1, 1.0f / a.bc2,
                 a.eps, a.wd, a.neg_lr, a.grad_scale, a.b1_blend,
                 a.nesterov ? 1.0f / a.bc1_next : 0.0f};
}

// Both moments q8: they are rounded to 3 bits anyway, so their loop uses the float32 fma itself
// (as XLA:CPU does), 1.3x faster here than the float64 emulation; the reference rounds to odd
// in float64 to get the same single rounding (jax_mlpo/kernels.py).
template <bool kHwFma>
inline float Fma(float a, float x, float y) {
  if constexpr (kHwFma) {
    return std::fma(a, x, y);
  } else {
    return Fma64(a, x, y);
  }
}

// One element's update from its bias-corrected first moment and new second moment: optax's
// scale_by_adam, add_decayed_weights and learning rate, in XLA:CPU's order (see
// jax_mlpo/optimizers/adamw.py).
template <bool kWd, bool kHwFma>
inline float AdamWUpdate(const Scalars& s, float m_hat, float vi, float p) {
  float u = m_hat / (std::sqrt(vi * s.inv_bc2) + s.eps);
  if constexpr (kWd) u = Fma<kHwFma>(s.wd, p, u);
  return u * s.neg_lr;
}

// The loop proper. The pointers are __restrict function parameters: GCC ignores restrict on
// locals here and would fall back to run-time alias checks (or scalar code).
// A bfloat16 moment is widened on load and rounded (to nearest even) on store; the update uses
// the float32 values before that rounding, as optax's mu_dtype does.
// With nesterov the first moment is optax's blend b1 m / bc1_next + (1 - b1) g / bc1, the first
// product fused (as XLA:CPU compiles it).
template <typename GradT, typename MuT, typename NuT, bool kWd, bool kUpdateParam, bool kBf16Out,
          int kOut, bool kNesterov = false>
__attribute__((noinline)) void AdamWLoop(size_t n, const Scalars s, MuT* __restrict m,
                                         NuT* __restrict v, const GradT* __restrict grad,
                                         float* __restrict p, float* __restrict out,
                                         const uint16_t* __restrict base,
                                         uint16_t* __restrict pb, uint16_t* __restrict ub) {
  for (size_t i = 0; i < n; ++i) {
    const float g = Load(grad, i) * s.scale;
    // optax's update_moment(_per_elem_norm) as XLA:CPU compiles it (see jax_mlpo/kernels.py).
    const float mi = Fma64(s.c1, g, s.b1 * Load(m, i));
    const float vi = Fma64(s.c2, g * g, s.b2 * Load(v, i));
    Store(m, i, mi);
    Store(v, i, vi);
    const float m_hat = kNesterov ? Fma64(s.b1_blend, mi * s.inv_bc1_next, s.c1 * (g * s.inv_bc1))
                                  : mi * s.inv_bc1;
    const float u = AdamWUpdate<kWd, false>(s, m_hat, vi, p[i]);
    WriteOutputs<kUpdateParam, kBf16Out, kOut>(i, u, p, out, base, pb, ub);
  }
}

template <bool kGradBf16, bool kWd, bool kUpdateParam, bool kBf16Out, int kOut, bool kMuBf16,
          bool kNuBf16, bool kNesterov>
void AdamWRange(const AdamWArgs& a, size_t begin, size_t end) {
  using GradT = std::conditional_t<kGradBf16, uint16_t, float>;
  using MuT = std::conditional_t<kMuBf16, uint16_t, float>;
  using NuT = std::conditional_t<kNuBf16, uint16_t, float>;
  const Scalars s = ScalarsOf(a);
  const GradT* grad = static_cast<const GradT*>(a.grad);
  void* out_any = kOut == kOutDeltaBf16 ? static_cast<void*>(a.update_bf16)
                                        : static_cast<void*>(a.update_out);
  // Optional pointers are offset only when this variant uses them (they are null otherwise).
  // (Streaming stores for u and bf16(p) through an L1 block were tried: ~10% slower here.)
  auto run = [&](size_t lo, size_t hi, const GradT* g) {
    AdamWLoop<GradT, MuT, NuT, kWd, kUpdateParam, kBf16Out, kOut, kNesterov>(
        hi - lo, s, static_cast<MuT*>(a.m) + lo, static_cast<NuT*>(a.v) + lo, g, a.param + lo,
        kOut == kOutUpdate || kOut == kOutDelta ? a.update_out + lo : nullptr,
        kOut >= kOutDelta ? a.delta_base + lo : nullptr,
        kBf16Out ? a.param_bf16_out + lo : nullptr,
        kOut == kOutDeltaBf16 ? a.update_bf16 + lo : nullptr);
  };
  OverGradients<kOut>(begin, end, grad, out_any, run);
}

#include "q8_isa.h"  // the q8 code: encode, decode, random bits

// A moment block into float32 (its storage: float32, bfloat16 or q8) and back.
__attribute__((noinline)) void LoadMomentBlock(const void* x, const float* scales, bool bf16,
                                               bool q8, bool is_signed, size_t lo, size_t n,
                                               float* out) {
  if (q8) {
    Q8DecodeLoop(static_cast<const uint8_t*>(x) + lo, scales + lo / kQ8Block, n, out, is_signed);
  } else if (bf16) {
    const uint16_t* h = static_cast<const uint16_t*>(x) + lo;
    for (size_t i = 0; i < n; ++i) out[i] = Bf16ToF32Elem(h[i]);
  } else {
    std::memcpy(out, static_cast<const float*>(x) + lo, n * sizeof(float));
  }
}

__attribute__((noinline)) void StoreMomentBlock(const float* in, bool bf16, bool q8,
                                                bool is_signed, bool stochastic, uint32_t seed,
                                                size_t lo, size_t n, void* x, float* scales) {
  if (q8) {
    Q8EncodeLoop(in, n, static_cast<uint8_t*>(x) + lo, scales + lo / kQ8Block, is_signed,
                 stochastic, seed, lo);
  } else if (bf16) {
    uint16_t* h = static_cast<uint16_t*>(x) + lo;
    for (size_t i = 0; i < n; ++i) h[i] = F32ToBf16Elem(in[i]);
  } else {
    std::memcpy(static_cast<float*>(x) + lo, in, n * sizeof(float));
  }
}

// AdamW where one moment is q8 and the other not: block by block (begin is a multiple of
// kQ8Block), each block's moments decoded into float32 on the stack, advanced by the float32
// table's own loop (its float64-emulated fma: no new instantiations), encoded again. The
// gradient block is copied too, so the update may overwrite it (XLA's aliasing).
template <bool kGradBf16, bool kWd, bool kUpdateParam, bool kBf16Out, int kOut>
void AdamWBlockedRange(const AdamWArgs& a, size_t begin, size_t end) {
  using GradT = std::conditional_t<kGradBf16, uint16_t, float>;
  const Scalars s = ScalarsOf(a);
  const GradT* grad = static_cast<const GradT*>(a.grad);
  alignas(64) float m[kQ8Block], v[kQ8Block];
  alignas(64) GradT g[kQ8Block];
  for (size_t lo = begin; lo < end; lo += kQ8Block) {
    const size_t n = std::min(kQ8Block, end - lo);
    LoadMomentBlock(a.m, a.m_scale, a.mu_bf16, a.mu_q8, true, lo, n, m);
    LoadMomentBlock(a.v, a.v_scale, a.nu_bf16, a.nu_q8, false, lo, n, v);
    std::memcpy(g, grad + lo, n * sizeof(GradT));
    AdamWLoop<GradT, float, float, kWd, kUpdateParam, kBf16Out, kOut>(
        n, s, m, v, g, a.param + lo,
        kOut == kOutUpdate || kOut == kOutDelta ? a.update_out + lo : nullptr,
        kOut >= kOutDelta ? a.delta_base + lo : nullptr,
        kBf16Out ? a.param_bf16_out + lo : nullptr,
        kOut == kOutDeltaBf16 ? a.update_bf16 + lo : nullptr);
    StoreMomentBlock(m, a.mu_bf16, a.mu_q8, true, a.stochastic, a.seed, lo, n, a.m, a.m_scale);
    StoreMomentBlock(v, a.nu_bf16, a.nu_q8, false, a.stochastic, a.seed, lo, n, a.v, a.v_scale);
  }
}

// AdamW with both moments q8 (the common case), fused: per block one pass decodes m and v,
// advances them, writes the outputs and finds each moment's largest magnitude; a second pass
// encodes both: two passes, against the general path's eight. The rounding is chosen per block, not
// compiled into each variant: the table stays 64 entries.
template <typename GradT, bool kWd, bool kUpdateParam, bool kBf16Out, int kOut>
__attribute__((noinline)) void AdamWQ8Block(
    size_t n, const Scalars s, uint8_t* __restrict mc, float* __restrict ms,
    uint8_t* __restrict vc, float* __restrict vs, const GradT* __restrict grad,
    float* __restrict p, float* __restrict out, const uint16_t* __restrict base,
    uint16_t* __restrict pb, uint16_t* __restrict ub, bool stochastic, uint32_t key,
    uint32_t first) {
  alignas(64) float m[kQ8Block], v[kQ8Block];
  const float m_scale = *ms, v_scale = *vs;
  uint32_t m_amax = 0, v_amax = 0;
  for (size_t i = 0; i < n; ++i) {
    const float g = Load(grad, i) * s.scale;
    const float mi = Fma<true>(s.c1, g, s.b1 * DecodeQ8<true>(mc[i], m_scale));
    const float vi = Fma<true>(s.c2, g * g, s.b2 * DecodeQ8<false>(vc[i], v_scale));
    m[i] = mi;
    v[i] = vi;
    m_amax = std::max(m_amax, AbsBits(mi));
    v_amax = std::max(v_amax, AbsBits(vi));
    const float u = AdamWUpdate<kWd, true>(s, mi * s.inv_bc1, vi, p[i]);
    WriteOutputs<kUpdateParam, kBf16Out, kOut>(i, u, p, out, base, pb, ub);
  }
  if (stochastic) {
    EncodeQ8Moments<true>(m, v, n, m_amax, v_amax, mc, ms, vc, vs, key, first);
  } else {
    EncodeQ8Moments<false>(m, v, n, m_amax, v_amax, mc, ms, vc, vs, key, first);
  }
}

template <bool kGradBf16, bool kWd, bool kUpdateParam, bool kBf16Out, int kOut>
void AdamWQ8Range(const AdamWArgs& a, size_t begin, size_t end) {
  using GradT = std::conditional_t<kGradBf16, uint16_t, float>;
  const Scalars s = ScalarsOf(a);
  const GradT* grad = static_cast<const GradT*>(a.grad);
  uint8_t* mc = static_cast<uint8_t*>(a.m);
  uint8_t* vc = static_cast<uint8_t*>(a.v);
  const uint32_t key = Lowbias32(a.seed);
  const void* out_any = kOut == kOutDeltaBf16 ? static_cast<void*>(a.update_bf16)
                                              : static_cast<void*>(a.update_out);
  const bool aliased = kOut != kOutNone && out_any == static_cast<const void*>(grad);
  alignas(64) GradT g[kQ8Block];
  for (size_t lo = begin; lo < end; lo += kQ8Block) {
    const size_t n = std::min(kQ8Block, end - lo);
    const GradT* gb = grad + lo;
    if (aliased) {  // the update overwrites the gradient: read it from a copy (__restrict)
      std::memcpy(g, gb, n * sizeof(GradT));
      gb = g;
    }
    const size_t k = lo / kQ8Block;
    AdamWQ8Block<GradT, kWd, kUpdateParam, kBf16Out, kOut>(
        n, s, mc + lo, a.m_scale + k, vc + lo, a.v_scale + k, gb, a.param + lo,
        kOut == kOutUpdate || kOut == kOutDelta ? a.update_out + lo : nullptr,
        kOut >= kOutDelta ? a.delta_base + lo : nullptr,
        kBf16Out ? a.param_bf16_out + lo : nullptr,
        kOut == kOutDeltaBf16 ? a.update_bf16 + lo : nullptr, a.stochastic, key,
        uint32_t(lo));
  }
}

void Bf16ToF32Loop(const uint16_t* __restrict src, float* __restrict dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = Bf16ToF32Elem(src[i]);
}

void F32ToBf16Loop(const float* __restrict src, uint16_t* __restrict dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = F32ToBf16Elem(src[i]);
}

void TriadLoop(float* __restrict a, const float* __restrict b, const float* __restrict c, float s,
               size_t n) {
  for (size_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

template <size_t I>
constexpr AdamWRangeFn AdamWEntry() {
  return &AdamWRange<(I & 1) != 0, (I & 2) != 0, (I & 4) != 0, (I & 8) != 0, int(I >> 4 & 3),
                     (I & 64) != 0, (I & 128) != 0, (I & 256) != 0>;
}

template <size_t I>
constexpr AdamWRangeFn AdamWBlockedEntry() {
  return &AdamWBlockedRange<(I & 1) != 0, (I & 2) != 0, (I & 4) != 0, (I & 8) != 0,
                            int(I >> 4 & 3)>;
}

template <size_t I>
constexpr AdamWRangeFn AdamWQ8Entry() {
  return &AdamWQ8Range<(I & 1) != 0, (I & 2) != 0, (I & 4) != 0, (I & 8) != 0,
                       int(I >> 4 & 3)>;
}

template <size_t... I, size_t... J, size_t... K>
constexpr KernelTable MakeTable(std::index_sequence<I...>, std::index_sequence<J...>,
                                std::index_sequence<K...>) {
  return KernelTable{JAX_MLPO_STR(JAX_MLPO_ISA_NS) + 4,  // drop "isa_"
                     {AdamWEntry<I>()...}, {AdamWBlockedEntry<J>()...}, {AdamWQ8Entry<K>()...},
                     &Q8EncodeLoop, &Q8DecodeLoop,
                     &Bf16ToF32Loop, &F32ToBf16Loop, &TriadLoop, &LionLoopAt,
                     &MomentumLoopAt, &ApplyLoopAt, &RuleLoop};
}

constexpr KernelTable kTable = MakeTable(std::make_index_sequence<512>(),
                                         std::make_index_sequence<64>(),
                                         std::make_index_sequence<64>());
static_assert(AdamWIndex(true, true, true, true, kOutDeltaBf16, true, true, true) == 511,
              "table layout");

}  // namespace

const KernelTable& Table() { return kTable; }

}  // namespace jax_mlpo::JAX_MLPO_ISA_NS
