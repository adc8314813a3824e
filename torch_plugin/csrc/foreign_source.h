// The segments of a torch.cuda.MemPool over another allocator (foreign_segments.h) from that
// allocator, on one device, with CUDA events ordering the frees of blocks other streams used.
//
// Failures: an allocator that returns null or throws an out-of-memory error gives a null
// segment (the caller reports the out of memory); an event is not recorded on a stream that
// captures a CUDA graph (0: ForeignSegments asks again later); a failed event call is warned
// about and taken as complete, since nothing could wait for it later (the sticky error
// surfaces at the program's next CUDA call); a failed device synchronisation is warned about
// and reported, so that nothing is taken as complete.
#ifndef VMM_TORCH_PLUGIN_CSRC_FOREIGN_SOURCE_H_
#define VMM_TORCH_PLUGIN_CSRC_FOREIGN_SOURCE_H_

#include <cstdint>
#include <memory>
#include <utility>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include "torch_plugin/csrc/foreign_segments.h"

namespace vmm_torch {

class AllocatorSource : public ForeignSource {
 public:
  AllocatorSource(std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator,
                  c10::DeviceIndex device)
      : allocator_(std::move(allocator)), device_(device) {}

  void* Allocate(size_t size, uintptr_t stream) override {
    c10::cuda::CUDAGuard guard(device_);
    try {
      return allocator_->raw_alloc_with_stream(size, reinterpret_cast<cudaStream_t>(stream));
    } catch (const c10::OutOfMemoryError&) {
      return nullptr;
    }
  }

  void Release(void* segment) override {
    c10::cuda::CUDAGuard guard(device_);
    allocator_->raw_delete(segment);
  }

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
};

}  // namespace vmm_torch

#endif  // VMM_TORCH_PLUGIN_CSRC_FOREIGN_SOURCE_H_
