// vmm_demo: the main job in one program — allocate, share with another process, dump stats.
//
//   bazel run //tools:vmm_demo                      # best backend: CUDA if present, else host
//   VMM_BACKEND=host bazel run //tools:vmm_demo -- --size=256M --out=/tmp/vmm_stats.json
//
// The parent creates a pool, allocates a buffer and fills it with a pattern, exports it as a
// descriptor, and starts a second process (this program again, with --import) that imports
// the descriptor, checks every byte, and writes a marker into the first bytes. The parent
// checks the marker, frees the buffer, prints a stats table and writes the stats and a
// snapshot as JSON.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "allocator/descriptor.h"
#include "allocator/driver_factory.h"
#include "allocator/pool.h"
#include "allocator/sharing.h"
#include "allocator/stats_json.h"
#include "tests/subprocess.h"

namespace vmm {
namespace {

constexpr uint8_t kMarker = 0xA5;

uint8_t PatternAt(size_t i) { return static_cast<uint8_t>(i * 31 + 7); }

std::string Flag(int argc, char** argv, const std::string& name, const std::string& fallback) {
  const std::string prefix = "--" + name + "=";
  for (int i = 1; i < argc; ++i) {
    if (absl::StartsWith(argv[i], prefix)) return argv[i] + prefix.size();
  }
  return fallback;
}

size_t ParseSize(const std::string& text) {
  size_t scale = 1;
  std::string digits = text;
  if (!digits.empty() && (digits.back() == 'M' || digits.back() == 'G' || digits.back() == 'K')) {
    scale = digits.back() == 'K' ? 1 << 10 : digits.back() == 'M' ? 1 << 20 : size_t{1} << 30;
    digits.pop_back();
  }
  size_t n = 0;
  return absl::SimpleAtoi(digits, &n) ? n * scale : 0;
}

int Fail(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "vmm_demo: %s: %s\n", what.c_str(), status.ToString().c_str());
  return 1;
}

absl::Status CopyOut(Driver* driver, DevPtr src, std::vector<uint8_t>& host) {
  absl::Status s = driver->MemcpyAsync(reinterpret_cast<DevPtr>(host.data()), src, host.size(), 0);
  return s.ok() ? driver->SynchronizeStream(0) : s;
}

// The second process: import, check, mark.
int Importer(Driver* driver, const std::string& hex) {
  absl::StatusOr<BufferDescriptor> d = BufferDescriptor::Decode(absl::HexStringToBytes(hex));
  if (!d.ok()) return Fail("decode", d.status());
  absl::StatusOr<std::unique_ptr<ImportedBuffer>> buffer = ImportBuffer(driver, *d);
  if (!buffer.ok()) return Fail("import", buffer.status());
  std::vector<uint8_t> host((*buffer)->size());
  if (absl::Status s = CopyOut(driver, (*buffer)->ptr(), host); !s.ok()) return Fail("read", s);
  for (size_t i = 0; i < host.size(); ++i) {
    if (host[i] != PatternAt(i)) {
      std::fprintf(stderr, "vmm_demo: byte %zu is %u, expected %u\n", i, host[i], PatternAt(i));
      return 1;
    }
  }
  absl::Status s = driver->MemsetAsync((*buffer)->ptr(), kMarker, 4096, 0);
  if (s.ok()) s = driver->SynchronizeStream(0);
  if (!s.ok()) return Fail("write", s);
  std::printf("  [pid %d] imported %zu bytes (%zu handle(s), %s) from %s: all bytes match; "
              "wrote a marker\n",
              getpid(), host.size(), d->handles().size(),
              std::string(HandleTypeName(d->handle_type())).c_str(),
              d->owner_uuid().value_or("?").c_str());
  return 0;
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
  const size_t size = ParseSize(Flag(argc, argv, "size", "64M"));
  // `bazel run` starts programs in their runfiles: write beside the user's checkout.
  const char* workspace = std::getenv("BUILD_WORKSPACE_DIRECTORY");
  const std::string out = Flag(argc, argv, "out",
                               workspace != nullptr ? std::string(workspace) + "/vmm_stats.json"
                                                    : "vmm_stats.json");
  if (size == 0) return Fail("--size", absl::InvalidArgumentError("expected e.g. 64M"));
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
  for (size_t i = 0; i < size; ++i) host[i] = PatternAt(i);
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

  Subprocess child({"/proc/self/exe", "--import=" + absl::BytesToHexString(bytes)});
  for (std::string line = child.ReadLine(); !line.empty(); line = child.ReadLine()) {
    std::printf("%s\n", line.c_str());
  }
  if (child.Wait() != 0) return Fail("import", absl::InternalError("the second process failed"));

  if (s = CopyOut(driver, dev, host); !s.ok()) return Fail("read back", s);
  const bool marked = host[0] == kMarker && host[4095] == kMarker && host[4096] == PatternAt(4096);
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
  const std::string hex = vmm::Flag(argc, argv, "import", "");
  return hex.empty() ? vmm::Exporter(*driver, argc, argv) : vmm::Importer(*driver, hex);
}
