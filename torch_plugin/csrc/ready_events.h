// ready_events.h: the CUDA events a torch.multiprocessing put records for the tensors it
// sends (vmm_torch.reductions.prepare_send) and the queue's feeder thread waits for before the
// send goes (vmm_torch.sharing.wait_until_ready), so that the receiver reads what was written
// before the put. One call each from Python instead of torch.cuda.Event, current_stream,
// record and is_current_stream_capturing (tens of microseconds on every put), and the events
// are reused instead of created for each put. Used by vmm_cuda_allocator.cpp's module.
//
// Failures: Record throws c10::Error while the current stream captures a CUDA graph (a send
// then could not be ordered) or when the CUDA runtime fails; Wait and Discard of an id that
// is not outstanding throw c10::ValueError. Thread safe.
#ifndef VMM_TORCH_PLUGIN_CSRC_READY_EVENTS_H_
#define VMM_TORCH_PLUGIN_CSRC_READY_EVENTS_H_

#include <cstdint>
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

class ReadyEvents {
 public:
  // Records an event on the current stream of `device`; returns its id (> 0).
  int64_t Record(c10::DeviceIndex device) {
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
      Give(device, event);
      C10_CUDA_CHECK(recorded);
    }
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t id = ++last_id_;
    outstanding_.emplace(id, std::make_pair(device, event));
    return id;
  }

  // Waits until the work event `id` follows is done (the caller releases the GIL), then
  // takes the event back.
  void Wait(int64_t id) {
    const auto [device, event] = Claim(id);
    const cudaError_t done = cudaEventSynchronize(event);
    Give(device, event);
    C10_CUDA_CHECK(done);
  }

  // Takes the event `id` back without waiting (a put whose object was never sent).
  void Discard(int64_t id) {
    const auto [device, event] = Claim(id);
    Give(device, event);
  }

 private:
  std::pair<c10::DeviceIndex, cudaEvent_t> Claim(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = outstanding_.find(id);
    TORCH_CHECK_VALUE(it != outstanding_.end(), "vmm: no outstanding ready event ", id);
    auto out = it->second;
    outstanding_.erase(it);
    return out;
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

  void Give(c10::DeviceIndex device, cudaEvent_t event) {
    std::lock_guard<std::mutex> lock(mu_);
    free_[device].push_back(event);
  }

  std::mutex mu_;
  int64_t last_id_ = 0;
  std::unordered_map<int64_t, std::pair<c10::DeviceIndex, cudaEvent_t>> outstanding_;
  std::unordered_map<c10::DeviceIndex, std::vector<cudaEvent_t>> free_;
};

}  // namespace vmm_torch

#endif  // VMM_TORCH_PLUGIN_CSRC_READY_EVENTS_H_
