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
#include "allocator/sharing.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "allocator/driver_factory.h"
#include "allocator/fd_share.h"
#include "allocator/host_driver.h"
#include "allocator/pool.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
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
    PoolOptions options;
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
    if (!driver_->MemcpyAsync(reinterpret_cast<DevPtr>(host.data()), ptr, size, 0).ok()) return false;
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
  PoolOptions options;
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
  PoolOptions options;
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
  PoolOptions options;
  options.reserve_size = 256 * kMiB;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Pool> exporter, CreateExportablePool(driver.get(), options));
  ASSERT_OK_AND_ASSIGN(void* a, exporter->Allocate(2 * kMiB, 0));
  ASSERT_OK_AND_ASSIGN(BufferDescriptor real, ExportBuffer(*exporter, a));
  // 400 MiB of mappings of one 2 MiB allocation, on a 256 MiB device.
  ASSERT_OK_AND_ASSIGN(BufferDescriptor copies, Repeated(real, 200, exporter->device_uuid()));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> open, ImportBuffer(driver.get(), copies));
  EXPECT_EQ(driver->GetMemInfo(0)->free, 254 * kMiB);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Pool> meanwhile, CreateExportablePool(driver.get(), options));
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
  ASSERT_EQ(std::system(absl::StrCat("cp ", PeerPath(), " ", peer, " && chmod 755 ", peer).c_str()), 0);
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
