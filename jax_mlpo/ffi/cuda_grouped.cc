// The CUDA handlers of a grouped host update: jax_mlpo_group_send and jax_mlpo_group_receive
// (cuda_grouped.h says why an update in groups is two calls per group on a GPU). Neither blocks:
// each enqueues its copies on XLA's stream and returns. Host API only (no device code); the
// stream wait comes from the driver through the runtime (cudaGetDriverEntryPointByVersion), so
// nothing links libcuda. Returns ffi::Error, never throws.
#include "cuda_grouped.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include "cuda_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_mlpo {
namespace {

using WaitValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

WaitValue32 StreamWait() {
  static const WaitValue32 wait = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return WaitValue32{nullptr};
    }
    return reinterpret_cast<WaitValue32>(fn);
  }();
  return wait;
}

std::mutex g_slots_mu;
// Never freed: tickets and the host functions in flight point at the slots.
auto* g_slots = new std::map<std::pair<cudaStream_t, int32_t>, std::unique_ptr<GroupSlot>>();

constexpr size_t Align(size_t n) { return (n + 63) & ~size_t(63); }

// Whether round a is at or after round b (the flag's comparison: wraps around).
bool AtOrAfter(uint32_t a, uint32_t b) { return int32_t(a - b) >= 0; }

struct Arrival {
  GroupSlot* slot;
  uint32_t round;
};

// A host function on XLA's stream, after a send's copies: no CUDA calls allowed here.
void CUDART_CB Arrived(void* data) {
  std::unique_ptr<Arrival> arrival(static_cast<Arrival*>(data));
  GroupSlot* slot = arrival->slot;
  {
    std::lock_guard<std::mutex> lock(slot->mu);
    if (!AtOrAfter(slot->arrived, arrival->round)) slot->arrived = arrival->round;
  }
  slot->arrived_cv.notify_all();
}

void FailRound(GroupSlot* slot, uint32_t round) {
  {
    std::lock_guard<std::mutex> lock(slot->mu);
    slot->failed = round;
  }
  slot->arrived_cv.notify_all();
}

// Makes the slot's staging hold `bytes`. A larger staging replaces the old one only after the
// stream is idle (its copies may still read the old): once per shape, not per step.
ffi::Error Reserve(cudaStream_t stream, GroupSlot* slot, size_t bytes, const std::string& who) {
  if (slot->capacity >= bytes) return ffi::Error::Success();
  if (slot->host != nullptr) {
    cudaError_t err = cudaStreamSynchronize(stream);
    if (err == cudaSuccess) err = cudaFreeHost(slot->host);
    if (err != cudaSuccess) return CudaError(who + ": freeing the staging", err);
    slot->host = nullptr;
    slot->capacity = 0;
  }
  void* host = nullptr;
  cudaError_t err = cudaHostAlloc(&host, bytes, cudaHostAllocPortable | cudaHostAllocMapped);
  if (err != cudaSuccess) {
    return CudaError(who + ": pinning " + std::to_string(bytes) + " bytes of staging", err);
  }
  slot->host = static_cast<char*>(host);
  slot->capacity = bytes;
  slot->record()->flag = slot->sent;  // every earlier round is done: the stream was idle
  return ffi::Error::Success();
}

ffi::Error CheckGroup(int32_t group, int32_t groups, size_t ids, size_t n, const char* who) {
  if (ids != n || groups < 2 || group < 0 || group >= groups) {
    return ffi::Error::InvalidArgument(std::string(who) +
                                       ": leaf_ids must name each leaf, and group be in "
                                       "[0, groups), groups > 1");
  }
  return ffi::Error::Success();
}

