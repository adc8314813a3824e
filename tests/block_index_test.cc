// Tests of BlockIndex (block_index.h), the two-level table that finds the live block starting
// at an address. Nothing is mapped: the index only does arithmetic on a fake base address.
#include "allocator/block_index.h"

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "allocator/block.h"
#include "gtest/gtest.h"

namespace vmm {
namespace {

constexpr uintptr_t kBase = uintptr_t{1} << 40;
constexpr size_t kLeafSlots = 4096;  // slots per leaf (kLeafBits = 12 in block_index.h)

// Owns the Blocks the index points to.
class Blocks {
 public:
  Block* Make(uintptr_t addr, size_t size = 512) {
    blocks_.push_back(std::make_unique<Block>());
    Block* b = blocks_.back().get();
    b->addr = addr;
    b->size = size;
    b->state = BlockState::kAllocated;
    return b;
  }

 private:
  std::vector<std::unique_ptr<Block>> blocks_;
};

TEST(BlockIndexTest, EmptyIndexFindsNothing) {
  BlockIndex index;
  index.Init(kBase, size_t{1} << 30, 9);
  EXPECT_EQ(index.count(), 0u);
  EXPECT_EQ(index.Find(kBase), nullptr);
  EXPECT_EQ(index.Find(kBase + 512), nullptr);
  EXPECT_EQ(index.Find(kBase + (size_t{1} << 29)), nullptr);
  Blocks blocks;
  EXPECT_TRUE(index.SlotFree(blocks.Make(kBase)));
  EXPECT_TRUE(index.SlotFree(blocks.Make(kBase + (size_t{1} << 30) - 512)));
}

TEST(BlockIndexTest, InsertFindErase) {
  BlockIndex index;
  index.Init(kBase, size_t{1} << 20, 9);
  Blocks blocks;
  Block* a = blocks.Make(kBase, 1024);
  Block* b = blocks.Make(kBase + 1024, 512);
  Block* c = blocks.Make(kBase + 4096, 8192);

  index.Insert(a);
  EXPECT_EQ(index.count(), 1u);
  EXPECT_EQ(index.Find(kBase), a);
  EXPECT_EQ(index.Find(kBase + 1024), nullptr);
  EXPECT_FALSE(index.SlotFree(a));
  EXPECT_TRUE(index.SlotFree(b));

  index.Insert(b);
  index.Insert(c);
  EXPECT_EQ(index.count(), 3u);
  EXPECT_EQ(index.Find(kBase), a);
  EXPECT_EQ(index.Find(kBase + 1024), b);
  EXPECT_EQ(index.Find(kBase + 4096), c);

  index.Erase(b);
  EXPECT_EQ(index.count(), 2u);
  EXPECT_EQ(index.Find(kBase + 1024), nullptr);
  EXPECT_TRUE(index.SlotFree(b));
  EXPECT_EQ(index.Find(kBase), a);
  EXPECT_EQ(index.Find(kBase + 4096), c);

  // The slot can be taken again, by another Block object.
  Block* b2 = blocks.Make(kBase + 1024, 2048);
  index.Insert(b2);
  EXPECT_EQ(index.Find(kBase + 1024), b2);
  EXPECT_EQ(index.count(), 3u);

  index.Erase(a);
  index.Erase(b2);
  index.Erase(c);
  EXPECT_EQ(index.count(), 0u);
  EXPECT_EQ(index.Find(kBase), nullptr);
  EXPECT_EQ(index.Find(kBase + 1024), nullptr);
  EXPECT_EQ(index.Find(kBase + 4096), nullptr);
}

TEST(BlockIndexTest, AddressesThatAreNotBlockStartsFindNothing) {
  BlockIndex index;
  index.Init(kBase, size_t{1} << 20, 9);
  Blocks blocks;
  Block* big = blocks.Make(kBase + 8192, 16384);
  index.Insert(big);
  // Inside the block: in its own slot, and in the slots it covers.
  EXPECT_EQ(index.Find(kBase + 8192 + 1), nullptr);
  EXPECT_EQ(index.Find(kBase + 8192 + 256), nullptr);
  EXPECT_EQ(index.Find(kBase + 8192 + 511), nullptr);
  EXPECT_EQ(index.Find(kBase + 8192 + 512), nullptr);
  EXPECT_EQ(index.Find(kBase + 8192 + 4096), nullptr);
  EXPECT_EQ(index.Find(big->end() - 1), nullptr);
  // Just around it.
  EXPECT_EQ(index.Find(kBase + 8192 - 1), nullptr);
  EXPECT_EQ(index.Find(kBase + 8192 - 512), nullptr);
  EXPECT_EQ(index.Find(big->end()), nullptr);
  EXPECT_EQ(index.Find(kBase + 8192), big);
}

TEST(BlockIndexTest, BlockNotAlignedToItsSlotIsFoundOnlyAtItsAddress) {
  // The large arena's slots may be larger than 512 bytes; a block starts anywhere in its slot.
  BlockIndex index;
  index.Init(kBase, size_t{1} << 24, 12);  // 4 KiB slots
  Blocks blocks;
  Block* b = blocks.Make(kBase + 3 * 4096 + 1536, 4096);
  index.Insert(b);
  EXPECT_EQ(index.Find(b->addr), b);
  EXPECT_EQ(index.Find(kBase + 3 * 4096), nullptr);  // start of its slot
  EXPECT_EQ(index.Find(kBase + 3 * 4096 + 512), nullptr);
  EXPECT_EQ(index.Find(kBase + 4 * 4096), nullptr);
  // SlotFree is per slot, not per address: another block starting in that slot may not go in.
  EXPECT_FALSE(index.SlotFree(blocks.Make(kBase + 3 * 4096)));
  EXPECT_TRUE(index.SlotFree(blocks.Make(kBase + 4 * 4096)));
  index.Erase(b);
  EXPECT_TRUE(index.SlotFree(b));
  EXPECT_EQ(index.Find(b->addr), nullptr);
}

TEST(BlockIndexTest, AddressesOutsideTheRangeFindNothing) {
  BlockIndex index;
  const size_t size = size_t{1} << 20;
  index.Init(kBase, size, 9);
  Blocks blocks;
  Block* first = blocks.Make(kBase);
  Block* last = blocks.Make(kBase + size - 512);
  index.Insert(first);
  index.Insert(last);
  EXPECT_EQ(index.Find(kBase), first);
  EXPECT_EQ(index.Find(kBase + size - 512), last);
  EXPECT_EQ(index.Find(kBase - 512), nullptr);
  EXPECT_EQ(index.Find(kBase - 1), nullptr);
  EXPECT_EQ(index.Find(kBase + size), nullptr);
  EXPECT_EQ(index.Find(kBase + size + 512), nullptr);
  EXPECT_EQ(index.Find(0), nullptr);
  EXPECT_EQ(index.Find(~uintptr_t{0}), nullptr);
  EXPECT_EQ(index.Find(~uintptr_t{0} - 511), nullptr);
}

TEST(BlockIndexTest, SlotAndLeafBoundaries) {
  // Slots of 512 bytes; leaves of 4096 slots (2 MiB of range each).
  BlockIndex index;
  const size_t leaf_bytes = kLeafSlots * 512;
  const size_t size = 3 * leaf_bytes + 5 * 512;  // a partial last leaf
  index.Init(kBase, size, 9);
  Blocks blocks;
  const std::vector<uintptr_t> addrs = {
      kBase,                         // slot 0 of leaf 0
      kBase + 512,                   // slot 1
      kBase + leaf_bytes - 1024,     // second-to-last slot of leaf 0
      kBase + leaf_bytes - 512,      // last slot of leaf 0
      kBase + leaf_bytes,            // slot 0 of leaf 1
      kBase + leaf_bytes + 512,      // slot 1 of leaf 1
      kBase + 2 * leaf_bytes - 512,  // last slot of leaf 1
      kBase + 3 * leaf_bytes,        // first slot of the partial leaf
      kBase + size - 512,            // the very last slot
  };
  std::vector<Block*> inserted;
  for (uintptr_t a : addrs) {
    Block* b = blocks.Make(a);
    ASSERT_TRUE(index.SlotFree(b)) << std::hex << a - kBase;
    index.Insert(b);
    inserted.push_back(b);
  }
  EXPECT_EQ(index.count(), addrs.size());
  for (size_t i = 0; i < addrs.size(); ++i) {
    EXPECT_EQ(index.Find(addrs[i]), inserted[i]) << std::hex << addrs[i] - kBase;
    EXPECT_EQ(index.Find(addrs[i] + 256), nullptr);
  }
  // Neighbouring slots that hold nothing, on both sides of leaf edges.
  EXPECT_EQ(index.Find(kBase + 1024), nullptr);
  EXPECT_EQ(index.Find(kBase + leaf_bytes - 1536), nullptr);
  EXPECT_EQ(index.Find(kBase + leaf_bytes + 1024), nullptr);
  EXPECT_EQ(index.Find(kBase + 2 * leaf_bytes), nullptr);  // leaf 2 never allocated
  EXPECT_EQ(index.Find(kBase + 2 * leaf_bytes + 512), nullptr);
  EXPECT_EQ(index.Find(kBase + 3 * leaf_bytes + 512), nullptr);
  // Erasing the last slot of leaf 0 leaves slot 0 of leaf 1 alone, and the other way round.
  index.Erase(inserted[3]);
  EXPECT_EQ(index.Find(kBase + leaf_bytes - 512), nullptr);
  EXPECT_EQ(index.Find(kBase + leaf_bytes), inserted[4]);
  EXPECT_EQ(index.Find(kBase + leaf_bytes - 1024), inserted[2]);
  index.Erase(inserted[4]);
  EXPECT_EQ(index.Find(kBase + leaf_bytes), nullptr);
  EXPECT_EQ(index.Find(kBase + leaf_bytes + 512), inserted[5]);
  EXPECT_EQ(index.count(), addrs.size() - 2);
}

TEST(BlockIndexTest, LargeSlots) {
  // 2 MiB slots over a 64 GiB range: 32768 slots, eight leaves.
  BlockIndex index;
  const int shift = 21;
  const size_t slot = size_t{1} << shift;
  const size_t size = size_t{64} << 30;
  index.Init(kBase, size, shift);
  Blocks blocks;
  Block* a = blocks.Make(kBase + 4095 * slot, slot);
  Block* b = blocks.Make(kBase + 4096 * slot, 3 * slot);
  Block* c = blocks.Make(kBase + size - slot, slot);
  index.Insert(a);
  index.Insert(b);
  index.Insert(c);
  EXPECT_EQ(index.Find(a->addr), a);
  EXPECT_EQ(index.Find(b->addr), b);
  EXPECT_EQ(index.Find(c->addr), c);
  EXPECT_EQ(index.Find(b->addr + slot), nullptr);
  EXPECT_EQ(index.Find(b->addr + 512), nullptr);
  EXPECT_EQ(index.Find(kBase + size), nullptr);
  EXPECT_EQ(index.count(), 3u);
}

TEST(BlockIndexTest, ManyBlocks) {
  // Every 512-byte slot of 16 MiB (8 leaves), filled, checked, half erased, checked again.
  BlockIndex index;
  const size_t size = size_t{16} << 20;
  index.Init(kBase, size, 9);
  Blocks blocks;
  const size_t n = size / 512;
  std::vector<Block*> all;
  all.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    Block* b = blocks.Make(kBase + i * 512);
    index.Insert(b);
    all.push_back(b);
  }
  ASSERT_EQ(index.count(), n);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(index.Find(kBase + i * 512), all[i]) << i;
    ASSERT_EQ(index.Find(kBase + i * 512 + 1), nullptr) << i;
  }
  for (size_t i = 0; i < n; i += 2) index.Erase(all[i]);
  ASSERT_EQ(index.count(), n / 2);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(index.Find(kBase + i * 512), i % 2 == 0 ? nullptr : all[i]) << i;
    ASSERT_EQ(index.SlotFree(all[i]), i % 2 == 0) << i;
  }
}

