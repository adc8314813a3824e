// Multithreaded tests of the pool on the host backend.
//
// Worker threads allocate and free blocks of mixed sizes on their own streams and on the
// default stream, stamp every block with a value only its owner writes and check the stamp
// before the free, hand blocks to other threads' streams (record_stream, with host work on
// that stream reading the block), and export live blocks, reading them back through an
// import; meanwhile a monitor thread trims the cache and reads stats, snapshots and
// invariants. A second test makes threads contend for a small memory limit, so that cache
// trims, retries and out-of-memory errors run concurrently; a third destroys streams while
// other threads' blocks are still tagged with them or recorded on them. Every test ends with
// all blocks freed, the cache emptied, and the driver as free as before the pool existed.
//
// Block contents are the check that the pool never hands out memory someone still uses: a
// block overwritten by another thread, or reused while a stream still reads it, shows up as
// a wrong stamp (and, under ThreadSanitizer, as a data race). Operation counts are kept small
// enough for ThreadSanitizer, which runs this test too and is several times slower.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "allocator/driver.h"
#include "allocator/host_driver.h"
#include "allocator/pool.h"
#include "allocator/status_macros.h"
#include "gtest/gtest.h"
#include "tests/sanitizers.h"
#include "tests/status_matchers.h"
#include "tests/test_backend.h"


