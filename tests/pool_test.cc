// Unit tests of the caching pool on the host backend (the same suite runs on CUDA with
// VMM_TEST_BACKEND=cuda, tests/test_backend.h). Tests named TwoDevices* use a
// host backend that emulates two devices, or on CUDA run only where there are two GPUs.
#include "allocator/pool.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "allocator/capture_window.h"
#include "allocator/driver_error.h"
#include "allocator/driver_factory.h"
#include "allocator/forwarding_driver.h"
#include "allocator/host_driver.h"
#include "allocator/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/pool_helpers.h"
#include "tests/slack_range_driver.h"
#include "tests/status_matchers.h"
#include "tests/stream_gate.h"
#include "tests/test_backend.h"

namespace vmm {
namespace {

using ::testing::HasSubstr;

constexpr size_t kMiB = size_t{1} << 20;

// Remembers which exported chunks a pool reported released, and which pools went away.
class RecordingObserver : public ExportObserver {
 public:
  void ChunkReleased(uint64_t pool_id, uint64_t chunk_id) override {
    std::lock_guard<std::mutex> lock(mu_);
    released_.push_back(chunk_id);
  }
  void PoolDestroyed(uint64_t pool_id) override {
    std::lock_guard<std::mutex> lock(mu_);
    destroyed_.push_back(pool_id);
  }
  std::vector<uint64_t> released() {
    std::lock_guard<std::mutex> lock(mu_);
    return released_;
  }
  std::vector<uint64_t> destroyed() {
    std::lock_guard<std::mutex> lock(mu_);
    return destroyed_;
  }

 private:
  std::mutex mu_;
  std::vector<uint64_t> released_;
  std::vector<uint64_t> destroyed_;
};

// Each test gets its own driver: the host backend with a capacity the test chooses, or the
// CUDA backend when VMM_TEST_BACKEND=cuda (capacity is then the GPU's).
class PoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(driver_, TestDriver(HostDriverOptions{2 * kMiB, 256 * kMiB}, &owned_));
    on_cuda_ = driver_->Name() == "cuda";
    auto info = driver_->GetMemInfo(0);
    ASSERT_TRUE(info.ok());
    free_at_start_ = info->free;
  }

  // A pool that grows by exactly what each request needs unless the test says otherwise, so
  // that the tests can predict the reserved bytes.
  static PoolOptions Exact() {
    PoolOptions options = SingleChunkOptions();
    options.growth_fraction = 0;
    return options;
  }

  std::unique_ptr<Pool> MakePool(PoolOptions options = Exact(),
                                 ExportObserver* observer = nullptr) {
    if (options.reserve_size == 0) options.reserve_size = 1024 * kMiB;
    return CreatePoolOrFail(driver_, options, observer);
  }

  void* Alloc(Pool& pool, size_t size, Stream stream = 0) {
    return AllocateOrFail(pool, size, stream);
  }

  size_t DeviceFree() { return driver_->GetMemInfo(0)->free; }

  // A driver with two devices: the host backend emulating two (same capacity as above), or
  // the CUDA backend when it has two GPUs; nullptr otherwise (the test skips).
  Driver* TwoDeviceDriver() {
    if (on_cuda_) return driver_->DeviceCount() >= 2 ? driver_ : nullptr;
    HostDriverOptions options{2 * kMiB, 256 * kMiB};
    options.device_count = 2;
    owned_two_ = NewHostDriver(options);
    return owned_two_.get();
  }

  // The test's driver on CUDA; on the host backend, one whose device holds `capacity` bytes
  // (for tests that need more than the fixture's 256 MiB).
  Driver* DriverOfAtLeast(size_t capacity) {
    if (on_cuda_) return driver_;
    owned_big_ = NewHostDriver(HostDriverOptions{2 * kMiB, capacity});
    return owned_big_.get();
  }

  std::unique_ptr<Driver> owned_;
  std::unique_ptr<Driver> owned_two_;
  std::unique_ptr<Driver> owned_big_;
  Driver* driver_ = nullptr;
  bool on_cuda_ = false;
  size_t free_at_start_ = 0;
};

TEST_F(PoolTest, AllocatesAlignedDistinctBlocks) {
  auto pool = MakePool();
  void* a = Alloc(*pool, 100);
  void* b = Alloc(*pool, 3 * kMiB);
  void* c = Alloc(*pool, 0);
  EXPECT_NE(a, b);
  EXPECT_NE(a, c);
  for (void* p : {a, b, c}) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 512, 0u);
    EXPECT_TRUE(pool->Contains(p));
  }
  PoolStats s = pool->GetStats();
  EXPECT_EQ(s.allocation.current, 3);
  EXPECT_EQ(s.requested_bytes.current, 100 + 3 * static_cast<int64_t>(kMiB));
  EXPECT_EQ(s.allocated_bytes.current, 512 + 3 * static_cast<int64_t>(kMiB) + 512);
  for (void* p : {a, b, c}) ASSERT_TRUE(pool->Free(p).ok());
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
}

TEST_F(PoolTest, CachedReuseMakesNoDriverCalls) {
  auto pool = MakePool();
  void* a = Alloc(*pool, 5 * kMiB);
  ASSERT_TRUE(pool->Free(a).ok());
  const PoolStats before = pool->GetStats();
  for (int i = 0; i < 100; ++i) {
    void* b = Alloc(*pool, 5 * kMiB);
    EXPECT_EQ(a, b);
    ASSERT_TRUE(pool->Free(b).ok());
  }
  const PoolStats after = pool->GetStats();
  EXPECT_EQ(after.driver_create, before.driver_create);
  EXPECT_EQ(after.driver_map, before.driver_map);
  EXPECT_EQ(after.driver_event, before.driver_event);
  EXPECT_EQ(after.num_device_alloc, before.num_device_alloc);
}

TEST_F(PoolTest, BestFitPicksTheSmallestBlockThatFits) {
  auto pool = MakePool();
  // Three large blocks separated by live ones, then freed: 8, 4 and 6 MiB holes.
  void* h8 = Alloc(*pool, 8 * kMiB);
  void* s1 = Alloc(*pool, 2 * kMiB);
  void* h4 = Alloc(*pool, 4 * kMiB);
  void* s2 = Alloc(*pool, 2 * kMiB);
  void* h6 = Alloc(*pool, 6 * kMiB);
  void* s3 = Alloc(*pool, 2 * kMiB);
  for (void* p : {h8, h4, h6}) ASSERT_TRUE(pool->Free(p).ok());
  EXPECT_EQ(Alloc(*pool, 5 * kMiB), h6);
  EXPECT_EQ(Alloc(*pool, 3 * kMiB), h4);
  EXPECT_EQ(Alloc(*pool, 7 * kMiB), h8);
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
  (void)s1, (void)s2, (void)s3;
}

TEST_F(PoolTest, SplitsAndCoalescesAcrossChunkBoundaries) {
  auto pool = MakePool();
  // Two growths give two adjacent chunks.
  void* a = Alloc(*pool, 4 * kMiB);
  void* b = Alloc(*pool, 6 * kMiB);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b), reinterpret_cast<uintptr_t>(a) + 4 * kMiB);
  EXPECT_EQ(pool->GetStats().segment.current, 2);
  ASSERT_TRUE(pool->Free(a).ok());
  ASSERT_TRUE(pool->Free(b).ok());
  PoolStats s = pool->GetStats();
  EXPECT_EQ(s.inactive_split.current, 1);
  EXPECT_EQ(s.largest_free_block, static_cast<int64_t>(10 * kMiB));
  EXPECT_EQ(s.fragmentation, 0.0);
  // A block larger than either chunk fits in the coalesced space without growing.
  const int64_t growths = s.num_device_alloc;
  void* c = Alloc(*pool, 9 * kMiB);
  EXPECT_EQ(c, a);
  EXPECT_EQ(pool->GetStats().num_device_alloc, growths);
  Snapshot snap = pool->GetSnapshot();
  ASSERT_EQ(snap.segments.size(), 1u);
  EXPECT_EQ(snap.segments[0].chunks.size(), 2u);
  ASSERT_EQ(snap.segments[0].blocks.size(), 2u);
  EXPECT_EQ(snap.segments[0].blocks[0].state, BlockState::kAllocated);
  EXPECT_EQ(snap.segments[0].blocks[1].state, BlockState::kFree);
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
}

TEST_F(PoolTest, GrowthExtendsTheFreeBlockAtTheEdge) {
  auto pool = MakePool();
  void* a = Alloc(*pool, 10 * kMiB);
  ASSERT_TRUE(pool->Free(a).ok());
  void* b = Alloc(*pool, 30 * kMiB);
  EXPECT_EQ(a, b);
  // 10 MiB cached + 20 MiB new: exactly what is needed.
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, static_cast<int64_t>(30 * kMiB));
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
}

TEST_F(PoolTest, GrowthIsRaisedToAFractionOfTheReservedBytes) {
  PoolOptions options = SingleChunkOptions();
  options.growth_fraction = 0.5;
  options.max_growth_extra = 8 * kMiB;
  auto pool = MakePool(options);
  void* a = Alloc(*pool, 10 * kMiB);  // nothing reserved yet: exactly 10 MiB
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, static_cast<int64_t>(10 * kMiB));
  void* b = Alloc(*pool, 10 * kMiB);  // + 10 MiB needed + min(8 MiB, 0.5 * 10 MiB) rounded
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, static_cast<int64_t>(24 * kMiB));
  void* c = Alloc(*pool, 30 * kMiB);  // + 30 MiB - the 4 MiB cached + min(8 MiB, 12 MiB)
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, static_cast<int64_t>(58 * kMiB));
  const int64_t growths = pool->GetStats().num_device_alloc;
  void* d = Alloc(*pool, 8 * kMiB);  // the extra is cached: no growth
  EXPECT_EQ(pool->GetStats().num_device_alloc, growths);
  for (void* p : {a, b, c, d}) ASSERT_TRUE(pool->Free(p).ok());
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
}

TEST_F(PoolTest, SmallRequestsUseTheSmallArena) {
  auto pool = MakePool();
  void* big = Alloc(*pool, 4 * kMiB);
  std::vector<void*> small;
  for (int i = 0; i < 64; ++i) small.push_back(Alloc(*pool, 8192));
  // 64 small blocks share one small chunk, below the large block's range.
  PoolStats s = pool->GetStats();
  EXPECT_EQ(s.reserved_bytes.current, static_cast<int64_t>(4 * kMiB + 2 * kMiB));
  for (void* p : small) EXPECT_LT(p, big);
  for (void* p : small) ASSERT_TRUE(pool->Free(p).ok());
  ASSERT_TRUE(pool->Free(big).ok());
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
}

TEST_F(PoolTest, EmptyCacheReturnsAllMemoryToTheDriver) {
  auto pool = MakePool();
  std::vector<void*> blocks;
  for (size_t size : {kMiB / 2, 3 * kMiB, 17 * kMiB, 64 * kMiB}) {
    blocks.push_back(Alloc(*pool, size));
  }
  void* keep = Alloc(*pool, 5 * kMiB);
  for (void* p : blocks) ASSERT_TRUE(pool->Free(p).ok());
  ASSERT_TRUE(pool->EmptyCache().ok());
  PoolStats s = pool->GetStats();
  EXPECT_EQ(s.reserved_bytes.current, static_cast<int64_t>(6 * kMiB));  // keep's rounded chunk
  EXPECT_GT(s.num_device_free, 0);
  ASSERT_TRUE(pool->Free(keep).ok());
  ASSERT_TRUE(pool->EmptyCache().ok());
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, 0);
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
  pool.reset();
  EXPECT_EQ(DeviceFree(), free_at_start_);
}

TEST_F(PoolTest, DestroyingThePoolReturnsMemoryEvenWithLiveBlocks) {
  auto pool = MakePool();
  Alloc(*pool, 40 * kMiB);
  Alloc(*pool, 1000);
  EXPECT_LT(DeviceFree(), free_at_start_);
  pool.reset();
  EXPECT_EQ(DeviceFree(), free_at_start_);
}

TEST_F(PoolTest, OutOfMemoryIsACleanErrorAndThePoolStaysUsable) {
  if (on_cuda_) GTEST_SKIP() << "uses the host backend's small capacity";
  auto pool = MakePool();
  void* a = Alloc(*pool, 100 * kMiB);
  auto huge = pool->Allocate(200 * kMiB, 0);
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(huge.status().message(), HasSubstr("requested 209715200 bytes"));
  EXPECT_THAT(huge.status().message(), HasSubstr("reserved"));
  PoolStats s = pool->GetStats();
  EXPECT_EQ(s.num_ooms, 1);
  EXPECT_EQ(s.num_alloc_retries, 1);
  void* b = Alloc(*pool, 100 * kMiB);
  EXPECT_NE(b, nullptr);
  ASSERT_TRUE(pool->Free(a).ok());
  ASSERT_TRUE(pool->Free(b).ok());
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
}

TEST_F(PoolTest, TrimsTheCacheThenRetriesBeforeFailing) {
  if (on_cuda_) GTEST_SKIP() << "uses the host backend's small capacity";
  auto pool = MakePool();
  // 150 MiB cached in its own chunk, 4 MiB live after it: a 200 MiB request cannot extend the
  // cached block (the live one is in the way), so the cache must be released first.
  void* a = Alloc(*pool, 150 * kMiB);
  void* pin = Alloc(*pool, 4 * kMiB);
  ASSERT_TRUE(pool->Free(a).ok());
  auto c = pool->Allocate(200 * kMiB, 0);
  ASSERT_TRUE(c.ok()) << c.status();
  PoolStats s = pool->GetStats();
  EXPECT_EQ(s.num_alloc_retries, 1);
  EXPECT_EQ(s.num_ooms, 0);
  EXPECT_EQ(s.reserved_bytes.current, static_cast<int64_t>(204 * kMiB));
  ASSERT_TRUE(pool->Free(*c).ok());
  ASSERT_TRUE(pool->Free(pin).ok());
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
}

// The handle-type probe needs one granule: on a full device it learns nothing, and the pool
// must not be made with a type chosen from that (it would stay unshareable for good).
TEST_F(PoolTest, CreationOnAFullDeviceFailsRatherThanChoosingNoSharing) {
  if (on_cuda_) GTEST_SKIP() << "fills the host backend's small capacity";
  ASSERT_OK_AND_ASSIGN(PhysHandle filler, driver_->Create(0, DeviceFree(), 0));
  for (HandleRequest request :
       {HandleRequest::kAuto, HandleRequest::kPosixFd, HandleRequest::kFabric}) {
    PoolOptions options = Exact();
    options.reserve_size = 64 * kMiB;
    options.handle_type = request;
    EXPECT_THAT(Pool::Create(driver_, options),
                StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("out of memory")));
  }
  PoolOptions none = Exact();
  none.reserve_size = 64 * kMiB;
  none.handle_type = HandleRequest::kNone;
  EXPECT_OK(Pool::Create(driver_, none)) << "no probe, nothing to learn";
  ASSERT_OK(driver_->Release(filler));
  // Once memory is free the same request resolves to a shareable type.
  auto pool = MakePool();
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->handle_type(), HandleType::kFabric);
}

