// vmm_peer_bench: the workloads of alloc_workloads.h for vmm and for the CUDA runtime's own
// allocators, side by side in one process (docs/DESIGN.md §5). PyTorch's allocator is measured by
// torch_peer_bench.cpp, which is built on the GPU machine; bench/report.py joins the results.
//
// Allocators (--allocators, comma separated):
//   vmm                a vmm Pool on the CUDA backend, stream 0 (--backend=host: the host
//                      backend, for a smoke run on a machine without a GPU).
//   cuda_malloc_async  cudaMallocAsync / cudaFreeAsync on one stream from the default
//                      memory pool, release threshold set to the maximum so that it caches.
//                      Peak reserved from cudaMemPoolAttrReservedMemHigh; its driver calls are
//                      not visible, so no counts.
//   cuda_malloc        plain cudaMalloc / cudaFree, the uncached reference: pair test only,
//                      with --cuda_malloc_iters pairs; --cuda_malloc_replay adds the replay
//                      (off by default: reserved equals allocated by construction, so its ratio
//                      says nothing, and every op is a synchronous driver call).
//
// Without a GPU it says so and exits with status 1 (unless only vmm on the host backend is
// asked for).
//
//   bazel run -c opt //bench:vmm_peer_bench -- --trace=/tmp/trace.txt
//   bazel run -c opt //bench:vmm_peer_bench -- --allocators=vmm --backend=host --trace=...
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "allocator/pool.h"
#include "bench/alloc_workloads.h"
#include "bench/vmm_adapter.h"

ABSL_FLAG(std::vector<std::string>, allocators,
          std::vector<std::string>({"vmm", "cuda_malloc_async", "cuda_malloc"}),
          "allocators to run: vmm, cuda_malloc_async, cuda_malloc");
ABSL_FLAG(std::string, backend, "cuda", "vmm's driver backend: cuda or host");
ABSL_FLAG(std::string, trace, "", "trace to replay (no replay when empty)");
ABSL_FLAG(std::vector<std::string>, live, std::vector<std::string>({"64", "1024"}),
          "live blocks in the pair test");
ABSL_FLAG(int64_t, iters, 100000, "pairs per repetition");
ABSL_FLAG(int, reps, 7, "pair test repetitions (median reported)");
ABSL_FLAG(int, warm_reps, 3, "warm replays after the cold one");
ABSL_FLAG(int64_t, cuda_malloc_iters, 2000, "pairs per repetition for cuda_malloc");
ABSL_FLAG(bool, cuda_malloc_replay, false, "also replay the trace through cuda_malloc");
ABSL_FLAG(double, growth_fraction, -1,
          "vmm PoolOptions::growth_fraction (<0: default; applies with --large_page_mib=0)");
ABSL_FLAG(int64_t, large_page_mib, -1, "vmm PoolOptions::large_page in MiB (<0: default)");
ABSL_FLAG(std::string, max_growth_extra_mib, "",
          "vmm PoolOptions::max_growth_extra in MiB, 'inf' for no cap (empty: default)");

namespace {

bool CudaOk(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return true;
  std::fprintf(stderr, "%s: %s (%s)\n", what, cudaGetErrorName(err), cudaGetErrorString(err));
  return false;
}

// cudaMallocAsync from the default pool, on a stream of its own.
class CudaMallocAsyncAdapter {
 public:
  ~CudaMallocAsyncAdapter() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  bool Init() {
    if (!CudaOk(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate") ||
        !CudaOk(cudaDeviceGetDefaultMemPool(&pool_, 0), "cudaDeviceGetDefaultMemPool")) {
      return false;
    }
    uint64_t threshold = UINT64_MAX;  // keep everything cached
    return CudaOk(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &threshold),
                  "cudaMemPoolSetAttribute(ReleaseThreshold)");
  }
  std::string Name() const { return "cuda_malloc_async"; }
  void* Alloc(size_t bytes) {
    void* p = nullptr;
    return CudaOk(cudaMallocAsync(&p, bytes, stream_), "cudaMallocAsync") ? p : nullptr;
  }
  void Free(void* p) { CudaOk(cudaFreeAsync(p, stream_), "cudaFreeAsync"); }
  vmm_bench::AllocStats Stats() {
    vmm_bench::AllocStats s;
    uint64_t current = 0, high = 0;
    if (CudaOk(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemCurrent, &current),
               "cudaMemPoolGetAttribute") &&
        CudaOk(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &high),
               "cudaMemPoolGetAttribute")) {
      s.reserved = static_cast<int64_t>(current);
      s.peak_reserved = static_cast<int64_t>(high);
    }
    return s;
  }
  // Returns the cached memory to the driver and resets the high-water mark to the current.
  void Reset() {
    CudaOk(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    CudaOk(cudaMemPoolTrimTo(pool_, 0), "cudaMemPoolTrimTo");
    uint64_t zero = 0;
    CudaOk(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &zero),
           "cudaMemPoolSetAttribute(ReservedMemHigh)");
  }

 private:
  cudaStream_t stream_ = nullptr;
  cudaMemPool_t pool_ = nullptr;
};

