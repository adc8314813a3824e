// growth_bench: the cost of growing an empty pool, against the bare driver calls that map the
// same chunks (docs/DESIGN.md §5: pool <= 1.5 x bare).
//
// For each chunk size it times, `--reps` times each and interleaved:
//   - vmm:  one Pool::Allocate(grow) on a fresh, empty pool (PoolOptions::max_chunk = chunk),
//   - bare: Driver::Create + Map for each chunk of the same range, then one SetAccess,
// through the same Driver and with the same handle types, and prints the medians and their
// ratio as JSON lines (alloc_workloads.h). Creating the pool (reserving its range) and
// releasing the memory happen between repetitions and are not timed; the release is timed
// separately (vmm: Free + EmptyCache; bare: Unmap + Release).
//
//   bazel run -c opt //bench:growth_bench                     # CUDA if present, else host
//   bazel run -c opt //bench:growth_bench -- --backend=host --reps=5
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/types/span.h"
#include "allocator/driver.h"
#include "allocator/pool.h"
#include "bench/alloc_workloads.h"
#include "bench/vmm_adapter.h"

ABSL_FLAG(std::string, backend, "auto", "driver backend: auto, cuda or host");
ABSL_FLAG(int64_t, grow_mib, 1024, "bytes to grow by, in MiB");
ABSL_FLAG(std::vector<std::string>, chunk_mib, std::vector<std::string>({"0", "2"}),
          "physical chunk sizes in MiB (0: one chunk of the whole growth)");
ABSL_FLAG(int, reps, 15, "timed repetitions (the median is reported)");
ABSL_FLAG(std::string, handle_type, "auto", "pool handle type: auto, none, posix_fd, fabric");