// A request no state of the pool could serve is refused before the cache is trimmed or
// anything is reserved or mapped, and counts in num_ooms, as in PyTorch: bad input past the
// GPU's whole memory; out of memory in this pool past what a range that does not grow
// holds (its large arena) but within the GPU's memory, which only a GPU shows here.
TEST_F(PoolTest, ARequestNoDeviceCouldHoldIsInvalidAndTouchesNothing) {
  auto pool = MakePool();  // 1 GiB of address range
  void* cached = Alloc(*pool, 8 * kMiB);
  ASSERT_OK(pool->Free(cached));
  const int64_t reserved = pool->GetStats().reserved_bytes.current;
  std::vector<size_t> invalid = {size_t{1} << 47, (size_t{1} << 47) + 1, SIZE_MAX};
  std::vector<size_t> past_range;
  if (on_cuda_) {
    past_range = {2048 * kMiB, 1024 * kMiB - kMiB};  // the latter inside the range
  } else {
    invalid.push_back(2048 * kMiB);
    invalid.push_back(512 * kMiB);  // inside the range, past the 256 MiB device
  }
  for (size_t size : invalid) {
    SCOPED_TRACE(size);
    EXPECT_THAT(pool->Allocate(size, 0),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("more than")));
    EXPECT_THAT(pool->AllocateShareable(size, 0), StatusIs(absl::StatusCode::kInvalidArgument));
  }
  for (size_t size : past_range) {
    SCOPED_TRACE(size);
    EXPECT_THAT(pool->Allocate(size, 0), StatusIs(absl::StatusCode::kResourceExhausted,
                                                  HasSubstr("address range holds")));
    EXPECT_THAT(pool->AllocateShareable(size, 0),
                StatusIs(absl::StatusCode::kResourceExhausted));
  }
  EXPECT_THAT(CheckRequestSize(size_t{1} << 47), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_OK(CheckRequestSize((size_t{1} << 47) - 1));
  PoolStats s = pool->GetStats();
  EXPECT_EQ(s.num_ooms, static_cast<int64_t>(2 * (invalid.size() + past_range.size())));
  EXPECT_EQ(s.num_alloc_retries, 0);
  EXPECT_EQ(s.reserved_bytes.current, reserved) << "the cache was trimmed for it";
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
}

TEST_F(PoolTest, MemoryLimitBoundsTheReservedBytes) {
  PoolOptions options = Exact();
  options.memory_limit = 32 * kMiB;
  auto pool = MakePool(options);
  void* a = Alloc(*pool, 30 * kMiB);
  auto b = pool->Allocate(4 * kMiB, 0);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(b.status().message(), HasSubstr("memory limit"));
  pool->SetMemoryLimit(0);
  void* c = Alloc(*pool, 4 * kMiB);
  for (void* p : {a, c}) ASSERT_TRUE(pool->Free(p).ok());
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
}

TEST_F(PoolTest, FailedGrowthRollsBackCleanly) {
  if (on_cuda_) GTEST_SKIP() << "uses the host backend's small capacity";
  PoolOptions options = Exact();
  options.max_chunk = 2 * kMiB;  // many pieces per growth, so a late one fails
  auto pool = MakePool(options);
  void* a = Alloc(*pool, 250 * kMiB);
  const PoolStats before = pool->GetStats();
  const size_t free_before = DeviceFree();
  // 6 MiB of capacity is left: the fourth 2 MiB piece of this growth fails.
  auto b = pool->Allocate(8 * kMiB, 0);
  ASSERT_FALSE(b.ok());
  PoolStats after = pool->GetStats();
  EXPECT_EQ(after.reserved_bytes.current, before.reserved_bytes.current);
  EXPECT_GT(after.driver_release, before.driver_release);  // the pieces made were released
  EXPECT_EQ(DeviceFree(), free_before);
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
  void* c = Alloc(*pool, 4 * kMiB);
  EXPECT_NE(c, nullptr);
  ASSERT_TRUE(pool->Free(a).ok());
  ASSERT_TRUE(pool->Free(c).ok());
}

TEST_F(PoolTest, RejectsForeignAndDoubleFrees) {
  auto pool = MakePool();
  void* a = Alloc(*pool, 4096);
  int local = 0;
  EXPECT_EQ(pool->Free(&local).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(pool->Free(a).ok());
  absl::Status again = pool->Free(a);
  EXPECT_EQ(again.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(again.message(), HasSubstr("double free"));
  EXPECT_EQ(pool->RecordStream(a, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool->Export(a).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
}

TEST_F(PoolTest, RejectsBadOptions) {
  PoolOptions bad_device;
  bad_device.device = 7;
  EXPECT_EQ(Pool::Create(driver_, bad_device).status().code(),
            absl::StatusCode::kInvalidArgument);
  PoolOptions bad_peer;
  bad_peer.peer_devices = {0};
  EXPECT_EQ(Pool::Create(driver_, bad_peer).status().code(), absl::StatusCode::kInvalidArgument);
  PoolOptions bad_growth;
  bad_growth.growth_fraction = 2;
  EXPECT_EQ(Pool::Create(driver_, bad_growth).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Pool::Create(nullptr, {}).status().code(), absl::StatusCode::kInvalidArgument);
  // Sizes the pool rounds up to its granularity: near 2^64 they wrapped to 0 (a small_chunk
  // of 0 taken silently, a reserve "of size 0" refused by the driver). Named, and refused
  // (ParsePoolOptions refuses them too; a C++ caller may set the fields).
  for (auto [name, field] : {std::pair<const char*, size_t PoolOptions::*>{
                                 "small_chunk", &PoolOptions::small_chunk},
                             {"reserve_size", &PoolOptions::reserve_size}}) {
    for (size_t value : {SIZE_MAX, (size_t{1} << 48) + 1}) {
      SCOPED_TRACE(absl::StrCat(name, "=", value));
      PoolOptions huge;
      huge.*field = value;
      EXPECT_THAT(Pool::Create(driver_, huge).status(),
                  StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(name)));
    }
  }
}

// large_page and max_chunk are compared as the pool uses them, rounded to its granularity
// (large_page up, max_chunk down): at 2 MiB granules, 3 MiB each is a 4 MiB page, one
// physical chunk, above a 2 MiB max_chunk. (Compared as given, it was taken.)
TEST_F(PoolTest, APageAboveMaxChunkOnceRoundedIsRefused) {
  if (driver_->Granularity(0).value_or(0) != 2 * kMiB) GTEST_SKIP() << "needs 2 MiB granules";
  PoolOptions options;
  options.reserve_size = 1024 * kMiB;
  options.max_chunk = 3 * kMiB;
  options.large_page = 3 * kMiB;
  EXPECT_THAT(Pool::Create(driver_, options).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("large_page 4194304 is larger than max_chunk 2097152")));
  // Both within one page once rounded: taken, and no chunk is above max_chunk.
  options.max_chunk = 4 * kMiB;
  auto pool = MakePool(options);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->options().large_page, 4 * kMiB);
  EXPECT_EQ(pool->options().max_chunk, 4 * kMiB);
  void* p = Alloc(*pool, 20 * kMiB);
  for (const SegmentInfo& segment : pool->GetSnapshot().segments) {
    for (const ChunkInfo& chunk : segment.chunks) EXPECT_LE(chunk.size, 4 * kMiB);
  }
  ASSERT_TRUE(pool->Free(p).ok());
}

// Refuses to reserve more than `most` bytes of address space, as a driver or a process
// address space too small for the range asked for would.
// (`code`: the error it says so with; out of memory by default).
class NarrowRangeDriver : public ForwardingDriver {
 public:
  NarrowRangeDriver(Driver* inner, size_t most,
                    absl::StatusCode code = absl::StatusCode::kResourceExhausted)
      : ForwardingDriver(inner), most_(most), code_(code) {}
  absl::StatusOr<DevPtr> Reserve(size_t size, size_t alignment) override {
    ++reserves_;
    if (size > most_) {
      return absl::Status(code_, absl::StrCat("no ", size, " bytes of address space"));
    }
    return ForwardingDriver::Reserve(size, alignment);
  }
  int reserves() const { return reserves_; }

 private:
  size_t most_;
  absl::StatusCode code_;
  int reserves_ = 0;
};

// The default address range: kPagedRangeDevices times the GPU's memory where the large
// arena moves pages or may come to (pool_options.h reserve_size, pressure_page), twice in
// single chunks for good, and the GPU's
// memory for the small arena; kPagedRangeFallbackDevices times, then twice, where the driver
// refuses the larger range; an explicit reserve_size, or a range refused even at twice, is not
// retried.
TEST_F(PoolTest, TheDefaultRangeIsWideWherePagesMoveAndNarrowsWhereRefused) {
  ASSERT_OK_AND_ASSIGN(MemInfo info, driver_->GetMemInfo(0));
  ASSERT_OK_AND_ASSIGN(size_t granularity, driver_->Granularity(0));
  // The range for `multiple` times the GPU's memory, as the pool rounds it (each part to
  // granularity): the large arena that multiple but an eighth of twice the GPU's memory,
  // the small arena the GPU's memory (whatever the multiple: every small chunk the device
  // could hold fits it).
  auto range = [&](size_t multiple) {
    const size_t want = multiple * info.total;
    const size_t eighth = (2 * info.total / 8 + granularity - 1) / granularity * granularity;
    const size_t small = (info.total + granularity - 1) / granularity * granularity;
    return small + (want - eighth + granularity - 1) / granularity * granularity;
  };
  PoolOptions paged;  // Pool::Create's defaults: 4 MiB pages
  auto pool = CreatePoolOrFail(driver_, paged);  // (MakePool sets a range)
  ASSERT_NE(pool, nullptr);
  ASSERT_GT(pool->options().large_page, 0u);
  EXPECT_EQ(pool->GetSnapshot().reserved_size, range(kPagedRangeDevices));
  PoolOptions unpaged;
  unpaged.large_page = 0;  // pages once past half of its memory (pressure_page): wide
  pool = CreatePoolOrFail(driver_, unpaged);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->GetSnapshot().reserved_size, range(kPagedRangeDevices));
  unpaged.pressure_page = 0;  // single chunks for good: twice
  pool = CreatePoolOrFail(driver_, unpaged);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->GetSnapshot().reserved_size, range(2));
  pool.reset();

  NarrowRangeDriver fallback(driver_, range(kPagedRangeFallbackDevices));
  ASSERT_OK_AND_ASSIGN(pool, Pool::Create(&fallback, paged));
  EXPECT_EQ(pool->GetSnapshot().reserved_size, range(kPagedRangeFallbackDevices))
      << "the widest range was refused";
  EXPECT_EQ(fallback.reserves(), 2);
  pool.reset();
  NarrowRangeDriver narrow(driver_, range(2));
  ASSERT_OK_AND_ASSIGN(pool, Pool::Create(&narrow, paged));
  EXPECT_EQ(pool->GetSnapshot().reserved_size, range(2)) << "both wider ranges were refused";
  EXPECT_EQ(narrow.reserves(), 3);
  void* p = Alloc(*pool, 8 * kMiB);
  ASSERT_TRUE(pool->Free(p).ok());
  pool.reset();

  PoolOptions explicit_range = paged;
  explicit_range.reserve_size = range(4);
  NarrowRangeDriver refused(driver_, range(2));
  EXPECT_THAT(Pool::Create(&refused, explicit_range).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("address space")));
  EXPECT_EQ(refused.reserves(), 1) << "a range the caller chose is not narrowed";
  NarrowRangeDriver none(driver_, 0);
  EXPECT_THAT(Pool::Create(&none, paged).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("address space")));
  // 32, 8 and 2 times, then an eighth and a 64th of twice where at least kLeastGrowingRange.
  EXPECT_EQ(none.reserves(), 3 + (2 * info.total / 8 >= kLeastGrowingRange ? 1 : 0) +
                                 (2 * info.total / 64 >= kLeastGrowingRange ? 1 : 0));
  // Where even twice is refused (many pools took the address space), a range that grows
  // starts smaller and grows from there: the default one, and a chosen one that grows (the
  // plugin's private pools).
  NarrowRangeDriver short_of_space(driver_, range(2) - 1);
  ASSERT_OK_AND_ASSIGN(pool, Pool::Create(&short_of_space, paged));
  EXPECT_LE(pool->GetSnapshot().reserved_size, range(2) / 4);
  EXPECT_GE(pool->GetSnapshot().reserved_size, kLeastGrowingRange);
  EXPECT_EQ(short_of_space.reserves(), 4);
  p = Alloc(*pool, 8 * kMiB);
  ASSERT_TRUE(pool->Free(p).ok());
  pool.reset();
  PoolOptions growing = paged;
  growing.reserve_size = 2 * info.total;
  growing.range_grows = true;
  NarrowRangeDriver short_again(driver_, range(2) - 1);
  ASSERT_OK_AND_ASSIGN(pool, Pool::Create(&short_again, growing));
  EXPECT_LE(pool->GetSnapshot().reserved_size, range(2) / 4);
  EXPECT_EQ(short_again.reserves(), 2);
  pool.reset();
  // A driver that takes the size for invalid is asked for the narrower ranges too; any other
  // failure is the driver's, and is returned as it is.
  NarrowRangeDriver invalid(driver_, range(2), absl::StatusCode::kInvalidArgument);
  ASSERT_OK_AND_ASSIGN(pool, Pool::Create(&invalid, paged));
  EXPECT_EQ(pool->GetSnapshot().reserved_size, range(2));
  pool.reset();
  NarrowRangeDriver broken(driver_, range(2), absl::StatusCode::kInternal);
  EXPECT_THAT(Pool::Create(&broken, paged).status(),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("address space")));
  EXPECT_EQ(broken.reserves(), 1);
  // What is accepted does not depend on the range: small_size's bound is an eighth of twice
  // the GPU's memory with pages as without.
  const size_t small_arena = (2 * info.total / 8 + granularity - 1) / granularity * granularity;
  for (size_t page : {size_t{0}, 4 * kMiB}) {
    SCOPED_TRACE(absl::StrCat("large_page ", page));
    PoolOptions bound;
    bound.large_page = page;
    bound.small_size = small_arena;
    ASSERT_OK_AND_ASSIGN(pool, Pool::Create(driver_, bound));
    pool.reset();
    bound.small_size = small_arena + 1;
    EXPECT_THAT(Pool::Create(driver_, bound).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("small_size")));
  }
  ASSERT_OK_AND_ASSIGN(MemInfo after, driver_->GetMemInfo(0));
  EXPECT_EQ(after.free, free_at_start_) << "nothing is left held";
}

