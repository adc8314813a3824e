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

// The searches and updates below are on the pool's cached path: inline.

inline int FreeBlocks::BinOf(size_t size) {
  const uint64_t units = size >> 9;  // sizes are multiples of 512
  if (units < kSecond) return static_cast<int>(units);
  const int top = 63 - __builtin_clzll(units);  // >= kSecondBits
  const int first = top - kSecondBits + 1;
  const int second = static_cast<int>((units >> (top - kSecondBits)) & (kSecond - 1));
  return first * kSecond + second;
}

inline FreeBlocks::Bins* FreeBlocks::Find(Stream stream) const {
  if (last_ != nullptr && last_->stream == stream) return last_;
  for (const auto& bins : tags_) {
    if (bins->stream == stream) return bins.get();
  }
  return nullptr;
}

inline FreeBlocks::Bins& FreeBlocks::FindOrAdd(Stream stream) {
  Bins* bins = Find(stream);
  if (bins == nullptr) {
    tags_.push_back(std::make_unique<Bins>());
    bins = tags_.back().get();
    bins->stream = stream;
  }
  last_ = bins;
  return *bins;
}

inline void FreeBlocks::Insert(Block* block) {
  Bins& bins = FindOrAdd(block->stream);
  const int bin = BinOf(block->size);
  block->free_prev = nullptr;
  block->free_next = bins.heads[bin];
  if (block->free_next != nullptr) block->free_next->free_prev = block;
  bins.heads[bin] = block;
  bins.first_map |= uint64_t{1} << (bin / kSecond);
  bins.second_map[bin / kSecond] |= 1u << (bin % kSecond);
  block->free_bins = &bins;
  block->free_bin = bin;
  ++bins.count;
  ++count_;
}

inline void FreeBlocks::Remove(Block* block) {
  Bins& bins = *static_cast<Bins*>(block->free_bins);
  const int bin = block->free_bin;
  if (block->free_prev != nullptr) {
    block->free_prev->free_next = block->free_next;
  } else {
    bins.heads[bin] = block->free_next;
  }
  if (block->free_next != nullptr) block->free_next->free_prev = block->free_prev;
  if (bins.heads[bin] == nullptr) {
    bins.second_map[bin / kSecond] &= ~(1u << (bin % kSecond));
    if (bins.second_map[bin / kSecond] == 0) bins.first_map &= ~(uint64_t{1} << (bin / kSecond));
  }
  block->free_prev = block->free_next = nullptr;
  block->free_bins = nullptr;
  --bins.count;
  --count_;
}

inline Block* FreeBlocks::SmallestIn(Block* head, size_t at_least) {
  Block* best = nullptr;
  for (Block* b = head; b != nullptr; b = b->free_next) {
    if (b->size < at_least) continue;
    if (b->size == at_least) {
      if (best == nullptr || best->size != at_least || b->addr < best->addr) best = b;
      continue;
    }
    if (best == nullptr || b->size < best->size || (b->size == best->size && b->addr < best->addr)) {
      best = b;
    }
  }
  return best;
}

inline Block* FreeBlocks::BestFitIn(const Bins& bins, size_t size) {
  if (bins.count == 0) return nullptr;
  const int bin = BinOf(size);
  if (Block* b = SmallestIn(bins.heads[bin], size)) return b;
  // The next non-empty bin: every block in it is larger than `size`.
  int first = bin / kSecond;
  const int second = bin % kSecond;
  uint32_t rest = second + 1 < kSecond ? bins.second_map[first] & (~0u << (second + 1)) : 0;
  if (rest == 0) {
    const uint64_t higher =
        first + 1 < kFirst ? bins.first_map & (~uint64_t{0} << (first + 1)) : 0;
    if (higher == 0) return nullptr;
    first = __builtin_ctzll(higher);
    rest = bins.second_map[first];
  }
  const int next = first * kSecond + __builtin_ctz(rest);
  return SmallestIn(bins.heads[next], 0);
}

inline Block* FreeBlocks::BestFit(Stream stream, size_t size) const {
  const Bins* own = Find(stream);
  Block* mine = own != nullptr ? BestFitIn(*own, size) : nullptr;
  if (stream == kAnyStream) return mine;
  const Bins* shared = Find(kAnyStream);
  Block* any = shared != nullptr ? BestFitIn(*shared, size) : nullptr;
  if (mine == nullptr) return any;
  if (any == nullptr) return mine;
  return any->size < mine->size ? any : mine;
}

}  // namespace vmm

#endif  // VMM_ALLOCATOR_FREE_BLOCKS_H_
