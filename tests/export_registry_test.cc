// Tests of the sharing side of exported memory (export_registry.h, fd_export_anchor.h) on the
// host backend, each with a driver of its own so that free memory can be checked exactly.
#include "allocator/export_registry.h"

#include <cstring>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "allocator/fd_share.h"
#include "allocator/host_driver.h"
#include "allocator/pool.h"
#include "allocator/sharing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/pool_helpers.h"
#include "tests/status_matchers.h"
#include "tests/sanitizers.h"
#include "tests/subprocess.h"

#if VMM_UNDER_TSAN
// A forked child here starts threads (its own fd server's): ThreadSanitizer refuses that in a
// child forked from a process with threads unless told to go on (it cannot follow them; the
// child's own checks still run). TSAN_OPTIONS from the environment still apply on top.
extern "C" const char* __tsan_default_options() { return "die_after_fork=0"; }
#endif

namespace vmm {
namespace {

using ::testing::HasSubstr;

constexpr size_t kMiB = size_t{1} << 20;

class ExportRegistryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    driver_ = NewHostDriver(HostDriverOptions{2 * kMiB, 256 * kMiB});
    free_at_start_ = DeviceFree();
  }

  std::unique_ptr<Pool> MakePool(HandleRequest handle_type) {
    PoolOptions options = SingleChunkOptions();
    options.growth_fraction = 0;
    options.reserve_size = 1024 * kMiB;
    options.handle_type = handle_type;
    auto pool = CreateExportablePool(driver_.get(), options);
    EXPECT_TRUE(pool.ok()) << pool.status();
    return pool.ok() ? std::move(*pool) : nullptr;
  }

  void* Alloc(Pool& pool, size_t size) {
    auto p = pool.Allocate(size, 0);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *p : nullptr;
  }

  size_t DeviceFree() { return driver_->GetMemInfo(0)->free; }

  ExportRegistry& registry() { return ExportRegistry::Process(); }

  std::unique_ptr<Driver> driver_;
  size_t free_at_start_ = 0;
};

TEST_F(ExportRegistryTest, HandlesAreCachedPerChunkAndDroppedWhenTheChunkGoes) {
  auto pool = MakePool(HandleRequest::kPosixFd);
  const size_t cached_before = registry().cached_handles();
  const size_t fds_before = FdServer::Get().size();
  void* a = Alloc(*pool, 8 * kMiB);
  auto first = ExportBuffer(*pool, a);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = ExportBuffer(*pool, a);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(*first, *second) << "the same chunk gives the same handle";
  EXPECT_EQ(registry().cached_handles(), cached_before + 1);
  EXPECT_EQ(FdServer::Get().size(), fds_before + 1) << "one fd per chunk";
  EXPECT_EQ(pool->GetStats().driver_export, 1) << "the driver exported the chunk once";
  ASSERT_TRUE(pool->Free(a).ok());
  ASSERT_TRUE(pool->EmptyCache().ok());
  EXPECT_EQ(registry().cached_handles(), cached_before) << "released chunk: handle dropped";
  EXPECT_EQ(FdServer::Get().size(), fds_before) << "and its fd closed: nothing pinned";
}

TEST_F(ExportRegistryTest, FabricHandlesAreCachedAndDroppedToo) {
  PoolOptions options = SingleChunkOptions();
  options.handle_type = HandleRequest::kFabric;
  options.reserve_size = 1024 * kMiB;
  auto pool = CreateExportablePool(driver_.get(), options);
  if (!pool.ok()) GTEST_SKIP() << "no fabric handles here: " << pool.status();
  const size_t cached_before = registry().cached_handles();
  void* a = Alloc(**pool, 4 * kMiB);
  auto d = ExportBuffer(**pool, a);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->handle_type(), HandleType::kFabric);
  EXPECT_EQ(registry().cached_handles(), cached_before + 1);
  pool->reset();  // the live block goes with the pool
  EXPECT_EQ(registry().cached_handles(), cached_before);
  EXPECT_EQ(DeviceFree(), free_at_start_);
}

TEST_F(ExportRegistryTest, PoolsNotMadeForExportAreRefused) {
  PoolOptions options = SingleChunkOptions();
  options.reserve_size = 1024 * kMiB;
  auto pool = Pool::Create(driver_.get(), options);
  ASSERT_TRUE(pool.ok()) << pool.status();
  void* a = Alloc(**pool, kMiB);
  auto d = ExportBuffer(**pool, a);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(d.status().message(), HasSubstr("CreateExportablePool"));
  ASSERT_TRUE((*pool)->Free(a).ok());
}

