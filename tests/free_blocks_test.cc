// Tests of FreeBlocks (free_blocks.h), the per-stream segregated bins of cached blocks and
// their best-fit search (a bounded walk of each bin). Blocks carry fake addresses: nothing is
// mapped.
#include "allocator/free_blocks.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "allocator/block.h"
#include "gtest/gtest.h"

namespace vmm {
namespace {

constexpr uintptr_t kBase = uintptr_t{1} << 40;
constexpr size_t kKiB = 1024;
constexpr size_t kMiB = kKiB * 1024;
constexpr size_t kGiB = kMiB * 1024;
constexpr Stream kS = 7;
constexpr Stream kT = 0x5000;

class FreeBlocksTest : public ::testing::Test {
 protected:
  // A kFree block, not yet in the set; addresses increase with each one unless given.
  Block* Make(size_t size, Stream stream, uintptr_t addr = 0) {
    blocks_.push_back(std::make_unique<Block>());
    Block* b = blocks_.back().get();
    b->addr = addr != 0 ? addr : next_addr_;
    next_addr_ += size_t{1} << 42;  // far apart (FreeBlocks never looks at overlaps)
    b->size = size;
    b->state = BlockState::kFree;
    b->stream = stream;
    return b;
  }
  Block* Add(size_t size, Stream stream, uintptr_t addr = 0) {
    Block* b = Make(size, stream, addr);
    set_.Insert(b);
    return b;
  }

  // Every contained block, checked to be filed where its size and tag say.
  std::set<Block*> All() {
    std::set<Block*> out;
    set_.ForEach([&](Block* b) {
      EXPECT_TRUE(out.insert(b).second) << "listed twice";
      EXPECT_TRUE(set_.Contains(b));
      EXPECT_TRUE(set_.Filed(b)) << b->size;
    });
    EXPECT_EQ(out.size(), set_.count());
    return out;
  }

