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

}  // namespace vmm