namespace {

using vmm::Driver;
using vmm_bench::JsonLine;
using Clock = std::chrono::steady_clock;

constexpr size_t kMiB = size_t{1} << 20;

double MicrosSince(Clock::time_point start) { return vmm_bench::SecondsSince(start) * 1e6; }

bool Fail(const char* what, const absl::Status& status) {
  std::fprintf(stderr, "growth_bench: %s: %s\n", what, status.ToString().c_str());
  return false;
}

struct Timing {
  double grow_us = 0;
  double release_us = 0;
};

// One growth of a fresh pool by `grow` bytes in chunks of at most `chunk`.
bool TimePool(Driver* driver, vmm::PoolOptions options, size_t grow, size_t chunk,
              Timing* timing, vmm::HandleType* handle_type) {
  options.max_chunk = chunk;
  options.reserve_size = 4 * grow;  // the small arena takes an eighth
  absl::StatusOr<std::unique_ptr<vmm::Pool>> pool = vmm::Pool::Create(driver, options);
  if (!pool.ok()) return Fail("Pool::Create", pool.status());
  *handle_type = (*pool)->handle_type();
  const auto start = Clock::now();
  absl::StatusOr<void*> p = (*pool)->Allocate(grow, 0);
  timing->grow_us = MicrosSince(start);
  if (!p.ok()) return Fail("Pool::Allocate", p.status());
  const vmm::PoolStats stats = (*pool)->GetStats();
  const int64_t chunks = static_cast<int64_t>((grow + chunk - 1) / chunk);
  if (stats.driver_create != chunks || stats.driver_set_access != 1) {
    std::fprintf(stderr, "growth_bench: the pool made %lld creates and %lld set_access, "
                 "expected %lld and 1\n", static_cast<long long>(stats.driver_create),
                 static_cast<long long>(stats.driver_set_access),
                 static_cast<long long>(chunks));
    return false;
  }
  const auto release = Clock::now();
  if (absl::Status s = (*pool)->Free(*p); !s.ok()) return Fail("Pool::Free", s);
  if (absl::Status s = (*pool)->EmptyCache(); !s.ok()) return Fail("Pool::EmptyCache", s);
  timing->release_us = MicrosSince(release);
  return true;
}

// The bare driver calls for the same range: Create + Map per chunk, one SetAccess.
bool TimeBare(Driver* driver, size_t grow, size_t chunk, uint32_t handle_bits, Timing* timing) {
  absl::StatusOr<size_t> granularity = driver->Granularity(0);
  if (!granularity.ok()) return Fail("Granularity", granularity.status());
  absl::StatusOr<vmm::DevPtr> base = driver->Reserve(grow, *granularity);
  if (!base.ok()) return Fail("Reserve", base.status());
  std::vector<vmm::PhysHandle> handles;
  bool ok = true;
  const auto start = Clock::now();
  for (size_t off = 0; off < grow && ok; off += chunk) {
    const size_t size = std::min(chunk, grow - off);
    absl::StatusOr<vmm::PhysHandle> h = driver->Create(0, size, handle_bits);
    if (!h.ok()) {
      ok = Fail("Create", h.status());
      break;
    }
    handles.push_back(*h);
    if (absl::Status s = driver->Map(*base + off, size, *h); !s.ok()) ok = Fail("Map", s);
  }
  const int device = 0;
  if (ok) {
    if (absl::Status s = driver->SetAccess(*base, grow, absl::MakeConstSpan(&device, 1));
        !s.ok()) {
      ok = Fail("SetAccess", s);
    }
  }
  timing->grow_us = MicrosSince(start);
  const auto release = Clock::now();
  if (ok) {
    if (absl::Status s = driver->Unmap(*base, grow); !s.ok()) ok = Fail("Unmap", s);
  } else {
    // A partial mapping: unmap what was mapped, chunk by chunk.
    for (size_t i = 0; i < handles.size(); ++i) {
      (void)driver->Unmap(*base + i * chunk, std::min(chunk, grow - i * chunk));
    }
  }
  for (vmm::PhysHandle h : handles) {
    if (absl::Status s = driver->Release(h); !s.ok()) ok = Fail("Release", s);
  }
  timing->release_us = MicrosSince(release);
  if (absl::Status s = driver->Unreserve(*base, grow); !s.ok()) ok = Fail("Unreserve", s);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Times growing a vmm pool against the bare driver calls.");
  absl::ParseCommandLine(argc, argv);
  vmm::PoolOptions options;
  options.large_page = 0;  // one growth in chunks of `chunk` bytes
  const std::optional<vmm::HandleRequest> request =
      vmm::ParseHandleRequest(absl::GetFlag(FLAGS_handle_type));
  if (!request) {
    std::fprintf(stderr, "growth_bench: bad --handle_type\n");
    return 2;
  }
  options.handle_type = *request;
  absl::StatusOr<Driver*> driver = vmm_bench::BenchDriver(absl::GetFlag(FLAGS_backend),
                                                          size_t{64} << 30);
  if (!driver.ok()) {
    std::fprintf(stderr, "growth_bench: %s\n", driver.status().ToString().c_str());
    return 1;
  }
  const std::string backend((*driver)->Name());
  const size_t grow = static_cast<size_t>(absl::GetFlag(FLAGS_grow_mib)) * kMiB;
  const int reps = std::max(1, absl::GetFlag(FLAGS_reps));

  for (const std::string& chunk_flag : absl::GetFlag(FLAGS_chunk_mib)) {
    uint64_t chunk_mib = 0;
    if (!absl::SimpleAtoi(chunk_flag, &chunk_mib)) {
      std::fprintf(stderr, "growth_bench: bad --chunk_mib value %s\n", chunk_flag.c_str());
      return 2;
    }
    const size_t chunk = chunk_mib == 0 ? grow : static_cast<size_t>(chunk_mib) * kMiB;
    std::vector<double> pool_grow, pool_release, bare_grow, bare_release;
    vmm::HandleType handle_type = vmm::HandleType::kNone;
    // Repetition 0 warms both paths (driver entry points, first-touch of host structures).
    for (int rep = 0; rep <= reps; ++rep) {
      Timing p, b;
      if (!TimePool(*driver, options, grow, chunk, &p, &handle_type)) return 1;
      if (!TimeBare(*driver, grow, chunk, vmm::HandleTypeBit(handle_type), &b)) return 1;
      if (rep == 0) continue;
      pool_grow.push_back(p.grow_us);
      pool_release.push_back(p.release_us);
      bare_grow.push_back(b.grow_us);
      bare_release.push_back(b.release_us);
    }
    const std::string name = "grow_" + std::to_string(grow / kMiB) + "MiB/chunk=" +
                             std::to_string(chunk / kMiB) + "MiB";
    JsonLine tags;
    tags.Str("backend", backend)
        .Str("handle_type", std::string(vmm::HandleTypeName(handle_type)))
        .Int("chunks", static_cast<int64_t>((grow + chunk - 1) / chunk))
        .Int("repetitions", reps);
    const double pool_us = vmm_bench::Median(pool_grow);
    const double bare_us = vmm_bench::Median(bare_grow);
    vmm_bench::Result("grow", name, "vmm", "grow_us", pool_us, "us").Merge(tags).Print();
    vmm_bench::Result("grow", name, "bare_driver", "grow_us", bare_us, "us").Merge(tags).Print();
    vmm_bench::Result("grow", name, "vmm", "grow_over_bare", pool_us / bare_us, "x")
        .Num("target", 1.5)
        .Merge(tags)
        .Print();
    vmm_bench::Result("grow", name, "vmm", "release_us", vmm_bench::Median(pool_release), "us")
        .Merge(tags)
        .Print();
    vmm_bench::Result("grow", name, "bare_driver", "release_us",
                      vmm_bench::Median(bare_release), "us")
        .Merge(tags)
        .Print();
    std::fprintf(stderr, "%s (%s): pool %.1f us, bare %.1f us, ratio %.3f (target <= 1.5)\n",
                 name.c_str(), backend.c_str(), pool_us, bare_us, pool_us / bare_us);
  }
  return 0;
}
