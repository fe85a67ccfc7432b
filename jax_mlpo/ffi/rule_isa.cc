// The tile program's interpreter (rule.h), compiled once per instruction set with kernels_isa.cc's
// flags (-O3 -fno-math-errno -ffp-contract=off): each operation is one loop over a tile,
// vectorized by GCC, with IEEE float32 results (no contraction into fma, no approximations).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels.h"
#include "rule.h"

#ifndef JAX_MLPO_ISA_NS
#error "JAX_MLPO_ISA_NS must name the instruction-set namespace (isa_base, isa_avx2, isa_avx512)"
#endif

namespace jax_mlpo::JAX_MLPO_ISA_NS {
namespace {

#include "elementwise_isa.h"  // bf16 conversions

inline float Bool(bool x) { return x ? 1.0f : 0.0f; }

// IEEE 754-2019 maximum and minimum, as XLA:CPU's max and min: NaN if either is, and -0 < +0.
inline float Maximum(float a, float b) {
  if (a != a || b != b) return a + b;
  if (a != b) return a > b ? a : b;
  return std::signbit(a) ? b : a;
}
inline float Minimum(float a, float b) {
  if (a != a || b != b) return a + b;
  if (a != b) return a < b ? a : b;
  return std::signbit(a) ? a : b;
}

// One element of an operation, as XLA:CPU computes it on float32 (lax's primitives): max and min
// as above, sign keeps +-0 and NaN, a boolean is 0 or 1, select's a is the predicate (lax's
// select_n: c where true, b where false), clamp is clamp(lo=a, x=b, hi=c). The fused forms are
// one fma (a hardware instruction from AVX2 on; the baseline build calls libm's, slower).
template <int Op>
inline float Eval(float a, float b, float c) {
  if constexpr (Op == kRuleCopy) return a;
  if constexpr (Op == kRuleNeg) return -a;
  if constexpr (Op == kRuleAbs) return std::fabs(a);
  if constexpr (Op == kRuleSign) return std::fabs(a) > 0.0f ? std::copysign(1.0f, a) : a;
  if constexpr (Op == kRuleSqrt) return std::sqrt(a);
  if constexpr (Op == kRuleRsqrt) return 1.0f / std::sqrt(a);
  if constexpr (Op == kRuleExp) return std::exp(a);
  if constexpr (Op == kRuleExp2) return std::exp2(a);
  if constexpr (Op == kRuleLog) return std::log(a);
  if constexpr (Op == kRuleLog1p) return std::log1p(a);
  if constexpr (Op == kRuleExpm1) return std::expm1(a);
  if constexpr (Op == kRuleTanh) return std::tanh(a);
  if constexpr (Op == kRuleLogistic) return 1.0f / (1.0f + std::exp(-a));
  if constexpr (Op == kRuleSin) return std::sin(a);
  if constexpr (Op == kRuleCos) return std::cos(a);
  if constexpr (Op == kRuleFloor) return std::floor(a);
  if constexpr (Op == kRuleCeil) return std::ceil(a);
  if constexpr (Op == kRuleRoundBf16) return Bf16ToF32Elem(F32ToBf16Elem(a));
  if constexpr (Op == kRuleNot) return Bool(a == 0.0f);
  if constexpr (Op == kRuleIsFinite) return Bool(std::isfinite(a));
  if constexpr (Op == kRuleAdd) return a + b;
  if constexpr (Op == kRuleSub) return a - b;
  if constexpr (Op == kRuleMul) return a * b;
  if constexpr (Op == kRuleDiv) return a / b;
  if constexpr (Op == kRuleMax) return Maximum(a, b);
  if constexpr (Op == kRuleMin) return Minimum(a, b);
  if constexpr (Op == kRulePow) return std::pow(a, b);
  if constexpr (Op == kRuleLt) return Bool(a < b);
  if constexpr (Op == kRuleLe) return Bool(a <= b);
  if constexpr (Op == kRuleGt) return Bool(a > b);
  if constexpr (Op == kRuleGe) return Bool(a >= b);
  if constexpr (Op == kRuleEq) return Bool(a == b);
  if constexpr (Op == kRuleNe) return Bool(a != b);
  if constexpr (Op == kRuleAnd) return Bool(a != 0.0f && b != 0.0f);
  if constexpr (Op == kRuleOr) return Bool(a != 0.0f || b != 0.0f);
  if constexpr (Op == kRuleXor) return Bool((a != 0.0f) != (b != 0.0f));
  if constexpr (Op == kRuleSelect) return a != 0.0f ? c : b;
  if constexpr (Op == kRuleClamp) return Minimum(c, Maximum(a, b));
  if constexpr (Op == kRuleMulAdd) return std::fma(a, b, c);
  if constexpr (Op == kRuleMulSub) return std::fma(a, b, -c);
  if constexpr (Op == kRuleNegMulAdd) return std::fma(-a, b, c);
  return 0.0f;  // loads, stores and broadcasts are not element operations
}

using TileFn = void (*)(float* __restrict d, const float* __restrict a,
                        const float* __restrict b, const float* __restrict c, size_t n);
using ScalarFn = float (*)(float a, float b, float c);

// The destination never shares a register with an operand (rule_program.py allocates so).
template <int Op>
void TileLoop(float* __restrict d, const float* __restrict a, const float* __restrict b,
              const float* __restrict c, size_t n) {
  for (size_t i = 0; i < n; ++i) d[i] = Eval<Op>(a[i], b[i], c[i]);
}

template <int Op>
float ScalarOp(float a, float b, float c) {
  return Eval<Op>(a, b, c);
}

template <size_t... I>
constexpr std::array<TileFn, sizeof...(I)> MakeTileFns(std::index_sequence<I...>) {
  return {&TileLoop<int(I)>...};
}
template <size_t... I>
constexpr std::array<ScalarFn, sizeof...(I)> MakeScalarFns(std::index_sequence<I...>) {
  return {&ScalarOp<int(I)>...};
}

constexpr auto kTileFns = MakeTileFns(std::make_index_sequence<kRuleOpCount>());
constexpr auto kScalarFns = MakeScalarFns(std::make_index_sequence<kRuleOpCount>());

void LoadTile(float* __restrict d, const void* src, bool bf16, size_t lo, size_t n) {
  if (!bf16) {
    std::memcpy(d, static_cast<const float*>(src) + lo, n * sizeof(float));
    return;
  }
  const uint16_t* __restrict s = static_cast<const uint16_t*>(src) + lo;
  for (size_t i = 0; i < n; ++i) d[i] = Bf16ToF32Elem(s[i]);
}

void StoreTile(void* dst, const float* s, bool bf16, size_t lo, size_t n) {
  if (!bf16) {
    float* d = static_cast<float*>(dst) + lo;
    if (d != s) std::memcpy(d, s, n * sizeof(float));  // the same: a value read in place
    return;
  }
  uint16_t* d = static_cast<uint16_t*>(dst) + lo;
  for (size_t i = 0; i < n; ++i) d[i] = F32ToBf16Elem(s[i]);
}

void RuleRange(const RuleArgs& a, size_t begin, size_t end) {
  // the scalars, then the prologue over them: a few operations, done by each thread
  std::vector<float> scalars(a.scalars, a.scalars + a.scalar_regs);
  for (size_t k = 0; k < a.prologue_len; ++k) {
    const int32_t* in = a.prologue + k * kRuleWords;
    const float x = scalars[size_t(in[2])];
    const float y = in[3] >= 0 ? scalars[size_t(in[3])] : 0.0f;
    const float z = in[4] >= 0 ? scalars[size_t(in[4])] : 0.0f;
    scalars[size_t(in[1])] = kScalarFns[size_t(in[0])](x, y, z);
  }
  // Where each register's value is written (home) and read (at): a tile register's home is
  // its storage, 64-byte aligned; an array register's is the array's tile. A load that may be
  // a view reads the array in place.
  const size_t regs = a.tile_regs + a.n_arrays;
  std::vector<float> storage(a.tile_regs * kRuleTile + 16);
  float* base = storage.data() + (-reinterpret_cast<uintptr_t>(storage.data()) / 4 & 15);
  std::vector<float*> home(regs);
  std::vector<const float*> at(regs);
  for (size_t r = 0; r < a.tile_regs; ++r) at[r] = home[r] = base + r * kRuleTile;
  for (size_t k = 0; k < a.setup_len; ++k) {
    const int32_t* in = a.setup + k * kRuleWords;
    std::fill_n(home[size_t(in[1])], kRuleTile, scalars[size_t(in[2])]);
  }
  for (size_t lo = begin; lo < end; lo += kRuleTile) {
    const size_t n = std::min(kRuleTile, end - lo);
    for (size_t k = 0; k < a.n_arrays; ++k) {
      at[a.tile_regs + k] = home[a.tile_regs + k] = static_cast<float*>(a.arrays[k]) + lo;
    }
    for (size_t k = 0; k < a.body_len; ++k) {
      const int32_t* in = a.body + k * kRuleWords;
      switch (in[0]) {
        case kRuleLoadF32:
          if (a.viewable[in[2]]) {
            at[in[1]] = static_cast<const float*>(a.arrays[in[2]]) + lo;
            break;
          }
          [[fallthrough]];
        case kRuleLoadBf16:
          LoadTile(home[in[1]], a.arrays[in[2]], in[0] == kRuleLoadBf16, lo, n);
          at[in[1]] = home[in[1]];
          break;
        case kRuleStoreF32:
        case kRuleStoreBf16:
          StoreTile(a.arrays[in[1]], at[in[2]], in[0] == kRuleStoreBf16, lo, n);
          break;
        default: {
          const float* x = at[in[2]];
          kTileFns[size_t(in[0])](home[in[1]], x, in[3] >= 0 ? at[in[3]] : x,
                                  in[4] >= 0 ? at[in[4]] : x, n);
          at[in[1]] = home[in[1]];
        }
      }
    }
  }
}

}  // namespace

RuleRangeFn RuleLoop() { return &RuleRange; }

}  // namespace jax_mlpo::JAX_MLPO_ISA_NS
