// Attack tests of the moving path (reclaim_policy.h) under the DEFAULT pool options: long
// randomized sequences with several streams, pending frees, async stream work racing the pool,
// exports of every ExportUse, SettleExport, AllocateShareable, EmptyCache, SetKeepMemory, memory
// limits near the working set, a DeviceCap shared by two pools, ranges that grow past their first
// reservation, and driver failures injected while the pool moves chunks. After every step:
// Pool::CheckInvariants, every live block's bytes, stats against the snapshot and the driver,
// that no exported chunk moved, and that the ranges the pool's MappingListener was told are
// mapped are its chunks' (tests/told_ranges.h).
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "allocator/device_cap.h"
#include "allocator/host_driver.h"
#include "allocator/pool.h"
#include "gtest/gtest.h"
#include "allocator/forwarding_driver.h"
#include "tests/pool_helpers.h"
#include "tests/slack_range_driver.h"
#include "tests/status_matchers.h"
#include "tests/stream_gate.h"
#include "tests/told_ranges.h"

namespace vmm {
namespace {

constexpr size_t kKiB = size_t{1} << 10;
constexpr size_t kMiB = size_t{1} << 20;

// ---------------------------------------------------------------------------------------------
// Failure injection.

enum FaultOp {
  kCreate, kMap, kUnmap, kSetAccess, kSyncStream,
  kCreateEvent, kRecordEvent, kEventDone, kSyncDevice, kReserveAt, kNumOps
};
const char* const kOpNames[kNumOps] = {"Create",      "Map",         "Unmap",
                                       "SetAccess",   "SynchronizeStream", "CreateEvent",
                                       "RecordEvent", "EventDone",   "SynchronizeDevice",
                                       "ReserveAt"};

class FaultDriver : public ForwardingDriver {
 public:
  using ForwardingDriver::ForwardingDriver;

  // Fails the call of `op` after `skip` successful ones; every later one too if `persistent`.
  void Arm(int op, int skip, bool persistent, absl::StatusCode code = absl::StatusCode::kInternal) {
    std::lock_guard<std::mutex> lock(mu_);
    arm_[op] = Arm_{true, skip, persistent, code};
  }
  void Disarm() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& a : arm_) a = Arm_{};
  }
  int64_t injected() const { return injected_.load(); }
  std::string log() {
    std::lock_guard<std::mutex> lock(mu_);
    return log_;
  }
  void ClearLog() {
    std::lock_guard<std::mutex> lock(mu_);
    log_.clear();
  }

  absl::StatusOr<PhysHandle> Create(int d, size_t size, uint32_t types) override {
    if (absl::Status s = Hit(kCreate); !s.ok()) return s;
    return ForwardingDriver::Create(d, size, types);
  }
  absl::Status Map(DevPtr p, size_t size, PhysHandle h) override {
    if (absl::Status s = Hit(kMap); !s.ok()) return s;
    return ForwardingDriver::Map(p, size, h);
  }
  absl::Status Unmap(DevPtr p, size_t size) override {
    if (absl::Status s = Hit(kUnmap); !s.ok()) return s;
    return ForwardingDriver::Unmap(p, size);
  }
  absl::Status SetAccess(DevPtr p, size_t size, absl::Span<const int> devices) override {
    if (absl::Status s = Hit(kSetAccess); !s.ok()) return s;
    return ForwardingDriver::SetAccess(p, size, devices);
  }
  absl::StatusOr<DevPtr> ReserveAt(DevPtr at, size_t size) override {
    if (absl::Status s = Hit(kReserveAt); !s.ok()) return s;
    return ForwardingDriver::ReserveAt(at, size);
  }
  absl::Status SynchronizeStream(Stream s) override {
    if (absl::Status st = Hit(kSyncStream); !st.ok()) return st;
    return ForwardingDriver::SynchronizeStream(s);
  }
  absl::StatusOr<Event> CreateEvent(int d) override {
    if (absl::Status s = Hit(kCreateEvent); !s.ok()) return s;
    return ForwardingDriver::CreateEvent(d);
  }
  absl::Status RecordEvent(Event e, Stream s) override {
    if (absl::Status st = Hit(kRecordEvent); !st.ok()) return st;
    return ForwardingDriver::RecordEvent(e, s);
  }
  absl::StatusOr<bool> EventDone(Event e) override {
    if (absl::Status s = Hit(kEventDone); !s.ok()) return s;
    return ForwardingDriver::EventDone(e);
  }
  absl::Status SynchronizeDevice(int d) override {
    if (absl::Status s = Hit(kSyncDevice); !s.ok()) return s;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++device_syncs_[d];
    }
    return ForwardingDriver::SynchronizeDevice(d);
  }
  // Successful SynchronizeDevice calls for device `d`.
  int device_syncs(int d) {
    std::lock_guard<std::mutex> lock(mu_);
    return device_syncs_[d];
  }

 private:
  struct Arm_ {
    bool on = false;
    int skip = 0;
    bool persistent = false;
    absl::StatusCode code = absl::StatusCode::kInternal;
  };
  std::map<int, int> device_syncs_;
  absl::Status Hit(int op) {
    std::lock_guard<std::mutex> lock(mu_);
    Arm_& a = arm_[op];
    if (!a.on) return absl::OkStatus();
    if (a.skip > 0) {
      --a.skip;
      return absl::OkStatus();
    }
    if (!a.persistent) a.on = false;
    ++injected_;
    absl::StrAppend(&log_, " [injected ", kOpNames[op], "]");
    return absl::Status(a.code, absl::StrCat("injected ", kOpNames[op], " failure"));
  }

  std::mutex mu_;
  Arm_ arm_[kNumOps];
  std::atomic<int64_t> injected_{0};
  std::string log_;
};

// ---------------------------------------------------------------------------------------------
// An observer that knows which exported chunk ids are still meant to be where they were.

class TrackingObserver : public ExportObserver {
 public:
  void ChunkReleased(uint64_t pool, uint64_t id) override {
    std::lock_guard<std::mutex> lock(mu_);
    released_.insert({pool, id});
  }
  void ChunkRenamed(uint64_t pool, uint64_t old_id, uint64_t new_id) override {
    std::lock_guard<std::mutex> lock(mu_);
    renamed_[{pool, old_id}] = new_id;
  }
  void PoolDestroyed(uint64_t) override {}
  bool Released(uint64_t pool, uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    return released_.count({pool, id}) != 0;
  }
  // 0 if not renamed.
  uint64_t RenamedTo(uint64_t pool, uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = renamed_.find({pool, id});
    return it == renamed_.end() ? 0 : it->second;
  }

 private:
  std::mutex mu_;
  std::set<std::pair<uint64_t, uint64_t>> released_;
  std::map<std::pair<uint64_t, uint64_t>, uint64_t> renamed_;
};

// ---------------------------------------------------------------------------------------------
// Patterns. A block is stamped at every 4 KiB and at its last byte.

void Stamp(void* p, size_t n, unsigned char v) {
  auto* b = static_cast<unsigned char*>(p);
  for (size_t i = 0; i < n; i += 4096) b[i] = v;
  b[n - 1] = v;
}

// Empty if intact, else where it is not.
std::string CheckStamp(const void* p, size_t n, unsigned char v) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; i += 4096) {
    if (b[i] != v) {
      return absl::StrCat("byte ", i, " of block ", absl::Hex(reinterpret_cast<uintptr_t>(p)),
                          " (", n, " bytes) is ", int{b[i]}, ", want ", int{v});
    }
  }
  if (b[n - 1] != v) return absl::StrCat("last byte of ", absl::Hex(reinterpret_cast<uintptr_t>(p)));
  return "";
}

void SleepUs(void* arg) { ::usleep(static_cast<useconds_t>(reinterpret_cast<uintptr_t>(arg))); }

// ---------------------------------------------------------------------------------------------
// The harness: one or two pools on a fault-injecting host driver.

struct Live {
  size_t size;
  unsigned char value;
  Stream stream;
  bool shareable;
  bool async;  // written by stream work not yet known complete: check after a device sync
};

struct Tracked {
  uint64_t id;
  uintptr_t addr;
  size_t size;
};

struct PoolState {
  std::string name;
  std::unique_ptr<ToldRanges> told;  // the pool's MappingListener: outlives it
  std::unique_ptr<Pool> pool;
  std::map<uintptr_t, Live> live;
  size_t live_bytes = 0;
  size_t live_cap = 0;
  // Kept memory: chunk addresses that must stay, and the counters that must not move.
  bool keep = false;
  std::set<uintptr_t> kept_chunks;
  int64_t moves_at_keep = 0;
  int64_t frees_at_keep = 0;
  // kTracked exports not settled yet.
  std::vector<std::vector<ExportedChunk>> unsettled;
  // Exported chunks (by current id) that must stay where they are.
  std::map<uint64_t, Tracked> exported;
  std::vector<int> peers;
  bool limited = false;  // a memory limit or a shared cap may refuse growth
};

