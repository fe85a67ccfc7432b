// What jax_mlpo._native lends jax_mlpo._native_testing: the kernels' state (the instruction set in
// use, the thread pool) is the CPU module's, so the test-only module reaches it through this
// table, published as the capsule _native._api, rather than linking copies of its own.
#ifndef JAX_MLPO_FFI_NATIVE_API_H_
#define JAX_MLPO_FFI_NATIVE_API_H_

#include <cstddef>
#include <cstdint>

#include "kernels.h"

namespace jax_mlpo {

struct NativeApi {
  size_t size;  // sizeof(NativeApi) where the table was built: both modules come from one build
  bool (*set_isa)(const char* name);
  void (*adamw)(const AdamWArgs& args, size_t n);
  void (*bf16_to_f32)(const uint16_t* src, float* dst, size_t n);
  void (*f32_to_bf16)(const float* src, uint16_t* dst, size_t n);
  void (*triad)(float* a, const float* b, const float* c, float s, size_t n);
  void (*copy)(void* dst, const void* src, size_t nbytes);
  bool (*crc32c_hardware)();
};

constexpr const char* kNativeApiCapsule = "jax_mlpo._native._api";

}  // namespace jax_mlpo

#endif  // JAX_MLPO_FFI_NATIVE_API_H_
