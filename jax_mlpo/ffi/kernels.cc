// Instruction-set dispatch, the kernels' multi-threaded drivers and the C entry points loaded
// with ctypes.
#include "kernels.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "thread_pool.h"

#if defined(__x86_64__) || defined(_M_X64)
#define JAX_MLPO_X86 1
#endif

namespace jax_mlpo {
namespace {

// Calls below this many elements run on the calling thread: waking the pool costs ~10-50 us.
constexpr size_t kMinParallelElems = size_t{1} << 16;
constexpr size_t kChunkAlignElems = 256;       // chunk starts stay cache-line aligned
constexpr size_t kMinParallelBytes = size_t{1} << 20;
constexpr size_t kChunkAlignBytes = 4096;

// The table for `want` ("base", "avx2", "avx512"; empty: the best this CPU runs), or null if
// this CPU or build lacks it.
const KernelTable* FindKernels(const std::string& want) {
#ifdef JAX_MLPO_X86
#ifdef JAX_MLPO_HAVE_AVX512
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (avx512 && (want.empty() || want == "avx512")) return &isa_avx512::Table();
#endif
#ifdef JAX_MLPO_HAVE_AVX2
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2 && (want.empty() || want == "avx2")) return &isa_avx2::Table();
#endif
#endif
  if (want.empty() || want == "base") return &isa_base::Table();
  return nullptr;
}

// Chosen once; JAX_MLPO_ISA=base|avx2 forces a lesser one (an unavailable one is ignored).
const KernelTable* InitialKernels() {
  const char* env = std::getenv("JAX_MLPO_ISA");
  const KernelTable* forced = env ? FindKernels(env) : nullptr;
  return forced ? forced : FindKernels("");
}

std::atomic<const KernelTable*> g_kernels{InitialKernels()};

// Where a call's update goes (AdamWOut), from which of the optional outputs it was given.
template <typename Args>
int OutMode(const Args& a) {
  return a.update_bf16 != nullptr   ? kOutDeltaBf16
         : a.update_out == nullptr  ? kOutNone
         : a.delta_base != nullptr  ? kOutDelta
                                    : kOutUpdate;
}

}  // namespace

const KernelTable& Kernels() { return *g_kernels.load(std::memory_order_acquire); }

void AdamW(const AdamWArgs& args, size_t n) {
  const int out = OutMode(args);
  const int index = AdamWIndex(args.grad_bf16, args.has_wd, args.update_param,
                               args.param_bf16_out != nullptr, out, args.mu_bf16, args.nu_bf16,
                               args.nesterov);
  const KernelTable& table = Kernels();
  const AdamWRangeFn fn = args.mu_q8 && args.nu_q8   ? table.adamw_q8[index & 63]
                          : args.mu_q8 || args.nu_q8 ? table.adamw_blocked[index & 63]
                                                     : table.adamw[index];
  static_assert(kChunkAlignElems % kQ8Block == 0, "chunks must start on a q8 block");
  ParallelFor(n, kMinParallelElems, kChunkAlignElems,
              [&](size_t b, size_t e) { fn(args, b, e); });
}

void Lion(const LionArgs& args, size_t n) {
  const int out = OutMode(args);
  const LionRangeFn fn = Kernels().lion(LionIndex(args.grad_bf16, args.has_wd, args.update_param,
                                                  args.param_bf16_out != nullptr, out,
                                                  args.mu_bf16));
  ParallelFor(n, kMinParallelElems, kChunkAlignElems,
              [&](size_t b, size_t e) { fn(args, b, e); });
}

void Momentum(const MomentumArgs& args, size_t n) {
  const MomentumRangeFn fn =
      Kernels().momentum(MomentumIndex(args.grad_bf16, args.mu_bf16, args.nesterov));
  ParallelFor(n, kMinParallelElems, kChunkAlignElems,
              [&](size_t b, size_t e) { fn(args, b, e); });
}

