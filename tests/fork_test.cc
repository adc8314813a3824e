// fork() and vmm's pools on the host backend: a forked child never allocates from, or exports,
// memory of a pool its parent made (both would hand out the same bytes), gets device pools of
// its own through ProcessState, and may still free blocks made before the fork.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>

#include "absl/status/status.h"
#include "allocator/fork_guard.h"
#include "allocator/host_driver.h"
#include "allocator/pool.h"
#include "allocator/sharing.h"
#include "gtest/gtest.h"
#include "tests/subprocess.h"
#include "torch_plugin/process_state.h"

namespace vmm {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

class ForkTest : public ::testing::Test {
 protected:
  void SetUp() override { driver_ = NewHostDriver(HostDriverOptions{2 * kMiB, 256 * kMiB}); }

  std::unique_ptr<Pool> MakePool() {
    PoolOptions options;
    options.reserve_size = 256 * kMiB;
    options.handle_type = HandleRequest::kPosixFd;
    auto pool = CreateExportablePool(driver_.get(), options);
    EXPECT_TRUE(pool.ok()) << pool.status();
    return pool.ok() ? std::move(*pool) : nullptr;
  }

  std::unique_ptr<Driver> driver_;
};

TEST_F(ForkTest, TheGenerationGoesUpInTheChildOnly) {
  const uint64_t parent = ForkGeneration();
  EXPECT_EQ(InForkedChild([&] { return ForkGeneration() == parent + 1 ? 0 : 1; }), 0);
  EXPECT_EQ(ForkGeneration(), parent);
}

TEST_F(ForkTest, AChildCannotAllocateOrExportFromItsParentsPool) {
  auto pool = MakePool();
  void* before = *pool->Allocate(kMiB, 0);
  std::memset(before, 0x11, kMiB);
  void* cached = *pool->Allocate(kMiB, 0);
  ASSERT_TRUE(pool->Free(cached).ok());  // free space the child must not take
  const int rc = InForkedChild([&] {
    absl::StatusOr<void*> p = pool->Allocate(kMiB, 0);
    if (p.ok() || p.status().code() != absl::StatusCode::kFailedPrecondition) return 1;
    if (pool->AllocateShareable(kMiB, 0).status().code() !=
        absl::StatusCode::kFailedPrecondition) {
      return 2;
    }
    if (ExportBuffer(*pool, before).status().code() != absl::StatusCode::kFailedPrecondition) {
      return 3;
    }
    // Blocks made before the fork can be read and freed.
    if (static_cast<unsigned char*>(before)[kMiB - 1] != 0x11) return 4;
    if (!pool->Free(before).ok()) return 5;
    return 0;
  });
  EXPECT_EQ(rc, 0);
  // The parent's pool is untouched by the child: it allocates and exports as before.
  absl::StatusOr<void*> again = pool->Allocate(kMiB, 0);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, cached) << "the parent reuses its cached block";
  EXPECT_TRUE(ExportBuffer(*pool, before).ok());
  ASSERT_TRUE(pool->Free(*again).ok());
  ASSERT_TRUE(pool->Free(before).ok());
}

// The finding this guards against: after fork() parent and child allocated the same pool
// memory, so the child's writes overwrote the parent's tensor.
TEST_F(ForkTest, ChildDevicePoolsAreItsOwnAndParentDataSurvives) {
  setenv("VMM_BACKEND", "host", 1);
  ProcessState state;
  absl::StatusOr<Pool*> parent_pool = state.DevicePool(0);
  ASSERT_TRUE(parent_pool.ok()) << parent_pool.status();
  void* parent_block = *(*parent_pool)->Allocate(4 * kMiB, 0);
  std::memset(parent_block, 0xAA, 4 * kMiB);
  void* spare = *(*parent_pool)->Allocate(4 * kMiB, 0);
  ASSERT_TRUE((*parent_pool)->Free(spare).ok());
  const int rc = InForkedChild([&] {
    absl::StatusOr<Pool*> child_pool = state.DevicePool(0);
    if (!child_pool.ok()) return 1;
    if (*child_pool == *parent_pool) return 2;
    absl::StatusOr<void*> p = (*child_pool)->Allocate(4 * kMiB, 0);
    if (!p.ok()) return 3;
    if ((*parent_pool)->Contains(*p)) return 4;
    std::memset(*p, 0x55, 4 * kMiB);
    // A block of the parent's pool is still found, and freed, in the child.
    if (state.Owner(parent_block).pool != *parent_pool) return 5;
    if (!state.FreeBlock(parent_block).ok()) return 6;
    if (!state.FreeBlock(*p).ok()) return 7;
    return 0;
  });
  EXPECT_EQ(rc, 0);
  const auto* bytes = static_cast<const unsigned char*>(parent_block);
  for (size_t i = 0; i < 4 * kMiB; i += 4096) {
    ASSERT_EQ(bytes[i], 0xAA) << "the child's allocation overwrote the parent's at " << i;
  }
  EXPECT_EQ(*state.DevicePool(0), *parent_pool) << "the parent keeps its pool";
  ASSERT_TRUE(state.FreeBlock(parent_block).ok());
  unsetenv("VMM_BACKEND");
}

