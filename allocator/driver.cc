#include "allocator/driver.h"

namespace vmm {

absl::string_view HandleTypeName(HandleType type) {
  switch (type) {
    case HandleType::kNone:
      return "none";
    case HandleType::kPosixFd:
      return "posix_fd";
    case HandleType::kFabric:
      return "fabric";
  }
  return "unknown";
}

}  // namespace vmm