struct Options {
  uint64_t seed = 1;
  int steps = 2000;
  bool two_pools = false;     // a second pool sharing a DeviceCap with the first
  int fault_percent = 0;      // steps with a fault armed
  bool persistent_faults = false;
  bool async = true;          // stream work racing the pool
  // The defaults, but for 8 MiB pages: the pools here have an export observer, so "auto" would
  // give them single chunks (pool_options.h), and the moving path is what is attacked.
  PoolOptions pool = [] {
    PoolOptions o;
    o.large_page = 8 * kMiB;
    return o;
  }();
  size_t capacity = 768 * kMiB;
  int devices = 1;
  size_t live_cap = 200 * kMiB;
  size_t max_size = 64 * kMiB;
  // Address space kept free after each range (SlackRangeDriver), where a range that grows
  // (PoolOptions::range_grows) goes; 0: the host driver's own (mostly taken).
  size_t slack = 0;
};

class Harness {
 public:
  explicit Harness(const Options& o) : o_(o), rng_(o.seed) {
    HostDriverOptions h;
    h.capacity = o.capacity;
    h.device_count = o.devices;
    inner_ = NewHostDriver(h);
    if (o.slack != 0) slack_ = std::make_unique<SlackRangeDriver>(inner_.get(), o.slack);
    driver_ = std::make_unique<FaultDriver>(slack_ != nullptr ? slack_.get() : inner_.get());
    for (int i = 0; i < 3; ++i) streams_.push_back(*inner_->CreateStream(0));
    streams_.push_back(0);  // the default stream too
  }
  ~Harness() {
    driver_->Disarm();
    (void)inner_->SynchronizeDevice(0);
    for (auto& ps : pools_) {
      ps.pool.reset();  // its teardown unmaps what it still holds, and says so
      EXPECT_TRUE(ps.told->ranges().empty()) << ps.told->bytes() << " bytes still told mapped";
      EXPECT_TRUE(ps.told->errors().empty()) << ps.told->errors().front();
    }
    for (Stream s : streams_) {
      if (s != 0) (void)inner_->DestroyStream(s);
    }
  }

  ::testing::AssertionResult Setup() {
    PoolState a;
    a.name = "A";
    a.live_cap = o_.live_cap;
    a.peers = o_.pool.peer_devices;
    auto p = Pool::Create(driver_.get(), o_.pool, &observer_);
    if (!p.ok()) return ::testing::AssertionFailure() << p.status();
    a.pool = std::move(*p);
    a.told = std::make_unique<ToldRanges>();
    a.pool->SetMappingListener(a.told.get(), MappingSource{});
    a.limited = SmallRange();
    pools_.push_back(std::move(a));
    if (o_.two_pools) {
      cap_ = std::make_shared<DeviceCap>();
      cap_->SetLimit(o_.live_cap + 96 * kMiB);
      PoolState b;
      b.name = "B";
      b.live_cap = o_.live_cap / 3;
      b.peers = o_.pool.peer_devices;
      auto q = Pool::Create(driver_.get(), o_.pool, &observer_);
      if (!q.ok()) return ::testing::AssertionFailure() << q.status();
      b.pool = std::move(*q);
      b.told = std::make_unique<ToldRanges>();
      b.pool->SetMappingListener(b.told.get(), MappingSource{});
      pools_[0].pool->ShareDeviceCap(cap_);
      pools_[0].limited = b.limited = true;
      b.pool->ShareDeviceCap(cap_);
      pools_.push_back(std::move(b));
    }
    return ::testing::AssertionSuccess();
  }

  // Runs the steps; the first violation is returned as a failure naming the step.
  ::testing::AssertionResult Run() {
    for (step_ = 0; step_ < o_.steps; ++step_) {
      const bool fault = o_.fault_percent > 0 && Pct() < o_.fault_percent;
      if (fault) {
        const int op = static_cast<int>(rng_() % kNumOps);
        const int skip = static_cast<int>(rng_() % 4);
        const bool persistent = o_.persistent_faults && Pct() < 40;
        absl::StatusCode code =
            (op == kCreate && Pct() < 50) || (op == kMap && Pct() < 20)
                ? absl::StatusCode::kResourceExhausted
                : absl::StatusCode::kInternal;
        driver_->Arm(op, skip, persistent, code);
        what_ = absl::StrCat("[fault ", kOpNames[op], " skip ", skip,
                             persistent ? " persistent" : "", "] ");
      } else {
        what_.clear();
      }
      driver_->ClearLog();
      PoolState& ps = pools_.size() > 1 && Pct() < 25 ? pools_[1] : pools_[0];
      const PoolStats before = ps.pool->GetStats();
      if (auto r = DoStep(ps, fault); !r) return r;
      driver_->Disarm();
      const PoolStats after = ps.pool->GetStats();
      if (after.num_chunk_moves != before.num_chunk_moves) ++steps_with_moves_;
      moves_ += after.num_chunk_moves - before.num_chunk_moves;
      if (auto r = CheckAll(/*sync=*/step_ % 5 == 4 || !o_.async); !r) return r;
    }
    return Finish();
  }

  int64_t moves() const { return moves_; }
  int64_t steps_with_moves() const { return steps_with_moves_; }
  int64_t injected() const { return driver_->injected(); }
  int64_t alloc_failures() const { return alloc_failures_; }
  int64_t exports() const { return exports_; }
  // Snapshots that showed a chunk of several pages (summed over chunks and steps).
  int64_t several_page_chunks_seen() const { return several_page_chunks_seen_; }
  // Ranges the pools reserved after their first (PoolStats::num_range_extensions).
  int64_t range_extensions() const {
    int64_t n = 0;
    for (const auto& ps : pools_) n += ps.pool->GetStats().num_range_extensions;
    return n;
  }
  // Driver calls that crossed from one reservation into another (none may).
  int crossings() const { return slack_ != nullptr ? slack_->crossings() : 0; }
  int64_t sync_streams() const {
    int64_t n = 0;
    for (const auto& ps : pools_) n += ps.pool->GetStats().num_sync_stream;
    return n;
  }

 private:
  int Pct() { return static_cast<int>(rng_() % 100); }
  // Whether the pools' range is small and bounded: it fragments, and an OOM is legitimate
  // (not where it grows into address space the driver keeps free).
  bool SmallRange() const {
    return o_.pool.reserve_size != 0 && !(o_.pool.range_grows && o_.slack != 0);
  }
  Stream AnyStream() { return streams_[rng_() % streams_.size()]; }

  size_t RandomSize() {
    const int r = Pct();
    if (r < 25) return 512 * (1 + rng_() % 512);                                // small arena
    if (r < 45) return 256 * kKiB + 1 + rng_() % (2 * kMiB);                    // KV-page-ish
    if (r < 92) return 2 * kMiB + rng_() % (22 * kMiB);                         // a few pages
    return 24 * kMiB + rng_() % (o_.max_size - 24 * kMiB);                       // many pages
  }

  ::testing::AssertionResult Fail(const std::string& msg) {
    return ::testing::AssertionFailure()
           << "seed " << o_.seed << " step " << step_ << " " << what_ << msg
           << " driver log:" << driver_->log();
  }

  // Writes `value` into a fresh block: on the host when its stream has no stream work in
  // flight that could still touch the memory, else (or at random) by stream work.
  void Fill(uintptr_t addr, Live& l) {
    if (o_.async && (busy_.count(l.stream) || Pct() < 35)) {
      if (Pct() < 50) {
        (void)inner_->LaunchHostFunc(l.stream, &SleepUs,
                                     reinterpret_cast<void*>(uintptr_t{200} + rng_() % 3000));
      }
      (void)inner_->MemsetAsync(addr, l.value, l.size, l.stream);
      busy_.insert(l.stream);
      l.async = true;
    } else {
      Stamp(reinterpret_cast<void*>(addr), l.size, l.value);
      l.async = false;
    }
  }

