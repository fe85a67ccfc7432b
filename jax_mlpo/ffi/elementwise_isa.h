// The element operations the optimizers' loops share: bfloat16 conversions, loads and stores of
// float32 or bfloat16 values, Fma64, where an element's update goes, and the gradients' blocks
// when the update overwrites them. Included inside each instruction set's anonymous namespace
// (kernels_isa.cc, lion_isa.cc), so every copy is compiled with that instruction set's flags.

inline uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

inline float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

inline float Bf16ToF32Elem(uint16_t h) { return FromBits(uint32_t(h) << 16); }

// Round to nearest even, as XLA's and ml_dtypes' conversions: NaN -> sign | 0x7fc0 (quiet NaN,
// payload dropped), inf stays inf, overflow rounds to inf, denormals are kept (no DAZ/FTZ).
inline uint16_t F32ToBf16Elem(float f) {
  const uint32_t x = Bits(f);
  uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  uint32_t nan = ((x >> 16) & 0x8000u) | 0x7fc0u;
  return uint16_t((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

// Gradients and moments are float32 or bfloat16 (uint16_t bits); all arithmetic is float32.
inline float Load(const float* x, size_t i) { return x[i]; }
inline float Load(const uint16_t* x, size_t i) { return Bf16ToF32Elem(x[i]); }
inline void Store(float* x, size_t i, float f) { x[i] = f; }
inline void Store(uint16_t* x, size_t i, float f) { x[i] = F32ToBf16Elem(f); }

// float32 a * x + y as the reference computes it: the product is exact in float64, the sum is
// rounded to float64 and then to float32 (XLA:CPU uses a float32 fma here; the two differ only
// in rare double-rounding cases). Written out so that the result does not depend on the ISA.
inline float Fma64(float a, float x, float y) {
  return float(double(a) * double(x) + double(y));
}

// Where an element's update goes: the param in place, the update itself or the new param's
// difference to the bf16 params (float32 or bfloat16), and the new param rounded to bfloat16.
template <bool kUpdateParam, bool kBf16Out, int kOut>
inline void WriteOutputs(size_t i, float u, float* __restrict p, float* __restrict out,
                         const uint16_t* __restrict base, uint16_t* __restrict pb,
                         uint16_t* __restrict ub) {
  float pn = 0.0f;
  if constexpr (kUpdateParam || kOut >= kOutDelta || kBf16Out) pn = p[i];
  if constexpr (kUpdateParam) {
    pn = pn + u;
    p[i] = pn;
  }
  if constexpr (kOut == kOutUpdate) out[i] = u;
  if constexpr (kOut == kOutDelta) out[i] = pn - Bf16ToF32Elem(base[i]);
  // Both operands are bf16 values, so the float32 difference is bf16 subtraction's exact
  // result before its one rounding (exact itself when they are within 2x: Sterbenz).
  if constexpr (kOut == kOutDeltaBf16) {
    ub[i] = F32ToBf16Elem(Bf16ToF32Elem(F32ToBf16Elem(pn)) - Bf16ToF32Elem(base[i]));
  }
  if constexpr (kBf16Out) pb[i] = F32ToBf16Elem(pn);
}

// Elements per block when the update is written over the gradient it is computed from.
constexpr size_t kAliasBlock = 1024;

// Runs run(lo, hi, g) over [begin, end) with g the gradients from lo. When the update is written
// over the gradient (XLA aliased them: `out` is `grad`), element by element, the loops' pointers
// are __restrict, so each block's gradients are read from a copy on the stack.
template <int kOut, typename GradT, typename Run>
inline void OverGradients(size_t begin, size_t end, const GradT* grad, const void* out,
                          const Run& run) {
  if (kOut == kOutNone || out != static_cast<const void*>(grad)) {
    run(begin, end, grad + begin);
    return;
  }
  alignas(64) GradT block[kAliasBlock];
  for (size_t lo = begin; lo < end; lo += kAliasBlock) {
    const size_t hi = std::min(end, lo + kAliasBlock);
    std::memcpy(block, grad + lo, (hi - lo) * sizeof(GradT));
    run(lo, hi, block);
  }
}
