#include "allocator/block.h"

namespace vmm {

const char* BlockStateName(BlockState state) {
  switch (state) {
    case BlockState::kUnmapped:
      return "unmapped";
    case BlockState::kFree:
      return "free";
    case BlockState::kAllocated:
      return "allocated";
    case BlockState::kPendingFree:
      return "pending_free";
    case BlockState::kRetired:
      return "retired";
  }
  return "unknown";
}

}  // namespace vmm
