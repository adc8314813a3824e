// move_bench: what moving physical chunks from one address range to another costs the driver,
// by chunk size, and whether unmapping the old addresses on a second thread hides that part.
//
// The pool's reclaim (allocator/reclaim_policy.h) moves free chunks: unmap where they are, map
// where the request goes, grant access there. For each chunk size, --chunks chunks are made and
// mapped side by side in one reserved range; each variant then moves all of them to a second
// range (and back, alternately), and the median over --reps of the time per chunk is printed:
//   - batched:    what ChunkMap::Move does: one Unmap over the old run, a Map per chunk, one
//                 SetAccess over the new range;
//   - serial:     chunk by chunk: Map at the new address, SetAccess there, Unmap at the old
//                 (the chunk is mapped twice in between, which both backends allow);
//   - background: as serial, but a second thread does the Unmaps while the calling thread goes
//                 on; `caller_us_per_chunk` is what the calling thread spent (what a deferred
//                 unmap would save an allocation), `us_per_chunk` the time until both are done;
//   - map_access / unmap: each half alone;
//   - recreate:   the other way to reuse free memory: release the chunks where they are (one
//                 Unmap over the run, a Release each) and create their bytes anew as one
//                 allocation in the other range (Create, Map, SetAccess); `us_per_chunk` per
//                 chunk released, `release_us_per_chunk` the releasing part, `create_us` the
//                 one allocation's Create, Map and SetAccess. (The rig then turns it back into
//                 chunks, untimed.)
// Measured on an H200 (docs/results/2026-12-02.md, runs AG, AH and AJ): 45-63 us a chunk, with
// no steady trend from 2 to 32 MiB, and 73 at 128 MiB (one run); with the unmaps on a second
// thread the caller saved 0-15 us a chunk and both threads together took longer than the serial
// way (the driver runs the two threads' calls largely in turn); releasing and creating anew
// cost 46-55 us a chunk at 2-8 MiB, 85 at 32 MiB and 217 at 128 MiB.
//
//   bazel run -c opt //bench:move_bench                      # CUDA if present, else host
//   bazel run -c opt //bench:move_bench -- --backend=host --chunk_mib=2,8 --chunks=16
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/types/span.h"
#include "allocator/driver.h"
#include "bench/alloc_workloads.h"
#include "bench/vmm_adapter.h"

ABSL_FLAG(std::string, backend, "auto", "driver backend: auto, cuda or host");
ABSL_FLAG(std::vector<std::string>, chunk_mib, std::vector<std::string>({"2", "8", "32"}),
          "chunk sizes in MiB (multiples of the allocation granularity)");
ABSL_FLAG(int, chunks, 128, "chunks moved together");
ABSL_FLAG(int, reps, 5, "timed repetitions of each variant (the median is reported)");

namespace {

using vmm::DevPtr;
using vmm::Driver;
using Clock = std::chrono::steady_clock;

constexpr size_t kMiB = size_t{1} << 20;
constexpr int kDevice = 0;

// The chunks of one size and the two ranges they move between. Every method returns the first
// error (naming the call); on success the chunks are mapped in range `at_` only. Which chunk is
// mapped where is kept chunk by chunk, so that the destructor undoes whatever a failure left.
class MoveRig {
 public:
  MoveRig(Driver* driver, size_t chunk, int count)
      : d_(driver), chunk_(chunk), count_(count), mapped_{Flags(count), Flags(count)} {}
  MoveRig(const MoveRig&) = delete;
  MoveRig& operator=(const MoveRig&) = delete;
  ~MoveRig() {
    for (int r = 0; r < 2; ++r) {
      for (int i = 0; i < count_; ++i) {
        if (mapped_[r][i]) (void)d_->Unmap(Addr(r, i), chunk_);
      }
    }
    if (whole_at_ >= 0) (void)d_->Unmap(range_[whole_at_], Bytes());
    if (whole_) (void)d_->Release(*whole_);
    for (vmm::PhysHandle h : handles_) (void)d_->Release(h);
    for (DevPtr r : range_) {
      if (r != 0) (void)d_->Unreserve(r, Bytes());
    }
  }

