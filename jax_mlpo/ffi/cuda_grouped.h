// The grouped host update on a GPU (cuda_grouped.cc): what its two handlers and its bindings
// (cuda_grouped_bindings.cc) share.
//
// An update split into groups of layers (jax_mlpo/transforms/overlap.py) is two calls per group
// on a GPU. The send (jax_mlpo_group_send) enqueues on XLA's stream the copies of the group's
// scalars, gradients and params into pinned host staging, then a host function that tells the
// engine they have arrived. The receive (jax_mlpo_group_receive) takes every group's send token,
// so XLA runs every send before any receive, and enqueues a stream wait on the group's flag in
// pinned memory (cuStreamWaitValue32), then the copies of the group's updates from the staging
// into its results. Both return at once: the stream, not a host thread, waits for the engine,
// which sets each group's flag as soon as its subgroups are updated (GroupTicket::Release).
//
// Why every send precedes every receive: a subgroup may hold leaves of two groups, and a
// group's update is done only when all of its subgroups are; with one call per group, the next
// group's copies would sit behind this group's wait on the stream, and the engine would wait
// for them forever.
#ifndef JAX_MLPO_FFI_CUDA_GROUPED_H_
#define JAX_MLPO_FFI_CUDA_GROUPED_H_

#include <cuda_runtime_api.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "host_update.h"
#include "xla/ffi/api/ffi.h"

namespace jax_mlpo {

// The head of a group's staging: the scalars its send copies back, the next count its receive
// copies out, and the flag its receive's stream wait reads.
struct alignas(64) GroupRecord {
  int32_t handle;
  int32_t count;
  float scalars[kNumScalars];
  int32_t next;
  uint32_t flag;  // the last round whose update is done (the engine writes it)
};

// One group's staging for one stream. The staging is the whole group, pinned: its copies are
// enqueued ahead of the engine, so a buffer of a subgroup at a time would have to wait for the
// engine before the next copy could be enqueued. It is sized at the group's first send, reused
// by every later round (the stream orders a round's copies after the last round's), and freed
// by ReleaseStaging (the engine's close). Slots are never freed: tickets point at them.
struct GroupSlot {
  char* host = nullptr;  // cudaHostAlloc'd: [GroupRecord | grads | params | updates]
  size_t capacity = 0;
  uint32_t sent = 0;      // rounds sent (the launching thread's)
  uint32_t received = 0;  // rounds received (the launching thread's)
  std::vector<size_t> update_offsets;  // this round's updates in `host`
  std::mutex mu;
  std::condition_variable arrived_cv;
  uint32_t arrived = 0;  // the last round whose inputs are on the host (under mu)
  uint32_t failed = 0;   // a round whose send failed after the engine was handed it (under mu)

  GroupRecord* record() const { return reinterpret_cast<GroupRecord*>(host); }
};

// One round of one group, as the engine holds it (Python's GroupTicket).
struct GroupTicket {
  GroupSlot* slot;
  uint32_t round;

  // Waits (without the GIL) until the round's inputs are on the host; false on timeout.
  // Throws std::runtime_error if the send failed after handing the round to the engine.
  bool Wait(double timeout_s) const;
  // Writes the next count (the receive's count result) and sets the flag: the receive's
  // copies go ahead. Idempotent; a later round's flag is never lowered. The count is the
  // engine's to compute: it may release a group before the group's own scalars have arrived.
  void Release(int32_t next) const;
};

// The slot of `group` for `stream` (made at its first use).
GroupSlot* SlotOf(cudaStream_t stream, int32_t group);

// Frees every slot's staging (after synchronizing each stream): the engine's close. The next
// send allocates it again.
void ReleaseStaging();

// Whether the driver has the stream wait the receive needs (cuStreamWaitValue32).
bool GroupedAvailable();

// Runs the Python send callback (set_group_send) on one group's staged views: gradients, params,
// updates (host memory, valid while the round is held), and its ticket. Takes the GIL; never
// throws. Defined in cuda_grouped_bindings.cc.
xla::ffi::Error CallGroupSend(cudaStream_t stream, const CallGroup& group,
                              const std::vector<BufferView>& views, GroupTicket ticket);

}  // namespace jax_mlpo

#endif  // JAX_MLPO_FFI_CUDA_GROUPED_H_