// Blocks of up to small_size may take most of the device: the default range gives the small
// arena the GPU's memory. (It was a quarter of it: 128 KiB blocks past 64 MiB of a 256 MiB
// device failed with "no gap" while three quarters of the device were free; bench/traces.py
// rl_phases with 4 layers, whose KV blocks are 128 KiB, failed so on a device three times
// its peak.)
TEST_F(PoolTest, SmallBlocksMayTakeMostOfTheDevice) {
  if (on_cuda_) GTEST_SKIP() << "fills the host backend's small capacity";
  for (size_t page : {size_t{0}, 4 * kMiB}) {
    SCOPED_TRACE(absl::StrCat("large_page ", page));
    PoolOptions options;
    options.large_page = page;
    auto pool = CreatePoolOrFail(driver_, options);
    ASSERT_NE(pool, nullptr);
    ASSERT_GE(pool->options().small_size, 128 * 1024u);
    std::vector<void*> blocks;
    for (size_t held = 0; held < 192 * kMiB; held += 128 * 1024) {
      absl::StatusOr<void*> p = pool->Allocate(128 * 1024, 0);
      ASSERT_OK(p.status()) << "with " << held / kMiB << " MiB held";
      ASSERT_TRUE(pool->InSmallArena(*p));
      blocks.push_back(*p);
    }
    for (void* p : blocks) ASSERT_OK(pool->Free(p));
    EXPECT_OK(pool->CheckInvariants());
  }
}

// Where the small arena's range is full and the large arena has room (a range given in the
// options, or a private pool's that does not grow: its small arena is an eighth of it), blocks
// of up to small_size spill into the large arena, as blocks just past small_size; before,
// they failed with "no gap" while most of the range was free. Freed small-arena space is
// used again first; past the large arena too, the error is a clean out-of-memory.
TEST_F(PoolTest, SmallBlocksSpillIntoTheLargeArenaOnceTheSmallRangeIsFull) {
  for (size_t page : {size_t{0}, 4 * kMiB}) {
  SCOPED_TRACE(absl::StrCat("large_page ", page));
  PoolOptions options = Exact();
  options.large_page = page;
  options.reserve_size = 64 * kMiB;  // a small arena of 8 MiB, a large one of 56
  auto pool = MakePool(options);
  ASSERT_NE(pool, nullptr);
  const size_t small = 128 * 1024;
  ASSERT_GE(pool->options().small_size, small);
  const size_t spill = (pool->options().small_size + 1 + 511) / 512 * 512;
  std::vector<void*> in_small;
  std::vector<void*> spilled;
  for (int i = 0; i < 96; ++i) {  // 12 MiB of 128 KiB blocks
    absl::StatusOr<void*> p = pool->Allocate(small, 0);
    ASSERT_OK(p.status()) << "block " << i;
    (pool->InSmallArena(*p) ? in_small : spilled).push_back(*p);
  }
  EXPECT_EQ(in_small.size(), 64u) << "the small arena's 8 MiB first";
  EXPECT_EQ(spilled.size(), 32u);
  PoolStats stats = pool->GetStats();
  EXPECT_EQ(stats.num_small_spills, 32);
  EXPECT_EQ(stats.num_ooms, 0);
  EXPECT_EQ(stats.allocated_bytes.current, static_cast<int64_t>(64 * small + 32 * spill));
  EXPECT_EQ(stats.requested_bytes.current, static_cast<int64_t>(96 * small));
  EXPECT_EQ(stats.arena[kLargeArena].requested_bytes.current, static_cast<int64_t>(32 * small));
  EXPECT_EQ(stats.arena[kLargeArena].allocation.current, 32);
  for (void* p : spilled) {
    ASSERT_OK_AND_ASSIGN(size_t asked, pool->BlockSize(p));
    EXPECT_EQ(asked, small) << "the request's size, as for any block";
  }
  EXPECT_OK(pool->CheckInvariants());

  // A freed small-arena block is used again before the large arena.
  ASSERT_OK(pool->Free(in_small.back()));
  in_small.back() = Alloc(*pool, small);
  EXPECT_TRUE(pool->InSmallArena(in_small.back()));
  EXPECT_EQ(pool->GetStats().num_small_spills, 32);

  // A freed spilled block is reused by the next spill (no growth), and a checkpoint restore
  // of it (AllocateAt with the size LiveBlocks gives) finds it in the large arena.
  const int64_t grown = pool->GetStats().num_device_alloc;
  ASSERT_OK(pool->Free(spilled.back()));
  spilled.back() = Alloc(*pool, 4096);
  EXPECT_FALSE(pool->InSmallArena(spilled.back()));
  EXPECT_EQ(pool->GetStats().num_device_alloc, grown);
  BlockInfo last;
  for (const BlockInfo& b : pool->LiveBlocks()) {
    if (b.addr == reinterpret_cast<uintptr_t>(spilled.back())) last = b;
  }
  ASSERT_EQ(last.size, spill);
  ASSERT_OK(pool->Free(spilled.back()));
  ASSERT_OK_AND_ASSIGN(spilled.back(), pool->AllocateAt(last.addr, last.size, 0));

  // Once the large arena is full too: out of memory, and the pool stays usable.
  absl::StatusOr<void*> p;
  while ((p = pool->Allocate(small, 0)).ok()) spilled.push_back(*p);
  EXPECT_THAT(p.status(), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("no gap")));
  EXPECT_THAT(p.status().message(), HasSubstr("small arena's range is full"));
  EXPECT_GE(spilled.size(), 32u + 20u) << "most of the large arena's 56 MiB spilled into";
  EXPECT_EQ(pool->GetStats().num_small_spills, static_cast<int64_t>(spilled.size()) + 1)
      << "blocks served (the one freed and spilled again above too), not requests that failed";
  EXPECT_OK(pool->CheckInvariants());
  ASSERT_OK(pool->Free(in_small.back()));
  in_small.back() = Alloc(*pool, small);
  EXPECT_TRUE(pool->InSmallArena(in_small.back()));

  for (void* q : in_small) ASSERT_OK(pool->Free(q));
  for (void* q : spilled) ASSERT_OK(pool->Free(q));
  EXPECT_OK(pool->CheckInvariants());
  ASSERT_OK(pool->EmptyCache());
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, 0);
  }
}

// Two streams taking turns with spilled blocks reuse their own, as with any large block: a
// spill that first reclaimed the other stream's frees merged its own free block with them,
// and the next turn found nothing of its own (an event not yet complete) and grew (a cut
// range grew to the whole device over 4,000 pairs, with 380 retries), with event calls at
// every turn.
TEST_F(PoolTest, TwoStreamsTakingTurnsWithSpilledBlocksReuseTheirOwn) {
  PoolOptions options = Exact();
  options.reserve_size = 64 * kMiB;  // a small arena of 8 MiB
  auto pool = MakePool(options);
  ASSERT_NE(pool, nullptr);
  std::vector<void*> fill;
  for (int i = 0; i < 64; ++i) fill.push_back(Alloc(*pool, 128 * 1024));
  Stream a = *driver_->CreateStream(0);
  Stream b = *driver_->CreateStream(0);
  // Each stream's first spill grows, both live at once, so that each stream has a spill of its
  // own cached before the turns. Taken in turns here, the second stream's first spill takes
  // the first one's free where the event its reclaim records is already complete (a host
  // stream's worker reaches it at once when idle; a GPU's often), the two share one block
  // until an event is not yet complete, and that turn's growth (the second stream's first,
  // legitimate) fell inside the turns below: 14 of 100 runs.
  void* first_a = Alloc(*pool, 4096, a);
  void* first_b = Alloc(*pool, 4096, b);
  ASSERT_OK(pool->Free(first_a));
  ASSERT_OK(pool->Free(first_b));
  const PoolStats before = pool->GetStats();
  for (int i = 0; i < 1000; ++i) {
    for (Stream s : {a, b}) {
      void* p = Alloc(*pool, 4096, s);
      ASSERT_FALSE(pool->InSmallArena(p));
      ASSERT_OK(pool->Free(p));
    }
  }
  const PoolStats after = pool->GetStats();
  EXPECT_EQ(after.num_device_alloc, before.num_device_alloc) << "no growth";
  EXPECT_EQ(after.num_alloc_retries, before.num_alloc_retries);
  EXPECT_EQ(after.driver_event, before.driver_event)
      << "no other stream reclaimed: each turn finds its own spill first";
  EXPECT_EQ(after.num_small_spills, before.num_small_spills + 2000);
  for (void* p : fill) ASSERT_OK(pool->Free(p));
  EXPECT_OK(pool->CheckInvariants());
  ASSERT_OK(driver_->SynchronizeStream(a));
  ASSERT_OK(driver_->SynchronizeStream(b));
  ASSERT_OK(driver_->DestroyStream(a));
  ASSERT_OK(driver_->DestroyStream(b));
}

// A spill that would grow the large arena first looks again at the small arena once other
// streams' frees there are known complete (the reclaim before any growth): here the small
// blocks another stream freed serve the request, with no new memory.
TEST_F(PoolTest, ASpillLooksAgainAtTheSmallArenaBeforeGrowing) {
  PoolOptions options = Exact();
  options.reserve_size = 64 * kMiB;  // a small arena of 8 MiB
  auto pool = MakePool(options);
  ASSERT_NE(pool, nullptr);
  Stream s = *driver_->CreateStream(0);
  Stream t = *driver_->CreateStream(0);
  std::vector<void*> small;
  for (int i = 0; i < 64; ++i) small.push_back(Alloc(*pool, 128 * 1024, s));
  for (void* q : small) ASSERT_OK(pool->Free(q));  // tagged s: t may not use them yet
  // A miss on t records an event on s (its frees' work); the block stays live, so that t has
  // nothing cached in the large arena. Once s is synchronised the event is complete.
  void* large = Alloc(*pool, 4 * kMiB, t);
  ASSERT_OK(driver_->SynchronizeStream(s));
  const PoolStats before = pool->GetStats();
  void* p = Alloc(*pool, 128 * 1024, t);
  EXPECT_TRUE(pool->InSmallArena(p));
  const PoolStats after = pool->GetStats();
  EXPECT_EQ(after.num_small_spills, 0);
  EXPECT_EQ(after.num_device_alloc, before.num_device_alloc) << "no growth";
  EXPECT_EQ(after.reserved_bytes.current, before.reserved_bytes.current);
  ASSERT_OK(pool->Free(p));
  ASSERT_OK(pool->Free(large));
  EXPECT_OK(pool->CheckInvariants());
  ASSERT_OK(driver_->SynchronizeStream(t));
  ASSERT_OK(driver_->DestroyStream(s));
  ASSERT_OK(driver_->DestroyStream(t));
}

// Short of memory rather than of range, a small request grows the small arena as before; where
// that fails, a cached block of the large arena that holds it as a spill serves it (a larger
// request would be served by that block: a smaller one must not fail).
TEST_F(PoolTest, ASmallRequestPastTheMemoryLimitSpillsIntoACachedLargeBlock) {
  PoolOptions options = Exact();
  options.reserve_size = 64 * kMiB;
  options.memory_limit = 6 * kMiB;
  auto pool = MakePool(options);
  ASSERT_NE(pool, nullptr);
  void* large = Alloc(*pool, 2 * kMiB + 512 * 1024);  // 4 MiB mapped, 1.5 MiB of it free
  std::vector<void*> small;
  for (int i = 0; i < 16; ++i) small.push_back(Alloc(*pool, 128 * 1024));  // the last 2 MiB
  EXPECT_EQ(pool->GetStats().num_small_spills, 0);
  absl::StatusOr<void*> p = pool->Allocate(128 * 1024, 0);
  ASSERT_OK(p.status());
  EXPECT_FALSE(pool->InSmallArena(*p));
  EXPECT_EQ(pool->GetStats().num_small_spills, 1);
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, static_cast<int64_t>(6 * kMiB));
  small.push_back(*p);
  for (void* q : small) ASSERT_OK(pool->Free(q));
  ASSERT_OK(pool->Free(large));
  EXPECT_OK(pool->CheckInvariants());
}

// A spill is for a small arena short of range, not of memory: past a memory limit a small
// request is out of memory as before where no cached large block holds it either.
TEST_F(PoolTest, NoSpillWhereTheSmallArenaIsShortOfMemoryRatherThanRange) {
  PoolOptions options = Exact();
  options.reserve_size = 64 * kMiB;
  options.memory_limit = 8 * kMiB;
  auto pool = MakePool(options);
  ASSERT_NE(pool, nullptr);
  void* large = Alloc(*pool, 6 * kMiB);
  std::vector<void*> small;
  absl::StatusOr<void*> p;
  while ((p = pool->Allocate(128 * 1024, 0)).ok()) small.push_back(*p);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted) << p.status();
  EXPECT_EQ(small.size(), 16u) << "one 2 MiB small chunk within the limit";
  EXPECT_EQ(pool->GetStats().num_small_spills, 0);
  for (void* q : small) EXPECT_TRUE(pool->InSmallArena(q));
  for (void* q : small) ASSERT_OK(pool->Free(q));
  ASSERT_OK(pool->Free(large));
  EXPECT_OK(pool->CheckInvariants());
}

// A spilled request whose small arena holds it once another stream's frees are known complete
// (the retry's synchronisation) is served there: blocks freed on a stream whose work is still
// queued fill the small arena, the large arena is full, and a request on another stream
// waits for the synchronisation rather than fail in the large arena.
TEST_F(PoolTest, ASpilledRequestGoesBackToTheSmallArenaAfterTheRetrysSynchronisation) {
  if (on_cuda_) GTEST_SKIP() << "holds a stream through a host function";
  PoolOptions options = Exact();
  options.reserve_size = 64 * kMiB;  // a small arena of 8 MiB, a large one of 56
  auto pool = MakePool(options);
  ASSERT_NE(pool, nullptr);
  Stream s = *driver_->CreateStream(0);
  Stream t = *driver_->CreateStream(0);
  void* large = Alloc(*pool, 56 * kMiB);  // the large arena's whole range
  std::vector<void*> small;
  for (int i = 0; i < 64; ++i) small.push_back(Alloc(*pool, 128 * 1024, s));
  void* got = nullptr;
  {
    StreamGate gate(driver_, s);  // s's work before the frees has not run
    for (void* q : small) ASSERT_OK(pool->Free(q));
    std::thread opener([&gate] {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      gate.Release();
    });
    absl::StatusOr<void*> p = pool->Allocate(128 * 1024, t);
    opener.join();
    ASSERT_OK(p.status());
    got = *p;
  }
  EXPECT_TRUE(pool->InSmallArena(got));
  EXPECT_EQ(pool->GetStats().num_small_spills, 0);
  EXPECT_EQ(pool->GetStats().num_alloc_retries, 1);
  ASSERT_OK(pool->Free(got));
  ASSERT_OK(pool->Free(large));
  EXPECT_OK(pool->CheckInvariants());
  ASSERT_OK(driver_->SynchronizeStream(s));
  ASSERT_OK(driver_->DestroyStream(s));
  ASSERT_OK(driver_->DestroyStream(t));
}

