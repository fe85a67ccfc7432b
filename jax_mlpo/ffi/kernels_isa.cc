// The loops, compiled once per instruction set: CMake builds this file three times with
// JAX_MLPO_ISA_NS set to isa_base / isa_avx2 / isa_avx512 and the matching -m flags, always with
// -O3 -fno-math-errno (vectorized sqrtf) and -ffp-contract=off (no FMA: the results must be
// bitwise equal to the numpy reference). Plain loops over __restrict pointers; GCC vectorizes them
// (check with -fopt-info-vec).
#include <cmath>
#include <cstring>
#include <utility>

#include "kernels.h"

#ifndef JAX_MLPO_ISA_NS
#error "JAX_MLPO_ISA_NS must name the instruction-set namespace (isa_base, isa_avx2, isa_avx512)"
#endif
#define JAX_MLPO_STR2(x) #x
#define JAX_MLPO_STR(x) JAX_MLPO_STR2(x)

namespace jax_mlpo::JAX_MLPO_ISA_NS {
namespace {

inline float Bf16ToF32Elem(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, as XLA's and ml_dtypes' conversions: NaN -> sign | 0x7fc0 (quiet NaN,
// payload dropped), inf stays inf, overflow rounds to inf, denormals are kept (no DAZ/FTZ).
inline uint16_t F32ToBf16Elem(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  uint32_t nan = ((x >> 16) & 0x8000u) | 0x7fc0u;
  return uint16_t((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

template <typename T>
inline T* Off(T* ptr, size_t begin) {  // null stays null (no arithmetic on a null pointer)
  return ptr == nullptr ? nullptr : ptr + begin;
}

template <bool kGradBf16, bool kWd, bool kUpdateParam, bool kBf16Out, int kOut>
void AdamWRange(const AdamWArgs& a, size_t begin, size_t end) {
  const size_t n = end - begin;
  float* __restrict m = Off(a.m, begin);
  float* __restrict v = Off(a.v, begin);
  float* __restrict p = Off(a.param, begin);
  const float* __restrict gf = Off(static_cast<const float*>(a.grad), begin);
  const uint16_t* __restrict gb = Off(static_cast<const uint16_t*>(a.grad), begin);
  float* __restrict out = Off(a.update_out, begin);
  const uint16_t* __restrict base = Off(a.delta_base, begin);
  uint16_t* __restrict pb = Off(a.param_bf16_out, begin);
  const float c1 = a.c1, b1 = a.b1, c2 = a.c2, b2 = a.b2, bc1 = a.bc1, bc2 = a.bc2;
  const float eps = a.eps, wd = a.wd, neg_lr = a.neg_lr, scale = a.grad_scale;
  for (size_t i = 0; i < n; ++i) {
    float g = kGradBf16 ? Bf16ToF32Elem(gb[i]) : gf[i];
    g = g * scale;
    // Same expressions and order as optax.tree.update_moment(_per_elem_norm).
    const float mi = c1 * g + b1 * m[i];
    const float vi = c2 * (g * g) + b2 * v[i];
    m[i] = mi;
    v[i] = vi;
    float u = (mi / bc1) / (std::sqrt(vi / bc2) + eps);
    if constexpr (kWd) u = u + wd * p[i];
    u = u * neg_lr;
    float pn = 0.0f;
    if constexpr (kUpdateParam || kOut == kOutDelta || kBf16Out) pn = p[i];
    if constexpr (kUpdateParam) {
      pn = pn + u;
      p[i] = pn;
    }
    if constexpr (kOut == kOutUpdate) out[i] = u;
    if constexpr (kOut == kOutDelta) out[i] = pn - Bf16ToF32Elem(base[i]);
    if constexpr (kBf16Out) pb[i] = F32ToBf16Elem(pn);
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
  return &AdamWRange<(I & 1) != 0, (I & 2) != 0, (I & 4) != 0, (I & 8) != 0, int(I >> 4)>;
}

template <size_t... I>
constexpr KernelTable MakeTable(std::index_sequence<I...>) {
  return KernelTable{JAX_MLPO_STR(JAX_MLPO_ISA_NS) + 4,  // drop "isa_"
                     {AdamWEntry<I>()...}, &Bf16ToF32Loop,
                     &F32ToBf16Loop, &TriadLoop};
}

constexpr KernelTable kTable = MakeTable(std::make_index_sequence<48>());
static_assert(AdamWIndex(true, true, true, true, kOutDelta) == 47, "table layout");

}  // namespace

const KernelTable& Table() { return kTable; }

}  // namespace jax_mlpo::JAX_MLPO_ISA_NS