TEST_F(ExportRegistryTest, PoolsThatCannotExportSaySo) {
  auto pool = MakePool(HandleRequest::kNone);
  void* a = Alloc(*pool, kMiB);
  auto d = ExportBuffer(*pool, a);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(d.status().message(), HasSubstr("not exportable"));
  ASSERT_TRUE(pool->Free(a).ok());
}

// The first POSIX-fd export of any pool sets up one smallest allocation exported as a kept fd
// (so that later exports skip the driver's set-up), shared by every pool of the device while
// one of them lives; it is not pool memory. Fabric exports need none.
TEST_F(ExportRegistryTest, FdExportsKeepOneAnchorPerDeviceWhilePoolsLive) {
  const size_t granularity = 2 * kMiB;
  const size_t anchors_before = registry().fd_anchors();
  auto first = MakePool(HandleRequest::kPosixFd);
  auto second = MakePool(HandleRequest::kPosixFd);
  void* a = Alloc(*first, 2 * granularity);
  void* b = Alloc(*second, 2 * granularity);
  const size_t before_export = DeviceFree();
  ASSERT_TRUE(ExportBuffer(*first, a).ok());
  ASSERT_TRUE(ExportBuffer(*second, b).ok());
  EXPECT_EQ(DeviceFree(), before_export - granularity) << "one anchor for both pools";
  EXPECT_EQ(registry().fd_anchors(), anchors_before + 1);
  EXPECT_EQ(first->GetStats().reserved_bytes.current, static_cast<int64_t>(2 * granularity))
      << "the anchor is not pool memory";
  ASSERT_TRUE(first->Free(a).ok());
  ASSERT_TRUE(second->Free(b).ok());
  first.reset();
  EXPECT_EQ(registry().fd_anchors(), anchors_before + 1) << "the anchor stays while a pool lives";
  second.reset();
  EXPECT_EQ(registry().fd_anchors(), anchors_before) << "and goes with the last one";
  EXPECT_EQ(DeviceFree(), free_at_start_);
}

// A forked child's copy of its parent's anchor fd would keep the parent's granule on the GPU
// until the child exits: the child forgets the parent's anchors, and its own pools make and
// drop their own.
TEST_F(ExportRegistryTest, AForkedChildHoldsNoAnchorOfItsParent) {
  const size_t anchors_before = registry().fd_anchors();
  auto pool = MakePool(HandleRequest::kPosixFd);
  void* a = Alloc(*pool, 2 * kMiB);
  ASSERT_OK(ExportBuffer(*pool, a).status());
  ASSERT_EQ(registry().fd_anchors(), anchors_before + 1);
  const int code = InForkedChild([&] {
    if (registry().fd_anchors() != 0) return 1;
    std::unique_ptr<Pool> own = MakePool(HandleRequest::kPosixFd);
    if (own == nullptr) return 2;
    void* b = Alloc(*own, 2 * kMiB);
    if (b == nullptr || !ExportBuffer(*own, b).ok()) return 3;
    if (registry().fd_anchors() != 1) return 4;
    if (!own->Free(b).ok()) return 5;
    own.reset();
    return registry().fd_anchors() == 0 ? 0 : 6;
  });
  EXPECT_EQ(code, 0) << "1: the parent's anchor is still held in the child; 2-6: the child's "
                        "own pool and anchor";
  EXPECT_EQ(registry().fd_anchors(), anchors_before + 1) << "the parent's anchor stays";
  ASSERT_OK(pool->Free(a));
  pool.reset();
  EXPECT_EQ(registry().fd_anchors(), anchors_before);
}