// Plain cudaMalloc / cudaFree. Nothing is cached, so reserved is what is live (tracked here,
// unrounded).
class CudaMallocAdapter {
 public:
  std::string Name() const { return "cuda_malloc"; }
  void* Alloc(size_t bytes) {
    void* p = nullptr;
    if (!CudaOk(cudaMalloc(&p, bytes), "cudaMalloc")) return nullptr;
    live_ += static_cast<int64_t>(bytes);
    peak_ = std::max(peak_, live_);
    sizes_.emplace_back(p, bytes);
    return p;
  }
  void Free(void* p) {
    for (size_t i = 0; i < sizes_.size(); ++i) {
      if (sizes_[i].first == p) {
        live_ -= static_cast<int64_t>(sizes_[i].second);
        sizes_[i] = sizes_.back();
        sizes_.pop_back();
        break;
      }
    }
    CudaOk(cudaFree(p), "cudaFree");
  }
  vmm_bench::AllocStats Stats() {
    vmm_bench::AllocStats s;
    s.reserved = live_;
    s.peak_reserved = peak_;
    return s;
  }
  void Reset() { peak_ = live_; }

 private:
  int64_t live_ = 0;
  int64_t peak_ = 0;
  std::vector<std::pair<void*, size_t>> sizes_;  // live blocks (a few thousand at most)
};

// `bazel run` starts the program in its runfiles; relative paths mean the user's directory.
std::string UserPath(const std::string& path) {
  const char* dir = std::getenv("BUILD_WORKING_DIRECTORY");
  if (path.empty() || path[0] == '/' || dir == nullptr) return path;
  return std::string(dir) + "/" + path;
}

