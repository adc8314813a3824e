// Sharing between processes: export, transport as bytes, import in another process, and the
// seed's semantics — nothing pinned, importer independent after import, exporter unaffected
// by a dying importer, clean errors for stale, forged and hostile descriptors. Runs on the
// backend of tests/test_backend.h (host in CI; VMM_TEST_BACKEND=cuda on the GPU machine), for
// both handle types.
//
// TwoDeviceSharingTest exports from device 0 and imports on device 1, in this process and in
// others. On the host backend it uses a driver that emulates two devices, and its helper
// processes get VMM_HOST_DEVICES=2; on CUDA it runs only where there are two GPUs (skipped
// elsewhere).
//
// ReExportTest sends an import on (A -> B -> C, ReExportImport): C reads A's bytes through B
// after A has freed them or exited, and B's descriptor goes stale with B's import. On CUDA
// only POSIX-fd buffers can be sent on (its driver does not export imported handles).
#include "allocator/sharing.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "allocator/driver_factory.h"
#include "allocator/fd_share.h"
#include "allocator/host_driver.h"
#include "allocator/kept_handles.h"
#include "allocator/pool.h"
#include "allocator/unique_fd.h"
#include "gmock/gmock.h"
#include "allocator/forwarding_driver.h"
#include "gtest/gtest.h"
#include "tests/pool_helpers.h"
#include "tests/status_matchers.h"
#include "tests/subprocess.h"
#include "tests/test_backend.h"

namespace vmm {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr size_t kMiB = size_t{1} << 20;

// The other process: tools/vmm_peer (its import and export subcommands).
std::string PeerPath() { return HelperProgramPath("tools/vmm_peer"); }

// A pool of the parameter's handle type on some driver, with the checks every test ends with:
// the pool's invariants, no import left open, and the driver's free memory back to its start.
class PoolFixture : public ::testing::TestWithParam<HandleRequest> {
 protected:
  // Creates pool_ on `driver` (skips the test when fabric handles are unavailable).
  void MakePool(Driver* driver, size_t reserve) {
    driver_ = driver;
    free_at_start_ = driver_->GetMemInfo(0)->free;
    PoolOptions options = SingleChunkOptions();
    options.reserve_size = reserve;
    options.handle_type = GetParam();
    auto pool = CreateExportablePool(driver_, options);
    if (!pool.ok() && GetParam() == HandleRequest::kFabric) {
      GTEST_SKIP() << "fabric handles unavailable here: " << pool.status();
    }
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = std::move(*pool);
  }

  // (Resets the pool even when a check fails: a derived fixture may own the driver.)
  void TearDown() override {
    if (pool_ == nullptr) return;
    EXPECT_TRUE(pool_->CheckInvariants().ok()) << pool_->CheckInvariants();
    pool_.reset();
    EXPECT_EQ(OpenImportMappings(), 0u);
    EXPECT_EQ(driver_->GetMemInfo(0)->free, free_at_start_) << "physical memory leaked";
  }

  // Allocates `size` bytes (on the pool's device) filled with `value`.
  void* Filled(size_t size, uint8_t value) {
    auto p = pool_->Allocate(size, 0);
    EXPECT_TRUE(p.ok()) << p.status();
    EXPECT_TRUE(driver_->MemsetAsync(reinterpret_cast<DevPtr>(*p), value, size, 0).ok());
    EXPECT_TRUE(driver_->SynchronizeStream(0).ok());
    return *p;
  }

  static std::string Hex(const BufferDescriptor& d) { return absl::BytesToHexString(d.Encode()); }

  Driver* driver_ = nullptr;
  std::unique_ptr<Pool> pool_;
  size_t free_at_start_ = 0;
};

class SharingTest : public PoolFixture {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(Driver* driver, TestDriver());
    MakePool(driver, 4096 * kMiB);
  }

  // Whether every byte of [ptr, ptr+size) is `value`.
  bool AllBytes(DevPtr ptr, size_t size, uint8_t value) {
    std::vector<uint8_t> host(size);
    if (!driver_->MemcpyAsync(reinterpret_cast<DevPtr>(host.data()), ptr, size, 0).ok()) {
      return false;
    }
    if (!driver_->SynchronizeStream(0).ok()) return false;
    for (uint8_t b : host) {
      if (b != value) return false;
    }
    return true;
  }

};

TEST_P(SharingTest, ExportDescribesTheChunksTheBlockSpans) {
  void* a = Filled(3 * kMiB, 1);
  auto d = ExportBuffer(*pool_, a);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->handle_type(), pool_->handle_type());
  EXPECT_EQ(d->size(), 3 * kMiB);
  EXPECT_EQ(d->offset(), 0u);
  ASSERT_EQ(d->sizes().size(), 1u);
  EXPECT_EQ(d->sizes()[0], 4 * kMiB);
  EXPECT_EQ(d->owner_uuid(), pool_->device_uuid());
  // The encoding round-trips and is stable.
  auto again = ExportBuffer(*pool_, a);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->Encode(), d->Encode());
  ASSERT_TRUE(pool_->Free(a).ok());
}

TEST_P(SharingTest, ImportInTheSameProcessSeesTheBytesAndSharesTheMapping) {
  void* a = Filled(5 * kMiB, 7);
  auto d = ExportBuffer(*pool_, a);
  ASSERT_TRUE(d.ok()) << d.status();
  auto one = ImportBuffer(driver_, *d);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_TRUE(AllBytes((*one)->ptr(), (*one)->size(), 7));
  EXPECT_EQ((*one)->mapped_size(), 6 * kMiB);
  auto two = ImportBuffer(driver_, *d);
  ASSERT_TRUE(two.ok());
  EXPECT_TRUE((*two)->shared());
  EXPECT_EQ((*two)->ptr(), (*one)->ptr());
  EXPECT_EQ(OpenImportMappings(), 1u);
  one->reset();
  two->reset();
  EXPECT_EQ(OpenImportMappings(), 0u);
  ASSERT_TRUE(pool_->Free(a).ok());
}

// --- Unmap reports (ImportedBuffer::OnUnmapped): what a receiver tells the sender ---------

// Records the OnUnmapped calls of imports: `forwarded` of each, and the open mappings then.
class UnmapRecorder {
 public:
  absl::AnyInvocable<void(bool) &&> Callback() {
    return [this](bool forwarded) {
      std::lock_guard<std::mutex> lock(mu_);
      forwarded_.push_back(forwarded);
      open_then_.push_back(OpenImportMappings());
    };
  }
  std::vector<bool> forwarded() {
    std::lock_guard<std::mutex> lock(mu_);
    return forwarded_;
  }
  std::vector<size_t> open_then() {
    std::lock_guard<std::mutex> lock(mu_);
    return open_then_;
  }

 private:
  std::mutex mu_;
  std::vector<bool> forwarded_;
  std::vector<size_t> open_then_;
};

TEST_P(SharingTest, OnUnmappedRunsOnceTheLastImportSharingTheMappingIsGone) {
  void* a = Filled(2 * kMiB, 5);
  ASSERT_OK_AND_ASSIGN(BufferDescriptor d, ExportBuffer(*pool_, a));
  const size_t open_before = OpenImportMappings();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> one, ImportBuffer(driver_, d));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> two, ImportBuffer(driver_, d));
  ASSERT_TRUE(two->shared());
  UnmapRecorder recorder;
  one->OnUnmapped(recorder.Callback());
  two->OnUnmapped(recorder.Callback());
  one.reset();
  EXPECT_TRUE(recorder.forwarded().empty()) << "ran while another import still maps it";
  EXPECT_EQ(OpenImportMappings(), open_before + 1);
  two.reset();
  EXPECT_EQ(recorder.forwarded(), (std::vector<bool>{false, false})) << "each callback once";
  EXPECT_EQ(recorder.open_then(), (std::vector<size_t>{open_before, open_before}))
      << "a callback ran before the range was unmapped";
  EXPECT_EQ(OpenImportMappings(), open_before);
  // A later import of the same buffer is a new mapping, with callbacks of its own.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> three, ImportBuffer(driver_, d));
  EXPECT_FALSE(three->shared());
  three.reset();
  EXPECT_EQ(recorder.forwarded().size(), 2u);
  ASSERT_OK(pool_->Free(a));
}

