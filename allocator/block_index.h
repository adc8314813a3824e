// block_index.h: finds the live block that starts at an address, in a few loads.
//
// A two-level table over one arena's address range: the range is cut into slots of
// 1 << slot_shift bytes, slots are grouped in leaves of 4096, and a leaf is allocated the
// first time a block starts in it. A slot holds the live block starting in it, so blocks
// must start at least one slot apart: the small arena uses 512-byte slots (every block is a
// multiple of 512), the large arena slots no larger than its smallest block. Find() checks
// the block's address, so a pointer into the middle of a block, or one that was never
// allocated, finds nothing. Not thread safe: the pool's lock guards it.
#ifndef VMM_ALLOCATOR_BLOCK_INDEX_H_
#define VMM_ALLOCATOR_BLOCK_INDEX_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "allocator/block.h"

namespace vmm {

class BlockIndex {
 public:
  void Init(uintptr_t base, size_t size, int slot_shift) {
    base_ = base;
    size_ = size;
    shift_ = slot_shift;
    leaves_.resize(((size >> slot_shift) >> kLeafBits) + 1);
  }

  // Lengthens the indexed range to `size` bytes; a shorter size is ignored (a live block may
  // be indexed anywhere in the range).
  void Resize(size_t size) {
    if (size <= size_) return;
    size_ = size;
    leaves_.resize(((size >> shift_) >> kLeafBits) + 1);
  }

  // The live block starting exactly at `addr`, or nullptr.
  Block* Find(uintptr_t addr) const {
    const uintptr_t off = addr - base_;  // wraps around for addr < base_
    if (off >= size_) return nullptr;
    const size_t slot = off >> shift_;
    const Block* const* leaf = leaves_[slot >> kLeafBits].get();
    if (leaf == nullptr) return nullptr;
    Block* b = const_cast<Block*>(leaf[slot & kLeafMask]);
    return b != nullptr && b->addr == addr ? b : nullptr;
  }

  // Records `block` as live. Its slot must be empty.
  void Insert(Block* block) {
    const size_t slot = (block->addr - base_) >> shift_;
    std::unique_ptr<Block*[]>& leaf = leaves_[slot >> kLeafBits];
    if (leaf == nullptr) leaf.reset(new Block*[kLeafSize]());
    leaf[slot & kLeafMask] = block;
    ++count_;
  }

  void Erase(const Block* block) {
    const size_t slot = (block->addr - base_) >> shift_;
    leaves_[slot >> kLeafBits][slot & kLeafMask] = nullptr;
    --count_;
  }

  // Whether `block`'s slot is free, i.e. Insert may take it.
  bool SlotFree(const Block* block) const {
    const size_t slot = (block->addr - base_) >> shift_;
    const Block* const* leaf = leaves_[slot >> kLeafBits].get();
    return leaf == nullptr || leaf[slot & kLeafMask] == nullptr;
  }

  size_t count() const { return count_; }

 private:
  static constexpr int kLeafBits = 12;
  static constexpr size_t kLeafSize = size_t{1} << kLeafBits;
  static constexpr size_t kLeafMask = kLeafSize - 1;

  uintptr_t base_ = 0;
  size_t size_ = 0;
  int shift_ = 9;
  size_t count_ = 0;
  std::vector<std::unique_ptr<Block*[]>> leaves_;
};

}  // namespace vmm

#endif  // VMM_ALLOCATOR_BLOCK_INDEX_H_
