// vmm_demo: the main job in one program — allocate, share with another process, dump stats.
//
//   bazel run //tools:vmm_demo                      # best backend: CUDA if present, else host
//   VMM_BACKEND=host bazel run //tools:vmm_demo -- --size=256M --out=/tmp/vmm_stats.json
//
// The parent creates a pool, allocates a buffer and fills it with a pattern, exports it as a
// descriptor, and starts a second process (tools/vmm_peer import, found beside this program or
// in its runfiles) that imports the descriptor, checks every byte, and writes a marker into
// the first bytes. The parent checks the marker, frees the buffer, prints a stats table and
// writes the stats and a snapshot as JSON.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "allocator/byte_size.h"
#include "allocator/descriptor.h"
#include "allocator/driver_factory.h"
#include "allocator/pool.h"
#include "allocator/sharing.h"
#include "allocator/stats_json.h"
#include "tests/subprocess.h"
#include "tools/byte_pattern.h"

namespace vmm {
namespace {

constexpr uint8_t kMarker = 0xA5;
constexpr size_t kMarkerSize = 4096;

std::string Flag(int argc, char** argv, const std::string& name, const std::string& fallback) {
  const std::string prefix = "--" + name + "=";
  for (int i = 1; i < argc; ++i) {
    if (absl::StartsWith(argv[i], prefix)) return argv[i] + prefix.size();
  }
  return fallback;
}

int Fail(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "vmm_demo: %s: %s\n", what.c_str(), status.ToString().c_str());
  return 1;
}

absl::Status CopyOut(Driver* driver, DevPtr src, std::vector<uint8_t>& host) {
  absl::Status s = driver->MemcpyAsync(reinterpret_cast<DevPtr>(host.data()), src, host.size(), 0);
  return s.ok() ? driver->SynchronizeStream(0) : s;
}

// The second process (vmm_peer import, on this driver's backend): imports the descriptor,
// checks every byte against the pattern and writes the marker over the first bytes; its
// output is printed here.
absl::Status RunImporter(Driver* driver, const std::string& encoded) {
  Subprocess child({HelperProgramPath("tools/vmm_peer"), "import",
                    absl::StrCat("--backend=", driver->Name()),
                    "--descriptor=" + absl::BytesToHexString(encoded), "--expect=pattern",
                    absl::StrCat("--write=", kMarker), absl::StrCat("--write_size=", kMarkerSize)},
                   {}, Subprocess::Output::kWithStderr);
  if (!child.started()) return absl::InternalError("could not start tools/vmm_peer");
  for (std::string line = child.ReadLine(); !line.empty(); line = child.ReadLine()) {
    std::printf("  [second process] %s\n", line.c_str());
  }
  if (const int code = child.Wait(); code != 0) {
    return absl::InternalError(absl::StrCat("the second process exited with ", code));
  }
  return absl::OkStatus();
}

void PrintStats(const PoolStats& s) {
  auto mib = [](int64_t n) { return static_cast<double>(n) / (1 << 20); };
  std::printf("\n%-22s %12s %12s\n", "statistic", "current", "peak");
  std::printf("%-22s %10.1f M %10.1f M\n", "allocated", mib(s.allocated_bytes.current),
              mib(s.allocated_bytes.peak));
  std::printf("%-22s %10.1f M %10.1f M\n", "reserved", mib(s.reserved_bytes.current),
              mib(s.reserved_bytes.peak));
  std::printf("%-22s %10.1f M %10.1f M\n", "exported", mib(s.exported_bytes.current),
              mib(s.exported_bytes.peak));
  std::printf("%-22s %12ld %12ld\n", "allocations", s.allocation.current, s.allocation.peak);
  std::printf("%-22s %12ld %12ld\n", "chunks", s.segment.current, s.segment.peak);
  std::printf("%-22s %12ld\n", "growths", s.num_device_alloc);
  std::printf("%-22s %12ld\n", "releases", s.num_device_free);
  std::printf("%-22s %12ld\n", "driver: create", s.driver_create);
  std::printf("%-22s %12ld\n", "driver: map", s.driver_map);
  std::printf("%-22s %12ld\n", "driver: set access", s.driver_set_access);
  std::printf("%-22s %12ld\n", "driver: export", s.driver_export);
  std::printf("%-22s %12.3f\n", "fragmentation", s.fragmentation);
}

int Exporter(Driver* driver, int argc, char** argv) {
  absl::StatusOr<uint64_t> size_flag = ParseByteSize(Flag(argc, argv, "size", "64M"));
  if (!size_flag.ok()) return Fail("--size", size_flag.status());
  if (*size_flag < 2 * kMarkerSize) {
    return Fail("--size", absl::InvalidArgumentError(
                              absl::StrCat("at least ", 2 * kMarkerSize, " bytes, e.g. 64M")));
  }
  const size_t size = *size_flag;
  // `bazel run` starts programs in their runfiles: write beside the user's checkout.
  const char* workspace = std::getenv("BUILD_WORKSPACE_DIRECTORY");
  const std::string out = Flag(argc, argv, "out",
                               workspace != nullptr ? std::string(workspace) + "/vmm_stats.json"
                                                    : "vmm_stats.json");
  PoolOptions options;
  options.reserve_size = std::max<size_t>(size_t{8} << 30, 4 * size);
  absl::StatusOr<std::unique_ptr<Pool>> pool = CreateExportablePool(driver, options);
  if (!pool.ok()) return Fail("pool", pool.status());
  std::printf("vmm demo on the %s backend, device %s, handles: %s\n",
              std::string(driver->Name()).c_str(), (*pool)->device_uuid().c_str(),
              std::string(HandleTypeName((*pool)->handle_type())).c_str());

  // Some ordinary traffic, then the buffer to share.
  for (size_t n : {size_t{4096}, size_t{3} << 20, size_t{40} << 20}) {
    absl::StatusOr<void*> p = (*pool)->Allocate(n, 0);
    if (!p.ok()) return Fail("allocate", p.status());
    (void)(*pool)->Free(*p);
  }
  absl::StatusOr<void*> ptr = (*pool)->Allocate(size, 0);
  if (!ptr.ok()) return Fail("allocate", ptr.status());
  std::vector<uint8_t> host(size);
  for (size_t i = 0; i < size; ++i) host[i] = PatternByte(i);
  const auto dev = reinterpret_cast<DevPtr>(*ptr);
  absl::Status s = driver->MemcpyAsync(dev, reinterpret_cast<DevPtr>(host.data()), size, 0);
  if (s.ok()) s = driver->SynchronizeStream(0);
  if (!s.ok()) return Fail("fill", s);
  std::printf("  [pid %d] allocated %zu bytes at %p and filled them\n", getpid(), size, *ptr);

  absl::StatusOr<BufferDescriptor> d = ExportBuffer(**pool, *ptr);
  if (!d.ok()) return Fail("export", d.status());
  const std::string bytes = d->Encode();
  std::printf("  [pid %d] exported: %zu handle(s), descriptor of %zu bytes\n", getpid(),
              d->handles().size(), bytes.size());

  if (s = RunImporter(driver, bytes); !s.ok()) return Fail("import", s);

  if (s = CopyOut(driver, dev, host); !s.ok()) return Fail("read back", s);
  const bool marked = host[0] == kMarker && host[kMarkerSize - 1] == kMarker &&
                      host[kMarkerSize] == PatternByte(kMarkerSize);
  std::printf("  [pid %d] the second process's marker is %s\n", getpid(),
              marked ? "visible here: the memory is shared" : "MISSING");
  if (!marked) return 1;
  if (s = (*pool)->Free(*ptr); !s.ok()) return Fail("free", s);

  PrintStats((*pool)->GetStats());
  nlohmann::json dump;
  dump["stats"] = StatsToJson((*pool)->GetStats());
  dump["torch_stats"] = TorchMemoryStats((*pool)->GetStats());
  dump["snapshot"] = SnapshotToJson((*pool)->GetSnapshot());
  std::ofstream(out) << dump.dump(2) << "\n";
  std::printf("\nstats and snapshot written to %s\n", out.c_str());
  return 0;
}

}  // namespace
}  // namespace vmm

int main(int argc, char** argv) {
  absl::StatusOr<vmm::Driver*> driver = vmm::DefaultDriver();
  if (!driver.ok()) return vmm::Fail("driver", driver.status());
  return vmm::Exporter(*driver, argc, argv);
}
