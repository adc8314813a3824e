// device_cap.h: one cap on the physical bytes several pools of a device hold together.
//
// set_per_process_memory_fraction caps everything PyTorch's allocator holds on a device; with
// vmm registered, that is the device pool and the private pools (CUDA graph pools, MemPools)
// on that GPU (torch_plugin/process_state.h). Each such pool shares the DeviceCap of its GPU:
// its ChunkMap adds what it maps and subtracts what it releases, and Pool::Grow refuses a
// growth that would take the pools' sum past the limit (ResourceExhausted, after which the
// pool trims its own cache and retries, as for its own memory limit). Checked, not reserved:
// two pools growing at the same moment may pass the limit by one growth each. Thread safe.
#ifndef VMM_ALLOCATOR_DEVICE_CAP_H_
#define VMM_ALLOCATOR_DEVICE_CAP_H_

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace vmm {

class DeviceCap {
 public:
  // The most bytes the sharing pools may hold together (0: no limit).
  void SetLimit(size_t bytes) { limit_.store(bytes, std::memory_order_relaxed); }
  size_t limit() const { return limit_.load(std::memory_order_relaxed); }

  // Bytes mapped (`delta` > 0) or released (< 0) by one of the pools.
  void Add(int64_t delta) { held_.fetch_add(delta, std::memory_order_relaxed); }
  int64_t held() const { return held_.load(std::memory_order_relaxed); }

  // Whether `more` bytes fit under the limit now.
  bool Allows(size_t more) const {
    const size_t cap = limit();
    const int64_t held_now = held();
    return cap == 0 || static_cast<size_t>(held_now < 0 ? 0 : held_now) + more <= cap;
  }

 private:
  std::atomic<size_t> limit_{0};
  std::atomic<int64_t> held_{0};
};

}  // namespace vmm

#endif  // VMM_ALLOCATOR_DEVICE_CAP_H_
