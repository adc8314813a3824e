// import_bench: where the time of sharing a buffer between processes goes, driver call by
// driver call, so that the importer's critical path (docs/DESIGN.md §5: import an 8 GiB buffer) can be
// taken apart and the cheaper ways of issuing the same calls compared.
//
// For each handle type (--handle_types; a type that cannot be created and exported here, e.g.
// fabric without an IMEX channel, gets one {"skipped": ..., "why": ...} line), buffer size
// (--sizes) and way of cutting the buffer into physical allocations (--chunk_sizes: "whole" is
// one allocation, otherwise pieces of that size; more than 4096 pieces is skipped), every
// repetition runs, in this process and through one Driver, fresh buffers through:
//   bare_driver: 1 Create each piece (exportable as the type)  2 Export each piece
//     3 Import each exported handle  4 Reserve the whole range  5 Map each imported piece in
//     order  6 SetAccess once over the whole range (device 0)  7 Unmap (one call, whole range)
//     8 Unreserve  9 Release the imported handles, then the originals.
//     One line per step (median ns) and critical_path_ns: the median of steps 3-6 summed.
//   bare_driver/align=A: as bare_driver, the range reserved at alignment A (from
//     --reserve_alignments; whether the page tables get cheaper when the range is aligned).
//   bare_driver/set_access_per_piece: step 6 as one SetAccess per piece (summed).
//   bare_driver/set_access_xT: step 6 as T equal granularity-aligned parts issued at once
//     from T threads (T from --threads).
//   bare_driver/import_map_xT: Reserve first, then steps 3 and 5 from T threads, each
//     importing and mapping a contiguous run of the pieces (only with more than one piece).
//     Threads are started before the clock and released together: only the calls are timed.
//     Each variant is one line, critical_path_ns, with its steps' medians as fields.
//   vmm: a Pool forced to the handle type (max_chunk = the piece size) allocates a shareable
//     block of the size (allocate_ns); Pool::Export exports its fresh chunks (pool_export_ns);
//     ExportBuffer then describes them (describe_ns: fd registration with the FdServer, the
//     handles already exported); ImportBuffer maps the descriptor in this process
//     (import_buffer_ns; for posix_fd this takes FetchFds' same-process shortcut, no socket)
//     and the buffer is closed (close_ns); the block is freed (free_ns). Then a second process
//     (tools/vmm_peer import-loop, started once) imports the same descriptor for real:
//     xproc_fd_fetch_ns (posix_fd: the fds fetched over the exporter's Unix socket alone),
//     xproc_import_buffer_ns (ImportBuffer, socket fetch included) and xproc_close_ns, timed
//     there.
// Repetition 0 is a warm-up and not reported; variants are interleaved within a repetition.
// Output: JSON lines (alloc_workloads.h), bench "import"; a summary per combination on stderr.
//
//   bazel run -c opt //bench:import_bench -- --backend=host --sizes=64M
//   import_bench --backend=cuda --sizes=64M,1G,8G --handle_types=fabric,posix_fd
//       --chunk_sizes=whole,1G,2M --reps=7 > import.jsonl     (one line; these are the defaults)
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "allocator/byte_size.h"
#include "allocator/descriptor.h"
#include "allocator/driver.h"
#include "allocator/handle_probe.h"
#include "allocator/pool.h"
#include "allocator/sharing.h"
#include "allocator/status_macros.h"
#include "bench/alloc_workloads.h"
#include "bench/vmm_adapter.h"
#include "tests/subprocess.h"

ABSL_FLAG(std::string, backend, "auto", "driver backend: auto, cuda or host");
ABSL_FLAG(std::vector<std::string>, sizes, std::vector<std::string>({"64M", "1G", "8G"}),
          "buffer sizes (K/M/G suffixes)");
ABSL_FLAG(int, reps, 7, "timed repetitions (medians are reported)");
ABSL_FLAG(std::vector<std::string>, handle_types,
          std::vector<std::string>({"fabric", "posix_fd"}), "handle types: fabric, posix_fd");
ABSL_FLAG(std::vector<std::string>, chunk_sizes,
          std::vector<std::string>({"whole", "1G", "2M"}),
          "physical allocation sizes: whole (one allocation) or a size (K/M/G suffixes)");
