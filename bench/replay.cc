// replay: replays an allocation trace through a vmm Pool and prints JSON results (one object
// per line, alloc_workloads.h): peak reserved / peak allocated, growths and releases
// (num_device_alloc / num_device_free), driver calls by kind, and ns per operation.
//
// Growth-policy options take comma-separated lists; every combination is replayed, so one
// run studies the policy:
//
//   python3 bench/training_trace.py > /tmp/trace.txt
//   bazel run -c opt //bench:replay -- --trace=/tmp/trace.txt --backend=host
//       --growth_fraction=0,0.01,0.02,0.05 --max_growth_extra_mib=128,512,inf   (one line)
//
// A one-line summary per combination goes to stderr.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "allocator/pool.h"
#include "bench/alloc_workloads.h"
#include "bench/vmm_adapter.h"

ABSL_FLAG(std::string, trace, "", "trace file: lines 'a ID BYTES' / 'f ID' (required)");
ABSL_FLAG(std::string, backend, "auto", "driver backend: auto, cuda or host");
ABSL_FLAG(std::vector<std::string>, growth_fraction, {},
          "PoolOptions::growth_fraction values (default: the PoolOptions default)");
ABSL_FLAG(std::vector<std::string>, max_growth_extra_mib, {},
          "PoolOptions::max_growth_extra values in MiB, 'inf' for no cap (default: the "
          "PoolOptions default)");
ABSL_FLAG(int64_t, max_chunk_mib, 0, "PoolOptions::max_chunk in MiB (0: the default)");
ABSL_FLAG(std::vector<std::string>, large_page_mib, {},
          "PoolOptions::large_page values in MiB, 0 for off (default: the PoolOptions "
          "default, auto: 4 MiB pages for a pool that does not export); growth_fraction and "
          "max_growth_extra apply only with 0");
ABSL_FLAG(int64_t, host_capacity_gib, 256,
          "physical capacity of the host backend in GiB (memfd memory is never touched)");
ABSL_FLAG(int, warm_reps, 3, "replays from a warm cache after the first one");
ABSL_FLAG(bool, reset_peaks, false,
          "reset the pool's peak statistics before each warm replay (as a training loop that "
          "logs a peak per step does)");
ABSL_FLAG(std::string, label, "vmm", "allocator label in the results");
ABSL_FLAG(std::string, options, "",
          "pool option text (pool_options.h, e.g. 'small_size=256K,small_chunk=8M') applied "
          "before the swept flags above");

