// torch_peer_bench: the workloads of alloc_workloads.h through PyTorch's CUDA caching
// allocator (c10::cuda::CUDACachingAllocator::raw_alloc / raw_delete), for comparison with
// vmm (docs/DESIGN.md §5). Built on the GPU machine against the installed torch by build_torch_peer.sh;
// not part of the Bazel build.
//
// The allocator's settings come from PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF), read by
// PyTorch itself; the results are labelled from it: "torch_expandable" with
// expandable_segments:True, "torch_cuda_malloc_async" with backend:cudaMallocAsync, else
// "torch_native" (--label overrides).
//
//   bench/build_torch_peer.sh /tmp/torch_peer_bench
//   /tmp/torch_peer_bench --trace=/tmp/trace.txt
//   PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True /tmp/torch_peer_bench --trace=/tmp/trace.txt
//
// Flags: --trace=FILE (no replay when absent), --live=64,1024, --iters=100000, --reps=7,
// --warm_reps=3, --label=NAME.
#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <utility>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

#include "alloc_workloads.h"

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;

// num_device_alloc / num_device_free appeared in DeviceStats in later releases; these read
// them where they exist and give -1 where they do not.
template <typename T, typename = void>
struct HasDeviceAllocCounts : std::false_type {};
template <typename T>
struct HasDeviceAllocCounts<T, std::void_t<decltype(std::declval<T&>().num_device_alloc),
                                           decltype(std::declval<T&>().num_device_free)>>
    : std::true_type {};

template <typename Stats>
std::pair<int64_t, int64_t> DeviceAllocCounts(const Stats& s) {
  if constexpr (HasDeviceAllocCounts<Stats>::value) {
    return {static_cast<int64_t>(s.num_device_alloc), static_cast<int64_t>(s.num_device_free)};
  } else {
    return {-1, -1};
  }
}

std::string Lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

// The label for the allocator settings in the environment.
std::string LabelFromEnv() {
  std::string conf;
  for (const char* var : {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"}) {
    if (const char* v = std::getenv(var)) conf += Lower(v) + ",";
  }
  conf.erase(std::remove(conf.begin(), conf.end(), ' '), conf.end());
  if (conf.find("backend:cudamallocasync") != std::string::npos) return "torch_cuda_malloc_async";
  if (conf.find("expandable_segments:true") != std::string::npos) return "torch_expandable";
  return "torch_native";
}

// PyTorch's CUDA allocator on device 0 and the current (default) stream.
class TorchAdapter {
 public:
  explicit TorchAdapter(std::string name) : name_(std::move(name)) {}

  std::string Name() const { return name_; }

  void* Alloc(size_t bytes) {
    try {
      return cca::raw_alloc(bytes);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: raw_alloc(%zu): %s\n", name_.c_str(), bytes, e.what());
      return nullptr;
    }
  }

  void Free(void* p) { cca::raw_delete(p); }

  vmm_bench::AllocStats Stats() {
    const auto s = cca::getDeviceStats(0);
    vmm_bench::AllocStats out;
    const size_t all = 0;  // StatType::AGGREGATE
    out.reserved = s.reserved_bytes[all].current;
    out.peak_reserved = s.reserved_bytes[all].peak;
    const auto [device_alloc, device_free] = DeviceAllocCounts(s);
    if (device_alloc >= 0) {
      out.counts.emplace_back("num_device_alloc", device_alloc);
      out.counts.emplace_back("num_device_free", device_free);
    }
    // Segments created and released (cudaMalloc / cudaFree, or expandable segments created).
    out.counts.emplace_back("segments_allocated", s.segment[all].allocated);
    out.counts.emplace_back("segments_freed", s.segment[all].freed);
    out.counts.emplace_back("num_alloc_retries", s.num_alloc_retries);
    if (name_ == "torch_expandable") {
      // Expandable segments map and unmap pages of 2 MiB (small pool) and 20 MiB (large pool):
      // each page mapped is a cuMemCreate and a cuMemMap, each unmapped a cuMemUnmap and a
      // cuMemRelease, and each map a cuMemSetAccess (num_device_alloc counts maps). A lower
      // bound of the driver calls, from PyTorch's own byte counts.
      constexpr size_t kSmall = 1, kLarge = 2;  // StatType::SMALL_POOL, LARGE_POOL
      const int64_t mapped = s.reserved_bytes[kSmall].allocated / (int64_t{2} << 20) +
                             s.reserved_bytes[kLarge].allocated / (int64_t{20} << 20);
      const int64_t unmapped = s.reserved_bytes[kSmall].freed / (int64_t{2} << 20) +
                               s.reserved_bytes[kLarge].freed / (int64_t{20} << 20);
      out.counts.emplace_back("driver_calls",
                              2 * (mapped + unmapped) + std::max<int64_t>(device_alloc, 0));
    }
    return out;
  }

  // Releases the cache and starts peaks and totals afresh.
  void Reset() {
    cca::emptyCache();
    cca::resetPeakStats(0);
    cca::resetAccumulatedStats(0);
  }

 private:
  std::string name_;
};

}  // namespace

int main(int argc, char** argv) {
  using vmm_bench::FlagValue;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    bool known = false;
    for (const char* flag : {"--trace=", "--live=", "--iters=", "--reps=", "--warm_reps=",
                             "--label="}) {
      known |= arg.rfind(flag, 0) == 0;
    }
    if (!known) {
      std::fprintf(stderr, "torch_peer_bench: unknown argument %s\n", arg.c_str());
      return 2;
    }
  }
  if (c10::cuda::device_count() == 0) {
    std::fprintf(stderr, "torch_peer_bench: no CUDA GPU visible to PyTorch\n");
    return 1;
  }
  cca::init(c10::cuda::device_count());  // what torch's lazy CUDA initialisation does

  TorchAdapter adapter(FlagValue(argc, argv, "label", LabelFromEnv()));
  vmm_bench::JsonLine tags;
  const char* conf = std::getenv("PYTORCH_CUDA_ALLOC_CONF");
  tags.Str("alloc_conf", conf != nullptr ? conf : "");

  bool ok = true;
  for (const std::string& live : vmm_bench::SplitList(FlagValue(argc, argv, "live", "64,1024"))) {
    vmm_bench::PairOptions pair;
    pair.live = std::stoul(live);
    pair.iterations = std::stoul(FlagValue(argc, argv, "iters", "100000"));
    pair.repetitions = std::stoi(FlagValue(argc, argv, "reps", "7"));
    adapter.Reset();
    if (!vmm_bench::RunPairWorkload(adapter, pair, tags)) {
      std::fprintf(stderr, "torch_peer_bench: pair test with %s live failed\n", live.c_str());
      ok = false;
    }
  }
  const std::string trace_path = FlagValue(argc, argv, "trace", "");
  if (!trace_path.empty()) {
    vmm_bench::Trace trace;
    std::string error;
    if (!vmm_bench::LoadTrace(trace_path, &trace, &error)) {
      std::fprintf(stderr, "torch_peer_bench: %s\n", error.c_str());
      return 1;
    }
    vmm_bench::ReplayOptions replay;
    replay.warm_repetitions = std::stoi(FlagValue(argc, argv, "warm_reps", "3"));
    if (!vmm_bench::RunReplayWorkload(adapter, trace, replay, tags)) {
      std::fprintf(stderr, "torch_peer_bench: replay failed\n");
      ok = false;
    }
  }
  adapter.Reset();
  return ok ? 0 : 1;
}