ABSL_FLAG(std::vector<std::string>, threads, std::vector<std::string>({"2", "4", "8"}),
          "thread counts of the concurrent variants");
ABSL_FLAG(std::vector<std::string>, reserve_alignments, std::vector<std::string>(),
          "alignments of the reserved range (K/M/G suffixes) to also time bare_driver with");
ABSL_FLAG(bool, keep_exported_fd, false,
          "hold one small allocation exported as a POSIX fd (fd open) for the whole run: "
          "whether the driver's cost of a first fd export is per export or set up once");
ABSL_FLAG(bool, vmm_path, true, "also time Pool::Export + ImportBuffer");
ABSL_FLAG(bool, cross_process, true, "also import the vmm descriptor in a second process");

namespace {

using vmm::DevPtr;
using vmm::Driver;
using vmm::HandleType;
using vmm::PhysHandle;
using vmm_bench::JsonLine;
using Clock = std::chrono::steady_clock;

constexpr size_t kMaxPieces = 4096;
constexpr int kDevice = 0;

double NsSince(Clock::time_point start) { return vmm_bench::SecondsSince(start) * 1e9; }

// `s` with `what` before its message (OK stays OK).
absl::Status Fail(absl::string_view what, const absl::Status& s) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

void Warn(absl::string_view what, const absl::Status& s) {
  if (!s.ok()) std::fprintf(stderr, "import_bench: %.*s: %s\n", static_cast<int>(what.size()),
                            what.data(), s.ToString().c_str());
}

// The value of a size flag (byte_size.h); InvalidArgument naming the flag when malformed.
absl::StatusOr<size_t> ParseSizeFlag(absl::string_view flag, const std::string& text) {
  absl::StatusOr<uint64_t> n = vmm::ParseByteSize(text);
  if (!n.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", n.status().message()));
  }
  return static_cast<size_t>(*n);
}

// A size in result names: "64MiB", "2GiB", "1536KiB" — exact, the largest binary unit that
// divides it (vmm::FormatBytes rounds to two decimals, for people; names must be exact).
std::string SizeName(size_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (u < 4 && n >= 1024 && n % 1024 == 0) n /= 1024, ++u;
  return absl::StrCat(n, units[u]);
}

void PrintSkipped(const std::string& name, const std::string& why) {
  JsonLine().Str("bench", "import").Str("skipped", name).Str("why", why).Print();
}
void PrintError(const std::string& name, const std::string& allocator, const absl::Status& s) {
  JsonLine().Str("bench", "import").Str("name", name).Str("allocator", allocator)
      .Str("error", s.ToString()).Print();
  std::fprintf(stderr, "import_bench: %s (%s): %s\n", name.c_str(), allocator.c_str(),
               s.ToString().c_str());
}

// Whether this driver can create memory exportable as `type` (the pools' own probe).
absl::Status Probe(Driver* driver, HandleType type, size_t granularity) {
  return vmm::ProbeHandleType(*driver, kDevice, granularity, type);
}

// Runs fn(t) for t in [0, threads) on threads started before the clock and released together;
// returns the ns from the release to the last one's end.
template <typename Fn>
double TimeOnThreads(int threads, Fn fn) {
  std::atomic<bool> go{false};
  std::atomic<int> ready{0}, done{0};
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      fn(t);
      done.fetch_add(1, std::memory_order_release);
    });
  }
  while (ready.load() < threads) std::this_thread::yield();
  const auto start = Clock::now();
  go.store(true, std::memory_order_release);
  while (done.load(std::memory_order_acquire) < threads) std::this_thread::yield();
  const double ns = NsSince(start);
  for (std::thread& w : workers) w.join();
  return ns;
}

