// Host kernels of jax_mlpo: fused AdamW, bf16 <-> fp32 conversion, STREAM triad, parallel copy.
//
// The loops live in kernels_isa.cc, which CMake compiles once per instruction set (baseline
// x86-64, AVX2, AVX-512); kernels.cc picks one table at load time with cpuid, splits large calls
// over a thread pool and exports the C entry points that Python loads with ctypes.
#ifndef JAX_MLPO_FFI_KERNELS_H_
#define JAX_MLPO_FFI_KERNELS_H_

#include <cstddef>
#include <cstdint>

namespace jax_mlpo {

// One AdamW step over n contiguous elements. Unused optional pointers are null. The scalars are
// float32 values prepared exactly as the numpy reference does (jax_mlpo/kernels.py).
struct AdamWArgs {
  void* m;                         // in/out: float32, or bfloat16 (mu_bf16)
  void* v;                         // in/out: float32, or bfloat16 (nu_bf16)
  const void* grad;                // float32 or bfloat16 (grad_bf16)
  float* param;                    // read; written when update_param
  float* update_out;               // optional
  const uint16_t* delta_base;      // optional bfloat16; needs update_out
  uint16_t* param_bf16_out;        // optional
  uint16_t* update_bf16;           // optional bfloat16 update (needs delta_base, no update_out)
  float c1, b1, c2, b2;            // c1 = f32(1 - b1), c2 = f32(1 - b2)
  float bc1, bc2;                  // bias corrections; the loop multiplies by 1.0f / bc
  float eps, wd, neg_lr;
  float grad_scale;                // 1 when the reference skips the scaling (same bits)
  bool grad_bf16;
  bool mu_bf16;                    // m is stored in bfloat16: read widened, written rounded
  bool nu_bf16;                    // the same for v
  bool has_wd;                     // weight_decay != 0 (adding 0 * p is not a no-op for -0, inf)
  bool update_param;
};

// Output mode of the update: none, the AdamW update u, p_new - f32(delta_base), or that delta in
// bfloat16, bf16(bf16(p_new) - delta_base) (the update in the params' dtype).
enum AdamWOut : int { kOutNone = 0, kOutUpdate = 1, kOutDelta = 2, kOutDeltaBf16 = 3 };

using AdamWRangeFn = void (*)(const AdamWArgs&, size_t begin, size_t end);

// The loops of one instruction set. adamw is indexed by AdamWIndex().
struct KernelTable {
  const char* isa;
  AdamWRangeFn adamw[256];
  void (*bf16_to_f32)(const uint16_t* src, float* dst, size_t n);
  void (*f32_to_bf16)(const float* src, uint16_t* dst, size_t n);
  void (*triad)(float* a, const float* b, const float* c, float s, size_t n);
};

constexpr int AdamWIndex(bool grad_bf16, bool has_wd, bool update_param, bool bf16_out, int out,
                         bool mu_bf16, bool nu_bf16) {
  return int(grad_bf16) | int(has_wd) << 1 | int(update_param) << 2 | int(bf16_out) << 3 |
         out << 4 | int(mu_bf16) << 6 | int(nu_bf16) << 7;
}

namespace isa_base { const KernelTable& Table(); }
namespace isa_avx2 { const KernelTable& Table(); }
namespace isa_avx512 { const KernelTable& Table(); }

// The table in use: the best this CPU runs, unless JAX_MLPO_ISA=base|avx2 or jax_mlpo_set_isa
// chose another.
const KernelTable& Kernels();

// Multi-threaded drivers used by both the ctypes API and the XLA FFI handlers. They run with
// IEEE floating point (no flush-to-zero), whatever the calling thread's MXCSR says.
void AdamW(const AdamWArgs& args, size_t n);
void Bf16ToF32(const uint16_t* src, float* dst, size_t n);
void F32ToBf16(const float* src, uint16_t* dst, size_t n);
void Triad(float* a, const float* b, const float* c, float s, size_t n);
void Copy(void* dst, const void* src, size_t nbytes);

}  // namespace jax_mlpo

#endif  // JAX_MLPO_FFI_KERNELS_H_