  ::testing::AssertionResult DoStep(PoolState& ps, bool fault) {
    Pool& pool = *ps.pool;
    // Kept memory: rarely turned on, soon turned off again.
    if (Pct() < (ps.keep ? 12 : 1)) {
      ps.keep = !ps.keep;
      pool.SetKeepMemory(ps.keep);
      if (ps.keep) {
        const PoolStats st = pool.GetStats();
        ps.moves_at_keep = st.num_chunk_moves;
        ps.frees_at_keep = st.num_device_free;
        ps.kept_chunks.clear();
      }
    }
    const int r = Pct();
    if (r < 46 && ps.live_bytes < ps.live_cap) {
      const bool shareable = Pct() < 6;
      const size_t size = shareable ? 512 * (1 + rng_() % (16 * kMiB / 512)) : RandomSize();
      const Stream stream = AnyStream();
      absl::StatusOr<void*> p =
          shareable ? pool.AllocateShareable(size, stream) : pool.Allocate(size, stream);
      if (!p.ok()) {
        ++alloc_failures_;
        if (getenv("ATTACK_VERBOSE")) std::cout << "step " << step_ << " alloc " << size << " failed: " << p.status() << std::endl;
        const bool oom = absl::IsResourceExhausted(p.status());
        if (!fault && !oom) return Fail(absl::StrCat("allocate ", size, ": ", p.status().ToString()));
        if (!fault && oom && !ps.limited && !ps.keep && ps.live_bytes + size < o_.capacity / 2) {
          return Fail(absl::StrCat("unexpected OOM for ", size, " with ", ps.live_bytes,
                                   " live: ", p.status().ToString()));
        }
        return ::testing::AssertionSuccess();
      }
      const auto addr = reinterpret_cast<uintptr_t>(*p);
      if (ps.live.count(addr)) return Fail(absl::StrCat("address handed out twice: ", absl::Hex(addr)));
      Live l{size, static_cast<unsigned char>(1 + rng_() % 250), stream, shareable, false};
      Fill(addr, l);
      ps.live[addr] = l;
      ps.live_bytes += size;
      return ::testing::AssertionSuccess();
    }
    if (r < 82 && !ps.live.empty()) {
      auto it = ps.live.begin();
      std::advance(it, static_cast<long>(rng_() % ps.live.size()));
      const uintptr_t addr = it->first;
      Live& l = it->second;
      if (!l.async) {
        if (std::string e = CheckStamp(reinterpret_cast<void*>(addr), l.size, l.value); !e.empty()) {
          return Fail("before free: " + e);
        }
      }
      if (o_.async && Pct() < 30) {
        // Another stream uses it (the same bytes again, later): the free must wait for it.
        Stream t = AnyStream();
        if (t != l.stream) {
          (void)inner_->LaunchHostFunc(t, &SleepUs,
                                       reinterpret_cast<void*>(uintptr_t{500} + rng_() % 4000));
          (void)inner_->MemsetAsync(addr, l.value, l.size, t);
          busy_.insert(t);
          if (absl::Status s = pool.RecordStream(reinterpret_cast<void*>(addr), t); !s.ok()) {
            return Fail(absl::StrCat("record_stream: ", s.ToString()));
          }
        }
      }
      if (o_.async && Pct() < 30) {
        // Its own stream still writes it when it is freed (stream-ordered free).
        (void)inner_->LaunchHostFunc(l.stream, &SleepUs,
                                     reinterpret_cast<void*>(uintptr_t{500} + rng_() % 4000));
        (void)inner_->MemsetAsync(addr, l.value, l.size, l.stream);
        busy_.insert(l.stream);
      }
      absl::Status s = pool.Free(reinterpret_cast<void*>(addr));
      if (!s.ok() && !fault) return Fail(absl::StrCat("free: ", s.ToString()));
      if (!s.ok()) {
        // Is it still live? Then keep it in the model.
        bool still = false;
        for (const BlockInfo& b : pool.LiveBlocks()) {
          still |= b.addr == addr && b.state == BlockState::kAllocated;
        }
        if (still) return ::testing::AssertionSuccess();
      }
      ps.live_bytes -= l.size;
      ps.live.erase(it);
      return ::testing::AssertionSuccess();
    }
    if (r < 85 && !ps.live.empty()) {
      auto it = ps.live.begin();
      std::advance(it, static_cast<long>(rng_() % ps.live.size()));
      const int u = Pct();
      const ExportUse use = u < 40 ? ExportUse::kTracked : u < 75 ? ExportUse::kUntracked : ExportUse::kMark;
      const ExportNeighbours nb = Pct() < 50 ? ExportNeighbours::kRefuse : ExportNeighbours::kAllow;
      absl::StatusOr<ExportedBlock> e =
          pool.Export(reinterpret_cast<void*>(it->first), HandleType::kNone, nb, use);
      if (!e.ok()) {
        if (absl::IsFailedPrecondition(e.status()) && nb == ExportNeighbours::kRefuse) {
          return ::testing::AssertionSuccess();
        }
        return Fail(absl::StrCat("export: ", e.status().ToString()));
      }
      ++exports_;
      for (const ExportedChunk& c : e->chunks) {
        ps.exported[c.id] = Tracked{c.id, c.addr, c.size};
      }
      if (use == ExportUse::kTracked) ps.unsettled.push_back(e->chunks);
      return ::testing::AssertionSuccess();
    }
    if (r < 89 && !ps.unsettled.empty()) {
      const size_t i = rng_() % ps.unsettled.size();
      pool.SettleExport(ps.unsettled[i], /*released=*/Pct() < 80);
      ps.unsettled.erase(ps.unsettled.begin() + static_cast<long>(i));
      return ::testing::AssertionSuccess();
    }
    if (r < 90) {
      absl::Status s = pool.EmptyCache();
      if (!s.ok() && !fault) return Fail(absl::StrCat("EmptyCache: ", s.ToString()));
      if (s.ok()) busy_.clear();  // it synchronised the device
      return ::testing::AssertionSuccess();
    }
    if (r < 92) {
      const int64_t reserved = pool.GetStats().reserved_bytes.current;
      size_t limit = 0;
      if (Pct() < 70) {
        limit = std::max<size_t>(ps.live_bytes + 8 * kMiB + rng_() % (64 * kMiB),
                                 static_cast<size_t>(reserved) -
                                     std::min<size_t>(static_cast<size_t>(reserved),
                                                      rng_() % (16 * kMiB + 1)));
      }
      pool.SetMemoryLimit(limit);
      ps.limited = limit != 0 || cap_ != nullptr || SmallRange();
      return ::testing::AssertionSuccess();
    }
    // A device synchronisation from the program (not the pool).
    (void)inner_->SynchronizeDevice(0);
    busy_.clear();
    return ::testing::AssertionSuccess();
  }

  ::testing::AssertionResult CheckPool(PoolState& ps, bool contents) {
    Pool& pool = *ps.pool;
    if (absl::Status s = pool.CheckInvariants(); !s.ok()) {
      return Fail(absl::StrCat("pool ", ps.name, ": ", s.ToString()));
    }
    const PoolStats st = pool.GetStats();
    const Snapshot snap = pool.GetSnapshot();
    int64_t chunk_bytes = 0, chunk_count = 0, exported_bytes = 0, allocated = 0, allocated_n = 0;
    std::map<uintptr_t, ChunkInfo> chunks;
    std::map<uintptr_t, BlockInfo> blocks;
    for (const SegmentInfo& seg : snap.segments) {
      for (const ChunkInfo& c : seg.chunks) {
        chunk_bytes += static_cast<int64_t>(c.size);
        ++chunk_count;
        if (c.exported) exported_bytes += static_cast<int64_t>(c.size);
        chunks[c.addr] = c;
        // A large-arena chunk of a whole number of pages, two or more, that no shareable block
        // owns or owned (a spare chunk reused as plain memory): what growth_page makes (its
        // powers of two of pages). A small-arena chunk taken into the large arena may count
        // too where small_chunk is such a size: the edges checked (kEdges) keep it below a
        // page.
        const size_t page = pool.options().large_page;  // as the pool rounded it
        if (seg.large && !c.dedicated && !c.exported && !c.observed && page != 0 &&
            c.size >= 2 * page && c.size % page == 0 &&
            c.size != pool.options().small_chunk) {
          ++several_page_chunks_seen_;
        }
      }
      for (const BlockInfo& b : seg.blocks) {
        if (b.state == BlockState::kAllocated) {
          allocated += static_cast<int64_t>(b.size);
          ++allocated_n;
          blocks[b.addr] = b;
        }
      }
    }
    if (chunk_bytes != st.reserved_bytes.current) {
      return Fail(absl::StrCat("pool ", ps.name, ": snapshot chunks hold ", chunk_bytes,
                               " bytes, reserved_bytes says ", st.reserved_bytes.current));
    }
    if (chunk_count != st.segment.current) {
      return Fail(absl::StrCat("pool ", ps.name, ": ", chunk_count, " chunks in the snapshot, segment says ",
                               st.segment.current));
    }
    // What the listener was told is mapped: the chunks, no more, no less.
    std::map<uintptr_t, size_t> chunk_sizes;
    for (const auto& [a, c] : chunks) chunk_sizes[a] = c.size;
    if (const std::vector<std::string> errors = ps.told->errors(); !errors.empty()) {
      return Fail(absl::StrCat("pool ", ps.name, ": the listener was told ", errors.front()));
    }
    if (ps.told->ranges() != ToldRanges::Merge(chunk_sizes)) {
      return Fail(absl::StrCat("pool ", ps.name, ": the listener was told ", ps.told->bytes(),
                               " bytes mapped in other ranges than the chunks' ", chunk_bytes));
    }
    if (exported_bytes != st.exported_bytes.current) return Fail("exported_bytes vs snapshot");
    if (allocated != st.allocated_bytes.current) return Fail("allocated_bytes vs snapshot");
    if (allocated_n != static_cast<int64_t>(ps.live.size())) {
      return Fail(absl::StrCat("pool ", ps.name, ": ", allocated_n, " allocated blocks, model has ",
                               ps.live.size()));
    }
    int64_t requested = 0;
    for (const auto& [addr, l] : ps.live) {
      requested += static_cast<int64_t>(l.size);
      auto b = blocks.find(addr);
      if (b == blocks.end() || b->second.size < l.size || b->second.requested != l.size) {
        return Fail(absl::StrCat("live block ", absl::Hex(addr), " missing from the snapshot"));
      }
    }
    if (requested != st.requested_bytes.current) return Fail("requested_bytes vs model");
    // Exported chunks stay where they were until released (or, renamed, stay as spare; a
    // plain allocation that takes a spare chunk takes the mark off, and it stays observed).
    for (auto it = ps.exported.begin(); it != ps.exported.end();) {
      const Tracked t = it->second;
      if (observer_.Released(pool.id(), t.id)) {
        it = ps.exported.erase(it);
        continue;
      }
      if (uint64_t n = observer_.RenamedTo(pool.id(), t.id); n != 0) {
        it = ps.exported.erase(it);
        ps.exported[n] = Tracked{n, t.addr, t.size};
        it = ps.exported.begin();  // restart: the map changed
        continue;
      }
      auto c = chunks.find(t.addr);
      if (c == chunks.end() || c->second.size != t.size ||
          !(c->second.exported || c->second.observed)) {
        return Fail(absl::StrCat("pool ", ps.name, ": exported chunk id ", t.id, " at ", absl::Hex(t.addr),
                                 " is no longer there (moved?) and was never released"));
      }
      ++it;
    }
    // Kept memory: nothing moved, nothing released.
    if (ps.keep) {
      for (uintptr_t a : ps.kept_chunks) {
        if (!chunks.count(a)) return Fail(absl::StrCat("kept chunk at ", absl::Hex(a), " disappeared"));
      }
      for (const auto& [a, c] : chunks) ps.kept_chunks.insert(a);
      if (st.num_chunk_moves != ps.moves_at_keep) return Fail("a chunk moved while the pool kept its memory");
      if (st.num_device_free != ps.frees_at_keep) return Fail("memory released while kept");
    }
    // Access on the pool's device and its peers for every mapped chunk.
    for (const auto& [a, c] : chunks) {
      for (int d = -1; d < static_cast<int>(ps.peers.size()); ++d) {
        const int dev = d < 0 ? 0 : ps.peers[static_cast<size_t>(d)];
        absl::StatusOr<bool> has = inner_->HasAccess(a, dev);
        if (!has.ok() || !*has) {
          return Fail(absl::StrCat("chunk at ", absl::Hex(a), " lacks access for device ", dev, ": ",
                                   has.ok() ? "no" : has.status().ToString()));
        }
      }
    }
    for (auto& [addr, l] : ps.live) {
      if (l.async && !contents) continue;
      if (std::string e = CheckStamp(reinterpret_cast<void*>(addr), l.size, l.value); !e.empty()) {
        return Fail(absl::StrCat("pool ", ps.name, ": ", e));
      }
    }
    return ::testing::AssertionSuccess();
  }