absl::Status FirstError(const std::vector<absl::Status>& statuses) {
  for (const absl::Status& s : statuses) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

enum Step { kCreate, kExport, kImport, kReserve, kMap, kSetAccess, kUnmap, kUnreserve,
            kReleaseImported, kReleaseOriginal, kSteps };
const char* const kStepNames[kSteps] = {"create", "export", "import", "reserve", "map",
                                        "set_access", "unmap", "unreserve", "release_imported",
                                        "release_original"};

struct Variant {
  enum Kind { kBase, kAccessPerPiece, kAccessThreads, kImportMapThreads } kind;
  int threads;
  std::string label;
  size_t alignment = 0;  // of the reserved range; 0: the granularity
};

// What one pass holds; the destructor gives back whatever an error left behind.
struct Buffer {
  Driver* driver;
  std::vector<size_t> sizes, offsets;
  size_t total = 0;
  std::vector<PhysHandle> originals, imported;  // 0: none
  std::vector<vmm::ShareableHandle> exported;
  std::vector<uint8_t> mapped;
  DevPtr base = 0;

  Buffer(Driver* d, const std::vector<size_t>& pieces) : driver(d), sizes(pieces) {
    for (size_t s : pieces) offsets.push_back(total), total += s;
    originals.assign(pieces.size(), 0);
    imported.assign(pieces.size(), 0);
    exported.resize(pieces.size());
    mapped.assign(pieces.size(), 0);
  }
  ~Buffer() {
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (mapped[i]) Warn("cleanup Unmap", driver->Unmap(base + offsets[i], sizes[i]));
    }
    if (base != 0) Warn("cleanup Unreserve", driver->Unreserve(base, total));
    for (PhysHandle h : imported) {
      if (h != 0) Warn("cleanup Release", driver->Release(h));
    }
    for (PhysHandle h : originals) {
      if (h != 0) Warn("cleanup Release", driver->Release(h));
    }
  }
  absl::Status ImportAndMap(size_t i) {
    VMM_ASSIGN_OR_RETURN(imported[i], driver->Import(exported[i]));
    VMM_RETURN_IF_ERROR(driver->Map(base + offsets[i], sizes[i], imported[i]));
    mapped[i] = 1;
    return absl::OkStatus();
  }
};