TEST_P(SharingTest, OnUnmappedSaysForwardedOnceAnImportSharingTheMappingWasSentOn) {
  void* a = Filled(2 * kMiB, 6);
  ASSERT_OK_AND_ASSIGN(BufferDescriptor d, ExportBuffer(*pool_, a));
  UnmapRecorder recorder;
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> alone, ImportBuffer(driver_, d));
    alone->OnUnmapped(recorder.Callback());
    alone->MarkForwarded();
  }
  EXPECT_EQ(recorder.forwarded(), (std::vector<bool>{true}));
  {
    // Marked through the other import of one mapping: the mapping was sent on.
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> one, ImportBuffer(driver_, d));
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> two, ImportBuffer(driver_, d));
    one->OnUnmapped(recorder.Callback());
    two->MarkForwarded();
    two.reset();
    EXPECT_EQ(recorder.forwarded().size(), 1u);
  }
  EXPECT_EQ(recorder.forwarded(), (std::vector<bool>{true, true}));
  ASSERT_OK(pool_->Free(a));
}

TEST_P(SharingTest, AnotherProcessReadsAndWritesTheSameMemory) {
  void* a = Filled(7 * kMiB, 42);
  auto d = ExportBuffer(*pool_, a);
  ASSERT_TRUE(d.ok()) << d.status();
  Subprocess peer({PeerPath(), "import", "--descriptor=" + Hex(*d), "--expect=42", "--write=43"});
  ASSERT_TRUE(peer.started());
  EXPECT_THAT(peer.ReadLine(), HasSubstr("ok"));
  EXPECT_EQ(peer.Wait(), 0);
  EXPECT_TRUE(AllBytes(reinterpret_cast<DevPtr>(a), 7 * kMiB, 43)) << "the peer's writes are seen";
  ASSERT_TRUE(pool_->Free(a).ok());
}

TEST_P(SharingTest, BlocksSpanningManyChunksImportAsOneRange) {
  pool_.reset();
  PoolOptions options = SingleChunkOptions();
  options.reserve_size = 1024 * kMiB;
  options.handle_type = GetParam();
  options.max_chunk = 2 * kMiB;  // a 9 MiB block spans five chunks
  pool_ = std::move(*CreateExportablePool(driver_, options));
  void* a = Filled(9 * kMiB, 9);
  auto d = ExportBuffer(*pool_, a);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->handles().size(), 5u);
  Subprocess peer({PeerPath(), "import", "--descriptor=" + Hex(*d), "--expect=9"});
  EXPECT_EQ(peer.Wait(), 0);
  ASSERT_TRUE(pool_->Free(a).ok());
}

TEST_P(SharingTest, AParkedDescriptorPinsNothing) {
  void* a = Filled(4 * kMiB, 5);
  auto d = ExportBuffer(*pool_, a);
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_TRUE(pool_->Free(a).ok());
  ASSERT_TRUE(pool_->EmptyCache().ok());
  EXPECT_EQ(pool_->GetStats().reserved_bytes.current, 0) << "the exported chunk went back";
  // The importer gets a clean error naming the owner.
  Subprocess peer({PeerPath(), "import", "--descriptor=" + Hex(*d), "--expect=5"});
  EXPECT_EQ(peer.Wait(), 3);
  auto local = ImportBuffer(driver_, *d);
  ASSERT_FALSE(local.ok());
  EXPECT_THAT(local.status().message(), HasSubstr(pool_->device_uuid()));
}

// A child forked while memory is exported (a DataLoader worker) inherits the fds the fd server
// and the export anchor hold; a CUDA allocation exported as an fd stays on the GPU while any
// copy is open. The child closes its copies at the fork, so memory its parent frees and
// releases meanwhile goes back at once. The child touches no CUDA; it waits on a pipe.
TEST_P(SharingTest, AForkedChildPinsNoExportedMemoryItsParentReleases) {
  void* a = Filled(8 * kMiB, 9);
  ASSERT_OK(ExportBuffer(*pool_, a).status());
  int gate[2];
  ASSERT_EQ(pipe2(gate, O_CLOEXEC), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(gate[1]);
    char byte;
    while (read(gate[0], &byte, 1) < 0 && errno == EINTR) {
    }
    _exit(0);
  }
  close(gate[0]);
  UniqueFd open_gate(gate[1]);  // the child ends once it closes, whatever fails below
  const absl::Status freed = pool_->Free(a);
  pool_.reset();  // its chunks and its anchor released while the child lives
  const size_t free_with_child = driver_->GetMemInfo(0)->free;
  open_gate.reset();
  EXPECT_OK(freed);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_EQ(free_with_child, free_at_start_)
      << "the forked child's copies held " << (free_at_start_ - free_with_child)
      << " bytes of released memory on " << driver_->Name();
  EXPECT_EQ(driver_->GetMemInfo(0)->free, free_at_start_);
}

TEST_P(SharingTest, ImporterKeepsItsDataAfterTheExporterFreesAndExits) {
  Subprocess exporter({PeerPath(), "export", "--size=" + std::to_string(6 * kMiB), "--fill=77"});
  const std::string hex = exporter.ReadLine();
  ASSERT_FALSE(hex.empty());
  Subprocess importer({PeerPath(), "import", "--descriptor=" + hex, "--expect=77", "--wait"});
  ASSERT_EQ(importer.ReadLine(), "imported");
  exporter.WriteLine("free");
  EXPECT_EQ(exporter.ReadLine(), "freed");
  exporter.WriteLine("exit");
  EXPECT_EQ(exporter.Wait(), 0);
  importer.WriteLine("check");
  EXPECT_THAT(importer.ReadLine(), HasSubstr("ok"));
  EXPECT_EQ(importer.Wait(), 0);
}

