// ready_events.h: the CUDA events a torch.multiprocessing put records for the tensors it
// sends (vmm_torch.reductions.prepare_send) and the queue's feeder thread waits for before the
// send goes (send_steps.h), so that the receiver reads what was written before the put. They
// are kept by storage (its address and its StorageImpl's), at most kMaxStorages storages (the
// oldest dropped: a put whose object is never pickled leaves its entry), and reused instead of
// created for each put. A storage made where an earlier one was, at both addresses (the heap
// reuses a freed StorageImpl's), finds the earlier one's events too and waits for them as well:
// more than it needs, never less. Used by vmm_cuda_allocator.cpp's module.
//
// Failures: Record throws c10::Error while the current stream captures a CUDA graph (a send
// then could not be ordered) or when the CUDA runtime fails; Wait throws c10::Error when the
// CUDA runtime fails. Thread safe.
#ifndef VMM_TORCH_PLUGIN_CSRC_READY_EVENTS_H_
#define VMM_TORCH_PLUGIN_CSRC_READY_EVENTS_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

namespace vmm_torch {

// A storage among the ready events: its address and its StorageImpl.
struct StorageKey {
  uintptr_t base = 0;
  uintptr_t impl = 0;
  bool operator==(const StorageKey& other) const {
    return base == other.base && impl == other.impl;
  }
};

struct StorageKeyHash {
  size_t operator()(const StorageKey& key) const {
    return std::hash<uintptr_t>()(key.base) * 31 + std::hash<uintptr_t>()(key.impl);
  }
};

class ReadyEvents {
 public:
  static constexpr size_t kMaxStorages = 65536;

  // Records an event on the current stream of `device` for the storage `key`.
  void Record(const StorageKey& key, c10::DeviceIndex device) {
    c10::cuda::CUDAGuard guard(device);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
    TORCH_CHECK(status == cudaStreamCaptureStatusNone,
                "cannot send a CUDA tensor of vmm memory while the current stream captures a "
                "CUDA graph; send it after the capture");
    cudaEvent_t event = Take(device);
    const cudaError_t recorded = cudaEventRecord(event, stream);
    if (recorded != cudaSuccess) {
      Give({{device, event}});
      C10_CUDA_CHECK(recorded);
    }
    std::vector<Event> dropped;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Entry& entry = by_storage_[key];
      if (entry.events.empty()) {
        entry.generation = ++generation_;
        order_.push_back({key, entry.generation});
      }
      entry.events.emplace_back(device, event);
      while (by_storage_.size() > kMaxStorages) DropOldest(&dropped);
      if (order_.size() > 2 * kMaxStorages) Compact();
    }
    Give(dropped);
  }

  // Waits until the work the events of storage `key` follow is done, and reuses them; false
  // when there were none. An event not done yet is waited for inside `blocking(wait)` (which
  // releases the GIL around `wait`); done ones cost a query, and the caller keeps the GIL.
  template <typename Blocking>
  bool Wait(const StorageKey& key, Blocking&& blocking) {
    std::vector<Event> events = Claim(key);
    cudaError_t failed = cudaSuccess;
    for (const Event& event : events) {
      c10::cuda::CUDAGuard guard(event.first);  // no context made on another device
      cudaError_t done = cudaEventQuery(event.second);
      if (done == cudaErrorNotReady) blocking([&] { done = cudaEventSynchronize(event.second); });
      if (done != cudaSuccess && failed == cudaSuccess) failed = done;
    }
    Give(events);
    C10_CUDA_CHECK(failed);
    return !events.empty();
  }

  // Reuses the events of storage `key` without waiting (a send that synchronised otherwise).
  void Discard(const StorageKey& key) { Give(Claim(key)); }

 private:
  using Event = std::pair<c10::DeviceIndex, cudaEvent_t>;
  // A storage's events, and the generation of its place in order_ (a storage claimed and
  // recorded again gets a new place; its old one is stale).
  struct Entry {
    std::vector<Event> events;
    uint64_t generation = 0;
  };
  struct Place {
    StorageKey key;
    uint64_t generation = 0;
  };

  bool Current(const Place& place) const {
    auto it = by_storage_.find(place.key);
    return it != by_storage_.end() && it->second.generation == place.generation;
  }

  std::vector<Event> Claim(const StorageKey& key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_storage_.find(key);
    if (it == by_storage_.end()) return {};
    std::vector<Event> events = std::move(it->second.events);
    by_storage_.erase(it);
    return events;
  }

  // The oldest storage's events into `dropped` (order_ may hold stale places).
  void DropOldest(std::vector<Event>* dropped) {
    while (!order_.empty()) {
      const Place place = order_.front();
      order_.pop_front();
      if (!Current(place)) continue;
      auto it = by_storage_.find(place.key);
      dropped->insert(dropped->end(), it->second.events.begin(), it->second.events.end());
      by_storage_.erase(it);
      return;
    }
  }

  // Drops the stale places from order_, keeping the order of the rest.
  void Compact() {
    std::deque<Place> kept;
    for (const Place& place : order_) {
      if (Current(place)) kept.push_back(place);
    }
    order_.swap(kept);
  }

  cudaEvent_t Take(c10::DeviceIndex device) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::vector<cudaEvent_t>& free = free_[device];
      if (!free.empty()) {
        cudaEvent_t event = free.back();
        free.pop_back();
        return event;
      }
    }
    cudaEvent_t event = nullptr;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return event;
  }

  void Give(const std::vector<Event>& events) {
    if (events.empty()) return;
    std::lock_guard<std::mutex> lock(mu_);
    for (const Event& event : events) free_[event.first].push_back(event.second);
  }

  std::mutex mu_;  // guards everything below
  // Storages with events, and the order they got their first one (oldest first).
  std::unordered_map<StorageKey, Entry, StorageKeyHash> by_storage_;
  std::deque<Place> order_;
  uint64_t generation_ = 0;
  std::unordered_map<c10::DeviceIndex, std::vector<cudaEvent_t>> free_;
};

}  // namespace vmm_torch

#endif  // VMM_TORCH_PLUGIN_CSRC_READY_EVENTS_H_