// One buffer through steps 1-9 as `v` issues them; ns[] gets each step's time.
absl::Status RunPass(Driver* driver, HandleType type, const std::vector<size_t>& pieces,
                     size_t granularity, const Variant& v, double ns[kSteps]) {
  Buffer b(driver, pieces);
  const size_t n = pieces.size();
  const int device = kDevice;
  auto t = Clock::now();
  for (size_t i = 0; i < n; ++i) {
    absl::StatusOr<PhysHandle> h = driver->Create(kDevice, pieces[i], vmm::HandleTypeBit(type));
    if (!h.ok()) return Fail("Create", h.status());
    b.originals[i] = *h;
  }
  ns[kCreate] = NsSince(t);
  t = Clock::now();
  for (size_t i = 0; i < n; ++i) {
    absl::StatusOr<vmm::ShareableHandle> e = driver->Export(b.originals[i], type);
    if (!e.ok()) return Fail("Export", e.status());
    b.exported[i] = *std::move(e);
  }
  ns[kExport] = NsSince(t);

  if (v.kind == Variant::kImportMapThreads) {
    ns[kImport] = 0;
    t = Clock::now();
    absl::StatusOr<DevPtr> base = driver->Reserve(b.total, std::max(granularity, v.alignment));
    ns[kReserve] = NsSince(t);
    if (!base.ok()) return Fail("Reserve", base.status());
    b.base = *base;
    std::vector<absl::Status> statuses(v.threads);
    ns[kMap] = TimeOnThreads(v.threads, [&](int k) {
      for (size_t i = n * k / v.threads; i < n * (k + 1) / v.threads; ++i) {
        statuses[k] = b.ImportAndMap(i);
        if (!statuses[k].ok()) return;
      }
    });
    VMM_RETURN_IF_ERROR(Fail("Import+Map", FirstError(statuses)));
  } else {
    t = Clock::now();
    for (size_t i = 0; i < n; ++i) {
      absl::StatusOr<PhysHandle> h = driver->Import(b.exported[i]);
      if (!h.ok()) return Fail("Import", h.status());
      b.imported[i] = *h;
    }
    ns[kImport] = NsSince(t);
    t = Clock::now();
    absl::StatusOr<DevPtr> base = driver->Reserve(b.total, std::max(granularity, v.alignment));
    ns[kReserve] = NsSince(t);
    if (!base.ok()) return Fail("Reserve", base.status());
    b.base = *base;
    t = Clock::now();
    for (size_t i = 0; i < n; ++i) {
      VMM_RETURN_IF_ERROR(Fail("Map", driver->Map(b.base + b.offsets[i], pieces[i],
                                                  b.imported[i])));
      b.mapped[i] = 1;
    }
    ns[kMap] = NsSince(t);
  }

  if (v.kind == Variant::kAccessThreads) {
    const size_t part = b.total / granularity / v.threads * granularity;
    std::vector<absl::Status> statuses(v.threads);
    ns[kSetAccess] = TimeOnThreads(v.threads, [&](int k) {
      const size_t begin = part * k;
      const size_t end = k + 1 == v.threads ? b.total : begin + part;
      statuses[k] = driver->SetAccess(b.base + begin, end - begin, {device});
    });
    VMM_RETURN_IF_ERROR(Fail("SetAccess", FirstError(statuses)));
  } else if (v.kind == Variant::kAccessPerPiece) {
    t = Clock::now();
    for (size_t i = 0; i < n; ++i) {
      VMM_RETURN_IF_ERROR(Fail("SetAccess", driver->SetAccess(b.base + b.offsets[i], pieces[i],
                                                              {device})));
    }
    ns[kSetAccess] = NsSince(t);
  } else {
    t = Clock::now();
    VMM_RETURN_IF_ERROR(Fail("SetAccess", driver->SetAccess(b.base, b.total, {device})));
    ns[kSetAccess] = NsSince(t);
  }

  t = Clock::now();
  VMM_RETURN_IF_ERROR(Fail("Unmap", driver->Unmap(b.base, b.total)));
  ns[kUnmap] = NsSince(t);
  b.mapped.assign(n, 0);
  t = Clock::now();
  absl::Status unreserved = driver->Unreserve(b.base, b.total);
  ns[kUnreserve] = NsSince(t);
  VMM_RETURN_IF_ERROR(Fail("Unreserve", unreserved));
  b.base = 0;
  b.exported.clear();  // closes the exported fds (untimed)
  for (int step : {kReleaseImported, kReleaseOriginal}) {
    std::vector<PhysHandle>& handles = step == kReleaseImported ? b.imported : b.originals;
    t = Clock::now();
    for (PhysHandle& h : handles) {
      absl::Status s = driver->Release(h);
      if (!s.ok()) return Fail("Release", s);
      h = 0;
    }
    ns[step] = NsSince(t);
  }
  return absl::OkStatus();
}

double CriticalPath(const double ns[kSteps]) {
  return ns[kImport] + ns[kReserve] + ns[kMap] + ns[kSetAccess];
}

// --- The second process -------------------------------------------------------------------

struct ChildTimes {
  double fetch_ns = 0, import_ns = 0, close_ns = 0;
};

class ImportChild {
 public:
  // Starts the second process (vmm_peer import-loop: it answers each descriptor with "ok
  // FETCH_NS IMPORT_NS CLOSE_NS"); an error when it does not come up.
  absl::Status Start(const std::string& backend) {
    process_ = std::make_unique<vmm::Subprocess>(std::vector<std::string>{
        vmm::HelperProgramPath("tools/vmm_peer"), "import-loop", "--backend=" + backend});
    const std::string line = process_->ReadLine();
    if (line == "ready") return absl::OkStatus();
    process_.reset();
    return absl::UnavailableError("second process: " + (line.empty() ? "died" : line));
  }
  bool running() const { return process_ != nullptr; }
  absl::StatusOr<ChildTimes> Import(const vmm::BufferDescriptor& d) {
    process_->WriteLine(absl::BytesToHexString(d.Encode()));
    const std::string line = process_->ReadLine();
    std::vector<std::string> f = absl::StrSplit(line, ' ');
    ChildTimes t;
    if (f.size() == 4 && f[0] == "ok" && absl::SimpleAtod(f[1], &t.fetch_ns) &&
        absl::SimpleAtod(f[2], &t.import_ns) && absl::SimpleAtod(f[3], &t.close_ns)) {
      return t;
    }
    if (line.empty()) process_.reset();
    return absl::InternalError("second process: " + (line.empty() ? "died" : line));
  }
  ~ImportChild() {
    if (process_ == nullptr) return;
    process_->CloseInput();
    if (int code = process_->Wait(); code != 0) {
      std::fprintf(stderr, "import_bench: the second process exited with %d\n", code);
    }
  }

