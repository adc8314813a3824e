// Tests of SpareChunks (spare_chunks.h), the exported chunks a pool keeps for reuse: a fit is
// the smallest chunk within the slack (of equal sizes, the one filed last), a trim takes the
// oldest, and what is taken out is no longer there.
#include "allocator/spare_chunks.h"

#include <cstddef>
#include <cstdint>
#include <utility>

#include "gtest/gtest.h"

namespace vmm {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

TEST(SpareChunksTest, AnEmptySetFitsNothing) {
  SpareChunks spare;
  EXPECT_TRUE(spare.empty());
  EXPECT_EQ(spare.TakeFit(kMiB, SIZE_MAX), 0u);
  EXPECT_EQ(spare.TakeOldest(), (std::pair<uintptr_t, size_t>{0, 0}));
}

TEST(SpareChunksTest, TheSmallestChunkWithinTheSlackFits) {
  SpareChunks spare;
  ASSERT_TRUE(spare.Add(0x1000, 8 * kMiB));
  ASSERT_TRUE(spare.Add(0x2000, 4 * kMiB));
  ASSERT_TRUE(spare.Add(0x3000, 16 * kMiB));
  EXPECT_EQ(spare.count(), 3u);
  EXPECT_EQ(spare.bytes(), 28 * kMiB);
  EXPECT_EQ(spare.TakeFit(5 * kMiB, 2 * kMiB), 0u) << "8 MiB leaves 3 MiB, past the slack";
  EXPECT_EQ(spare.TakeFit(5 * kMiB, 3 * kMiB), 0x1000u);
  EXPECT_EQ(spare.TakeFit(3 * kMiB, SIZE_MAX), 0x2000u);
  EXPECT_EQ(spare.TakeFit(16 * kMiB, 0), 0x3000u) << "an exact fit needs no slack";
  EXPECT_TRUE(spare.empty());
  EXPECT_EQ(spare.bytes(), 0u);
}

TEST(SpareChunksTest, OfEqualSizesTheNewestFitsAndTheOldestIsTrimmedFirst) {
  SpareChunks spare;
  ASSERT_TRUE(spare.Add(0xa000, 2 * kMiB));
  ASSERT_TRUE(spare.Add(0xb000, 2 * kMiB));
  ASSERT_TRUE(spare.Add(0xc000, 2 * kMiB));
  EXPECT_EQ(spare.TakeFit(2 * kMiB, 0), 0xc000u);
  EXPECT_EQ(spare.TakeOldest(), (std::pair<uintptr_t, size_t>{0xa000, 2 * kMiB}));
  EXPECT_FALSE(spare.Contains(0xa000));
  EXPECT_TRUE(spare.Contains(0xb000));
  // Filed again, a chunk counts as the newest.
  ASSERT_TRUE(spare.Add(0xa000, 2 * kMiB));
  EXPECT_EQ(spare.TakeOldest().first, 0xb000u);
  EXPECT_EQ(spare.TakeOldest().first, 0xa000u);
  EXPECT_TRUE(spare.empty());
}

TEST(SpareChunksTest, AChunkIsFiledOnce) {
  SpareChunks spare;
  ASSERT_TRUE(spare.Add(0x1000, kMiB));
  EXPECT_FALSE(spare.Add(0x1000, 2 * kMiB));
  EXPECT_EQ(spare.count(), 1u);
  EXPECT_EQ(spare.bytes(), kMiB);
  EXPECT_EQ(spare.TakeFit(2 * kMiB, SIZE_MAX), 0u);
}

// Many chunks of many sizes: every fit is the one a scan of all of them would choose.
TEST(SpareChunksTest, ManyChunksFitAsAScanWould) {
  SpareChunks spare;
  struct Entry {
    uintptr_t addr;
    size_t size;
    bool in;
  };
  std::vector<Entry> filed;
  uint64_t x = 12345;
  auto next = [&] { return x = x * 6364136223846793005ULL + 1442695040888963407ULL; };
  for (int i = 0; i < 2000; ++i) {
    const size_t size = ((next() >> 33) % 64 + 1) * 2 * kMiB;
    filed.push_back(Entry{0x100000 + uintptr_t(i) * 0x1000, size, true});
    ASSERT_TRUE(spare.Add(filed.back().addr, size));
  }
  for (int i = 0; i < 1500; ++i) {
    const size_t n = ((next() >> 33) % 64 + 1) * 2 * kMiB - kMiB;
    const size_t slack = n / 8;
    // The scan: the smallest within the slack, of equals the last filed.
    int best = -1;
    for (int j = 0; j < static_cast<int>(filed.size()); ++j) {
      const Entry& e = filed[j];
      if (!e.in || e.size < n || e.size - n > slack) continue;
      if (best < 0 || e.size <= filed[best].size) best = j;
    }
    const uintptr_t got = spare.TakeFit(n, slack);
    if (best < 0) {
      EXPECT_EQ(got, 0u);
      continue;
    }
    EXPECT_EQ(got, filed[best].addr) << "request " << n;
    filed[best].in = false;
  }
}

}  // namespace
}  // namespace vmm
