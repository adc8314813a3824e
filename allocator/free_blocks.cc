#include "allocator/free_blocks.h"

#include <algorithm>

namespace vmm {

FreeBlocks::FreeBlocks() = default;
FreeBlocks::~FreeBlocks() = default;

std::vector<Block*> FreeBlocks::BlocksOf(Stream stream) const {
  std::vector<Block*> out;
  if (const Bins* bins = Find(stream)) {
    for (Block* head : bins->heads) {
      for (Block* b = head; b != nullptr; b = b->free_next) out.push_back(b);
    }
  }
  return out;
}

size_t FreeBlocks::Largest() const {
  size_t largest = 0;
  for (const auto& bins : tags_) {
    if (bins->count == 0) continue;
    const int first = 63 - __builtin_clzll(bins->first_map);
    const int bin = first * kSecond + (31 - __builtin_clz(bins->second_map[first]));
    // Below 2 * kSecond units (32 KiB) a bin holds blocks of one size.
    const bool one_size = bin < 2 * kSecond;
    for (const Block* b = bins->heads[bin]; b != nullptr; b = one_size ? nullptr : b->free_next) {
      largest = std::max(largest, b->size);
    }
  }
  return largest;
}

bool FreeBlocks::Filed(const Block* block) const {
  const Bins* bins = Find(block->stream);
  const int bin = BinOf(block->size);
  if (bins == nullptr || block->free_bins != bins || block->free_bin != bin) return false;
  for (const Block* b = bins->heads[bin]; b != nullptr; b = b->free_next) {
    if (b == block) return true;
  }
  return false;
}

}  // namespace vmm
