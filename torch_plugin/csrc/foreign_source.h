// The segments of a torch.cuda.MemPool over another allocator (foreign_segments.h) from that
// allocator, on one device, with CUDA events ordering the frees of blocks other streams used.
//
// Its segments count against the GPU's memory fraction with vmm's own pools (`hold`, over
// vmm_device_hold), as PyTorch's allocator counts a custom allocator's segments with its own,
// and its blocks in the GPU's joint allocated bytes (`count`, over vmm_device_hold_allocated),
// are entered in the plugin's ForeignIndex under their pool (set_owner), and are told, as
// they come and before they go back, to a `Tell` (set_tell: the allocation history's
// segment_alloc / segment_free entries), called with the pool's lock held.
//
// Failures: a segment the fraction does not admit, or one the allocator returns null for or
// throws an out-of-memory error on, gives a null segment (failure() says which; the caller
// reports the out of memory); an event is not recorded on a stream that
// captures a CUDA graph (0: ForeignSegments asks again later); a failed event call is warned
// about and taken as complete, since nothing could wait for it later (the sticky error
// surfaces at the program's next CUDA call); a failed device synchronisation is warned about
// and reported, so that nothing is taken as complete.
#ifndef VMM_TORCH_PLUGIN_CSRC_FOREIGN_SOURCE_H_
#define VMM_TORCH_PLUGIN_CSRC_FOREIGN_SOURCE_H_

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include "torch_plugin/csrc/foreign_index.h"
#include "torch_plugin/csrc/foreign_segments.h"

namespace vmm_torch {

class AllocatorSource : public ForeignSource {
 public:
  // Counts `delta` bytes against the GPU's memory fraction; false (nothing counted) when a
  // delta > 0 does not fit, with why in `*why`.
  using Hold = std::function<bool(int64_t delta, std::string* why)>;
  // Counts `delta` bytes of blocks handed out (> 0) or taken back (< 0) in the GPU's joint
  // allocated figure.
  using Count = std::function<void(int64_t delta)>;
  // Told each segment the allocator gave (`made`) or is about to be given back, with the
  // stream it was asked for. Must not call into the pool.
  using Tell = std::function<void(bool made, void* segment, size_t size, uintptr_t stream)>;

  AllocatorSource(std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator,
                  c10::DeviceIndex device, Hold hold, Count count, ForeignIndex* index)
      : allocator_(std::move(allocator)),
        device_(device),
        hold_(std::move(hold)),
        count_(std::move(count)),
        index_(index) {}

  // The pool its segments are entered under in the index (before its first Allocate); `keep`
  // is what keeps that pool alive, held by the index only while a segment is entered.
  void set_owner(ForeignSegments* pool, std::weak_ptr<void> keep) {
    owner_ = pool;
    keep_ = std::move(keep);
  }
  // Whom to tell of its segments (before its first Allocate).
  void set_tell(Tell tell) { tell_ = std::move(tell); }

  void* Allocate(size_t size, uintptr_t stream) override {
    std::string why;
    if (!hold_(static_cast<int64_t>(size), &why)) {
      SetLastFailure(why.c_str());
      return nullptr;
    }
    c10::cuda::CUDAGuard guard(device_);
    void* segment = nullptr;
    try {
      segment = allocator_->raw_alloc_with_stream(size, reinterpret_cast<cudaStream_t>(stream));
    } catch (const c10::OutOfMemoryError&) {
      segment = nullptr;
    } catch (...) {
      hold_(-static_cast<int64_t>(size), nullptr);  // the allocator's own error, passed on
      throw;
    }
    if (segment == nullptr) {
      hold_(-static_cast<int64_t>(size), nullptr);
      SetLastFailure("the MemPool's allocator returned no memory");
      return nullptr;
    }
    index_->Add(segment, size, ForeignIndex::Owner{owner_, keep_.lock()});
    if (tell_) tell_(/*made=*/true, segment, size, stream);
    return segment;
  }