namespace vmm {
namespace {

constexpr size_t kKiB = size_t{1} << 10;
constexpr size_t kMiB = size_t{1} << 20;
constexpr int kThreads = 8;
// ThreadSanitizer runs fewer operations so that the test stays within a few seconds.
constexpr int kOpsScale = VMM_UNDER_TSAN ? 2 : 1;

// --- Block contents ---------------------------------------------------------------------------

// A block carries its stamp in 8-byte slots: every 8 bytes when it is at most kStride long,
// else at its start, its end and every kStride-aligned address in between. Two live blocks
// that overlap by kStride bytes or more therefore share a slot. Slots never overlap each other
// (blocks are at least 16 bytes).
constexpr size_t kStride = 64 * kKiB;

template <typename F>
void ForEachSlot(const void* ptr, size_t size, F&& f) {
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  const size_t step = size <= kStride ? 8 : kStride;
  f(p);
  for (uintptr_t a = (p + 8 + step - 1) / step * step; a + 16 <= p + size; a += step) f(a);
  f(p + size - 8);
}

void Stamp(void* ptr, size_t size, uint64_t stamp) {
  ForEachSlot(ptr, size,
              [&](uintptr_t a) { std::memcpy(reinterpret_cast<void*>(a), &stamp, sizeof stamp); });
}

// "" when every slot holds `stamp`, else where the first wrong slot is and what it holds.
std::string Damage(const void* ptr, size_t size, uint64_t stamp) {
  std::string damage;
  ForEachSlot(ptr, size, [&](uintptr_t a) {
    uint64_t found;
    std::memcpy(&found, reinterpret_cast<const void*>(a), sizeof found);
    if (found != stamp && damage.empty()) {
      damage = absl::StrCat("offset ", a - reinterpret_cast<uintptr_t>(ptr), " holds 0x",
                            absl::Hex(found), " instead of 0x", absl::Hex(stamp));
    }
  });
  return damage;
}

// Host work queued on a stream that uses a block: it checks the block's stamp, after a pause
// that gives a pool that reuses the block too early the chance to show it.
struct StreamRead {
  const void* ptr;
  size_t size;
  uint64_t stamp;
  bool pause;
  std::atomic<int>* failures;
};

void ReadOnStream(void* arg) {
  std::unique_ptr<StreamRead> read(static_cast<StreamRead*>(arg));
  if (read->pause) std::this_thread::sleep_for(std::chrono::microseconds(300));
  if (!Damage(read->ptr, read->size, read->stamp).empty()) read->failures->fetch_add(1);
}

void PauseOnStream(void*) { std::this_thread::sleep_for(std::chrono::microseconds(200)); }

// A block exported with the chunks' shareable handles, as the sharing side makes them.
struct ExportedWithHandles {
  ExportedBlock block;
  std::vector<ShareableHandle> handles;  // one per chunk, in order
};

absl::StatusOr<ExportedWithHandles> ExportWithHandles(Pool& pool, void* ptr) {
  ExportedWithHandles out;
  Driver& driver = *pool.driver();
  VMM_ASSIGN_OR_RETURN(
      out.block, pool.Export(ptr, HandleType::kNone,
                             [&](const ExportedChunk& c, bool* called_driver) -> absl::Status {
                               *called_driver = true;
                               VMM_ASSIGN_OR_RETURN(ShareableHandle h,
                                                    driver.Export(c.handle, pool.handle_type()));
                               out.handles.push_back(std::move(h));
                               return absl::OkStatus();
                             }));
  return out;
}

// Maps the chunks of an exported block at a new address through Import(), as another process
// would, and returns the block's first 8 bytes as seen there.
absl::StatusOr<uint64_t> ReadThroughImport(Driver& driver, const ExportedWithHandles& exported) {
  size_t total = 0;
  for (const ExportedChunk& c : exported.block.chunks) total += c.size;
  VMM_ASSIGN_OR_RETURN(DevPtr base, driver.Reserve(total, 0));
  std::vector<PhysHandle> handles;
  size_t mapped = 0;
  uint64_t first = 0;
  absl::Status status = [&]() -> absl::Status {
    for (size_t i = 0; i < exported.block.chunks.size(); ++i) {
      const ExportedChunk& c = exported.block.chunks[i];
      VMM_ASSIGN_OR_RETURN(PhysHandle imported, driver.Import(exported.handles[i]));
      handles.push_back(imported);
      VMM_RETURN_IF_ERROR(driver.Map(base + mapped, c.size, imported));
      mapped += c.size;
    }
    VMM_RETURN_IF_ERROR(driver.SetAccess(base, total, {0}));
    std::memcpy(&first, reinterpret_cast<const void*>(base + exported.block.offset),
                sizeof first);
    return absl::OkStatus();
  }();
  if (mapped > 0) status.Update(driver.Unmap(base, mapped));
  for (PhysHandle h : handles) status.Update(driver.Release(h));
  status.Update(driver.Unreserve(base, total));
  if (!status.ok()) return status;
  return first;
}

// --- Checks of what the pool reports ----------------------------------------------------------

// A snapshot's segments are tiled by their blocks and backed exactly by their chunks.
void ExpectConsistentSnapshot(const Snapshot& snap) {
  for (const SegmentInfo& seg : snap.segments) {
    uintptr_t at = seg.addr;
    for (const BlockInfo& b : seg.blocks) {
      EXPECT_EQ(b.addr, at) << "blocks of a segment must be contiguous";
      EXPECT_NE(b.state, BlockState::kUnmapped) << "a segment holds mapped blocks only";
      at = b.addr + b.size;
    }
    EXPECT_EQ(at, seg.addr + seg.size);
    at = seg.addr;
    for (const ChunkInfo& c : seg.chunks) {
      EXPECT_EQ(c.addr, at) << "chunks of a segment must be contiguous";
      at = c.addr + c.size;
    }
    EXPECT_EQ(at, seg.addr + seg.size);
  }
}

void ExpectSaneStats(const PoolStats& s) {
  EXPECT_GE(s.allocation.current, 0);
  EXPECT_GE(s.allocated_bytes.current, 0);
  EXPECT_LE(s.allocated_bytes.current, s.active_bytes.current);
  EXPECT_LE(s.active_bytes.current, s.reserved_bytes.current);
  EXPECT_LE(s.exported_bytes.current, s.reserved_bytes.current);
  EXPECT_LE(s.inactive_split_bytes.current, s.reserved_bytes.current);
  EXPECT_LE(s.reserved_bytes.current, s.reserved_bytes.peak);
}

// Trims the cache and reads every view of the pool in a loop until told to stop.
class Monitor {
 public:
  explicit Monitor(Pool* pool) : pool_(pool), thread_([this] { Run(); }) {}
  ~Monitor() { Stop(); }

  void Stop() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }
  int iterations() const { return iterations_.load(); }