TEST(BlockIndexTest, FindChecksTheBlocksCurrentAddress) {
  // Find() compares the address the Block holds now, so a stale entry for a block whose
  // address changed finds nothing rather than the wrong block.
  BlockIndex index;
  index.Init(kBase, size_t{1} << 20, 12);
  Blocks blocks;
  Block* b = blocks.Make(kBase + 4096);
  index.Insert(b);
  ASSERT_EQ(index.Find(kBase + 4096), b);
  b->addr = kBase + 4096 + 512;  // same slot
  EXPECT_EQ(index.Find(kBase + 4096), nullptr);
  EXPECT_EQ(index.Find(kBase + 4096 + 512), b);
  b->addr = kBase + 4096;
  index.Erase(b);
  EXPECT_EQ(index.count(), 0u);
}

TEST(BlockIndexTest, RandomAgainstMap) {
  // Random inserts and erases at random slots (blocks start anywhere in their slot), checked
  // against a std::map after every step with random probes.
  std::mt19937_64 rng(20240611);
  const int shift = 10;  // 1 KiB slots
  const size_t slots = 3 * kLeafSlots + 77;
  const size_t size = slots << shift;
  BlockIndex index;
  index.Init(kBase, size, shift);
  Blocks blocks;
  std::map<size_t, Block*> by_slot;  // slot -> live block
  std::uniform_int_distribution<size_t> any_slot(0, slots - 1);
  for (int step = 0; step < 20000; ++step) {
    const size_t slot = any_slot(rng);
    auto it = by_slot.find(slot);
    if (it == by_slot.end()) {
      const uintptr_t addr = kBase + (slot << shift) + 512 * (rng() % 2);
      Block* b = blocks.Make(addr);
      ASSERT_TRUE(index.SlotFree(b));
      index.Insert(b);
      by_slot[slot] = b;
    } else {
      ASSERT_FALSE(index.SlotFree(it->second));
      index.Erase(it->second);
      by_slot.erase(it);
    }
    ASSERT_EQ(index.count(), by_slot.size());
    for (int probe = 0; probe < 4; ++probe) {
      const size_t s = any_slot(rng);
      const uintptr_t addr = kBase + (s << shift) + 512 * (rng() % 2);
      auto e = by_slot.find(s);
      Block* expect = e != by_slot.end() && e->second->addr == addr ? e->second : nullptr;
      ASSERT_EQ(index.Find(addr), expect) << "step " << step << " slot " << s;
    }
  }
  for (const auto& [slot, b] : by_slot) {
    ASSERT_EQ(index.Find(b->addr), b);
    index.Erase(b);
  }
  EXPECT_EQ(index.count(), 0u);
}

}  // namespace
}  // namespace vmm