// A chunk reused after its send (pool.h, "Reusing exported chunks") keeps its fd, registered
// afresh: the earlier send's descriptor fetches nothing, the next export's does, and the driver
// exports nothing again.
TEST_F(ExportRegistryTest, AReusedChunkKeepsItsFdUnderANewToken) {
  auto pool = MakePool(HandleRequest::kPosixFd);
  ASSERT_NE(pool, nullptr);
  ASSERT_EQ(pool->handle_type(), HandleType::kPosixFd);
  ASSERT_OK_AND_ASSIGN(void* p, pool->AllocateShareable(2 * kMiB, 0));
  std::memset(p, 0x11, 2 * kMiB);
  std::vector<ExportedChunk> first_chunks;
  ASSERT_OK_AND_ASSIGN(BufferDescriptor first, ExportBuffer(*pool, p, ExportNeighbours::kAllow,
                                                            ExportUse::kTracked, &first_chunks));
  ASSERT_EQ(first_chunks.size(), 1u);
  ASSERT_EQ(first.handles().size(), 1u);
  ASSERT_OK_AND_ASSIGN(const FdToken first_token, FdToken::Decode(first.handles()[0]));
  const size_t fds = FdServer::Get().size();
  const size_t cached = registry().cached_handles();
  const int64_t driver_exports = pool->GetStats().driver_export;

  // Freed, reported released by its receiver: spare, renamed at once: the same fd under a new
  // key; the old token is stale before the chunk is reused.
  ASSERT_OK(pool->Free(p));
  pool->SettleExport(first_chunks, /*released=*/true);
  EXPECT_EQ(FdServer::Get().size(), fds);
  EXPECT_EQ(registry().cached_handles(), cached);
  EXPECT_THAT(FetchFds({first_token}), StatusIs(absl::StatusCode::kNotFound, HasSubstr("stale")))
      << "spare: renamed already";

  // Reused: still the same fd.
  ASSERT_OK_AND_ASSIGN(void* q, pool->AllocateShareable(2 * kMiB, 0));
  ASSERT_EQ(q, p);
  ASSERT_EQ(pool->GetStats().num_export_reuses, 1);
  EXPECT_EQ(FdServer::Get().size(), fds) << "the fd is kept, not closed and exported again";
  EXPECT_EQ(registry().cached_handles(), cached);
  EXPECT_THAT(FetchFds({first_token}), StatusIs(absl::StatusCode::kNotFound, HasSubstr("stale")));
  EXPECT_THAT(ImportBuffer(driver_.get(), first).status(),
              StatusIs(absl::StatusCode::kNotFound));
  std::memset(q, 0x22, 2 * kMiB);
  std::vector<ExportedChunk> second_chunks;
  ASSERT_OK_AND_ASSIGN(BufferDescriptor second, ExportBuffer(*pool, q, ExportNeighbours::kAllow,
                                                             ExportUse::kTracked,
                                                             &second_chunks));
  ASSERT_EQ(second_chunks.size(), 1u);
  EXPECT_NE(second_chunks[0].id, first_chunks[0].id);
  EXPECT_EQ(pool->GetStats().driver_export, driver_exports) << "the cached fd was used";
  EXPECT_EQ(FdServer::Get().size(), fds);
  ASSERT_OK_AND_ASSIGN(const FdToken second_token, FdToken::Decode(second.handles()[0]));
  EXPECT_NE(second_token.key, first_token.key);
  EXPECT_NE(second_token.nonce, first_token.nonce);
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedBuffer> imported,
                         ImportBuffer(driver_.get(), second));
    EXPECT_EQ(reinterpret_cast<const uint8_t*>(imported->ptr())[2 * kMiB - 1], 0x22);
  }
  // The second send ends: its chunk goes back to the driver with EmptyCache, fd and all.
  ASSERT_OK(pool->Free(q));
  pool->SettleExport(second_chunks, true);
  ASSERT_OK(pool->EmptyCache());
  EXPECT_EQ(FdServer::Get().size(), fds - 1);
  EXPECT_EQ(registry().cached_handles(), cached - 1);
  EXPECT_THAT(FetchFds({second_token}), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, 0);
}

// Without memory left for the anchor, exports still work (only slower on CUDA).
TEST_F(ExportRegistryTest, FdExportsWorkWhenTheAnchorCannotBeCreated) {
  auto pool = MakePool(HandleRequest::kPosixFd);
  void* all = Alloc(*pool, DeviceFree());  // the whole device
  ASSERT_NE(all, nullptr);
  ASSERT_EQ(DeviceFree(), 0u);
  auto d = ExportBuffer(*pool, all);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->handle_type(), HandleType::kPosixFd);
  ASSERT_TRUE(pool->Free(all).ok());
  pool.reset();
  EXPECT_EQ(DeviceFree(), free_at_start_) << "no anchor was left behind";
}

}  // namespace
}  // namespace vmm
