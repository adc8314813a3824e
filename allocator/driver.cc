#include "allocator/driver.h"

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"

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

absl::string_view BackendName(Backend backend) {
  return backend == Backend::kHost ? "host" : "cuda";
}

std::optional<Backend> BackendOfDeviceUuid(absl::string_view uuid) {
  if (absl::StartsWith(uuid, "HOST-")) return Backend::kHost;
  if (absl::StartsWith(uuid, "GPU-")) return Backend::kCuda;
  return std::nullopt;
}

absl::Status CheckMapsWholeAllocation(absl::string_view who, size_t size, PhysHandle handle,
                                      size_t allocation_size) {
  if (size == allocation_size) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s: %d bytes of handle 0x%x, whose allocation has %d: a mapping covers a whole allocation",
      who, size, handle, allocation_size));
}

}  // namespace vmm