ffi::Error GroupSendImpl(cudaStream_t stream, ffi::BufferR0<ffi::S32> handle,
                         ffi::BufferR0<ffi::S32> count, ffi::Buffer<ffi::F32> scalars,
                         ffi::RemainingArgs leaves, ffi::ResultBufferR0<ffi::S32> token,
                         int32_t group, int32_t groups, ffi::Span<const int32_t> leaf_ids,
                         bool f32_updates) {
  const std::string who = "jax_mlpo_group_send";
  const size_t n = leaves.size() / 2;
  if (leaves.size() % 2 != 0 || scalars.element_count() != kNumScalars) {
    return ffi::Error::InvalidArgument(who + ": expects f32[" + std::to_string(kNumScalars) +
                                       "] scalars, then a gradient and a param per leaf");
  }
  if (auto e = CheckGroup(group, groups, leaf_ids.size(), n, who.c_str()); !e.success()) return e;
  std::vector<ffi::AnyBuffer> bufs;
  for (size_t k = 0; k < 2 * n; ++k) {
    auto leaf = leaves.get<ffi::AnyBuffer>(k);
    if (leaf.has_error()) return leaf.error();
    bufs.push_back(*leaf);
  }
  // [record | grads | params | updates], each leaf 64-byte aligned
  std::vector<BufferView> views(3 * n);
  std::vector<std::pair<size_t, size_t>> updates(n);  // offset, bytes
  size_t offset = sizeof(GroupRecord);
  for (size_t k = 0; k < 2 * n; ++k) {
    views[k] = BufferView{reinterpret_cast<void*>(offset), int64_t(bufs[k].size_bytes()),
                          bufs[k].element_type()};
    offset += Align(bufs[k].size_bytes());
  }
  for (size_t k = 0; k < n; ++k) {
    const ffi::AnyBuffer& param = bufs[n + k];
    size_t bytes = f32_updates ? 4 * param.element_count() : param.size_bytes();
    updates[k] = {offset, bytes};
    views[2 * n + k] = BufferView{reinterpret_cast<void*>(offset), int64_t(bytes),
                                  f32_updates ? ffi::DataType::F32 : param.element_type()};
    offset += Align(bytes);
  }
  GroupSlot* slot = SlotOf(stream, group);
  if (auto e = Reserve(stream, slot, offset, who); !e.success()) return e;
  for (auto& v : views) v.data = slot->host + reinterpret_cast<size_t>(v.data);
  slot->update_offsets.clear();
  for (const auto& update : updates) slot->update_offsets.push_back(update.first);
  const uint32_t round = ++slot->sent;
  // The engine first, so that a refused round enqueues nothing that would wait for it. A
  // failed send has no receive (XLA stops the program): the round is marked received.
  if (auto e = CallGroupSend(stream, CallGroup{group, groups, leaf_ids}, views,
                             GroupTicket{slot, round});
      !e.success()) {
    slot->received = round;
    return e;
  }
  GroupRecord* record = slot->record();
  auto d2h = [&](void* dst, const void* src, size_t bytes) {
    return bytes ? cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream) : cudaSuccess;
  };
  cudaError_t err = d2h(&record->handle, handle.untyped_data(), sizeof(int32_t));
  if (err == cudaSuccess) err = d2h(&record->count, count.untyped_data(), sizeof(int32_t));
  if (err == cudaSuccess) err = d2h(record->scalars, scalars.untyped_data(), sizeof(float) * kNumScalars);
  for (size_t k = 0; k < 2 * n && err == cudaSuccess; ++k) {
    err = d2h(views[k].data, bufs[k].untyped_data(), bufs[k].size_bytes());
  }
  if (err == cudaSuccess) err = cudaLaunchHostFunc(stream, Arrived, new Arrival{slot, round});
  if (err == cudaSuccess) err = cudaMemsetAsync(token->untyped_data(), 0, sizeof(int32_t), stream);
  if (err != cudaSuccess) {
    FailRound(slot, round);  // the engine, waiting for the round, fails it and frees the flags
    slot->received = round;
    return CudaError(who + ": enqueueing the copies to the host", err);
  }
  return ffi::Error::Success();
}

