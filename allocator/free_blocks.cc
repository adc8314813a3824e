#include "allocator/free_blocks.h"

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