 private:
  void Run() {
    while (!stop_.load()) {
      absl::Status trimmed = pool_->EmptyCache();
      EXPECT_TRUE(trimmed.ok()) << trimmed;
      ExpectSaneStats(pool_->GetStats());
      ExpectConsistentSnapshot(pool_->GetSnapshot());
      absl::Status invariants = pool_->CheckInvariants();
      EXPECT_TRUE(invariants.ok()) << invariants;
      if (!trimmed.ok() || !invariants.ok()) return;
      iterations_.fetch_add(1);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  Pool* const pool_;
  std::atomic<bool> stop_{false};
  std::atomic<int> iterations_{0};
  std::thread thread_;  // last: starts after the members above exist
};

// --- Workers ----------------------------------------------------------------------------------

// What the workers of one test share; read-only while they run, except the atomics.
struct Shared {
  Driver* driver = nullptr;
  Pool* pool = nullptr;
  std::vector<Stream> streams;  // one per worker, made by the fixture
  // Each worker's current stream: its fixture stream, or one it made (rotate_every).
  std::vector<std::atomic<Stream>> current = std::vector<std::atomic<Stream>>(kThreads);
  bool exportable = false;
  std::atomic<int> stream_read_failures{0};
  std::atomic<int> start_line{0};  // workers wait here until all have started
};

struct WorkerConfig {
  int ops = 0;
  size_t max_live = 0;
  // Percentages of operations; the rest free a block.
  int allocate = 0;
  int hand_off = 0;   // record_stream on another worker's stream (b)
  int do_export = 0;  // Export of a live block (d)
  int busy = 0;       // queue a pause on the worker's own stream
  // Every this many operations the worker replaces its stream with a new one and destroys
  // the old one, while blocks are still tagged with it or recorded on it (0: never). Hand-offs
  // then queue pauses, not reads: the host backend's SynchronizeDevice does not wait for work
  // that a stream being destroyed still runs, so such reads would race with reuse.
  int rotate_every = 0;
  size_t max_large = 0;
  // Out-of-memory is expected (e): counted, answered by freeing a block and trying again.
  bool expect_oom = false;
  size_t impossible_size = 0;  // requested once per worker when expect_oom: must fail
};

struct Live {
  void* ptr;
  size_t size;
  uint64_t stamp;
  Stream stream;  // allocated on
};

class Worker {
 public:
  Worker(int id, Shared* shared, const WorkerConfig& config)
      : id_(id), shared_(shared), config_(config), rng_(0x5eed0000u + id) {}

  void Run() {
    shared_->start_line.fetch_add(1);
    while (shared_->start_line.load() < kThreads) std::this_thread::yield();
    if (config_.expect_oom) RequestTheImpossible();
    for (int op = 0; op < config_.ops && !failed_; ++op) {
      if (config_.rotate_every > 0 && op % config_.rotate_every == 0) RotateStream();
      Step();
    }
    while (!live_.empty() && !failed_) Free(live_.size() - 1);
    if (made_stream_ != 0) {
      EXPECT_TRUE(shared_->driver->DestroyStream(made_stream_).ok());
    }
  }

  int64_t ooms() const { return ooms_; }
  int hand_offs() const { return hand_offs_; }
  int imports_checked() const { return imports_checked_; }
  const std::set<uint64_t>& exported_chunks() const { return exported_chunks_; }

 private:
  Stream own_stream() const { return shared_->current[id_].load(); }
  Stream any_stream() { return shared_->current[rng_() % kThreads].load(); }

  void Step() {
    const int r = static_cast<int>(rng_() % 100);
    if (live_.empty() || (r < config_.allocate && live_.size() < config_.max_live)) {
      Allocate(RandomSize(), RandomStream());
      return;
    }
    const size_t i = rng_() % live_.size();
    int bound = config_.allocate;
    if (r < (bound += config_.hand_off)) return HandOff(i);
    if (r < (bound += config_.do_export)) return Export(i);
    if (r < (bound += config_.busy)) return Busy();
    Free(i);
  }

  // Mostly the worker's own stream, often the default one, now and then another worker's.
  Stream RandomStream() {
    const int r = static_cast<int>(rng_() % 10);
    if (r < 6) return own_stream();
    if (r < 9) return 0;
    return any_stream();
  }

  size_t RandomSize() {
    const int r = static_cast<int>(rng_() % 100);
    if (r < 55) return 64 + rng_() % (64 * kKiB);        // small arena
    if (r < 80) return 64 * kKiB + rng_() % (2 * kMiB);  // either side of small_size
    return kMiB + rng_() % config_.max_large;            // large arena
  }

  // Allocates and stamps a block; on out-of-memory (when expected) frees one of this
  // worker's blocks and tries again, a few times.
  void Allocate(size_t size, Stream stream) {
    const bool shareable = shared_->exportable && rng_() % 40 == 0;
    for (int attempt = 0; attempt < 4; ++attempt) {
      absl::StatusOr<void*> got = shareable ? shared_->pool->AllocateShareable(size, stream)
                                            : shared_->pool->Allocate(size, stream);
      if (got.ok()) return Adopt(*got, size, stream);
      if (!config_.expect_oom || !absl::IsResourceExhausted(got.status())) {
        return Fail(got.status());
      }
      ++ooms_;
      if (live_.empty()) return;
      Free(0);
    }
  }

  void Adopt(void* ptr, size_t size, Stream stream) {
    const auto p = reinterpret_cast<uintptr_t>(ptr);
    if (p % 512 != 0 || !shared_->pool->Contains(ptr)) {
      ADD_FAILURE() << "block " << ptr << " is misaligned or outside the pool";
      failed_ = true;
      return;
    }
    const uint64_t stamp = (static_cast<uint64_t>(id_ + 1) << 48) | ++sequence_;
    Stamp(ptr, size, stamp);
    live_.push_back(Live{ptr, size, stamp, stream});
  }

  void Free(size_t i) {
    const Live block = live_[i];
    live_[i] = live_.back();
    live_.pop_back();
    if (std::string damage = Damage(block.ptr, block.size, block.stamp); !damage.empty()) {
      ADD_FAILURE() << "worker " << id_ << ": block " << block.ptr << " of " << block.size
                    << " bytes was overwritten while it was live: " << damage;
      failed_ = true;
    }
    absl::Status freed = shared_->pool->Free(block.ptr);
    if (!freed.ok()) Fail(freed);
  }

  // A stream other than the block's own reads the block; record_stream tells the pool, and
  // half the time the block is freed at once, so that only the pool keeps it from being
  // reused. (Work on the block's own stream would need no record_stream, but then the host
  // could not write a reused block directly: same-stream reuse is ordered by the stream.)
  void HandOff(size_t i) {
    const Live& block = live_[i];
    Stream other = block.stream;
    while (other == block.stream) other = any_stream();
    if (config_.rotate_every > 0) {
      // `other` may be destroyed at any moment: the launch may fail, record_stream may not.
      (void)shared_->driver->LaunchHostFunc(other, &PauseOnStream, nullptr);
    } else {
      auto* read = new StreamRead{block.ptr, block.size, block.stamp, rng_() % 3 == 0,
                                  &shared_->stream_read_failures};
      absl::Status launched = shared_->driver->LaunchHostFunc(other, &ReadOnStream, read);
      if (!launched.ok()) {
        delete read;
        return Fail(launched);
      }
    }
    absl::Status recorded = shared_->pool->RecordStream(block.ptr, other);
    if (!recorded.ok()) return Fail(recorded);
    ++hand_offs_;
    if (rng_() % 2 == 0) Free(i);
  }

  void Export(size_t i) {
    if (!shared_->exportable) return Free(i);
    const Live& block = live_[i];
    const bool with_handles = rng_() % 4 == 0;
    absl::StatusOr<ExportedWithHandles> with =
        with_handles ? ExportWithHandles(*shared_->pool, block.ptr)
                     : absl::StatusOr<ExportedWithHandles>(absl::UnknownError("unused"));
    absl::StatusOr<ExportedBlock> exported =
        with_handles ? (with.ok() ? absl::StatusOr<ExportedBlock>(with->block) : with.status())
                     : shared_->pool->Export(block.ptr);
    if (!exported.ok()) return Fail(exported.status());
    EXPECT_EQ(exported->size, block.size);
    ASSERT_FALSE(exported->chunks.empty());
    EXPECT_EQ(exported->chunks[0].addr + exported->offset, reinterpret_cast<uintptr_t>(block.ptr));
    size_t spanned = 0;
    for (size_t c = 0; c < exported->chunks.size(); ++c) {
      if (c > 0) {
        EXPECT_EQ(exported->chunks[c].addr,
                  exported->chunks[c - 1].addr + exported->chunks[c - 1].size);
      }
      spanned += exported->chunks[c].size;
      exported_chunks_.insert(exported->chunks[c].id);
    }
    EXPECT_GE(spanned, exported->offset + exported->size);
    if (!with_handles) return;
    absl::StatusOr<uint64_t> seen = ReadThroughImport(*shared_->driver, *with);
    if (!seen.ok()) return Fail(seen.status());
    EXPECT_EQ(*seen, block.stamp) << "an importer sees other data than the exporter";
    ++imports_checked_;
  }

  void Busy() {
    absl::Status launched = shared_->driver->LaunchHostFunc(own_stream(), &PauseOnStream, nullptr);
    if (!launched.ok()) Fail(launched);
  }

  void RotateStream() {
    absl::StatusOr<Stream> fresh = shared_->driver->CreateStream(0);
    if (!fresh.ok()) return Fail(fresh.status());
    shared_->current[id_].store(*fresh);
    if (made_stream_ != 0) {
      absl::Status destroyed = shared_->driver->DestroyStream(made_stream_);
      if (!destroyed.ok()) return Fail(destroyed);
    }
    made_stream_ = *fresh;
  }

  // A request larger than the memory limit: the pool trims, retries and reports OOM.
  void RequestTheImpossible() {
    absl::StatusOr<void*> got = shared_->pool->Allocate(config_.impossible_size, own_stream());
    EXPECT_TRUE(absl::IsResourceExhausted(got.status())) << got.status();
    if (!got.ok()) ++ooms_;
  }

  void Fail(const absl::Status& status) {
    ADD_FAILURE() << "worker " << id_ << ": " << status;
    failed_ = true;
  }

  const int id_;
  Shared* const shared_;
  const WorkerConfig config_;
  std::mt19937_64 rng_;
  std::vector<Live> live_;
  uint64_t sequence_ = 0;
  Stream made_stream_ = 0;  // the stream this worker made last (rotate_every)
  bool failed_ = false;
  int64_t ooms_ = 0;
  int hand_offs_ = 0;
  int imports_checked_ = 0;
  std::set<uint64_t> exported_chunks_;
};

// --- Fixture ----------------------------------------------------------------------------------

class PoolThreadsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(const TestBackend backend, SelectedTestBackend());
    if (backend != TestBackend::kHost) {
      GTEST_SKIP() << "host backend only: it stamps blocks from the CPU";
    }
    driver_ = NewHostDriver(HostDriverOptions{2 * kMiB, 2048 * kMiB});
    free_at_start_ = driver_->GetMemInfo(0)->free;
    shared_.driver = driver_.get();
    for (int i = 0; i < kThreads; ++i) {
      absl::StatusOr<Stream> stream = driver_->CreateStream(0);
      ASSERT_TRUE(stream.ok()) << stream.status();
      shared_.streams.push_back(*stream);
      shared_.current[i].store(*stream);
    }
  }

