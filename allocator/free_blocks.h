// free_blocks.h: the set of cached (kFree) blocks of an arena, searched best-fit per stream.
//
// Blocks are kept per stream tag in segregated size bins (two-level, as in TLSF): sizes are
// multiples of 512; below 16 KiB each bin holds one size, above that each power of two is cut
// into 32 bins. Bitmaps find the next non-empty bin in constant time, and each bin is an
// intrusive list, so inserting and removing a block take constant time and no memory. The
// search is exact best fit: the smallest fitting block of the request's own bin, else the
// smallest block of the next non-empty bin (every block there is larger), ties going to the
// lower address unless an exact size is found first.
//
// The best fit for stream S is the better of S's own blocks and the blocks every stream may
// use (kAnyStream). A block's size and tag must not change while it is in the set: Remove()
// it first.
#ifndef VMM_ALLOCATOR_FREE_BLOCKS_H_
#define VMM_ALLOCATOR_FREE_BLOCKS_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "allocator/block.h"

namespace vmm {

class FreeBlocks {
 public:
  FreeBlocks();
  ~FreeBlocks();
  FreeBlocks(const FreeBlocks&) = delete;
  FreeBlocks& operator=(const FreeBlocks&) = delete;

  void Insert(Block* block);
  void Remove(Block* block);
  bool Contains(const Block* block) const { return block->free_bins != nullptr; }
  size_t count() const { return count_; }

  // The smallest block of at least `size` bytes that `stream` may take now: one freed on
  // `stream` itself, or one free for every stream; nullptr when there is none.
  Block* BestFit(Stream stream, size_t size) const;

  // The blocks tagged with `stream`.
  std::vector<Block*> BlocksOf(Stream stream) const;

  // Calls f(stream) once for each tag that has blocks.
  template <typename F>
  void ForEachStream(F&& f) const {
    for (const auto& bins : tags_) {
      if (bins->count > 0) f(bins->stream);
    }
  }

  // Calls f(block) for every block.
  template <typename F>
  void ForEach(F&& f) const {
    for (const auto& bins : tags_) {
      for (Block* head : bins->heads) {
        for (Block* b = head; b != nullptr; b = b->free_next) f(b);
      }
    }
  }

 private:
  static constexpr int kSecondBits = 5;
  static constexpr int kSecond = 1 << kSecondBits;  // bins per power of two
  static constexpr int kFirst = 64 - 9 - kSecondBits + 1;
  static constexpr int kBins = kFirst * kSecond;

  // The blocks of one stream tag.
  struct Bins {
    Stream stream = 0;
    size_t count = 0;
    uint64_t first_map = 0;            // bit f: some bin of class f is non-empty
    uint32_t second_map[kFirst] = {};  // bit s of class f: bin (f, s) is non-empty
    Block* heads[kBins] = {};
  };

  static int BinOf(size_t size);
  static Block* SmallestIn(Block* head, size_t at_least);
  Bins* Find(Stream stream) const;
  Bins& FindOrAdd(Stream stream);
  static Block* BestFitIn(const Bins& bins, size_t size);

  std::vector<std::unique_ptr<Bins>> tags_;  // few: one per stream that freed memory
  Bins* last_ = nullptr;                      // the tag used last (the common one)
  size_t count_ = 0;
};

}  // namespace vmm

#endif  // VMM_ALLOCATOR_FREE_BLOCKS_H_
