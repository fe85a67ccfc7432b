// Instruction-set dispatch and the kernels' multi-threaded drivers (bound to Python in
// kernel_bindings.cc).
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

const char* Isa() { return Kernels().isa; }

bool SetIsa(const char* name) {
  const KernelTable* table = FindKernels(name ? name : "");
  if (table == nullptr) return false;
  g_kernels.store(table, std::memory_order_release);
  return true;
}

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

const char* const kRuleOpNames[kRuleOpCount] = {
#define JAX_MLPO_RULE_NAME(name, operands) #name,
    JAX_MLPO_RULE_OPS(JAX_MLPO_RULE_NAME)
#undef JAX_MLPO_RULE_NAME
};

void Rule(const RuleArgs& args, size_t n) {
  const RuleRangeFn fn = Kernels().rule();
  ParallelFor(n, kMinParallelElems, kRuleTile, [&](size_t b, size_t e) { fn(args, b, e); });
}

void Copy(void* dst, const void* src, size_t nbytes) {
  auto* d = static_cast<char*>(dst);
  auto* s = static_cast<const char*>(src);
  ParallelFor(nbytes, kMinParallelBytes, kChunkAlignBytes,
              [&](size_t b, size_t e) { std::memcpy(d + b, s + b, e - b); });
}

}  // namespace jax_mlpo