  void Release(void* segment, size_t size, uintptr_t stream) override {
    index_->Remove(segment);  // first: the allocator may hand the address out again at once
    if (tell_) tell_(/*made=*/false, segment, size, stream);
    // The pool no longer has the segment, whatever the allocator's free does.
    hold_(-static_cast<int64_t>(size), nullptr);
    c10::cuda::CUDAGuard guard(device_);
    allocator_->raw_delete(segment);
  }

  void CountAllocated(int64_t delta) override {
    if (count_) count_(delta);
  }

  // Why the calling thread's last Allocate that returned null did (cut at 511 bytes).
  static const char* LastFailure() { return FailureText(); }

  uintptr_t RecordEvent(uintptr_t stream) override {
    const auto cuda_stream = reinterpret_cast<cudaStream_t>(stream);
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(cuda_stream, &capture) != cudaSuccess) {
      (void)cudaGetLastError();
    } else if (capture != cudaStreamCaptureStatusNone) {
      return 0;  // recorded after the capture (the event would be a node of the graph)
    }
    c10::cuda::CUDAGuard guard(StreamDevice(cuda_stream));
    cudaEvent_t event = nullptr;
    if (!Ok(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "creating an event")) {
      return kNoEvent;
    }
    if (!Ok(cudaEventRecord(event, cuda_stream), "recording an event")) {
      (void)cudaEventDestroy(event);
      return kNoEvent;
    }
    return reinterpret_cast<uintptr_t>(event);
  }

  bool EventDone(uintptr_t event) override {
    if (event == kNoEvent) return true;
    const cudaError_t rc = cudaEventQuery(reinterpret_cast<cudaEvent_t>(event));
    if (rc == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    Ok(rc, "querying an event");  // a failed event counts as done: nothing could wait for it
    return true;
  }

  void DestroyEvent(uintptr_t event) override {
    if (event != kNoEvent) (void)cudaEventDestroy(reinterpret_cast<cudaEvent_t>(event));
  }

  bool SynchronizeDevice() override {
    c10::cuda::CUDAGuard guard(device_);
    return Ok(cudaDeviceSynchronize(), "synchronizing the device");
  }

 private:
  // A fixed buffer, trivially destructible, as libvmm's error record: an allocation may come
  // after the thread's thread_local objects were destroyed (its exit), where a string's
  // buffer, freed, would be freed again.
  static constexpr size_t kFailureTextBytes = 512;
  static char* FailureText() {
    thread_local char text[kFailureTextBytes] = "";
    return text;
  }
  static void SetLastFailure(const char* why) {
    std::snprintf(FailureText(), kFailureTextBytes, "%s", why);
  }

  // What stands for an event whose creation or recording failed: taken as complete.
  static constexpr uintptr_t kNoEvent = 1;

  // The device of `stream` (a record_stream may name another GPU's stream), else the pool's.
  c10::DeviceIndex StreamDevice(cudaStream_t stream) const {
#if CUDART_VERSION >= 12080
    int device = 0;
    if (stream != nullptr && cudaStreamGetDevice(stream, &device) == cudaSuccess) {
      return static_cast<c10::DeviceIndex>(device);
    }
    (void)cudaGetLastError();
#endif
    return device_;
  }

  static bool Ok(cudaError_t rc, const char* what) {
    if (rc == cudaSuccess) return true;
    (void)cudaGetLastError();
    TORCH_WARN("vmm: a MemPool over another allocator: ", what, " failed: ",
               cudaGetErrorString(rc));
    return false;
  }

  std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator_;
  c10::DeviceIndex device_;
  Hold hold_;
  Count count_;
  ForeignIndex* index_;
  ForeignSegments* owner_ = nullptr;
  std::weak_ptr<void> keep_;
  Tell tell_;
};

}  // namespace vmm_torch

#endif  // VMM_TORCH_PLUGIN_CSRC_FOREIGN_SOURCE_H_