 private:
  std::unique_ptr<vmm::Subprocess> process_;
};

// --- The vmm path ---------------------------------------------------------------------------

enum VmmStep { kAllocate, kPoolExport, kDescribe, kVmmImport, kClose, kFree, kXFetch, kXImport,
               kXClose, kVmmSteps };
// (Named apart from the bare steps: ImportBuffer is steps 3-6 and more, not step 3.)
const char* const kVmmNames[kVmmSteps] = {"allocate", "pool_export", "describe", "import_buffer",
                                          "close", "free", "xproc_fd_fetch",
                                          "xproc_import_buffer", "xproc_close"};

// One block through allocate, export, describe, import, close (and the second process's
// import), then free.
absl::Status RunVmm(Driver* driver, vmm::Pool& pool, size_t size, ImportChild* child,
                    double ns[kVmmSteps]) {
  auto t = Clock::now();
  absl::StatusOr<void*> p = pool.AllocateShareable(size, 0);
  ns[kAllocate] = NsSince(t);
  if (!p.ok()) return Fail("Pool::AllocateShareable", p.status());
  absl::Status status = [&]() -> absl::Status {
    t = Clock::now();
    // Marking alone (the pool's part of an export); ExportBuffer below makes the handles.
    absl::StatusOr<vmm::ExportedBlock> block = pool.Export(*p);
    ns[kPoolExport] = NsSince(t);
    if (!block.ok()) return Fail("Pool::Export", block.status());
    t = Clock::now();
    absl::StatusOr<vmm::BufferDescriptor> d = vmm::ExportBuffer(pool, *p);
    ns[kDescribe] = NsSince(t);
    if (!d.ok()) return Fail("ExportBuffer", d.status());
    t = Clock::now();
    absl::StatusOr<std::unique_ptr<vmm::ImportedBuffer>> buffer = vmm::ImportBuffer(driver, *d);
    ns[kVmmImport] = NsSince(t);
    if (!buffer.ok()) return Fail("ImportBuffer", buffer.status());
    t = Clock::now();
    buffer->reset();
    ns[kClose] = NsSince(t);
    if (child != nullptr && child->running()) {
      absl::StatusOr<ChildTimes> x = child->Import(*d);
      if (!x.ok()) return Fail("cross-process import", x.status());
      ns[kXFetch] = x->fetch_ns;
      ns[kXImport] = x->import_ns;
      ns[kXClose] = x->close_ns;
    }
    return absl::OkStatus();
  }();
  t = Clock::now();
  absl::Status freed = pool.Free(*p);
  ns[kFree] = NsSince(t);
  VMM_RETURN_IF_ERROR(status);
  return Fail("Pool::Free", freed);
}

// --- One combination --------------------------------------------------------------------------

struct Combination {
  HandleType type;
  size_t size;
  size_t chunk;  // == size for "whole"
  std::vector<size_t> pieces;
  std::string name;
  JsonLine tags;
};

