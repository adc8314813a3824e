// A pool never queues work on a stream that is capturing a CUDA graph (stream_reclaim.h), nor
// records or queries any event while the framework says a capture is under way
// (capture_window.h), when background work waits too: a
// miss does not record its reclaim event there (another thread's capture in thread_local mode
// would take the event into its graph, and the allocation would then fail querying it), a free
// used by such a stream waits until the capture is over instead of recording or synchronising
// there, and an event that a capture took after all is left to it. Runs on the host backend,
// whose streams a driver wrapper here marks as capturing (real captures: the drop-in program
// tests/gpu/dropin/case_graph_thread_local_background.py).
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>

#include "absl/status/status.h"
#include "allocator/capture_window.h"
#include "allocator/forwarding_driver.h"
#include "allocator/host_driver.h"
#include "allocator/pool.h"
#include "gtest/gtest.h"
#include "tests/pool_helpers.h"
#include "tests/status_matchers.h"
#include "tests/stream_gate.h"

namespace vmm {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

// The host driver, with streams marked as capturing: work queued on them joins "the graph"
// (an event recorded there cannot be queried: Unavailable, as CUDA's
// CUDA_ERROR_CAPTURED_EVENT), and synchronising them is an error (it would end the capture).
// Counts what a pool must never do to a capturing stream.
class CapturingDriver : public ForwardingDriver {
 public:
  using ForwardingDriver::ForwardingDriver;

  void BeginCapture(Stream s) {
    std::lock_guard<std::mutex> lock(mu_);
    capturing_.insert(s);
  }
  // As CUDA: an event last recorded before the capture began is not affected; use
  // TakeIntoCapture for one the capture took after the pool's check.
  void EndCapture(Stream s) {
    std::lock_guard<std::mutex> lock(mu_);
    capturing_.erase(s);
  }
  // The events last recorded on `s` now belong to a graph.
  void TakeIntoCapture(Stream s) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [event, stream] : last_stream_) {
      if (stream == s) captured_.insert(event);
    }
  }
  int touched_capturing() {
    std::lock_guard<std::mutex> lock(mu_);
    return touched_capturing_;
  }
  // Event queries so far.
  int queries() {
    std::lock_guard<std::mutex> lock(mu_);
    return queries_;
  }
  // Events recorded on `s` while it was not capturing.
  int records_on(Stream s) {
    std::lock_guard<std::mutex> lock(mu_);
    return records_[s];
  }

  absl::StatusOr<bool> StreamCapturing(Stream s) override {
    std::lock_guard<std::mutex> lock(mu_);
    return capturing_.count(s) != 0;
  }
  absl::Status RecordEvent(Event e, Stream s) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      last_stream_[e] = s;
      if (capturing_.count(s) != 0) {
        ++touched_capturing_;
        captured_.insert(e);
        return absl::OkStatus();
      }
      captured_.erase(e);
      ++records_[s];
    }
    return ForwardingDriver::RecordEvent(e, s);
  }
  absl::StatusOr<bool> EventDone(Event e) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++queries_;
      if (captured_.count(e) != 0) {
        return absl::UnavailableError("cuEventQuery: CUDA_ERROR_CAPTURED_EVENT");
      }
    }
    return ForwardingDriver::EventDone(e);
  }
  // Calls that would invalidate a global-mode capture, made while a capture window was open.
  int in_window() const { return in_window_.load(); }
  absl::Status SynchronizeDevice(int device) override {
    CountInWindow();
    return ForwardingDriver::SynchronizeDevice(device);
  }
  absl::Status Unmap(DevPtr ptr, size_t size) override {
    CountInWindow();
    return ForwardingDriver::Unmap(ptr, size);
  }
  absl::Status Release(PhysHandle handle) override {
    CountInWindow();
    return ForwardingDriver::Release(handle);
  }
  absl::Status Unreserve(DevPtr ptr, size_t size) override {
    CountInWindow();
    return ForwardingDriver::Unreserve(ptr, size);
  }
  absl::Status SynchronizeStream(Stream s) override {
    CountInWindow();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (capturing_.count(s) != 0) {
        ++touched_capturing_;
        return absl::UnavailableError("cuStreamSynchronize: capture invalidated");
      }
    }
    return ForwardingDriver::SynchronizeStream(s);
  }

 private:
  void CountInWindow() {
    if (CaptureWindowOpen()) ++in_window_;
  }

  std::atomic<int> in_window_{0};
  std::mutex mu_;
  std::set<Stream> capturing_;
  std::set<Event> captured_;
  std::map<Event, Stream> last_stream_;
  std::map<Stream, int> records_;
  int queries_ = 0;
  int touched_capturing_ = 0;
};