  void TearDown() override {
    pool_.reset();  // before the streams its blocks were tagged with
    for (Stream s : shared_.streams) EXPECT_TRUE(driver_->DestroyStream(s).ok());
  }

  void CreatePool(const PoolOptions& options) {
    absl::StatusOr<std::unique_ptr<Pool>> pool = Pool::Create(driver_.get(), options, &observer_);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = std::move(*pool);
    shared_.pool = pool_.get();
    shared_.exportable = pool_->handle_type() != HandleType::kNone;
  }

  // Runs kThreads workers with `config` beside a monitor thread.
  std::vector<std::unique_ptr<Worker>> RunWorkers(const WorkerConfig& config) {
    std::vector<std::unique_ptr<Worker>> workers;
    for (int i = 0; i < kThreads; ++i) {
      workers.push_back(std::make_unique<Worker>(i, &shared_, config));
    }
    Monitor monitor(pool_.get());
    std::vector<std::thread> threads;
    for (auto& w : workers) threads.emplace_back([&w] { w->Run(); });
    for (std::thread& t : threads) t.join();
    monitor.Stop();
    EXPECT_GT(monitor.iterations(), 0);
    return workers;
  }

  // Everything is freed: the pool must be able to give all its memory back, and the driver
  // must have all of it once the pool is gone.
  void ExpectAllMemoryReturned() {
    ASSERT_TRUE(pool_->EmptyCache().ok());
    absl::Status invariants = pool_->CheckInvariants();
    EXPECT_TRUE(invariants.ok()) << invariants;
    const PoolStats s = pool_->GetStats();
    EXPECT_EQ(s.allocation.current, 0);
    EXPECT_EQ(s.allocated_bytes.current, 0);
    EXPECT_EQ(s.active_bytes.current, 0);
    EXPECT_EQ(s.reserved_bytes.current, 0);
    EXPECT_EQ(s.exported_bytes.current, 0);
    EXPECT_EQ(s.segment.current, 0);
    pool_.reset();
    EXPECT_EQ(driver_->GetMemInfo(0)->free, free_at_start_);
  }

