// vmm_adapter.h: the workload adapter (alloc_workloads.h) for a vmm Pool, and the backend
// choice shared by the benchmark programs.
//
//   absl::StatusOr<vmm::Driver*> driver = vmm_bench::BenchDriver("host", 256 << 30);
//   vmm_bench::VmmAdapter adapter(*driver, vmm::PoolOptions{});
//   if (absl::Status s = adapter.Init(); !s.ok()) ...
//   vmm_bench::RunPairWorkload(adapter, {});
#ifndef VMM_BENCH_VMM_ADAPTER_H_
#define VMM_BENCH_VMM_ADAPTER_H_

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/driver.h"
#include "allocator/driver_factory.h"
#include "allocator/host_driver.h"
#include "allocator/pool.h"
#include "bench/alloc_workloads.h"
#include "bench/timed_driver.h"

namespace vmm_bench {

// The driver for `backend`: "cuda", "host", or "auto" (CUDA when a device is present, else
// host). The host backend is a private one with `host_capacity` bytes of (untouched, hence
// free) memfd memory, so that traces larger than the default capacity fit.
inline absl::StatusOr<vmm::Driver*> BenchDriver(const std::string& backend,
                                                size_t host_capacity) {
  std::string name = backend;
  if (name == "auto") {
    absl::StatusOr<vmm::Driver*> best = vmm::DefaultDriver();
    if (!best.ok()) return best.status();
    name = std::string((*best)->Name());
  }
  if (name == "host") {
    vmm::HostDriverOptions options;
    options.capacity = host_capacity;
    static vmm::Driver* host = vmm::NewHostDriver(options).release();  // lives until exit
    return host;
  }
  return vmm::DriverByName(name);
}

// A vmm Pool on stream 0. Reset() replaces the pool with a fresh one, so that a replay starts
// from nothing reserved.
class VmmAdapter {
 public:
  VmmAdapter(vmm::Driver* driver, const vmm::PoolOptions& options, std::string name = "vmm")
      : driver_(driver), options_(options), name_(std::move(name)) {}

  // Creates the pool.
  absl::Status Init() {
    pool_.reset();
    absl::StatusOr<std::unique_ptr<vmm::Pool>> pool = vmm::Pool::Create(driver_, options_);
    if (!pool.ok()) return pool.status();
    pool_ = *std::move(pool);
    return absl::OkStatus();
  }

  std::string Name() const { return name_; }

  void* Alloc(size_t bytes) {
    absl::StatusOr<void*> p = pool_->Allocate(bytes, 0);
    if (!p.ok()) {
      std::fprintf(stderr, "%s: Allocate(%zu): %s\n", name_.c_str(), bytes,
                   p.status().ToString().c_str());
      return nullptr;
    }
    return *p;
  }

  void Free(void* ptr) {
    absl::Status s = pool_->Free(ptr);
    if (!s.ok()) std::fprintf(stderr, "%s: Free: %s\n", name_.c_str(), s.ToString().c_str());
  }

  // Also report the nanoseconds `timed` (the driver the pool was given, or one it forwards
  // to) spent in the pool's driver calls, as counts named "driver_ns*" (timed_driver.h).
  void ReportDriverTimes(const TimedDriver* timed) { timed_ = timed; }

  AllocStats Stats() const {
    const vmm::PoolStats s = pool_->GetStats();
    AllocStats out;
    out.reserved = s.reserved_bytes.current;
    out.peak_reserved = s.reserved_bytes.peak;
    const int64_t calls = s.driver_create + s.driver_map + s.driver_set_access +
                          s.driver_unmap + s.driver_release;
    out.counts = {{"num_device_alloc", s.num_device_alloc},
                  {"num_device_free", s.num_device_free},
                  {"driver_calls", calls},
                  {"driver_create", s.driver_create},
                  {"driver_map", s.driver_map},
                  {"driver_set_access", s.driver_set_access},
                  {"driver_unmap", s.driver_unmap},
                  {"driver_release", s.driver_release},
                  {"driver_event", s.driver_event},
                  {"num_chunk_moves", s.num_chunk_moves},
                  {"moved_bytes", s.moved_bytes},
                  {"num_sync_stream", s.num_sync_stream}};
    if (timed_ != nullptr) {
      for (auto& time : timed_->Times()) out.counts.push_back(std::move(time));
    }
    return out;
  }

  void Reset() {
    if (absl::Status s = Init(); !s.ok()) {
      std::fprintf(stderr, "%s: creating the pool: %s\n", name_.c_str(), s.ToString().c_str());
      std::abort();
    }
  }

  vmm::Pool* pool() const { return pool_.get(); }

 private:
  vmm::Driver* const driver_;
  const vmm::PoolOptions options_;
  const std::string name_;
  std::unique_ptr<vmm::Pool> pool_;
  const TimedDriver* timed_ = nullptr;
};

}  // namespace vmm_bench

#endif  // VMM_BENCH_VMM_ADAPTER_H_