namespace {

constexpr size_t kMiB = size_t{1} << 20;

// `bazel run` starts the program in its runfiles; relative paths mean the user's directory.
std::string UserPath(const std::string& path) {
  const char* dir = std::getenv("BUILD_WORKING_DIRECTORY");
  if (path.empty() || path[0] == '/' || dir == nullptr) return path;
  return std::string(dir) + "/" + path;
}

bool ParseFractions(const std::vector<std::string>& in, std::vector<double>* out) {
  for (const std::string& s : in) {
    double v = 0;
    if (!absl::SimpleAtod(s, &v)) return false;
    out->push_back(v);
  }
  return true;
}

bool ParseMib(const std::vector<std::string>& in, std::vector<size_t>* out) {
  for (const std::string& s : in) {
    uint64_t v = 0;
    if (s == "inf") {
      out->push_back(SIZE_MAX);
    } else if (absl::SimpleAtoi(s, &v)) {
      out->push_back(static_cast<size_t>(v) * kMiB);
    } else {
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Replays an allocation trace through a vmm Pool.");
  absl::ParseCommandLine(argc, argv);
  const std::string trace_path = UserPath(absl::GetFlag(FLAGS_trace));
  if (trace_path.empty()) {
    std::fprintf(stderr, "replay: --trace=FILE is required\n");
    return 2;
  }
  vmm_bench::Trace trace;
  std::string error;
  if (!vmm_bench::LoadTrace(trace_path, &trace, &error)) {
    std::fprintf(stderr, "replay: %s\n", error.c_str());
    return 1;
  }

  absl::StatusOr<vmm::PoolOptions> parsed = vmm::ParsePoolOptions(absl::GetFlag(FLAGS_options));
  if (!parsed.ok()) {
    std::fprintf(stderr, "replay: --options: %s\n", parsed.status().ToString().c_str());
    return 2;
  }
  const vmm::PoolOptions defaults = *parsed;
  std::vector<double> fractions;
  std::vector<size_t> extras;
  if (!ParseFractions(absl::GetFlag(FLAGS_growth_fraction), &fractions) ||
      !ParseMib(absl::GetFlag(FLAGS_max_growth_extra_mib), &extras)) {
    std::fprintf(stderr, "replay: bad --growth_fraction or --max_growth_extra_mib value\n");
    return 2;
  }
  if (fractions.empty()) fractions.push_back(defaults.growth_fraction);
  if (extras.empty()) extras.push_back(defaults.max_growth_extra);
  std::vector<size_t> pages;
  if (!ParseMib(absl::GetFlag(FLAGS_large_page_mib), &pages)) {
    std::fprintf(stderr, "replay: bad --large_page_mib value\n");
    return 2;
  }
  if (pages.empty()) pages.push_back(defaults.large_page);

  absl::StatusOr<vmm::Driver*> driver = vmm_bench::BenchDriver(
      absl::GetFlag(FLAGS_backend), static_cast<size_t>(absl::GetFlag(FLAGS_host_capacity_gib))
                                        << 30);
  if (!driver.ok()) {
    std::fprintf(stderr, "replay: %s\n", driver.status().ToString().c_str());
    return 1;
  }
  const std::string backend((*driver)->Name());
  std::fprintf(stderr, "replay: %s: %zu events, %zu allocations, peak allocated %.3f GiB, %s\n",
               trace.path.c_str(), trace.ops.size(), trace.allocs,
               static_cast<double>(trace.peak_live_bytes) / (1 << 30), backend.c_str());

  vmm_bench::ReplayOptions replay_options;
  replay_options.warm_repetitions = absl::GetFlag(FLAGS_warm_reps);
  int failures = 0;
  for (double fraction : fractions) {
    for (size_t extra : extras) {
     for (size_t page : pages) {
      vmm::PoolOptions options = defaults;
      options.large_page = page;
      options.growth_fraction = fraction;
      options.max_growth_extra = extra;
      if (absl::GetFlag(FLAGS_max_chunk_mib) > 0) {
        options.max_chunk = static_cast<size_t>(absl::GetFlag(FLAGS_max_chunk_mib)) * kMiB;
      }
      vmm_bench::TimedDriver timed(*driver);
      vmm_bench::VmmAdapter adapter(&timed, options, absl::GetFlag(FLAGS_label));
      adapter.ReportDriverTimes(&timed);
      if (absl::Status s = adapter.Init(); !s.ok()) {
        std::fprintf(stderr, "replay: creating the pool: %s\n", s.ToString().c_str());
        return 1;
      }
      vmm_bench::JsonLine tags;
      tags.Str("backend", backend)
          .Str("handle_type", std::string(vmm::HandleTypeName(adapter.pool()->handle_type())))
          .Num("growth_fraction", fraction);
      tags.Str("max_growth_extra_mib", extra == SIZE_MAX ? "inf" : std::to_string(extra / kMiB));
      tags.Int("max_chunk_mib", static_cast<int64_t>(options.max_chunk / kMiB));
      tags.Int("large_page_mib",
               static_cast<int64_t>(adapter.pool()->options().large_page / kMiB));
      tags.Int("growth_page_mib",
               static_cast<int64_t>(adapter.pool()->options().growth_page / kMiB));
      if (absl::GetFlag(FLAGS_reset_peaks)) {
        replay_options.before_warm_replay = [&adapter] { adapter.pool()->ResetPeakStats(); };
      }
      vmm_bench::ReplaySummary sum;
      if (!vmm_bench::RunReplayWorkload(adapter, trace, replay_options, tags, &sum)) {
        std::fprintf(stderr, "replay: growth_fraction=%g max_growth_extra=%zu MiB failed\n",
                     fraction, extra == SIZE_MAX ? 0 : extra / kMiB);
        ++failures;
        continue;
      }
      std::fprintf(stderr,
                   "growth_fraction=%-5g max_growth_extra=%5s MiB page=%4zu MiB  ratio=%.4f  "
                   "peak_reserved=%.3f GiB  growths=%lld releases=%lld driver_calls=%lld "
                   "(create=%lld map=%lld set_access=%lld unmap=%lld release=%lld) moves=%lld "
                   "syncs=%lld  %.0f ns/op cold, %.0f warm\n",
                   fraction, extra == SIZE_MAX ? "inf" : std::to_string(extra / kMiB).c_str(),
                   adapter.pool()->page() / kMiB,
                   sum.ratio, static_cast<double>(sum.peak_reserved) / (1 << 30),
                   static_cast<long long>(sum.Count("num_device_alloc")),
                   static_cast<long long>(sum.Count("num_device_free")),
                   static_cast<long long>(sum.Count("driver_calls")),
                   static_cast<long long>(sum.Count("driver_create")),
                   static_cast<long long>(sum.Count("driver_map")),
                   static_cast<long long>(sum.Count("driver_set_access")),
                   static_cast<long long>(sum.Count("driver_unmap")),
                   static_cast<long long>(sum.Count("driver_release")),
                   static_cast<long long>(sum.Count("num_chunk_moves")),
                   static_cast<long long>(sum.Count("num_sync_stream")), sum.ns_per_op_cold,
                   sum.ns_per_op_warm);
     }
    }
  }
  return failures == 0 ? 0 : 1;
}