// Whether process `pid` (a child not yet waited for) becomes a zombie within 10 s.
bool BecomesZombie(pid_t pid) {
  for (int i = 0; i < 1000; ++i) {
    std::ifstream stat_file(absl::StrCat("/proc/", pid, "/stat"));
    std::string line;
    if (std::getline(stat_file, line)) {
      const size_t close = line.rfind(')');
      if (close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'Z') {
        return true;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

// A descriptor of an exporter that has exited (without freeing) is Unavailable, as vmm_c.h
// says, for both handle types: the fd server is gone, and so is the process whose fd a host
// fabric handle names. (A CUDA fabric handle carries no process: the driver's own error.)
TEST_P(SharingTest, ImportingFromAnExporterThatHasExitedIsUnavailable) {
  const bool fabric = GetParam() == HandleRequest::kFabric;
  Subprocess exporter({PeerPath(), "export", "--size=" + std::to_string(2 * kMiB), "--fill=9",
                       fabric ? "--handle=fabric" : "--handle=posix_fd"});
  const std::string hex = exporter.ReadLine();
  ASSERT_FALSE(hex.empty()) << "the exporter failed";
  ASSERT_OK_AND_ASSIGN(BufferDescriptor d, BufferDescriptor::Decode(absl::HexStringToBytes(hex)));
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> live, ImportBuffer(driver_, d));
    EXPECT_TRUE(AllBytes(live->ptr(), 2 * kMiB, 9));
  }
  exporter.WriteLine("exit");
  // Not yet waited for (a zombie, as a worker that died before its parent joined it): it
  // has exited all the same. Then reaped.
  for (bool reaped : {false, true}) {
    SCOPED_TRACE(reaped ? "reaped" : "a zombie");
    if (reaped) {
      ASSERT_EQ(exporter.Wait(), 0);
    } else {
      ASSERT_TRUE(BecomesZombie(exporter.pid()));
    }
    absl::StatusOr<std::unique_ptr<ImportedBuffer>> gone = ImportBuffer(driver_, d);
    ASSERT_FALSE(gone.ok());
    if (fabric && driver_->backend() != Backend::kHost) continue;
    EXPECT_THAT(gone.status(), StatusIs(absl::StatusCode::kUnavailable)) << gone.status();
    if (d.owner_uuid()) {
      EXPECT_THAT(gone.status().message(), HasSubstr(*d.owner_uuid()));
    }
  }
}

TEST_P(SharingTest, AnImporterThatDiesLeavesTheExporterFine) {
  void* a = Filled(4 * kMiB, 11);
  auto d = ExportBuffer(*pool_, a);
  ASSERT_TRUE(d.ok()) << d.status();
  Subprocess dying({PeerPath(), "import", "--descriptor=" + Hex(*d), "--expect=11", "--die"});
  EXPECT_EQ(dying.Wait(), 128 + SIGABRT);
  EXPECT_TRUE(AllBytes(reinterpret_cast<DevPtr>(a), 4 * kMiB, 11));
  // Sharing still works.
  Subprocess peer({PeerPath(), "import", "--descriptor=" + Hex(*d), "--expect=11"});
  EXPECT_EQ(peer.Wait(), 0);
  void* b = Filled(kMiB, 12);
  ASSERT_TRUE(pool_->Free(b).ok());
  ASSERT_TRUE(pool_->Free(a).ok());
}

TEST_P(SharingTest, ForgedHandlesFailCleanly) {
  void* a = Filled(2 * kMiB, 1);
  auto real = ExportBuffer(*pool_, a);
  ASSERT_TRUE(real.ok());
  std::mt19937 rng(7);
  std::string forged(64, '\0');
  for (char& c : forged) c = static_cast<char>(rng());
  // Random bytes.
  auto d = BufferDescriptor::FromHandles(real->handle_type(), {forged},
                                         {static_cast<int64_t>(2 * kMiB)}, std::nullopt,
                                         std::string("GPU-forged"));
  if (driver_->Name() == "host") {
    d = BufferDescriptor::FromHandles(real->handle_type(), {forged},
                                      {static_cast<int64_t>(2 * kMiB)}, std::nullopt,
                                      pool_->device_uuid());
  }
  ASSERT_TRUE(d.ok());
  auto imported = ImportBuffer(driver_, *d);
  ASSERT_FALSE(imported.ok());
  EXPECT_THAT(imported.status().message(), HasSubstr("importing a buffer of the owner"));
  // A real handle with its last bytes changed (for fd tokens: the nonce).
  std::string tampered(reinterpret_cast<const char*>(real->handles()[0].data()), 64);
  tampered[50] ^= 0x5a;
  auto d2 = BufferDescriptor::FromHandles(real->handle_type(), {tampered},
                                          {static_cast<int64_t>(real->sizes()[0])}, std::nullopt,
                                          pool_->device_uuid());
  ASSERT_TRUE(d2.ok());
  auto imported2 = ImportBuffer(driver_, *d2);
  if (real->handle_type() == HandleType::kPosixFd) {
    ASSERT_FALSE(imported2.ok());
    EXPECT_EQ(imported2.status().code(), absl::StatusCode::kNotFound) << imported2.status();
  }
  // Either way nothing is left mapped, and the pool is fine.
  imported2 = absl::UnknownError("dropped");
  EXPECT_EQ(OpenImportMappings(), 0u);
  ASSERT_TRUE(pool_->Free(a).ok());
}

TEST_P(SharingTest, HostileDescriptorsFailCleanlyAndLeakNothing) {
  void* a = Filled(2 * kMiB, 3);
  auto real = ExportBuffer(*pool_, a);
  ASSERT_TRUE(real.ok());
  const std::string handle(reinterpret_cast<const char*>(real->handles()[0].data()), 64);
  const size_t free_before = driver_->GetMemInfo(0)->free;
  struct Case {
    std::vector<std::string> handles;
    std::vector<int64_t> sizes;
    absl::StatusCode code;
  };
  const int64_t g = static_cast<int64_t>(pool_->granularity());
  std::vector<Case> cases = {
      {{}, {}, absl::StatusCode::kInvalidArgument},                        // nothing to map
      {{handle}, {g + 512}, absl::StatusCode::kInvalidArgument},           // not granular
      {{handle}, {g * 1024 * 1024}, absl::StatusCode::kUnknown},           // 2 TiB from 2 MiB
      {{handle, handle}, {g, g}, absl::StatusCode::kUnknown},              // repeated handle
      {{handle}, {int64_t{1} << 46}, absl::StatusCode::kUnknown},          // huge
  };
  for (const Case& c : cases) {
    auto d = BufferDescriptor::FromHandles(real->handle_type(), c.handles, c.sizes, std::nullopt,
                                           pool_->device_uuid());
    ASSERT_TRUE(d.ok()) << d.status();
    auto imported = ImportBuffer(driver_, *d);
    if (c.code != absl::StatusCode::kUnknown) {
      ASSERT_FALSE(imported.ok());
      EXPECT_EQ(imported.status().code(), c.code) << imported.status();
    } else if (imported.ok()) {
      // A repeated handle may map (twice the same memory): it must still unmap cleanly.
      imported->reset();
    }
    EXPECT_EQ(OpenImportMappings(), 0u);
    EXPECT_EQ(driver_->GetMemInfo(0)->free, free_before) << "leak after a hostile import";
  }
  std::printf("hostile imports (%s): device free memory %zu bytes before, %zu after\n",
              std::string(driver_->Name()).c_str(), free_before, driver_->GetMemInfo(0)->free);
  // Truncated and corrupted encodings never get as far as the driver.
  const std::string bytes = real->Encode();
  for (size_t n = 0; n < bytes.size(); n += 7) {
    EXPECT_FALSE(BufferDescriptor::Decode(bytes.substr(0, n)).ok());
  }
  ASSERT_TRUE(pool_->Free(a).ok());
}

// Map entries of this process whose line in /proc/self/maps contains `what` (all: "").
size_t MapCount(const std::string& what = "") {
  FILE* f = std::fopen("/proc/self/maps", "r");
  if (f == nullptr) return 0;
  size_t count = 0;
  char line[4096];
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    count += std::strstr(line, what.c_str()) != nullptr;
  }
  std::fclose(f);
  return count;
}

// Maps of host backend memory (memfds named "vmm-..."): what an import adds. Counted rather
// than all maps, which the sanitizers' allocators also add to.
size_t MemfdMaps() { return MapCount("/memfd:vmm-"); }

// A descriptor of `copies` copies of `real`'s first handle, each of its first size.
absl::StatusOr<BufferDescriptor> Repeated(const BufferDescriptor& real, size_t copies,
                                          const std::string& owner) {
  const std::string handle(reinterpret_cast<const char*>(real.handles()[0].data()), 64);
  std::vector<std::string> handles(copies, handle);
  std::vector<int64_t> sizes(copies, static_cast<int64_t>(real.sizes()[0]));
  return BufferDescriptor::FromHandles(real.handle_type(), handles, sizes, std::nullopt, owner);
}

// After a refused hostile import, the process still does everything: allocates, creates a
// pool, imports a valid descriptor and starts a thread.
void ExpectTheProcessStillWorks(Driver* driver, Pool& pool, const BufferDescriptor& valid) {
  auto p = pool.Allocate(3 * kMiB, 0);
  ASSERT_OK(p);
  EXPECT_OK(pool.Free(*p));
  PoolOptions options = SingleChunkOptions();
  options.reserve_size = 64 * kMiB;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Pool> another, CreateExportablePool(driver, options));
  auto q = another->Allocate(kMiB, 0);
  ASSERT_OK(q);
  EXPECT_OK(another->Free(*q));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> imported, ImportBuffer(driver, valid));
  EXPECT_EQ(imported->size(), valid.size());
  bool ran = false;
  std::thread([&ran] { ran = true; }).join();
  EXPECT_TRUE(ran);
}

TEST_P(SharingTest, ADescriptorPastTheMapLimitIsRefusedUpFront) {
  void* a = Filled(2 * kMiB, 3);
  ASSERT_OK_AND_ASSIGN(BufferDescriptor real, ExportBuffer(*pool_, a));
  const size_t copies = 300;
  ASSERT_OK_AND_ASSIGN(BufferDescriptor hostile, Repeated(real, copies, pool_->device_uuid()));
  // A limit the process is 100 maps short of, beside the headroom: 300 do not fit.
  ImportOptions options;
  options.max_map_count = MapCount() + kMapCountHeadroom + 100;
  const size_t maps_before = MemfdMaps();
  auto refused = ImportBuffer(driver_, hostile, options);
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kResourceExhausted,
                                AllOf(HasSubstr("mapping 300 handles"), HasSubstr("map limit"),
                                      HasSubstr(absl::StrCat(options.max_map_count)))));
  EXPECT_EQ(OpenImportMappings(), 0u);
  EXPECT_EQ(MemfdMaps(), maps_before) << "the refused import left maps behind";
  ExpectTheProcessStillWorks(driver_, *pool_, real);
  // Under the real limit the same descriptor fits, maps and unmaps cleanly (the host backend's
  // maps are counted: one per handle; CUDA's are the driver's own).
  const bool host = driver_->backend() == Backend::kHost;
  const size_t settled = MemfdMaps();  // the pool may keep a chunk it grew meanwhile
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> fits, ImportBuffer(driver_, hostile));
  EXPECT_EQ(fits->mapped_size(), copies * real.sizes()[0]);
  if (host) EXPECT_EQ(MemfdMaps(), settled + copies);
  fits.reset();
  EXPECT_EQ(MemfdMaps(), settled);
  ASSERT_OK(pool_->Free(a));
}