  ::testing::AssertionResult CheckAll(bool sync) {
    if (sync) {
      (void)inner_->SynchronizeDevice(0);
      busy_.clear();
      for (auto& ps : pools_) {
        for (auto& [a, l] : ps.live) l.async = false;
      }
    }
    int64_t reserved = 0, allocated = 0, allocated_peaks = 0;
    for (auto& ps : pools_) {
      if (auto r = CheckPool(ps, sync); !r) return r;
      const PoolStats stats = ps.pool->GetStats();
      reserved += stats.reserved_bytes.current;
      allocated += stats.allocated_bytes.current;
      allocated_peaks += stats.allocated_bytes.peak;
    }
    // Every physical byte the driver holds is some pool's reserved byte.
    absl::StatusOr<MemInfo> info = inner_->GetMemInfo(0);
    if (!info.ok()) return Fail(info.status().ToString());
    const int64_t held = static_cast<int64_t>(info->total - info->free);
    if (held != reserved) {
      return Fail(absl::StrCat("driver holds ", held, " bytes, pools reserve ", reserved));
    }
    if (cap_ != nullptr && cap_->held() != reserved) {
      return Fail(absl::StrCat("DeviceCap holds ", cap_->held(), ", pools reserve ", reserved));
    }
    // The joint figures: the pools' sums now, and a peak between that and the sum of peaks.
    if (cap_ != nullptr && (cap_->reserved().current() != reserved ||
                            cap_->allocated().current() != allocated ||
                            cap_->allocated().peak() < allocated ||
                            cap_->allocated().peak() > allocated_peaks)) {
      return Fail(absl::StrCat("DeviceCap's joint figures: reserved ", cap_->reserved().current(),
                               " (pools reserve ", reserved, "), allocated ",
                               cap_->allocated().current(), " peak ", cap_->allocated().peak(),
                               " (pools ", allocated, ", their peaks ", allocated_peaks, ")"));
    }
    return ::testing::AssertionSuccess();
  }

  ::testing::AssertionResult Finish() {
    driver_->Disarm();
    for (auto& ps : pools_) {
      ps.pool->SetKeepMemory(false);
      ps.keep = false;
      for (auto& u : ps.unsettled) ps.pool->SettleExport(u, true);
      ps.unsettled.clear();
      for (const auto& [addr, l] : ps.live) {
        if (absl::Status s = ps.pool->Free(reinterpret_cast<void*>(addr)); !s.ok()) {
          return Fail(absl::StrCat("final free: ", s.ToString()));
        }
      }
      ps.live.clear();
      ps.live_bytes = 0;
      if (absl::Status s = ps.pool->EmptyCache(); !s.ok()) return Fail(s.ToString());
    }
    if (auto r = CheckAll(true); !r) return r;
    for (auto& ps : pools_) {
      const PoolStats st = ps.pool->GetStats();
      if (st.reserved_bytes.current != 0) {
        return Fail(absl::StrCat("pool ", ps.name, " holds ", st.reserved_bytes.current,
                                 " bytes after freeing everything and EmptyCache"));
      }
    }
    return ::testing::AssertionSuccess();
  }

  Options o_;
  std::mt19937_64 rng_;
  std::unique_ptr<Driver> inner_;
  std::unique_ptr<SlackRangeDriver> slack_;  // with Options::slack, between the two
  std::unique_ptr<FaultDriver> driver_;
  std::vector<Stream> streams_;
  std::set<Stream> busy_;
  TrackingObserver observer_;
  std::shared_ptr<DeviceCap> cap_;
  std::vector<PoolState> pools_;
  int step_ = 0;
  std::string what_;
  int64_t moves_ = 0, steps_with_moves_ = 0, alloc_failures_ = 0, exports_ = 0;
  int64_t several_page_chunks_seen_ = 0;
};

// What a run saw: chunks of several pages in its snapshots (Harness::several_page_chunks_seen)
// and ranges grown (Harness::range_extensions).
struct Seen {
  int64_t several_pages = 0;
  int64_t range_extensions = 0;
};

Seen RunHarness(Options o, bool expect_moves = true) {
  // ATTACK_SEED_BASE / ATTACK_STEPS: more seeds and longer runs by hand.
  if (const char* b = getenv("ATTACK_SEED_BASE")) o.seed += std::strtoull(b, nullptr, 10) * 1000003;
  if (const char* n = getenv("ATTACK_STEPS")) o.steps = std::atoi(n);
  Harness h(o);
  const ::testing::AssertionResult setup = h.Setup();
  EXPECT_TRUE(setup);
  if (!setup) return {};
  ::testing::AssertionResult r = h.Run();
  EXPECT_TRUE(r);
  EXPECT_EQ(h.crossings(), 0) << "a driver call crossed from one reservation into another";
  std::cout << "seed " << o.seed << ": moves " << h.moves() << " in " << h.steps_with_moves()
            << " steps, sync_stream " << h.sync_streams() << ", exports " << h.exports()
            << ", allocation failures " << h.alloc_failures() << ", injected faults "
            << h.injected() << ", chunks of several pages seen "
            << h.several_page_chunks_seen() << ", ranges grown " << h.range_extensions()
            << std::endl;
  if (r && expect_moves) {
    EXPECT_GT(h.moves(), 0);
  }
  return {h.several_page_chunks_seen(), h.range_extensions()};
}

// ---------------------------------------------------------------------------------------------
// Randomized sequences under the defaults.

class AttackSeeds : public ::testing::TestWithParam<uint64_t> {};

TEST_P(AttackSeeds, DefaultsSinglePoolWithStreamsExportsKeepAndLimits) {
  Options o;
  o.seed = GetParam();
  RunHarness(o);
}

TEST_P(AttackSeeds, DefaultsTwoPoolsSharingADeviceCap) {
  Options o;
  o.seed = GetParam() * 7919;
  o.two_pools = true;
  RunHarness(o);
}

TEST_P(AttackSeeds, DefaultsWithPeerDevices) {
  Options o;
  o.seed = GetParam() * 104729;
  o.devices = 3;
  o.pool.peer_devices = {1, 2};
  RunHarness(o);
}

TEST_P(AttackSeeds, DefaultsWithOneShotFaults) {
  Options o;
  o.seed = GetParam() * 31;
  o.fault_percent = 20;
  RunHarness(o);
}

TEST_P(AttackSeeds, DefaultsWithPersistentFaults) {
  Options o;
  o.seed = GetParam() * 131;
  o.fault_percent = 20;
  o.persistent_faults = true;
  RunHarness(o);
}

