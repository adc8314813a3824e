// Tests of the process's pools and imports behind the C interface (process_state.h), on the
// host backend. Each test uses a ProcessState of its own.
#include "torch_plugin/process_state.h"

#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "allocator/cuda_driver.h"
#include "allocator/descriptor.h"
#include "allocator/driver_factory.h"
#include "allocator/import_closer.h"
#include "allocator/mutex.h"
#include "allocator/send_acker.h"
#include "allocator/send_ledger.h"
#include "allocator/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/hold_journal.h"
#include "tests/sanitizers.h"

namespace vmm {
namespace {

using ::testing::HasSubstr;

constexpr size_t kMiB = size_t{1} << 20;
constexpr char kHostOptions[] = "reserve_size=256M";
// A pool whose sends move a block that shares a chunk (PoolOptions::isolate_sends).
constexpr char kIsolatedOptions[] = "reserve_size=256M,isolate_sends=1";

class ProcessStateTest : public ::testing::Test {
 protected:
  absl::StatusOr<int64_t> HostPool(absl::string_view options = kHostOptions) {
    return state_.CreatePool(Backend::kHost, 0, options);
  }

  // Uses private pool (id0, id1) of host device 0 (made with `options` if new): its id and
  // entry.
  struct PrivateEntry {
    int64_t id = 0;
    std::shared_ptr<ProcessState::ExplicitPool> entry;
  };
  absl::StatusOr<PrivateEntry> UsePrivateHostPool(uint64_t id0, uint64_t id1,
                                                   absl::string_view options = "") {
    VMM_ASSIGN_OR_RETURN(int64_t id, state_.UsePrivatePool(Backend::kHost, 0, id0, id1,
                                                           std::string(options)));
    VMM_ASSIGN_OR_RETURN(std::shared_ptr<ProcessState::ExplicitPool> entry, state_.FindPool(id));
    return PrivateEntry{id, std::move(entry)};
  }

  // A MiB block of a host pool filled with `fill`, exported and imported in this process.
  struct Imported {
    void* block = nullptr;
    int64_t import = 0;
    const uint8_t* at = nullptr;  // the import's mapping
  };
  Imported ImportOwnBlock(uint8_t fill) {
    Imported out;
    absl::StatusOr<int64_t> id = HostPool();
    EXPECT_TRUE(id.ok()) << id.status();
    absl::StatusOr<void*> p =
        id.ok() ? state_.PoolAllocate(*id, kMiB, 0, /*shareable=*/true) : id.status();
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return out;
    out.block = *p;
    std::memset(*p, fill, kMiB);
    absl::StatusOr<BufferDescriptor> exported = state_.Export(*p);
    EXPECT_TRUE(exported.ok()) << exported.status();
    absl::StatusOr<int64_t> import =
        exported.ok() ? state_.Import(exported->Encode(), -1, Backend::kHost, false)
                      : exported.status();
    EXPECT_TRUE(import.ok()) << import.status();
    if (!import.ok()) return out;
    out.import = *import;
    absl::StatusOr<ProcessState::ImportInfo> info = state_.GetImportInfo(*import);
    EXPECT_TRUE(info.ok());
    if (info.ok()) out.at = reinterpret_cast<const uint8_t*>(info->ptr);
    return out;
  }

  ProcessState state_;
};

// The plugin's pools keep single chunks unless told (process_state.cc): a tensor sent in place
// spans one handle, and a block of a few hundred KiB goes to the small arena (1 MiB) rather
// than pin the free space of a large chunk against empty_cache().
TEST_F(ProcessStateTest, ExplicitPoolsKeepSingleChunksAndAOneMiBSmallArena) {
  absl::StatusOr<int64_t> id = HostPool("reserve_size=2G");
  ASSERT_TRUE(id.ok()) << id.status();
  Pool* pool = (*state_.FindPool(*id))->pool.get();
  EXPECT_EQ(pool->options().large_page, 0u);
  EXPECT_EQ(pool->options().small_size, kMiB);
  absl::StatusOr<void*> p = state_.PoolAllocate(*id, 24 * kMiB, 0, false);
  ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<BufferDescriptor> d = state_.Export(*p);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->handles().size(), 1u);
  ASSERT_TRUE(state_.FreeBlock(*p).ok());
  absl::StatusOr<void*> activations = state_.PoolAllocate(*id, 256 * kMiB, 0, false);
  ASSERT_TRUE(activations.ok()) << activations.status();
  ASSERT_TRUE(state_.FreeBlock(*activations).ok());
  absl::StatusOr<void*> kept = state_.PoolAllocate(*id, 512 * 1024, 0, false);
  ASSERT_TRUE(kept.ok()) << kept.status();
  ASSERT_TRUE(pool->EmptyCache().ok());
  EXPECT_LE(pool->GetStats().reserved_bytes.current, static_cast<int64_t>(2 * kMiB))
      << "empty_cache() left a large chunk mapped for a 512 KiB block";
  ASSERT_TRUE(state_.FreeBlock(*kept).ok());
  ASSERT_TRUE(state_.ClosePool(*id).ok());