void RunBare(Driver* driver, const Combination& c, size_t granularity, int reps,
             const std::vector<int>& threads, const std::vector<size_t>& alignments) {
  std::vector<Variant> variants = {{Variant::kBase, 1, "bare_driver"}};
  for (size_t alignment : alignments) {
    if (alignment > granularity) {
      variants.push_back({Variant::kBase, 1, absl::StrCat("bare_driver/align=", SizeName(alignment)),
                          alignment});
    }
  }
  if (c.pieces.size() > 1) {
    variants.push_back({Variant::kAccessPerPiece, 1, "bare_driver/set_access_per_piece"});
  }
  for (int t : threads) {
    if (c.size / granularity >= static_cast<size_t>(t)) {
      variants.push_back({Variant::kAccessThreads, t, absl::StrCat("bare_driver/set_access_x", t)});
    }
  }
  for (int t : threads) {
    if (c.pieces.size() >= static_cast<size_t>(t) && c.pieces.size() > 1) {
      variants.push_back(
          {Variant::kImportMapThreads, t, absl::StrCat("bare_driver/import_map_x", t)});
    }
  }
  // times[variant][step] over repetitions; [kSteps] is the critical path.
  std::vector<std::vector<std::vector<double>>> times(
      variants.size(), std::vector<std::vector<double>>(kSteps + 1));
  std::vector<bool> failed(variants.size(), false);
  for (int rep = 0; rep <= reps; ++rep) {
    for (size_t v = 0; v < variants.size(); ++v) {
      if (failed[v]) continue;
      double ns[kSteps] = {};
      if (absl::Status s = RunPass(driver, c.type, c.pieces, granularity, variants[v], ns);
          !s.ok()) {
        PrintError(c.name, variants[v].label, s);
        failed[v] = true;
        continue;
      }
      if (rep == 0) continue;
      for (int i = 0; i < kSteps; ++i) times[v][i].push_back(ns[i]);
      times[v][kSteps].push_back(CriticalPath(ns));
    }
  }
  for (size_t v = 0; v < variants.size(); ++v) {
    if (failed[v]) continue;
    auto median = [&](int step) { return vmm_bench::Median(times[v][step]); };
    const std::string& label = variants[v].label;
    if (variants[v].kind == Variant::kBase && variants[v].alignment == 0) {
      for (int i = 0; i < kSteps; ++i) {
        vmm_bench::Result("import", c.name, label, absl::StrCat(kStepNames[i], "_ns"), median(i),
                          "ns").Merge(c.tags).Print();
      }
    }
    JsonLine line = vmm_bench::Result("import", c.name, label, "critical_path_ns",
                                      median(kSteps), "ns");
    line.Merge(c.tags).Int("threads", variants[v].threads);
    if (variants[v].alignment != 0) {
      line.Int("reserve_alignment", static_cast<int64_t>(variants[v].alignment));
    }
    // (import_map_xT: Import and Map run together; their time is import_map_ns.)
    const bool together = variants[v].kind == Variant::kImportMapThreads;
    if (!together) line.Num("import_ns", median(kImport));
    line.Num("reserve_ns", median(kReserve));
    line.Num(together ? "import_map_ns" : "map_ns", median(kMap));
    line.Num("set_access_ns", median(kSetAccess)).Print();
    std::fprintf(stderr, "%s %s: critical path %.1f us (import %.1f, reserve %.1f, %s %.1f, "
                 "set_access %.1f)\n", c.name.c_str(), label.c_str(), median(kSteps) / 1e3,
                 median(kImport) / 1e3, median(kReserve) / 1e3, together ? "import+map" : "map",
                 median(kMap) / 1e3, median(kSetAccess) / 1e3);
  }
}

void RunVmmPath(Driver* driver, const Combination& c, int reps, ImportChild* child) {
  vmm::PoolOptions options;
  options.handle_type = c.type == HandleType::kFabric ? vmm::HandleRequest::kFabric
                                                      : vmm::HandleRequest::kPosixFd;
  options.max_chunk = c.chunk;
  options.reserve_size = 4 * c.size;  // the small arena takes an eighth
  absl::StatusOr<std::unique_ptr<vmm::Pool>> pool = vmm::CreateExportablePool(driver, options);
  if (!pool.ok()) return PrintError(c.name, "vmm", Fail("CreateExportablePool", pool.status()));
  std::vector<std::vector<double>> times(kVmmSteps);
  for (int rep = 0; rep <= reps; ++rep) {
    double ns[kVmmSteps] = {};
    if (absl::Status s = RunVmm(driver, **pool, c.size, child, ns); !s.ok()) {
      return PrintError(c.name, "vmm", s);
    }
    if (rep == 0) continue;
    for (int i = 0; i < kVmmSteps; ++i) times[i].push_back(ns[i]);
  }
  if (absl::Status s = (*pool)->CheckInvariants(); !s.ok()) PrintError(c.name, "vmm", s);
  const bool xproc = child != nullptr && child->running();
  for (int i = 0; i < kVmmSteps; ++i) {
    if (i >= kXFetch && (!xproc || (i == kXFetch && c.type != HandleType::kPosixFd))) continue;
    JsonLine line = vmm_bench::Result("import", c.name, "vmm", absl::StrCat(kVmmNames[i], "_ns"),
                                      vmm_bench::Median(times[i]), "ns");
    line.Merge(c.tags);
    if (i == kVmmImport && c.type == HandleType::kPosixFd) line.Str("fd_fetch", "same_process");
    line.Print();
  }
  auto us = [&](int step) { return vmm_bench::Median(times[step]) / 1e3; };
  std::string xproc_text = "no second process";
  if (xproc) {
    xproc_text = absl::StrFormat("second process: import %.1f us%s, close %.1f us", us(kXImport),
                                 c.type == HandleType::kPosixFd
                                     ? absl::StrFormat(" (fd fetch alone %.1f us)", us(kXFetch))
                                     : "",
                                 us(kXClose));
  }
  std::fprintf(stderr, "%s vmm: export %.1f us, describe %.1f us, import %.1f us, close %.1f us"
               "; %s\n", c.name.c_str(), us(kPoolExport), us(kDescribe), us(kVmmImport),
               us(kClose), xproc_text.c_str());
}

