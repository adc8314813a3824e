// A pool makes no driver call on a foreign stream (driver.h, kForeignStreamBit: one its owner
// may destroy, such as a torch.cuda.ExternalStream) once the allocation that named it has
// returned: another stream takes its cached blocks after a device synchronisation, an export
// beside them synchronises the device, and the stream's own allocations reuse its blocks as
// any stream's do. Runs on the host backend, through a driver wrapper that counts calls on
// destroyed streams (the CUDA driver may crash on them: the drop-in program
// tests/gpu/dropin/case_api_external_stream_destroyed.py).
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>

#include "absl/status/status.h"
#include "allocator/forwarding_driver.h"
#include "allocator/host_driver.h"
#include "allocator/pool.h"
#include "gtest/gtest.h"
#include "tests/pool_helpers.h"
#include "tests/status_matchers.h"

namespace vmm {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

// The host driver, counting every call that names a destroyed stream (and failing it).
class DeadStreamDriver : public ForwardingDriver {
 public:
  using ForwardingDriver::ForwardingDriver;

  int calls_on_dead() {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_on_dead_;
  }

  absl::Status DestroyStream(Stream s) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      dead_.insert(StreamHandle(s));
    }
    return ForwardingDriver::DestroyStream(s);
  }
  absl::StatusOr<bool> StreamCapturing(Stream s) override {
    if (Dead(s)) return absl::InternalError("StreamCapturing on a destroyed stream");
    return ForwardingDriver::StreamCapturing(s);
  }
  absl::Status RecordEvent(Event e, Stream s) override {
    if (Dead(s)) return absl::InternalError("RecordEvent on a destroyed stream");
    return ForwardingDriver::RecordEvent(e, s);
  }
  absl::Status SynchronizeStream(Stream s) override {
    if (Dead(s)) return absl::InternalError("SynchronizeStream on a destroyed stream");
    return ForwardingDriver::SynchronizeStream(s);
  }

 private:
  bool Dead(Stream s) {
    std::lock_guard<std::mutex> lock(mu_);
    if (s == 0 || dead_.count(StreamHandle(s)) == 0) return false;
    ++calls_on_dead_;
    return true;
  }

  std::mutex mu_;
  std::set<Stream> dead_;
  int calls_on_dead_ = 0;
};

class ForeignStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    host_ = NewHostDriver(HostDriverOptions{2 * kMiB, 256 * kMiB});
    driver_ = std::make_unique<DeadStreamDriver>(host_.get());
    owner_stream_ = *driver_->CreateStream(0);
    foreign_ = owner_stream_ | kForeignStreamBit;
    t_ = *driver_->CreateStream(0);
    PoolOptions options = SingleChunkOptions();
    options.reserve_size = 1024 * kMiB;
    pool_ = CreatePoolOrFail(driver_.get(), options);
    ASSERT_NE(pool_, nullptr);
  }
  void TearDown() override {
    if (pool_ != nullptr) {
      EXPECT_OK(pool_->CheckInvariants());
    }
    pool_.reset();
    EXPECT_EQ(driver_->calls_on_dead(), 0) << "no driver call named a destroyed stream";
    EXPECT_OK(driver_->DestroyStream(t_));
    if (!destroyed_) {
      EXPECT_OK(driver_->DestroyStream(owner_stream_));
    }
  }
  // The owner destroys its stream, as cudaStreamDestroy after its work is done.
  void DestroyForeign() {
    ASSERT_OK(driver_->SynchronizeStream(foreign_));
    ASSERT_OK(driver_->DestroyStream(owner_stream_));
    destroyed_ = true;
  }

  std::unique_ptr<Driver> host_;
  std::unique_ptr<DeadStreamDriver> driver_;
  std::unique_ptr<Pool> pool_;
  Stream owner_stream_ = 0, foreign_ = 0, t_ = 0;
  bool destroyed_ = false;
};