class StreamCaptureTest : public ::testing::Test {
 protected:
  void SetUp() override {
    host_ = NewHostDriver(HostDriverOptions{2 * kMiB, 256 * kMiB});
    driver_ = std::make_unique<CapturingDriver>(host_.get());
    s_ = *driver_->CreateStream(0);
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
    for (Stream s : {s_, t_}) {
      driver_->EndCapture(s);
      EXPECT_OK(driver_->SynchronizeStream(s));
      EXPECT_OK(driver_->DestroyStream(s));
    }
  }

  std::unique_ptr<Driver> host_;
  std::unique_ptr<CapturingDriver> driver_;
  std::unique_ptr<Pool> pool_;
  Stream s_ = 0, t_ = 0;
};

TEST_F(StreamCaptureTest, AMissLeavesTheBlocksOfACapturingStreamAlone) {
  ASSERT_OK_AND_ASSIGN(void* a, pool_->Allocate(4 * kMiB, s_));
  ASSERT_OK(pool_->Free(a));  // cached for s
  driver_->BeginCapture(s_);
  ASSERT_OK_AND_ASSIGN(void* b, pool_->Allocate(4 * kMiB, t_));  // a miss on t
  EXPECT_NE(b, a) << "s's work is not known complete";
  EXPECT_EQ(driver_->touched_capturing(), 0) << "nothing queued on the capturing stream";
  EXPECT_EQ(driver_->records_on(s_), 0);
  ASSERT_OK(pool_->Free(b));
  driver_->EndCapture(s_);
  ASSERT_OK_AND_ASSIGN(void* c, pool_->Allocate(8 * kMiB, t_));  // a miss on t again
  EXPECT_EQ(driver_->records_on(s_), 1) << "once the capture is over, s is reclaimed from";
  ASSERT_OK(pool_->Free(c));
}

TEST_F(StreamCaptureTest, AFreeUsedByACapturingStreamWaitsForTheCaptureToEnd) {
  ASSERT_OK_AND_ASSIGN(void* a, pool_->Allocate(4 * kMiB, s_));
  ASSERT_OK(pool_->RecordStream(a, t_));
  driver_->BeginCapture(t_);
  ASSERT_OK(pool_->Free(a));
  EXPECT_EQ(driver_->touched_capturing(), 0) << "no event recorded, no synchronisation";
  EXPECT_EQ(pool_->GetStats().active.current, 1) << "a waits";
  ASSERT_OK_AND_ASSIGN(void* b, pool_->Allocate(4 * kMiB, s_));
  EXPECT_NE(b, a);
  ASSERT_OK(pool_->Free(b));
  ASSERT_OK(pool_->EmptyCache());  // a device synchronisation does not end a capture
  EXPECT_EQ(pool_->GetStats().active.current, 1) << "a still waits";
  EXPECT_EQ(driver_->records_on(t_), 0);
  driver_->EndCapture(t_);
  ASSERT_OK_AND_ASSIGN(void* c, pool_->Allocate(8 * kMiB, s_));  // a miss: the event now
  EXPECT_EQ(driver_->records_on(t_), 1);
  ASSERT_OK(driver_->SynchronizeStream(t_));
  ASSERT_OK_AND_ASSIGN(void* d, pool_->Allocate(8 * kMiB, s_));  // a miss: it is done
  EXPECT_EQ(pool_->GetStats().active.current, 2) << "a recycled; c and d live";
  EXPECT_EQ(driver_->touched_capturing(), 0);
  for (void* p : {c, d}) ASSERT_OK(pool_->Free(p));
}