  absl::Status Init() {
    for (DevPtr& r : range_) {
      absl::StatusOr<DevPtr> reserved = d_->Reserve(Bytes(), 0);
      if (!reserved.ok()) return reserved.status();
      r = *reserved;
    }
    return MakeChunks(at_);
  }

  // One Unmap of the whole run, a Map per chunk, one SetAccess (ChunkMap::Move).
  absl::Status MoveBatched() {
    const int from = at_, to = 1 - at_;
    if (absl::Status s = d_->Unmap(range_[from], Bytes()); !s.ok()) return s;
    std::fill(mapped_[from].begin(), mapped_[from].end(), 0);
    for (int i = 0; i < count_; ++i) {
      if (absl::Status s = MapChunk(to, i); !s.ok()) return s;
    }
    at_ = to;
    return d_->SetAccess(range_[to], Bytes(), Device());
  }

  // Chunk by chunk: map and grant at the new address, then `unmap_old(i)`.
  absl::Status MoveEach(const std::function<absl::Status(int)>& unmap_old) {
    const int to = 1 - at_;
    for (int i = 0; i < count_; ++i) {
      if (absl::Status s = MapChunk(to, i); !s.ok()) return s;
      if (absl::Status s = d_->SetAccess(Addr(to, i), chunk_, Device()); !s.ok()) return s;
      if (absl::Status s = unmap_old(i); !s.ok()) return s;
    }
    at_ = to;
    return absl::OkStatus();
  }

  absl::Status MoveSerial() {
    const int from = at_;
    return MoveEach([&](int i) { return UnmapChunk(from, i); });
  }

  // MoveEach with the old mappings unmapped by a second thread. `caller_us` is the time the
  // calling thread spent until it handed the last one over, `total_us` until the second
  // thread had unmapped it, both from just before the thread starts.
  absl::Status MoveWithBackgroundUnmap(double* caller_us, double* total_us) {
    const int from = at_;
    const auto start = Clock::now();
    std::mutex mu;
    std::condition_variable cv;
    std::deque<int> queue;  // guarded by mu
    bool done = false;      // guarded by mu
    absl::Status unmapped;  // written by the thread, read after join
    std::thread unmapper([&] {
      for (;;) {
        int i;
        {
          std::unique_lock<std::mutex> lock(mu);
          cv.wait(lock, [&] { return !queue.empty() || done; });
          if (queue.empty()) return;
          i = queue.front();
          queue.pop_front();
        }
        // Only this thread touches mapped_[from] until the join: the caller maps into `to`.
        absl::Status s = UnmapChunk(from, i);
        if (!s.ok() && unmapped.ok()) unmapped = s;
      }
    });
    absl::Status moved = MoveEach([&](int i) {
      {
        std::lock_guard<std::mutex> lock(mu);
        queue.push_back(i);
      }
      cv.notify_one();
      return absl::OkStatus();
    });
    *caller_us = vmm_bench::SecondsSince(start) * 1e6;
    {
      std::lock_guard<std::mutex> lock(mu);
      done = true;
    }
    cv.notify_one();
    unmapper.join();
    *total_us = vmm_bench::SecondsSince(start) * 1e6;
    return moved.ok() ? unmapped : moved;
  }

  // Releases the chunks and creates their bytes as one allocation in the other range (timed:
  // `release_us` for the Unmap and Releases, `create_us` for Create, Map and SetAccess), then
  // makes that range chunks again, untimed.
  absl::Status Recreate(double* release_us, double* create_us) {
    const int from = at_, to = 1 - at_;
    auto start = Clock::now();
    if (absl::Status s = d_->Unmap(range_[from], Bytes()); !s.ok()) return s;
    std::fill(mapped_[from].begin(), mapped_[from].end(), 0);
    for (; !handles_.empty(); handles_.pop_back()) {
      if (absl::Status s = d_->Release(handles_.back()); !s.ok()) return s;
    }
    *release_us = vmm_bench::SecondsSince(start) * 1e6;
    start = Clock::now();
    absl::StatusOr<vmm::PhysHandle> whole = d_->Create(kDevice, Bytes(), 0);
    if (!whole.ok()) return whole.status();
    whole_ = *whole;
    if (absl::Status s = d_->Map(range_[to], Bytes(), *whole_); !s.ok()) return s;
    whole_at_ = to;
    if (absl::Status s = d_->SetAccess(range_[to], Bytes(), Device()); !s.ok()) return s;
    *create_us = vmm_bench::SecondsSince(start) * 1e6;
    // Back to chunks, in the range the memory went to.
    if (absl::Status s = d_->Unmap(range_[to], Bytes()); !s.ok()) return s;
    whole_at_ = -1;
    if (absl::Status s = d_->Release(*whole_); !s.ok()) return s;  // the destructor retries
    whole_.reset();
    return MakeChunks(to);
  }