TEST_P(SharingTest, AHugeDescriptorOfOneRepeatedHandleIsRefusedQuickly) {
  void* a = Filled(2 * kMiB, 4);
  ASSERT_OK_AND_ASSIGN(BufferDescriptor real, ExportBuffer(*pool_, a));
  ASSERT_OK_AND_ASSIGN(BufferDescriptor hostile, Repeated(real, 200000, pool_->device_uuid()));
  // Through the bytes, as an importer gets it: the decoder's own limits let it through.
  ASSERT_OK_AND_ASSIGN(BufferDescriptor decoded, BufferDescriptor::Decode(hostile.Encode()));
  const size_t maps_before = MemfdMaps();
  const auto start = std::chrono::steady_clock::now();
  auto refused = ImportBuffer(driver_, decoded);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kInvalidArgument,
                                AllOf(HasSubstr("200000 handles"),
                                      HasSubstr(absl::StrCat(kMaxImportHandles)),
                                      HasSubstr(pool_->device_uuid()))));
  EXPECT_LT(seconds, 1.0) << "refused only after trying";
  EXPECT_EQ(OpenImportMappings(), 0u);
  EXPECT_EQ(MemfdMaps(), maps_before) << "the refused import left maps behind";
  ExpectTheProcessStillWorks(driver_, *pool_, real);
  ASSERT_OK(pool_->Free(a));
}

TEST_P(SharingTest, FdsCanAlsoBeFetchedWithPidfd) {
  if (GetParam() != HandleRequest::kPosixFd) GTEST_SKIP() << "fd handles only";
  Subprocess exporter({PeerPath(), "export", "--size=" + std::to_string(2 * kMiB), "--fill=21",
                       "--handle=posix_fd"});
  const std::string hex = exporter.ReadLine();
  auto d = BufferDescriptor::Decode(absl::HexStringToBytes(hex));
  ASSERT_TRUE(d.ok()) << d.status();
  auto token = FdToken::Decode(d->handles()[0]);
  ASSERT_TRUE(token.ok());
  auto fds = FetchFds({*token}, FdFetch::kPidfd);
  if (!fds.ok() && fds.status().code() == absl::StatusCode::kPermissionDenied) {
    GTEST_SKIP() << "no ptrace rights here: " << fds.status();
  }
  ASSERT_TRUE(fds.ok()) << fds.status();
  fds->clear();
  ImportOptions options;
  options.fd_fetch = FdFetch::kPidfd;
  auto imported = ImportBuffer(driver_, *d, options);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_TRUE(AllBytes((*imported)->ptr(), 2 * kMiB, 21));
  imported->reset();
  exporter.WriteLine("exit");
  EXPECT_EQ(exporter.Wait(), 0);
}

// An open import of many copies of one handle costs the importer its memory once, so pools
// created meanwhile work and stay shareable (they did not when each copy was counted: the
// handle-type probe found the device full and the pool became unshareable for good).
TEST(SharingAccountingTest, DuplicatedHandlesDoNotUseUpTheImportersMemory) {
  HostDriverOptions host;
  host.capacity = 256 * kMiB;
  std::unique_ptr<Driver> driver = NewHostDriver(host);
  PoolOptions options = SingleChunkOptions();
  options.reserve_size = 256 * kMiB;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Pool> exporter, CreateExportablePool(driver.get(), options));
  ASSERT_OK_AND_ASSIGN(void* a, exporter->Allocate(2 * kMiB, 0));
  ASSERT_OK_AND_ASSIGN(BufferDescriptor real, ExportBuffer(*exporter, a));
  // 400 MiB of mappings of one 2 MiB allocation, on a 256 MiB device.
  ASSERT_OK_AND_ASSIGN(BufferDescriptor copies, Repeated(real, 200, exporter->device_uuid()));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> open, ImportBuffer(driver.get(), copies));
  EXPECT_EQ(driver->GetMemInfo(0)->free, 254 * kMiB);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Pool> meanwhile,
                       CreateExportablePool(driver.get(), options));
  EXPECT_EQ(meanwhile->handle_type(), exporter->handle_type());
  ASSERT_OK_AND_ASSIGN(void* b, meanwhile->AllocateShareable(64 * kMiB, 0));
  EXPECT_OK(ExportBuffer(*meanwhile, b));
  EXPECT_OK(meanwhile->Free(b));
  open.reset();
  EXPECT_OK(exporter->Free(a));
}

INSTANTIATE_TEST_SUITE_P(HandleTypes, SharingTest,
                         ::testing::Values(HandleRequest::kPosixFd, HandleRequest::kFabric),
                         [](const auto& info) {
                           return info.param == HandleRequest::kFabric ? "fabric" : "posix_fd";
                         });

// --- The fd server's answers ------------------------------------------------------------------

// Fds open /dev/null until the process has none left below its (lowered) limit; closing them
// and restoring the limit on destruction.
class FdsExhausted {
 public:
  FdsExhausted() {
    getrlimit(RLIMIT_NOFILE, &saved_);
    rlimit low = saved_;
    low.rlim_cur = std::min<rlim_t>(saved_.rlim_cur, 512);
    setrlimit(RLIMIT_NOFILE, &low);
    for (int fd; (fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;) held_.push_back(fd);
  }
  ~FdsExhausted() {
    for (int fd : held_) ::close(fd);
    setrlimit(RLIMIT_NOFILE, &saved_);
  }

 private:
  rlimit saved_{};
  std::vector<int> held_;
};

// An exporter that holds the memory but cannot duplicate its fd (out of fds) says so; the
// handle is not stale.
TEST(FdShareTest, AnExporterOutOfFdsSaysSoRatherThanStale) {
  UniqueFd memfd(::memfd_create("vmm-fd-share-test", MFD_CLOEXEC));
  ASSERT_TRUE(memfd.valid());
  ASSERT_OK_AND_ASSIGN(FdToken token, FdServer::Get().Register(std::move(memfd)));
  absl::StatusOr<std::vector<UniqueFd>> fetched;
  {
    FdsExhausted exhausted;
    fetched = FetchFds({token});
  }
  EXPECT_THAT(fetched, StatusIs(absl::StatusCode::kUnavailable,
                                AllOf(HasSubstr("could not duplicate"),
                                      HasSubstr("Too many open files"))));
  EXPECT_OK(FetchFds({token})) << "works again once fds are free";
  FdServer::Get().Unregister(token.key);
}

// An importer of another user is refused by the exporter's fd server; it says so instead of
// "Connection reset by peer". Needs root, to run the two processes as two other users.
TEST(FdShareTest, AnExporterOfAnotherUserRefusesAndTheImporterSaysWhy) {
  if (geteuid() != 0 || ::access("/usr/bin/setpriv", X_OK) != 0) {
    GTEST_SKIP() << "needs root and setpriv to run two processes as two other users";
  }
  // A copy of vmm_peer that the other users can run (the runfiles may be under /root).
  char dir[] = "/tmp/vmm-peer-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  ASSERT_EQ(::chmod(dir, 0755), 0);
  const std::string peer = absl::StrCat(dir, "/vmm_peer");
  const std::string copy = absl::StrCat("cp ", PeerPath(), " ", peer, " && chmod 755 ", peer);
  ASSERT_EQ(std::system(copy.c_str()), 0);
  auto as_user = [&](int uid, std::vector<std::string> args) {
    std::vector<std::string> argv = {"/usr/bin/setpriv", absl::StrCat("--reuid=", uid),
                                     absl::StrCat("--regid=", uid), "--clear-groups", peer};
    argv.insert(argv.end(), args.begin(), args.end());
    return argv;
  };
  Subprocess exporter(as_user(65534, {"export", "--size=2M", "--fill=5", "--handle=posix_fd",
                                      "--backend=host"}));
  const std::string hex = exporter.ReadLine();
  ASSERT_FALSE(hex.empty()) << "the exporter failed";
  Subprocess importer(
      as_user(65533, {"import", "--descriptor=" + hex, "--expect=5", "--backend=host"}), {},
      Subprocess::Output::kWithStderr);
  const std::string output = importer.ReadAll();
  EXPECT_EQ(importer.Wait(), 3) << output;
  EXPECT_THAT(output, HasSubstr("refused: not the same user")) << output;
  EXPECT_THAT(output, HasSubstr("PERMISSION_DENIED")) << output;
  exporter.WriteLine("exit");
  EXPECT_EQ(exporter.Wait(), 0);
  std::system(absl::StrCat("rm -rf ", dir).c_str());
}

// --- Re-export: A -> B -> C ----------------------------------------------------------------

// A driver that forwards every call to another and counts the exports it is asked for.
class CountingDriver : public ForwardingDriver {
 public:
  using ForwardingDriver::ForwardingDriver;
  int exports() const { return exports_.load(); }
  absl::StatusOr<ShareableHandle> Export(PhysHandle h, HandleType t) override {
    ++exports_;
    return ForwardingDriver::Export(h, t);
  }