TEST_F(StreamCaptureTest, AnEventACaptureTookIsLeftToItAndRecordedAgainLater) {
  ASSERT_OK_AND_ASSIGN(void* a, pool_->Allocate(4 * kMiB, s_));
  ASSERT_OK(pool_->RecordStream(a, t_));
  {
    StreamGate gate(driver_.get(), t_);  // t busy: the free's event is not done
    ASSERT_OK(pool_->Free(a));
    EXPECT_EQ(pool_->GetStats().active.current, 1);
    // t begins capturing after the event was recorded, and the capture takes it.
    driver_->BeginCapture(t_);
    driver_->TakeIntoCapture(t_);
  }
  ASSERT_OK_AND_ASSIGN(void* b, pool_->Allocate(4 * kMiB, s_));  // queries it: no error
  EXPECT_NE(b, a);
  EXPECT_EQ(pool_->GetStats().active.current, 2) << "a still waits";
  ASSERT_OK(pool_->Free(b));
  const int records = driver_->records_on(t_);
  driver_->EndCapture(t_);
  ASSERT_OK_AND_ASSIGN(void* c, pool_->Allocate(8 * kMiB, s_));  // a miss: a new event
  EXPECT_EQ(driver_->records_on(t_), records + 1);
  ASSERT_OK(driver_->SynchronizeStream(t_));
  ASSERT_OK_AND_ASSIGN(void* d, pool_->Allocate(8 * kMiB, s_));
  EXPECT_EQ(pool_->GetStats().active.current, 2) << "a recycled; c and d live";
  EXPECT_EQ(driver_->touched_capturing(), 0);
  for (void* p : {c, d}) ASSERT_OK(pool_->Free(p));
}

// While a capture window is open (PyTorch captures a graph, in global mode), a pool records
// and queries no event on any stream; what waited goes on once it closes.
TEST_F(StreamCaptureTest, WhileACaptureWindowIsOpenNoEventIsRecordedOrQueried) {
  ASSERT_OK_AND_ASSIGN(void* a, pool_->Allocate(4 * kMiB, s_));
  ASSERT_OK(pool_->Free(a));  // cached for s
  ASSERT_OK_AND_ASSIGN(void* used, pool_->Allocate(4 * kMiB, s_));
  ASSERT_OK(pool_->RecordStream(used, t_));
  OpenCaptureWindow();
  ASSERT_OK(pool_->Free(used));  // used by t: its event is deferred
  ASSERT_OK_AND_ASSIGN(void* b, pool_->Allocate(4 * kMiB, t_));  // a miss on t
  EXPECT_NE(b, a);
  EXPECT_EQ(driver_->records_on(s_) + driver_->records_on(t_), 0);
  EXPECT_EQ(pool_->GetStats().active.current, 2) << "used still waits";
  CloseCaptureWindow();
  ASSERT_OK(pool_->Free(b));
  ASSERT_OK_AND_ASSIGN(void* c, pool_->Allocate(16 * kMiB, s_));  // a miss: events now
  EXPECT_GE(driver_->records_on(t_), 1);
  ASSERT_OK(pool_->Free(c));
}

// An event a miss recorded before the window opened, still running, is not queried while it
// is open (a query invalidates a global-mode capture).
TEST_F(StreamCaptureTest, AnEventInFlightIsNotQueriedWhileACaptureWindowIsOpen) {
  StreamGate gate(driver_.get(), s_);  // s busy: its reclaim event stays in flight
  ASSERT_OK_AND_ASSIGN(void* a, pool_->Allocate(4 * kMiB, s_));
  ASSERT_OK(pool_->Free(a));
  ASSERT_OK_AND_ASSIGN(void* b, pool_->Allocate(4 * kMiB, t_));  // records on s, queries
  EXPECT_EQ(driver_->records_on(s_), 1);
  OpenCaptureWindow();
  const int queries = driver_->queries();
  ASSERT_OK_AND_ASSIGN(void* c, pool_->Allocate(4 * kMiB, t_));  // another miss
  EXPECT_EQ(driver_->queries(), queries);
  ASSERT_OK(pool_->Free(c));
  ASSERT_OK(pool_->Free(b));
  CloseCaptureWindow();
  gate.Release();
}

// empty_cache inside a capture (a library's call, a memory check in captured code) releases
// nothing until the capture is over: its device synchronisation would invalidate it.
TEST_F(StreamCaptureTest, EmptyCacheDuringACaptureWindowReleasesNothing) {
  ASSERT_OK_AND_ASSIGN(void* a, pool_->Allocate(8 * kMiB, s_));
  ASSERT_OK(pool_->Free(a));
  OpenCaptureWindow();
  EXPECT_OK(pool_->EmptyCache());
  EXPECT_EQ(driver_->in_window(), 0);
  EXPECT_EQ(pool_->GetStats().reserved_bytes.current, 8 * kMiB);
  CloseCaptureWindow();
  ASSERT_OK(pool_->EmptyCache());
  EXPECT_EQ(pool_->GetStats().reserved_bytes.current, 0);
}

