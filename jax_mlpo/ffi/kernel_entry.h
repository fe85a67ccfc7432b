// The C entry points' shared argument checks and outputs (kernels.cc, muon.cc): their error
// codes, the overlap test of the arrays a call writes, and the update outputs every optimizer
// kernel shares, in an anonymous namespace: each entry-point file has its own copy.
#ifndef JAX_MLPO_FFI_KERNEL_ENTRY_H_
#define JAX_MLPO_FFI_KERNEL_ENTRY_H_

#include <cstddef>
#include <cstdint>

namespace {

enum : int {
  kOk = 0,
  kErrNull = 1,
  kErrOverlap = 2,
  kErrDeltaWithoutOut = 3,
  kErrSize = 4,
  kErrBf16WithoutDelta = 5,
  kErrNesterovQ8 = 6,
};

struct Range {
  const char* lo;
  size_t bytes;
  bool written;
};

bool Overlap(const Range& a, const Range& b) {
  return a.lo != nullptr && b.lo != nullptr && a.lo < b.lo + b.bytes && b.lo < a.lo + a.bytes;
}

// Whether a written range overlaps any other range, but for the pair (grad, update) when the
// update is computed in place over its gradient.
template <int N>
bool AnyOverlap(const Range (&ranges)[N], bool in_place, int grad, int update) {
  for (int i = 0; i < N; ++i)
    for (int j = i + 1; j < N; ++j) {
      if (in_place && i == grad && j == update) continue;
      if ((ranges[i].written || ranges[j].written) && Overlap(ranges[i], ranges[j])) return true;
    }
  return false;
}

// The outputs every optimizer kernel shares: the update (float32, or bfloat16 as a difference to
// delta_base) and the new params in bfloat16.
template <typename Args>
void SetOutputs(Args& a, void* update_out, int update_bf16, const uint16_t* delta_base,
                uint16_t* param_bf16_out) {
  if (update_bf16) {
    a.update_bf16 = static_cast<uint16_t*>(update_out);
  } else {
    a.update_out = static_cast<float*>(update_out);
  }
  a.delta_base = delta_base;
  a.param_bf16_out = param_bf16_out;
}

}  // namespace

#endif  // JAX_MLPO_FFI_KERNEL_ENTRY_H_