INSTANTIATE_TEST_SUITE_P(Seeds, AttackSeeds, ::testing::Values(1, 2, 3));

// ---------------------------------------------------------------------------------------------
// Hostile and edge options: the same sequences must keep every invariant.

struct Edge {
  const char* name;
  void (*apply)(PoolOptions&);
  bool several_pages = false;  // the options make chunks of several pages: one must show
  size_t slack = 0;            // Options::slack: the range grows (one must)
};

const Edge kEdges[] = {
    {"page_3MiB_not_multiple_of_granularity", [](PoolOptions& o) { o.large_page = 3 * kMiB; }},
    {"page_1_byte", [](PoolOptions& o) { o.large_page = 1; }},
    {"page_at_max_chunk", [](PoolOptions& o) { o.max_chunk = 4 * kMiB; o.large_page = 4 * kMiB; }},
    {"page_32MiB", [](PoolOptions& o) { o.large_page = 32 * kMiB; }},
    {"small_size_above_page", [](PoolOptions& o) { o.small_size = 12 * kMiB; }},
    {"small_size_1", [](PoolOptions& o) { o.small_size = 1; }},
    {"growth_fraction_1", [](PoolOptions& o) { o.growth_fraction = 1; }},
    {"spare_export_off", [](PoolOptions& o) { o.spare_export_bytes = 0; }},
    {"release_threshold_0", [](PoolOptions& o) { o.release_threshold = 0; }},
    {"release_threshold_16MiB", [](PoolOptions& o) { o.release_threshold = 16 * kMiB; }},
    {"page_16MiB_small_size_4MiB", [](PoolOptions& o) { o.large_page = 16 * kMiB; o.small_size = 4 * kMiB; }},
    {"reserve_96MiB", [](PoolOptions& o) { o.reserve_size = 96 * kMiB; }},
    // Chunks of several pages (growth_page), which the harness's pools, made to export, do not
    // make by default: the C++ defaults' 4 MiB pages in 32 MiB chunks, for requests from two
    // pages (the harness's sizes stay below the default 128 MiB), until one is shared. (Made
    // only until memory first moves: requests of two pages come early enough that one of the
    // two seeds makes some, RunHarness.)
    {"chunks_of_several_pages",
     [](PoolOptions& o) {
       o.large_page = 4 * kMiB;
       o.growth_page = 32 * kMiB;
       o.growth_page_from = 8 * kMiB;
     },
     true},
    {"chunks_of_several_pages_from_1_byte",
     [](PoolOptions& o) {
       o.large_page = 2 * kMiB;
       o.growth_page = 64 * kMiB;
       o.growth_page_from = 1;
     },
     true},
    // Pages of three granules (half pages are not whole granules) in chunks of five pages.
    {"page_6MiB_growth_page_30MiB",
     [](PoolOptions& o) {
       o.large_page = 6 * kMiB;
       o.growth_page = 30 * kMiB;
       o.growth_page_from = 6 * kMiB;
     },
     true},
    {"growth_page_beyond_max_chunk",
     [](PoolOptions& o) {
       o.large_page = 4 * kMiB;
       o.max_chunk = 16 * kMiB;
       o.growth_page = size_t{1} << 40;
       o.growth_page_from = 8 * kMiB;
     },
     true},
    {"small_chunk_8MiB_small_size_4MiB",
     [](PoolOptions& o) {
       o.small_size = 4 * kMiB;
       o.small_chunk = 8 * kMiB;
     }},
    {"no_pages_exact_growth",
     [](PoolOptions& o) {
       o.large_page = 0;
       o.growth_fraction = 0;
     }},
    // A range that grows after itself, with pages and without: blocks, moves, releases and
    // exports on both sides of each seam, and no driver call across one.
    {"range_grows_from_96MiB",
     [](PoolOptions& o) {
       o.reserve_size = 96 * kMiB;
       o.range_grows = true;
     },
     false, size_t{4} << 30},
    {"range_grows_from_96MiB_no_pages",
     [](PoolOptions& o) {
       o.reserve_size = 96 * kMiB;
       o.range_grows = true;
       o.large_page = 0;
       o.growth_fraction = 0;
     },
     false, size_t{4} << 30},
};

class AttackEdges : public ::testing::TestWithParam<int> {};

TEST_P(AttackEdges, RandomStepsKeepInvariants) {
  const Edge& e = kEdges[GetParam()];
  Seen seen;
  for (uint64_t seed : {11u, 12u}) {
    SCOPED_TRACE(absl::StrCat(e.name, " seed ", seed));
    Options o;
    o.seed = seed;
    o.steps = 1200;
    e.apply(o.pool);
    o.slack = e.slack;
    if (o.pool.reserve_size != 0 && e.slack == 0) {
      o.live_cap = o.pool.reserve_size / 2;
      o.max_size = 32 * kMiB;
    }
    const Seen run = RunHarness(o, /*expect_moves=*/false);
    seen.several_pages += run.several_pages;
    seen.range_extensions += run.range_extensions;
    if (HasFatalFailure() || HasNonfatalFailure()) return;
  }
  if (e.several_pages) {
    EXPECT_GT(seen.several_pages, 0) << "no chunk of several pages was made";
  }
  if (e.slack != 0) {
    EXPECT_GT(seen.range_extensions, 0) << "the range never grew";
  }
}

INSTANTIATE_TEST_SUITE_P(Edges, AttackEdges,
                         ::testing::Range(0, static_cast<int>(sizeof(kEdges) / sizeof(kEdges[0]))),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return std::string(kEdges[i.param].name);
                         });

// ---------------------------------------------------------------------------------------------
// Deterministic reproductions of what the random steps found, and of the hostile options.

class ReclaimAttack : public ::testing::Test {
 protected:
  void SetUp() override {
    inner_ = NewHostDriver(HostDriverOptions{2 * kMiB, 512 * kMiB});
    driver_ = std::make_unique<FaultDriver>(inner_.get());
  }
  void TearDown() override { driver_->Disarm(); }
  // A free whose stream takes no event, with or without that stream's synchronisation failing
  // too (the tests below say what it shows).
  void FreeWhoseStreamTookNoEvent(bool stream_sync_fails);
  std::unique_ptr<Pool> MakePool(PoolOptions options = {}) {
    return CreatePoolOrFail(driver_.get(), options);
  }
  // 8 MiB pages, and chunks of up to four of them for a request of any size until the first
  // move (the defaults before 4 MiB pages): what the move tests below were written for.
  static PoolOptions EightMiBPages() {
    PoolOptions options;
    options.large_page = 8 * kMiB;
    options.growth_page_from = 0;
    return options;
  }
  // Expects `p` (an allocation) to have succeeded, and frees it.
  static void ExpectAllocatedAndFree(Pool& pool, const absl::StatusOr<void*>& p) {
    EXPECT_TRUE(p.ok()) << p.status();
    if (p.ok()) EXPECT_OK(pool.Free(*p));
  }
  int64_t DriverHeld() {
    MemInfo info = *inner_->GetMemInfo(0);
    return static_cast<int64_t>(info.total - info.free);
  }
  // After a request of `size` bytes that met an injected fault (`c`, its result): the pool
  // serves it (again, if it failed), the memory holds what is written, and the pool is whole.
  void ExpectServedAfterAFault(Pool& pool, absl::StatusOr<void*> c, size_t size) {
    if (!c.ok()) c = pool.Allocate(size, 0);
    ASSERT_OK(c.status());
    Stamp(*c, size, 0x77);
    EXPECT_EQ(CheckStamp(*c, size, 0x77), "");
    ASSERT_OK(pool.CheckInvariants());
    EXPECT_EQ(DriverHeld(), pool.GetStats().reserved_bytes.current);
  }
  // Calls `f(op, skip)` for a one-shot failure of each driver call at each of the first four
  // points it is made (AllocateWithOneShotFault), under a trace naming them.
  template <typename F>
  static void ForEachOneShotFault(F&& f) {
    for (int op = 0; op < kNumOps; ++op) {
      for (int skip = 0; skip < 4; ++skip) {
        SCOPED_TRACE(absl::StrCat(kOpNames[op], " skip ", skip));
        f(op, skip);
      }
    }
  }
  // Allocates `size` bytes while driver call `op` fails once, after `skip` successful ones;
  // then checks the pool's invariants and that the driver holds what the pool reserves.
  // `*faulted`: whether the failure happened.
  absl::StatusOr<void*> AllocateWithOneShotFault(Pool& pool, int op, int skip, size_t size,
                                                 bool* faulted) {
    const int64_t injected = driver_->injected();
    driver_->Arm(op, skip, /*persistent=*/false);
    absl::StatusOr<void*> c = pool.Allocate(size, 0);
    driver_->Disarm();
    *faulted = driver_->injected() != injected;
    EXPECT_OK(pool.CheckInvariants());
    EXPECT_EQ(DriverHeld(), pool.GetStats().reserved_bytes.current);
    return c;
  }
  std::unique_ptr<Driver> inner_;
  std::unique_ptr<FaultDriver> driver_;
};