// Up to 4096 pieces make 4096 exported fds, and as many again held by the host backend.
void RaiseFdLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    setrlimit(RLIMIT_NOFILE, &limit);
  }
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Times sharing a buffer between processes, driver call by call.");
  absl::ParseCommandLine(argc, argv);
  RaiseFdLimit();

  absl::StatusOr<Driver*> driver = vmm_bench::BenchDriver(absl::GetFlag(FLAGS_backend),
                                                          size_t{256} << 30);
  if (!driver.ok()) {
    std::fprintf(stderr, "import_bench: %s\n", driver.status().ToString().c_str());
    return 1;
  }
  const std::string backend((*driver)->Name());
  absl::StatusOr<size_t> granularity = (*driver)->Granularity(kDevice);
  if (!granularity.ok()) {
    std::fprintf(stderr, "import_bench: %s\n", granularity.status().ToString().c_str());
    return 1;
  }
  const int reps = std::max(1, absl::GetFlag(FLAGS_reps));
  std::vector<size_t> sizes, chunks;  // chunk 0: whole
  auto parse_size = [](absl::string_view flag, const std::string& text) -> size_t {
    absl::StatusOr<size_t> n = ParseSizeFlag(flag, text);
    if (n.ok()) return *n;
    std::fprintf(stderr, "import_bench: %s\n", n.status().ToString().c_str());
    std::exit(2);
  };
  for (const std::string& s : absl::GetFlag(FLAGS_sizes)) {
    sizes.push_back(parse_size("sizes", s));
    if (sizes.back() == 0 || sizes.back() % *granularity != 0) {
      std::fprintf(stderr, "import_bench: --sizes: %s is not a multiple of %zu\n", s.c_str(),
                   *granularity);
      return 2;
    }
  }
  for (const std::string& s : absl::GetFlag(FLAGS_chunk_sizes)) {
    chunks.push_back(s == "whole" ? 0 : parse_size("chunk_sizes", s));
    if (s != "whole" && (chunks.back() == 0 || chunks.back() % *granularity != 0)) {
      std::fprintf(stderr, "import_bench: --chunk_sizes: %s is not whole or a multiple of %zu\n",
                   s.c_str(), *granularity);
      return 2;
    }
  }
  std::vector<int> threads;
  for (const std::string& s : absl::GetFlag(FLAGS_threads)) {
    int t = 0;
    if (!absl::SimpleAtoi(s, &t) || t < 1) {
      std::fprintf(stderr, "import_bench: bad --threads value %s\n", s.c_str());
      return 2;
    }
    threads.push_back(t);
  }
  std::vector<size_t> alignments;
  for (const std::string& s : absl::GetFlag(FLAGS_reserve_alignments)) {
    if (s.empty()) continue;
    alignments.push_back(parse_size("reserve_alignments", s));
    if (alignments.back() == 0 || (alignments.back() & (alignments.back() - 1)) != 0) {
      std::fprintf(stderr, "import_bench: --reserve_alignments: %s is not a power of two\n",
                   s.c_str());
      return 2;
    }
  }

  // --keep_exported_fd: released when main returns.
  struct Kept {
    Driver* driver = nullptr;
    PhysHandle handle = 0;
    vmm::ShareableHandle fd;
    ~Kept() {
      if (handle != 0) Warn("Release of the kept allocation", driver->Release(handle));
    }
  } kept;
  if (absl::GetFlag(FLAGS_keep_exported_fd)) {
    kept.driver = *driver;
    absl::StatusOr<PhysHandle> h =
        (*driver)->Create(kDevice, *granularity, vmm::HandleTypeBit(HandleType::kPosixFd));
    absl::StatusOr<vmm::ShareableHandle> e =
        h.ok() ? (*driver)->Export(*h, HandleType::kPosixFd) : h.status();
    if (h.ok()) kept.handle = *h;
    if (!e.ok()) {
      std::fprintf(stderr, "import_bench: --keep_exported_fd: %s\n", e.status().ToString().c_str());
      return 1;
    }
    kept.fd = *std::move(e);
  }

  std::unique_ptr<ImportChild> child;
  for (const std::string& type_name : absl::GetFlag(FLAGS_handle_types)) {
    const std::optional<HandleType> parsed = vmm::ParseHandleType(type_name);
    if (!parsed || *parsed == HandleType::kNone) {
      std::fprintf(stderr, "import_bench: bad --handle_types value %s\n", type_name.c_str());
      return 2;
    }
    const HandleType type = *parsed;
    if (absl::Status s = Probe(*driver, type, *granularity); !s.ok()) {
      PrintSkipped(absl::StrCat("import/", type_name), s.ToString());
      continue;
    }
    if (absl::GetFlag(FLAGS_vmm_path) && absl::GetFlag(FLAGS_cross_process) && child == nullptr) {
      child = std::make_unique<ImportChild>();
      if (absl::Status s = child->Start(backend); !s.ok()) PrintError("import", "vmm", s);
    }
    for (size_t size : sizes) {
      std::vector<size_t> done_counts;  // piece counts already run for this size
      for (size_t chunk_flag : chunks) {
        Combination c;
        c.type = type;
        c.size = size;
        c.chunk = chunk_flag == 0 ? size : std::min(chunk_flag, size);
        c.name = absl::StrCat("import_", SizeName(size), "/", type_name, "/chunk=",
                              chunk_flag == 0 ? "whole" : SizeName(chunk_flag));
        const size_t count = (size + c.chunk - 1) / c.chunk;
        if (count > kMaxPieces) {
          PrintSkipped(c.name, absl::StrCat(count, " pieces, more than ", kMaxPieces));
          continue;
        }
        if (std::find(done_counts.begin(), done_counts.end(), count) != done_counts.end()) {
          PrintSkipped(c.name, absl::StrCat("the same ", count, " piece(s) as another chunk size"));
          continue;
        }
        done_counts.push_back(count);
        for (size_t off = 0; off < size; off += c.chunk) {
          c.pieces.push_back(std::min(c.chunk, size - off));
        }
        c.tags.Str("backend", backend)
            .Str("handle_type", type_name)
            .Int("size_bytes", static_cast<int64_t>(size))
            .Int("chunk_bytes", static_cast<int64_t>(c.chunk))
            .Int("pieces", static_cast<int64_t>(count))
            .Int("repetitions", reps);
        absl::StatusOr<vmm::MemInfo> before = (*driver)->GetMemInfo(kDevice);
        RunBare(*driver, c, *granularity, reps, threads, alignments);
        if (absl::GetFlag(FLAGS_vmm_path)) RunVmmPath(*driver, c, reps, child.get());
        // The host backend's books are exact: every byte must be back.
        absl::StatusOr<vmm::MemInfo> after = (*driver)->GetMemInfo(kDevice);
        if (backend == "host" && before.ok() && after.ok() && after->free != before->free) {
          PrintError(c.name, "all", absl::InternalError(absl::StrCat(
                                        "leaked ", before->free - after->free, " bytes")));
        }
      }
    }
  }
  return 0;
}
