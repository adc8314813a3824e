// A stand-in for the part of PyTorch's <c10/cuda/CUDACachingAllocator.h> that
// torch_plugin/csrc/alloc_history.h uses, so that the history's logic builds and is tested on
// machines without a CUDA build of torch (tests/alloc_history_test.cc). It declares the same
// names with the same shapes as torch 2.11 (trace entries, record-context levels, the context
// recorder and trace trackers); it is not PyTorch's code, and nothing but that test includes
// it. Where torch changes these shapes, the extension's own build (on the GPU machine) is
// what fails, not this test.
#ifndef VMM_TESTS_TORCH_STAND_IN_C10_CUDA_CUDACACHINGALLOCATOR_H_
#define VMM_TESTS_TORCH_STAND_IN_C10_CUDA_CUDACACHINGALLOCATOR_H_

#include <cstddef>
#include <cstdint>
#include <ctime>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

struct CUstream_st;
using cudaStream_t = CUstream_st*;

namespace c10 {

using DeviceIndex = int8_t;
using CaptureId_t = unsigned long long;
using MempoolId_t = std::pair<CaptureId_t, CaptureId_t>;

// A recorded stack: here only a label the test can compare.
struct GatheredContext {
  virtual ~GatheredContext() = default;
  std::string label;
};

namespace cuda {
using c10::MempoolId_t;
}  // namespace cuda

namespace CachingDeviceAllocator {

using CreateContextFn = std::shared_ptr<GatheredContext> (*)();

enum struct RecordContext { NEVER = 0, STATE = 1, ALLOC = 2, ALL = 3 };

union trace_time_ {
  time_t t_;
  uint64_t approx_t_;
};

struct TraceEntry {
  enum Action {
    ALLOC,
    FREE_REQUESTED,
    FREE_COMPLETED,
    SEGMENT_ALLOC,
    SEGMENT_FREE,
    SEGMENT_MAP,
    SEGMENT_UNMAP,
    SNAPSHOT,
    OOM
  };
  TraceEntry(Action action, DeviceIndex device, size_t addr, size_t size, void* stream,
             MempoolId_t mempool, uint64_t time, std::shared_ptr<GatheredContext> context = {},
             std::string compile_context = "", std::string user_metadata = "")
      : action_(action),
        device_(device),
        addr_(addr),
        context_(std::move(context)),
        stream_(stream),
        size_(size),
        mempool_(std::move(mempool)),
        compile_context_(std::move(compile_context)),
        user_metadata_(std::move(user_metadata)) {
    time_.approx_t_ = time;
  }
  Action action_;
  DeviceIndex device_;
  size_t addr_;
  std::shared_ptr<GatheredContext> context_;
  void* stream_{};
  size_t size_;
  MempoolId_t mempool_;
  trace_time_ time_{};
  std::string compile_context_;
  std::string user_metadata_;
};

// The action of a name PyTorch's Python API gives (skip_actions); throws on an unknown one.
inline TraceEntry::Action parseTraceEntryAction(std::string_view name) {
  static constexpr std::pair<std::string_view, TraceEntry::Action> kNames[] = {
      {"alloc", TraceEntry::ALLOC},
      {"free_requested", TraceEntry::FREE_REQUESTED},
      {"free_completed", TraceEntry::FREE_COMPLETED},
      {"segment_alloc", TraceEntry::SEGMENT_ALLOC},
      {"segment_free", TraceEntry::SEGMENT_FREE},
      {"segment_map", TraceEntry::SEGMENT_MAP},
      {"segment_unmap", TraceEntry::SEGMENT_UNMAP},
      {"snapshot", TraceEntry::SNAPSHOT},
      {"oom", TraceEntry::OOM},
  };
  for (const auto& [n, action] : kNames) {
    if (n == name) return action;
  }
  throw std::invalid_argument("unknown trace entry action");
}

using AllocatorTraceTracker = std::function<void(const TraceEntry&)>;

}  // namespace CachingDeviceAllocator

namespace cuda::CUDACachingAllocator {
using c10::CachingDeviceAllocator::AllocatorTraceTracker;
using c10::CachingDeviceAllocator::CreateContextFn;
using c10::CachingDeviceAllocator::RecordContext;
using c10::CachingDeviceAllocator::TraceEntry;
}  // namespace cuda::CUDACachingAllocator

}  // namespace c10

#endif  // VMM_TESTS_TORCH_STAND_IN_C10_CUDA_CUDACACHINGALLOCATOR_H_
