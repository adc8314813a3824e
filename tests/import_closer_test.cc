// Closing imports on the background thread (import_closer.h): CloseLater returns at once and
// the import is closed (unmapped) on the closing thread, in order; FlushCloses waits for what
// was queued; an import sharing its mapping with a live one leaves the mapping (and its unmap
// reports, ImportedBuffer::OnUnmapped) alone; a forked child starts with an empty queue. Runs
// on the backend of tests/test_backend.h (under ThreadSanitizer in CI).
#include "allocator/import_closer.h"

#include <unistd.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "allocator/host_driver.h"
#include "allocator/pool.h"
#include "allocator/sharing.h"
#include "allocator/status_macros.h"
#include "gtest/gtest.h"
#include "tests/sanitizers.h"
#include "tests/status_matchers.h"
#include "tests/subprocess.h"
#include "tests/test_backend.h"

namespace vmm {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

// The thread each OnUnmapped callback ran on, and whether it said forwarded.
class Reports {
 public:
  absl::AnyInvocable<void(bool) &&> Callback() {
    return [this](bool forwarded) {
      std::lock_guard<std::mutex> lock(mu_);
      threads_.push_back(std::this_thread::get_id());
      forwarded_.push_back(forwarded);
    };
  }
  std::vector<std::thread::id> threads() {
    std::lock_guard<std::mutex> lock(mu_);
    return threads_;
  }
  std::vector<bool> forwarded() {
    std::lock_guard<std::mutex> lock(mu_);
    return forwarded_;
  }

 private:
  std::mutex mu_;
  std::vector<std::thread::id> threads_;
  std::vector<bool> forwarded_;
};

class ImportCloserTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(driver_, TestDriver());
    PoolOptions options;
    options.reserve_size = 1024 * kMiB;
    ASSERT_OK_AND_ASSIGN(pool_, CreateExportablePool(driver_, options));
    if (pool_->handle_type() == HandleType::kNone) GTEST_SKIP() << "nothing to export here";
    open_at_start_ = OpenImportMappings();
  }
  void TearDown() override {
    EXPECT_EQ(FlushCloses(absl::Seconds(10)), 0u);
    EXPECT_EQ(OpenImportMappings(), open_at_start_);
    for (void* p : blocks_) EXPECT_OK(pool_->Free(p));
  }

  // A descriptor of a fresh exported block of `size` bytes.
  absl::StatusOr<BufferDescriptor> Exported(size_t size) {
    VMM_ASSIGN_OR_RETURN(void* p, pool_->AllocateShareable(size, 0));
    blocks_.push_back(p);
    return ExportBuffer(*pool_, p);
  }

  // An import of `d` (nullptr, failing the test, on an error).
  std::unique_ptr<ImportedBuffer> Imported(const absl::StatusOr<BufferDescriptor>& d) {
    EXPECT_OK(d);
    if (!d.ok()) return nullptr;
    absl::StatusOr<std::unique_ptr<ImportedBuffer>> b = ImportBuffer(driver_, *d);
    EXPECT_OK(b);
    return b.ok() ? std::move(*b) : nullptr;
  }

  Driver* driver_ = nullptr;
  std::unique_ptr<Pool> pool_;
  std::vector<void*> blocks_;
  size_t open_at_start_ = 0;
};

TEST_F(ImportCloserTest, NothingQueuedFlushesAtOnce) {
  CloseLater(nullptr);
  const absl::Time start = absl::Now();
  EXPECT_EQ(FlushCloses(absl::Seconds(5)), 0u);
  EXPECT_EQ(FlushCloses(absl::ZeroDuration()), 0u);
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
}

