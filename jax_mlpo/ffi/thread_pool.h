// The thread pool that runs the host kernels' large calls: [0, n) is cut into aligned chunks, one
// per thread, and every chunk runs with IEEE floating point.
#ifndef JAX_MLPO_FFI_THREAD_POOL_H_
#define JAX_MLPO_FFI_THREAD_POOL_H_

#include <cstddef>

namespace jax_mlpo {

// The threads a parallel call may use: SetNumThreads's choice, else JAX_MLPO_NUM_THREADS, else the
// CPUs this process may use.
int NumThreads();
// n <= 0 restores the default. Returns the number now in use.
int SetNumThreads(int n);

using RangeFn = void (*)(const void* ctx, size_t begin, size_t end);

// Splits [0, n) into at most NumThreads() chunks whose starts are multiples of align and runs
// fn(ctx, begin, end) on each, under IEEE floating point (round to nearest, no flush-to-zero,
// exceptions masked), whatever the calling thread's state. Calls under min_parallel elements run
// on the calling thread: waking the pool costs more than they do. One parallel call at a time;
// others wait for it.
void ParallelFor(size_t n, size_t min_parallel, size_t align, RangeFn fn, const void* ctx);

// The same for a callable body(begin, end).
template <typename Body>
void ParallelFor(size_t n, size_t min_parallel, size_t align, const Body& body) {
  ParallelFor(
      n, min_parallel, align,
      [](const void* ctx, size_t begin, size_t end) {
        (*static_cast<const Body*>(ctx))(begin, end);
      },
      &body);
}

}  // namespace jax_mlpo

#endif  // JAX_MLPO_FFI_THREAD_POOL_H_
