// Randomized stress test of the pool against a reference model, on the host backend.
//
// Each seed runs thousands of random operations — allocations of mixed sizes on three
// streams, frees, record_stream, exports, shareable allocations, cache trims, busy streams —
// and checks after each one that live blocks never overlap, that every block's contents
// survive until it is freed, that the pool's counters match the model, and (every few steps,
// and at each export) every invariant of the pool's bookkeeping, the size of a live block,
// and whether it shares its chunks with other blocks (against a brute-force answer from the
// pool's snapshot).
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "allocator/host_driver.h"
#include "allocator/pool.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"
#include "tests/test_backend.h"

namespace vmm {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

struct Live {
  size_t size;
  uint8_t pattern;
  Stream stream;
  size_t block;  // the bytes it holds: rounded up to 512, or a spill's (pool.h SpillSize)
};

class PoolStressTest : public ::testing::TestWithParam<uint32_t> {};

// Writes `pattern` at both ends of the block (all of it when small) and checks it back.
void Fill(void* p, size_t size, uint8_t pattern) {
  auto* bytes = static_cast<uint8_t*>(p);
  const size_t edge = std::min<size_t>(size, 4096);
  std::memset(bytes, pattern, edge);
  std::memset(bytes + size - edge, pattern, edge);
}
bool Intact(const void* p, size_t size, uint8_t pattern) {
  const auto* bytes = static_cast<const uint8_t*>(p);
  const size_t edge = std::min<size_t>(size, 4096);
  for (size_t i = 0; i < edge; ++i) {
    if (bytes[i] != pattern || bytes[size - edge + i] != pattern) return false;
  }
  return true;
}

void Sleep1ms(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(1)); }

// Whether another block in use (allocated, or freed while a stream still uses it) lies in a
// chunk that the block at `p` spans, worked out by brute force from the pool's snapshot.
bool SharesChunksBySnapshot(const Snapshot& snapshot, uintptr_t p) {
  size_t size = 0;
  for (const SegmentInfo& segment : snapshot.segments) {
    for (const BlockInfo& block : segment.blocks) {
      if (block.addr == p) size = block.size;
    }
  }
  EXPECT_GT(size, 0u) << "no block at " << p << " in the snapshot";
  std::vector<std::pair<uintptr_t, uintptr_t>> spanned;
  for (const SegmentInfo& segment : snapshot.segments) {
    for (const ChunkInfo& chunk : segment.chunks) {
      if (chunk.addr < p + size && p < chunk.addr + chunk.size) {
        spanned.emplace_back(chunk.addr, chunk.addr + chunk.size);
      }
    }
  }
  for (const SegmentInfo& segment : snapshot.segments) {
    for (const BlockInfo& block : segment.blocks) {
      if (block.addr == p || (block.state != BlockState::kAllocated &&
                              block.state != BlockState::kPendingFree)) {
        continue;
      }
      for (const auto& [lo, hi] : spanned) {
        if (block.addr < hi && lo < block.addr + block.size) return true;
      }
    }
  }
  return false;
}