  // Maps the chunks a second time in the other range and grants access there (map_access),
  // then unmaps that second mapping (unmap); the chunks stay where they were.
  absl::Status MapAccessOther(double* map_us, double* unmap_us) {
    const int other = 1 - at_;
    auto start = Clock::now();
    for (int i = 0; i < count_; ++i) {
      if (absl::Status s = MapChunk(other, i); !s.ok()) return s;
      if (absl::Status s = d_->SetAccess(Addr(other, i), chunk_, Device()); !s.ok()) return s;
    }
    *map_us = vmm_bench::SecondsSince(start) * 1e6;
    start = Clock::now();
    for (int i = 0; i < count_; ++i) {
      if (absl::Status s = UnmapChunk(other, i); !s.ok()) return s;
    }
    *unmap_us = vmm_bench::SecondsSince(start) * 1e6;
    return absl::OkStatus();
  }

 private:
  // One flag a chunk (uint8_t, not bool: two threads write flags of different ranges).
  using Flags = std::vector<uint8_t>;

  size_t Bytes() const { return chunk_ * static_cast<size_t>(count_); }
  DevPtr Addr(int range, int i) const { return range_[range] + chunk_ * static_cast<size_t>(i); }
  static absl::Span<const int> Device() { return absl::MakeConstSpan(&kDevice, 1); }
  absl::Status MapChunk(int range, int i) {
    absl::Status s = d_->Map(Addr(range, i), chunk_, handles_[i]);
    if (s.ok()) mapped_[range][i] = 1;
    return s;
  }
  // Creates the chunks (none may exist), maps them side by side in `range` and grants access
  // there; the chunks are then at `range`.
  absl::Status MakeChunks(int range) {
    for (int i = 0; i < count_; ++i) {
      absl::StatusOr<vmm::PhysHandle> h = d_->Create(kDevice, chunk_, 0);
      if (!h.ok()) return h.status();
      handles_.push_back(*h);
    }
    for (int i = 0; i < count_; ++i) {
      if (absl::Status s = MapChunk(range, i); !s.ok()) return s;
    }
    at_ = range;
    return d_->SetAccess(range_[range], Bytes(), Device());
  }
  absl::Status UnmapChunk(int range, int i) {
    absl::Status s = d_->Unmap(Addr(range, i), chunk_);
    if (s.ok()) mapped_[range][i] = 0;
    return s;
  }