// While held (a CUDA graph being captured), nothing is closed; imports queued meanwhile are
// closed once the last hold is released.
TEST_F(ImportCloserTest, HeldClosesWaitForTheLastRelease) {
  HoldCloses();
  HoldCloses();
  std::unique_ptr<ImportedBuffer> b = Imported(Exported(2 * kMiB));
  ASSERT_NE(b, nullptr);
  Reports reports;
  b->OnUnmapped(reports.Callback());
  CloseLater(std::move(b));
  EXPECT_EQ(FlushCloses(absl::Milliseconds(300)), 1u);
  EXPECT_TRUE(reports.threads().empty()) << "closed while held";
  ReleaseCloses();
  EXPECT_EQ(FlushCloses(absl::Milliseconds(300)), 1u);
  EXPECT_TRUE(reports.threads().empty()) << "closed while one hold is left";
  ReleaseCloses();
  EXPECT_EQ(FlushCloses(absl::Seconds(10)), 0u);
  EXPECT_EQ(reports.threads().size(), 1u);
  ReleaseCloses();  // one too many: ignored
  EXPECT_EQ(OpenImportMappings(), open_at_start_);
}

TEST_F(ImportCloserTest, QueuedImportsAreClosedOnTheClosingThreadAndFlushed) {
  constexpr int kImports = 20;
  Reports reports;
  for (int i = 0; i < kImports; ++i) {
    std::unique_ptr<ImportedBuffer> b = Imported(Exported(2 * kMiB));
    ASSERT_NE(b, nullptr);
    b->OnUnmapped(reports.Callback());
    CloseLater(std::move(b));
  }
  EXPECT_EQ(FlushCloses(absl::Seconds(10)), 0u);
  EXPECT_EQ(OpenImportMappings(), open_at_start_) << "a queued import is still mapped";
  const std::vector<std::thread::id> threads = reports.threads();
  ASSERT_EQ(threads.size(), static_cast<size_t>(kImports)) << "each report once";
  for (std::thread::id id : threads) {
    EXPECT_NE(id, std::this_thread::get_id()) << "closed by the caller";
    EXPECT_EQ(id, threads[0]) << "one closing thread";
  }
  EXPECT_EQ(reports.forwarded(), std::vector<bool>(kImports, false));
}

// The mapping of an import closed later stays while another import shares it; its reports
// follow the last one.
TEST_F(ImportCloserTest, AMappingSharedWithALiveImportStays) {
  const absl::StatusOr<BufferDescriptor> d = Exported(4 * kMiB);
  std::unique_ptr<ImportedBuffer> kept = Imported(d);
  std::unique_ptr<ImportedBuffer> dropped = Imported(d);
  ASSERT_TRUE(kept != nullptr && dropped != nullptr);
  ASSERT_TRUE(dropped->shared());
  Reports reports;
  dropped->OnUnmapped(reports.Callback());
  CloseLater(std::move(dropped));
  EXPECT_EQ(FlushCloses(absl::Seconds(10)), 0u);
  EXPECT_EQ(OpenImportMappings(), open_at_start_ + 1);
  EXPECT_TRUE(reports.forwarded().empty()) << "reported while still mapped here";
  kept->MarkForwarded();
  CloseLater(std::move(kept));
  EXPECT_EQ(FlushCloses(absl::Seconds(10)), 0u);
  EXPECT_EQ(OpenImportMappings(), open_at_start_);
  EXPECT_EQ(reports.forwarded(), std::vector<bool>{true});
}

// Stops the closing thread inside the close of one import (in its unmap report) until Finish
// or FinishAfter: what a slow close (a long device synchronize) looks like to the others.
class SlowClose {
 public:
  explicit SlowClose(ImportedBuffer& buffer) {
    buffer.OnUnmapped([this](bool) {
      inside_.store(true);
      while (!finish_.load()) absl::SleepFor(absl::Milliseconds(1));
    });
  }
  ~SlowClose() {
    Finish();
    if (finisher_.joinable()) finisher_.join();
  }
  // Whether the closing thread got inside the close within 10 s.
  bool WaitInside() {
    const absl::Time start = absl::Now();
    while (!inside_.load() && absl::Now() - start < absl::Seconds(10)) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    return inside_.load();
  }
  void Finish() { finish_.store(true); }
  // Lets the close finish `delay` from now, from another thread.
  void FinishAfter(absl::Duration delay) {
    finisher_ = std::thread([this, delay] {
      absl::SleepFor(delay);
      Finish();
    });
  }
  void Join() { finisher_.join(); }