TEST_P(PoolStressTest, MatchesReferenceModel) {
  ASSERT_OK_AND_ASSIGN(const TestBackend backend, SelectedTestBackend());
  if (backend != TestBackend::kHost) {
    GTEST_SKIP() << "host backend only: it reads blocks from the CPU";
  }
  const uint32_t seed = GetParam();
  std::mt19937 rng(seed);
  std::unique_ptr<Driver> driver = NewHostDriver(HostDriverOptions{2 * kMiB, 768 * kMiB});
  const size_t free_at_start = driver->GetMemInfo(0)->free;
  PoolOptions options;
  options.reserve_size = 2048 * kMiB;
  options.growth_fraction = (seed % 2) ? 0.0 : 0.05;
  options.max_chunk = (seed % 3 == 0) ? 8 * kMiB : 2048 * kMiB;
  if (seed % 5 == 0) options.release_threshold = 64 * kMiB;
  auto created = Pool::Create(driver.get(), options);
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<Pool> pool = std::move(*created);
  const bool exportable = pool->handle_type() != HandleType::kNone;

  std::vector<Stream> streams = {0, *driver->CreateStream(0), *driver->CreateStream(0)};
  std::map<uintptr_t, Live> live;
  int64_t model_bytes = 0;
  int64_t ooms = 0;
  int64_t spills = 0;
  const size_t small_size = pool->options().small_size;

  auto random_size = [&]() -> size_t {
    const uint32_t r = rng() % 100;
    if (r < 55) return 1 + rng() % (64 << 10);
    if (r < 90) return kMiB + rng() % (8 * kMiB);
    return 16 * kMiB + rng() % (48 * kMiB);
  };
  auto pick = [&]() {
    auto it = live.begin();
    std::advance(it, rng() % live.size());
    return it;
  };
  auto check_no_overlap = [&](uintptr_t p, size_t size) {
    auto next = live.lower_bound(p);
    if (next != live.end()) {
      ASSERT_GE(next->first, p + size) << "overlaps the next live block";
    }
    if (next != live.begin()) {
      auto prev = std::prev(next);
      ASSERT_LE(prev->first + prev->second.size, p) << "overlaps the previous live block";
    }
  };

  const int steps = 4000;
  for (int step = 0; step < steps; ++step) {
    const uint32_t op = rng() % 100;
    if (op < 55 || live.empty()) {
      const size_t size = random_size();
      const Stream stream = streams[rng() % streams.size()];
      const bool shareable = exportable && rng() % 50 == 0;
      auto got = shareable ? pool->AllocateShareable(size, stream) : pool->Allocate(size, stream);
      if (!got.ok()) {
        ASSERT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted) << got.status();
        ++ooms;
        ASSERT_EQ(pool->GetStats().num_ooms, ooms);
        continue;
      }
      const auto p = reinterpret_cast<uintptr_t>(*got);
      ASSERT_EQ(p % 512, 0u);
      ASSERT_TRUE(pool->Contains(*got));
      check_no_overlap(p, size);
      const auto pattern = static_cast<uint8_t>(rng());
      Fill(*got, size, pattern);
      // A small request the large arena served (its small arena short of room) spilled.
      const bool spilled = !shareable && size <= small_size && !pool->InSmallArena(*got);
      const size_t block = spilled ? (small_size + 1 + 511) / 512 * 512 : (size + 511) / 512 * 512;
      spills += spilled ? 1 : 0;
      live[p] = Live{size, pattern, stream, block};
      model_bytes += static_cast<int64_t>(block);
    } else if (op < 90) {
      auto it = pick();
      ASSERT_TRUE(Intact(reinterpret_cast<void*>(it->first), it->second.size, it->second.pattern))
          << "block at " << it->first << " was overwritten";
      ASSERT_TRUE(pool->Free(reinterpret_cast<void*>(it->first)).ok());
      model_bytes -= static_cast<int64_t>(it->second.block);
      live.erase(it);
    } else if (op < 94) {
      auto it = pick();
      ASSERT_TRUE(pool->RecordStream(reinterpret_cast<void*>(it->first),
                                     streams[rng() % streams.size()]).ok());
    } else if (op < 96 && exportable) {
      auto it = pick();
      // Whether exporting it would show other blocks, before and after (marking changes
      // nothing of that).
      const bool shares = SharesChunksBySnapshot(pool->GetSnapshot(), it->first);
      ASSERT_OK_AND_ASSIGN(bool answer, pool->SharesChunks(reinterpret_cast<void*>(it->first)));
      EXPECT_EQ(answer, shares) << "block at " << it->first;
      auto exported = pool->Export(reinterpret_cast<void*>(it->first));
      ASSERT_TRUE(exported.ok()) << exported.status();
      ASSERT_FALSE(exported->chunks.empty());
      EXPECT_EQ(exported->chunks[0].addr + exported->offset, it->first);
      EXPECT_EQ(exported->size, it->second.size);
      size_t spanned = 0;
      for (size_t i = 0; i < exported->chunks.size(); ++i) {
        if (i > 0) {
          EXPECT_EQ(exported->chunks[i].addr,
                    exported->chunks[i - 1].addr + exported->chunks[i - 1].size);
        }
        spanned += exported->chunks[i].size;
      }
      EXPECT_GE(spanned, exported->offset + exported->size);
      ASSERT_OK_AND_ASSIGN(answer, pool->SharesChunks(reinterpret_cast<void*>(it->first)));
      EXPECT_EQ(answer, shares) << "exporting changed whether the block shares its chunks";
    } else if (op < 97) {
      ASSERT_TRUE(pool->EmptyCache().ok());
    } else {
      // Give a stream some queued work, so frees on it are not complete at once.
      ASSERT_TRUE(driver->LaunchHostFunc(streams[1 + rng() % 2], &Sleep1ms, nullptr).ok());
    }
    const PoolStats stats = pool->GetStats();
    ASSERT_EQ(stats.allocation.current, static_cast<int64_t>(live.size()));
    ASSERT_EQ(stats.allocated_bytes.current, model_bytes);
    ASSERT_EQ(stats.num_small_spills, spills);
    if (step % 25 == 0) {
      ASSERT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
      if (!live.empty()) {
        // Not through `rng`, so that the operations stay those the seed always gave.
        auto it = std::next(live.begin(), static_cast<long>(step / 25 % live.size()));
        const void* p = reinterpret_cast<void*>(it->first);
        ASSERT_OK_AND_ASSIGN(bool answer, pool->SharesChunks(p));
        EXPECT_EQ(answer, SharesChunksBySnapshot(pool->GetSnapshot(), it->first))
            << "block at " << it->first;
        ASSERT_OK_AND_ASSIGN(size_t size, pool->BlockSize(p));
        EXPECT_EQ(size, it->second.size);
      }
    }
  }
  for (auto& [p, block] : live) {
    ASSERT_TRUE(Intact(reinterpret_cast<void*>(p), block.size, block.pattern));
    ASSERT_TRUE(pool->Free(reinterpret_cast<void*>(p)).ok());
  }
  ASSERT_TRUE(pool->EmptyCache().ok());
  ASSERT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
  const PoolStats end = pool->GetStats();
  EXPECT_EQ(end.reserved_bytes.current, 0);
  EXPECT_EQ(end.active_bytes.current, 0);
  pool.reset();
  for (size_t i = 1; i < streams.size(); ++i) ASSERT_TRUE(driver->DestroyStream(streams[i]).ok());
  EXPECT_EQ(driver->GetMemInfo(0)->free, free_at_start);
}

INSTANTIATE_TEST_SUITE_P(Seeds, PoolStressTest, ::testing::Range<uint32_t>(1, 21));

}  // namespace
}  // namespace vmm
