// A file tier's request queue on Linux kernel AIO: the submission path DeepSpeed's libaio swapper
// uses, without a thread per request in flight.
//
// One queue per tier holds up to `depth` requests in the kernel at once. Callers hand in a
// blob's chunk requests and block (module.cc has released the GIL) until all of them are done;
// several callers share the queue, and queued requests go to the kernel reads first, then by
// blob (oldest first), then in order, as the thread queue of tiers/posix.py orders them. One
// reaper thread collects completions and tops the kernel queue up again. Each caller checksums
// its own chunks (crc32c of a write before it is queued, of a read once it has landed), so the
// checksums spread over the callers' threads and never hold the reaper.
//
// The syscalls are made directly (<linux/aio_abi.h>), so the package needs no libaio. A request
// whose buffer is not page aligned, or that moves more than its buffer (a blob's last block,
// padded to a whole page for O_DIRECT), goes through an aligned bounce buffer of its own.
#include <linux/aio_abi.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include "io.h"

namespace jax_mlpo {
namespace {

constexpr uintptr_t kAlign = 4096;

struct Op {
  const AioRequest* request;
  AioResult* result;
  char* buffer = nullptr;  // what the kernel reads or fills: the caller's or a bounce buffer
  bool bounced = false;
  bool done = false;
  struct iocb cb;
};

// Queue order: reads (0) before writes (1), then by blob, then by arrival.
using Key = std::tuple<int, uint64_t, uint64_t, Op*>;

}  // namespace

class AioQueue {
 public:
  explicit AioQueue(int depth) : depth_(depth) {}

  int Start() {
    if (syscall(SYS_io_setup, depth_, &ctx_) != 0) return errno;
    reaper_ = std::thread([this] { Reap(); });
    return 0;
  }

  ~AioQueue() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closing_ = true;
    }
    wake_.notify_all();
    if (reaper_.joinable()) reaper_.join();
    if (ctx_ != 0) syscall(SYS_io_destroy, ctx_);
  }

  // Moves the n requests of one blob (its place in the queue's order); returns when every one
  // is done.
  void Run(int64_t n, const AioRequest* requests, AioResult* results, uint64_t blob) {
    std::vector<Op> ops(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      Op& op = ops[size_t(i)];
      op.request = &requests[i];
      op.result = &results[i];
      if (!Prepare(&op)) continue;
      Enqueue(&op, blob);
    }
    for (Op& op : ops) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        done_.wait(lock, [&op] { return op.done; });
      }
      Finish(&op);
    }
  }

 private:
  // Sets up the buffer (and a write's checksum); false if the request failed already.
  bool Prepare(Op* op) {
    const AioRequest& r = *op->request;
    op->result->moved = 0;
    op->result->crc = 0;
    op->buffer = static_cast<char*>(r.data);
    if (r.moved != r.nbytes || reinterpret_cast<uintptr_t>(r.data) % kAlign != 0) {
      void* bounce = nullptr;
      if (posix_memalign(&bounce, kAlign, size_t(std::max<int64_t>(r.moved, 1))) != 0) {
        op->result->moved = -ENOMEM;
        op->done = true;
        return false;
      }
      op->buffer = static_cast<char*>(bounce);
      op->bounced = true;
      if (r.write) {
        std::memcpy(op->buffer, r.data, size_t(r.nbytes));
        std::memset(op->buffer + r.nbytes, 0, size_t(r.moved - r.nbytes));
      }
    }
    if (r.write) op->result->crc = Crc32c(op->buffer, size_t(r.moved), 0);
    std::memset(&op->cb, 0, sizeof(op->cb));
    op->cb.aio_data = reinterpret_cast<uint64_t>(op);
    op->cb.aio_lio_opcode = r.write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
    op->cb.aio_fildes = uint32_t(r.fd);
    op->cb.aio_buf = reinterpret_cast<uint64_t>(op->buffer);
    op->cb.aio_nbytes = uint64_t(r.moved);
    op->cb.aio_offset = r.offset;
    return true;
  }

  // After completion: a read's checksum and copy out of its bounce buffer.
  void Finish(Op* op) {
    const AioRequest& r = *op->request;
    if (!r.write && op->result->moved > 0) {
      op->result->crc = Crc32c(op->buffer, size_t(op->result->moved), 0);
      if (op->bounced) {
        std::memcpy(r.data, op->buffer, size_t(std::min(op->result->moved, r.nbytes)));
      }
    }
    if (op->bounced) free(op->buffer);
  }

  void Enqueue(Op* op, uint64_t blob) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queued_.emplace(op->request->write ? 1 : 0, blob, next_seq_++, op);
    }
    Pump();
  }

  // Hands queued requests to the kernel while fewer than depth_ are there.
  void Pump() {
    std::vector<Op*> batch;
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (in_flight_ < depth_ && !queued_.empty()) {
        batch.push_back(std::get<3>(*queued_.begin()));
        queued_.erase(queued_.begin());
        ++in_flight_;
      }
    }
    if (batch.empty()) return;
    wake_.notify_all();
    std::vector<struct iocb*> cbs;
    for (Op* op : batch) cbs.push_back(&op->cb);
    size_t submitted = 0;
    while (submitted < cbs.size()) {
      const long rc = syscall(SYS_io_submit, ctx_, long(cbs.size() - submitted),
                              cbs.data() + submitted);
      if (rc > 0) {
        submitted += size_t(rc);
        continue;
      }
      const int error = rc == 0 ? EAGAIN : errno;
      if (error == EINTR) continue;
      // The first request the kernel refused fails with its errno; the rest are tried again.
      Complete(batch[submitted], -error);
      ++submitted;
    }
  }

  void Complete(Op* op, int64_t result) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      op->result->moved = result;
      op->done = true;
      --in_flight_;
    }
    done_.notify_all();
  }

  void Reap() {
    std::vector<struct io_event> events(static_cast<size_t>(depth_));
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [this] { return in_flight_ > 0 || closing_; });
        if (in_flight_ == 0 && closing_) return;
      }
      // A timeout, so that requests the kernel refused (completed here, never in flight there)
      // cannot leave this thread waiting for events that will not come.
      struct timespec timeout = {0, 100 * 1000 * 1000};
      const long got =
          syscall(SYS_io_getevents, ctx_, 1L, long(depth_), events.data(), &timeout);
      if (got < 0) continue;  // EINTR
      for (long i = 0; i < got; ++i) {
        Complete(reinterpret_cast<Op*>(events[size_t(i)].data), events[size_t(i)].res);
      }
      Pump();
    }
  }

  const int depth_;
  aio_context_t ctx_ = 0;
  std::thread reaper_;
  std::mutex mu_;
  std::condition_variable wake_;  // the reaper: something is in flight, or closing
  std::condition_variable done_;  // callers: a request completed
  std::set<Key> queued_;
  int in_flight_ = 0;  // submitted (or being submitted) and not yet completed
  bool closing_ = false;
  uint64_t next_seq_ = 0;
};

AioQueue* AioOpen(int depth, int* error) {
  auto* queue = new AioQueue(std::max(1, depth));
  *error = queue->Start();
  if (*error != 0) {
    delete queue;
    return nullptr;
  }
  return queue;
}

void AioRun(AioQueue* queue, size_t n, const AioRequest* requests, AioResult* results,
            uint64_t blob) {
  queue->Run(int64_t(n), requests, results, blob);
}

void AioClose(AioQueue* queue) { delete queue; }

}  // namespace jax_mlpo