// A pool without pages switches to pressure_page pages once a growth would take it past half
// of what it may hold, and not before; pressure_page=0 keeps single chunks for good.
TEST_F(PoolTest, APoolWithoutPagesGrowsInPagesPastHalfOfWhatItMayHold) {
  for (size_t pressure : {kAutoSize, size_t{0}}) {
    SCOPED_TRACE(absl::StrCat("pressure_page ", pressure));
    PoolOptions options = Exact();
    options.pressure_page = pressure;
    options.memory_limit = 64 * kMiB;
    auto pool = MakePool(options);
    ASSERT_NE(pool, nullptr);
    EXPECT_EQ(pool->options().pressure_page, pressure == 0 ? 0 : 4 * kMiB);
    std::vector<void*> blocks;
    for (int i = 0; i < 4; ++i) blocks.push_back(Alloc(*pool, 8 * kMiB));  // 32 MiB: half
    EXPECT_EQ(pool->page(), 0u);
    EXPECT_EQ(pool->GetStats().segment.current, 4);
    blocks.push_back(Alloc(*pool, 8 * kMiB));  // past half
    const PoolStats stats = pool->GetStats();
    EXPECT_EQ(pool->page(), pressure == 0 ? 0 : 4 * kMiB);
    EXPECT_EQ(stats.num_page_switches, pressure == 0 ? 0 : 1);
    EXPECT_EQ(stats.segment.current, pressure == 0 ? 5 : 6);  // one chunk, or two pages
    EXPECT_EQ(stats.reserved_bytes.current, static_cast<int64_t>(40 * kMiB));
    for (void* p : blocks) ASSERT_OK(pool->Free(p));
    EXPECT_OK(pool->CheckInvariants());
  }
}

// After the switch a growth is at most kPressureGrowthChunks chunks of whole pages: a huge
// request is not thousands of pages (a block sent in place carries a handle per chunk).
TEST_F(PoolTest, AGrowthAfterTheSwitchIsAFewChunksOfPages) {
  Driver* driver = DriverOfAtLeast(4096 * kMiB);
  PoolOptions options = Exact();
  options.pressure_page = kAutoSize;
  options.memory_limit = 2048 * kMiB;
  options.reserve_size = 8192 * kMiB;
  auto pool = CreatePoolOrFail(driver, options);
  ASSERT_NE(pool, nullptr);
  void* p = Alloc(*pool, 1536 * kMiB);  // past half of the limit: switched
  EXPECT_EQ(pool->page(), 4 * kMiB);
  // 1.5 GiB in 4 MiB pages would be 384 chunks; in 32 MiB chunks it is 48, within 64.
  EXPECT_EQ(pool->GetStats().segment.current, 48);
  ASSERT_OK(pool->Free(p));
  EXPECT_OK(pool->CheckInvariants());
}

// A pool that keeps its memory moves nothing, so it keeps single chunks (pool_options.h
// pressure_page) until it no longer keeps it; a shareable block keeps a chunk of its own
// wherever the pool stands; pages given explicitly have nothing to switch to.
TEST_F(PoolTest, NoSwitchToPagesWhereNothingWouldMove) {
  PoolOptions options = Exact();
  options.pressure_page = kAutoSize;
  options.memory_limit = 64 * kMiB;
  auto kept = MakePool(options);
  ASSERT_NE(kept, nullptr);
  kept->SetKeepMemory(true);
  std::vector<void*> blocks;
  for (int i = 0; i < 6; ++i) blocks.push_back(Alloc(*kept, 8 * kMiB));
  EXPECT_EQ(kept->page(), 0u);
  EXPECT_EQ(kept->GetStats().num_page_switches, 0);
  kept->SetKeepMemory(false);
  blocks.push_back(Alloc(*kept, 8 * kMiB));
  EXPECT_EQ(kept->page(), 4 * kMiB);
  EXPECT_EQ(kept->GetStats().num_page_switches, 1);
  EXPECT_EQ(kept->GetStats().segment.current, 8);  // six chunks, then two pages
  for (void* p : blocks) ASSERT_OK(kept->Free(p));
  kept.reset();

  auto shares = MakePool(options);
  ASSERT_NE(shares, nullptr);
  ASSERT_OK_AND_ASSIGN(void* shared, shares->AllocateShareable(40 * kMiB, 0));
  EXPECT_EQ(shares->page(), 0u);
  EXPECT_EQ(shares->GetStats().segment.current, 1);
  ASSERT_OK(shares->Free(shared));
  shares.reset();

  options.large_page = 2 * kMiB;
  auto paged = MakePool(options);
  ASSERT_NE(paged, nullptr);
  EXPECT_EQ(paged->options().pressure_page, 0u);
  EXPECT_EQ(paged->page(), 2 * kMiB);
}

// A growth that fails (here for want of a gap in a small range, the pool far below half of
// its device) switches a pool without pages as well: the retry set it short of memory.
TEST_F(PoolTest, AFailedGrowthSwitchesAPoolWithoutPagesToPages) {
  PoolOptions options = Exact();
  options.pressure_page = kAutoSize;
  options.reserve_size = 64 * kMiB;  // a small arena of 8 MiB, a large one of 56
  auto pool = MakePool(options);
  ASSERT_NE(pool, nullptr);
  void* a = Alloc(*pool, 30 * kMiB);
  void* b = Alloc(*pool, 20 * kMiB);
  ASSERT_OK(pool->Free(a));
  EXPECT_THAT(pool->Allocate(40 * kMiB, 0),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("no gap")));
  EXPECT_EQ(pool->page(), 4 * kMiB) << "switched for the retry";
  EXPECT_EQ(pool->GetStats().num_page_switches, 1);
  const int64_t chunks = pool->GetStats().segment.current;
  void* c = Alloc(*pool, 8 * kMiB);
  EXPECT_EQ(pool->GetStats().segment.current, chunks + 2) << "two pages";
  ASSERT_OK(pool->Free(b));
  ASSERT_OK(pool->Free(c));
  EXPECT_OK(pool->CheckInvariants());
}

// pressure_page is checked as large_page is: given, at most max_chunk (before and after
// rounding to the granularity); by default a page of 4 MiB, or max_chunk where that is
// smaller; not used where the pool has pages.
TEST_F(PoolTest, PressurePageIsBoundedByMaxChunk) {
  PoolOptions options = Exact();
  options.max_chunk = 2 * kMiB;
  options.pressure_page = 4 * kMiB;
  EXPECT_THAT(Pool::Create(driver_, options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("pressure_page 4194304 is larger than max_chunk")));
  options.pressure_page = 3 * kMiB;  // 4 MiB once rounded
  options.max_chunk = 3 * kMiB;     // 2 MiB once rounded
  options.reserve_size = 64 * kMiB;
  EXPECT_THAT(Pool::Create(driver_, options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("once both are rounded")));
  options.pressure_page = kAutoSize;
  auto pool = MakePool(options);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->options().pressure_page, 2 * kMiB);
  options.large_page = 2 * kMiB;
  options.pressure_page = 64 * kMiB;  // past max_chunk, but not used
  pool = MakePool(options);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->options().pressure_page, 0u);
}

// Workspaces of 8-56 MiB replaced at random, at most five live, under a memory limit of 1.07
// times the most they can hold (bench/traces.py mixed_lifetimes' workspaces at a 32nd of
// their size). In single chunks for good (pressure_page=0) blocks that reuse part of what a
// freed one left, or that join a free neighbour in another chunk, pin chunk after chunk until
// a request finds no chunk wholly free to release: out of memory at some seeds, with more than
// the request free in the pool. Switched to pages past half of the limit, the free pages move
// to the request.
TEST_F(PoolTest, APoolWithoutPagesNearItsLimitServesRequestsItsFreeMemoryHolds) {
  Driver* driver = DriverOfAtLeast(512 * kMiB);
  constexpr int kSeeds = 8;
  int failed_single = 0;
  for (size_t pressure : {kAutoSize, size_t{0}}) {
    for (int seed = 0; seed < kSeeds; ++seed) {
      SCOPED_TRACE(absl::StrCat("pressure_page ", pressure, " seed ", seed));
      PoolOptions options = Exact();
      options.pressure_page = pressure;
      options.memory_limit = 300 * kMiB;
      options.reserve_size = 2048 * kMiB;
      auto pool = CreatePoolOrFail(driver, options);
      ASSERT_NE(pool, nullptr);
      std::mt19937_64 rng(seed);
      std::vector<void*> live;
      bool failed = false;
      for (int i = 0; i < 1000 && !failed; ++i) {
        if (live.size() == 5) {  // at most 5 * 56 MiB live with the request: 280 MiB
          const size_t k = rng() % live.size();
          ASSERT_OK(pool->Free(live[k]));
          live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
        }
        const size_t size = 8 * kMiB + rng() % (48 * kMiB + 1);
        absl::StatusOr<void*> p = pool->Allocate(size, 0);
        if (!p.ok()) {
          ASSERT_TRUE(absl::IsResourceExhausted(p.status())) << p.status();
          failed = true;
          if (pressure != 0) ADD_FAILURE() << "allocation " << i << ": " << p.status();
          break;
        }
        live.push_back(*p);
      }
      failed_single += failed && pressure == 0;
      for (void* p : live) ASSERT_OK(pool->Free(p));
      EXPECT_OK(pool->CheckInvariants());
      if (pressure != 0) {
        EXPECT_EQ(pool->GetStats().num_page_switches, 1);
      }
    }
  }
  // The workload is one that strands single chunks (else it would test nothing).
  EXPECT_GT(failed_single, 0);
}

// Records the sizes of address space asked for, and refuses any above 1 TiB without asking
// the driver (a process's address space holds less than what is tested here).
class RecordingRangeDriver : public ForwardingDriver {
 public:
  using ForwardingDriver::ForwardingDriver;
  absl::StatusOr<DevPtr> Reserve(size_t size, size_t alignment) override {
    asked_.push_back(size);
    if (size > (size_t{1} << 40)) return absl::ResourceExhaustedError("no such address space");
    return ForwardingDriver::Reserve(size, alignment);
  }
  const std::vector<size_t>& asked() const { return asked_; }

 private:
  std::vector<size_t> asked_;
};

// A device past what any address range holds (a hostile or broken driver): the default range
// is capped at 2^48 bytes, neither passed (2^61 bytes of memory: twice is 2^62) nor wrapped
// around to a small one (2^63 and more: twice, or eight times, wraps past 2^64), and the
// range refused (the smaller ones a range that grows asks for next included) is a clean
// out-of-memory error.
TEST(PoolRangeTest, TheDefaultRangeOfAHugeDeviceIsCappedNotWrapped) {
  for (size_t capacity : {size_t{1} << 61, (size_t{1} << 63) + (size_t{1} << 30)}) {
    HostDriverOptions options;
    options.capacity = capacity;
    std::unique_ptr<Driver> host = NewHostDriver(options);
    for (size_t page : {size_t{0}, 4 * kMiB}) {
      SCOPED_TRACE(absl::StrCat("capacity ", capacity, ", large_page ", page));
      RecordingRangeDriver driver(host.get());
      PoolOptions pool_options;
      pool_options.large_page = page;
      EXPECT_THAT(Pool::Create(&driver, pool_options).status(),
                  StatusIs(absl::StatusCode::kResourceExhausted));
      ASSERT_FALSE(driver.asked().empty());
      EXPECT_EQ(driver.asked().front(), kMaxOptionBytes);
      for (size_t asked : driver.asked()) EXPECT_LE(asked, kMaxOptionBytes);
    }
  }
}

// A range that no longer has a gap for a request grows after itself: by the large arena's
// first size, a reservation of its own that every growth, release and block may use, no call
// crossing from one reservation into the next, each given back whole. Where the driver gives
// no address space there, and for an explicit reserve_size, the request fails as before.
TEST_F(PoolTest, AFullRangeGrowsAfterItselfWhereTheDriverGivesAddressSpace) {
  SlackRangeDriver driver(driver_, 512 * kMiB);
  PoolOptions options = Exact();
  options.reserve_size = 64 * kMiB;  // a large arena of 56 MiB (the small one: the GPU's)
  options.range_grows = true;
  {
    auto pool = CreatePoolOrFail(&driver, options);
    ASSERT_NE(pool, nullptr);
    const size_t first = pool->GetSnapshot().reserved_size;
    const uintptr_t seam = pool->base() + first;
    void* a = Alloc(*pool, 40 * kMiB);
    void* b = Alloc(*pool, 30 * kMiB);  // 16 MiB of gap left: the range grows
    EXPECT_EQ(driver.reserve_ats(), 1);
    EXPECT_EQ(pool->GetStats().num_range_extensions, 1);
    EXPECT_EQ(pool->GetSnapshot().reserved_size, first + 56 * kMiB);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b), seam) << "in the new gap, not across the seam";
    EXPECT_TRUE(pool->Contains(reinterpret_cast<char*>(b) + 30 * kMiB - 1));
    EXPECT_TRUE(pool->Contains(reinterpret_cast<void*>(seam + 56 * kMiB - 1)));
    EXPECT_FALSE(pool->Contains(reinterpret_cast<void*>(seam + 56 * kMiB)));
    EXPECT_OK(pool->CheckInvariants());
    // Both freed, the gap between them joins them into a block that spans the seam.
    ASSERT_OK(pool->Free(a));
    ASSERT_OK(pool->Free(b));
    void* c = Alloc(*pool, 80 * kMiB);
    EXPECT_EQ(c, a);
    EXPECT_EQ(pool->GetStats().num_range_extensions, 1);
    EXPECT_OK(pool->CheckInvariants());
    if (!on_cuda_) {  // the host backend's memory is the process's: write across the seam
      std::memset(c, 0x5a, 80 * kMiB);
      EXPECT_EQ(static_cast<unsigned char*>(c)[80 * kMiB - 1], 0x5a);
    }
    ASSERT_OK(pool->Free(c));
    ASSERT_OK(pool->EmptyCache());  // releases on both sides, unmapped one side at a time
    EXPECT_EQ(pool->GetStats().reserved_bytes.current, 0);
    // Where the driver refuses, the request fails as before, and the pool goes on. The
    // refusal stands (neither the retry after trimming the cache nor the next miss asks
    // again) until EmptyCache.
    void* d = Alloc(*pool, 50 * kMiB);
    void* e = Alloc(*pool, 50 * kMiB);  // one in each reservation: 6 MiB of gap left in each
    EXPECT_EQ(reinterpret_cast<uintptr_t>(e), seam);
    driver.set_refuse(true);
    for (int i = 0; i < 2; ++i) {
      EXPECT_THAT(pool->Allocate(30 * kMiB, 0),
                  StatusIs(absl::StatusCode::kResourceExhausted,
                           HasSubstr("lengthening it was refused: the address space there is "
                                     "taken")));
      EXPECT_EQ(driver.reserve_ats(), 2);
    }
    driver.set_refuse(false);
    ASSERT_OK(pool->EmptyCache());
    void* f = Alloc(*pool, 30 * kMiB);
    EXPECT_EQ(driver.reserve_ats(), 3);
    EXPECT_EQ(pool->GetStats().num_range_extensions, 2);
    ASSERT_OK(pool->Free(d));
    ASSERT_OK(pool->Free(e));
    ASSERT_OK(pool->Free(f));
    EXPECT_OK(pool->CheckInvariants());
    EXPECT_EQ(driver.crossings(), 0);
  }
  EXPECT_EQ(driver.reservations(), 0u) << "every reservation given back";
  // An explicit range is a bound: no gap, no growth.
  options.range_grows = false;
  const int asked = driver.reserve_ats();
  {
    auto pool = CreatePoolOrFail(&driver, options);
    ASSERT_NE(pool, nullptr);
    void* a = Alloc(*pool, 40 * kMiB);
    EXPECT_THAT(pool->Allocate(30 * kMiB, 0),
                StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("no gap")));
    EXPECT_EQ(driver.reserve_ats(), asked);
    ASSERT_OK(pool->Free(a));
  }
  // The default range grows (twice a 32 MiB device in single chunks: a 56 MiB large arena).
  SlackRangeDriver small_device(driver_, 512 * kMiB, 32 * kMiB);
  PoolOptions defaults;
  defaults.large_page = 0;
  defaults.pressure_page = 0;
  {
    auto pool = CreatePoolOrFail(&small_device, defaults);
    ASSERT_NE(pool, nullptr);
    void* a = Alloc(*pool, 30 * kMiB);
    void* b = Alloc(*pool, 30 * kMiB);
    EXPECT_EQ(pool->GetStats().num_range_extensions, 1);
    ASSERT_OK(pool->Free(a));
    ASSERT_OK(pool->Free(b));
    EXPECT_OK(pool->CheckInvariants());
  }
  EXPECT_EQ(small_device.crossings(), 0);
  EXPECT_EQ(small_device.reservations(), 0u);
  ASSERT_OK_AND_ASSIGN(MemInfo after, driver_->GetMemInfo(0));
  EXPECT_EQ(after.free, free_at_start_) << "nothing is left held";
}