void Apply(const ApplyArgs& args, size_t n) {
  const int out = OutMode(args);
  const ApplyRangeFn fn = Kernels().apply(
      ApplyIndex(args.has_wd, args.update_param, args.param_bf16_out != nullptr, out));
  ParallelFor(n, kMinParallelElems, kChunkAlignElems,
              [&](size_t b, size_t e) { fn(args, b, e); });
}

void Q8Encode(const float* x, size_t n, uint8_t* codes, float* scales, bool is_signed,
              bool stochastic, uint32_t seed) {
  auto fn = Kernels().q8_encode;
  ParallelFor(n, kMinParallelElems, kChunkAlignElems, [&](size_t b, size_t e) {
    fn(x + b, e - b, codes + b, scales + b / kQ8Block, is_signed, stochastic, seed, b);
  });
}

void Q8Decode(const uint8_t* codes, const float* scales, size_t n, float* out, bool is_signed) {
  auto fn = Kernels().q8_decode;
  ParallelFor(n, kMinParallelElems, kChunkAlignElems, [&](size_t b, size_t e) {
    fn(codes + b, scales + b / kQ8Block, e - b, out + b, is_signed);
  });
}

void Bf16ToF32(const uint16_t* src, float* dst, size_t n) {
  auto fn = Kernels().bf16_to_f32;
  ParallelFor(n, kMinParallelElems, kChunkAlignElems,
              [&](size_t b, size_t e) { fn(src + b, dst + b, e - b); });
}

void F32ToBf16(const float* src, uint16_t* dst, size_t n) {
  auto fn = Kernels().f32_to_bf16;
  ParallelFor(n, kMinParallelElems, kChunkAlignElems,
              [&](size_t b, size_t e) { fn(src + b, dst + b, e - b); });
}

void Triad(float* a, const float* b, const float* c, float s, size_t n) {
  auto fn = Kernels().triad;
  ParallelFor(n, kMinParallelElems, kChunkAlignElems,
              [&](size_t lo, size_t hi) { fn(a + lo, b + lo, c + lo, s, hi - lo); });
}

void Copy(void* dst, const void* src, size_t nbytes) {
  auto* d = static_cast<char*>(dst);
  auto* s = static_cast<const char*>(src);
  ParallelFor(nbytes, kMinParallelBytes, kChunkAlignBytes,
              [&](size_t b, size_t e) { std::memcpy(d + b, s + b, e - b); });
}

}  // namespace jax_mlpo

// ---- C entry points (ctypes releases the GIL around each call) ----------------------------------

#include "kernel_entry.h"  // the entry points' argument checks and outputs