size_t HostFree(Driver& host) { return host.GetMemInfo(0)->free; }

// Frees that wait for a stream running behind (record_stream on a communication stream) cost
// one event query a pass for that stream, not one for each of them: events on a stream
// complete in the order they were recorded. Each free queried every pending event before.
TEST_F(StreamCaptureTest, FreesPendingOnAStreamRunningBehindQueryItsOldestEventOnly) {
  constexpr int kBlocks = 100;
  auto gate = std::make_unique<StreamGate>(driver_.get(), t_);  // t runs behind
  std::vector<void*> blocks;
  for (int i = 0; i < kBlocks; ++i) blocks.push_back(AllocateOrFail(*pool_, kMiB, s_));
  for (void* b : blocks) ASSERT_OK(pool_->RecordStream(b, t_));
  const int before = driver_->queries();
  for (void* b : blocks) ASSERT_OK(pool_->Free(b));  // each free processes the pending ones
  EXPECT_LE(driver_->queries() - before, 2 * kBlocks) << "each free queried every pending one";
  EXPECT_EQ(pool_->GetStats().active_bytes.current, kBlocks * static_cast<int64_t>(kMiB))
      << "freed before t's work was done";
  gate->Release();
  ASSERT_OK(driver_->SynchronizeStream(t_));
  void* c = AllocateOrFail(*pool_, kMiB, s_);  // the pending frees are processed: all done
  ASSERT_OK(pool_->Free(c));
  EXPECT_EQ(pool_->GetStats().active_bytes.current, 0);
}

// Frees pending on two streams come back as each stream finishes, whichever was used first:
// the pending entries are kept per stream, and a stream running behind holds back only its
// own.
TEST_F(StreamCaptureTest, FreesPendingOnTwoStreamsComeBackAsEachStreamFinishes) {
  ASSERT_OK_AND_ASSIGN(Stream u, driver_->CreateStream(0));
  auto gate_t = std::make_unique<StreamGate>(driver_.get(), t_);
  auto gate_u = std::make_unique<StreamGate>(driver_.get(), u);
  std::vector<void*> on_t, on_u;
  for (int i = 0; i < 3; ++i) {
    on_t.push_back(AllocateOrFail(*pool_, kMiB, s_));
    on_u.push_back(AllocateOrFail(*pool_, 2 * kMiB, s_));
  }
  for (int i = 0; i < 3; ++i) {  // interleaved: t's, u's, t's, ...
    ASSERT_OK(pool_->RecordStream(on_t[i], t_));
    ASSERT_OK(pool_->Free(on_t[i]));
    ASSERT_OK(pool_->RecordStream(on_u[i], u));
    ASSERT_OK(pool_->Free(on_u[i]));
  }
  EXPECT_EQ(pool_->GetStats().active_bytes.current, 9 * static_cast<int64_t>(kMiB));
  gate_u->Release();  // u finishes first, though t's frees came first
  ASSERT_OK(driver_->SynchronizeStream(u));
  void* x = AllocateOrFail(*pool_, kMiB, s_);  // processes the pending frees
  EXPECT_EQ(pool_->GetStats().active_bytes.current, 4 * static_cast<int64_t>(kMiB))
      << "u's frees were held back by t's, or t's came back early";
  gate_t->Release();
  ASSERT_OK(driver_->SynchronizeStream(t_));
  void* y = AllocateOrFail(*pool_, kMiB, s_);  // t's come back too
  ASSERT_OK(pool_->Free(x));
  ASSERT_OK(pool_->Free(y));
  EXPECT_EQ(pool_->GetStats().active_bytes.current, 0);
  EXPECT_OK(pool_->CheckInvariants());
  EXPECT_OK(driver_->DestroyStream(u));
}

