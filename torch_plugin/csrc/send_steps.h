// send_steps.h: the two steps of a torch.multiprocessing send of a CUDA tensor, each one call
// from Python (vmm_torch.reductions), for vmm_cuda_allocator.cpp's module. In Python they were
// a dozen attribute reads and C calls, tens of microseconds of a put's latency.
//
//   Prepare (Queue.put, the sending thread): whether the tensor may travel and how
//     (vmm_send_prepare, which also keeps a block alone in its chunks until it is sent), and
//     for memory that goes as it is, an event on the current stream (ready_events.h).
//   Export (the queue's feeder thread): waits for the storage's events (without any,
//     synchronises the device, as a send not prepared by put must), then vmm_export_send:
//     the descriptor's bytes and the ticket. Only a wait that blocks runs inside `blocking`
//     (the module releases the GIL there): a feeder that let the GIL go for every send would
//     wait up to the interpreter's switch interval to get it back from a busy thread.
//
// Both return a kind (vmm_send_kind, or kNonLeaf for a non-leaf tensor that requires grad)
// and leave every other case (relocation, refusals, errors) to the Python path, which raises.
// Failures: c10::Error from the CUDA runtime or a stream that captures a graph (Record); an
// export that fails returns no bytes, and libvmm's last error (of this thread) says why.
#ifndef VMM_TORCH_PLUGIN_CSRC_SEND_STEPS_H_
#define VMM_TORCH_PLUGIN_CSRC_SEND_STEPS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include "torch_plugin/csrc/ready_events.h"
#include "torch_plugin/vmm_c.h"

namespace vmm_torch {

// A kind beside vmm_send_kind's: a non-leaf tensor that requires grad (never sent).
constexpr int kNonLeaf = -1;

// The storage of `t` as a ready-event key; base 0 where `t` is not a strided CUDA or CPU
// tensor with a storage (wrapper tensors have none).
inline StorageKey StorageOf(const at::Tensor& t) {
  if (!t.defined() || t.layout() != c10::kStrided || !(t.is_cuda() || t.is_cpu()) ||
      !t.has_storage()) {
    return {};
  }
  const c10::Storage& storage = t.storage();
  return {reinterpret_cast<uintptr_t>(storage.data()),
          reinterpret_cast<uintptr_t>(storage.unsafeGetStorageImpl())};
}

inline bool IsNonLeaf(const at::Tensor& t) { return t.requires_grad() && !t.is_leaf(); }

inline bool GoesAsItIs(int kind) {
  return kind == VMM_SEND_IN_PLACE || kind == VMM_SEND_IMPORT;
}

// What the sending thread does for a CUDA tensor it puts: (kind, storage address). For
// memory that goes as it is, the event is recorded.
inline std::pair<int, uintptr_t> PrepareSend(const at::Tensor& t,
                                             decltype(&vmm_send_prepare) send_prepare,
                                             ReadyEvents* ready) {
  if (IsNonLeaf(t)) return {kNonLeaf, 0};
  const StorageKey key = StorageOf(t);
  if (key.base == 0) return {VMM_SEND_NOT_VMM, 0};
  const int kind = send_prepare(reinterpret_cast<const void*>(key.base));
  if (GoesAsItIs(kind) && t.is_cuda()) ready->Record(key, t.device().index());
  return {kind, key.base};
}

// A send's export: its kind, and for memory that goes as it is, the descriptor's bytes and
// the ticket (none where the export failed).
struct Exported {
  int kind = VMM_SEND_NOT_VMM;
  std::optional<std::pair<std::string, std::string>> bytes;
};

// What the feeder thread does for a tensor it pickles.
template <typename Blocking>
Exported ExportSend(const at::Tensor& t, decltype(&vmm_send_kind) send_kind,
                    decltype(&vmm_export_send) export_send,
                    decltype(&vmm_release_buffer) release_buffer, ReadyEvents* ready,
                    Blocking&& blocking) {
  Exported out;
  if (IsNonLeaf(t)) {
    out.kind = kNonLeaf;
    return out;
  }
  const StorageKey key = StorageOf(t);
  out.kind = key.base == 0 ? VMM_SEND_NOT_VMM : send_kind(reinterpret_cast<const void*>(key.base));
  if (!GoesAsItIs(out.kind)) return out;
  if (t.is_cuda() && !ready->Wait(key, blocking)) {
    c10::cuda::CUDAGuard guard(t.device().index());
    cudaError_t synced = cudaSuccess;
    blocking([&] { synced = cudaDeviceSynchronize(); });
    C10_CUDA_CHECK(synced);
  }
  uint8_t* data = nullptr;
  size_t length = 0;
  std::string ticket(VMM_TICKET_BYTES, '\0');
  if (export_send(reinterpret_cast<const void*>(key.base), &data, &length,
                  reinterpret_cast<uint8_t*>(&ticket[0])) != 0) {
    return out;
  }
  std::string descriptor(reinterpret_cast<const char*>(data), length);
  release_buffer(data);
  out.bytes.emplace(std::move(descriptor), std::move(ticket));
  return out;
}

}  // namespace vmm_torch

#endif  // VMM_TORCH_PLUGIN_CSRC_SEND_STEPS_H_