 private:
  std::atomic<int> exports_{0};
};

// A CountingDriver whose SynchronizeDevice fails once told to, and that counts Unmap calls.
class FailingSyncDriver : public CountingDriver {
 public:
  using CountingDriver::CountingDriver;
  absl::Status SynchronizeDevice(int d) override {
    if (fail_sync_) return absl::InternalError("the device had an error");
    return CountingDriver::SynchronizeDevice(d);
  }
  absl::Status Unmap(DevPtr p, size_t size) override {
    ++unmaps_;
    return CountingDriver::Unmap(p, size);
  }
  void FailSync() { fail_sync_ = true; }
  int unmaps() const { return unmaps_; }

 private:
  std::atomic<bool> fail_sync_{false};
  std::atomic<int> unmaps_{0};
};

// Closing an import whose device cannot be synchronized leaves its range mapped (work may still
// use it) instead of unmapping under that work.
TEST_P(SharingTest, AnImportWhoseDeviceFailsToSyncIsLeftMapped) {
  void* a = Filled(2 * kMiB, 77);
  ASSERT_OK_AND_ASSIGN(BufferDescriptor d, ExportBuffer(*pool_, a));
  FailingSyncDriver failing(driver_);
  ImportOptions options;
  options.share_mappings = false;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> b, ImportBuffer(&failing, d, options));
  const DevPtr ptr = b->ptr();
  const DevPtr base = b->mapping_base();
  const size_t mapped = b->mapped_size();
  const size_t open = OpenImportMappings();
  std::vector<bool> reported;
  b->OnUnmapped([&reported](bool forwarded) { reported.push_back(forwarded); });
  failing.FailSync();
  b.reset();
  EXPECT_EQ(failing.unmaps(), 0) << "unmapped after a failed synchronize";
  EXPECT_EQ(reported, std::vector<bool>{true}) << "left mapped: not a release";
  EXPECT_EQ(OpenImportMappings(), open - 1);
  EXPECT_TRUE(AllBytes(ptr, 2 * kMiB, 77)) << "the range is still mapped";
  // What the process leaked, given back by hand so that the memory checks pass.
  EXPECT_OK(driver_->Unmap(base, mapped));
  EXPECT_OK(driver_->Unreserve(base, mapped));
  ASSERT_OK(pool_->Free(a));
}

// B is this process unless a test says otherwise: it imports what A (a pool of this process,
// or a vmm_peer export) exported and sends it on to C (vmm_peer import).
class ReExportTest : public SharingTest {
 protected:
  void SetUp() override {
    SharingTest::SetUp();
    if (pool_ == nullptr) return;  // skipped
    if (driver_->backend() == Backend::kCuda && GetParam() == HandleRequest::kFabric) {
      GTEST_SKIP() << "the CUDA driver does not export imported handles: fabric imports cannot "
                      "be sent on (ReExportImport is FailedPrecondition there)";
    }
  }

  std::string HandleFlag() const {
    return GetParam() == HandleRequest::kFabric ? "--handle=fabric" : "--handle=posix_fd";
  }
  bool fds() const { return GetParam() == HandleRequest::kPosixFd; }
  // The arguments of a vmm_peer that exports `size` bytes of `fill` with this test's handles.
  std::vector<std::string> ExporterArgs(size_t size, int fill) const {
    return {PeerPath(), "export", "--size=" + std::to_string(size),
            "--fill=" + std::to_string(fill), HandleFlag()};
  }
  // The descriptor an exporter started with ExporterArgs prints first.
  static absl::StatusOr<BufferDescriptor> ExportedBy(Subprocess& exporter) {
    const std::string hex = exporter.ReadLine();
    if (hex.empty()) return absl::InternalError("the exporter failed");
    return BufferDescriptor::Decode(absl::HexStringToBytes(hex));
  }

  // The same buffer as `original`, described by another process (other handles).
  static void ExpectSameBuffer(const BufferDescriptor& sent_on, const BufferDescriptor& original) {
    EXPECT_EQ(sent_on.handle_type(), original.handle_type());
    EXPECT_EQ(sent_on.sizes(), original.sizes());
    EXPECT_EQ(sent_on.size(), original.size());
    EXPECT_EQ(sent_on.offset(), original.offset());
    EXPECT_EQ(sent_on.owner_uuid(), original.owner_uuid());
    EXPECT_NE(sent_on.handles(), original.handles()) << "the handles are this process's own";
  }

  // A (vmm_peer export) exports `size` bytes of 61; B (this process) imports and re-exports
  // them; A frees the buffer and, if `exporter_exits`, exits; C imports B's descriptor, reads
  // A's bytes and writes its own, which B sees. Dropping B's import leaves nothing behind.
  void SendOnAfterTheExporterGoes(bool exporter_exits) {
    const size_t fds_before = FdServer::Get().size();
    const size_t size = 6 * kMiB;
    Subprocess a(ExporterArgs(size, 61));
    ASSERT_OK_AND_ASSIGN(BufferDescriptor from_a, ExportedBy(a));
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> b, ImportBuffer(driver_, from_a));
    EXPECT_EQ(b->handle_type(), from_a.handle_type());
    ASSERT_OK_AND_ASSIGN(BufferDescriptor from_b, ReExportImport(*b));
    ExpectSameBuffer(from_b, from_a);
    EXPECT_EQ(FdServer::Get().size(), fds_before + (fds() ? from_b.handles().size() : 0));
    a.WriteLine("free");
    EXPECT_EQ(a.ReadLine(), "freed");
    if (exporter_exits) {
      a.WriteLine("exit");
      EXPECT_EQ(a.Wait(), 0);
    }
    Subprocess c({PeerPath(), "import", "--descriptor=" + Hex(from_b), "--expect=61",
                  "--write=62"});
    EXPECT_THAT(c.ReadLine(), HasSubstr("ok"));
    EXPECT_EQ(c.Wait(), 0) << "C could not read A's bytes through B";
    EXPECT_TRUE(AllBytes(b->ptr(), size, 62)) << "B does not see C's writes";
    b.reset();
    EXPECT_EQ(FdServer::Get().size(), fds_before);
    EXPECT_EQ(OpenImportMappings(), 0u);
    if (!exporter_exits) {
      a.WriteLine("exit");
      EXPECT_EQ(a.Wait(), 0);
    }
  }
};

TEST_P(ReExportTest, CReadsABytesThroughBAfterAFreesThem) { SendOnAfterTheExporterGoes(false); }

TEST_P(ReExportTest, CReadsABytesThroughBAfterAExits) { SendOnAfterTheExporterGoes(true); }

