// CRC-32C (Castagnoli), the checksum the file tiers store for every chunk of a blob.
//
// x86-64 with SSE4.2 uses the crc32 instruction (8 bytes per instruction); anything else uses a
// slicing-by-8 table. Both give the standard CRC-32C (same as zarr3's crc32c codec and
// google-crc32c), so a checksum can be verified by any other implementation.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "io.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <nmmintrin.h>
#define JAX_MLPO_CRC_HW 1
#endif

namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct Tables {
  uint32_t t[8][256];
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  }
};

const Tables& Table() {
  static const Tables tables;
  return tables;
}

uint32_t Crc32cSoftware(uint32_t crc, const uint8_t* p, size_t n) {
  const Tables& tb = Table();
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);  // little-endian hosts only (x86-64, aarch64)
    word ^= crc;
    crc = tb.t[7][word & 0xFF] ^ tb.t[6][(word >> 8) & 0xFF] ^ tb.t[5][(word >> 16) & 0xFF] ^
          tb.t[4][(word >> 24) & 0xFF] ^ tb.t[3][(word >> 32) & 0xFF] ^
          tb.t[2][(word >> 40) & 0xFF] ^ tb.t[1][(word >> 48) & 0xFF] ^ tb.t[0][word >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ tb.t[0][(crc ^ *p++) & 0xFF];
  return crc;
}

#ifdef JAX_MLPO_CRC_HW
__attribute__((target("sse4.2"))) uint32_t Crc32cHardware(uint32_t crc, const uint8_t* p,
                                                          size_t n) {
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}

bool HasSse42() {
  unsigned a, b, c, d;
  return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_SSE4_2);
}
#endif

}  // namespace

namespace jax_mlpo {

uint32_t Crc32c(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
#ifdef JAX_MLPO_CRC_HW
  static const bool hw = HasSse42();
  if (hw) return ~::Crc32cHardware(crc, p, n);
#endif
  return ~Crc32cSoftware(crc, p, n);
}

bool Crc32cHardware() {
#ifdef JAX_MLPO_CRC_HW
  return HasSse42();
#else
  return false;
#endif
}

}  // namespace jax_mlpo