extern "C" {

const char* jax_mlpo_isa(void) { return jax_mlpo::Kernels().isa; }

// Switches the loops to another instruction set (tests, benchmarks); "" picks the best one.
// Returns 0, or -1 if this CPU or build lacks it. Not meant to race with running kernels.
int jax_mlpo_set_isa(const char* name) {
  const jax_mlpo::KernelTable* table = jax_mlpo::FindKernels(name ? name : "");
  if (table == nullptr) return -1;
  jax_mlpo::g_kernels.store(table, std::memory_order_release);
  return 0;
}

int jax_mlpo_num_threads(void) { return jax_mlpo::NumThreads(); }

// n <= 0 restores the default (JAX_MLPO_NUM_THREADS, else the CPUs this process may use).
int jax_mlpo_set_num_threads(int n) { return jax_mlpo::SetNumThreads(n); }

// scalars: c1, b1, c2, b2, bc1, bc2, eps, weight_decay, -lr, grad_scale, bc1_next, f32(b1)
// (float32, prepared by jax_mlpo.native exactly as the numpy reference computes them; the last
// two for nesterov). update_out is float32, or
// bfloat16 when update_bf16 (which needs delta_base); it may be the gradient's own buffer (same
// address and width: the update then overwrites the gradient it is computed from), but no other
// written array may overlap anything. moments: bits 0 and 1, m and v are bfloat16; bits 2 and 3,
// m and v are q8 (codes, with m_scale / v_scale: one float32 per 256 elements); bit 4, q8 codes
// are rounded stochastically with `seed` (else to nearest); bit 5, nesterov (not with q8).
// Returns 0 or an error code.
int jax_mlpo_adamw_step(void* m, void* v, int moments, float* m_scale, float* v_scale,
                        uint32_t seed, const void* grad, int grad_bf16, float* param,
                        int update_param, void* update_out, int update_bf16,
                        const uint16_t* delta_base, uint16_t* param_bf16_out, int64_t n,
                        const float* scalars, int has_wd) {
  if (n < 0) return kErrSize;
  if (n == 0) return kOk;
  if (!m || !v || !grad || !param || !scalars) return kErrNull;
  if (delta_base && !update_out) return kErrDeltaWithoutOut;
  if (update_bf16 && !delta_base) return kErrBf16WithoutDelta;
  const size_t f = size_t(n) * 4, h = size_t(n) * 2, q = size_t(n);
  const size_t scales = (size_t(n) + jax_mlpo::kQ8Block - 1) / jax_mlpo::kQ8Block * 4;
  const bool in_place = update_out == grad && (grad_bf16 != 0) == (update_bf16 != 0);
  const bool mu_bf16 = (moments & 1) != 0, nu_bf16 = (moments & 2) != 0;
  const bool mu_q8 = (moments & 4) != 0, nu_q8 = (moments & 8) != 0;
  if ((mu_q8 && (mu_bf16 || !m_scale)) || (nu_q8 && (nu_bf16 || !v_scale))) return kErrNull;
  const bool nesterov = (moments & 32) != 0;
  if (nesterov && (mu_q8 || nu_q8)) return kErrNesterovQ8;
  const Range ranges[] = {
      {static_cast<const char*>(m), mu_q8 ? q : mu_bf16 ? h : f, true},
      {static_cast<const char*>(v), nu_q8 ? q : nu_bf16 ? h : f, true},
      {static_cast<const char*>(grad), grad_bf16 ? h : f, false},
      {reinterpret_cast<const char*>(param), f, update_param != 0},
      {static_cast<const char*>(update_out), update_bf16 ? h : f, true},
      {reinterpret_cast<const char*>(delta_base), h, false},
      {reinterpret_cast<const char*>(param_bf16_out), h, true},
      {reinterpret_cast<const char*>(mu_q8 ? m_scale : nullptr), scales, true},
      {reinterpret_cast<const char*>(nu_q8 ? v_scale : nullptr), scales, true},
  };
  if (AnyOverlap(ranges, in_place, /*grad=*/2, /*update=*/4)) return kErrOverlap;
  jax_mlpo::AdamWArgs a{};
  a.m = m;
  a.v = v;
  a.m_scale = m_scale;
  a.v_scale = v_scale;
  a.mu_q8 = mu_q8;
  a.nu_q8 = nu_q8;
  a.stochastic = (moments & 16) != 0;
  a.seed = seed;
  a.grad = grad;
  a.param = param;
  SetOutputs(a, update_out, update_bf16, delta_base, param_bf16_out);
  a.c1 = scalars[0];
  a.b1 = scalars[1];
  a.c2 = scalars[2];
  a.b2 = scalars[3];
  a.bc1 = scalars[4];
  a.bc2 = scalars[5];
  a.eps = scalars[6];
  a.wd = scalars[7];
  a.neg_lr = scalars[8];
  a.grad_scale = scalars[9];
  a.bc1_next = scalars[10];
  a.b1_blend = scalars[11];
  a.nesterov = nesterov;
  a.grad_bf16 = grad_bf16 != 0;
  a.mu_bf16 = mu_bf16;
  a.nu_bf16 = nu_bf16;
  a.has_wd = has_wd != 0;
  a.update_param = update_param != 0;
  jax_mlpo::AdamW(a, size_t(n));
  return kOk;
}

// Lion's step with jax_mlpo_adamw_step's outputs and checks. scalars: c1, b1, c2, b2,
// weight_decay, -lr (float32, prepared by jax_mlpo.native exactly as the numpy reference does).
// mu_bf16: m is bfloat16. Returns 0 or an error code.
int jax_mlpo_lion_step(void* m, int mu_bf16, const void* grad, int grad_bf16, float* param,
                       int update_param, void* update_out, int update_bf16,
                       const uint16_t* delta_base, uint16_t* param_bf16_out, int64_t n,
                       const float* scalars, int has_wd) {
  if (n < 0) return kErrSize;
  if (n == 0) return kOk;
  if (!m || !grad || !param || !scalars) return kErrNull;
  if (delta_base && !update_out) return kErrDeltaWithoutOut;
  if (update_bf16 && !delta_base) return kErrBf16WithoutDelta;
  const size_t f = size_t(n) * 4, h = size_t(n) * 2;
  const bool in_place = update_out == grad && (grad_bf16 != 0) == (update_bf16 != 0);
  const Range ranges[] = {
      {static_cast<const char*>(m), mu_bf16 ? h : f, true},
      {static_cast<const char*>(grad), grad_bf16 ? h : f, false},
      {reinterpret_cast<const char*>(param), f, update_param != 0},
      {static_cast<const char*>(update_out), update_bf16 ? h : f, true},
      {reinterpret_cast<const char*>(delta_base), h, false},
      {reinterpret_cast<const char*>(param_bf16_out), h, true},
  };
  if (AnyOverlap(ranges, in_place, /*grad=*/1, /*update=*/3)) return kErrOverlap;
  jax_mlpo::LionArgs a{};
  a.m = m;
  a.grad = grad;
  a.param = param;
  SetOutputs(a, update_out, update_bf16, delta_base, param_bf16_out);
  a.c1 = scalars[0];
  a.b1 = scalars[1];
  a.c2 = scalars[2];
  a.b2 = scalars[3];
  a.wd = scalars[4];
  a.neg_lr = scalars[5];
  a.grad_bf16 = grad_bf16 != 0;
  a.mu_bf16 = mu_bf16 != 0;
  a.has_wd = has_wd != 0;
  a.update_param = update_param != 0;
  jax_mlpo::Lion(a, size_t(n));
  return kOk;
}

void jax_mlpo_bf16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  if (n > 0) jax_mlpo::Bf16ToF32(src, dst, size_t(n));
}