TEST_P(ReExportTest, ReExportingAgainReusesTheFirstExport) {
  pool_.reset();
  PoolOptions options = SingleChunkOptions();
  options.reserve_size = 1024 * kMiB;
  options.handle_type = GetParam();
  options.max_chunk = 2 * kMiB;  // a 9 MiB block spans five chunks
  ASSERT_OK_AND_ASSIGN(pool_, CreateExportablePool(driver_, options));
  void* a = Filled(9 * kMiB, 23);
  ASSERT_OK_AND_ASSIGN(BufferDescriptor d, ExportBuffer(*pool_, a));
  ASSERT_EQ(d.handles().size(), 5u);
  CountingDriver counting(driver_);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> b, ImportBuffer(&counting, d));
  const size_t fds_before = FdServer::Get().size();
  ASSERT_OK_AND_ASSIGN(BufferDescriptor first, ReExportImport(*b));
  ExpectSameBuffer(first, d);
  // Fds are sent on as the import fetched them (no driver call); fabric handles are exported
  // by the driver, once each.
  const int exports = counting.exports();
  EXPECT_EQ(exports, fds() ? 0 : 5);
  const size_t registered = FdServer::Get().size();
  EXPECT_EQ(registered, fds_before + (fds() ? 5 : 0));
  ASSERT_OK_AND_ASSIGN(BufferDescriptor second, ReExportImport(*b));
  EXPECT_EQ(second, first);
  EXPECT_EQ(counting.exports(), exports) << "a second driver export";
  EXPECT_EQ(FdServer::Get().size(), registered) << "a second registration";
  // An import sharing the mapping shares what it sent on.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> shared, ImportBuffer(&counting, d));
  EXPECT_TRUE(shared->shared());
  ASSERT_OK_AND_ASSIGN(BufferDescriptor third, ReExportImport(*shared));
  EXPECT_EQ(third, first);
  EXPECT_EQ(counting.exports(), exports);
  // Each works in another process.
  for (const BufferDescriptor* sent_on : {&first, &second}) {
    Subprocess c({PeerPath(), "import", "--descriptor=" + Hex(*sent_on), "--expect=23"});
    EXPECT_EQ(c.Wait(), 0);
  }
  b.reset();
  EXPECT_EQ(FdServer::Get().size(), registered) << "still in use by the shared import";
  shared.reset();
  EXPECT_EQ(FdServer::Get().size(), fds_before);
  EXPECT_EQ(OpenImportMappings(), 0u);
  ASSERT_OK(pool_->Free(a));
}

// Sending an import on makes its receivers uncounted: its unmap report says forwarded.
TEST_P(ReExportTest, AReExportedImportIsReportedForwarded) {
  void* a = Filled(2 * kMiB, 24);
  ASSERT_OK_AND_ASSIGN(BufferDescriptor d, ExportBuffer(*pool_, a));
  std::vector<bool> reported;
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> b, ImportBuffer(driver_, d));
    b->OnUnmapped([&reported](bool forwarded) { reported.push_back(forwarded); });
    ASSERT_OK(ReExportImport(*b).status());
    EXPECT_TRUE(reported.empty());
  }
  EXPECT_EQ(reported, std::vector<bool>{true});
  ASSERT_OK(pool_->Free(a));
}

TEST_P(ReExportTest, OnceBDropsTheImportItsDescriptorIsStale) {
  const size_t fds_before = FdServer::Get().size();
  Subprocess a(ExporterArgs(4 * kMiB, 44));
  ASSERT_OK_AND_ASSIGN(BufferDescriptor from_a, ExportedBy(a));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> b, ImportBuffer(driver_, from_a));
  ASSERT_OK_AND_ASSIGN(BufferDescriptor from_b, ReExportImport(*b));
  a.WriteLine("free");  // from now on B's mapping alone holds the memory
  EXPECT_EQ(a.ReadLine(), "freed");
  b.reset();
  EXPECT_EQ(FdServer::Get().size(), fds_before) << "re-exported fds left registered";
  EXPECT_EQ(OpenImportMappings(), 0u);
  const size_t free_before = driver_->GetMemInfo(0)->free;
  // C gets a clean error naming the owner; so does an import here.
  Subprocess c({PeerPath(), "import", "--descriptor=" + Hex(from_b), "--expect=44"}, {},
               Subprocess::Output::kWithStderr);
  const std::string output = c.ReadAll();
  EXPECT_EQ(c.Wait(), 3) << output;
  EXPECT_THAT(output, HasSubstr("NOT_FOUND")) << output;
  EXPECT_THAT(output, HasSubstr(*from_a.owner_uuid())) << output;
  auto here = ImportBuffer(driver_, from_b);
  ASSERT_FALSE(here.ok());
  EXPECT_TRUE(absl::IsNotFound(here.status()) || absl::IsUnavailable(here.status()))
      << here.status();
  EXPECT_EQ(OpenImportMappings(), 0u);
  // Nothing of the failed imports stays mapped. On CUDA other processes (A, C) come and go
  // meanwhile and the driver's own bookkeeping moves free memory by less than a granule (64 KiB
  // on an H200), less than anything vmm maps.
  const int64_t moved = static_cast<int64_t>(driver_->GetMemInfo(0)->free) -
                        static_cast<int64_t>(free_before);
  if (driver_->backend() == Backend::kHost) {
    EXPECT_EQ(moved, 0);
  } else {
    EXPECT_LT(std::abs(moved), int64_t{2} << 20);
  }
  a.WriteLine("exit");
  EXPECT_EQ(a.Wait(), 0);
}

// B is another process (vmm_peer reexport): A, this process, frees; C reads A's bytes through
// B and writes, B sees it; after B drops the import, and after B exits, C is refused.
TEST_P(ReExportTest, AnotherProcessSendsTheBufferOn) {
  void* a = Filled(3 * kMiB, 51);
  ASSERT_OK_AND_ASSIGN(BufferDescriptor d, ExportBuffer(*pool_, a));
  Subprocess b({PeerPath(), "reexport", "--descriptor=" + Hex(d), "--expect=51"});
  const std::string from_b = b.ReadLine();
  ASSERT_FALSE(from_b.empty()) << "B failed";
  ASSERT_OK(pool_->Free(a));
  ASSERT_OK(pool_->EmptyCache());
  EXPECT_EQ(pool_->GetStats().reserved_bytes.current, 0) << "A still holds the memory";
  b.WriteLine("again");
  EXPECT_EQ(b.ReadLine(), from_b) << "the second re-export differs from the first";
  Subprocess c({PeerPath(), "import", "--descriptor=" + from_b, "--expect=51", "--write=52"});
  EXPECT_THAT(c.ReadLine(), HasSubstr("ok"));
  EXPECT_EQ(c.Wait(), 0);
  b.WriteLine("expect 52");
  EXPECT_EQ(b.ReadLine(), "match") << "B does not see C's writes";
  b.WriteLine("drop");
  EXPECT_EQ(b.ReadLine(), "dropped 0") << "B left fds registered";
  Subprocess after_drop({PeerPath(), "import", "--descriptor=" + from_b, "--expect=52"});
  EXPECT_EQ(after_drop.Wait(), 3);
  b.WriteLine("exit");
  EXPECT_EQ(b.Wait(), 0);
  Subprocess after_exit({PeerPath(), "import", "--descriptor=" + from_b, "--expect=52"});
  EXPECT_EQ(after_exit.Wait(), 3);
}

// Threads sending on imports that share one mapping all get the one descriptor, made once.
TEST_P(ReExportTest, ThreadsReExportingTogetherShareOneExport) {
  void* a = Filled(2 * kMiB, 9);
  ASSERT_OK_AND_ASSIGN(BufferDescriptor d, ExportBuffer(*pool_, a));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> one, ImportBuffer(driver_, d));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> two, ImportBuffer(driver_, d));
  ASSERT_TRUE(two->shared());
  const size_t fds_before = FdServer::Get().size();
  std::vector<std::string> encoded(8);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < encoded.size(); ++i) {
    threads.emplace_back([&, i] {
      absl::StatusOr<BufferDescriptor> sent_on = ReExportImport(i % 2 ? *one : *two);
      if (sent_on.ok()) encoded[i] = sent_on->Encode();
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::string& e : encoded) EXPECT_EQ(e, encoded[0]);
  EXPECT_FALSE(encoded[0].empty());
  EXPECT_EQ(FdServer::Get().size(), fds_before + (fds() ? 1 : 0));
  one.reset();
  two.reset();
  EXPECT_EQ(FdServer::Get().size(), fds_before);
  ASSERT_OK(pool_->Free(a));
}

// A re-export that fails (here: no fd left to duplicate) registers nothing and can be retried.
TEST_P(ReExportTest, AFailedReExportLeavesNothingRegisteredAndCanBeRetried) {
  if (!fds()) GTEST_SKIP() << "fd handles only";
  void* a = Filled(2 * kMiB, 8);
  ASSERT_OK_AND_ASSIGN(BufferDescriptor d, ExportBuffer(*pool_, a));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> b, ImportBuffer(driver_, d));
  std::vector<bool> reported;
  b->OnUnmapped([&reported](bool forwarded) { reported.push_back(forwarded); });
  const size_t fds_before = FdServer::Get().size();
  absl::StatusOr<BufferDescriptor> refused;
  {
    FdsExhausted exhausted;
    refused = ReExportImport(*b);
  }
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kResourceExhausted,
                                AllOf(HasSubstr("re-exporting an imported buffer of the owner"),
                                      HasSubstr(pool_->device_uuid()))));
  EXPECT_EQ(FdServer::Get().size(), fds_before);
  ASSERT_OK_AND_ASSIGN(BufferDescriptor sent_on, ReExportImport(*b));
  ExpectSameBuffer(sent_on, d);
  b.reset();
  EXPECT_EQ(reported, std::vector<bool>{true});
  EXPECT_EQ(FdServer::Get().size(), fds_before);
  ASSERT_OK(pool_->Free(a));
}

