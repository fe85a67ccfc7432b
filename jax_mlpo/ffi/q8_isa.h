// The 8-bit blockwise moment's code (q8; kernels.h has the format, jax_mlpo/engine/quantize.py the
// reference and the reasons): encoding, decoding and the stochastic rounding's random bits.
//
// Not a header of its own: kernels_isa.cc includes it inside its instruction-set namespace, after
// Bits/FromBits, so that these loops are compiled once per instruction set with the AdamW loops
// that call them.
#ifndef JAX_MLPO_ISA_NS
#error "q8_isa.h is included by kernels_isa.cc only"
#endif

// Chris Wellons' lowbias32: a cheap integer hash with good avalanche; a stochastic rounding's
// seed goes through it once per call.
inline uint32_t Lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// Below 2^-90 a block is stored as zeros: its decoded values would be float32 denormals, and a
// moment that small moves nothing (sqrt(2^-90) = 2^-45 is far below any eps).
constexpr uint32_t kQ8FlushBits = (127u - 90u) << 23;
// Above 2^126 (a non-finite or absurd moment) the block's scale is NaN: every element decodes
// to NaN, as a float32 moment would propagate one.
constexpr uint32_t kQ8MaxBits = (127u + 126u) << 23;

template <bool kSigned>
struct Q8Code {
  static constexpr uint32_t kBias = kSigned ? kQ8BiasSigned : kQ8BiasUnsigned;
  static constexpr uint32_t kTop = kSigned ? 127u : 255u;
  // The random bits of a stochastic rounding: each element's hash gives m the low 16 bits and
  // v the high 16, shifted to the 20 bits the code drops (the rounding is then unbiased to
  // 2^-16 of a code's step).
  static uint32_t RandomBits(uint32_t h) { return kSigned ? (h & 0xffffu) << 4 : h >> 16 << 4; }
};

// An element's hash in a seeded stream: key (the seed through lowbias32, so a different one
// each step and segment) plus the index, through one multiply and a fold. Consecutive elements'
// bits are related (a Weyl sequence), but each element's across steps are as random as the key.
inline uint32_t ElementHash(uint32_t key, uint32_t index) {
  const uint32_t h = (key + index) * 0x9e3779b1u;
  return h ^ (h >> 16);
}

inline uint32_t AbsBits(float x) { return Bits(x) & 0x7fffffffu; }

// A block's scale from the bits of its largest magnitude, and the multiplier to apply to its
// values. False for a block stored without codes (n zero codes, the scale 0 below 2^-90 and NaN
// above 2^126 or for a non-finite value), which it writes.
inline bool Q8Scale(uint32_t amax, size_t n, uint8_t* __restrict codes, float* __restrict scale,
                    float* inv) {
  if (amax < kQ8FlushBits || amax > kQ8MaxBits) {
    std::memset(codes, 0, n);
    *scale = amax < kQ8FlushBits ? 0.0f : FromBits(0x7fc00000u);
    return false;
  }
  // The scale 2^e is the smallest power of two >= amax, so every |x| / 2^e is in [0, 1] and
  // computed exactly (as is the decode's product): a decoded block re-encodes to itself.
  const uint32_t e = (amax >> 23) + ((amax & 0x7fffffu) != 0 ? 1u : 0u);
  *scale = FromBits(e << 23);
  *inv = FromBits((254u - e) << 23);
  return true;
}

// One element's code from its bits, its block's multiplier and the rounding's addend: 2^19
// rounds the 3-bit mantissa to nearest (ties away from zero); 20 random bits round up with
// probability equal to the dropped fraction (unbiased).
template <bool kSigned>
inline uint8_t EncodeQ8(uint32_t xb, float inv, uint32_t add) {
  using Code = Q8Code<kSigned>;
  const uint32_t r = Bits(FromBits(xb & 0x7fffffffu) * inv);
  const uint32_t q = (r + add) >> 20;
  const uint32_t u = q > Code::kBias ? std::min(q - Code::kBias, Code::kTop) : 0u;
  if constexpr (kSigned) {
    return uint8_t(u | (u != 0 ? (xb >> 24) & 0x80u : 0u));
  } else {
    // A positive v never becomes 0 (the update would divide by eps alone): the smallest code
    // stands in for anything below it.
    return uint8_t(r != 0 && u == 0 ? 1u : u);
  }
}