  Driver* const d_;
  const size_t chunk_;
  const int count_;
  DevPtr range_[2] = {0, 0};
  int at_ = 0;  // the range the chunks are mapped in once a move succeeded
  Flags mapped_[2];  // mapped_[r][i]: chunk i is mapped in range r
  std::vector<vmm::PhysHandle> handles_;  // the chunks' (fewer while Recreate runs)
  std::optional<vmm::PhysHandle> whole_;  // Recreate's one allocation, while it exists
  int whole_at_ = -1;                     // the range it is mapped in, or -1
};

int Fail(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "move_bench: %s: %s\n", what.c_str(), status.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Times moving physical chunks between address ranges.");
  absl::ParseCommandLine(argc, argv);
  const int count = absl::GetFlag(FLAGS_chunks);
  const int reps = absl::GetFlag(FLAGS_reps);
  if (count < 1 || reps < 1) {
    std::fprintf(stderr, "move_bench: --chunks and --reps must be at least 1\n");
    return 2;
  }
  absl::StatusOr<Driver*> driver = vmm_bench::BenchDriver(absl::GetFlag(FLAGS_backend),
                                                          size_t{64} << 30);
  if (!driver.ok()) return Fail("driver", driver.status());
  absl::StatusOr<size_t> granularity = (*driver)->Granularity(kDevice);
  if (!granularity.ok()) return Fail("Granularity", granularity.status());
  const std::string backend((*driver)->Name());

  // Every size is checked before any is measured.
  std::vector<uint64_t> sizes_mib;
  for (const std::string& flag : absl::GetFlag(FLAGS_chunk_mib)) {
    uint64_t mib = 0;
    const uint64_t most = SIZE_MAX / kMiB / 2 / static_cast<uint64_t>(count);  // two ranges
    if (!absl::SimpleAtoi(flag, &mib) || mib == 0 || mib > most ||
        (mib * kMiB) % *granularity != 0) {
      std::fprintf(stderr, "move_bench: --chunk_mib value '%s' is not a positive multiple of "
                   "the granularity (%zu bytes) that %d chunks can take\n", flag.c_str(),
                   *granularity, count);
      return 2;
    }
    sizes_mib.push_back(mib);
  }
  for (const uint64_t mib : sizes_mib) {
    const size_t chunk = static_cast<size_t>(mib) * kMiB;
    MoveRig rig(*driver, chunk, count);
    if (absl::Status s = rig.Init(); !s.ok()) return Fail("setting up", s);
    std::vector<double> batched, serial, background, caller, map_access, unmap, recreate,
        release, create;
    // Repetition 0 warms every path; it is not counted.
    for (int rep = 0; rep <= reps; ++rep) {
      auto start = Clock::now();
      if (absl::Status s = rig.MoveBatched(); !s.ok()) return Fail("batched move", s);
      const double batched_us = vmm_bench::SecondsSince(start) * 1e6;
      start = Clock::now();
      if (absl::Status s = rig.MoveSerial(); !s.ok()) return Fail("serial move", s);
      const double serial_us = vmm_bench::SecondsSince(start) * 1e6;
      double caller_us = 0, background_us = 0;
      if (absl::Status s = rig.MoveWithBackgroundUnmap(&caller_us, &background_us); !s.ok()) {
        return Fail("move with background unmaps", s);
      }
      double map_us = 0, unmap_us = 0;
      if (absl::Status s = rig.MapAccessOther(&map_us, &unmap_us); !s.ok()) {
        return Fail("map and unmap alone", s);
      }
      double release_us = 0, create_us = 0;
      if (absl::Status s = rig.Recreate(&release_us, &create_us); !s.ok()) {
        return Fail("release and create anew", s);
      }
      if (rep == 0) continue;
      recreate.push_back((release_us + create_us) / count);
      release.push_back(release_us / count);
      create.push_back(create_us);
      batched.push_back(batched_us / count);
      serial.push_back(serial_us / count);
      background.push_back(background_us / count);
      caller.push_back(caller_us / count);
      map_access.push_back(map_us / count);
      unmap.push_back(unmap_us / count);
    }
    const std::string name = "move/chunk=" + std::to_string(mib) + "MiB";
    vmm_bench::JsonLine tags;
    tags.Str("backend", backend).Int("chunks", count).Int("repetitions", reps);
    auto print = [&](const char* variant, const char* metric, const std::vector<double>& v) {
      vmm_bench::Result("move", name, variant, metric, vmm_bench::Median(v), "us")
          .Merge(tags)
          .Print();
    };
    print("batched", "us_per_chunk", batched);
    print("serial", "us_per_chunk", serial);
    print("background", "us_per_chunk", background);
    print("background", "caller_us_per_chunk", caller);
    print("map_access", "us_per_chunk", map_access);
    print("unmap", "us_per_chunk", unmap);
    print("recreate", "us_per_chunk", recreate);
    print("recreate", "release_us_per_chunk", release);
    print("recreate", "create_us", create);
    std::fprintf(stderr,
                 "%s (%s, %d chunks): batched %.1f, serial %.1f, background unmap %.1f "
                 "(caller %.1f), map+access %.1f, unmap %.1f us a chunk; release and create "
                 "as one %.1f (release %.1f a chunk, create+map+access %.1f in all)\n",
                 name.c_str(), backend.c_str(), count, vmm_bench::Median(batched),
                 vmm_bench::Median(serial), vmm_bench::Median(background),
                 vmm_bench::Median(caller), vmm_bench::Median(map_access),
                 vmm_bench::Median(unmap), vmm_bench::Median(recreate),
                 vmm_bench::Median(release), vmm_bench::Median(create));
  }
  return 0;
}