  FreeBlocks set_;
  std::vector<std::unique_ptr<Block>> blocks_;
  uintptr_t next_addr_ = kBase;
};

// The answer of a search over bins of at most kMaxWalk blocks (every bin here): the smallest
// block of at least n bytes that `stream` may take (its own tag or kAnyStream); within a tag
// ties go to the lower address; between the stream's own best and kAnyStream's best, the own
// one wins a tie.
Block* Reference(const std::vector<Block*>& blocks, Stream stream, size_t n) {
  auto best_of = [&](Stream tag) {
    Block* best = nullptr;
    for (Block* b : blocks) {
      if (b->stream != tag || b->size < n) continue;
      if (best == nullptr || std::tie(b->size, b->addr) < std::tie(best->size, best->addr)) {
        best = b;
      }
    }
    return best;
  };
  Block* mine = best_of(stream);
  if (stream == kAnyStream) return mine;
  Block* any = best_of(kAnyStream);
  if (mine == nullptr) return any;
  if (any == nullptr) return mine;
  return any->size < mine->size ? any : mine;
}

std::string Describe(const Block* b) {
  return b == nullptr ? "null"
                      : absl::StrCat("{size=", b->size, " addr=0x", absl::Hex(b->addr),
                                     " stream=", b->stream, "}");
}

TEST_F(FreeBlocksTest, EmptySetFindsNothing) {
  EXPECT_EQ(set_.count(), 0u);
  EXPECT_EQ(set_.BestFit(kS, 512), nullptr);
  EXPECT_EQ(set_.BestFit(kAnyStream, 512), nullptr);
  EXPECT_EQ(set_.BestFit(0, 0), nullptr);
  EXPECT_TRUE(set_.BlocksOf(kS).empty());
  int streams = 0;
  set_.ForEachStream([&](Stream) { ++streams; });
  EXPECT_EQ(streams, 0);
  EXPECT_TRUE(All().empty());
}

TEST_F(FreeBlocksTest, InsertAndRemove) {
  Block* a = Make(4 * kKiB, kS);
  EXPECT_FALSE(set_.Contains(a));
  set_.Insert(a);
  EXPECT_TRUE(set_.Contains(a));
  EXPECT_TRUE(set_.Filed(a));
  EXPECT_EQ(set_.count(), 1u);
  EXPECT_EQ(set_.BestFit(kS, 4 * kKiB), a);
  EXPECT_EQ(set_.BestFit(kS, 512), a);
  EXPECT_EQ(set_.BestFit(kS, 4 * kKiB + 512), nullptr);

  Block* b = Add(8 * kKiB, kS);
  EXPECT_EQ(set_.count(), 2u);
  EXPECT_EQ(set_.BestFit(kS, 4 * kKiB + 512), b);

  set_.Remove(a);
  EXPECT_FALSE(set_.Contains(a));
  EXPECT_FALSE(set_.Filed(a));
  EXPECT_EQ(a->free_prev, nullptr);
  EXPECT_EQ(a->free_next, nullptr);
  EXPECT_EQ(set_.count(), 1u);
  EXPECT_EQ(set_.BestFit(kS, 512), b);
  set_.Remove(b);
  EXPECT_EQ(set_.count(), 0u);
  EXPECT_EQ(set_.BestFit(kS, 512), nullptr);
  // Removed blocks can go back in.
  set_.Insert(a);
  EXPECT_EQ(set_.BestFit(kS, 512), a);
  EXPECT_EQ(All(), (std::set<Block*>{a}));
}

TEST_F(FreeBlocksTest, BestFitAmongOneSizeBins) {
  // Below 32 KiB every 512-byte size has a bin of its own.
  Block* k1 = Add(1 * kKiB, kS);
  Block* k3 = Add(3 * kKiB, kS);
  Block* k3h = Add(3 * kKiB + 512, kS);
  Block* k20 = Add(20 * kKiB, kS);
  EXPECT_EQ(set_.BestFit(kS, 1), k1);
  EXPECT_EQ(set_.BestFit(kS, 512), k1);
  EXPECT_EQ(set_.BestFit(kS, 1 * kKiB), k1);
  EXPECT_EQ(set_.BestFit(kS, 1 * kKiB + 512), k3);
  EXPECT_EQ(set_.BestFit(kS, 3 * kKiB), k3);
  EXPECT_EQ(set_.BestFit(kS, 3 * kKiB + 512), k3h);
  EXPECT_EQ(set_.BestFit(kS, 4 * kKiB), k20);
  EXPECT_EQ(set_.BestFit(kS, 20 * kKiB), k20);
  EXPECT_EQ(set_.BestFit(kS, 20 * kKiB + 512), nullptr);
}

TEST_F(FreeBlocksTest, BestFitAcrossClasses) {
  Block* m1 = Add(1 * kMiB, kS);
  Block* m3 = Add(3 * kMiB, kS);
  Block* m64 = Add(64 * kMiB, kS);
  Block* g5 = Add(5 * kGiB, kS);
  EXPECT_EQ(set_.BestFit(kS, 512), m1);
  EXPECT_EQ(set_.BestFit(kS, 1 * kMiB), m1);
  EXPECT_EQ(set_.BestFit(kS, 1 * kMiB + 512), m3);
  EXPECT_EQ(set_.BestFit(kS, 3 * kMiB), m3);
  EXPECT_EQ(set_.BestFit(kS, 3 * kMiB + 512), m64);
  EXPECT_EQ(set_.BestFit(kS, 64 * kMiB), m64);
  EXPECT_EQ(set_.BestFit(kS, 64 * kMiB + 512), g5);
  EXPECT_EQ(set_.BestFit(kS, 5 * kGiB), g5);
  EXPECT_EQ(set_.BestFit(kS, 5 * kGiB + 512), nullptr);
  set_.Remove(m3);
  EXPECT_EQ(set_.BestFit(kS, 1 * kMiB + 512), m64);
  set_.Remove(m64);
  EXPECT_EQ(set_.BestFit(kS, 1 * kMiB + 512), g5);
}

TEST_F(FreeBlocksTest, SmallestFitInsideASharedBin) {
  // Above 32 KiB a bin holds several sizes: [512 MiB, 528 MiB) is one bin (32 bins per power of
  // two). The search must still pick the smallest fitting size in it, whatever the list order.
  const size_t lo = 512 * kMiB;
  Block* s8 = Add(lo + 8 * kMiB, kS);
  Block* s0 = Add(lo, kS);
  Block* s15 = Add(lo + 15 * kMiB, kS);
  Block* s3 = Add(lo + 3 * kMiB + 512, kS);
  Block* next_bin = Add(lo + 16 * kMiB, kS);
  EXPECT_EQ(set_.BestFit(kS, 1), s0);
  EXPECT_EQ(set_.BestFit(kS, lo), s0);
  EXPECT_EQ(set_.BestFit(kS, lo + 512), s3);
  EXPECT_EQ(set_.BestFit(kS, lo + 3 * kMiB + 512), s3);
  EXPECT_EQ(set_.BestFit(kS, lo + 3 * kMiB + 1024), s8);
  EXPECT_EQ(set_.BestFit(kS, lo + 8 * kMiB + 512), s15);
  EXPECT_EQ(set_.BestFit(kS, lo + 15 * kMiB), s15);
  // Larger than every block of the request's bin: the next bin.
  EXPECT_EQ(set_.BestFit(kS, lo + 15 * kMiB + 512), next_bin);
  set_.Remove(next_bin);
  EXPECT_EQ(set_.BestFit(kS, lo + 15 * kMiB + 512), nullptr);

  // A small shared bin: [32 KiB, 33 KiB) holds 32 KiB and 32.5 KiB.
  Block* a = Add(32 * kKiB + 512, kS);
  Block* b = Add(32 * kKiB, kS);
  EXPECT_EQ(set_.BestFit(kS, 32 * kKiB), b);
  EXPECT_EQ(set_.BestFit(kS, 32 * kKiB - 512), b);
  EXPECT_EQ(set_.BestFit(kS, 32 * kKiB + 1), a);
  EXPECT_EQ(set_.BestFit(kS, 32 * kKiB + 512), a);
  EXPECT_EQ(set_.BestFit(kS, 33 * kKiB), s0);
}

TEST_F(FreeBlocksTest, TiesGoToTheLowerAddress) {
  // Equal sizes, inserted in scrambled address order: the lowest address wins, for an exact
  // request, for a smaller request in the same bin, and in the next non-empty bin.
  const std::vector<int> order = {3, 0, 4, 1, 2};
  for (size_t size : {4 * kKiB, 40 * kKiB, 3 * kMiB + 512, 100 * kMiB}) {
    FreeBlocks set;
    std::vector<Block*> made(order.size());
    for (int i : order) {
      made[i] = Make(size, kS, kBase + (static_cast<uintptr_t>(i) + 1) * kGiB);
      set.Insert(made[i]);
    }
    EXPECT_EQ(set.BestFit(kS, size), made[0]) << size;
    EXPECT_EQ(set.BestFit(kS, size - 512), made[0]) << size;
    EXPECT_EQ(set.BestFit(kS, 512), made[0]) << size;
    set.Remove(made[0]);
    EXPECT_EQ(set.BestFit(kS, size), made[1]) << size;
    set.Remove(made[2]);
    EXPECT_EQ(set.BestFit(kS, size), made[1]) << size;
    set.Remove(made[1]);
    EXPECT_EQ(set.BestFit(kS, size), made[3]) << size;
    for (int i : {3, 4}) set.Remove(made[i]);
    EXPECT_EQ(set.count(), 0u);
  }
}

TEST_F(FreeBlocksTest, ExactSizeBeatsALowerAddressThatIsLarger) {
  // In a shared bin, a larger block at a lower address loses to the exact size.
  const size_t lo = 512 * kMiB;
  Block* larger_low = Add(lo + 4 * kMiB, kS, kBase);
  Block* exact_high = Add(lo + 2 * kMiB, kS, kBase + 64 * kGiB);
  Block* exact_higher = Add(lo + 2 * kMiB, kS, kBase + 128 * kGiB);
  EXPECT_EQ(set_.BestFit(kS, lo + 2 * kMiB), exact_high);
  EXPECT_EQ(set_.BestFit(kS, lo + kMiB), exact_high);
  EXPECT_EQ(set_.BestFit(kS, lo + 2 * kMiB + 512), larger_low);
  set_.Remove(exact_high);
  EXPECT_EQ(set_.BestFit(kS, lo + 2 * kMiB), exact_higher);
}

TEST_F(FreeBlocksTest, StreamsSeeTheirOwnAndAnyStreamBlocks) {
  Block* s_big = Add(64 * kKiB, kS);
  Block* t_small = Add(4 * kKiB, kT);
  // kS cannot take kT's block, even though it fits better.
  EXPECT_EQ(set_.BestFit(kS, 4 * kKiB), s_big);
  EXPECT_EQ(set_.BestFit(kT, 4 * kKiB), t_small);
  EXPECT_EQ(set_.BestFit(kT, 8 * kKiB), nullptr);
  // A stream with nothing of its own, and kAnyStream itself, see no tagged blocks.
  EXPECT_EQ(set_.BestFit(0, 512), nullptr);
  EXPECT_EQ(set_.BestFit(kAnyStream, 512), nullptr);

  Block* any_mid = Add(16 * kKiB, kAnyStream);
  EXPECT_EQ(set_.BestFit(0, 512), any_mid);
  EXPECT_EQ(set_.BestFit(kAnyStream, 512), any_mid);
  EXPECT_EQ(set_.BestFit(kAnyStream, 16 * kKiB + 512), nullptr);  // tagged blocks are not its
  // The better of the stream's own and kAnyStream's.
  EXPECT_EQ(set_.BestFit(kS, 4 * kKiB), any_mid);
  EXPECT_EQ(set_.BestFit(kS, 16 * kKiB + 512), s_big);
  EXPECT_EQ(set_.BestFit(kT, 4 * kKiB), t_small);
  EXPECT_EQ(set_.BestFit(kT, 4 * kKiB + 512), any_mid);
  EXPECT_EQ(set_.BestFit(kT, 16 * kKiB + 512), nullptr);
}

TEST_F(FreeBlocksTest, OwnBlockWinsATieWithAnyStream) {
  Block* any = Add(8 * kKiB, kAnyStream, kBase);  // lower address
  Block* own = Add(8 * kKiB, kS, kBase + kGiB);   // same size
  EXPECT_EQ(set_.BestFit(kS, 8 * kKiB), own);
  EXPECT_EQ(set_.BestFit(kS, 4 * kKiB), own);
  EXPECT_EQ(set_.BestFit(kT, 8 * kKiB), any);
  EXPECT_EQ(set_.BestFit(kAnyStream, 8 * kKiB), any);
  Block* any_smaller = Add(8 * kKiB - 512, kAnyStream);
  EXPECT_EQ(set_.BestFit(kS, 4 * kKiB), any_smaller);
  EXPECT_EQ(set_.BestFit(kS, 8 * kKiB), own);
}

TEST_F(FreeBlocksTest, BlocksOfForEachStreamAndForEach) {
  Block* s1 = Add(512, kS);
  Block* s2 = Add(2 * kMiB, kS);
  Block* s3 = Add(2 * kMiB, kS);  // same bin as s2
  Block* t1 = Add(64 * kKiB, kT);
  Block* a1 = Add(1 * kGiB, kAnyStream);
  Block* z1 = Add(4 * kKiB, 0);  // the default stream is a tag like any other

  auto as_set = [](const std::vector<Block*>& v) { return std::set<Block*>(v.begin(), v.end()); };
  EXPECT_EQ(set_.BlocksOf(kS).size(), 3u);
  EXPECT_EQ(as_set(set_.BlocksOf(kS)), (std::set<Block*>{s1, s2, s3}));
  EXPECT_EQ(as_set(set_.BlocksOf(kT)), (std::set<Block*>{t1}));
  EXPECT_EQ(as_set(set_.BlocksOf(kAnyStream)), (std::set<Block*>{a1}));
  EXPECT_EQ(as_set(set_.BlocksOf(0)), (std::set<Block*>{z1}));
  EXPECT_TRUE(set_.BlocksOf(12345).empty());
  EXPECT_EQ(All(), (std::set<Block*>{s1, s2, s3, t1, a1, z1}));

  std::multiset<Stream> streams;
  set_.ForEachStream([&](Stream s) { streams.insert(s); });
  EXPECT_EQ(streams, (std::multiset<Stream>{kS, kT, kAnyStream, 0}));

  // A tag whose blocks all left is no longer reported.
  set_.Remove(t1);
  set_.Remove(z1);
  streams.clear();
  set_.ForEachStream([&](Stream s) { streams.insert(s); });
  EXPECT_EQ(streams, (std::multiset<Stream>{kS, kAnyStream}));
  EXPECT_TRUE(set_.BlocksOf(kT).empty());
  EXPECT_EQ(All(), (std::set<Block*>{s1, s2, s3, a1}));
  // ... and comes back with a new block.
  Block* t2 = Add(512, kT);
  streams.clear();
  set_.ForEachStream([&](Stream s) { streams.insert(s); });
  EXPECT_EQ(streams, (std::multiset<Stream>{kS, kT, kAnyStream}));
  EXPECT_EQ(set_.BestFit(kT, 512), t2);
}

// A program that makes and destroys streams leaves tags with nothing cached: they are
// dropped as new tags come (the kept ones stay a small multiple of those in use), and a tag
// that still holds blocks, kAnyStream's among them, is kept and searched as before.
TEST_F(FreeBlocksTest, TagsOfStreamsWithNothingCachedAreDropped) {
  Block* any = Add(64 * kKiB, kAnyStream);
  Block* kept = Add(32 * kKiB, kS);
  for (Stream s = 1000; s < 11000; ++s) {  // 10,000 short-lived streams, one block each
    Block* b = Add(4 * kKiB, s);
    EXPECT_EQ(set_.BestFit(s, 4 * kKiB), b);
    set_.Remove(b);
    EXPECT_LE(set_.tag_count(), 130u) << "at stream " << s;
  }
  EXPECT_EQ(set_.BestFit(kS, 16 * kKiB), kept);
  EXPECT_EQ(set_.BestFit(kT, 16 * kKiB), any);
  EXPECT_EQ(set_.BestFit(kAnyStream, 16 * kKiB), any);
  EXPECT_EQ(set_.BestFit(1000, 4 * kKiB), any) << "a dropped tag's stream sees kAnyStream's";
  EXPECT_EQ(All(), (std::set<Block*>{any, kept}));
  std::vector<Stream> streams;
  set_.ForEachStream([&](Stream s) { streams.push_back(s); });
  EXPECT_EQ(streams, (std::vector<Stream>{kAnyStream, kS}));
  // A stream whose tag was dropped files blocks again.
  Block* again = Add(8 * kKiB, 1000);
  EXPECT_EQ(set_.BestFit(1000, 4 * kKiB), again);
  EXPECT_EQ(set_.BlocksOf(1000), (std::vector<Block*>{again}));
}

// ForEachAtLeast(stream, n): every block of the tag of at least n bytes, once; no block of
// another tag; of smaller blocks only those sharing n's bin (the reclaim policy's search for
// free blocks of a page or more, which must not walk the small ones). Randomized against a
// reference, with sizes across classes and tags.
TEST_F(FreeBlocksTest, ForEachAtLeastVisitsTheLargeBlocksOfATag) {
  std::mt19937_64 rng(17);
  const Stream tags[] = {kS, kT, kAnyStream};
  std::vector<Block*> blocks;
  for (int i = 0; i < 600; ++i) {
    // Sizes log-uniform from 512 B to 4 GiB, multiples of 512.
    const int shift = static_cast<int>(rng() % 24);
    const size_t size = ((size_t{512} << shift) + (rng() % (size_t{512} << shift))) / 512 * 512;
    blocks.push_back(Add(size, tags[rng() % 3]));
  }
  for (int i = 0; i < 150; ++i) {  // some leave, so that bins and classes empty again
    const size_t at = rng() % blocks.size();
    if (set_.Contains(blocks[at])) set_.Remove(blocks[at]);
  }
  for (size_t n : {size_t{512}, 16 * kKiB, 16 * kKiB + 512, 2 * kMiB, 8 * kMiB, 8 * kMiB + 512,
                   1 * kGiB, 8 * kGiB}) {
    for (Stream tag : {kS, kT, kAnyStream, Stream{12345}}) {
      std::set<Block*> seen;
      set_.ForEachAtLeast(tag, n, [&](Block* b) {
        EXPECT_TRUE(seen.insert(b).second) << "visited twice: " << Describe(b);
        EXPECT_EQ(b->stream, tag) << Describe(b);
      });
      for (Block* b : blocks) {
        if (!set_.Contains(b) || b->stream != tag) continue;
        if (b->size >= n) {
          EXPECT_TRUE(seen.count(b)) << "missed " << Describe(b) << " for n=" << n;
        } else if (seen.count(b)) {
          // A smaller block only from n's own bin (a thirty-second of n wide, one size below
          // 16 KiB): what BestFit looks at too.
          EXPECT_GE(b->size + n / 32 + 512, n) << Describe(b) << " for n=" << n;
        }
      }
    }
  }
}

TEST_F(FreeBlocksTest, BlocksOfOneSize) {
  // Many blocks in one bin's intrusive list: removing the head, the tail and middles keeps the
  // list intact.
  std::vector<Block*> same;
  for (int i = 0; i < 9; ++i) same.push_back(Add(48 * kKiB, kS));
  EXPECT_EQ(set_.count(), 9u);
  EXPECT_EQ(set_.BestFit(kS, 48 * kKiB), same[0]);
  // The list is LIFO: the last inserted is its head.
  set_.Remove(same[8]);  // head
  set_.Remove(same[0]);  // tail
  set_.Remove(same[4]);  // middle
  EXPECT_EQ(set_.BestFit(kS, 48 * kKiB), same[1]);
  EXPECT_EQ(All(), (std::set<Block*>{same[1], same[2], same[3], same[5], same[6], same[7]}));
  for (int i : {1, 2, 3, 5, 6}) set_.Remove(same[i]);
  EXPECT_EQ(set_.BestFit(kS, 512), same[7]);
  set_.Remove(same[7]);
  EXPECT_EQ(set_.BestFit(kS, 512), nullptr);
  EXPECT_EQ(set_.count(), 0u);
}

// A search compares at most kMaxWalk (256) blocks of a bin, the latest filed: refilling the
// holes of 150,000 tiny tensors walked one bin of 75,000 blocks per request before (a host
// replay spent 95 µs a request in it). Among blocks of one size it picks the lowest address
// of those 256; in a shared bin where none of them fits, up to 4,096 more are looked at before
// a larger bin's block is taken.
TEST_F(FreeBlocksTest, ASearchComparesTheLatestFiledBlocksOfABinOnly) {
  std::vector<Block*> holes;
  for (int i = 0; i < 1000; ++i) holes.push_back(Add(512, kS));  // addresses increase
  EXPECT_EQ(set_.BestFit(kS, 512), holes[1000 - 256]) << "the lowest of the latest 256";
  set_.Remove(holes[1000 - 256]);
  EXPECT_EQ(set_.BestFit(kS, 512), holes[1000 - 257]) << "the walk moved down by one";

  // A shared bin (64 KiB to 66 KiB): the one fitting block was filed first, then 300 that
  // are too small, then a much larger block of another bin.
  Block* fits = Add(65 * kKiB + 512, kT);
  for (int i = 0; i < 300; ++i) Add(64 * kKiB, kT);
  Add(1 * kGiB, kT);
  EXPECT_EQ(set_.BestFit(kT, 65 * kKiB), fits) << "a close fit past the walk lost to 1 GiB";
  // Past both walks (256 + 4,096 blocks too small filed after it), the larger bin serves.
  for (int i = 0; i < 4100; ++i) Add(64 * kKiB, kT);
  EXPECT_EQ(set_.BestFit(kT, 65 * kKiB)->size, 1 * kGiB);
}

// Sizes in bytes where a new bin starts: every 512 bytes below 32 KiB, then 32 bins per power
// of two.
std::vector<size_t> BinEdges(size_t max_units) {
  std::vector<size_t> edges;
  for (size_t u = 1; u < 64; ++u) edges.push_back(u * 512);
  for (size_t f = 1; (size_t{32} << f) <= max_units; ++f) {
    for (size_t s = 0; s < 32; ++s) edges.push_back(((32 + s) << f) * 512);
  }
  return edges;
}

TEST_F(FreeBlocksTest, SizesAtAndAroundEveryBinEdge) {
  // For every bin edge up to 64 GiB, blocks of the edge size and one step either side; every
  // request at and around every edge must find exactly the reference answer.
  std::vector<Block*> blocks;
  std::set<size_t> sizes;
  for (size_t e : BinEdges(size_t{64} << 21)) {
    for (size_t size : {e - 512, e, e + 512}) {
      if (size > 0) sizes.insert(size);
    }
  }
  for (size_t size : sizes) blocks.push_back(Add(size, kS));
  for (size_t size : sizes) {
    for (size_t n : {size - 1, size, size + 1}) {
      Block* got = set_.BestFit(kS, n);
      Block* want = Reference(blocks, kS, n);
      ASSERT_EQ(got, want) << "n=" << n << " got " << Describe(got) << " want " << Describe(want);
    }
  }
  // Removing every other size (so that the next non-empty bin is often in another class).
  std::vector<Block*> kept;
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (i % 2 == 0) {
      set_.Remove(blocks[i]);
    } else {
      kept.push_back(blocks[i]);
    }
  }
  for (size_t size : sizes) {
    for (size_t n : {size - 512, size, size + 512}) {
      Block* got = set_.BestFit(kS, n);
      Block* want = Reference(kept, kS, n);
      ASSERT_EQ(got, want) << "n=" << n << " got " << Describe(got) << " want " << Describe(want);
    }
  }
}

TEST_F(FreeBlocksTest, OneBlockPerEdgeFoundFromBelow) {
  // A single block at a bin edge is found by every smaller request, however many empty bins
  // and classes lie between (exercises the bitmap search), and by no larger one.
  for (size_t e : BinEdges(size_t{1} << 30)) {
    FreeBlocks set;
    Block* b = Make(e, kS);
    set.Insert(b);
    for (size_t n : {size_t{1}, size_t{512}, e / 3, e / 2, e - 512, e}) {
      if (n == 0) continue;
      ASSERT_EQ(set.BestFit(kS, n), b) << "edge " << e << " n " << n;
    }
    ASSERT_EQ(set.BestFit(kS, e + 1), nullptr) << e;
    ASSERT_EQ(set.BestFit(kS, e + 512), nullptr) << e;
    set.Remove(b);
    ASSERT_EQ(set.BestFit(kS, 512), nullptr) << e;
  }
}

TEST_F(FreeBlocksTest, VeryLargeBlocks) {
  Block* tb = Add(size_t{1} << 40, kS);
  Block* huge = Add((size_t{1} << 50) + 512, kS);
  EXPECT_EQ(set_.BestFit(kS, 1), tb);
  EXPECT_EQ(set_.BestFit(kS, size_t{1} << 40), tb);
  EXPECT_EQ(set_.BestFit(kS, (size_t{1} << 40) + 512), huge);
  EXPECT_EQ(set_.BestFit(kS, size_t{1} << 50), huge);
  EXPECT_EQ(set_.BestFit(kS, (size_t{1} << 50) + 1024), nullptr);
  EXPECT_EQ(set_.BestFit(kS, size_t{1} << 62), nullptr);
  EXPECT_TRUE(set_.Filed(tb));
  EXPECT_TRUE(set_.Filed(huge));
}

TEST_F(FreeBlocksTest, ReplaceInTheSameBin) {
  // A split of a large block: the upper part takes the old block's place (same bin).
  const size_t lo = 512 * kMiB;
  Block* other = Add(lo + 8 * kMiB, kS);
  Block* old = Add(lo + 4 * kMiB, kS, kBase);
  Block* other2 = Add(lo + 8 * kMiB, kS);
  Block* rest = Make(lo + 2 * kMiB, kS, kBase + 2 * kMiB);
  set_.Replace(old, rest, rest->size);
  EXPECT_FALSE(set_.Contains(old));
  EXPECT_TRUE(set_.Contains(rest));
  EXPECT_TRUE(set_.Filed(rest));
  EXPECT_EQ(old->free_prev, nullptr);
  EXPECT_EQ(old->free_next, nullptr);
  EXPECT_EQ(set_.count(), 3u);
  EXPECT_EQ(set_.BestFit(kS, lo), rest);
  EXPECT_EQ(All(), (std::set<Block*>{other, rest, other2}));
  set_.Remove(rest);
  EXPECT_EQ(set_.BestFit(kS, lo), other);
  EXPECT_EQ(All(), (std::set<Block*>{other, other2}));
}

TEST_F(FreeBlocksTest, ReplaceIntoAnotherBin) {
  Block* old = Add(64 * kKiB, kS);
  Block* keep = Add(1 * kMiB, kS);
  // Grows by coalescing: the new block's size is given before it is set (as Arena does).
  Block* grown = Make(16 * kKiB, kS);
  set_.Replace(old, grown, 512 * kKiB);
  grown->size = 512 * kKiB;
  EXPECT_FALSE(set_.Contains(old));
  EXPECT_TRUE(set_.Filed(grown));
  EXPECT_EQ(set_.count(), 2u);
  EXPECT_EQ(set_.BestFit(kS, 64 * kKiB), grown);
  EXPECT_EQ(set_.BestFit(kS, 512 * kKiB + 512), keep);
  // Shrinks to a one-size bin.
  Block* small = Make(512, kS);
  set_.Replace(grown, small, 512);
  EXPECT_TRUE(set_.Filed(small));
  EXPECT_FALSE(set_.Contains(grown));
  EXPECT_EQ(set_.BestFit(kS, 512), small);
  EXPECT_EQ(set_.BestFit(kS, 1024), keep);
  EXPECT_EQ(All(), (std::set<Block*>{small, keep}));
}

TEST_F(FreeBlocksTest, ResizedMovesABlockToItsNewBin) {
  Block* b = Add(4 * kKiB, kS);
  Block* c = Add(8 * kKiB, kS);
  b->size = 16 * kKiB;  // another bin: not filed until Resized()
  EXPECT_FALSE(set_.Filed(b));
  set_.Resized(b);
  EXPECT_TRUE(set_.Filed(b));
  EXPECT_EQ(set_.count(), 2u);
  EXPECT_EQ(set_.BestFit(kS, 4 * kKiB), c);
  EXPECT_EQ(set_.BestFit(kS, 8 * kKiB + 512), b);
  // Within one shared bin nothing moves, and the new size is seen.
  Block* big = Add(512 * kMiB + kMiB, kS);
  big->size = 512 * kMiB + 9 * kMiB;
  set_.Resized(big);
  EXPECT_TRUE(set_.Filed(big));
  EXPECT_EQ(set_.BestFit(kS, 512 * kMiB + 2 * kMiB), big);
  // Shrinking below another block.
  big->size = 2 * kKiB;
  set_.Resized(big);
  EXPECT_TRUE(set_.Filed(big));
  EXPECT_EQ(set_.BestFit(kS, 512), big);
  EXPECT_EQ(set_.BestFit(kS, 16 * kKiB + 512), nullptr);
  EXPECT_EQ(All(), (std::set<Block*>{b, c, big}));
}

TEST_F(FreeBlocksTest, TalliesCountBlocksAndBytesAsTheyEnterAndLeave) {
  auto expect = [&](int64_t n, int64_t b, const char* what) {
    SCOPED_TRACE(what);
    const Stat blocks = set_.block_stat();
    const Stat bytes = set_.byte_stat();
    EXPECT_EQ(blocks.current, n);
    EXPECT_EQ(bytes.current, b);
    EXPECT_EQ(blocks.allocated - blocks.freed, n);
    EXPECT_EQ(bytes.allocated - bytes.freed, b);
    EXPECT_GE(blocks.peak, n);
    EXPECT_GE(bytes.peak, b);
    int64_t walked = 0;
    set_.ForEach([&](const Block* x) { walked += static_cast<int64_t>(x->size); });
    EXPECT_EQ(walked, b);
    EXPECT_EQ(set_.count(), static_cast<size_t>(n));
  };
  Block* a = Add(4 * kKiB, kS);
  Block* c = Add(64 * kKiB, kS);
  expect(2, 68 * kKiB, "inserted");
  // Taken in part: the rest replaces it (another bin).
  Block* rest = Make(16 * kKiB, kS);
  c->size = 48 * kKiB;
  set_.Replace(c, rest, 16 * kKiB);
  expect(2, 20 * kKiB, "replaced by a smaller rest");
  // Grown by coalescing in place.
  a->size = 12 * kKiB;
  set_.Resized(a);
  expect(2, 28 * kKiB, "resized");
  // Replaced by a larger block within the same bin.
  Block* grown = Make(17 * kKiB, kS);
  set_.Replace(rest, grown, 17 * kKiB);
  expect(2, 29 * kKiB, "replaced in its bin");
  EXPECT_EQ(set_.byte_stat().allocated, (68 + 8 + 1) * kKiB) << "filed, and grown in place";
  set_.Remove(a);
  set_.Remove(grown);
  expect(0, 0, "removed");
  EXPECT_EQ(set_.byte_stat().peak, 68 * kKiB);
  EXPECT_EQ(set_.block_stat().peak, 2);
  Block* again = Add(8 * kKiB, kS);
  set_.ResetStatPeaks();
  set_.ResetStatAccumulated();
  EXPECT_EQ(set_.byte_stat().peak, 8 * kKiB);
  EXPECT_EQ(set_.byte_stat().allocated, 0);
  EXPECT_EQ(set_.block_stat().freed, 0);
  set_.Remove(again);
  EXPECT_EQ(set_.byte_stat().freed, 8 * kKiB);
  EXPECT_EQ(set_.block_stat().freed, 1);
  EXPECT_EQ(set_.byte_stat().peak, 8 * kKiB);
}

TEST_F(FreeBlocksTest, RemoveLastOfAClassKeepsOtherClasses) {
  // Emptying a bin must clear only its bits: the other bins of its class, and other classes,
  // stay findable.
  Block* a = Add(40 * kKiB, kS);   // class 1
  Block* b = Add(60 * kKiB, kS);   // class 1, another bin
  Block* c = Add(200 * kKiB, kS);  // class 3
  set_.Remove(a);
  EXPECT_EQ(set_.BestFit(kS, 33 * kKiB), b);
  set_.Remove(b);
  EXPECT_EQ(set_.BestFit(kS, 33 * kKiB), c);
  set_.Insert(a);
  EXPECT_EQ(set_.BestFit(kS, 33 * kKiB), a);
  EXPECT_EQ(set_.BestFit(kS, 40 * kKiB + 512), c);
}

TEST_F(FreeBlocksTest, RandomAgainstReference) {
  // Random inserts, removes, resizes and replaces over a few tags, every search checked against
  // a linear scan. Fixed seed; sizes log-uniform from 512 B to 4 GiB, with many repeats.
  std::mt19937_64 rng(0x5eed);
  const std::vector<Stream> tags = {0, kS, kT, kAnyStream};
  auto random_size = [&]() -> size_t {
    const int bits = static_cast<int>(rng() % 23);  // up to 2^22 units = 2 GiB
    const size_t units = (size_t{1} << bits) + rng() % (size_t{1} << bits);
    return (rng() % 4 == 0 ? (rng() % 8 + 1) * 4096 : units * 512);  // repeats of small sizes
  };
  std::vector<Block*> in;   // in the set
  std::vector<Block*> out;  // made, not in the set
  for (int step = 0; step < 6000; ++step) {
    const int op = static_cast<int>(rng() % 10);
    if (op < 4 || in.empty()) {
      Block* b;
      if (!out.empty() && rng() % 2 == 0) {
        const size_t i = rng() % out.size();
        b = out[i];
        out.erase(out.begin() + static_cast<std::ptrdiff_t>(i));
        b->size = random_size();
        b->stream = tags[rng() % tags.size()];
      } else {
        b = Make(random_size(), tags[rng() % tags.size()]);
      }
      set_.Insert(b);
      in.push_back(b);
    } else if (op < 6) {
      const size_t i = rng() % in.size();
      set_.Remove(in[i]);
      out.push_back(in[i]);
      in.erase(in.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (op < 8) {
      Block* b = in[rng() % in.size()];
      if (rng() % 2 == 0) {
        b->size = random_size();
      } else {  // a small change, usually within the bin
        const size_t delta = 512 * (rng() % 32 + 1);
        b->size = rng() % 2 == 0 || b->size <= delta ? b->size + delta : b->size - delta;
      }
      set_.Resized(b);
    } else {
      // Replace a contained block by a new one of the same tag.
      const size_t i = rng() % in.size();
      Block* old = in[i];
      Block* b = Make(rng() % 2 == 0 ? random_size() : old->size, old->stream);
      set_.Replace(old, b, b->size);
      in[i] = b;
      out.push_back(old);
    }
    ASSERT_EQ(set_.count(), in.size());
    size_t largest = 0;
    for (const Block* b : in) largest = std::max(largest, b->size);
    ASSERT_EQ(set_.Largest(), largest) << "step " << step;
    for (int q = 0; q < 6; ++q) {
      const Stream s = tags[rng() % tags.size()];
      size_t n = random_size();
      if (q == 0 && !in.empty()) n = in[rng() % in.size()]->size;  // an exact size
      if (q == 1) n += rng() % 512;                                // not a multiple of 512
      Block* got = set_.BestFit(s, n);
      Block* want = Reference(in, s, n);
      ASSERT_EQ(got, want) << "step " << step << " stream " << s << " n " << n << ": got "
                           << Describe(got) << " want " << Describe(want);
    }
    if (step % 500 == 0) {
      std::set<Block*> all = All();
      ASSERT_EQ(all, std::set<Block*>(in.begin(), in.end()));
      for (Stream s : tags) {
        std::vector<Block*> of = set_.BlocksOf(s);
        const auto expect =
            std::count_if(in.begin(), in.end(), [&](const Block* b) { return b->stream == s; });
        ASSERT_EQ(static_cast<std::ptrdiff_t>(of.size()), expect);
        for (Block* b : of) ASSERT_EQ(b->stream, s);
      }
    }
  }
}

}  // namespace
}  // namespace vmm