// A re-export that fails sent nothing on: the import's unmap report does not say forwarded.
TEST_P(ReExportTest, AFailedReExportDoesNotMarkTheImportForwarded) {
  if (!fds()) GTEST_SKIP() << "fd handles only";
  void* a = Filled(2 * kMiB, 9);
  ASSERT_OK_AND_ASSIGN(BufferDescriptor d, ExportBuffer(*pool_, a));
  std::vector<bool> reported;
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> b, ImportBuffer(driver_, d));
    b->OnUnmapped([&reported](bool forwarded) { reported.push_back(forwarded); });
    FdsExhausted exhausted;
    EXPECT_FALSE(ReExportImport(*b).ok());
  }
  EXPECT_EQ(reported, std::vector<bool>{false});
  ASSERT_OK(pool_->Free(a));
}

// The fds open in this process.
size_t OpenFds() {
  size_t n = 0;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return 0;
  while (::readdir(dir) != nullptr) ++n;
  ::closedir(dir);
  return n;
}

// Past the process's kept-fd cap an import maps and reads as any other but keeps no fds, and
// refuses to be sent on; imports within the cap still can be.
// Whether an open fd of this process is a copy of `file` (the same device and inode).
bool HoldsFile(const struct stat& file) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return true;  // cannot tell: fail the check
  bool found = false;
  while (dirent* e = readdir(dir)) {
    const int fd = std::atoi(e->d_name);
    struct stat st;
    if (e->d_name[0] == '.' || fd == dirfd(dir) || fstat(fd, &st) != 0) continue;
    found |= st.st_dev == file.st_dev && st.st_ino == file.st_ino;
  }
  closedir(dir);
  return found;
}

// An import keeps the fds it fetched so that it can be sent on (kept_handles.h); a copy in a
// forked child would hold the exporter's memory for the child's life. The child closes its
// copies at the fork and cannot send the import on; the parent still can.
TEST_P(ReExportTest, AForkedChildKeepsNoFdOfItsParentsImports) {
  if (!fds()) GTEST_SKIP() << "fabric handles are not fds";
  Subprocess a(ExporterArgs(4 * kMiB, 61));
  ASSERT_OK_AND_ASSIGN(BufferDescriptor from_a, ExportedBy(a));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> b, ImportBuffer(driver_, from_a));
  ASSERT_OK_AND_ASSIGN(BufferDescriptor from_b, ReExportImport(*b));
  ASSERT_EQ(from_b.handles().size(), 1u);
  struct stat kept;
  {
    ASSERT_OK_AND_ASSIGN(const FdToken token, FdToken::Decode(from_b.handles()[0]));
    ASSERT_OK_AND_ASSIGN(std::vector<UniqueFd> copy, FetchFds({token}));
    ASSERT_EQ(copy.size(), 1u);
    ASSERT_EQ(fstat(copy[0].get(), &kept), 0);
  }  // closed before the fork
  ASSERT_TRUE(HoldsFile(kept));
  const int code = InForkedChild([&] {
    if (HoldsFile(kept)) return 1;
    const absl::Status sent_on = ReExportImport(*b).status();
    if (!absl::IsFailedPrecondition(sent_on)) return 2;
    if (!absl::StrContains(sent_on.message(), "forked")) return 3;
    return 0;
  });
  EXPECT_EQ(code, 0) << "1: the child holds a copy of the import's fd; 2-3: it was not told it "
                        "cannot send the import on";
  ASSERT_OK_AND_ASSIGN(BufferDescriptor again, ReExportImport(*b));
  EXPECT_EQ(again, from_b) << "the parent's import is untouched";
  EXPECT_TRUE(AllBytes(b->ptr(), 4 * kMiB, 61));
  b.reset();
  a.WriteLine("exit");
  EXPECT_EQ(a.Wait(), 0);
}

TEST_P(ReExportTest, ImportsPastTheKeptFdCapKeepNoFdsAndCannotBeSentOn) {
  if (!fds()) GTEST_SKIP() << "fd handles only: fabric handles are not capped";
  const size_t in_use = KeptHandles::KeptFdsInUse();
  KeptHandles::SetKeptFdCapForTesting(in_use + 2);
  std::vector<void*> blocks;
  std::vector<std::unique_ptr<ImportedBuffer>> imports;
  for (int i = 0; i < 2; ++i) {
    blocks.push_back(Filled(2 * kMiB, 30 + i));
    ASSERT_OK_AND_ASSIGN(BufferDescriptor d, ExportBuffer(*pool_, blocks.back()));
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> b, ImportBuffer(driver_, d));
    imports.push_back(std::move(b));
  }
  EXPECT_EQ(KeptHandles::KeptFdsInUse(), in_use + 2) << "one fd each, within the cap";
  for (int i = 0; i < 3; ++i) {
    blocks.push_back(Filled(2 * kMiB, 40 + i));
    ASSERT_OK_AND_ASSIGN(BufferDescriptor d, ExportBuffer(*pool_, blocks.back()));
    const size_t open_before = OpenFds();
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> past, ImportBuffer(driver_, d));
    EXPECT_EQ(OpenFds(), open_before) << "an import past the cap holds no extra fd";
    EXPECT_EQ(KeptHandles::KeptFdsInUse(), in_use + 2);
    EXPECT_TRUE(AllBytes(past->ptr(), 2 * kMiB, 40 + i));
    EXPECT_THAT(ReExportImport(*past),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         AllOf(HasSubstr("keeps no fds for this import"),
                               HasSubstr("too many imports open"))));
    imports.push_back(std::move(past));
  }
  ASSERT_OK_AND_ASSIGN(BufferDescriptor sent_on, ReExportImport(*imports[0]));
  Subprocess c({PeerPath(), "import", "--descriptor=" + Hex(sent_on), "--expect=30"});
  EXPECT_EQ(c.Wait(), 0) << "an import within the cap is sent on";
  imports.clear();
  EXPECT_EQ(KeptHandles::KeptFdsInUse(), in_use) << "closing the imports frees their slots";
  KeptHandles::SetKeptFdCapForTesting(0);
  for (void* p : blocks) ASSERT_OK(pool_->Free(p));
  EXPECT_EQ(OpenImportMappings(), 0u);
}

INSTANTIATE_TEST_SUITE_P(HandleTypes, ReExportTest,
                         ::testing::Values(HandleRequest::kPosixFd, HandleRequest::kFabric),
                         [](const auto& info) {
                           return info.param == HandleRequest::kFabric ? "fabric" : "posix_fd";
                         });

// What an import keeps cannot describe memory of handle type none.
TEST(KeptHandlesTest, HandleTypeNoneHasNothingToSendOn) {
  ASSERT_OK_AND_ASSIGN(Driver* driver, TestDriver());
  KeptHandles kept(driver, HandleType::kNone);
  EXPECT_THAT(kept.Describe(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                        HasSubstr("handle type is none")));
  EXPECT_OK(kept.Release());
  EXPECT_THAT(kept.Describe(), StatusIs(absl::StatusCode::kFailedPrecondition));
}

// --- Two devices ---------------------------------------------------------------------------

// The environment of helper processes: two emulated devices on the host backend (no effect on
// CUDA).
const std::vector<std::string> kTwoHostDevices = {"VMM_HOST_DEVICES=2"};

// Whether every byte of [ptr, ptr+size) is `value`, copied out on `stream`.
bool AllBytesAre(Driver* driver, DevPtr ptr, size_t size, uint8_t value, Stream stream) {
  std::vector<uint8_t> host(size);
  if (!driver->MemcpyAsync(reinterpret_cast<DevPtr>(host.data()), ptr, size, stream).ok() ||
      !driver->SynchronizeStream(stream).ok()) {
    return false;
  }
  for (uint8_t b : host) {
    if (b != value) return false;
  }
  return true;
}

