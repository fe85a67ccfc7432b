// The kernels' thread pool: one process-wide pool, resized on demand, rebuilt after fork.
#include "thread_pool.h"

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define JAX_MLPO_X86 1
#include <xmmintrin.h>
#endif
#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

namespace jax_mlpo {
namespace {

// XLA runs handlers on threads that flush denormals to zero; the numpy reference does not.
// Run every kernel with IEEE floating point (round to nearest, no FTZ/DAZ, exceptions masked)
// and restore the caller's state afterwards.
class IeeeFpScope {
 public:
#if defined(JAX_MLPO_X86)
  IeeeFpScope() : saved_(_mm_getcsr()) {
    if ((saved_ & ~kFlags) != kDefault) _mm_setcsr(kDefault);
  }
  ~IeeeFpScope() {
    if ((saved_ & ~kFlags) != kDefault) _mm_setcsr(saved_);
  }

 private:
  static constexpr unsigned kDefault = 0x1f80, kFlags = 0x3f;  // MXCSR; flags: sticky bits
  unsigned saved_;
#elif defined(__aarch64__)
  IeeeFpScope() {
    asm volatile("mrs %0, fpcr" : "=r"(saved_));
    if (saved_ & kMask) Set(saved_ & ~kMask);
  }
  ~IeeeFpScope() {
    if (saved_ & kMask) Set(saved_);
  }

 private:
  static void Set(uint64_t fpcr) { asm volatile("msr fpcr, %0" : : "r"(fpcr)); }
  // FZ (bit 24), rounding mode (23:22), FZ16 (19), trap enables (15, 12:8).
  static constexpr uint64_t kMask = (1u << 24) | (3u << 22) | (1u << 19) | (1u << 15) | (0x1fu << 8);
  uint64_t saved_;
#endif
};

int DefaultNumThreads() {
  if (const char* env = std::getenv("JAX_MLPO_NUM_THREADS")) {
    char* end = nullptr;
    long n = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && n >= 1) return int(std::min(n, 1024L));
  }
#if defined(__linux__)
  cpu_set_t set;  // respects taskset / cgroup cpusets, unlike hardware_concurrency
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
#endif
  return int(std::max(1u, std::thread::hardware_concurrency()));
}

// A fixed pool; Run(count, fn, ctx) calls fn(ctx, i) for i in [0, count), i == 0 on the caller.
class ThreadPool {
 public:
  using Task = void (*)(void* ctx, int index);

  explicit ThreadPool(int size) : size_(size) {
    for (int i = 1; i < size; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return size_; }

  void Run(int count, Task fn, void* ctx) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      task_ = fn;
      ctx_ = ctx;
      count_ = count;
      pending_ = count - 1;
      ++generation_;
    }
    work_cv_.notify_all();
    fn(ctx, 0);
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return pending_ == 0; });
  }

 private:
  void WorkerLoop(int index) {
    uint64_t seen = 0;
    for (;;) {
      Task fn;
      void* ctx;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        if (index >= count_) continue;
        fn = task_;
        ctx = ctx_;
      }
      fn(ctx, index);
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }

  const int size_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  uint64_t generation_ = 0;
  int count_ = 0, pending_ = 0;
  bool stop_ = false;
  Task task_ = nullptr;
  void* ctx_ = nullptr;
};

// One parallel call at a time (others wait); guards the pool and its reconfiguration. The pool
// is never destroyed at exit (XLA threads may still run kernels while statics are destroyed).
std::mutex g_pool_mu;
ThreadPool* g_pool = nullptr;
int g_num_threads = 0;  // 0: not decided yet

int NumThreadsLocked() {
  if (g_num_threads == 0) g_num_threads = DefaultNumThreads();
  return g_num_threads;
}

#if defined(__linux__)
// A forked child has no pool threads: forget (leak) the pool and start a fresh one when needed.
void AtForkPrepare() { g_pool_mu.lock(); }
void AtForkParent() { g_pool_mu.unlock(); }
void AtForkChild() {
  g_pool = nullptr;
  g_pool_mu.unlock();
}
const int g_atfork = pthread_atfork(AtForkPrepare, AtForkParent, AtForkChild);
#endif

}  // namespace

int NumThreads() {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  return NumThreadsLocked();
}

int SetNumThreads(int n) {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  g_num_threads = n >= 1 ? std::min(n, 1024) : DefaultNumThreads();
  return g_num_threads;
}

void ParallelFor(size_t n, size_t min_parallel, size_t align, RangeFn fn, const void* ctx) {
  if (n == 0) return;
  if (n >= min_parallel) {
    std::unique_lock<std::mutex> lock(g_pool_mu);
    const size_t threads = size_t(NumThreadsLocked());
    const size_t count = std::min(threads, std::max<size_t>(1, n / (min_parallel / 2)));
    if (count > 1) {
      if (g_pool == nullptr || g_pool->size() != int(threads)) {
        delete g_pool;  // joins its workers; we hold g_pool_mu, so none is running a task
        g_pool = new ThreadPool(int(threads));
      }
      size_t chunk = (n + count - 1) / count;
      chunk = (chunk + align - 1) / align * align;
      struct Chunks {
        RangeFn fn;
        const void* ctx;
        size_t n, chunk;
      } chunks{fn, ctx, n, chunk};
      g_pool->Run(int(count), [](void* p, int i) {
        const Chunks& c = *static_cast<const Chunks*>(p);
        const size_t begin = std::min(c.n, size_t(i) * c.chunk);
        const size_t end = std::min(c.n, begin + c.chunk);
        IeeeFpScope fp;
        if (begin < end) c.fn(c.ctx, begin, end);
      }, &chunks);
      return;
    }
  }
  IeeeFpScope fp;
  fn(ctx, size_t{0}, n);
}

}  // namespace jax_mlpo