TEST_F(ForeignStreamTest, ADestroyedStreamsBlocksWaitForADeviceSyncWithoutCallsOnIt) {
  ASSERT_OK_AND_ASSIGN(void* a, pool_->Allocate(4 * kMiB, foreign_));
  ASSERT_OK_AND_ASSIGN(void* live, pool_->Allocate(kMiB, foreign_));
  ASSERT_OK(pool_->Free(a));  // cached for the foreign stream
  DestroyForeign();
  ASSERT_OK(pool_->Free(live));  // a block of the destroyed stream, freed afterwards
  const int64_t syncs = pool_->GetStats().num_sync_all_streams;
  // A miss on t leaves them tagged (no event on the foreign stream), as PyTorch's allocator
  // keeps every stream's blocks: t grows instead.
  ASSERT_OK_AND_ASSIGN(void* b, pool_->Allocate(4 * kMiB, t_));
  EXPECT_NE(b, a);
  EXPECT_EQ(pool_->GetStats().num_sync_all_streams, syncs);
  ASSERT_OK(pool_->Free(b));
  // EmptyCache synchronises the device and returns them all.
  ASSERT_OK(pool_->EmptyCache());
  EXPECT_EQ(pool_->GetStats().reserved_bytes.current, 0);
}

TEST_F(ForeignStreamTest, TheSameStreamUnmarkedDoesNotReclaimItsMarkedTwin) {
  ASSERT_OK_AND_ASSIGN(void* a, pool_->Allocate(4 * kMiB, foreign_));
  ASSERT_OK(pool_->Free(a));
  const int64_t syncs = pool_->GetStats().num_sync_all_streams;
  ASSERT_OK_AND_ASSIGN(void* b, pool_->Allocate(8 * kMiB, owner_stream_));  // a miss
  EXPECT_EQ(pool_->GetStats().num_sync_all_streams, syncs) << "no device sync for its twin";
  ASSERT_OK(pool_->Free(b));
}

TEST_F(ForeignStreamTest, FreeingExportedMemoryOfADestroyedStreamWaitsOnAFence) {
  ASSERT_OK_AND_ASSIGN(void* a, pool_->Allocate(4 * kMiB, foreign_));
  ASSERT_OK_AND_ASSIGN(void* n, pool_->Allocate(64 << 10, foreign_));
  if (pool_->handle_type() == HandleType::kNone) GTEST_SKIP() << "memory is not exportable";
  ASSERT_OK(pool_->Export(a).status());
  DestroyForeign();
  const int64_t syncs = pool_->GetStats().num_sync_all_streams;
  ASSERT_OK(pool_->Free(a));  // exported: must wait for its stream's work, never calling it
  EXPECT_EQ(pool_->GetStats().num_sync_all_streams, syncs + 1);
  EXPECT_EQ(pool_->GetStats().active.current, 1) << "recycled after the device sync";
  ASSERT_OK(pool_->Free(n));
}

TEST_F(ForeignStreamTest, TheStreamItselfReusesItsBlocksWithoutASync) {
  ASSERT_OK_AND_ASSIGN(void* a, pool_->Allocate(4 * kMiB, foreign_));
  ASSERT_OK(pool_->Free(a));
  const PoolStats before = pool_->GetStats();
  ASSERT_OK_AND_ASSIGN(void* b, pool_->Allocate(4 * kMiB, foreign_));
  EXPECT_EQ(b, a);
  const PoolStats after = pool_->GetStats();
  EXPECT_EQ(after.num_sync_all_streams, before.num_sync_all_streams);
  EXPECT_EQ(after.driver_event, before.driver_event);
  ASSERT_OK(pool_->Free(b));
}

TEST_F(ForeignStreamTest, SnapshotsReportTheStreamWithoutItsMark) {
  ASSERT_OK_AND_ASSIGN(void* a, pool_->Allocate(4 * kMiB, foreign_));
  bool seen = false;
  for (const SegmentInfo& seg : pool_->GetSnapshot().segments) {
    for (const BlockInfo& b : seg.blocks) {
      if (b.addr == reinterpret_cast<uintptr_t>(a)) {
        seen = true;
        EXPECT_EQ(b.stream, owner_stream_);
      }
    }
  }
  EXPECT_TRUE(seen);
  ASSERT_OK(pool_->Free(a));
}

TEST_F(ForeignStreamTest, RecordStreamOnTheSameStreamUnmarkedAddsNoUse) {
  ASSERT_OK_AND_ASSIGN(void* a, pool_->Allocate(4 * kMiB, foreign_));
  ASSERT_OK(pool_->RecordStream(a, owner_stream_));
  ASSERT_OK(pool_->Free(a));
  EXPECT_EQ(pool_->GetStats().active.current, 0) << "no pending free for its own stream";
}

}  // namespace
}  // namespace vmm