// Frees deferred while their stream captures a graph (a capture the framework opened no
// window for: another library's, or one whose window went stale) cost each allocation one
// capture check of that stream, not one for each of them: with them kept in one list, every
// pass asked the driver about the stream once per deferred free (1,000 driver calls an
// allocation with 1,000 such frees).
TEST_F(StreamCaptureTest, FreesDeferredOnACapturingStreamCostOneCheckAPass) {
  constexpr int kBlocks = 1000;
  std::vector<void*> blocks;
  for (int i = 0; i < kBlocks; ++i) blocks.push_back(AllocateOrFail(*pool_, 4096, s_));
  for (void* b : blocks) ASSERT_OK(pool_->RecordStream(b, t_));
  driver_->BeginCapture(t_);
  for (void* b : blocks) ASSERT_OK(pool_->Free(b));  // each waits for the capture to end
  EXPECT_EQ(pool_->GetStats().active.current, kBlocks);
  const int64_t before = pool_->GetStats().driver_event;
  void* x = AllocateOrFail(*pool_, 4096, s_);  // not the cached path: frees are pending
  EXPECT_LE(pool_->GetStats().driver_event - before, 4)
      << "one capture check per deferred free, each allocation";
  ASSERT_OK(pool_->Free(x));
  driver_->EndCapture(t_);
  void* y = AllocateOrFail(*pool_, 4096, s_);  // records their events on t
  ASSERT_OK(driver_->SynchronizeStream(t_));
  void* z = AllocateOrFail(*pool_, 4096, s_);  // finds them done
  ASSERT_OK(pool_->Free(y));
  ASSERT_OK(pool_->Free(z));
  EXPECT_EQ(pool_->GetStats().active.current, 0);
  EXPECT_EQ(driver_->touched_capturing(), 0);
}

// Puts a block of stream 0 (whose events the host backend completes at once) and one of t
// side by side in one 8 MiB chunk and frees t's: the chunk holds free space tagged t beside
// the live block of stream 0, which is returned.
void* BesideSpaceOf(Pool& pool, Stream t) {
  void* x = AllocateOrFail(pool, 8 * kMiB, 0);
  EXPECT_OK(pool.Free(x));
  void* a = AllocateOrFail(pool, 4 * kMiB, 0);
  void* b = AllocateOrFail(pool, 4 * kMiB, t);  // a miss on t: stream 0's space retagged
  const uintptr_t pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  EXPECT_EQ(pa > pb ? pa - pb : pb - pa, 4 * kMiB) << "not side by side in one chunk";
  EXPECT_OK(pool.Free(b));
  return a;
}

// An export (a send) whose chunk holds space another stream freed waits for that stream
// before the space retires with the chunk; during a capture it does not synchronise the
// stream (that would invalidate a capture in global mode): the space waits as a pending free.
TEST_F(StreamCaptureTest, AnExportDuringACaptureWindowSynchronisesNothing) {
  void* a = BesideSpaceOf(*pool_, t_);
  OpenCaptureWindow();
  EXPECT_OK(pool_->Export(a).status());
  EXPECT_EQ(driver_->in_window(), 0) << "synchronised during the capture";
  CloseCaptureWindow();
  ASSERT_OK(pool_->Free(a));
  ASSERT_OK(pool_->EmptyCache());
  EXPECT_EQ(pool_->GetStats().reserved_bytes.current, 0);
}

// ... and the space it left waiting is neither reused nor released before the work of its
// stream that was queued before the export is done, whenever that ends.
TEST_F(StreamCaptureTest, SpaceAnExportDuringACaptureLeftWaitsForItsStream) {
  void* a = BesideSpaceOf(*pool_, t_);
  auto gate = std::make_unique<StreamGate>(driver_.get(), t_);  // t still works in b's space
  pool_->ResetPeakStats();
  pool_->ResetAccumulatedStats();
  OpenCaptureWindow();
  ASSERT_OK(pool_->Export(a).status());
  CloseCaptureWindow();
  // The held space is active (freed, still used by t), counted as allocated and freed there.
  const PoolStats held = pool_->GetStats();
  EXPECT_EQ(held.active_bytes.current, 8 * static_cast<int64_t>(kMiB));
  EXPECT_EQ(held.active.current, 2);
  EXPECT_GE(held.active_bytes.peak, held.active_bytes.current);
  EXPECT_GE(held.active.peak, held.active.current);
  // Since the reset (a live: 4 MiB, 1 block), as much allocated and freed as active rose by.
  EXPECT_EQ(held.active_bytes.allocated - held.active_bytes.freed, 4 * static_cast<int64_t>(kMiB));
  EXPECT_EQ(held.active.allocated - held.active.freed, 1);
  EXPECT_GE(held.active_bytes.freed, 0);
  ASSERT_OK(pool_->Free(a));  // the chunk would go now, but for the space t may still use
  void* c = AllocateOrFail(*pool_, 2 * kMiB, 0);  // a miss: the pending frees are queried
  EXPECT_EQ(pool_->GetStats().reserved_bytes.current, 10 * kMiB)
      << "the chunk went while t's work may still use it";
  ASSERT_OK(pool_->CheckInvariants());
  ASSERT_OK(pool_->Free(c));
  gate->Release();
  ASSERT_OK(driver_->SynchronizeStream(t_));
  ASSERT_OK(pool_->EmptyCache());
  EXPECT_EQ(pool_->GetStats().reserved_bytes.current, 0);
}