// Encodes n <= kQ8Block values whose largest magnitude has bits amax. key: the hashed seed; first:
// x[0]'s index in the stream.
// (The encode and decode loops are not inlined into the AdamW variants: one copy each keeps the
// build time of the 128 variants that call them near the float32 table's.)
template <bool kSigned, bool kStochastic>
__attribute__((noinline)) void EncodeQ8Values(const float* __restrict x, size_t n, uint32_t amax,
                           uint8_t* __restrict codes, float* __restrict scale, uint32_t key,
                           uint32_t first) {
  float inv;
  if (!Q8Scale(amax, n, codes, scale, &inv)) return;
  for (size_t i = 0; i < n; ++i) {
    uint32_t add = 1u << 19;
    if constexpr (kStochastic) {
      add = Q8Code<kSigned>::RandomBits(ElementHash(key, first + uint32_t(i)));
    }
    codes[i] = EncodeQ8<kSigned>(Bits(x[i]), inv, add);
  }
}

// Both moments of a block in one loop, one hash per element for both (the fused kernel's).
template <bool kStochastic>
__attribute__((noinline)) void EncodeQ8Moments(const float* __restrict m,
                                               const float* __restrict v, size_t n,
                            uint32_t m_amax, uint32_t v_amax, uint8_t* __restrict mc,
                            float* __restrict ms, uint8_t* __restrict vc, float* __restrict vs,
                            uint32_t key, uint32_t first) {
  float m_inv, v_inv;
  const bool m_coded = Q8Scale(m_amax, n, mc, ms, &m_inv);
  const bool v_coded = Q8Scale(v_amax, n, vc, vs, &v_inv);
  if (!m_coded || !v_coded) {  // a zero or NaN block: the other one alone
    if (m_coded) EncodeQ8Values<true, kStochastic>(m, n, m_amax, mc, ms, key, first);
    if (v_coded) EncodeQ8Values<false, kStochastic>(v, n, v_amax, vc, vs, key, first);
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    uint32_t m_add = 1u << 19, v_add = 1u << 19;
    if constexpr (kStochastic) {
      const uint32_t h = ElementHash(key, first + uint32_t(i));
      m_add = Q8Code<true>::RandomBits(h);
      v_add = Q8Code<false>::RandomBits(h);
    }
    mc[i] = EncodeQ8<true>(Bits(m[i]), m_inv, m_add);
    vc[i] = EncodeQ8<false>(Bits(v[i]), v_inv, v_add);
  }
}

template <bool kSigned>
inline float DecodeQ8(uint8_t code, float scale) {
  const uint32_t c = code;
  const uint32_t u = kSigned ? c & 0x7fu : c;
  uint32_t b = u != 0 ? (u + Q8Code<kSigned>::kBias) << 20 : 0u;
  if constexpr (kSigned) b |= (c & 0x80u) << 24;
  return FromBits(b) * scale;
}

template <bool kSigned, bool kStochastic>
void Q8EncodeRange(const float* x, size_t n, uint8_t* codes, float* scales, uint32_t key,
                   size_t first) {
  for (size_t lo = 0; lo < n; lo += kQ8Block) {
    const size_t len = std::min(kQ8Block, n - lo);
    uint32_t amax = 0;
    for (size_t i = 0; i < len; ++i) amax = std::max(amax, AbsBits(x[lo + i]));
    EncodeQ8Values<kSigned, kStochastic>(x + lo, len, amax, codes + lo, scales + lo / kQ8Block,
                                         key, uint32_t(first + lo));
  }
}

void Q8EncodeLoop(const float* x, size_t n, uint8_t* codes, float* scales, bool is_signed,
                  bool stochastic, uint32_t seed, size_t first) {
  const uint32_t key = Lowbias32(seed);
  if (is_signed) {
    (stochastic ? Q8EncodeRange<true, true> : Q8EncodeRange<true, false>)(x, n, codes, scales,
                                                                          key, first);
  } else {
    (stochastic ? Q8EncodeRange<false, true> : Q8EncodeRange<false, false>)(x, n, codes, scales,
                                                                            key, first);
  }
}

template <bool kSigned>
void Q8DecodeRange(const uint8_t* __restrict codes, const float* __restrict scales, size_t n,
                   float* __restrict out) {
  for (size_t lo = 0; lo < n; lo += kQ8Block) {
    const size_t len = std::min(kQ8Block, n - lo);
    const float scale = scales[lo / kQ8Block];
    for (size_t i = 0; i < len; ++i) out[lo + i] = DecodeQ8<kSigned>(codes[lo + i], scale);
  }
}

void Q8DecodeLoop(const uint8_t* codes, const float* scales, size_t n, float* out,
                  bool is_signed) {
  (is_signed ? Q8DecodeRange<true> : Q8DecodeRange<false>)(codes, scales, n, out);
}