// Runs the pair test for every --live value and, when a trace is given, the replay.
template <typename Adapter>
bool RunAll(Adapter& adapter, int64_t iters, const vmm_bench::Trace* trace,
            const vmm_bench::JsonLine& tags) {
  bool ok = true;
  for (const std::string& live : absl::GetFlag(FLAGS_live)) {
    vmm_bench::PairOptions pair;
    if (!absl::SimpleAtoi(live, &pair.live)) {
      std::fprintf(stderr, "vmm_peer_bench: bad --live value %s\n", live.c_str());
      return false;
    }
    pair.iterations = static_cast<size_t>(iters);
    pair.repetitions = absl::GetFlag(FLAGS_reps);
    adapter.Reset();
    if (!vmm_bench::RunPairWorkload(adapter, pair, tags)) {
      std::fprintf(stderr, "vmm_peer_bench: %s: pair test with %s live failed\n",
                   adapter.Name().c_str(), live.c_str());
      ok = false;
    }
  }
  if (trace != nullptr) {
    vmm_bench::ReplayOptions replay;
    replay.warm_repetitions = absl::GetFlag(FLAGS_warm_reps);
    if (!vmm_bench::RunReplayWorkload(adapter, *trace, replay, tags)) {
      std::fprintf(stderr, "vmm_peer_bench: %s: replay failed\n", adapter.Name().c_str());
      ok = false;
    }
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Pair test and trace replay: vmm and the CUDA runtime.");
  absl::ParseCommandLine(argc, argv);
  const std::vector<std::string> allocators = absl::GetFlag(FLAGS_allocators);
  const std::string backend = absl::GetFlag(FLAGS_backend);
  bool need_gpu = backend != "host";
  for (const std::string& a : allocators) {
    if (a != "vmm" && a != "cuda_malloc_async" && a != "cuda_malloc") {
      std::fprintf(stderr, "vmm_peer_bench: unknown allocator %s\n", a.c_str());
      return 2;
    }
    need_gpu |= a != "vmm";
  }
  if (need_gpu) {
    int devices = 0;
    const cudaError_t err = cudaGetDeviceCount(&devices);
    if (err != cudaSuccess || devices == 0) {
      std::fprintf(stderr,
                   "vmm_peer_bench: no CUDA GPU here (cudaGetDeviceCount: %s). Run it on the "
                   "GPU machine, or run only vmm on the host backend: "
                   "--allocators=vmm --backend=host\n",
                   err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
      return 1;
    }
    if (!CudaOk(cudaSetDevice(0), "cudaSetDevice")) return 1;
  }

  vmm_bench::Trace trace;
  const std::string trace_path = UserPath(absl::GetFlag(FLAGS_trace));
  if (!trace_path.empty()) {
    std::string error;
    if (!vmm_bench::LoadTrace(trace_path, &trace, &error)) {
      std::fprintf(stderr, "vmm_peer_bench: %s\n", error.c_str());
      return 1;
    }
  }
  const vmm_bench::Trace* replay = trace_path.empty() ? nullptr : &trace;
  const int64_t iters = absl::GetFlag(FLAGS_iters);

  bool ok = true;
  for (const std::string& name : allocators) {
    vmm_bench::JsonLine tags;
    if (name == "vmm") {
      absl::StatusOr<vmm::Driver*> driver = vmm_bench::BenchDriver(backend, size_t{256} << 30);
      if (!driver.ok()) {
        std::fprintf(stderr, "vmm_peer_bench: %s\n", driver.status().ToString().c_str());
        return 1;
      }
      vmm::PoolOptions options;
      if (absl::GetFlag(FLAGS_large_page_mib) >= 0) {
        options.large_page = static_cast<size_t>(absl::GetFlag(FLAGS_large_page_mib)) << 20;
      }
      if (absl::GetFlag(FLAGS_growth_fraction) >= 0) {
        options.growth_fraction = absl::GetFlag(FLAGS_growth_fraction);
      }
      const std::string extra = absl::GetFlag(FLAGS_max_growth_extra_mib);
      uint64_t extra_mib = 0;
      if (extra == "inf") {
        options.max_growth_extra = SIZE_MAX;
      } else if (absl::SimpleAtoi(extra, &extra_mib)) {
        options.max_growth_extra = static_cast<size_t>(extra_mib) << 20;
      } else if (!extra.empty()) {
        std::fprintf(stderr, "vmm_peer_bench: bad --max_growth_extra_mib %s\n", extra.c_str());
        return 2;
      }
      vmm_bench::VmmAdapter adapter(*driver, options);
      if (absl::Status s = adapter.Init(); !s.ok()) {
        std::fprintf(stderr, "vmm_peer_bench: creating the pool: %s\n", s.ToString().c_str());
        return 1;
      }
      tags.Str("backend", std::string((*driver)->Name()))
          .Str("handle_type", std::string(vmm::HandleTypeName(adapter.pool()->handle_type())))
          .Num("growth_fraction", options.growth_fraction)
          .Str("max_growth_extra_mib", options.max_growth_extra == SIZE_MAX
                                           ? "inf"
                                           : std::to_string(options.max_growth_extra >> 20))
          .Int("max_chunk_mib", static_cast<int64_t>(options.max_chunk >> 20))
          .Int("large_page_mib",
               static_cast<int64_t>(adapter.pool()->options().large_page >> 20));
      ok &= RunAll(adapter, iters, replay, tags);
    } else if (name == "cuda_malloc_async") {
      CudaMallocAsyncAdapter adapter;
      if (!adapter.Init()) return 1;
      ok &= RunAll(adapter, iters, replay, tags);
    } else {
      CudaMallocAdapter adapter;
      ok &= RunAll(adapter, absl::GetFlag(FLAGS_cuda_malloc_iters),
                   absl::GetFlag(FLAGS_cuda_malloc_replay) ? replay : nullptr, tags);
    }
  }
  return ok ? 0 : 1;
}