// A pool whose last use ends during a capture (a private pool whose last block is freed
// there) is destroyed once the last window closes: its teardown synchronises and unmaps.
TEST_F(StreamCaptureTest, APoolDestroyedDuringACaptureWindowGoesOnceItCloses) {
  const size_t free_before = HostFree(*host_);
  ASSERT_OK_AND_ASSIGN(void* a, pool_->Allocate(8 * kMiB, s_));
  ASSERT_OK_AND_ASSIGN(void* b, pool_->Allocate(8 * kMiB, s_));
  ASSERT_OK(pool_->Free(b));
  (void)a;  // still live: destroyed with the pool
  OpenCaptureWindow();
  OpenCaptureWindow();  // two captures
  RunOutsideCapture([pool = std::shared_ptr<Pool>(std::move(pool_))]() mutable { pool.reset(); });
  EXPECT_EQ(HostFree(*host_), free_before - 16 * kMiB) << "destroyed during the capture";
  CloseCaptureWindow();
  EXPECT_EQ(HostFree(*host_), free_before - 16 * kMiB) << "destroyed during the other capture";
  CloseCaptureWindow();
  EXPECT_EQ(driver_->in_window(), 0);
  EXPECT_EQ(HostFree(*host_), free_before) << "not destroyed once the captures were over";
}

// With no capture under way the work runs at once.
TEST_F(StreamCaptureTest, APoolDestroyedOutsideACaptureGoesAtOnce) {
  const size_t free_before = HostFree(*host_);
  ASSERT_OK_AND_ASSIGN(void* a, pool_->Allocate(8 * kMiB, s_));
  ASSERT_OK(pool_->Free(a));
  RunOutsideCapture([pool = std::shared_ptr<Pool>(std::move(pool_))]() mutable { pool.reset(); });
  EXPECT_EQ(HostFree(*host_), free_before);
}

