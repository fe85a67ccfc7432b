// Host kernels of jax_mlpo: fused AdamW, Lion and Muon's host passes, a jax.numpy rule's tile
// program (rule.h), bf16 <-> fp32 conversion, the 8-bit blockwise moment code, STREAM triad,
// parallel copy.
//
// The loops live in kernels_isa.cc, which CMake compiles once per instruction set (baseline
// x86-64, AVX2, AVX-512); kernels.cc picks one table at load time with cpuid, splits large calls
// over the thread pool (thread_pool.cc); kernel_bindings.cc binds them to Python.
#ifndef JAX_MLPO_FFI_KERNELS_H_
#define JAX_MLPO_FFI_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "rule.h"

namespace jax_mlpo {

// One AdamW step over n contiguous elements. Unused optional pointers are null. The scalars are
// float32 values prepared exactly as the numpy reference does (jax_mlpo/kernels.py).
struct AdamWArgs {
  void* m;                         // in/out: float32, bfloat16 (mu_bf16) or 8-bit codes (mu_q8)
  void* v;                         // in/out: float32, bfloat16 (nu_bf16) or 8-bit codes (nu_q8)
  float* m_scale;                  // in/out with mu_q8: a scale per kQ8Block elements of m
  float* v_scale;                  // the same for v (nu_q8)
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
  float bc1_next;                  // nesterov: 1 - b1^(t+1), the next step's bias correction
  float b1_blend;                  // nesterov: f32(b1) (b1 above is as applied to m)
  bool grad_bf16;
  bool mu_bf16;                    // m is stored in bfloat16: read widened, written rounded
  bool nu_bf16;                    // the same for v
  bool mu_q8;                      // m is 8-bit blockwise (q8): decoded, updated, re-encoded
  bool nu_q8;                      // the same for v
  bool stochastic;                 // q8 codes are rounded stochastically (else to nearest)
  uint32_t seed;                   // the stochastic rounding's seed (this call's elements)
  bool has_wd;                     // weight_decay != 0 (adding 0 * p is not a no-op for -0, inf)
  bool update_param;
  bool nesterov;                   // optax's nesterov=True (float32 or bfloat16 moments only)
};

// Output mode of the update: none, the AdamW update u, p_new - f32(delta_base), or that delta in
// bfloat16, bf16(bf16(p_new) - delta_base) (the update in the params' dtype).
enum AdamWOut : int { kOutNone = 0, kOutUpdate = 1, kOutDelta = 2, kOutDeltaBf16 = 3 };

using AdamWRangeFn = void (*)(const AdamWArgs&, size_t begin, size_t end);

// One Lion step over n contiguous elements (optax.lion: scale_by_lion, add_decayed_weights,
// scale_by_learning_rate), with AdamWArgs's outputs. The scalars are float32 values prepared
// exactly as the numpy reference does (jax_mlpo/optimizers/lion.py).
struct LionArgs {
  void* m;                     // in/out: float32 or bfloat16 (mu_bf16)
  const void* grad;            // float32 or bfloat16 (grad_bf16)
  float* param;                // read; written when update_param
  float* update_out;           // optional
  const uint16_t* delta_base;  // optional bfloat16; needs update_out
  uint16_t* param_bf16_out;    // optional
  uint16_t* update_bf16;       // optional bfloat16 update (needs delta_base, no update_out)
  float c1, b1, c2, b2;        // c1 = f32(1 - b1), c2 = f32(1 - b2); b1, b2 as applied to m
  float wd, neg_lr;
  bool grad_bf16;
  bool mu_bf16;
  bool has_wd;
  bool update_param;
};

using LionRangeFn = void (*)(const LionArgs&, size_t begin, size_t end);

// Muon's host passes (optax.contrib.scale_by_muon; the orthogonalization runs on the device
// between them). The momentum pass advances m and writes the float32 momentum the device
// orthogonalizes: m_hat = m / bc, or with nesterov b m / bc_next + (1 - b) g / bc. The scalars
// are float32 values prepared exactly as the numpy reference does (jax_mlpo/optimizers/muon.py).
struct MomentumArgs {
  void* m;                     // in/out: float32 or bfloat16 (mu_bf16)
  const void* grad;            // float32 or bfloat16 (grad_bf16)
  float* out;                  // float32 m_hat; may be grad's own buffer (float32 grad)
  float c, b;                  // c = f32(1 - beta); b = beta as applied to m (moment_decay)
  float beta;                  // f32(beta), for the nesterov blend
  float bc, bc_next;           // bias corrections 1 - beta^t, 1 - beta^(t+1)
  bool grad_bf16;
  bool mu_bf16;
  bool nesterov;
};

using MomentumRangeFn = void (*)(const MomentumArgs&, size_t begin, size_t end);

constexpr int MomentumIndex(bool grad_bf16, bool mu_bf16, bool nesterov) {
  return int(grad_bf16) | int(mu_bf16) << 1 | int(nesterov) << 2;
}
constexpr size_t kMomentumVariants = 8;

// The master pass of bfloat16 params: u = -lr (d + wd p) from the orthogonalized direction d,
// applied to the float32 master, with AdamWArgs's outputs.
struct ApplyArgs {
  const float* direction;      // float32; may be update_out's own buffer
  float* param;                // read; written when update_param
  float* update_out;           // optional
  const uint16_t* delta_base;  // optional bfloat16; needs update_out
  uint16_t* param_bf16_out;    // optional
  uint16_t* update_bf16;       // optional bfloat16 update (needs delta_base, no update_out)
  float wd, neg_lr;
  bool has_wd;
  bool update_param;
};

using ApplyRangeFn = void (*)(const ApplyArgs&, size_t begin, size_t end);

constexpr int ApplyIndex(bool has_wd, bool update_param, bool bf16_out, int out) {
  return int(has_wd) | int(update_param) << 1 | int(bf16_out) << 2 | out << 3;
}
constexpr size_t kApplyVariants = 32;

constexpr int LionIndex(bool grad_bf16, bool has_wd, bool update_param, bool bf16_out, int out,
                        bool mu_bf16) {
  return int(grad_bf16) | int(has_wd) << 1 | int(update_param) << 2 | int(bf16_out) << 3 |
         out << 4 | int(mu_bf16) << 6;
}
constexpr size_t kLionVariants = 128;

// The 8-bit blockwise moment (q8, jax_mlpo/engine/quantize.py has the reference and the reasons): blocks
// of kQ8Block elements from the start of each call's range, a power-of-two float32 scale per
// block (the smallest at or above the block's largest magnitude), and per element a float with 3
// mantissa bits relative to that scale: m signed (sign bit and a 7-bit magnitude code, 2^-16..1),
// v unsigned (8-bit magnitude code, 2^-32..1). A magnitude code u > 0 stands for the float32
// whose bits are (u + bias) << 20.
constexpr size_t kQ8Block = 256;
constexpr uint32_t kQ8BiasSigned = 889;    // (127 << 3) - 127: code 127 is 1.0
constexpr uint32_t kQ8BiasUnsigned = 761;  // (127 << 3) - 255: code 255 is 1.0
using Q8EncodeFn = void (*)(const float* x, size_t n, uint8_t* codes, float* scales,
                            bool is_signed, bool stochastic, uint32_t seed, size_t first);
using Q8DecodeFn = void (*)(const uint8_t* codes, const float* scales, size_t n, float* out,
                            bool is_signed);

// The loops of one instruction set. adamw is indexed by AdamWIndex().
struct KernelTable {
  const char* isa;
  AdamWRangeFn adamw[512];         // bit 8 of the index: nesterov
  AdamWRangeFn adamw_blocked[64];  // one moment q8: indexed by AdamWIndex's low 6 bits
  AdamWRangeFn adamw_q8[64];       // both q8: the same index
  Q8EncodeFn q8_encode;
  Q8DecodeFn q8_decode;
  void (*bf16_to_f32)(const uint16_t* src, float* dst, size_t n);
  void (*f32_to_bf16)(const float* src, uint16_t* dst, size_t n);
  void (*triad)(float* a, const float* b, const float* c, float s, size_t n);
  LionRangeFn (*lion)(int index);  // the loop of a LionIndex() (lion_isa.cc)
  MomentumRangeFn (*momentum)(int index);  // a MomentumIndex()'s loop (muon_isa.cc)
  ApplyRangeFn (*apply)(int index);        // an ApplyIndex()'s loop (muon_isa.cc)
  RuleRangeFn (*rule)();                   // the tile program's interpreter (rule_isa.cc)
};

constexpr int AdamWIndex(bool grad_bf16, bool has_wd, bool update_param, bool bf16_out, int out,
                         bool mu_bf16, bool nu_bf16, bool nesterov = false) {
  return int(grad_bf16) | int(has_wd) << 1 | int(update_param) << 2 | int(bf16_out) << 3 |
         out << 4 | int(mu_bf16) << 6 | int(nu_bf16) << 7 | int(nesterov) << 8;
}

namespace isa_base { const KernelTable& Table(); }
namespace isa_avx2 { const KernelTable& Table(); }
namespace isa_avx512 { const KernelTable& Table(); }

// The table in use: the best this CPU runs, unless JAX_MLPO_ISA=base|avx2 or SetIsa chose
// another.
const KernelTable& Kernels();
const char* Isa();
// Switches to "base", "avx2" or "avx512" ("" or null: the best available) for tests and
// benchmarks; false if this CPU or build lacks it. Not meant to race with running kernels.
bool SetIsa(const char* name);

// Multi-threaded drivers used by both the Python bindings and the XLA FFI handlers. They run with
// IEEE floating point (no flush-to-zero), whatever the calling thread's MXCSR says.
void AdamW(const AdamWArgs& args, size_t n);
void Lion(const LionArgs& args, size_t n);
void Momentum(const MomentumArgs& args, size_t n);
void Apply(const ApplyArgs& args, size_t n);
void Bf16ToF32(const uint16_t* src, float* dst, size_t n);
// n elements in blocks of kQ8Block from x's start; `first` numbers x[0] for the random stream.
void Q8Encode(const float* x, size_t n, uint8_t* codes, float* scales, bool is_signed,
              bool stochastic, uint32_t seed);
void Q8Decode(const uint8_t* codes, const float* scales, size_t n, float* out, bool is_signed);
void F32ToBf16(const float* src, uint16_t* dst, size_t n);
void Triad(float* a, const float* b, const float* c, float s, size_t n);
// A tile program (rule.h) over n elements of its arrays.
void Rule(const RuleArgs& args, size_t n);
void Copy(void* dst, const void* src, size_t nbytes);

}  // namespace jax_mlpo

#endif  // JAX_MLPO_FFI_KERNELS_H_