  // Chunks released after an export: each must be reported once.
  class ReleasedChunks : public ExportObserver {
   public:
    void ChunkReleased(uint64_t pool_id, uint64_t chunk_id) override {
      std::lock_guard<std::mutex> lock(mu);
      ids.insert(chunk_id);
    }
    void PoolDestroyed(uint64_t pool_id) override {}
    std::mutex mu;
    std::multiset<uint64_t> ids;
  };

  std::unique_ptr<Driver> driver_;
  size_t free_at_start_ = 0;
  Shared shared_;
  ReleasedChunks observer_;  // outlives pool_
  std::unique_ptr<Pool> pool_;
};

TEST_F(PoolThreadsTest, WorkersAllocateHandOffAndExportWhileAMonitorTrims) {
  PoolOptions options;
  options.reserve_size = 4096 * kMiB;
  options.growth_fraction = 0.05;
  options.release_threshold = 256 * kMiB;
  CreatePool(options);
  if (HasFatalFailure()) return;
  ReleasedChunks* released = &observer_;

  WorkerConfig config;
  config.ops = 4000 / kOpsScale;
  config.max_live = 8;
  config.allocate = 45;
  config.hand_off = 8;
  config.do_export = 4;
  config.busy = 5;
  config.max_large = 24 * kMiB;
  std::vector<std::unique_ptr<Worker>> workers = RunWorkers(config);

  EXPECT_EQ(shared_.stream_read_failures.load(), 0)
      << "a block was reused while another stream still read it";
  int hand_offs = 0, imports = 0;
  std::set<uint64_t> exported;
  for (const auto& w : workers) {
    hand_offs += w->hand_offs();
    imports += w->imports_checked();
    exported.insert(w->exported_chunks().begin(), w->exported_chunks().end());
  }
  EXPECT_GT(hand_offs, 0);
  if (shared_.exportable) {
    EXPECT_GT(imports, 0);
    EXPECT_FALSE(exported.empty());
  }
  ExpectAllMemoryReturned();
  std::lock_guard<std::mutex> lock(released->mu);
  for (uint64_t id : exported) {
    EXPECT_EQ(released->ids.count(id), 1u)
        << "exported chunk " << id << " reported released " << released->ids.count(id) << " times";
  }
}

TEST_F(PoolThreadsTest, ThreadsContendForASmallMemoryLimit) {
  constexpr size_t kLimit = 64 * kMiB;
  PoolOptions options;
  options.reserve_size = 1024 * kMiB;
  options.memory_limit = kLimit;
  CreatePool(options);
  if (HasFatalFailure()) return;

  WorkerConfig config;
  config.ops = 2400 / kOpsScale;
  config.max_live = 3;
  config.allocate = 55;
  config.hand_off = 5;
  config.busy = 10;
  config.max_large = 12 * kMiB;
  config.expect_oom = true;
  config.impossible_size = kLimit + kMiB;
  std::vector<std::unique_ptr<Worker>> workers = RunWorkers(config);

  EXPECT_EQ(shared_.stream_read_failures.load(), 0);
  int64_t ooms = 0;
  for (const auto& w : workers) ooms += w->ooms();
  const PoolStats s = pool_->GetStats();
  EXPECT_GE(ooms, kThreads);  // at least the impossible requests
  EXPECT_EQ(s.num_ooms, ooms) << "every failed allocation is counted once";
  EXPECT_GE(s.num_alloc_retries, s.num_ooms) << "each failure trims the cache and retries";
  EXPECT_LE(s.reserved_bytes.peak, static_cast<int64_t>(kLimit));
  ExpectAllMemoryReturned();
}

// Streams are destroyed while blocks are still tagged with them or recorded on them: frees
// and reclaims meet streams that are gone and fall back to synchronising the device.
TEST_F(PoolThreadsTest, StreamsAreDestroyedWhileBlocksStillUseThem) {
  PoolOptions options;
  options.reserve_size = 2048 * kMiB;
  CreatePool(options);
  if (HasFatalFailure()) return;

  WorkerConfig config;
  config.ops = 1600 / kOpsScale;
  config.max_live = 6;
  config.allocate = 45;
  config.hand_off = 15;
  config.busy = 5;
  config.max_large = 8 * kMiB;
  config.rotate_every = 40;
  RunWorkers(config);
  ExpectAllMemoryReturned();
}

}  // namespace
}  // namespace vmm