void jax_mlpo_f32_to_bf16(const float* src, uint16_t* dst, int64_t n) {
  if (n > 0) jax_mlpo::F32ToBf16(src, dst, size_t(n));
}

// q8 codes and scales (one per 256 elements) of n float32 values, and back; is_signed: m's code
// (else v's); stochastic rounding with `seed` (the element index in x counts from 0).
void jax_mlpo_q8_encode(const float* x, int64_t n, uint8_t* codes, float* scales, int is_signed,
                        int stochastic, uint32_t seed) {
  if (n > 0) jax_mlpo::Q8Encode(x, size_t(n), codes, scales, is_signed, stochastic, seed);
}

void jax_mlpo_q8_decode(const uint8_t* codes, const float* scales, int64_t n, float* out,
                        int is_signed) {
  if (n > 0) jax_mlpo::Q8Decode(codes, scales, size_t(n), out, is_signed);
}

void jax_mlpo_triad(float* a, const float* b, const float* c, float s, int64_t n) {
  if (n > 0) jax_mlpo::Triad(a, b, c, s, size_t(n));
}

void jax_mlpo_copy(void* dst, const void* src, int64_t nbytes) {
  if (nbytes > 0) jax_mlpo::Copy(dst, src, size_t(nbytes));
}

}  // extern "C"