// A child whose first pool is a private one (a CUDA graph's or a MemPool's, made before any
// device pool of its own): that pool counts against a cap of the child's, and the child's
// statistics hold only its own pools, not the parent's device pool, private pools or gone
// pools.
TEST_F(ForkTest, AChildsFirstPrivatePoolStartsItsOwnStatistics) {
  setenv("VMM_BACKEND", "host", 1);
  ProcessState state;
  absl::StatusOr<Pool*> parent_pool = state.DevicePool(0);
  ASSERT_TRUE(parent_pool.ok()) << parent_pool.status();
  void* parent_block = *(*parent_pool)->Allocate(8 * kMiB, 0);
  absl::StatusOr<int64_t> parent_private = state.UsePrivatePool(std::nullopt, 0, 7, 7, "");
  ASSERT_TRUE(parent_private.ok()) << parent_private.status();
  void* parent_private_block = *state.PoolAllocate(*parent_private, 2 * kMiB, 0, false);
  ASSERT_EQ(state.DeviceStats(0).allocated_bytes.current, static_cast<int64_t>(10 * kMiB));
  const int rc = InForkedChild([&] {
    absl::StatusOr<int64_t> id = state.UsePrivatePool(std::nullopt, 0, 1, 1, "");
    if (!id.ok()) return 1;
    absl::StatusOr<void*> p = state.PoolAllocate(*id, 4 * kMiB, 0, false);
    if (!p.ok()) return 2;
    const PoolStats stats = state.DeviceStats(0);
    if (stats.allocated_bytes.current != static_cast<int64_t>(4 * kMiB)) return 3;
    if (stats.allocated_bytes.peak != static_cast<int64_t>(4 * kMiB)) return 4;
    if (!state.FreeBlock(*p).ok()) return 5;
    if (state.DeviceStats(0).allocated_bytes.current != 0) return 6;
    // The child's device pool, made after, shares the child's cap.
    absl::StatusOr<void*> q = state.DeviceAllocate(0, 2 * kMiB, 0);
    if (!q.ok()) return 7;
    if (state.DeviceStats(0).allocated_bytes.peak != static_cast<int64_t>(4 * kMiB)) return 8;
    if (!state.FreeBlock(*q).ok()) return 9;
    return 0;
  });
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(state.DeviceStats(0).allocated_bytes.current, static_cast<int64_t>(10 * kMiB))
      << "the parent's figures are its own";
  ASSERT_TRUE(state.FreeBlock(parent_private_block).ok());
  ASSERT_TRUE(state.FreeBlock(parent_block).ok());
  unsetenv("VMM_BACKEND");
}

TEST_F(ForkTest, ExplicitPoolsOfTheParentRefuseInTheChild) {
  ProcessState state;
  absl::StatusOr<int64_t> id = state.CreatePool(Backend::kHost, 0, "reserve_size=256M");
  ASSERT_TRUE(id.ok()) << id.status();
  const int rc = InForkedChild([&] {
    absl::StatusOr<void*> p = state.PoolAllocate(*id, kMiB, 0, false);
    if (p.ok()) return 1;
    if (p.status().code() != absl::StatusCode::kFailedPrecondition) return 2;
    if (p.status().message().find("fork") == absl::string_view::npos) return 3;
    return 0;
  });
  EXPECT_EQ(rc, 0);
  EXPECT_TRUE(state.PoolAllocate(*id, kMiB, 0, false).ok()) << "the parent still allocates";
}

}  // namespace
}  // namespace vmm
