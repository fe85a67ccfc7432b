// The disk's limit without fio: one point of the request size x requests in flight x direction
// sweep (experiments/bench/disk_limit.py), measured the way fio's randread / randwrite / randrw
// jobs do: O_DIRECT requests at random aligned offsets of a file laid out by the caller, each of
// `in_flight` threads keeping one request outstanding, for `seconds`. Mixed: every request is a
// read or a write with even odds (fio's rwmixread=50). Threads with blocking pread/pwrite, the
// way the file tiers move their data, so the figure is the limit of that submission path.
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "io.h"

namespace {

constexpr int64_t kAlign = 4096;  // O_DIRECT: offsets, sizes and buffers in whole pages

struct Totals {
  std::atomic<int64_t> read{0};
  std::atomic<int64_t> written{0};
  std::atomic<int> error{0};  // the first errno a request failed with
};

void Worker(int fd, int64_t slots, int64_t request, int mode, uint64_t seed, double seconds,
            Totals* totals) {
  void* buffer = nullptr;
  if (posix_memalign(&buffer, kAlign, size_t(request)) != 0) {
    totals->error.store(ENOMEM);
    return;
  }
  std::memset(buffer, 0x5a, size_t(request));  // written data: not all zeros
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  auto next = [&state] {  // xorshift64*
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    return state * 0x2545F4914F6CDD1Dull;
  };
  const auto stop = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  int64_t read = 0, written = 0;
  while (std::chrono::steady_clock::now() < stop && totals->error.load() == 0) {
    const uint64_t r = next();
    const off_t offset = off_t((r >> 1) % uint64_t(slots)) * request;
    const bool write = mode == 1 || (mode == 2 && (r & 1));
    const ssize_t n = write ? pwrite(fd, buffer, size_t(request), offset)
                            : pread(fd, buffer, size_t(request), offset);
    if (n != request) {
      int expected = 0;
      totals->error.compare_exchange_strong(expected, n < 0 ? errno : EIO);
      break;
    }
    (write ? written : read) += n;
  }
  totals->read += read;
  totals->written += written;
  free(buffer);
}

}  // namespace

namespace jax_mlpo {

ProbeResult DiskProbe(const char* path, int64_t file_bytes, int64_t request_bytes,
                      int32_t in_flight, int32_t mode, double seconds) {
  ProbeResult result;
  char message[1024];
  auto fail = [&](const char* what, int err) {
    std::snprintf(message, sizeof(message), "%s %s: %s", what, path, std::strerror(err));
    result.error = message;
    return result;
  };
  if (request_bytes <= 0 || request_bytes % kAlign || file_bytes < request_bytes ||
      in_flight <= 0 || mode < 0 || mode > 2 || !(seconds > 0)) {
    std::snprintf(message, sizeof(message),
                  "bad probe arguments: request %lld bytes (a positive multiple of 4096, at "
                  "most the file's %lld), %d in flight, mode %d, %g s",
                  (long long)request_bytes, (long long)file_bytes, in_flight, mode, seconds);
    result.error = message;
    return result;
  }
  const int fd = open(path, (mode == 0 ? O_RDONLY : O_RDWR) | O_DIRECT);
  if (fd < 0) {
    return fail(errno == EINVAL ? "O_DIRECT is not supported for" : "cannot open", errno);
  }
  Totals totals;
  std::vector<std::thread> threads;
  const auto t0 = std::chrono::steady_clock::now();
  for (int k = 0; k < in_flight; ++k) {
    threads.emplace_back(Worker, fd, file_bytes / request_bytes, request_bytes, mode,
                         uint64_t(k + 1), seconds, &totals);
  }
  for (auto& t : threads) t.join();
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  close(fd);
  if (const int err = totals.error.load()) return fail("a request failed on", err);
  result.read_bytes = totals.read.load();
  result.written_bytes = totals.written.load();
  return result;
}

}  // namespace jax_mlpo