// Sizes that leave an arena unable to serve what it is sent are refused, naming the option
// and its bound. A 1 GiB range gives the small arena 128 MiB (an eighth) and allows a
// small_chunk of up to 512 MiB (half). (A small_chunk of 64 GiB made the small arena the
// whole range and the large one a granule; a small_size of 4 GiB sent every request to the
// small arena: every request it could not hold failed as out of memory on an empty device.)
TEST_F(PoolTest, SizeOptionsThatLeaveAnArenaUnableToServeAreRefused) {
  PoolOptions options = Exact();
  options.reserve_size = 1024 * kMiB;
  for (size_t chunk : {size_t{64} << 30, 514 * kMiB}) {
    SCOPED_TRACE(absl::StrCat("small_chunk ", chunk));
    PoolOptions huge_chunk = options;
    huge_chunk.small_chunk = chunk;
    EXPECT_THAT(Pool::Create(driver_, huge_chunk).status(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("is more than half of the pool's reserved range, 536870912")));
  }
  for (size_t size : {size_t{4} << 30, 129 * kMiB}) {
    SCOPED_TRACE(absl::StrCat("small_size ", size));
    PoolOptions huge_size = options;
    huge_size.small_size = size;
    EXPECT_THAT(Pool::Create(driver_, huge_size).status(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("small_size " + std::to_string(size) +
                                   " is more than the small arena's least range, 134217728")));
  }
  // At the bounds: each arena serves what it is sent.
  PoolOptions chunk_at_bound = options;
  chunk_at_bound.small_chunk = 512 * kMiB;  // the small arena 512 MiB, the large one too
  auto pool = MakePool(chunk_at_bound);
  ASSERT_NE(pool, nullptr);
  void* p = Alloc(*pool, 100 * kMiB);
  EXPECT_EQ(pool->GetStats().arena[kLargeArena].allocated_bytes.current,
            static_cast<int64_t>(100 * kMiB));
  ASSERT_TRUE(pool->Free(p).ok());
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
  PoolOptions size_at_bound = options;
  size_at_bound.small_size = 128 * kMiB;
  pool = MakePool(size_at_bound);
  ASSERT_NE(pool, nullptr);
  p = Alloc(*pool, 100 * kMiB);
  EXPECT_EQ(pool->GetStats().arena[kSmallArena].allocated_bytes.current,
            static_cast<int64_t>(100 * kMiB));
  ASSERT_TRUE(pool->Free(p).ok());
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
}

// A release threshold past 2^63 - 1 keeps everything, as SIZE_MAX does: compared with signed
// byte counts it read as negative, and every free released the whole cache.
TEST_F(PoolTest, AHugeReleaseThresholdKeepsTheCache) {
  PoolOptions options = SingleChunkOptions();
  options.release_threshold = (size_t{1} << 63) + 5;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Pool> pool, Pool::Create(driver_, options));
  ASSERT_OK_AND_ASSIGN(void* p, pool->Allocate(4 * kMiB, 0));
  const int64_t reserved = pool->GetStats().reserved_bytes.current;
  ASSERT_OK(pool->Free(p));
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, reserved);
  EXPECT_EQ(pool->options().release_threshold, SIZE_MAX);
  EXPECT_OK(pool->CheckInvariants());
}

TEST(HandleNamesTest, ParseTheNamesTheyPrint) {
  for (HandleType type : {HandleType::kNone, HandleType::kPosixFd, HandleType::kFabric}) {
    EXPECT_EQ(ParseHandleType(HandleTypeName(type)), type);
  }
  EXPECT_EQ(ParseHandleRequest("auto"), HandleRequest::kAuto);
  EXPECT_EQ(ParseHandleRequest("none"), HandleRequest::kNone);
  EXPECT_EQ(ParseHandleRequest("posix_fd"), HandleRequest::kPosixFd);
  EXPECT_EQ(ParseHandleRequest("fabric"), HandleRequest::kFabric);
  for (const char* bad : {"", "Fabric", "auto ", "posix-fd", "unknown"}) {
    EXPECT_FALSE(ParseHandleType(bad).has_value()) << bad;
    EXPECT_FALSE(ParseHandleRequest(bad).has_value()) << bad;
  }
}

TEST_F(PoolTest, StatsTrackCurrentPeakAndTotals) {
  auto pool = MakePool();
  void* a = Alloc(*pool, 3 * kMiB);
  void* b = Alloc(*pool, 5 * kMiB);
  ASSERT_TRUE(pool->Free(a).ok());
  PoolStats s = pool->GetStats();
  EXPECT_EQ(s.allocated_bytes.current, static_cast<int64_t>(5 * kMiB));
  EXPECT_EQ(s.allocated_bytes.peak, static_cast<int64_t>(8 * kMiB));
  EXPECT_EQ(s.allocated_bytes.allocated, static_cast<int64_t>(8 * kMiB));
  EXPECT_EQ(s.allocated_bytes.freed, static_cast<int64_t>(3 * kMiB));
  EXPECT_EQ(s.allocation.peak, 2);
  EXPECT_EQ(s.inactive_split_bytes.current, static_cast<int64_t>(3 * kMiB));
  pool->ResetPeakStats();
  EXPECT_EQ(pool->GetStats().allocated_bytes.peak, static_cast<int64_t>(5 * kMiB));
  pool->ResetAccumulatedStats();
  EXPECT_EQ(pool->GetStats().allocated_bytes.allocated, 0);
  EXPECT_EQ(pool->GetStats().num_device_alloc, 0);
  ASSERT_TRUE(pool->Free(b).ok());
}

TEST_F(PoolTest, StatsAreSplitByArenaAsPyTorchsSmallAndLargePools) {
  auto pool = MakePool();
  void* small = Alloc(*pool, 4096);
  void* large = Alloc(*pool, 4 * kMiB);
  void* gone = Alloc(*pool, 100 * 1024);
  ASSERT_TRUE(pool->Free(gone).ok());
  PoolStats s = pool->GetStats();
  const ArenaStats& sm = s.arena[kSmallArena];
  const ArenaStats& lg = s.arena[kLargeArena];
  EXPECT_EQ(sm.allocation.current, 1);
  EXPECT_EQ(sm.allocation.allocated, 2);
  EXPECT_EQ(sm.allocated_bytes.current, 4096);
  EXPECT_EQ(sm.requested_bytes.current, 4096);
  EXPECT_EQ(sm.allocated_bytes.peak, 4096 + 100 * 1024);
  EXPECT_EQ(lg.allocation.current, 1);
  EXPECT_EQ(lg.allocated_bytes.current, static_cast<int64_t>(4 * kMiB));
  EXPECT_GE(sm.segment.current, 1);
  EXPECT_GE(lg.segment.current, 1);
  EXPECT_GE(sm.inactive_split_bytes.current, 100 * 1024);
  // Cached blocks are counted as they come and go: allocated - freed is what is cached.
  for (const Stat* inactive : std::initializer_list<const Stat*>{
           &s.inactive_split, &s.inactive_split_bytes, &sm.inactive_split_bytes,
           &lg.inactive_split_bytes}) {
    EXPECT_EQ(inactive->allocated - inactive->freed, inactive->current);
    EXPECT_GE(inactive->peak, inactive->current);
    EXPECT_GT(inactive->freed, 0);
  }
  // The pool's figures are the arenas' together (peaks need not be).
#define VMM_EXPECT_SUM(name)                                                      \
  EXPECT_EQ(s.name.current, sm.name.current + lg.name.current) << #name;          \
  EXPECT_EQ(s.name.allocated, sm.name.allocated + lg.name.allocated) << #name;    \
  EXPECT_EQ(s.name.freed, sm.name.freed + lg.name.freed) << #name;
  VMM_TORCH_STATS(VMM_EXPECT_SUM)
#undef VMM_EXPECT_SUM

  // A small block freed while another stream still uses it is active in the small arena.
  Stream t = *driver_->CreateStream(0);
  {
    StreamGate gate(driver_, t);
    ASSERT_TRUE(pool->RecordStream(small, t).ok());
    ASSERT_TRUE(pool->Free(small).ok());
    PoolStats pending = pool->GetStats();
    EXPECT_EQ(pending.arena[kSmallArena].active_bytes.current, 4096);
    EXPECT_EQ(pending.arena[kSmallArena].active.current, 1);
    EXPECT_EQ(pending.arena[kSmallArena].allocated_bytes.current, 0);
    EXPECT_EQ(pending.arena[kLargeArena].active_bytes.current,
              static_cast<int64_t>(4 * kMiB));
    pool->ResetPeakStats();
    pool->ResetAccumulatedStats();
    PoolStats reset = pool->GetStats();
    EXPECT_EQ(reset.arena[kSmallArena].active_bytes.peak, 4096);
    EXPECT_EQ(reset.arena[kSmallArena].allocated_bytes.peak, 0);
    EXPECT_EQ(reset.arena[kSmallArena].allocated_bytes.allocated, 0);
    EXPECT_EQ(reset.arena[kLargeArena].allocated_bytes.peak, static_cast<int64_t>(4 * kMiB));
    EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
  }
  ASSERT_TRUE(driver_->SynchronizeStream(t).ok());
  ASSERT_TRUE(pool->Free(large).ok());
  ASSERT_TRUE(pool->EmptyCache().ok());
  PoolStats empty = pool->GetStats();
  EXPECT_EQ(empty.arena[kSmallArena].active.current, 0);
  EXPECT_EQ(empty.arena[kSmallArena].reserved_bytes.current, 0);
  EXPECT_EQ(empty.arena[kLargeArena].reserved_bytes.current, 0);
  EXPECT_EQ(empty.arena[kSmallArena].active_bytes.freed, 4096)
      << "the pending block, since the reset";
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
  ASSERT_TRUE(driver_->DestroyStream(t).ok());
}

// --- Streams --------------------------------------------------------------------------------

TEST_F(PoolTest, BlockFreedOnAStreamIsReusedOnItAtOnce) {
  auto pool = MakePool();
  Stream s = *driver_->CreateStream(0);
  {
    StreamGate gate(driver_, s);  // s has work queued that has not run
    void* a = Alloc(*pool, 4 * kMiB, s);
    ASSERT_TRUE(pool->Free(a).ok());
    EXPECT_EQ(Alloc(*pool, 4 * kMiB, s), a);  // same stream: no wait needed
    ASSERT_TRUE(pool->Free(a).ok());
  }
  ASSERT_TRUE(driver_->SynchronizeStream(s).ok());
  ASSERT_TRUE(driver_->DestroyStream(s).ok());
}

TEST_F(PoolTest, OtherStreamsWaitForTheFreeingStreamsWork) {
  auto pool = MakePool();
  Stream s = *driver_->CreateStream(0);
  Stream t = *driver_->CreateStream(0);
  void* a = nullptr;
  {
    StreamGate gate(driver_, s);
    a = Alloc(*pool, 4 * kMiB, s);
    ASSERT_TRUE(pool->Free(a).ok());
    // s's work before the free has not completed: t must not get the block.
    void* b = Alloc(*pool, 4 * kMiB, t);
    EXPECT_NE(b, a);
    ASSERT_TRUE(pool->Free(b).ok());
    gate.Release();
    ASSERT_TRUE(driver_->SynchronizeStream(s).ok());
  }
  // Now it has: t may take a's memory (no growth needed).
  const int64_t growths = pool->GetStats().num_device_alloc;
  void* c = Alloc(*pool, 8 * kMiB, t);
  EXPECT_EQ(pool->GetStats().num_device_alloc, growths);
  EXPECT_TRUE(c == a || reinterpret_cast<uintptr_t>(c) + 4 * kMiB == reinterpret_cast<uintptr_t>(a))
      << "the two 4 MiB blocks coalesce once both are usable by t";
  ASSERT_TRUE(pool->Free(c).ok());
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
  ASSERT_TRUE(driver_->DestroyStream(s).ok());
  ASSERT_TRUE(driver_->DestroyStream(t).ok());
}