ffi::Error GroupReceiveImpl(cudaStream_t stream, ffi::RemainingArgs tokens,
                            ffi::ResultBufferR0<ffi::S32> count_out, ffi::RemainingRets updates,
                            int32_t group, int32_t groups, ffi::Span<const int32_t> leaf_ids) {
  const std::string who = "jax_mlpo_group_receive";
  if (auto e = CheckGroup(group, groups, leaf_ids.size(), updates.size(), who.c_str());
      !e.success()) {
    return e;
  }
  if (tokens.size() != size_t(groups)) {
    return ffi::Error::InvalidArgument(who + ": expects every group's send token");
  }
  WaitValue32 wait = StreamWait();
  if (wait == nullptr) {
    return ffi::Error::Internal(who + ": the CUDA driver has no cuStreamWaitValue32");
  }
  GroupSlot* slot = SlotOf(stream, group);
  // a send without its receive (a program stopped between them) is skipped
  if (slot->received == slot->sent || slot->update_offsets.size() != updates.size()) {
    return ffi::Error::Internal(who + ": a receive without its group's send");
  }
  const uint32_t round = slot->sent;
  slot->received = round;
  GroupRecord* record = slot->record();
  void* flag = nullptr;
  cudaError_t err = cudaHostGetDevicePointer(&flag, &record->flag, 0);
  if (err != cudaSuccess) return CudaError(who + ": the flag's device address", err);
  CUresult waited = wait(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(flag),
                         round, CU_STREAM_WAIT_VALUE_GEQ);
  if (waited != CUDA_SUCCESS) {
    return ffi::Error::Internal(who + ": cuStreamWaitValue32 failed (CUresult " +
                                std::to_string(int(waited)) + ")");
  }
  for (size_t k = 0; k < updates.size() && err == cudaSuccess; ++k) {
    auto out = updates.get<ffi::AnyBuffer>(k);
    if (out.has_error()) return out.error();
    const size_t bytes = (*out)->size_bytes();
    if (slot->update_offsets[k] + bytes > slot->capacity) {
      return ffi::Error::InvalidArgument(who + ": an update larger than its send staged");
    }
    if (bytes) {
      err = cudaMemcpyAsync((*out)->untyped_data(), slot->host + slot->update_offsets[k], bytes,
                            cudaMemcpyHostToDevice, stream);
    }
  }
  if (err == cudaSuccess) {
    err = cudaMemcpyAsync(count_out->typed_data(), &record->next, sizeof(int32_t),
                          cudaMemcpyHostToDevice, stream);
  }
  if (err != cudaSuccess) return CudaError(who + ": enqueueing the updates' copies", err);
  return ffi::Error::Success();
}

}  // namespace

bool GroupTicket::Wait(double timeout_s) const {
  std::unique_lock<std::mutex> lock(slot->mu);
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  const bool done = slot->arrived_cv.wait_until(lock, until, [&] {
    return slot->failed == round || AtOrAfter(slot->arrived, round);
  });
  if (slot->failed == round) {
    throw std::runtime_error("jax_mlpo_group_send: the copies of this group to the host failed");
  }
  return done;
}

void GroupTicket::Release(int32_t next) const {
  GroupRecord* record = slot->record();
  if (record == nullptr) return;  // the staging was released (the engine closed)
  record->next = next;
  // the updates and the next count are written before the flag that lets the copies read them
  if (!AtOrAfter(__atomic_load_n(&record->flag, __ATOMIC_ACQUIRE), round)) {
    __atomic_store_n(&record->flag, round, __ATOMIC_SEQ_CST);
  }
}

GroupSlot* SlotOf(cudaStream_t stream, int32_t group) {
  std::lock_guard<std::mutex> lock(g_slots_mu);
  auto& slot = (*g_slots)[{stream, group}];
  if (!slot) slot = std::make_unique<GroupSlot>();
  return slot.get();
}

void ReleaseStaging() {
  std::lock_guard<std::mutex> lock(g_slots_mu);
  for (auto& [key, slot] : *g_slots) {
    if (slot->host == nullptr) continue;
    cudaStreamSynchronize(key.first);  // a stream XLA already destroyed reports an error: go on
    cudaFreeHost(slot->host);
    slot->host = nullptr;
    slot->capacity = 0;
  }
}

bool GroupedAvailable() { return StreamWait() != nullptr; }

}  // namespace jax_mlpo

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlpoGroupSend, jax_mlpo::GroupSendImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // engine handle
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // step count
                                  .Arg<ffi::Buffer<ffi::F32>>()    // the scalars
                                  .RemainingArgs()                 // grads..., params...
                                  .Ret<ffi::BufferR0<ffi::S32>>()  // token for the receives
                                  .Attr<int32_t>("group")          // host_update.h: CallGroup
                                  .Attr<int32_t>("groups")
                                  .Attr<ffi::Span<const int32_t>>("leaf_ids")
                                  .Attr<bool>("f32_updates"));     // else the params' dtypes

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlpoGroupReceive, jax_mlpo::GroupReceiveImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .RemainingArgs()                 // every group's token
                                  .Ret<ffi::BufferR0<ffi::S32>>()  // count + 1
                                  .RemainingRets()                 // updates...
                                  .Attr<int32_t>("group")
                                  .Attr<int32_t>("groups")
                                  .Attr<ffi::Span<const int32_t>>("leaf_ids"));
