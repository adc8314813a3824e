// timed_driver.h: a Driver that times the calls a pool makes to grow, move and release its
// memory (create, map, unmap, set access, release, stream synchronisation), for benchmarks
// that report where an operation's time goes (bench/replay).
//
//   vmm_bench::TimedDriver timed(*driver);
//   vmm::Pool::Create(&timed, options) ...;  timed.Times()  // nanoseconds so far, by call
//
// Every call is passed on (allocator/forwarding_driver.h); failures are timed and returned as
// they are. Times are wall-clock nanoseconds summed over calls, read with relaxed atomics (a
// pool calls from any thread). The inner driver must outlive it.
#ifndef VMM_BENCH_TIMED_DRIVER_H_
#define VMM_BENCH_TIMED_DRIVER_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "allocator/forwarding_driver.h"

namespace vmm_bench {

class TimedDriver : public vmm::ForwardingDriver {
 public:
  enum Call { kCreate, kMap, kUnmap, kSetAccess, kRelease, kSync, kCalls };

  explicit TimedDriver(vmm::Driver* inner) : ForwardingDriver(inner) {}

  // The summed nanoseconds of each timed call, named "driver_ns_<call>", and their total
  // "driver_ns".
  std::vector<std::pair<std::string, int64_t>> Times() const {
    static constexpr const char* kNames[kCalls] = {"create",     "map",     "unmap",
                                                   "set_access", "release", "sync"};
    std::vector<std::pair<std::string, int64_t>> out;
    int64_t total = 0;
    for (int c = 0; c < kCalls; ++c) {
      const int64_t ns = ns_[c].load(std::memory_order_relaxed);
      out.emplace_back(std::string("driver_ns_") + kNames[c], ns);
      total += ns;
    }
    out.emplace_back("driver_ns", total);
    return out;
  }

  absl::StatusOr<vmm::PhysHandle> Create(int d, size_t size, uint32_t types) override {
    return Timed(kCreate, [&] { return ForwardingDriver::Create(d, size, types); });
  }
  absl::Status Map(vmm::DevPtr p, size_t size, vmm::PhysHandle h) override {
    return Timed(kMap, [&] { return ForwardingDriver::Map(p, size, h); });
  }
  absl::Status Unmap(vmm::DevPtr p, size_t size) override {
    return Timed(kUnmap, [&] { return ForwardingDriver::Unmap(p, size); });
  }
  absl::Status SetAccess(vmm::DevPtr p, size_t size, absl::Span<const int> devices) override {
    return Timed(kSetAccess, [&] { return ForwardingDriver::SetAccess(p, size, devices); });
  }
  absl::Status Release(vmm::PhysHandle h) override {
    return Timed(kRelease, [&] { return ForwardingDriver::Release(h); });
  }
  absl::Status SynchronizeStream(vmm::Stream s) override {
    return Timed(kSync, [&] { return ForwardingDriver::SynchronizeStream(s); });
  }
  absl::Status SynchronizeDevice(int d) override {
    return Timed(kSync, [&] { return ForwardingDriver::SynchronizeDevice(d); });
  }

 private:
  template <typename F>
  auto Timed(Call call, F&& f) -> decltype(f()) {
    const auto start = std::chrono::steady_clock::now();
    auto result = f();
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now() - start)
                        .count();
    ns_[call].fetch_add(ns, std::memory_order_relaxed);
    return result;
  }

  std::atomic<int64_t> ns_[kCalls] = {};
};

}  // namespace vmm_bench

#endif  // VMM_BENCH_TIMED_DRIVER_H_
