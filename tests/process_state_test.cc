// Tests of the process's pools and imports behind the C interface (process_state.h), on the
// host backend. Each test uses a ProcessState of its own.
#include "torch_plugin/process_state.h"

#include <cstring>
#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "allocator/descriptor.h"
#include "allocator/driver_factory.h"
#include "allocator/send_ledger.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace vmm {
namespace {

using ::testing::HasSubstr;

constexpr size_t kMiB = size_t{1} << 20;
constexpr char kHostOptions[] = "reserve_size=256M";

class ProcessStateTest : public ::testing::Test {
 protected:
  absl::StatusOr<int64_t> HostPool(absl::string_view options = kHostOptions) {
    return state_.CreatePool(Backend::kHost, 0, options);
  }
  ProcessState state_;
};

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
    EXPECT_TRUE(held[0].pool->GetSnapshot().segments.size() >= 0u);
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
  EXPECT_EQ(state_.SetMemoryFraction(0, 0).code(), absl::StatusCode::kInvalidArgument);
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
}

TEST_F(ProcessStateTest, BlocksSharingAChunkAreRelocatedNotSentInPlace) {
  absl::StatusOr<int64_t> id = HostPool();
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
  absl::StatusOr<int64_t> id = HostPool();
  ASSERT_TRUE(id.ok()) << id.status();
  absl::StatusOr<void*> p = state_.PoolAllocate(*id, kMiB, 0, /*shareable=*/true);
  ASSERT_TRUE(p.ok());
  std::memset(*p, 0x33, kMiB);
  absl::StatusOr<BufferDescriptor> exported = state_.Export(*p);
  ASSERT_TRUE(exported.ok()) << exported.status();
  absl::StatusOr<int64_t> import =
      state_.Import(exported->Encode(), -1, Backend::kHost, false);
  ASSERT_TRUE(import.ok()) << import.status();
  absl::StatusOr<ProcessState::ImportInfo> info = state_.GetImportInfo(*import);
  ASSERT_TRUE(info.ok());
  const void* at = reinterpret_cast<const void*>(info->ptr);
  ASSERT_EQ(state_.KindOfSend(at), ProcessState::SendKind::kImport);
  absl::StatusOr<ProcessState::Send> forward = state_.ExportSend(at);
  ASSERT_TRUE(forward.ok()) << forward.status();
  // The original goes, and so does the forwarder's own reference: the send holds the import.
  ASSERT_TRUE(state_.FreeBlock(*p).ok());
  ASSERT_TRUE(state_.AddImportRef(*import, -1).ok());
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

}  // namespace
}  // namespace vmm