  absl::StatusOr<int64_t> paged = HostPool("reserve_size=256M,large_page=8M");
  ASSERT_TRUE(paged.ok()) << paged.status();
  EXPECT_EQ((*state_.FindPool(*paged))->pool->options().large_page, 8 * kMiB);
  EXPECT_EQ((*state_.FindPool(*paged))->pool->options().small_size, 256 * 1024u);
  ASSERT_TRUE(state_.ClosePool(*paged).ok());
}

TEST_F(ProcessStateTest, ExplicitPoolsAllocateFreeAndClose) {
  absl::StatusOr<int64_t> id = HostPool();
  ASSERT_TRUE(id.ok()) << id.status();
  absl::StatusOr<void*> p = state_.PoolAllocate(*id, kMiB, 0, false);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(state_.Owner(*p).pool, (*state_.FindPool(*id))->pool.get());
  EXPECT_EQ(state_.AllPools().size(), 1u);
  ASSERT_TRUE(state_.FreeBlock(*p).ok());
  ASSERT_TRUE(state_.ClosePool(*id).ok());
  EXPECT_EQ(state_.FindPool(*id).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(state_.AllPools().empty()) << "closed and empty: destroyed";
}

TEST_F(ProcessStateTest, ARequestNoDeviceCouldHoldIsInvalidBeforeAnyPoolExists) {
  for (size_t size : {size_t{1} << 47, SIZE_MAX}) {
    absl::StatusOr<void*> p = state_.DeviceAllocate(0, size, 0);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << p.status();
    EXPECT_THAT(p.status().message(), HasSubstr("more than any device holds"));
  }
  EXPECT_EQ(state_.DevicePoolIfAny(0), nullptr) << "a pool was created (and its range reserved)";
  absl::StatusOr<int64_t> id = HostPool();
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(state_.PoolAllocate(*id, size_t{1} << 47, 0, false).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<void*> fine = state_.DeviceAllocate(0, kMiB, 0);
  ASSERT_TRUE(fine.ok()) << fine.status();
  EXPECT_TRUE(state_.FreeBlock(*fine).ok());
  ASSERT_TRUE(state_.ClosePool(*id).ok());
}

TEST_F(ProcessStateTest, AClosedPoolLivesUntilItsLastBlockIsFreed) {
  absl::StatusOr<int64_t> id = HostPool();
  ASSERT_TRUE(id.ok()) << id.status();
  void* a = *state_.PoolAllocate(*id, kMiB, 0, false);
  void* b = *state_.PoolAllocate(*id, kMiB, 0, false);
  ASSERT_TRUE(state_.ClosePool(*id).ok());
  EXPECT_EQ(state_.ClosePool(*id).code(), absl::StatusCode::kInvalidArgument) << "twice";
  EXPECT_EQ(state_.PoolAllocate(*id, kMiB, 0, false).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(state_.FreeBlock(a).ok());
  EXPECT_EQ(state_.AllPools().size(), 1u) << "b still lives";
  {
    // A pool handed out stays valid while held, even when its last block goes meanwhile.
    std::vector<ProcessState::PoolRef> held = state_.AllPools();
    ASSERT_TRUE(state_.FreeBlock(b).ok());
    EXPECT_TRUE(state_.AllPools().empty());
    // Still a pool to ask (ASan would catch a freed one), with nothing allocated in it.
    EXPECT_EQ(held[0].pool->GetStats().allocation.current, 0);
    EXPECT_TRUE(held[0].pool->CheckInvariants().ok());
  }
  EXPECT_EQ(state_.FreeBlock(b).code(), absl::StatusCode::kInvalidArgument) << "double free";
}

TEST_F(ProcessStateTest, BadArgumentsAreInvalidArgument) {
  EXPECT_EQ(HostPool("bogus=1").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(state_.CreatePool(Backend::kHost, -1, "").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(state_.CreatePool(Backend::kHost, 7, kHostOptions).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(state_.DevicePool(-1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(state_.DevicePool(ProcessState::kMaxDevices).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Past the devices the process tracks (a cap and statistics each), refused before the driver
  // is asked (whose own limit may be higher), as DevicePool.
  for (absl::Status status :
       {state_.CreatePool(Backend::kHost, ProcessState::kMaxDevices, kHostOptions).status(),
        state_.UsePrivatePool(Backend::kHost, ProcessState::kMaxDevices, 1, 2, "").status()}) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), HasSubstr("is out of range")) << status;
  }
  EXPECT_EQ(state_.SetMemoryFraction(-0.5, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(state_.SetMemoryFraction(1.5, 0).code(), absl::StatusCode::kInvalidArgument);
  int local = 0;
  EXPECT_EQ(state_.FreeBlock(&local).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(state_.Export(&local).status().message(), HasSubstr("does not belong to a vmm pool"));
  EXPECT_EQ(state_.AddImportRef(12345, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(state_.GetImportInfo(12345).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(state_.Import("not a descriptor", -1, std::nullopt, false).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ProcessStateTest, ConfigureWorksOnlyBeforeTheFirstDevicePool) {
  EXPECT_EQ(state_.Configure("growth_fraction=7").code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(state_.Configure("growth_fraction=0.5").ok());
  setenv("VMM_BACKEND", "host", 1);
  absl::StatusOr<Pool*> pool = state_.DevicePool(0);
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ(state_.DevicePoolIfAny(0), *pool);
  EXPECT_EQ(state_.DevicePoolIfAny(1), nullptr);
  EXPECT_EQ(state_.Configure("growth_fraction=0").code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(state_.SetMemoryFraction(0.5, 0).ok());
  unsetenv("VMM_BACKEND");
}

// A memory fraction set before anything else (vmm_torch.set_per_process_memory_fraction,
// which may run before CUDA is) loads no driver: cuInit then would break a fork() the program
// makes later and fix CUDA_VISIBLE_DEVICES early. Its device is checked against the driver
// once one is loaded. In a process of its own (re-run, not forked), where nothing loaded one.
TEST(ProcessStateFreshTest, AFractionSetBeforeTheDriverIsLoadedLoadsNone) {
  const std::string style = GTEST_FLAG_GET(death_test_style);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        unsetenv("VMM_BACKEND");
        ProcessState state;
        const bool set = state.SetMemoryFraction(0.5, 3).ok();
        _exit(!set ? 1 : LoadedCudaDriver() != nullptr ? 2 : 0);
      },
      ::testing::ExitedWithCode(0), "");
  GTEST_FLAG_SET(death_test_style, style);  // later death tests fork again
  // With a driver in use (the host backend here), the same device is refused.
  setenv("VMM_BACKEND", "host", 1);
  ProcessState state;
  EXPECT_EQ(state.SetMemoryFraction(0.5, 3).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(state.SetMemoryFraction(0.5, 0).ok());
  unsetenv("VMM_BACKEND");
}

// A block moved beside one of a closed pool whose last block is freed between AllocateBeside
// finding the pool and counting the new block there (forced by the hook): refused, the pool
// gone, rather than a block of a pool destroyed under it.
void* beside_hook_block = nullptr;
TEST_F(ProcessStateTest, ABlockBesideOneOfAPoolThatWentMeanwhileIsRefused) {
  absl::StatusOr<int64_t> id = HostPool("reserve_size=256M,handle_type=posix_fd");
  ASSERT_TRUE(id.ok()) << id.status();
  absl::StatusOr<void*> last = state_.PoolAllocate(*id, 4096, 0, false);
  ASSERT_TRUE(last.ok()) << last.status();
  ASSERT_TRUE(state_.ClosePool(*id).ok());  // destroyed with its last block
  beside_hook_block = *last;
  state_.SetBesideHookForTesting([](ProcessState& state, const void*) {
    ASSERT_TRUE(state.FreeBlock(beside_hook_block).ok());  // the pool goes now
  });
  absl::StatusOr<void*> beside = state_.AllocateBeside(*last, 4096, 0);
  state_.SetBesideHookForTesting(nullptr);
  EXPECT_EQ(beside.status().code(), absl::StatusCode::kInvalidArgument) << beside.status();
  EXPECT_THAT(beside.status().message(), HasSubstr("its pool went with its last block"));
  EXPECT_EQ(state_.Owner(*last).pool, nullptr);
}

TEST_F(ProcessStateTest, ExportThenImportSharesTheBytesAndCountsReferences) {
  absl::StatusOr<int64_t> id = HostPool("reserve_size=256M,handle_type=posix_fd");
  ASSERT_TRUE(id.ok()) << id.status();
  void* p = *state_.PoolAllocate(*id, 4 * kMiB, 0, false);
  std::memset(p, 0x5a, 4 * kMiB);
  absl::StatusOr<BufferDescriptor> d = state_.Export(p);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->backend(), Backend::kHost);
  // The backend comes from the descriptor: no backend argument needed.
  absl::StatusOr<int64_t> import = state_.Import(d->Encode(), -1, std::nullopt, false);
  ASSERT_TRUE(import.ok()) << import.status();
  absl::StatusOr<ProcessState::ImportInfo> info = state_.GetImportInfo(*import);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->size, 4 * kMiB);
  EXPECT_EQ(info->device, -1) << "host memory";
  EXPECT_NE(info->ptr, reinterpret_cast<DevPtr>(p)) << "a mapping of its own";
  EXPECT_EQ(reinterpret_cast<const unsigned char*>(info->ptr)[4 * kMiB - 1], 0x5a);
  ASSERT_TRUE(state_.AddImportRef(*import, +1).ok());
  ASSERT_TRUE(state_.AddImportRef(*import, -1).ok());
  EXPECT_EQ(state_.import_count(), 1u);
  ASSERT_TRUE(state_.AddImportRef(*import, -1).ok());
  EXPECT_EQ(state_.import_count(), 0u) << "the last reference unmaps";
  ASSERT_TRUE(state_.FreeBlock(p).ok());
}

TEST_F(ProcessStateTest, ImportingOnTheWrongBackendIsAClearError) {
  absl::StatusOr<int64_t> id = HostPool("reserve_size=256M,handle_type=posix_fd");
  ASSERT_TRUE(id.ok()) << id.status();
  void* p = *state_.PoolAllocate(*id, kMiB, 0, false);
  absl::StatusOr<BufferDescriptor> d = state_.Export(p);
  ASSERT_TRUE(d.ok()) << d.status();
  absl::StatusOr<int64_t> import = state_.Import(d->Encode(), -1, Backend::kCuda, false);
  EXPECT_FALSE(import.ok());
  EXPECT_NE(import.status().code(), absl::StatusCode::kOk);
  ASSERT_TRUE(state_.FreeBlock(p).ok());
}

// A GPU buffer imported where only the host backend is: the error names the owner (the
// default backend is asked, and ImportBuffer says it cannot map that owner's memory).
TEST_F(ProcessStateTest, AGpuBufferOnTheHostBackendIsRefusedNamingItsOwner) {
  setenv("VMM_BACKEND", "host", 1);
  absl::StatusOr<BufferDescriptor> d = BufferDescriptor::FromHandles(
      HandleType::kFabric, {std::string(64, '\1')}, {int64_t{2} << 20}, std::nullopt,
      std::string("GPU-12345678-aaaa-bbbb-cccc-0123456789ab"));
  ASSERT_TRUE(d.ok()) << d.status();
  absl::StatusOr<int64_t> import = state_.Import(d->Encode(), -1, std::nullopt, false);
  EXPECT_EQ(import.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(import.status().message(), HasSubstr("GPU-12345678"));
  unsetenv("VMM_BACKEND");
}

// Closing a pool while other threads allocate from it never destroys it under an allocation:
// every block handed out stays valid and is freed, and the pool goes with the last one.
TEST_F(ProcessStateTest, ClosingAPoolWhileOthersAllocateIsSafe) {
  for (int round = 0; round < 20; ++round) {
    absl::StatusOr<int64_t> id = HostPool("reserve_size=64M");
    ASSERT_TRUE(id.ok()) << id.status();
    std::atomic<int> freed_bad{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 3; ++t) {
      threads.emplace_back([&] {
        for (int i = 0; i < 20; ++i) {
          absl::StatusOr<void*> p = state_.PoolAllocate(*id, 4096, 0, false);
          if (!p.ok()) continue;  // closed meanwhile: a clean refusal
          std::memset(*p, 0x3c, 4096);
          if (!state_.FreeBlock(*p).ok()) freed_bad.fetch_add(1);
        }
      });
    }
    EXPECT_TRUE(state_.ClosePool(*id).ok());
    for (std::thread& t : threads) t.join();
    EXPECT_EQ(freed_bad.load(), 0);
    EXPECT_TRUE(state_.AllPools().empty());
  }
}

// --- Private pools -------------------------------------------------------------------------

TEST_F(ProcessStateTest, APrivatePoolTakesTheDevicePoolsOptionsAndKeepsItsMemory) {
  ASSERT_TRUE(state_.Configure("reserve_size=128M,release_threshold=0").ok());
  absl::StatusOr<PrivateEntry> opened = UsePrivateHostPool(5, 6);
  ASSERT_TRUE(opened.ok()) << opened.status();
  const int64_t id = opened->id;
  Pool& pool = *opened->entry->pool;
  EXPECT_TRUE(pool.keeps_memory());
  EXPECT_EQ(pool.GetSnapshot().reserved_size, 128 * kMiB) << "the device pools' options";
  void* p = *state_.PoolAllocate(id, 4 * kMiB, 0, false);
  ASSERT_TRUE(state_.FreeBlock(p).ok());
  EXPECT_EQ(pool.GetStats().reserved_bytes.current, static_cast<int64_t>(4 * kMiB))
      << "release_threshold=0 releases nothing while the pool keeps its memory";
  EXPECT_EQ(state_.ClosePool(id).code(), absl::StatusCode::kFailedPrecondition);
  // Tagged in snapshots, and counted in the stats of its GPU.
  bool tagged = false;
  for (const Snapshot& snap : state_.Snapshots()) {
    if (snap.pool_id != id) continue;
    tagged = snap.mempool_id[0] == 5 && snap.mempool_id[1] == 6;
  }
  EXPECT_TRUE(tagged);
  setenv("VMM_BACKEND", "host", 1);
  EXPECT_EQ(state_.DeviceStats(0).reserved_bytes.current, static_cast<int64_t>(4 * kMiB));
  unsetenv("VMM_BACKEND");
  EXPECT_EQ(state_.DevicePools(1).size(), 0u);
  opened->entry.reset();
  absl::StatusOr<int> left = state_.ReleasePrivatePool(0, 5, 6);
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_EQ(*left, 0);
  EXPECT_TRUE(state_.AllPools().empty());
  EXPECT_EQ(state_.ReleasePrivatePool(0, 5, 6).status().code(), absl::StatusCode::kNotFound);
}

// DeviceUsage (what the profiler's memory events report at every allocation) gives what
// DeviceStats sums over the GPU's pools, through the device pool's and private pools'
// allocations, exports, frees, a pool released with a block left, its last free, empty_cache
// and a memory fraction, without visiting the pools.
TEST_F(ProcessStateTest, DeviceUsageIsWhatTheDevicesStatisticsSay) {
  setenv("VMM_BACKEND", "host", 1);  // the device pool on the private pools' backend
  struct Unset {
    ~Unset() { unsetenv("VMM_BACKEND"); }
  } unset;
  auto same = [&](const std::string& when) {
    SCOPED_TRACE(when);
    const PoolStats stats = state_.DeviceStats(0);
    const ProcessState::Usage usage = state_.DeviceUsage(0);
    EXPECT_EQ(usage.allocated, stats.allocated_bytes.current);
    EXPECT_EQ(usage.reserved, stats.reserved_bytes.current);
  };
  same("nothing allocated");
  EXPECT_EQ(state_.DeviceUsage(0).reserved, 0);
  ASSERT_TRUE(state_.Configure("reserve_size=256M").ok());
  absl::StatusOr<void*> a = state_.DeviceAllocate(0, 3 * kMiB + 5, 0);
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<void*> small = state_.DeviceAllocate(0, 4096, 0);
  ASSERT_TRUE(small.ok()) << small.status();
  same("device pool");
  EXPECT_GT(state_.DeviceUsage(0).allocated, static_cast<int64_t>(3 * kMiB));
  std::vector<void*> kept;
  for (uint64_t key = 1; key <= 3; ++key) {
    absl::StatusOr<PrivateEntry> use = UsePrivateHostPool(7700 + key, 1);
    ASSERT_TRUE(use.ok()) << use.status();
    absl::StatusOr<void*> p = state_.PoolAllocate(use->id, key * kMiB, 0, /*shareable=*/true);
    ASSERT_TRUE(p.ok()) << p.status();
    absl::StatusOr<BufferDescriptor> exported = state_.Export(*p);
    ASSERT_TRUE(exported.ok()) << exported.status();
    kept.push_back(*p);
    same(absl::StrCat("private pool ", key));
  }
  ASSERT_TRUE(state_.FreeBlock(kept[0]).ok());
  same("an exported block of a private pool freed");
  ASSERT_TRUE(state_.ReleasePrivatePool(0, 7702, 1).ok());
  same("a private pool released with a block left");
  ASSERT_TRUE(state_.FreeBlock(kept[1]).ok());
  same("its last block freed: the pool is gone");
  ASSERT_TRUE(state_.SetMemoryFraction(0.5, 0).ok());
  ASSERT_TRUE(state_.FreeBlock(*a).ok());
  ASSERT_TRUE(state_.FreeBlock(*small).ok());
  same("the device pool's blocks freed");
  for (const ProcessState::PoolRef& p : state_.DevicePools(0)) {
    ASSERT_TRUE(p.pool->EmptyCache().ok());  // as vmm_empty_cache does
  }
  same("empty_cache");
  EXPECT_LT(state_.DeviceUsage(0).reserved, static_cast<int64_t>(8 * kMiB));
  ASSERT_TRUE(state_.ReleasePrivatePool(0, 7701, 1).ok());
  ASSERT_TRUE(state_.FreeBlock(kept[2]).ok());
  ASSERT_TRUE(state_.ReleasePrivatePool(0, 7703, 1).ok());
  same("every private pool gone");
  EXPECT_EQ(state_.DeviceUsage(0).allocated, 0);
}

// A private pool that is gone leaves its totals in its GPU's statistics, the releases of its
// teardown included (its chunks go with it, after its figures were taken): a GPU's
// num_device_free and driver calls of release catch up with its growths, whether the pool
// went at its release or with its last block.
TEST_F(ProcessStateTest, AGonePrivatePoolLeavesItsReleasesInItsGpusStatistics) {
  // The GPU's statistics on the private pools' backend, until the test ends however it ends.
  setenv("VMM_BACKEND", "host", 1);
  struct Unset {
    ~Unset() { unsetenv("VMM_BACKEND"); }
  } unset;
  const PoolStats before = state_.DeviceStats(0);
  for (bool free_first : {true, false}) {
    SCOPED_TRACE(free_first ? "freed, then released" : "released, then freed");
    absl::StatusOr<PrivateEntry> use = UsePrivateHostPool(9100 + free_first, 1);
    ASSERT_TRUE(use.ok()) << use.status();
    absl::StatusOr<void*> p = state_.PoolAllocate(use->id, 8 * kMiB, 0, false);
    ASSERT_TRUE(p.ok()) << p.status();
    use->entry.reset();
    if (free_first) {
      ASSERT_TRUE(state_.FreeBlock(*p).ok());
    }
    ASSERT_TRUE(state_.ReleasePrivatePool(0, 9100 + free_first, 1).ok());
    if (!free_first) {
      ASSERT_TRUE(state_.FreeBlock(*p).ok());
    }
  }
  const PoolStats after = state_.DeviceStats(0);
  EXPECT_EQ(after.reserved_bytes.current, before.reserved_bytes.current);
  EXPECT_EQ(after.segment.current, before.segment.current);
  EXPECT_GE(after.num_device_alloc - before.num_device_alloc, 2);
  EXPECT_EQ(after.num_device_free - before.num_device_free,
            after.segment.allocated - before.segment.allocated);
  EXPECT_EQ(after.driver_release - before.driver_release,
            after.driver_create - before.driver_create);
  EXPECT_EQ(after.segment.freed - before.segment.freed,
            after.segment.allocated - before.segment.allocated);
}

// What a hook of Retire does (SetRetireHookForTesting). As Retire starts, it resets the GPU's
// cumulative figures, then empties the going pool's cache if asked, as another thread's
// reset_accumulated_memory_stats() and empty_cache() may. Once the pool's figures are frozen
// (under the lock that orders resets with Retire), it starts a thread that resets them and
// notes whether that reset ended before the hook did (it must wait for the pool to be gone).
struct RetireHookPlan {
  ProcessState::RetireStage stage = ProcessState::RetireStage::kStarting;
  Pool* empty = nullptr;
  std::thread resetter;
  std::atomic<bool> reset_done{false};
  bool reset_done_in_window = false;
};
RetireHookPlan* retire_hook_plan = nullptr;
void ResetInRetire(ProcessState& state, int device, ProcessState::RetireStage stage) {
  RetireHookPlan& plan = *retire_hook_plan;
  if (stage != plan.stage) return;
  if (stage == ProcessState::RetireStage::kStarting) {
    state.ResetDeviceAccumulated(device);
    if (plan.empty != nullptr) {
      ASSERT_TRUE(plan.empty->EmptyCache().ok());
    }
    return;
  }
  plan.resetter = std::thread([&state, &plan, device] {
    state.ResetDeviceAccumulated(device);
    plan.reset_done = true;
  });
  absl::SleepFor(absl::Milliseconds(50));
  plan.reset_done_in_window = plan.reset_done;
}

// A reset of the GPU's cumulative figures that comes while a private pool goes leaves none of
// the pool's figures from before it, as PyTorch's reset under its lock would, and keeps what
// came after it: a release of the pool's cached chunk by an empty_cache. A reset asked once
// the pool's figures are frozen waits for them to join the GPU's totals, then clears them.
TEST_F(ProcessStateTest, AResetWhileAPrivatePoolGoesKeepsOnlyWhatCameAfterIt) {
  setenv("VMM_BACKEND", "host", 1);
  struct Unset {
    ProcessState& state;
    ~Unset() {
      unsetenv("VMM_BACKEND");
      state.SetRetireHookForTesting(nullptr);
      retire_hook_plan = nullptr;
    }
  } unset{state_};
  uint64_t id0 = 9200;
  for (int variant = 0; variant < 3; ++variant) {
    const bool frozen = variant == 2;
    const bool empty_cache = variant == 1;
    SCOPED_TRACE(frozen ? "reset once the figures are frozen"
                        : empty_cache ? "reset as Retire starts, then empty_cache"
                                      : "reset as Retire starts");
    absl::StatusOr<PrivateEntry> use = UsePrivateHostPool(++id0, 1);
    ASSERT_TRUE(use.ok()) << use.status();
    for (int i = 0; i < 3; ++i) {
      absl::StatusOr<void*> p = state_.PoolAllocate(use->id, 8 * kMiB, 0, false);
      ASSERT_TRUE(p.ok()) << p.status();
      ASSERT_TRUE(state_.FreeBlock(*p).ok());
    }
    const int64_t chunks = use->entry->pool->GetStats().segment.current;
    ASSERT_GE(chunks, 1);
    RetireHookPlan plan;
    plan.stage = frozen ? ProcessState::RetireStage::kFrozen : ProcessState::RetireStage::kStarting;
    plan.empty = empty_cache ? use->entry->pool.get() : nullptr;
    retire_hook_plan = &plan;
    use->entry.reset();
    ASSERT_GE(state_.DeviceStats(0).allocation.allocated, 3);
    state_.SetRetireHookForTesting(&ResetInRetire);
    ASSERT_TRUE(state_.ReleasePrivatePool(0, id0, 1).ok());
    state_.SetRetireHookForTesting(nullptr);
    if (plan.resetter.joinable()) plan.resetter.join();
    EXPECT_EQ(frozen, plan.reset_done.load());
    EXPECT_FALSE(plan.reset_done_in_window) << "a reset ended inside Retire's window";
    const PoolStats after = state_.DeviceStats(0);
    EXPECT_EQ(after.allocation.allocated, 0);
    EXPECT_EQ(after.allocation.freed, 0);
    EXPECT_EQ(after.allocated_bytes.allocated, 0);
    EXPECT_EQ(after.allocated_bytes.freed, 0);
    EXPECT_EQ(after.num_device_alloc, 0) << "the pool's growth came before the reset";
    // Its chunks are released after a reset as Retire starts, by the empty_cache or by its
    // teardown; a reset that waited for Retire clears those too.
    const int64_t released = frozen ? 0 : chunks;
    EXPECT_EQ(after.segment.freed, released);
    EXPECT_EQ(after.num_device_free, released);
    EXPECT_EQ(after.driver_release, released);
  }
}

// A private pool keeps its memory, so nothing in it moves: with pages it still reserves
// twice the GPU's memory, not the wider range of a pool that moves them (pool_options.h
// reserve_size), which a process holding a graph pool each would run out of.
TEST_F(ProcessStateTest, APrivatePoolWithPagesReservesTheRangeOfAPoolWithoutPages) {
  ASSERT_TRUE(state_.Configure("large_page=4M").ok());
  absl::StatusOr<PrivateEntry> opened = UsePrivateHostPool(7, 8);
  ASSERT_TRUE(opened.ok()) << opened.status();
  Pool& pool = *opened->entry->pool;
  ASSERT_EQ(pool.options().large_page, 4 * kMiB);
  absl::StatusOr<MemInfo> info = pool.driver()->GetMemInfo(0);
  ASSERT_TRUE(info.ok()) << info.status();
  // Twice the memory for the large arena, but for an eighth of it, and the memory itself for
  // the small arena (pool_options.h range_grows; the host GPU's memory is whole granules).
  EXPECT_EQ(pool.GetSnapshot().reserved_size, info->total + 2 * info->total - info->total / 4);
  opened->entry.reset();
  ASSERT_TRUE(state_.ReleasePrivatePool(0, 7, 8).ok());
  // A private pool that asks for its range gets it.
  opened = UsePrivateHostPool(7, 9, "reserve_size=64M");
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ(opened->entry->pool->GetSnapshot().reserved_size, 64 * kMiB);
  opened->entry.reset();
  ASSERT_TRUE(state_.ReleasePrivatePool(0, 7, 9).ok());
}

TEST_F(ProcessStateTest, PrivatePoolUsesAreCountedAcrossThreads) {
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i) {
        const uint64_t id0 = static_cast<uint64_t>((t + i) % 3);
        absl::StatusOr<int64_t> id =
            state_.UsePrivatePool(Backend::kHost, 0, id0, 0, "reserve_size=64M");
        if (!id.ok()) {
          failures.fetch_add(1);
          continue;
        }
        // Held by this use: open, and the same pool as FindPrivatePool's.
        absl::StatusOr<void*> p = state_.PoolAllocate(*id, 64 * 1024, 0, false);
        if (!p.ok() || state_.FindPrivatePool(0, id0, 0).value_or(-1) != *id) {
          failures.fetch_add(1);
        }
        if (p.ok() && !state_.FreeBlock(*p).ok()) failures.fetch_add(1);
        if (!state_.ReleasePrivatePool(0, id0, 0).ok()) failures.fetch_add(1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  for (uint64_t id0 : {0, 1, 2}) EXPECT_EQ(state_.PrivatePoolUses(0, id0, 0), 0);
  EXPECT_TRUE(state_.AllPools().empty()) << "every private pool closed and destroyed";
}

// --- Sends ---------------------------------------------------------------------------------

TEST_F(ProcessStateTest, ASentBlockIsFreedOnlyOnceItsReceiverAcknowledges) {
  absl::StatusOr<int64_t> id = HostPool();
  ASSERT_TRUE(id.ok()) << id.status();
  absl::StatusOr<void*> p = state_.PoolAllocate(*id, kMiB, 0, /*shareable=*/true);
  ASSERT_TRUE(p.ok()) << p.status();
  std::memset(*p, 0x5a, kMiB);
  ASSERT_EQ(state_.KindOfSend(*p), ProcessState::SendKind::kInPlace);
  absl::StatusOr<ProcessState::Send> send = state_.ExportSend(*p);
  ASSERT_TRUE(send.ok()) << send.status();
  const Pool* pool = state_.Owner(*p).pool;
  const uint64_t live = pool->GetStats().allocated_bytes.current;
  // The owner frees at once: deferred while the send is held.
  ASSERT_TRUE(state_.FreeBlock(*p).ok());
  EXPECT_EQ(state_.block_holds().deferred(), 1u);
  EXPECT_EQ(pool->GetStats().allocated_bytes.current, live);
  // Freed again meanwhile: a double free, refused as one of a block not held is, and nothing
  // changes (the block goes once, at the acknowledgement).
  const absl::Status again = state_.FreeBlock(*p);
  EXPECT_EQ(again.code(), absl::StatusCode::kInvalidArgument) << again;
  EXPECT_THAT(std::string(again.message()), HasSubstr("double free"));
  EXPECT_EQ(state_.block_holds().deferred(), 1u);
  EXPECT_EQ(pool->GetStats().allocated_bytes.current, live);
  // The receiver imports (here, in this process), then acknowledges.
  absl::StatusOr<int64_t> import =
      state_.Import(send->descriptor.Encode(), -1, Backend::kHost, false);
  ASSERT_TRUE(import.ok()) << import.status();
  absl::StatusOr<ProcessState::ImportInfo> info = state_.GetImportInfo(*import);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(reinterpret_cast<const uint8_t*>(info->ptr)[kMiB - 1], 0x5a);
  ASSERT_TRUE(AckSend(send->ticket).ok());
  EXPECT_EQ(state_.block_holds().held(), 0u);
  EXPECT_LT(pool->GetStats().allocated_bytes.current, live) << "freed at the acknowledgement";
  EXPECT_EQ(reinterpret_cast<const uint8_t*>(info->ptr)[0], 0x5a) << "the import is its own";
  EXPECT_EQ(AckSend(send->ticket).code(), absl::StatusCode::kNotFound) << "only once";
  ASSERT_TRUE(state_.AddImportRef(*import, -1).ok());
  // A second ack settled it (as a payload imported twice): the report finds nothing.
  EXPECT_EQ(ReportSends({send->ticket}, SendReport::kReleased).code(),
            absl::StatusCode::kNotFound);
}

// By default a block is sent where it is, its chunk exported with its neighbours (PyTorch's
// model: the tensor keeps its address). The chunk's free space retires while the receiver maps
// it, and comes back, neighbours still live, once the receiver reports its release.
TEST_F(ProcessStateTest, ABlockSharingAChunkIsSentInPlaceAndItsChunkComesBackOnRelease) {
  absl::StatusOr<int64_t> id = HostPool("reserve_size=256M,handle_type=posix_fd");
  ASSERT_TRUE(id.ok()) << id.status();
  // Three blocks of one small chunk: a is sent, b freed meanwhile, c lives on.
  absl::StatusOr<void*> a = state_.PoolAllocate(*id, 4096, 0, false);
  absl::StatusOr<void*> b = state_.PoolAllocate(*id, 4096, 0, false);
  absl::StatusOr<void*> c = state_.PoolAllocate(*id, 4096, 0, false);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  Pool* pool = state_.Owner(*a).pool;
  ASSERT_TRUE(*pool->SharesChunks(*a));
  std::memset(*a, 0x11, 4096);
  std::memset(*c, 0x33, 4096);
  EXPECT_EQ(state_.KindOfSend(*a), ProcessState::SendKind::kInPlace);
  EXPECT_EQ(state_.PrepareSend(*a), ProcessState::SendKind::kInPlace);
  EXPECT_EQ(pool->GetStats().exported_bytes.current, 0) << "preparing marks nothing";
  EXPECT_EQ(state_.KindOfSend(static_cast<char*>(*a) + 8), ProcessState::SendKind::kNotVmm);
  const uint64_t held_before = SendLedger::Get().GetStats().held_bytes;
  absl::StatusOr<ProcessState::Send> send = state_.ExportSend(*a);
  ASSERT_TRUE(send.ok()) << send.status();
  const BufferDescriptor& d = send->descriptor;
  EXPECT_EQ(d.size(), 4096u);
  ASSERT_EQ(d.sizes().size(), 1u);
  const auto chunk = static_cast<int64_t>(d.sizes()[0]);
  EXPECT_EQ(SendLedger::Get().GetStats().held_bytes, held_before + chunk)
      << "the chunk it was the first to export";
  EXPECT_EQ(pool->GetStats().exported_bytes.current, chunk);
  // A second send from the chunk holds only its block; its receiver is quick (no import).
  absl::StatusOr<ProcessState::Send> send_c = state_.ExportSend(*c);
  ASSERT_TRUE(send_c.ok()) << send_c.status();
  EXPECT_EQ(SendLedger::Get().GetStats().held_bytes, held_before + chunk + 4096);
  state_.ReceivedSend(/*import_id=*/987654321, send_c->ticket);
  EXPECT_EQ(FlushAcks(absl::Seconds(5)), 0u);
  EXPECT_EQ(pool->GetStats().exported_bytes.current, chunk) << "a's receiver maps it";
  // The sender drops a and b; b's space retires (nothing lands where the receiver sees it).
  ASSERT_TRUE(state_.FreeBlock(*a).ok());
  ASSERT_TRUE(state_.FreeBlock(*b).ok());
  absl::StatusOr<void*> elsewhere = state_.PoolAllocate(*id, 4096, 0, false);
  ASSERT_TRUE(elsewhere.ok());
  EXPECT_NE(*elsewhere, *b) << "freed space in an exported chunk is not reused";
  absl::StatusOr<int64_t> import = state_.Import(d.Encode(), -1, Backend::kHost, false);
  ASSERT_TRUE(import.ok()) << import.status();
  state_.ReceivedSend(*import, send->ticket);
  absl::StatusOr<ProcessState::ImportInfo> info = state_.GetImportInfo(*import);
  ASSERT_TRUE(info.ok());
  const auto* bytes = reinterpret_cast<const uint8_t*>(info->ptr);
  EXPECT_EQ(bytes[0], 0x11);
  EXPECT_EQ(bytes[4095], 0x11);
  EXPECT_EQ(info->size, 4096u);
  // The neighbour is mapped too, where it lies beside the block (PyTorch's exposure).
  const ptrdiff_t to_c = static_cast<char*>(*c) - static_cast<char*>(*a);
  EXPECT_EQ(bytes[to_c], 0x33);
  EXPECT_EQ(FlushAcks(absl::Seconds(5)), 0u);
  EXPECT_EQ(state_.block_holds().held(), 0u) << "acknowledged: a's free happened";
  EXPECT_EQ(pool->GetStats().exported_bytes.current, chunk) << "still mapped by the receiver";
  absl::StatusOr<void*> still_elsewhere = state_.PoolAllocate(*id, 4096, 0, false);
  ASSERT_TRUE(still_elsewhere.ok());
  EXPECT_TRUE(*still_elsewhere != *a && *still_elsewhere != *b);
  // Released: c still lives in the chunk, whose mark comes off and whose space is free again.
  ASSERT_TRUE(state_.AddImportRef(*import, -1).ok());
  EXPECT_EQ(FlushCloses(absl::Seconds(5)), 0u);
  EXPECT_EQ(FlushAcks(absl::Seconds(5)), 0u);
  EXPECT_EQ(pool->GetStats().exported_bytes.current, 0);
  absl::StatusOr<void*> again = state_.PoolAllocate(*id, 8192, 0, false);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *a) << "a's and b's retired space is free again, as one block";
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
  for (void* p : {*c, *elsewhere, *still_elsewhere, *again}) {
    ASSERT_TRUE(state_.FreeBlock(p).ok());
  }
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
}

TEST_F(ProcessStateTest, WithIsolatedSendsBlocksSharingAChunkAreRelocated) {
  absl::StatusOr<int64_t> id = HostPool(kIsolatedOptions);
  ASSERT_TRUE(id.ok()) << id.status();
  absl::StatusOr<void*> a = state_.PoolAllocate(*id, 4096, 0, false);
  absl::StatusOr<void*> b = state_.PoolAllocate(*id, 4096, 0, false);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(state_.KindOfSend(*a), ProcessState::SendKind::kRelocate);
  EXPECT_EQ(state_.ExportSend(*a).status().code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<void*> moved = state_.AllocateBeside(*a, 4096, 0);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(state_.KindOfSend(*moved), ProcessState::SendKind::kInPlace);
  EXPECT_EQ(state_.KindOfSend(static_cast<char*>(*a) + 8), ProcessState::SendKind::kNotVmm);
  int local = 0;
  EXPECT_EQ(state_.KindOfSend(&local), ProcessState::SendKind::kNotVmm);
  for (void* p : {*a, *b, *moved}) ASSERT_TRUE(state_.FreeBlock(p).ok());
}

TEST_F(ProcessStateTest, ABlockOfAPoolWithoutHandlesCannotBeSent) {
  absl::StatusOr<int64_t> id = HostPool("reserve_size=256M,handle_type=none");
  ASSERT_TRUE(id.ok()) << id.status();
  absl::StatusOr<void*> p = state_.PoolAllocate(*id, kMiB, 0, false);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(state_.KindOfSend(*p), ProcessState::SendKind::kNotExportable);
  EXPECT_FALSE(state_.ExportSend(*p).ok());
  ASSERT_TRUE(state_.FreeBlock(*p).ok());
}

TEST_F(ProcessStateTest, AnImportIsForwardedAndHeldUntilAcknowledged) {
  const Imported first = ImportOwnBlock(0x33);
  ASSERT_NE(first.at, nullptr);
  ASSERT_EQ(state_.KindOfSend(first.at), ProcessState::SendKind::kImport);
  absl::StatusOr<ProcessState::Send> forward = state_.ExportSend(first.at);
  ASSERT_TRUE(forward.ok()) << forward.status();
  // The original goes, and so does the forwarder's own reference: the send holds the import.
  ASSERT_TRUE(state_.FreeBlock(first.block).ok());
  ASSERT_TRUE(state_.AddImportRef(first.import, -1).ok());
  EXPECT_EQ(state_.import_count(), 1u);
  absl::StatusOr<int64_t> third =
      state_.Import(forward->descriptor.Encode(), -1, Backend::kHost, false);
  ASSERT_TRUE(third.ok()) << third.status();
  absl::StatusOr<ProcessState::ImportInfo> third_info = state_.GetImportInfo(*third);
  ASSERT_TRUE(third_info.ok());
  EXPECT_EQ(reinterpret_cast<const uint8_t*>(third_info->ptr)[7], 0x33);
  ASSERT_TRUE(AckSend(forward->ticket).ok());
  ASSERT_TRUE(state_.AddImportRef(*third, -1).ok());
  EXPECT_EQ(state_.import_count(), 0u) << "the forwarding hold ended with the acknowledgement";
}

// PyTorch's own CUDA IPC of a received storage (`_share_cuda_` of an import): Export forwards
// the import, and a third importer reads the first exporter's bytes after it freed them and
// the forwarder dropped its import.
TEST_F(ProcessStateTest, ExportOfAnImportForwardsIt) {
  const Imported first = ImportOwnBlock(0x5a);
  ASSERT_NE(first.at, nullptr);
  const uint8_t* at = first.at;
  absl::StatusOr<BufferDescriptor> forwarded = state_.Export(at);
  ASSERT_TRUE(forwarded.ok()) << forwarded.status();
  // Only the start of an import: a pointer inside it is nobody's block.
  EXPECT_EQ(state_.Export(at + 4096).status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<int64_t> third =
      state_.Import(forwarded->Encode(), -1, Backend::kHost, false);
  ASSERT_TRUE(third.ok()) << third.status();
  ASSERT_TRUE(state_.FreeBlock(first.block).ok());
  ASSERT_TRUE(state_.AddImportRef(first.import, -1).ok());
  EXPECT_EQ(state_.import_count(), 1u) << "Export took no reference of its own";
  absl::StatusOr<ProcessState::ImportInfo> third_info = state_.GetImportInfo(*third);
  ASSERT_TRUE(third_info.ok());
  EXPECT_EQ(reinterpret_cast<const uint8_t*>(third_info->ptr)[kMiB - 1], 0x5a);
  ASSERT_TRUE(state_.AddImportRef(*third, -1).ok());
  EXPECT_EQ(state_.import_count(), 0u);
}

TEST_F(ProcessStateTest, WithIsolatedSendsASmallBlockIsRelocatedEvenAlone) {
  absl::StatusOr<int64_t> id = HostPool(kIsolatedOptions);
  ASSERT_TRUE(id.ok()) << id.status();
  absl::StatusOr<void*> small = state_.PoolAllocate(*id, 4096, 0, false);
  ASSERT_TRUE(small.ok()) << small.status();
  Pool* pool = state_.Owner(*small).pool;
  ASSERT_TRUE(pool->InSmallArena(*small));
  ASSERT_FALSE(*pool->SharesChunks(*small)) << "alone in its chunk";
  EXPECT_EQ(state_.KindOfSend(*small), ProcessState::SendKind::kRelocate);
  EXPECT_EQ(state_.PrepareSend(*small), ProcessState::SendKind::kRelocate);
  EXPECT_EQ(pool->GetStats().exported_bytes.current, 0) << "its small chunk was marked";
  // A large block alone is sent in place; PrepareSend marks its chunk so that it stays alone.
  absl::StatusOr<void*> large = state_.PoolAllocate(*id, 4 * kMiB, 0, false);
  ASSERT_TRUE(large.ok()) << large.status();
  ASSERT_FALSE(pool->InSmallArena(*large));
  EXPECT_EQ(state_.KindOfSend(*large), ProcessState::SendKind::kInPlace);
  EXPECT_EQ(pool->GetStats().exported_bytes.current, 0) << "KindOfSend marks nothing";
  EXPECT_EQ(state_.PrepareSend(*large), ProcessState::SendKind::kInPlace);
  EXPECT_GE(pool->GetStats().exported_bytes.current, static_cast<int64_t>(4 * kMiB));
  // Where a small block moves: a shareable block, sent in place.
  absl::StatusOr<void*> moved = state_.AllocateBeside(*small, 4096, 0);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_FALSE(pool->InSmallArena(*moved));
  EXPECT_EQ(state_.KindOfSend(*moved), ProcessState::SendKind::kInPlace);
  for (void* p : {*small, *large, *moved}) ASSERT_TRUE(state_.FreeBlock(p).ok());
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
}

// --- What receivers report, and the send budget --------------------------------------------


TEST_F(ProcessStateTest, ASendReceivedByNoImportIsReportedReleasedAtOnce) {
  Journal journal;
  const SendLedger::Ticket ticket = HoldSettled(1, &journal);
  state_.ReceivedSend(/*import_id=*/987654321, ticket);
  EXPECT_EQ(FlushAcks(absl::Seconds(5)), 0u);
  EXPECT_EQ(journal.entries(), (std::vector<std::string>{"release", "settle(true)"}));
  EXPECT_EQ(AckSend(ticket).code(), absl::StatusCode::kNotFound) << "the hold is gone";
}

TEST_F(ProcessStateTest, AReceiverThatUnmapsASendLetsTheSenderReuseItsChunk) {
  absl::StatusOr<int64_t> id = HostPool("reserve_size=256M,handle_type=posix_fd");
  ASSERT_TRUE(id.ok()) << id.status();
  absl::StatusOr<void*> p = state_.PoolAllocate(*id, kMiB, 0, /*shareable=*/true);
  ASSERT_TRUE(p.ok()) << p.status();
  std::memset(*p, 0x44, kMiB);
  Pool* pool = state_.Owner(*p).pool;
  const SendLedger::Stats before = SendLedger::Get().GetStats();
  absl::StatusOr<ProcessState::Send> send = state_.ExportSend(*p);
  ASSERT_TRUE(send.ok()) << send.status();
  ASSERT_TRUE(state_.FreeBlock(*p).ok());  // deferred until the ack
  absl::StatusOr<int64_t> import =
      state_.Import(send->descriptor.Encode(), -1, Backend::kHost, false);
  ASSERT_TRUE(import.ok()) << import.status();
  state_.ReceivedSend(*import, send->ticket);
  EXPECT_EQ(FlushAcks(absl::Seconds(5)), 0u);
  // Acknowledged: the block is freed, its chunk parked while the receiver maps it.
  EXPECT_EQ(state_.block_holds().held(), 0u);
  EXPECT_EQ(pool->GetStats().allocated_bytes.current, 0);
  EXPECT_EQ(pool->SendBytesInUse(), 2 * kMiB);
  EXPECT_EQ(SendLedger::Get().GetStats().awaiting_release, before.awaiting_release + 1);
  // The receiver drops its import: closed on the closing thread, then reported released.
  ASSERT_TRUE(state_.AddImportRef(*import, -1).ok());
  EXPECT_EQ(FlushCloses(absl::Seconds(5)), 0u);
  EXPECT_EQ(FlushAcks(absl::Seconds(5)), 0u);
  EXPECT_EQ(SendLedger::Get().GetStats().awaiting_release, before.awaiting_release);
  EXPECT_EQ(SendLedger::Get().GetStats().released, before.released + 1);
  EXPECT_EQ(pool->SendBytesInUse(), 0u) << "spare, not a send's";
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, static_cast<int64_t>(2 * kMiB));
  // The next send's block takes the chunk.
  absl::StatusOr<void*> q = state_.PoolAllocate(*id, kMiB, 0, /*shareable=*/true);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(*q, *p);
  EXPECT_EQ(pool->GetStats().num_export_reuses, 1);
  ASSERT_TRUE(state_.FreeBlock(*q).ok());
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
}

TEST_F(ProcessStateTest, AReceiverThatSendsTheMemoryOnMakesTheSenderReleaseIt) {
  absl::StatusOr<int64_t> id = HostPool("reserve_size=256M,handle_type=posix_fd");
  ASSERT_TRUE(id.ok()) << id.status();
  absl::StatusOr<void*> p = state_.PoolAllocate(*id, kMiB, 0, /*shareable=*/true);
  ASSERT_TRUE(p.ok()) << p.status();
  Pool* pool = state_.Owner(*p).pool;
  const SendLedger::Stats before = SendLedger::Get().GetStats();
  absl::StatusOr<ProcessState::Send> send = state_.ExportSend(*p);
  ASSERT_TRUE(send.ok()) << send.status();
  ASSERT_TRUE(state_.FreeBlock(*p).ok());
  absl::StatusOr<int64_t> import =
      state_.Import(send->descriptor.Encode(), -1, Backend::kHost, false);
  ASSERT_TRUE(import.ok()) << import.status();
  state_.ReceivedSend(*import, send->ticket);
  absl::StatusOr<ProcessState::ImportInfo> info = state_.GetImportInfo(*import);
  ASSERT_TRUE(info.ok());
  absl::StatusOr<ProcessState::Send> forward =
      state_.ExportSend(reinterpret_cast<const void*>(info->ptr));
  ASSERT_TRUE(forward.ok()) << forward.status();
  ASSERT_TRUE(state_.AddImportRef(*import, -1).ok());  // the forward's hold keeps it
  ASSERT_TRUE(AckSend(forward->ticket).ok());          // its receiver acknowledges
  EXPECT_EQ(state_.import_count(), 0u);
  EXPECT_EQ(FlushCloses(absl::Seconds(5)), 0u);
  EXPECT_EQ(FlushAcks(absl::Seconds(5)), 0u);
  // Reported forwarded: nobody counts the memory's importers, so it is not reused.
  EXPECT_EQ(SendLedger::Get().GetStats().awaiting_release, before.awaiting_release);
  EXPECT_EQ(SendLedger::Get().GetStats().released, before.released);
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, 0) << "kept after a forward";
  EXPECT_EQ(pool->SendBytesInUse(), 0u);
  absl::StatusOr<void*> q = state_.PoolAllocate(*id, kMiB, 0, /*shareable=*/true);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(pool->GetStats().num_export_reuses, 0);
  ASSERT_TRUE(state_.FreeBlock(*q).ok());
}

TEST_F(ProcessStateTest, TheSendBudgetComesFromTheEnvironment) {
  struct Case {
    const char* value;
    uint64_t budget;
  };
  for (const Case& c : {Case{nullptr, uint64_t{1} << 30}, Case{"64M", uint64_t{64} << 20},
                        Case{"0", 0}, Case{"lots", uint64_t{1} << 30}, Case{"", uint64_t{1} << 30}}) {
    if (c.value != nullptr) {
      setenv("VMM_SEND_BUDGET", c.value, 1);
    } else {
      unsetenv("VMM_SEND_BUDGET");
    }
    ProcessState state;
    EXPECT_EQ(state.send_budget(), c.budget) << (c.value != nullptr ? c.value : "(unset)");
  }
  unsetenv("VMM_SEND_BUDGET");
  state_.SetSendBudget(12345);
  EXPECT_EQ(state_.send_budget(), 12345u);
}

// The budget counts unacknowledged sends (the ledger's held bytes: whole chunks, where sends
// are isolated) and blocks moved for a send that have not gone yet; the ledger is the
// process's, so the budget is set above what other tests left held.
TEST_F(ProcessStateTest, OverSendBudgetCountsUnacknowledgedSendsAndMovesNotYetSent) {
  absl::StatusOr<int64_t> id = HostPool("reserve_size=256M,handle_type=posix_fd,isolate_sends=1");
  ASSERT_TRUE(id.ok()) << id.status();
  const uint64_t base = SendLedger::Get().GetStats().held_bytes;
  state_.SetSendBudget(base + 3 * kMiB);
  EXPECT_FALSE(state_.OverSendBudget());
  absl::StatusOr<void*> a = state_.PoolAllocate(*id, kMiB, 0, /*shareable=*/true);
  ASSERT_TRUE(a.ok());
  EXPECT_FALSE(state_.OverSendBudget()) << "memory nobody sends";
  absl::StatusOr<void*> moved = state_.AllocateBeside(*a, kMiB, 0);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_FALSE(state_.OverSendBudget()) << "2 MiB of 3";
  absl::StatusOr<void*> moved2 = state_.AllocateBeside(*a, kMiB, 0);
  ASSERT_TRUE(moved2.ok()) << moved2.status();
  EXPECT_TRUE(state_.OverSendBudget()) << "4 MiB of 3";
  ASSERT_TRUE(state_.FreeBlock(*moved2).ok());
  EXPECT_FALSE(state_.OverSendBudget()) << "freed before it went";
  absl::StatusOr<ProcessState::Send> first = state_.ExportSend(*moved);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(state_.OverSendBudget()) << "sent: counted once, as held";
  absl::StatusOr<ProcessState::Send> second = state_.ExportSend(*a);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_TRUE(state_.OverSendBudget()) << "two unacknowledged sends of 2 MiB";
  ASSERT_TRUE(AckSend(second->ticket).ok());
  EXPECT_FALSE(state_.OverSendBudget()) << "what a receiver imported is its own";
  ASSERT_TRUE(AckSend(first->ticket).ok());
  state_.SetSendBudget(base + kMiB);
  absl::StatusOr<void*> moved3 = state_.AllocateBeside(*a, kMiB, 0);
  ASSERT_TRUE(moved3.ok());
  EXPECT_TRUE(state_.OverSendBudget());
  state_.SetSendBudget(0);
  EXPECT_FALSE(state_.OverSendBudget()) << "no budget";
  const absl::Time start = absl::Now();
  EXPECT_FALSE(state_.WaitForSendRoom(absl::Seconds(10)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  for (void* p : {*a, *moved, *moved3}) ASSERT_TRUE(state_.FreeBlock(p).ok());
  for (const auto& send : {*first, *second}) {
    (void)ReportSends({send.ticket}, SendReport::kReleased);
  }
}

// Over the budget with no memory coming back, a sender waits `stall` once, then not again
// until some comes back.
TEST_F(ProcessStateTest, WaitForSendRoomStopsWaitingOnceStalled) {
  absl::StatusOr<int64_t> id = HostPool("reserve_size=256M,handle_type=posix_fd");
  ASSERT_TRUE(id.ok()) << id.status();
  absl::StatusOr<void*> p = state_.PoolAllocate(*id, kMiB, 0, /*shareable=*/true);
  ASSERT_TRUE(p.ok());
  absl::StatusOr<ProcessState::Send> send = state_.ExportSend(*p);  // never acknowledged here
  ASSERT_TRUE(send.ok()) << send.status();
  state_.SetSendBudget(SendLedger::Get().GetStats().held_bytes - 1);
  ASSERT_TRUE(state_.OverSendBudget());
  absl::Time start = absl::Now();
  EXPECT_TRUE(state_.WaitForSendRoom(absl::Milliseconds(150))) << "it did not wait";
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(140));
  start = absl::Now();
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(state_.WaitForSendRoom(absl::Milliseconds(150)));
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(140)) << "waited again while stalled";
  // Memory comes back somewhere (any release or settle of the ledger): it waits again.
  Journal journal;
  const SendLedger::Ticket other = HoldSettled(1, &journal);
  ASSERT_TRUE(AckSend(other).ok());
  start = absl::Now();
  EXPECT_TRUE(state_.WaitForSendRoom(absl::Milliseconds(150)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(140));
  EXPECT_FALSE(state_.WaitForSendRoom(absl::Milliseconds(150)));
  ASSERT_TRUE(AckSend(send->ticket).ok());
  EXPECT_FALSE(state_.OverSendBudget());
  EXPECT_FALSE(state_.WaitForSendRoom(absl::Milliseconds(150)));
  ASSERT_TRUE(ReportSends({other}, SendReport::kReleased).ok());
  EXPECT_EQ(journal.entries(), (std::vector<std::string>{"release", "settle(true)"}));
  ASSERT_TRUE(state_.FreeBlock(*p).ok());
  (void)ReportSends({send->ticket}, SendReport::kReleased);
}

// While receivers keep acknowledging, a sender waits until its sends hold no more than the
// budget.
TEST_F(ProcessStateTest, WaitForSendRoomWaitsWhileMemoryComesBack) {
  absl::StatusOr<int64_t> id = HostPool("reserve_size=256M,handle_type=posix_fd");
  ASSERT_TRUE(id.ok()) << id.status();
  absl::StatusOr<void*> p = state_.PoolAllocate(*id, kMiB, 0, /*shareable=*/true);
  ASSERT_TRUE(p.ok());
  absl::StatusOr<ProcessState::Send> send = state_.ExportSend(*p);
  ASSERT_TRUE(send.ok()) << send.status();
  ASSERT_TRUE(state_.FreeBlock(*p).ok());
  state_.SetSendBudget(SendLedger::Get().GetStats().held_bytes - 1);
  ASSERT_TRUE(state_.OverSendBudget());
  // Another send is acknowledged after 150 ms (memory comes back, still over), this one after
  // 300 ms (under).
  Journal journal;
  const SendLedger::Ticket other = HoldSettled(1, &journal);
  std::thread receiver([&] {
    absl::SleepFor(absl::Milliseconds(150));
    EXPECT_TRUE(AckSend(other).ok());
    absl::SleepFor(absl::Milliseconds(150));
    EXPECT_TRUE(AckSend(send->ticket).ok());
  });
  const absl::Time start = absl::Now();
  EXPECT_TRUE(state_.WaitForSendRoom(absl::Milliseconds(250)));
  const absl::Duration waited = absl::Now() - start;
  receiver.join();
  EXPECT_GE(waited, absl::Milliseconds(280)) << "returned before this send's ack";
  EXPECT_LT(waited, absl::Milliseconds(550)) << "stalled although memory came back";
  EXPECT_FALSE(state_.OverSendBudget());
  (void)ReportSends({send->ticket, other}, SendReport::kReleased);
}

// Tests make and drop states: a send of a device pool's block that outlives its state must
// touch nothing of it when its receiver reports (the state's device pools are gone).
TEST(ProcessStateLifetimeTest, AReportAfterTheStateIsGoneTouchesNothingOfIt) {
  setenv("VMM_BACKEND", "host", 1);
  SendLedger::Ticket ticket{};
  {
    ProcessState state;
    ASSERT_TRUE(state.Configure("reserve_size=256M,handle_type=posix_fd").ok());
    absl::StatusOr<void*> p = state.DeviceAllocate(0, 4096, 0);
    ASSERT_TRUE(p.ok()) << p.status();
    absl::StatusOr<void*> moved = state.AllocateBeside(*p, 4096, 0);
    ASSERT_TRUE(moved.ok()) << moved.status();
    absl::StatusOr<ProcessState::Send> send = state.ExportSend(*moved);
    ASSERT_TRUE(send.ok()) << send.status();
    ticket = send->ticket;
    ASSERT_TRUE(AckSend(ticket).ok());  // released: the block is freed, its chunk parked
    ASSERT_TRUE(state.FreeBlock(*p).ok());
  }  // the device pool goes with the state
  unsetenv("VMM_BACKEND");
  EXPECT_TRUE(ReportSends({ticket}, SendReport::kReleased).ok());
}

}  // namespace
}  // namespace vmm

namespace vmm {
namespace {

// A large import is closed (unmapped) by the call that drops its last reference, so that its
// unmapping is over when the caller goes on; a small one on the closing thread.
TEST(ProcessStateCloseTest, ALargeImportIsClosedAtOnceASmallOneOnTheClosingThread) {
  ProcessState state;
  absl::StatusOr<int64_t> id =
      state.CreatePool(Backend::kHost, 0, "reserve_size=512M,handle_type=posix_fd");
  ASSERT_TRUE(id.ok()) << id.status();
  const size_t large = ProcessState::kCloseInlineBytes + (2 << 20);
  absl::StatusOr<void*> big = state.PoolAllocate(*id, large, 0, /*shareable=*/true);
  absl::StatusOr<void*> small = state.PoolAllocate(*id, 1 << 20, 0, /*shareable=*/true);
  ASSERT_TRUE(big.ok() && small.ok());
  absl::StatusOr<BufferDescriptor> dbig = state.Export(*big);
  absl::StatusOr<BufferDescriptor> dsmall = state.Export(*small);
  ASSERT_TRUE(dbig.ok() && dsmall.ok());
  ASSERT_EQ(FlushCloses(absl::Seconds(5)), 0u);
  const size_t open = OpenImportMappings();
  absl::StatusOr<int64_t> ibig = state.Import(dbig->Encode(), -1, Backend::kHost, false);
  absl::StatusOr<int64_t> ismall = state.Import(dsmall->Encode(), -1, Backend::kHost, false);
  ASSERT_TRUE(ibig.ok() && ismall.ok());
  EXPECT_EQ(OpenImportMappings(), open + 2);
  ASSERT_TRUE(state.AddImportRef(*ibig, -1).ok());
  EXPECT_EQ(OpenImportMappings(), open + 1) << "the large one is unmapped already";
  ASSERT_TRUE(state.AddImportRef(*ismall, -1).ok());
  EXPECT_EQ(FlushCloses(absl::Seconds(5)), 0u);
  EXPECT_EQ(OpenImportMappings(), open) << "the small one by the closing thread";
  ASSERT_TRUE(state.FreeBlock(*big).ok());
  ASSERT_TRUE(state.FreeBlock(*small).ok());
  ASSERT_TRUE(state.ClosePool(*id).ok());
}

// Private pools (a CUDA graph or a MemPool each) take 2.75 times the GPU's memory of address
// space apiece until the explicit and private pools alive hold the budget (kPoolRangeBudget;
// here three pools' worth); later ones get a quarter of the GPU's memory, which serves what
// fits it, and explicit pools the range of a pool without pages, so that hundreds of them
// leave the process address space. Released, they count no more.
TEST_F(ProcessStateTest, PrivatePoolsPastTheirAddressSpaceBudgetStartSmaller) {
  absl::StatusOr<PrivateEntry> first = UsePrivateHostPool(7000, 1);
  ASSERT_TRUE(first.ok()) << first.status();
  const size_t full = first->entry->pool->reserved_range();
  state_.SetPoolRangeBudgetForTesting(3 * full - 1);
  std::vector<uint64_t> made = {7000};
  for (uint64_t id0 = 7001; id0 < 7003; ++id0) {
    absl::StatusOr<PrivateEntry> use = UsePrivateHostPool(id0, 1);
    ASSERT_TRUE(use.ok()) << use.status();
    made.push_back(id0);
    EXPECT_EQ(use->entry->pool->reserved_range(), full) << "within the budget";
  }
  ASSERT_TRUE(state_.ReleasePrivatePool(0, 7002, 1).ok());
  made.pop_back();
  absl::StatusOr<PrivateEntry> third = UsePrivateHostPool(7003, 1);  // 2 held: within
  ASSERT_TRUE(third.ok()) << third.status();
  made.push_back(7003);
  EXPECT_EQ(third->entry->pool->reserved_range(), full) << "a released pool counts no more";
  absl::StatusOr<PrivateEntry> late = UsePrivateHostPool(7004, 1);  // 3 held: past it
  ASSERT_TRUE(late.ok()) << late.status();
  made.push_back(7004);
  EXPECT_LE(late->entry->pool->reserved_range(), full / 8);
  // It serves what fits a quarter of the GPU's memory, small blocks too.
  absl::StatusOr<void*> big = late->entry->pool->Allocate(64 * kMiB, 0);
  ASSERT_TRUE(big.ok()) << big.status();
  absl::StatusOr<void*> small = late->entry->pool->Allocate(4096, 0);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_TRUE(late->entry->pool->Free(*big).ok());
  EXPECT_TRUE(late->entry->pool->Free(*small).ok());
  // A request past what its range holds but within the GPU's memory is out of memory in this
  // pool (PyTorch's allocator would serve it; torch.cuda.OutOfMemoryError, not a ValueError),
  // refused before any retry; past the GPU's memory it is bad input, as in every pool.
  Pool& late_pool = *late->entry->pool;
  absl::StatusOr<MemInfo> info = late_pool.driver()->GetMemInfo(0);
  ASSERT_TRUE(info.ok()) << info.status();
  const size_t range = late_pool.reserved_range();
  ASSERT_LT(range + kMiB, info->total);
  const int64_t retries = late_pool.GetStats().num_alloc_retries;
  for (size_t size : {range + kMiB, range - kMiB}) {  // the latter: past the large arena
    absl::StatusOr<void*> past = late_pool.Allocate(size, 0);
    EXPECT_EQ(past.status().code(), absl::StatusCode::kResourceExhausted) << past.status();
    EXPECT_THAT(past.status().message(), HasSubstr("address range"));
  }
  EXPECT_EQ(late_pool.GetStats().num_alloc_retries, retries);
  EXPECT_EQ(late_pool.Allocate(info->total + kMiB, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  // An explicit pool made now (past the budget) gets twice the GPU's memory and a small arena
  // of its memory (2.75 times), not the paged default of 32.75 times, and counts too.
  absl::StatusOr<int64_t> explicit_pool = state_.CreatePool(Backend::kHost, 0, "");
  ASSERT_TRUE(explicit_pool.ok()) << explicit_pool.status();
  absl::StatusOr<std::shared_ptr<ProcessState::ExplicitPool>> entry =
      state_.FindPool(*explicit_pool);
  ASSERT_TRUE(entry.ok()) << entry.status();
  EXPECT_EQ((*entry)->pool->reserved_range(), full);
  ASSERT_TRUE(state_.ClosePool(*explicit_pool).ok());
  for (uint64_t id0 : made) ASSERT_TRUE(state_.ReleasePrivatePool(0, id0, 1).ok());
  state_.SetPoolRangeBudgetForTesting(ProcessState::kPoolRangeBudget);
}

// Where the address space runs short (here a limit on the process's), a private pool past the
// budget is still made, in a smaller range, as one within the budget is: the budget saves
// address space and never costs a pool. In a child process (the limit is the whole
// process's); not under the sanitizers, whose shadow memory such a limit would also bound.
TEST_F(ProcessStateTest, APrivatePoolPastTheBudgetIsMadeWhereAddressSpaceRunsShort) {
  if (VMM_UNDER_ASAN || VMM_UNDER_TSAN) {
    GTEST_SKIP() << "a limit on the address space bounds the sanitizers' shadow memory too";
  }
  constexpr size_t kRoom = size_t{10} << 30;  // what the limit leaves above what is mapped
  struct rlimit now;
  ASSERT_EQ(getrlimit(RLIMIT_AS, &now), 0);
  if (now.rlim_max != RLIM_INFINITY) GTEST_SKIP() << "the address space is limited already";
  // The child's exit code: 0 made (the second pool in less than the quarter it asked for),
  // 1 a pool refused, 2 no limit set, 3 a block refused, 4 the second pool's range not cut.
  EXPECT_EXIT(
      {
        ProcessState state;
        state.SetPoolRangeBudgetForTesting(0);  // every private pool after the first is past
        size_t pages = 0;
        std::ifstream("/proc/self/statm") >> pages;
        struct rlimit limit;
        limit.rlim_cur = limit.rlim_max =
            pages * static_cast<size_t>(sysconf(_SC_PAGESIZE)) + kRoom;
        if (setrlimit(RLIMIT_AS, &limit) != 0) _exit(2);
        for (uint64_t id0 : {1, 2}) {
          absl::StatusOr<int64_t> id = state.UsePrivatePool(Backend::kHost, 0, id0, 1, "");
          if (!id.ok()) {
            fprintf(stderr, "pool %d: %s\n", static_cast<int>(id0),
                    std::string(id.status().message()).c_str());
            _exit(1);
          }
          absl::StatusOr<void*> p = state.PoolAllocate(*id, 4 * kMiB, 0, false);
          if (!p.ok() || !state.FreeBlock(*p).ok()) _exit(3);
          absl::StatusOr<std::shared_ptr<ProcessState::ExplicitPool>> entry = state.FindPool(*id);
          if (!entry.ok()) _exit(1);
          const size_t total = (*entry)->pool->driver()->GetMemInfo(0)->total;
          if (id0 == 2 && (*entry)->pool->reserved_range() >= total / 4) _exit(4);
        }
        _exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace vmm
