// The file tiers' native I/O (crc32c.cc, aio_queue.cc) and the disk sweep's probe
// (disk_probe.cc), bound to Python in module.cc and testing_module.cc.
#ifndef JAX_MLPO_FFI_IO_H_
#define JAX_MLPO_FFI_IO_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace jax_mlpo {

// CRC-32C of n bytes, continuing from `crc` (0 for a fresh checksum).
uint32_t Crc32c(const void* data, size_t n, uint32_t crc);
// Whether Crc32c uses the CPU's crc32 instruction (else a table).
bool Crc32cHardware();

// One chunk request of a kernel-AIO queue.
struct AioRequest {
  int fd;
  void* data;      // the caller's bytes
  int64_t nbytes;  // bytes of `data`
  int64_t moved;   // bytes the request moves: nbytes, or nbytes padded to a page (zeros)
  int64_t offset;
  bool write;
};

// What became of it: `moved` bytes transferred (fewer: end of file or a full disk) or -errno,
// and the crc32c of the bytes moved (padding included).
struct AioResult {
  int64_t moved;
  uint32_t crc;
};

class AioQueue;
// A queue of `depth` requests in flight, or null with *error set to the errno of io_setup
// (EAGAIN: the system's fs.aio-max-nr is used up).
AioQueue* AioOpen(int depth, int* error);
// Moves n requests of blob number `blob` (smaller numbers first among queued requests of one
// direction) and returns when all are done; each result says how.
void AioRun(AioQueue* queue, size_t n, const AioRequest* requests, AioResult* results,
            uint64_t blob);
// Waits for what is in flight, then frees the queue.
void AioClose(AioQueue* queue);

// What a disk probe moved, or why it failed: `error` is empty on success and starts with
// "bad probe" for arguments out of range. mode: 0 random reads, 1 random writes, 2 both.
struct ProbeResult {
  int64_t read_bytes = 0;
  int64_t written_bytes = 0;
  double seconds = 0;
  std::string error;
};
ProbeResult DiskProbe(const char* path, int64_t file_bytes, int64_t request_bytes,
                      int32_t in_flight, int32_t mode, double seconds);

}  // namespace jax_mlpo

#endif  // JAX_MLPO_FFI_IO_H_