// Four 8 MiB blocks, one per page (EightMiBPages), the first and third freed: two wholly free pages that
// are not adjacent, so a 16 MiB request misses and takes both (nothing fresh is created).
std::vector<void*> TwoFreePages(Pool& pool) {
  std::vector<void*> p;
  for (int i = 0; i < 4; ++i) {
    p.push_back(AllocateOrFail(pool, 8 * kMiB, 0));
    Stamp(p.back(), 8 * kMiB, static_cast<unsigned char>(0x10 + i));
  }
  EXPECT_OK(pool.Free(p[0]));
  EXPECT_OK(pool.Free(p[2]));
  return {p[1], p[3]};
}

// The growth is part moved, part fresh; moving fails (Unmap), and so does the rollback's
// release of the fresh page (Unmap again): the fresh chunk stays registered where the arena
// has a gap.
TEST_F(ReclaimAttack, UnmapFailingDuringAMoveKeepsTheFreshChunkAsFreeMemory) {
  auto pool = MakePool();
  void* a = AllocateOrFail(*pool, 8 * kMiB, 0);
  void* b = AllocateOrFail(*pool, 8 * kMiB, 0);
  ASSERT_OK(pool->Free(a));  // one wholly free page; b keeps the next one
  const PoolStats before = pool->GetStats();
  driver_->Arm(kUnmap, /*skip=*/0, /*persistent=*/true);
  absl::StatusOr<void*> c = pool->Allocate(16 * kMiB, 0);  // 8 MiB moved + 8 MiB fresh
  driver_->Disarm();
  EXPECT_FALSE(c.ok());
  EXPECT_OK(pool->CheckInvariants());
  const PoolStats after = pool->GetStats();
  // The fresh page could not be released: it stays in the pool as free memory, counted, in a
  // free block (not in a gap).
  EXPECT_EQ(after.reserved_bytes.current, before.reserved_bytes.current + int64_t{8 * kMiB});
  EXPECT_EQ(DriverHeld(), after.reserved_bytes.current);
  EXPECT_OK(pool->Free(b));
  EXPECT_OK(pool->EmptyCache());
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, 0) << "leaked: EmptyCache cannot release it";
  EXPECT_EQ(DriverHeld(), 0);
  // The arena has the leaked range as a gap (merged with the rest): a growth planned over
  // it maps onto the leaked mapping.
  absl::StatusOr<void*> d = pool->Allocate(32 * kMiB, 0);
  EXPECT_TRUE(d.ok()) << d.status();
  if (d.ok()) EXPECT_OK(pool->Free(*d));
}

// Two pages are moved, the second's Unmap fails, and moving the first back fails too (Unmap):
// MoveChunks releases it, that release fails as well, and the chunk stays registered at the
// destination, which the arena still has as a gap; its source became a gap too.
TEST_F(ReclaimAttack, UnmapFailingWhileMovingBackKeepsTheChunkAsFreeMemory) {
  auto pool = MakePool(EightMiBPages());
  std::vector<void*> kept = TwoFreePages(*pool);
  const PoolStats before = pool->GetStats();
  driver_->Arm(kUnmap, /*skip=*/1, /*persistent=*/true);
  absl::StatusOr<void*> c = pool->Allocate(16 * kMiB, 0);  // two pages moved, none fresh
  driver_->Disarm();
  EXPECT_FALSE(c.ok());
  EXPECT_OK(pool->CheckInvariants());
  const PoolStats after = pool->GetStats();
  const Snapshot snap = pool->GetSnapshot();
  int64_t in_snapshot = 0;
  for (const SegmentInfo& s : snap.segments) {
    for (const ChunkInfo& ch : s.chunks) in_snapshot += static_cast<int64_t>(ch.size);
  }
  EXPECT_EQ(in_snapshot, after.reserved_bytes.current);
  EXPECT_EQ(DriverHeld(), after.reserved_bytes.current);
  for (void* p : kept) EXPECT_OK(pool->Free(p));
  EXPECT_OK(pool->EmptyCache());
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, 0);
  (void)before;
}

// One-shot failures of each driver call at each point of a move leave the pool whole, the
// live blocks intact, and the pool able to serve the request afterwards.
TEST_F(ReclaimAttack, OneShotFailuresAtEachPointOfAMove) {
  ForEachOneShotFault([&](int op, int skip) {
    auto pool = MakePool(EightMiBPages());
    std::vector<void*> kept = TwoFreePages(*pool);
    bool faulted = false;
    absl::StatusOr<void*> c = AllocateWithOneShotFault(*pool, op, skip, 16 * kMiB, &faulted);
    EXPECT_EQ(CheckStamp(kept[0], 8 * kMiB, 0x11), "");
    EXPECT_EQ(CheckStamp(kept[1], 8 * kMiB, 0x13), "");
    ExpectServedAfterAFault(*pool, c, 16 * kMiB);
  });
}

// The same with a hole of two adjacent pages (one Unmap for both) and a fresh page: a 24 MiB
// request takes the hole's two pages and creates the third. A failure after the hole is
// unmapped (a Map of either page, or the access grant) puts back what did not move.
TEST_F(ReclaimAttack, OneShotFailuresAtEachPointOfAMoveOfAdjacentPages) {
  ForEachOneShotFault([&](int op, int skip) {
    auto pool = MakePool(EightMiBPages());
    std::vector<void*> p;
    for (int i = 0; i < 4; ++i) {
      p.push_back(AllocateOrFail(*pool, 8 * kMiB, 0));
      Stamp(p.back(), 8 * kMiB, static_cast<unsigned char>(0x20 + i));
    }
    ASSERT_OK(pool->Free(p[1]));
    ASSERT_OK(pool->Free(p[2]));
    const PoolStats before = pool->GetStats();
    bool faulted = false;
    absl::StatusOr<void*> c = AllocateWithOneShotFault(*pool, op, skip, 24 * kMiB, &faulted);
    EXPECT_EQ(CheckStamp(p[0], 8 * kMiB, 0x20), "");
    EXPECT_EQ(CheckStamp(p[3], 8 * kMiB, 0x23), "");
    if (c.ok() && !faulted) {
      const PoolStats after = pool->GetStats();
      EXPECT_EQ(after.num_chunk_moves - before.num_chunk_moves, 2);
      EXPECT_EQ(after.driver_unmap - before.driver_unmap, 1) << "one Unmap for the hole";
    }
    ExpectServedAfterAFault(*pool, c, 24 * kMiB);
  });
}

// The same with a chunk of four pages (a fresh pool's 32 MiB growth, pool_options.h
// growth_page) freed between two live pages: a 48 MiB request moves it whole (one Unmap, one
// Map) and creates two pages. A failure at any point leaves every live byte and the pool's
// bookkeeping as they were, and the request is served after it.
TEST_F(ReclaimAttack, OneShotFailuresAtEachPointOfAMoveOfAChunkOfSeveralPages) {
  ForEachOneShotFault([&](int op, int skip) {
    auto pool = MakePool(EightMiBPages());
    void* left = AllocateOrFail(*pool, 8 * kMiB, 0);
    void* four = AllocateOrFail(*pool, 32 * kMiB, 0);
    void* right = AllocateOrFail(*pool, 8 * kMiB, 0);
    ASSERT_EQ(pool->GetStats().segment.current, 3) << "the 32 MiB growth is one chunk";
    Stamp(left, 8 * kMiB, 0x31);
    Stamp(right, 8 * kMiB, 0x32);
    ASSERT_OK(pool->Free(four));
    const PoolStats before = pool->GetStats();
    bool faulted = false;
    absl::StatusOr<void*> c = AllocateWithOneShotFault(*pool, op, skip, 48 * kMiB, &faulted);
    EXPECT_EQ(CheckStamp(left, 8 * kMiB, 0x31), "");
    EXPECT_EQ(CheckStamp(right, 8 * kMiB, 0x32), "");
    if (c.ok() && !faulted) {
      const PoolStats after = pool->GetStats();
      EXPECT_EQ(after.num_chunk_moves - before.num_chunk_moves, 1);
      EXPECT_EQ(after.moved_bytes - before.moved_bytes, static_cast<int64_t>(32 * kMiB));
      EXPECT_EQ(after.driver_create - before.driver_create, 1) << "two pages, one chunk";
    }
    ExpectServedAfterAFault(*pool, c, 48 * kMiB);
  });
}

// EmptyCache unmaps four adjacent free pages with one call; when that call fails, it unmaps
// them one by one, so one failure holds back none of them.
TEST_F(ReclaimAttack, AFailedUnmapOfARunIsRetriedPageByPage) {
  auto pool = MakePool(EightMiBPages());
  // Four 8 MiB pages side by side (allocated one by one: a fresh pool would make one 32 MiB
  // request a single chunk, pool_options.h growth_page), freed into one block.
  std::vector<void*> run;
  for (int i = 0; i < 4; ++i) run.push_back(AllocateOrFail(*pool, 8 * kMiB, 0));
  void* kept = AllocateOrFail(*pool, 8 * kMiB, 0);
  for (void* p : run) ASSERT_OK(pool->Free(p));
  const PoolStats before = pool->GetStats();
  driver_->Arm(kUnmap, /*skip=*/0, /*persistent=*/false);
  ASSERT_OK(pool->EmptyCache());
  driver_->Disarm();
  const PoolStats after = pool->GetStats();
  EXPECT_EQ(after.driver_unmap - before.driver_unmap, 5) << "the run's call, then one a page";
  EXPECT_EQ(after.reserved_bytes.current, static_cast<int64_t>(8 * kMiB));
  EXPECT_EQ(DriverHeld(), after.reserved_bytes.current);
  EXPECT_OK(pool->CheckInvariants());
  ASSERT_OK(pool->Free(kept));
}