// Free blocks of s and blocks every stream may use (t's, once t is done) side by side: a
// request of s that their run fits is served from it, whichever block of s the pool looks at
// first. (With s's 4 MiB block first, its retagged neighbour merged it through to the 16 MiB
// block, and the block above that was left: the request grew the pool.)
TEST_F(PoolTest, ACachedRunThatFitsIsServedWithoutGrowing) {
  auto pool = MakePool();
  Stream s = *driver_->CreateStream(0);
  Stream t = *driver_->CreateStream(0);
  void* b1 = Alloc(*pool, 4 * kMiB, s);
  void* b2 = Alloc(*pool, 8 * kMiB, t);
  void* b3 = Alloc(*pool, 16 * kMiB, s);
  void* b4 = Alloc(*pool, 32 * kMiB, t);
  // More blocks of t elsewhere than of s, between live ones.
  std::vector<void*> live = {Alloc(*pool, 4 * kMiB, s)};
  void* x = Alloc(*pool, 4 * kMiB, t);
  live.push_back(Alloc(*pool, 4 * kMiB, s));
  void* y = Alloc(*pool, 4 * kMiB, t);
  live.push_back(Alloc(*pool, 4 * kMiB, s));
  {
    StreamGate gate(driver_, t);
    for (void* p : {b1, b2, b3, b4, x, y}) ASSERT_TRUE(pool->Free(p).ok());
    // A miss of s waits for t's work (an event behind it): t's blocks keep their tag.
    live.push_back(Alloc(*pool, 20 * kMiB, s));
    gate.Release();
    ASSERT_TRUE(driver_->SynchronizeStream(t).ok());
  }
  // The next miss finds t done: its blocks are for any stream, and join s's neighbours.
  const PoolStats before = pool->GetStats();
  void* p = Alloc(*pool, 58 * kMiB, s);  // b1..b4 hold 60 MiB
  EXPECT_EQ(p, b1);
  const PoolStats after = pool->GetStats();
  EXPECT_EQ(after.num_device_alloc, before.num_device_alloc);
  EXPECT_EQ(after.reserved_bytes.current, before.reserved_bytes.current);
  EXPECT_EQ(after.num_alloc_retries, 0);
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
  live.push_back(p);
  for (void* q : live) ASSERT_TRUE(pool->Free(q).ok());
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
  ASSERT_TRUE(driver_->DestroyStream(s).ok());
  ASSERT_TRUE(driver_->DestroyStream(t).ok());
}

TEST_F(PoolTest, RecordStreamDelaysReuseUntilThatStreamIsDone) {
  auto pool = MakePool();
  Stream s = *driver_->CreateStream(0);
  Stream t = *driver_->CreateStream(0);
  auto gate = std::make_unique<StreamGate>(driver_, t);
  void* a = Alloc(*pool, 4 * kMiB, s);
  ASSERT_TRUE(pool->RecordStream(a, t).ok());
  ASSERT_TRUE(pool->Free(a).ok());
  PoolStats pending = pool->GetStats();
  EXPECT_EQ(pending.active_bytes.current, static_cast<int64_t>(4 * kMiB));
  EXPECT_EQ(pending.allocated_bytes.current, 0);
  EXPECT_EQ(pending.active.current, 1);
  void* b = Alloc(*pool, 4 * kMiB, s);
  EXPECT_NE(b, a) << "t may still be using a";
  // Active counts a (pending) and b: its peak is above allocated's.
  PoolStats both = pool->GetStats();
  EXPECT_EQ(both.active_bytes.current, static_cast<int64_t>(8 * kMiB));
  EXPECT_EQ(both.active_bytes.peak, static_cast<int64_t>(8 * kMiB));
  EXPECT_EQ(both.allocated_bytes.peak, static_cast<int64_t>(4 * kMiB));
  EXPECT_EQ(both.active.peak, 2);
  EXPECT_EQ(both.active_bytes.allocated, static_cast<int64_t>(8 * kMiB));
  EXPECT_EQ(both.active_bytes.freed, 0);
  ASSERT_TRUE(pool->Free(b).ok());
  pool->ResetPeakStats();
  pool->ResetAccumulatedStats();
  PoolStats reset = pool->GetStats();
  EXPECT_EQ(reset.active_bytes.current, static_cast<int64_t>(4 * kMiB));
  EXPECT_EQ(reset.active_bytes.peak, static_cast<int64_t>(4 * kMiB));
  EXPECT_EQ(reset.active_bytes.freed, 0);
  gate->Release();
  ASSERT_TRUE(driver_->SynchronizeStream(t).ok());
  void* c = Alloc(*pool, 4 * kMiB, s);
  EXPECT_EQ(c, a);
  ASSERT_TRUE(pool->Free(c).ok());
  PoolStats done = pool->GetStats();
  EXPECT_EQ(done.active_bytes.current, 0);
  EXPECT_EQ(done.active.current, 0);
  // Since the reset: a left active (4 MiB) and c came and went (4 MiB).
  EXPECT_EQ(done.active_bytes.allocated, static_cast<int64_t>(4 * kMiB));
  EXPECT_EQ(done.active_bytes.freed, static_cast<int64_t>(8 * kMiB));
  EXPECT_EQ(done.active_bytes.peak, static_cast<int64_t>(4 * kMiB));
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
  gate.reset();
  ASSERT_TRUE(driver_->DestroyStream(s).ok());
  ASSERT_TRUE(driver_->DestroyStream(t).ok());
}

// --- Export invariant ----------------------------------------------------------------------

TEST_F(PoolTest, ExportedChunksAreNeverRecycled) {
  RecordingObserver observer;
  auto pool = MakePool(Exact(), &observer);
  if (pool->handle_type() == HandleType::kNone) GTEST_SKIP() << "memory is not exportable";
  // One growth of 8 MiB holds a (2 MiB) and b (2 MiB) and 4 MiB of free space.
  void* a = Alloc(*pool, 8 * kMiB);
  ASSERT_TRUE(pool->Free(a).ok());
  a = Alloc(*pool, 2 * kMiB);
  void* b = Alloc(*pool, 2 * kMiB);
  auto exported = pool->Export(a);
  ASSERT_TRUE(exported.ok()) << exported.status();
  ASSERT_EQ(exported->chunks.size(), 1u);
  EXPECT_EQ(exported->offset, 0u);
  EXPECT_EQ(exported->size, 2 * kMiB);
  EXPECT_EQ(exported->chunks[0].size, 8 * kMiB);
  PoolStats s = pool->GetStats();
  EXPECT_EQ(s.exported_bytes.current, static_cast<int64_t>(8 * kMiB));
  EXPECT_EQ(s.inactive_split_bytes.current, 0) << "free space of the chunk is retired";
  // b's space is not reused after b is freed, nor is the retired space.
  ASSERT_TRUE(pool->Free(b).ok());
  ASSERT_TRUE(driver_->SynchronizeDevice(0).ok());
  void* c = Alloc(*pool, 2 * kMiB);
  EXPECT_FALSE(reinterpret_cast<uintptr_t>(c) >= reinterpret_cast<uintptr_t>(a) &&
               reinterpret_cast<uintptr_t>(c) < reinterpret_cast<uintptr_t>(a) + 8 * kMiB);
  EXPECT_TRUE(observer.released().empty());
  // Once a is freed too, the chunk goes back to the driver.
  ASSERT_TRUE(pool->Free(a).ok());
  ASSERT_TRUE(driver_->SynchronizeDevice(0).ok());
  ASSERT_TRUE(pool->Free(c).ok());  // also processes the pending release
  auto d = Alloc(*pool, 512);  // gives the pool a chance to process completed events
  ASSERT_TRUE(pool->Free(d).ok());
  ASSERT_TRUE(pool->EmptyCache().ok());
  EXPECT_EQ(observer.released(), std::vector<uint64_t>{exported->chunks[0].id})
      << "the observer hears of the released exported chunk, once";
  s = pool->GetStats();
  EXPECT_EQ(s.exported_bytes.current, 0);
  EXPECT_EQ(s.reserved_bytes.current, 0);
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
}

TEST_F(PoolTest, ShareableBlocksGetChunksOfTheirOwn) {
  auto pool = MakePool();
  if (pool->handle_type() == HandleType::kNone) GTEST_SKIP() << "memory is not exportable";
  void* small = Alloc(*pool, 3 * kMiB);
  auto shared = pool->AllocateShareable(3 * kMiB, 0);
  ASSERT_TRUE(shared.ok()) << shared.status();
  auto exported = pool->Export(*shared);
  ASSERT_TRUE(exported.ok());
  ASSERT_EQ(exported->chunks.size(), 1u);
  EXPECT_EQ(exported->chunks[0].size, 4 * kMiB);  // rounded to granularity, nothing else in it
  EXPECT_EQ(exported->offset, 0u);
  // The slack of its chunk is never handed out.
  void* other = Alloc(*pool, kMiB / 2 + 4096);
  const auto start = reinterpret_cast<uintptr_t>(*shared);
  EXPECT_FALSE(reinterpret_cast<uintptr_t>(other) >= start &&
               reinterpret_cast<uintptr_t>(other) < start + 4 * kMiB);
  const int64_t reserved = pool->GetStats().reserved_bytes.current;
  ASSERT_TRUE(pool->Free(*shared).ok());
  ASSERT_TRUE(pool->EmptyCache().ok());
  EXPECT_LE(pool->GetStats().reserved_bytes.current, reserved - static_cast<int64_t>(4 * kMiB));
  ASSERT_TRUE(pool->Free(small).ok());
  ASSERT_TRUE(pool->Free(other).ok());
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
}

// --- Whether a block shares its chunks -------------------------------------------------------

// Pool::SharesChunks of `ptr`, failing the test (and answering false) on an error.
bool Shares(Pool& pool, const void* ptr) {
  absl::StatusOr<bool> shares = pool.SharesChunks(ptr);
  EXPECT_TRUE(shares.ok()) << shares.status();
  return shares.ok() && *shares;
}

TEST_F(PoolTest, ABlockInChunksOfItsOwnSharesNothing) {
  auto pool = MakePool();
  if (pool->handle_type() == HandleType::kNone) GTEST_SKIP() << "memory is not exportable";
  void* before = Alloc(*pool, 3 * kMiB);
  ASSERT_OK_AND_ASSIGN(void* alone, pool->AllocateShareable(3 * kMiB + 100, 0));
  void* after = Alloc(*pool, 3 * kMiB);
  EXPECT_FALSE(Shares(*pool, alone)) << "only retired slack shares its chunk";
  EXPECT_OK(pool->Export(alone).status());
  EXPECT_FALSE(Shares(*pool, alone)) << "exporting changes nothing";
  ASSERT_OK_AND_ASSIGN(size_t size, pool->BlockSize(alone));
  EXPECT_EQ(size, 3 * kMiB + 100) << "the bytes asked for";
  for (void* p : {before, alone, after}) EXPECT_OK(pool->Free(p));
  EXPECT_OK(pool->CheckInvariants());
}

TEST_F(PoolTest, SmallBlocksInOneChunkShareItWhileBothLive) {
  auto pool = MakePool();
  void* a = Alloc(*pool, 1000);
  void* b = Alloc(*pool, 5000);  // beside a in the same small chunk
  ASSERT_EQ(reinterpret_cast<uintptr_t>(b), reinterpret_cast<uintptr_t>(a) + 1024);
  EXPECT_TRUE(Shares(*pool, a));
  EXPECT_TRUE(Shares(*pool, b));
  ASSERT_OK_AND_ASSIGN(size_t size, pool->BlockSize(b));
  EXPECT_EQ(size, 5000u);
  EXPECT_OK(pool->Free(b));
  EXPECT_FALSE(Shares(*pool, a)) << "free space does not count";
  EXPECT_OK(pool->Free(a));
}

TEST_F(PoolTest, ExportAloneRefusesABlockWithALiveNeighbour) {
  auto pool = MakePool();
  if (pool->handle_type() == HandleType::kNone) GTEST_SKIP() << "memory is not exportable";
  void* a = Alloc(*pool, 1000);
  void* b = Alloc(*pool, 5000);  // beside a in the same small chunk
  absl::StatusOr<ExportedBlock> refused =
      pool->Export(a, HandleType::kNone, ExportNeighbours::kRefuse);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("another live block"));
  PoolStats s = pool->GetStats();
  EXPECT_EQ(s.num_exports, 0) << "nothing was exported";
  EXPECT_EQ(s.exported_bytes.current, 0) << "nothing was marked";
  EXPECT_FALSE(pool->Export(b, HandleType::kNone, ExportNeighbours::kRefuse).ok());
  ASSERT_OK(pool->Free(b));
  EXPECT_OK(pool->Export(a, HandleType::kNone, ExportNeighbours::kRefuse).status())
      << "alone once its neighbour is gone";
  EXPECT_FALSE(Shares(*pool, a));
  ASSERT_OK(pool->Free(a));
  EXPECT_OK(pool->CheckInvariants());
}

// One thread allocates small blocks while another exports fresh blocks alone: an allocation
// can never land beside a block between the check and the export, so every block exported
// alone has no live neighbour in its chunks (none can arrive later: the chunks are retired).
// Every 40th round the allocating thread first frees all its blocks and waits, so that some
// exports succeed whatever the scheduling (otherwise, once its blocks share the exporter's
// chunk, every export may be refused and the success path never runs).
TEST_F(PoolTest, ExportAloneRacesNoAllocationIntoTheBlocksChunks) {
  auto pool = MakePool();
  if (pool->handle_type() == HandleType::kNone) GTEST_SKIP() << "memory is not exportable";
  std::atomic<bool> stop{false};
  std::atomic<bool> drain{false};
  std::atomic<bool> drained{false};
  std::atomic<bool> finished{false};  // the allocating thread returned (a failed assertion too)
  std::thread allocator([&] {
    struct Finished {
      std::atomic<bool>& flag;
      ~Finished() { flag.store(true); }
    } finished_on_return{finished};
    std::deque<void*> live;
    size_t i = 0;
    while (!stop.load(std::memory_order_relaxed)) {
      if (drain.load()) {
        for (void* p : live) ASSERT_OK(pool->Free(p));
        live.clear();
        drained.store(true);
        while (drain.load() && !stop.load()) std::this_thread::yield();
        drained.store(false);
        continue;
      }
      absl::StatusOr<void*> p = pool->Allocate(512 + (i++ % 16) * 512, 0);
      ASSERT_OK(p.status());
      live.push_back(*p);
      if (live.size() > 64) {
        ASSERT_OK(pool->Free(live.front()));
        live.pop_front();
      }
    }
    for (void* p : live) ASSERT_OK(pool->Free(p));
  });
  int exported = 0;
  int refused = 0;
  for (int i = 0; i < 400; ++i) {
    const bool alone = i % 40 == 0;
    if (alone) {
      drain.store(true);
      while (!drained.load() && !finished.load()) std::this_thread::yield();
    }
    void* fresh = Alloc(*pool, 256 * 1024);
    ASSERT_NE(fresh, nullptr);
    absl::StatusOr<ExportedBlock> e =
        pool->Export(fresh, HandleType::kNone, ExportNeighbours::kRefuse);
    if (alone) {
      EXPECT_OK(e.status()) << "iteration " << i << ": no other block was live";
      drain.store(false);
    }
    if (e.ok()) {
      ++exported;
      EXPECT_FALSE(Shares(*pool, fresh)) << "iteration " << i << ": exported with a neighbour";
    } else {
      ++refused;
      EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition) << e.status();
    }
    ASSERT_OK(pool->Free(fresh));
  }
  stop = true;
  allocator.join();
  EXPECT_GT(exported, 0) << "refused " << refused;
  EXPECT_OK(pool->CheckInvariants());
}

