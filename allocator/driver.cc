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

std::optional<HandleType> ParseHandleType(absl::string_view name) {
  for (HandleType type : {HandleType::kNone, HandleType::kPosixFd, HandleType::kFabric}) {
    if (name == HandleTypeName(type)) return type;
  }
  return std::nullopt;
}

}  // namespace vmm