// Hostile options: a large arena smaller than one page and than the request in half pages.
// With large_page 0 the pool serves the request; with the default page too, its growth planned
// to granularity (Pool::Grow's fallback), the short last chunk never moved.
TEST_F(ReclaimAttack, PageLargerThanTheLargeArenaRefusesEveryLargeRequest) {
  for (size_t page : {size_t{0}, size_t{8} << 20}) {
    SCOPED_TRACE(absl::StrCat("large_page ", page));
    PoolOptions options;
    options.reserve_size = 8 * kMiB;  // small arena 2 MiB, large arena 6 MiB
    options.large_page = page;
    auto pool = MakePool(options);
    ASSERT_NE(pool, nullptr);
    ExpectAllocatedAndFree(*pool, pool->Allocate(5 * kMiB, 0));  // two halves: 8 MiB > 6 MiB
  }
}

TEST_F(ReclaimAttack, PageRoundingMakesARequestThatFitsTheRangeFail) {
  for (size_t page : {size_t{0}, size_t{8} << 20}) {
    SCOPED_TRACE(absl::StrCat("large_page ", page));
    PoolOptions options;
    options.reserve_size = 16 * kMiB;  // large arena 14 MiB; max request 16 MiB
    options.large_page = page;
    auto pool = MakePool(options);
    // Four halves (16 MiB) do not fit the arena; planned to granularity, 14 MiB do.
    ExpectAllocatedAndFree(*pool, pool->Allocate(13 * kMiB, 0));
  }
}

// A memory limit that is not a multiple of the half page growth is planned in: the growth is
// planned to granularity there (pool.h) and uses the whole limit; past it the refusal is
// clean and the pool stays usable.
TEST_F(ReclaimAttack, MemoryLimitBetweenPagesServesWhatFits) {
  for (size_t page : {size_t{0}, size_t{8} << 20}) {
    SCOPED_TRACE(absl::StrCat("large_page ", page));
    PoolOptions options;
    options.memory_limit = 10 * kMiB;
    options.large_page = page;
    auto pool = MakePool(options);
    ExpectAllocatedAndFree(*pool, pool->Allocate(9 * kMiB, 0));  // 10 MiB of chunks, not 12
    absl::StatusOr<void*> p = pool->Allocate(11 * kMiB, 0);
    EXPECT_TRUE(absl::IsResourceExhausted(p.status())) << p.status();
    ASSERT_OK(pool->CheckInvariants());
    ExpectAllocatedAndFree(*pool, pool->Allocate(10 * kMiB, 0));
  }
}

// max_chunk is "the largest single physical allocation": a page above it is refused, one within
// it is used.
TEST_F(ReclaimAttack, APageAboveMaxChunkIsRefused) {
  PoolOptions options;
  options.max_chunk = 4 * kMiB;
  options.large_page = 8 * kMiB;
  absl::StatusOr<std::unique_ptr<Pool>> refused = Pool::Create(driver_.get(), options);
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status())) << refused.status();
  options.large_page = 4 * kMiB;
  auto pool = MakePool(options);
  ASSERT_NE(pool, nullptr);
  void* p = AllocateOrFail(*pool, 20 * kMiB, 0);
  size_t largest = 0;
  for (const SegmentInfo& s : pool->GetSnapshot().segments) {
    for (const ChunkInfo& c : s.chunks) largest = std::max(largest, c.size);
  }
  EXPECT_LE(largest, 4 * kMiB);
  EXPECT_OK(pool->Free(p));
}