TEST_F(PoolTest, ALargeBlockSharesOnlyWhatItsEndChunksHold) {
  PoolOptions options = Exact();
  options.max_chunk = 2 * kMiB;  // 8 MiB is four chunks
  auto pool = MakePool(options);
  void* all = Alloc(*pool, 8 * kMiB);
  ASSERT_OK(pool->Free(all));
  const auto base = reinterpret_cast<uintptr_t>(all);
  // a spans chunks 0-2 ([0, 5 MiB)); b sits in chunks 2-3 ([5 MiB, 7 MiB)).
  void* a = Alloc(*pool, 5 * kMiB);
  void* b = Alloc(*pool, 2 * kMiB);
  ASSERT_EQ(reinterpret_cast<uintptr_t>(a), base);
  ASSERT_EQ(reinterpret_cast<uintptr_t>(b), base + 5 * kMiB);
  EXPECT_TRUE(Shares(*pool, a)) << "its last chunk holds b";
  EXPECT_TRUE(Shares(*pool, b)) << "its first chunk holds a";
  ASSERT_OK(pool->Free(b));
  EXPECT_FALSE(Shares(*pool, a));
  ASSERT_OK(pool->Free(a));
  // a fills chunks 0-1 exactly; b and c sit in chunks 2 and 3, beside but not inside them.
  a = Alloc(*pool, 4 * kMiB);
  b = Alloc(*pool, 2 * kMiB);
  void* c = Alloc(*pool, 2 * kMiB);
  ASSERT_EQ(reinterpret_cast<uintptr_t>(b), base + 4 * kMiB);
  ASSERT_EQ(reinterpret_cast<uintptr_t>(c), base + 6 * kMiB);
  EXPECT_FALSE(Shares(*pool, a));
  EXPECT_FALSE(Shares(*pool, b));
  EXPECT_FALSE(Shares(*pool, c));
  for (void* p : {a, b, c}) EXPECT_OK(pool->Free(p));
  EXPECT_OK(pool->CheckInvariants());
}

TEST_F(PoolTest, BlocksInExportedChunksAndPendingFreesCount) {
  auto pool = MakePool();
  if (pool->handle_type() == HandleType::kNone) GTEST_SKIP() << "memory is not exportable";
  void* a = Alloc(*pool, 1000);
  void* b = Alloc(*pool, 2000);
  ASSERT_OK(pool->Export(a).status());
  EXPECT_TRUE(Shares(*pool, a)) << "b is still live in a's exported chunk";
  EXPECT_TRUE(Shares(*pool, b));
  Stream s = *driver_->CreateStream(0);
  {
    StreamGate gate(driver_, s);
    ASSERT_OK(pool->RecordStream(b, s));
    ASSERT_OK(pool->Free(b));
    EXPECT_TRUE(Shares(*pool, a)) << "s may still be using b's bytes";
    gate.Release();
    ASSERT_OK(driver_->SynchronizeStream(s));
  }
  void* c = Alloc(*pool, 512);  // finishes the pending free: b's space is retired
  EXPECT_FALSE(Shares(*pool, a));
  EXPECT_OK(pool->Free(c));
  EXPECT_OK(pool->Free(a));
  EXPECT_OK(pool->CheckInvariants());
  ASSERT_OK(driver_->DestroyStream(s));
}

TEST_F(PoolTest, SharesChunksAndBlockSizeRefuseWhatIsNotALiveBlock) {
  auto pool = MakePool();
  void* a = Alloc(*pool, 3 * kMiB);
  void* freed = Alloc(*pool, 1000);
  ASSERT_OK(pool->Free(freed));
  int on_the_stack = 0;
  const void* bad[] = {nullptr, static_cast<char*>(a) + 512, freed, &on_the_stack,
                       static_cast<char*>(a) + 3 * kMiB};
  for (const void* p : bad) {
    EXPECT_THAT(pool->SharesChunks(p).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not the start of a live")))
        << p;
    EXPECT_THAT(pool->BlockSize(p).status(), StatusIs(absl::StatusCode::kInvalidArgument)) << p;
  }
  EXPECT_OK(pool->Free(a));
}

// The observer hears of every exported chunk still held when the pool goes, then of the pool.
TEST_F(PoolTest, ObserverHearsOfChunksReleasedWithThePool) {
  RecordingObserver observer;
  auto pool = MakePool(Exact(), &observer);
  if (pool->handle_type() == HandleType::kNone) GTEST_SKIP() << "memory is not exportable";
  const uint64_t id = pool->id();
  void* a = Alloc(*pool, 2 * kMiB);
  void* b = Alloc(*pool, 6 * kMiB);  // not exported: not reported
  auto exported = pool->Export(a);
  ASSERT_TRUE(exported.ok()) << exported.status();
  pool.reset();  // a and b still live: released with the pool
  EXPECT_EQ(observer.released(), std::vector<uint64_t>{exported->chunks[0].id});
  EXPECT_EQ(observer.destroyed(), std::vector<uint64_t>{id});
  (void)b;
}

// A visitor sees each chunk's handle under the pool's lock, and its error stops the export.
TEST_F(PoolTest, ExportVisitorSeesEveryChunkAndItsErrorIsReturned) {
  auto pool = MakePool();
  if (pool->handle_type() == HandleType::kNone) GTEST_SKIP() << "memory is not exportable";
  void* a = Alloc(*pool, 4 * kMiB);
  std::vector<PhysHandle> seen;
  auto exported = pool->Export(a, HandleType::kNone, [&](const ExportedChunk& c, bool* driver) {
    seen.push_back(c.handle);
    *driver = true;
    return absl::OkStatus();
  });
  ASSERT_TRUE(exported.ok()) << exported.status();
  ASSERT_EQ(seen.size(), exported->chunks.size());
  EXPECT_NE(seen[0], 0u);
  EXPECT_EQ(pool->GetStats().driver_export, static_cast<int64_t>(seen.size()));
  EXPECT_EQ(exported->chunks[0].handle, 0u) << "a handle is valid only inside the visitor";
  auto failed = pool->Export(a, HandleType::kNone, [](const ExportedChunk&, bool* driver) {
    *driver = true;  // the driver was called, and failed
    return absl::UnavailableError("visitor says no");
  });
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(pool->GetStats().driver_export, static_cast<int64_t>(seen.size()) + 1)
      << "a failed driver call counts too";
  ASSERT_TRUE(pool->Free(a).ok());
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
}

TEST_F(PoolTest, ReleaseThresholdTrimsOnFree) {
  PoolOptions options = Exact();
  options.release_threshold = 8 * kMiB;
  auto pool = MakePool(options);
  void* a = Alloc(*pool, 20 * kMiB);
  void* b = Alloc(*pool, 4 * kMiB);
  ASSERT_TRUE(pool->Free(b).ok());
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, static_cast<int64_t>(24 * kMiB));
  ASSERT_TRUE(pool->Free(a).ok());
  // 24 MiB free is above the threshold: completed free chunks go back to the driver.
  EXPECT_LE(pool->GetStats().reserved_bytes.current, static_cast<int64_t>(8 * kMiB));
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
}

// --- Peer devices --------------------------------------------------------------------------

#define REQUIRE_TWO_DEVICES(var)                                                \
  Driver* const var = TwoDeviceDriver();                                        \
  if (var == nullptr) {                                                         \
    GTEST_SKIP() << "needs two devices and cuda has " << driver_->DeviceCount() \
                 << " (run on a machine with two GPUs)";                        \
  }

// The physical chunks the pool has mapped, from its snapshot.
std::vector<ChunkInfo> MappedChunks(const Pool& pool) {
  std::vector<ChunkInfo> chunks;
  for (const SegmentInfo& segment : pool.GetSnapshot().segments) {
    chunks.insert(chunks.end(), segment.chunks.begin(), segment.chunks.end());
  }
  return chunks;
}

// Whether `device`'s access to the first and last byte of every chunk is `granted`.
::testing::AssertionResult AccessIs(Driver* driver, const std::vector<ChunkInfo>& chunks,
                                    int device, bool granted) {
  for (const ChunkInfo& chunk : chunks) {
    for (DevPtr at : {DevPtr{chunk.addr}, DevPtr{chunk.addr + chunk.size - 1}}) {
      absl::StatusOr<bool> access = driver->HasAccess(at, device);
      if (!access.ok()) return ::testing::AssertionFailure() << access.status();
      if (*access != granted) {
        return ::testing::AssertionFailure()
               << absl::StrFormat("device %d %s access at 0x%x (chunk at 0x%x of %u bytes)", device,
                                  granted ? "lacks" : "has", at, chunk.addr, chunk.size);
      }
    }
  }
  return ::testing::AssertionSuccess();
}

// Whether every byte of [ptr, ptr+size) reads as `value` (copied out on stream 0).
bool AllBytesAre(Driver* driver, void* ptr, size_t size, uint8_t value) {
  std::vector<uint8_t> host(size);
  const DevPtr src = reinterpret_cast<DevPtr>(ptr);
  const DevPtr dst = reinterpret_cast<DevPtr>(host.data());
  if (!driver->MemcpyAsync(dst, src, size, 0).ok() || !driver->SynchronizeStream(0).ok()) {
    return false;
  }
  for (uint8_t b : host) {
    if (b != value) return false;
  }
  return true;
}

TEST_F(PoolTest, TwoDevicesPeerAccessCoversEveryChunkMappedLater) {
  REQUIRE_TWO_DEVICES(two);
  PoolOptions options = Exact();
  options.reserve_size = 1024 * kMiB;
  options.max_chunk = 4 * kMiB;  // growths of more than 4 MiB map several chunks
  options.peer_devices = {1};
  auto created = Pool::Create(two, options);
  ASSERT_TRUE(created.ok()) << created.status();
  Pool& pool = **created;

  std::vector<void*> blocks;
  auto allocate = [&](size_t size) {
    auto p = pool.Allocate(size, 0);
    EXPECT_TRUE(p.ok()) << p.status();
    if (p.ok()) blocks.push_back(*p);
    return p.ok() ? *p : nullptr;
  };
  allocate(3 * kMiB);  // the first growth
  ASSERT_EQ(MappedChunks(pool).size(), 1u);
  EXPECT_TRUE(AccessIs(two, MappedChunks(pool), 0, true));
  EXPECT_TRUE(AccessIs(two, MappedChunks(pool), 1, true));

  // Later growths: several chunks at once, the small arena, chunks of a shareable block.
  void* big = allocate(10 * kMiB);
  allocate(100);
  if (pool.handle_type() != HandleType::kNone) {
    auto shared = pool.AllocateShareable(3 * kMiB, 0);
    ASSERT_TRUE(shared.ok()) << shared.status();
    blocks.push_back(*shared);
  }
  EXPECT_GE(pool.GetStats().num_device_alloc, 3);
  EXPECT_GE(MappedChunks(pool).size(), 5u);
  EXPECT_TRUE(AccessIs(two, MappedChunks(pool), 0, true));
  EXPECT_TRUE(AccessIs(two, MappedChunks(pool), 1, true));

  // Device 1 writes a block that spans several chunks; the pool's device reads it back.
  ASSERT_NE(big, nullptr);
  auto on_one = two->CreateStream(1);
  ASSERT_TRUE(on_one.ok()) << on_one.status();
  ASSERT_TRUE(two->MemsetAsync(reinterpret_cast<DevPtr>(big), 0x42, 10 * kMiB, *on_one).ok());
  ASSERT_TRUE(two->SynchronizeStream(*on_one).ok());
  ASSERT_TRUE(two->DestroyStream(*on_one).ok());
  EXPECT_TRUE(AllBytesAre(two, big, 10 * kMiB, 0x42));

  // Everything goes back to the driver; what is mapped afterwards gets the peer too.
  for (void* p : blocks) ASSERT_TRUE(pool.Free(p).ok());
  ASSERT_TRUE(pool.EmptyCache().ok());
  EXPECT_TRUE(MappedChunks(pool).empty());
  void* again = allocate(6 * kMiB);
  ASSERT_FALSE(MappedChunks(pool).empty());
  EXPECT_TRUE(AccessIs(two, MappedChunks(pool), 0, true));
  EXPECT_TRUE(AccessIs(two, MappedChunks(pool), 1, true));
  ASSERT_TRUE(pool.Free(again).ok());
  EXPECT_TRUE(pool.CheckInvariants().ok()) << pool.CheckInvariants();
}

TEST_F(PoolTest, TwoDevicesWithoutPeersOnlyThePoolsDeviceHasAccess) {
  REQUIRE_TWO_DEVICES(two);
  for (int device : {0, 1}) {
    PoolOptions options = Exact();
    options.reserve_size = 1024 * kMiB;
    options.device = device;
    auto pool = Pool::Create(two, options);
    ASSERT_TRUE(pool.ok()) << pool.status();
    void* a = (*pool)->Allocate(3 * kMiB, 0).value_or(nullptr);
    void* b = (*pool)->Allocate(12 * kMiB, 0).value_or(nullptr);
    ASSERT_NE(a, nullptr);
    ASSERT_NE(b, nullptr);
    EXPECT_TRUE(AccessIs(two, MappedChunks(**pool), device, true)) << "pool on " << device;
    EXPECT_TRUE(AccessIs(two, MappedChunks(**pool), 1 - device, false)) << "pool on " << device;
    ASSERT_TRUE((*pool)->Free(a).ok());
    ASSERT_TRUE((*pool)->Free(b).ok());
  }
  // A peer must be another existing device.
  for (std::vector<int> peers : {std::vector<int>{0}, std::vector<int>{two->DeviceCount()}}) {
    PoolOptions bad;
    bad.peer_devices = peers;
    EXPECT_EQ(Pool::Create(two, bad).status().code(), absl::StatusCode::kInvalidArgument);
  }
}


// --- Keeping memory (private pools) ----------------------------------------------------------

TEST_F(PoolTest, AKeepingPoolReleasesNothingUntilItStops) {
  RecordingObserver observer;
  PoolOptions options = Exact();
  options.release_threshold = 0;  // Free would release every free chunk at once
  auto pool = MakePool(options, &observer);
  pool->SetKeepMemory(true);
  EXPECT_TRUE(pool->keeps_memory());
  void* a = Alloc(*pool, 8 * kMiB);
  void* small = Alloc(*pool, 1000);
  ASSERT_OK(pool->Free(a));
  ASSERT_OK(pool->Free(small));
  ASSERT_OK(pool->EmptyCache());
  PoolStats s = pool->GetStats();
  EXPECT_EQ(s.reserved_bytes.current, static_cast<int64_t>(8 * kMiB + 2 * kMiB));
  EXPECT_EQ(s.num_device_free, 0);
  // Freed memory is still reused.
  EXPECT_EQ(Alloc(*pool, 8 * kMiB), a);
  // An exported chunk left wholly free stays mapped (it would go at once, untracked).
  const bool exportable = pool->handle_type() != HandleType::kNone;
  if (exportable) {
    ASSERT_OK(pool->Export(a).status());
    ASSERT_OK(pool->Free(a));
    ASSERT_OK(driver_->SynchronizeDevice(0));
    ASSERT_OK(pool->EmptyCache());
    EXPECT_TRUE(observer.released().empty());
  } else {
    ASSERT_OK(pool->Free(a));
  }
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, static_cast<int64_t>(10 * kMiB));
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
  pool->SetKeepMemory(false);
  EXPECT_FALSE(pool->keeps_memory());
  ASSERT_OK(pool->EmptyCache());
  s = pool->GetStats();
  EXPECT_EQ(s.reserved_bytes.current, 0);
  EXPECT_EQ(s.exported_bytes.current, 0);
  EXPECT_EQ(observer.released().size(), exportable ? 1u : 0u);
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
  pool.reset();
  EXPECT_EQ(DeviceFree(), free_at_start_);
}