// Whether `device` may access `at`; an error fails the test (and counts as no).
bool Granted(Driver* driver, DevPtr at, int device) {
  absl::StatusOr<bool> granted = driver->HasAccess(at, device);
  EXPECT_TRUE(granted.ok()) << granted.status();
  return granted.ok() && *granted;
}

// Whether exactly the devices in `devices` of the two may access the first and last byte of
// the buffer's mapping.
::testing::AssertionResult AccessIsExactly(Driver* driver, const ImportedBuffer& buffer,
                                           const std::vector<int>& devices) {
  const DevPtr last = buffer.mapping_base() + buffer.mapped_size() - 1;
  for (DevPtr at : {buffer.mapping_base(), last}) {
    for (int device : {0, 1}) {
      const bool expected = std::find(devices.begin(), devices.end(), device) != devices.end();
      if (Granted(driver, at, device) != expected) {
        return ::testing::AssertionFailure()
               << "device " << device << (expected ? " lacks access" : " has access");
      }
    }
  }
  return ::testing::AssertionSuccess();
}

class TwoDeviceSharingTest : public PoolFixture {
 protected:
  void SetUp() override {
    absl::StatusOr<Driver*> driver = TestDriver();
    ASSERT_OK(driver);
    Driver* chosen = *driver;
    if ((*driver)->Name() == "host") {
      HostDriverOptions options;
      options.device_count = 2;
      owned_ = NewHostDriver(options);
      chosen = owned_.get();
    } else if ((*driver)->DeviceCount() < 2) {
      GTEST_SKIP() << "needs two devices and " << (*driver)->Name() << " has "
                   << (*driver)->DeviceCount() << " (run on a machine with two GPUs)";
    }
    MakePool(chosen, 1024 * kMiB);
    if (pool_ == nullptr) return;  // skipped
    auto stream = driver_->CreateStream(1);
    ASSERT_TRUE(stream.ok()) << stream.status();
    on_one_ = *stream;
  }

  void TearDown() override {
    if (on_one_ != 0) EXPECT_TRUE(driver_->DestroyStream(on_one_).ok());
    PoolFixture::TearDown();
  }

  std::string HandleFlag() const {
    return GetParam() == HandleRequest::kFabric ? "--handle=fabric" : "--handle=posix_fd";
  }

  std::unique_ptr<Driver> owned_;  // the host backend with two devices (pool_ is on device 0)
  Stream on_one_ = 0;              // a stream of device 1
};

TEST_P(TwoDeviceSharingTest, ImportOnTheOtherDeviceReadsAndWritesTheBytes) {
  const size_t size = 5 * kMiB;
  void* a = Filled(size, 7);
  auto d = ExportBuffer(*pool_, a);
  ASSERT_TRUE(d.ok()) << d.status();
  ImportOptions options;
  options.device = 1;
  auto imported = ImportBuffer(driver_, *d, options);
  ASSERT_TRUE(imported.ok()) << imported.status();
  const ImportedBuffer& buffer = **imported;
  EXPECT_EQ(buffer.device(), 1);
  EXPECT_TRUE(AccessIsExactly(driver_, buffer, {1}));
  EXPECT_TRUE(AllBytesAre(driver_, buffer.ptr(), size, 7, on_one_));
  // Device 1 writes through the import; device 0 sees it through the pool's mapping.
  ASSERT_TRUE(driver_->MemsetAsync(buffer.ptr(), 8, size, on_one_).ok());
  ASSERT_TRUE(driver_->SynchronizeStream(on_one_).ok());
  EXPECT_TRUE(AllBytesAre(driver_, reinterpret_cast<DevPtr>(a), size, 8, 0));
  imported->reset();
  ASSERT_TRUE(pool_->Free(a).ok());
}

TEST_P(TwoDeviceSharingTest, PeerDevicesOfAnImportGetAccessToo) {
  const size_t size = 3 * kMiB;
  void* a = Filled(size, 9);
  auto d = ExportBuffer(*pool_, a);
  ASSERT_TRUE(d.ok()) << d.status();
  struct Case {
    int device;
    std::vector<int> peers;
    std::vector<int> access;
  };
  const Case cases[] = {{1, {0}, {0, 1}}, {0, {1}, {0, 1}}, {0, {}, {0}}, {1, {}, {1}}};
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat("device ", c.device, ", ", c.peers.size(), " peer(s)"));
    ImportOptions options;
    options.device = c.device;
    options.peer_devices = c.peers;
    auto imported = ImportBuffer(driver_, *d, options);
    ASSERT_TRUE(imported.ok()) << imported.status();
    EXPECT_FALSE((*imported)->shared()) << "another device or peer list is another mapping";
    EXPECT_TRUE(AccessIsExactly(driver_, **imported, c.access));
    for (int device : c.access) {
      EXPECT_TRUE(AllBytesAre(driver_, (*imported)->ptr(), size, 9, device == 0 ? 0 : on_one_))
          << "read on device " << device;
    }
  }
  // A device or peer that does not exist fails the import and leaves nothing mapped.
  const int bad = driver_->DeviceCount();
  for (const auto& [device, peers] : {std::pair<int, std::vector<int>>{bad, {}}, {1, {bad}}}) {
    ImportOptions options;
    options.device = device;
    options.peer_devices = peers;
    auto imported = ImportBuffer(driver_, *d, options);
    EXPECT_EQ(imported.status().code(), absl::StatusCode::kInvalidArgument) << imported.status();
    EXPECT_EQ(OpenImportMappings(), 0u);
  }
  ASSERT_TRUE(pool_->Free(a).ok());
}

TEST_P(TwoDeviceSharingTest, AnotherProcessImportsOnTheOtherDevice) {
  const size_t size = 6 * kMiB;
  void* a = Filled(size, 31);
  auto d = ExportBuffer(*pool_, a);
  ASSERT_TRUE(d.ok()) << d.status();
  Subprocess peer(
      {PeerPath(), "import", "--descriptor=" + Hex(*d), "--expect=31", "--write=32", "--device=1"},
      kTwoHostDevices);
  ASSERT_TRUE(peer.started());
  EXPECT_THAT(peer.ReadLine(), HasSubstr("ok"));
  EXPECT_EQ(peer.Wait(), 0);
  EXPECT_TRUE(AllBytesAre(driver_, reinterpret_cast<DevPtr>(a), size, 32, 0));
  // With device 0 as a peer of the import, the peer checks that both have access.
  Subprocess both({PeerPath(), "import", "--descriptor=" + Hex(*d), "--expect=32", "--write=33",
                   "--device=1", "--peers=0"},
                  kTwoHostDevices);
  EXPECT_THAT(both.ReadLine(), HasSubstr("ok"));
  EXPECT_EQ(both.Wait(), 0);
  EXPECT_TRUE(AllBytesAre(driver_, reinterpret_cast<DevPtr>(a), size, 33, 0));
  ASSERT_TRUE(pool_->Free(a).ok());
}

// Process A exports from device 0, process B imports on device 1, checks A's bytes and writes
// its own, and A sees them.
TEST_P(TwoDeviceSharingTest, ProcessAExportsFromDeviceZeroProcessBImportsOnDeviceOne) {
  Subprocess exporter({PeerPath(), "export", "--size=" + std::to_string(6 * kMiB), "--fill=77",
                       "--device=0", HandleFlag()},
                      kTwoHostDevices);
  const std::string hex = exporter.ReadLine();
  ASSERT_FALSE(hex.empty()) << "the exporter failed";
  Subprocess importer(
      {PeerPath(), "import", "--descriptor=" + hex, "--expect=77", "--write=78", "--device=1"},
      kTwoHostDevices);
  EXPECT_THAT(importer.ReadLine(), HasSubstr("ok"));
  EXPECT_EQ(importer.Wait(), 0);
  exporter.WriteLine("expect 78");
  EXPECT_EQ(exporter.ReadLine(), "match") << "process A does not see process B's writes";
  exporter.WriteLine("exit");
  EXPECT_EQ(exporter.Wait(), 0);
}

INSTANTIATE_TEST_SUITE_P(HandleTypes, TwoDeviceSharingTest,
                         ::testing::Values(HandleRequest::kPosixFd, HandleRequest::kFabric),
                         [](const auto& info) {
                           return info.param == HandleRequest::kFabric ? "fabric" : "posix_fd";
                         });

}  // namespace
}  // namespace vmm