// Pages that do not fit size_t arithmetic or max_chunk are refused (SIZE_MAX is "auto": the
// default page).
TEST_F(ReclaimAttack, HugePageValues) {
  for (size_t page : {SIZE_MAX, SIZE_MAX - (size_t{1} << 20), size_t{1} << 62}) {
    SCOPED_TRACE(absl::StrCat("large_page ", page));
    PoolOptions options;
    options.large_page = page;
    absl::StatusOr<std::unique_ptr<Pool>> pool = Pool::Create(driver_.get(), options);
    if (!pool.ok()) {
      EXPECT_TRUE(absl::IsInvalidArgument(pool.status())) << pool.status();
      continue;
    }
    absl::StatusOr<void*> p = (*pool)->Allocate(20 * kMiB, 0);
    EXPECT_TRUE(p.ok()) << p.status();
    if (p.ok()) {
      EXPECT_OK((*pool)->Free(*p));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Threads: each allocates, writes, reads and frees its own blocks on its own stream while the
// others' misses move free pages. A page moved from under a live block faults or corrupts.

TEST(ReclaimAttackThreads, ConcurrentMissesNeverTouchLiveBlocks) {
  auto inner = NewHostDriver(HostDriverOptions{2 * kMiB, 1024 * kMiB});
  PoolOptions options;  // defaults
  auto pool = CreatePoolOrFail(inner.get(), options);
  ASSERT_NE(pool, nullptr);
  std::atomic<bool> failed{false};
  std::atomic<int> ooms{0};
  std::vector<std::thread> threads;
  std::mutex msg_mu;
  std::string msg;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      Stream s = *inner->CreateStream(0);
      std::mt19937_64 rng(1000 + t);
      std::map<uintptr_t, std::pair<size_t, unsigned char>> mine;
      size_t bytes = 0;
      for (int i = 0; i < 1500 && !failed; ++i) {
        if (mine.empty() || (rng() % 100 < 55 && bytes < 48 * kMiB)) {
          const size_t size = rng() % 3 == 0 ? 256 * kKiB + rng() % (2 * kMiB)
                                             : 1 * kMiB + rng() % (20 * kMiB);
          absl::StatusOr<void*> p = pool->Allocate(size, s);
          if (!p.ok()) {
            ++ooms;
            continue;
          }
          const auto v = static_cast<unsigned char>(1 + rng() % 250);
          Stamp(*p, size, v);
          mine[reinterpret_cast<uintptr_t>(*p)] = {size, v};
          bytes += size;
        } else {
          auto it = mine.begin();
          std::advance(it, static_cast<long>(rng() % mine.size()));
          if (rng() % 10 == 0) {
            // Exported by another party in the middle of it all.
            (void)pool->Export(reinterpret_cast<void*>(it->first));
          }
          (void)pool->Free(reinterpret_cast<void*>(it->first));
          bytes -= it->second.first;
          mine.erase(it);
        }
        for (const auto& [a, sv] : mine) {
          std::string e = CheckStamp(reinterpret_cast<void*>(a), sv.first, sv.second);
          if (!e.empty()) {
            std::lock_guard<std::mutex> lock(msg_mu);
            msg = absl::StrCat("thread ", t, " step ", i, ": ", e);
            failed = true;
            break;
          }
        }
        if (i % 97 == 0) (void)pool->EmptyCache();
      }
      for (const auto& [a, sv] : mine) (void)pool->Free(reinterpret_cast<void*>(a));
      (void)inner->DestroyStream(s);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_FALSE(failed) << msg;
  EXPECT_OK(pool->CheckInvariants());
  std::cout << "moves " << pool->GetStats().num_chunk_moves << ", ooms " << ooms << std::endl;
  EXPECT_GT(pool->GetStats().num_chunk_moves, 0);
}

// Stream order when the driver fails events: a free whose stream took no event (CreateEvent
// failed) waits for that stream (synchronised at once) or, where that fails too, for the
// device; its memory is neither moved nor reused before that stream's work is done, and
// nothing is left pending for ever.
TEST_F(ReclaimAttack, AFreeWhoseStreamTookNoEventWaitsForThatStream) {
  FreeWhoseStreamTookNoEvent(/*stream_sync_fails=*/false);
}

TEST_F(ReclaimAttack, AFreeWhoseStreamTookNoEventAndCannotBeSynchronisedWaitsForTheDevice) {
  FreeWhoseStreamTookNoEvent(/*stream_sync_fails=*/true);
}

void ReclaimAttack::FreeWhoseStreamTookNoEvent(bool stream_sync_fails) {
  auto pool = MakePool();
  const Stream s = *inner_->CreateStream(0);
  const Stream t1 = *inner_->CreateStream(0);
  const Stream t2 = *inner_->CreateStream(0);
  void* a = AllocateOrFail(*pool, 8 * kMiB, s);
  void* p = AllocateOrFail(*pool, 8 * kMiB, s);
  void* c = AllocateOrFail(*pool, 8 * kMiB, s);
  ASSERT_OK(pool->RecordStream(p, t1));
  ASSERT_OK(pool->RecordStream(p, t2));
  // t2 writes p for a while: it sleeps 300 ms first.
  ASSERT_OK(inner_->LaunchHostFunc(t2, &SleepUs, reinterpret_cast<void*>(uintptr_t{300000})));
  ASSERT_OK(inner_->MemsetAsync(reinterpret_cast<DevPtr>(p), 0xEE, 8 * kMiB, t2));
  driver_->Arm(kCreateEvent, /*skip=*/1, /*persistent=*/false);  // t1's event made, t2's not
  if (stream_sync_fails) driver_->Arm(kSyncStream, /*skip=*/0, /*persistent=*/false);
  const PoolStats before = pool->GetStats();
  const int64_t injected = driver_->injected();
  EXPECT_OK(pool->Free(p));
  driver_->Disarm();
  const PoolStats after = pool->GetStats();
  EXPECT_EQ(driver_->injected() - injected, stream_sync_fails ? 2 : 1);
  EXPECT_EQ(after.num_sync_stream - before.num_sync_stream, 1);
  EXPECT_EQ(after.num_sync_all_streams - before.num_sync_all_streams, stream_sync_fails ? 1 : 0);
  EXPECT_OK(pool->CheckInvariants());
  ::usleep(50000);  // t1's event completes; t2 still sleeps
  // Whatever p's memory serves next sees none of t2's bytes land after it was handed out.
  void* big = AllocateOrFail(*pool, 16 * kMiB, s);
  Stamp(big, 16 * kMiB, 0x22);
  ASSERT_OK(inner_->SynchronizeDevice(0));
  EXPECT_EQ(CheckStamp(big, 16 * kMiB, 0x22), "");
  for (void* q : {a, c, big}) EXPECT_OK(pool->Free(q));
  EXPECT_OK(pool->EmptyCache());
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, 0);
  EXPECT_EQ(DriverHeld(), 0);
}

// The only stream of a free takes no event and cannot be synchronised, and the device
// synchronisation that should finish it fails: the block stays pending (not lost), and the
// next allocation the cached path does not serve synchronises again and recycles it.
TEST_F(ReclaimAttack, AFreeLeftPendingByFailedSynchronisationsIsRecycledLater) {
  auto pool = MakePool();
  const Stream s = *inner_->CreateStream(0);
  const Stream t = *inner_->CreateStream(0);
  void* p = AllocateOrFail(*pool, 8 * kMiB, s);
  ASSERT_OK(pool->RecordStream(p, t));
  driver_->Arm(kCreateEvent, /*skip=*/0, /*persistent=*/false);
  driver_->Arm(kSyncStream, /*skip=*/0, /*persistent=*/false);
  driver_->Arm(kSyncDevice, /*skip=*/0, /*persistent=*/false);
  EXPECT_FALSE(pool->Free(p).ok());
  driver_->Disarm();
  EXPECT_OK(pool->CheckInvariants());
  PoolStats st = pool->GetStats();
  EXPECT_EQ(st.allocated_bytes.current, 0);
  EXPECT_EQ(st.active_bytes.current, static_cast<int64_t>(8 * kMiB));  // still pending
  void* q = AllocateOrFail(*pool, 64 * kKiB, s);
  st = pool->GetStats();
  EXPECT_EQ(st.active_bytes.current, st.allocated_bytes.current);  // p recycled
  EXPECT_OK(pool->CheckInvariants());
  EXPECT_OK(pool->Free(q));
  EXPECT_OK(pool->EmptyCache());
  EXPECT_OK(pool->CheckInvariants());
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, 0);
  EXPECT_EQ(DriverHeld(), 0);
}

// A block is exported while another stream still writes a block it freed in the same chunk
// (a stream-ordered free): that free space retires with the chunk, and the chunk goes once
// the exported block is freed, so the export waits for that stream first.
TEST_F(ReclaimAttack, ExportWaitsForStreamsThatFreedSpaceInItsChunk) {
  auto pool = MakePool();
  const Stream s = *inner_->CreateStream(0);
  const Stream t = *inner_->CreateStream(0);
  void* a = AllocateOrFail(*pool, 200 * kKiB, s);  // the small arena: one chunk holds both
  ASSERT_OK(pool->EmptyCache());  // the rest of a's chunk: free for every stream
  void* b = AllocateOrFail(*pool, 100 * kKiB, t);
  ASSERT_EQ(pool->GetStats().reserved_bytes.current, int64_t{2 * kMiB});
  ASSERT_OK(inner_->LaunchHostFunc(t, &SleepUs, reinterpret_cast<void*>(uintptr_t{300000})));
  ASSERT_OK(inner_->MemsetAsync(reinterpret_cast<DevPtr>(b), 0x5A, 100 * kKiB, t));
  ASSERT_OK(pool->Free(b));  // stream-ordered: t still writes it
  ASSERT_OK(pool->Export(a, HandleType::kNone, ExportNeighbours::kRefuse, ExportUse::kUntracked)
                .status());
  // t's write was waited for: it has landed.
  EXPECT_EQ(CheckStamp(b, 100 * kKiB, 0x5A), "");
  ASSERT_OK(pool->Free(a));  // the chunk goes once s is done with a
  EXPECT_OK(pool->CheckInvariants());
  ASSERT_OK(pool->EmptyCache());
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, 0);
  EXPECT_EQ(DriverHeld(), 0);
}

// A free that waits on a fence is finished by synchronising the pool's device and its peer
// devices: a stream of a peer device can reach the pool's memory too.
TEST_F(ReclaimAttack, AFenceIsFinishedBySynchronisingThePeerDevicesToo) {
  inner_ = NewHostDriver(HostDriverOptions{2 * kMiB, 512 * kMiB, /*device_count=*/2});
  driver_ = std::make_unique<FaultDriver>(inner_.get());
  PoolOptions options;
  options.peer_devices = {1};
  auto pool = MakePool(options);
  const Stream s = *inner_->CreateStream(0);
  const Stream t = *inner_->CreateStream(1);
  void* p = AllocateOrFail(*pool, 8 * kMiB, s);
  ASSERT_OK(pool->RecordStream(p, t));
  driver_->Arm(kCreateEvent, /*skip=*/0, /*persistent=*/false);
  driver_->Arm(kSyncStream, /*skip=*/0, /*persistent=*/false);
  const int on_device = driver_->device_syncs(0);
  const int on_peer = driver_->device_syncs(1);
  EXPECT_OK(pool->Free(p));
  driver_->Disarm();
  EXPECT_EQ(driver_->device_syncs(0) - on_device, 1);
  EXPECT_EQ(driver_->device_syncs(1) - on_peer, 1);
  const PoolStats st = pool->GetStats();
  EXPECT_EQ(st.active_bytes.current, 0);  // recycled
  EXPECT_OK(pool->CheckInvariants());
  EXPECT_OK(pool->EmptyCache());
  EXPECT_EQ(DriverHeld(), 0);
}

// A block freed while another stream (RecordStream) still used it is pending on that
// stream's event, not on its own stream's, whose order covers reuse. If a block of a third
// stream exports its chunk meanwhile, the block retires with the chunk, and the chunk goes
// once the exported block is freed: the export waits for the pending block's own stream.
TEST_F(ReclaimAttack, ExportWaitsForTheOwnStreamOfAFreeStillPendingInItsChunk) {
  auto pool = MakePool();
  const Stream s = *inner_->CreateStream(0);  // p's own stream
  const Stream t = *inner_->CreateStream(0);  // p's other user
  const Stream u = *inner_->CreateStream(0);  // the exporter's
  void* a = AllocateOrFail(*pool, 200 * kKiB, u);  // the small arena: one chunk holds a and p
  ASSERT_OK(pool->EmptyCache());
  void* p = AllocateOrFail(*pool, 100 * kKiB, s);
  ASSERT_OK(pool->EmptyCache());  // the rest of the chunk: free for every stream
  ASSERT_EQ(pool->GetStats().reserved_bytes.current, int64_t{2 * kMiB});
  ASSERT_OK(pool->RecordStream(p, t));
  StreamGate t_busy(inner_.get(), t);
  StreamGate s_busy(inner_.get(), s);  // work on p queued before the free
  ASSERT_OK(pool->Free(p));             // pending on t's event
  // s's work ends 300 ms from now, on another thread; the export must wait for it.
  std::atomic<bool> s_released{false};
  std::thread releaser([&] {
    ::usleep(300000);
    s_released = true;
    s_busy.Release();
  });
  ASSERT_OK(pool->Export(a, HandleType::kNone, ExportNeighbours::kAllow, ExportUse::kUntracked)
                .status());
  EXPECT_TRUE(s_released.load()) << "the export did not wait for p's own stream";
  releaser.join();
  t_busy.Release();
  ASSERT_OK(inner_->SynchronizeStream(t));
  ASSERT_OK(pool->Free(a));
  EXPECT_OK(pool->CheckInvariants());
  ASSERT_OK(inner_->SynchronizeDevice(0));
  ASSERT_OK(pool->EmptyCache());
  EXPECT_EQ(pool->GetStats().reserved_bytes.current, 0);
  EXPECT_EQ(DriverHeld(), 0);
}

}  // namespace
}  // namespace vmm