TEST_F(PoolTest, AKeepingPoolsFailedGrowthReleasesNothingBeforeItsRetry) {
  for (bool keep : {false, true}) {
    PoolOptions options = Exact();
    options.memory_limit = 16 * kMiB;
    auto pool = MakePool(options);
    pool->SetKeepMemory(keep);
    void* a = Alloc(*pool, 8 * kMiB);
    void* b = Alloc(*pool, 4 * kMiB);
    ASSERT_OK(pool->Free(b));
    // 10 MiB more would pass the limit whatever is released: a retry, then out of memory.
    EXPECT_THAT(pool->Allocate(10 * kMiB, 0).status(),
                StatusIs(absl::StatusCode::kResourceExhausted));
    const PoolStats s = pool->GetStats();
    EXPECT_EQ(s.num_alloc_retries, 1);
    EXPECT_EQ(s.num_device_free, keep ? 0 : 1) << "keep " << keep;
    EXPECT_EQ(s.reserved_bytes.current, static_cast<int64_t>((keep ? 12 : 8) * kMiB));
    EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
    ASSERT_OK(pool->Free(a));
  }
}

// --- Allocating at an address ----------------------------------------------------------------

TEST_F(PoolTest, AllocateAtTakesAFreedBlocksExactRange) {
  auto pool = MakePool();
  void* a = Alloc(*pool, 4 * kMiB);
  void* b = Alloc(*pool, 4 * kMiB);
  const auto at = reinterpret_cast<uintptr_t>(a);
  ASSERT_EQ(reinterpret_cast<uintptr_t>(b), at + 4 * kMiB) << "one growth after the other";
  ASSERT_OK(pool->Free(a));
  const PoolStats before = pool->GetStats();
  ASSERT_OK_AND_ASSIGN(void* again, pool->AllocateAt(at, 4 * kMiB, 0));
  EXPECT_EQ(again, a);
  PoolStats s = pool->GetStats();
  EXPECT_EQ(s.allocation.current, 2);
  EXPECT_EQ(s.allocated_bytes.current, static_cast<int64_t>(8 * kMiB));
  EXPECT_EQ(s.requested_bytes.current, static_cast<int64_t>(8 * kMiB));
  EXPECT_EQ(s.allocated_bytes.allocated, before.allocated_bytes.allocated + 4 * kMiB);
  EXPECT_EQ(s.num_device_alloc, before.num_device_alloc) << "no growth";
  EXPECT_EQ(s.driver_map, before.driver_map);
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
  // Allocated, partly allocated or unmapped ranges are refused, and nothing changes.
  for (auto [addr, size] : {std::pair{at, 4 * kMiB}, std::pair{at + 2 * kMiB, 4 * kMiB},
                            std::pair{at + 8 * kMiB, 2 * kMiB},
                            std::pair{at + 6 * kMiB, 4 * kMiB}}) {
    EXPECT_THAT(pool->AllocateAt(addr, size, 0).status(),
                StatusIs(absl::StatusCode::kFailedPrecondition))
        << absl::StrFormat("%#x + %d", addr, size);
  }
  EXPECT_EQ(pool->GetStats().allocation.current, 2);
  // Misaligned or empty, outside the pool, or a size of the other arena.
  for (auto [addr, size] : {std::pair{at + 100, 2 * kMiB}, std::pair{at, 2 * kMiB + 1},
                            std::pair{at, size_t{0}}, std::pair{uintptr_t{512}, 2 * kMiB},
                            std::pair{at, size_t{1024}}}) {
    EXPECT_THAT(pool->AllocateAt(addr, size, 0).status(),
                StatusIs(absl::StatusCode::kInvalidArgument))
        << absl::StrFormat("%#x + %d", addr, size);
  }
  ASSERT_OK(pool->Free(again));
  ASSERT_OK(pool->Free(b));
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
}

TEST_F(PoolTest, AllocateAtCarvesTheMiddleOfAFreeBlock) {
  auto pool = MakePool();
  void* a = Alloc(*pool, 8 * kMiB);
  void* small = Alloc(*pool, 1000);
  const auto at = reinterpret_cast<uintptr_t>(a);
  const auto small_at = reinterpret_cast<uintptr_t>(small);
  ASSERT_OK(pool->Free(a));
  ASSERT_OK(pool->Free(small));
  ASSERT_OK_AND_ASSIGN(void* mid, pool->AllocateAt(at + 3 * kMiB, 2 * kMiB + 512, 0));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(mid), at + 3 * kMiB);
  // The small arena serves small sizes at its addresses only.
  ASSERT_OK_AND_ASSIGN(void* tiny, pool->AllocateAt(small_at + 4096, 1024, 0));
  EXPECT_THAT(pool->AllocateAt(small_at, 2 * kMiB, 0).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
  const std::vector<BlockInfo> live = pool->LiveBlocks();
  ASSERT_EQ(live.size(), 2u);
  EXPECT_EQ(live[0].addr, small_at + 4096);
  EXPECT_EQ(live[0].size, 1024u);
  EXPECT_EQ(live[1].addr, at + 3 * kMiB);
  EXPECT_EQ(live[1].size, 2 * kMiB + 512);
  EXPECT_EQ(live[1].requested, 2 * kMiB + 512);
  EXPECT_EQ(live[1].state, BlockState::kAllocated);
  // What is left on both sides is still free: Allocate finds it, and all coalesces back.
  ASSERT_OK_AND_ASSIGN(void* below, pool->AllocateAt(at, 3 * kMiB, 0));
  ASSERT_OK(pool->Free(below));
  ASSERT_OK(pool->Free(mid));
  ASSERT_OK(pool->Free(tiny));
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
  EXPECT_EQ(pool->GetStats().inactive_split.current, 2) << "one free block per arena";
  EXPECT_EQ(Alloc(*pool, 8 * kMiB), a);
  ASSERT_OK(pool->Free(a));
}

// During a capture the synchronisation that would make such space free is not made: the
// request fails, saying why, with no synchronisation; after the capture it succeeds.
// A driver whose context is broken from `Break()` on, as after a device-side assert: its
// synchronisations and creations fail with the driver's error (CUDA_ERROR_ASSERT, 710)
// carried in the status, as cuda_status.h makes it.
class BrokenContextDriver : public ForwardingDriver {
 public:
  using ForwardingDriver::ForwardingDriver;
  void Break() { broken_ = true; }
  int syncs() const { return syncs_; }
  absl::Status SynchronizeDevice(int device) override {
    ++syncs_;
    if (broken_) return Broken("cuCtxSynchronize");
    return ForwardingDriver::SynchronizeDevice(device);
  }
  absl::StatusOr<PhysHandle> Create(int device, size_t size, uint32_t handle_types) override {
    if (broken_) return Broken("cuMemCreate");
    return ForwardingDriver::Create(device, size, handle_types);
  }

 private:
  static absl::Status Broken(const char* call) {
    return WithDriverError(
        absl::InternalError(absl::StrCat(call, ": CUDA_ERROR_ASSERT (device-side assert)")), 710);
  }
  bool broken_ = false;
  int syncs_ = 0;
};

// After the context broke: a pool with nothing cached empties its cache with no driver call
// (PyTorch's allocator then makes no CUDA call either), one with cached memory fails with the
// driver's error, and so does a growth: the error's CUresult reaches the caller (who raises
// torch.AcceleratorError with it).
TEST_F(PoolTest, ADriverErrorReachesTheCallerAndAnEmptyCacheMakesNoCall) {
  BrokenContextDriver broken(driver_);
  PoolOptions options = Exact();
  auto pool = CreatePoolOrFail(&broken, options);
  ASSERT_NE(pool, nullptr);
  void* a = Alloc(*pool, 4 * kMiB);
  void* b = Alloc(*pool, 4 * kMiB);
  ASSERT_OK(pool->Free(b));
  ASSERT_OK(pool->EmptyCache());  // gives b's memory back: every byte left is live
  broken.Break();
  const int syncs = broken.syncs();
  EXPECT_OK(pool->EmptyCache()) << "nothing cached: nothing to do";
  EXPECT_EQ(broken.syncs(), syncs);
  absl::StatusOr<void*> grown = pool->Allocate(64 * kMiB, 0);
  EXPECT_EQ(DriverErrorOf(grown.status()), 710) << grown.status();
  ASSERT_OK(pool->Free(a));
  const absl::Status emptied = pool->EmptyCache();
  EXPECT_EQ(emptied.code(), absl::StatusCode::kInternal) << emptied;
  EXPECT_EQ(DriverErrorOf(emptied), 710) << emptied;
}

TEST_F(PoolTest, AllocateAtDuringACaptureDoesNotSynchronise) {
  auto pool = MakePool();
  Stream s = *driver_->CreateStream(0);
  Stream t = *driver_->CreateStream(0);
  void* a = Alloc(*pool, 4 * kMiB, s);
  void* keep = Alloc(*pool, 4 * kMiB, t);
  const auto at = reinterpret_cast<uintptr_t>(a);
  ASSERT_OK(pool->Free(a));  // cached for s
  const int64_t syncs = pool->GetStats().num_sync_all_streams;
  OpenCaptureWindow();
  absl::StatusOr<void*> during = pool->AllocateAt(at, 4 * kMiB, t);
  CloseCaptureWindow();
  EXPECT_EQ(during.status().code(), absl::StatusCode::kFailedPrecondition) << during.status();
  EXPECT_THAT(std::string(during.status().message()), ::testing::HasSubstr("capture"));
  EXPECT_EQ(pool->GetStats().num_sync_all_streams, syncs);
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
  ASSERT_OK_AND_ASSIGN(void* after, pool->AllocateAt(at, 4 * kMiB, t));
  EXPECT_EQ(after, a);
  EXPECT_EQ(pool->GetStats().num_sync_all_streams, syncs + 1);
  ASSERT_OK(pool->Free(after));
  ASSERT_OK(pool->Free(keep));
  ASSERT_OK(driver_->DestroyStream(s));
  ASSERT_OK(driver_->DestroyStream(t));
}

TEST_F(PoolTest, AllocateAtTakesFreeSpaceOfOtherStreamsAfterASynchronisation) {
  auto pool = MakePool();
  Stream s = *driver_->CreateStream(0);
  Stream t = *driver_->CreateStream(0);
  void* a = Alloc(*pool, 4 * kMiB, s);
  void* b = Alloc(*pool, 4 * kMiB, t);
  void* c = Alloc(*pool, 4 * kMiB, t);
  ASSERT_OK(pool->RecordStream(b, s));
  const auto at = reinterpret_cast<uintptr_t>(a);
  {
    StreamGate gate(driver_, s);
    ASSERT_OK(pool->Free(a));  // cached for s
    ASSERT_OK(pool->Free(b));  // pending: s still uses it
    gate.Release();
  }
  const int64_t syncs = pool->GetStats().num_sync_all_streams;
  // a's space (tagged s) and b's (pending) as one block for t.
  ASSERT_OK_AND_ASSIGN(void* ab, pool->AllocateAt(at, 8 * kMiB, t));
  EXPECT_EQ(ab, a);
  EXPECT_EQ(pool->GetStats().num_sync_all_streams, syncs + 1);
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
  const std::vector<BlockInfo> live = pool->LiveBlocks();
  ASSERT_EQ(live.size(), 2u);
  EXPECT_EQ(live[0].stream, t);
  ASSERT_OK(pool->Free(ab));
  ASSERT_OK(pool->Free(c));
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
  ASSERT_OK(driver_->DestroyStream(s));
  ASSERT_OK(driver_->DestroyStream(t));
}

TEST_F(PoolTest, AllocateAtRefusesRetiredSpace) {
  auto pool = MakePool();
  if (pool->handle_type() == HandleType::kNone) GTEST_SKIP() << "memory is not exportable";
  void* a = Alloc(*pool, 8 * kMiB);
  ASSERT_OK(pool->Free(a));
  a = Alloc(*pool, 2 * kMiB);
  void* b = Alloc(*pool, 2 * kMiB);
  ASSERT_OK(pool->Export(b).status());  // the chunk's free space retires, and a's once freed
  ASSERT_OK(pool->Free(a));
  ASSERT_OK(driver_->SynchronizeDevice(0));
  EXPECT_THAT(pool->AllocateAt(reinterpret_cast<uintptr_t>(a), 2 * kMiB, 0).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("retired")));
  ASSERT_OK(pool->Free(b));
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
}

TEST_F(PoolTest, LiveBlocksListsAllocatedAndPendingBlocksInAddressOrder) {
  auto pool = MakePool();
  Stream t = *driver_->CreateStream(0);
  void* small = Alloc(*pool, 700);
  void* a = Alloc(*pool, 4 * kMiB);
  void* b = Alloc(*pool, 4 * kMiB);
  void* c = Alloc(*pool, 4 * kMiB);
  ASSERT_OK(pool->Free(b));
  ASSERT_OK(pool->RecordStream(c, t));
  auto gate = std::make_unique<StreamGate>(driver_, t);
  ASSERT_OK(pool->Free(c));
  std::vector<BlockInfo> live = pool->LiveBlocks();
  ASSERT_EQ(live.size(), 3u);
  EXPECT_EQ(live[0].addr, reinterpret_cast<uintptr_t>(small));
  EXPECT_EQ(live[0].requested, 700u);
  EXPECT_EQ(live[0].size, 1024u);
  EXPECT_EQ(live[1].addr, reinterpret_cast<uintptr_t>(a));
  EXPECT_EQ(live[1].state, BlockState::kAllocated);
  EXPECT_EQ(live[2].addr, reinterpret_cast<uintptr_t>(c));
  EXPECT_EQ(live[2].state, BlockState::kPendingFree);
  gate->Release();
  ASSERT_OK(driver_->SynchronizeStream(t));
  ASSERT_OK(pool->Free(small));
  ASSERT_OK(pool->Free(a));
  live = pool->LiveBlocks();
  EXPECT_TRUE(live.empty() || (live.size() == 1 && live[0].state == BlockState::kPendingFree));
  ASSERT_OK(pool->EmptyCache());  // finishes c's free
  EXPECT_TRUE(pool->LiveBlocks().empty());
  gate.reset();
  ASSERT_OK(driver_->DestroyStream(t));
}

}  // namespace
}  // namespace vmm