 private:
  std::atomic<bool> inside_{false};
  std::atomic<bool> finish_{false};
  std::thread finisher_;
};

// FlushCloses waits for an import being closed, not only for queued ones, and no longer than
// it is told.
TEST_F(ImportCloserTest, FlushWaitsForACloseInProgress) {
  std::unique_ptr<ImportedBuffer> slow = Imported(Exported(2 * kMiB));
  ASSERT_NE(slow, nullptr);
  SlowClose gate(*slow);
  std::unique_ptr<ImportedBuffer> after = Imported(Exported(2 * kMiB));
  ASSERT_NE(after, nullptr);
  Reports reports;
  after->OnUnmapped(reports.Callback());
  const absl::Time queued_at = absl::Now();
  CloseLater(std::move(slow));
  CloseLater(std::move(after));
  EXPECT_LT(absl::Now() - queued_at, absl::Milliseconds(500)) << "CloseLater waited";
  ASSERT_TRUE(gate.WaitInside());
  const absl::Time flush_at = absl::Now();
  EXPECT_GE(FlushCloses(absl::Milliseconds(100)), 1u) << "the close in progress counts";
  EXPECT_GE(absl::Now() - flush_at, absl::Milliseconds(90));
  EXPECT_TRUE(reports.forwarded().empty()) << "closed out of order";
  gate.FinishAfter(absl::Milliseconds(100));
  EXPECT_EQ(FlushCloses(absl::Seconds(10)), 0u);
  gate.Join();
  EXPECT_EQ(reports.forwarded(), std::vector<bool>{false});
}

// A forked child starts with an empty queue: it neither waits for nor closes its parent's.
// A fork waits for a close in progress (it may hold the driver's locks), and the child starts
// with an empty queue of its own.
TEST_F(ImportCloserTest, AForkWaitsForARunningCloseAndTheChildHasAnEmptyQueue) {
  std::unique_ptr<ImportedBuffer> slow = Imported(Exported(2 * kMiB));
  ASSERT_NE(slow, nullptr);
  SlowClose gate(*slow);
  CloseLater(std::move(slow));
  ASSERT_TRUE(gate.WaitInside());
  gate.FinishAfter(absl::Milliseconds(200));
  const absl::Time fork_at = absl::Now();
  EXPECT_EQ(InForkedChild([] {
              if (FlushCloses(absl::ZeroDuration()) != 0) return 1;
              CloseLater(nullptr);
              return FlushCloses(absl::Seconds(1)) == 0 ? 0 : 2;
            }),
            0);
  EXPECT_GE(absl::Now() - fork_at, absl::Milliseconds(150)) << "the fork did not wait";
  gate.Join();
  EXPECT_EQ(FlushCloses(absl::Seconds(10)), 0u);
}

// Children forked while the closing thread works through many closes find the driver's locks
// free (each child maps and unmaps once, under a 5 s alarm).
TEST_F(ImportCloserTest, ChildrenForkedDuringClosesCanUseTheDriver) {
  absl::StatusOr<BufferDescriptor> d = Exported(2 * kMiB);
  ASSERT_OK(d);
  ImportOptions separate;
  separate.share_mappings = false;
  int forks = 0, failed = 0;
  Driver* driver = driver_;
  for (int round = 0; round < 4 && forks < 40; ++round) {
    for (int i = 0; i < 100; ++i) {
      absl::StatusOr<std::unique_ptr<ImportedBuffer>> b = ImportBuffer(driver_, *d, separate);
      ASSERT_OK(b);
      CloseLater(std::move(*b));
    }
    while (FlushCloses(absl::ZeroDuration()) != 0 && forks < 40) {
      ++forks;
      failed += InForkedChild([driver] {
                  alarm(5);
                  absl::StatusOr<DevPtr> r = driver->Reserve(2 * kMiB, 2 * kMiB);
                  if (r.ok()) (void)driver->Unreserve(*r, 2 * kMiB);
                  return 0;
                }) != 0;
    }
  }
  EXPECT_EQ(failed, 0) << "of " << forks << " children (a lock held at the fork)";
}

}  // namespace
}  // namespace vmm