// A window that opens while kept work runs after the last one closed waits for that work.
TEST(CaptureWindowTest, AWindowOpeningWhileKeptWorkRunsWaitsForIt) {
  std::atomic<int> stage{0};
  std::thread opener;
  OpenCaptureWindow();
  RunOutsideCapture([&] {
    stage.store(1);
    opener = std::thread([&] {
      OpenCaptureWindow();  // waits for this work
      stage.store(3);
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_EQ(stage.load(), 1) << "the window opened while the kept work ran";
    stage.store(2);
  });
  EXPECT_EQ(stage.load(), 0) << "ran while the window was open";
  CloseCaptureWindow();  // runs the kept work here
  opener.join();
  EXPECT_EQ(stage.load(), 3);
  CloseCaptureWindow();
  EXPECT_FALSE(CaptureWindowOpen());
}

// Work nested in work this thread holds (an out-of-memory retry's growth, which would move
// memory) enters while a window is opening, since that window waits for the outer piece
// anyway; another thread's work does not, and the window opens once the outer piece ends.
TEST(CaptureWindowTest, NestedWorkEntersWhileAWindowWaitsForTheOuterPiece) {
  std::atomic<bool> opened{false};
  std::thread opener;
  {
    const WorkOutsideCapture outer(/*wanted=*/true);
    ASSERT_TRUE(outer.entered());
    opener = std::thread([&] {
      OpenCaptureWindow();  // waits for `outer`
      opened.store(true);
    });
    while (!CaptureWindowOpen()) std::this_thread::yield();  // the window is opening
    {
      const WorkOutsideCapture inner(/*wanted=*/true);
      EXPECT_TRUE(inner.entered()) << "nested work refused while the window waited for it";
    }
    bool other_entered = true;
    std::thread other([&] { other_entered = WorkOutsideCapture(/*wanted=*/true).entered(); });
    other.join();
    EXPECT_FALSE(other_entered) << "another thread's work entered while a window was opening";
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    EXPECT_FALSE(opened.load()) << "the window opened before the outer piece ended";
  }
  opener.join();
  EXPECT_TRUE(opened.load());
  EXPECT_FALSE(WorkOutsideCapture(/*wanted=*/true).entered()) << "the window is open now";
  CloseCaptureWindow();
  EXPECT_FALSE(CaptureWindowOpen());
}

// Background work waits while a window is open, and a window opens only once the work
// running has finished.
TEST(CaptureWindowTest, BackgroundWorkAndWindowsExcludeEachOther) {
  std::atomic<int> stage{0};
  EnterBackgroundWork();
  std::thread opener([&] {
    OpenCaptureWindow();  // waits for the work running
    stage.store(1);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(stage.load(), 0) << "the window waited for the running work";
  EXPECT_TRUE(CaptureWindowOpen()) << "yet it counts as open at once";
  LeaveBackgroundWork();
  opener.join();
  EXPECT_EQ(stage.load(), 1);
  std::thread worker([&] {
    EnterBackgroundWork();  // waits for the window to close
    stage.store(2);
    LeaveBackgroundWork();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(stage.load(), 1) << "work waited while the window was open";
  CloseCaptureWindow();
  worker.join();
  EXPECT_EQ(stage.load(), 2);
  EXPECT_FALSE(CaptureWindowOpen());
}

// Work kept until after a capture that throws is logged: the window's work is left and the
// exception goes no further (CloseCaptureWindow's callers are the C interface).
TEST(CaptureWindowTest, WorkThatThrowsLeavesWindowsWorking) {
  EXPECT_NO_THROW(RunOutsideCapture([] { throw std::runtime_error("teardown failed"); }));
  OpenCaptureWindow();  // would wait forever for work never left
  bool after = false;
  RunOutsideCapture([] { throw std::runtime_error("teardown failed"); });
  RunOutsideCapture([&] { after = true; });
  EXPECT_NO_THROW(CloseCaptureWindow());
  EXPECT_TRUE(after) << "the work kept after the one that threw did not run";
  OpenCaptureWindow();
  CloseCaptureWindow();
}

// A window left open (a capture that raised before it ended its route) stops holding work
// back after the stale period, but a capture that begins later is protected again.
TEST(CaptureWindowTest, ACaptureAfterAWindowWentStaleHoldsWorkBack) {
  SetStaleAfterForTesting(std::chrono::milliseconds(100));
  OpenCaptureWindow();  // left open
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  bool ran = false;
  RunOutsideCapture([&] { ran = true; });
  EXPECT_TRUE(ran) << "a stale window still held work back";
  OpenCaptureWindow();  // a new capture
  EXPECT_TRUE(CaptureWindowOpen());
  ran = false;
  RunOutsideCapture([&] { ran = true; });
  EXPECT_FALSE(ran) << "work ran during the new capture";
  CloseCaptureWindow();  // the window left open counts from the newest's opening
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  bool next = false;
  RunOutsideCapture([&] { next = true; });
  EXPECT_TRUE(ran && next) << "kept work did not run once the windows left were stale";
  CloseCaptureWindow();
  SetStaleAfterForTesting(kStaleAfter);
}

// A child forked while another thread's work holds windows back has no such thread: its
// windows open at once.
TEST(CaptureWindowTest, AChildForkedDuringWorkCanOpenAWindow) {
  std::atomic<bool> entered{false};
  std::atomic<bool> done{false};
  std::thread worker([&] {
    const WorkOutsideCapture work(/*wanted=*/true);
    entered = work.entered();
    while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  while (!entered) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(5);
    OpenCaptureWindow();
    CloseCaptureWindow();
    _exit(0);
  }
  done = true;
  worker.join();
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child's window never opened";
}

}  // namespace
}  // namespace vmm
