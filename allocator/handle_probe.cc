#include "allocator/handle_probe.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "allocator/log.h"
#include "allocator/status_macros.h"

namespace vmm {

std::optional<HandleRequest> ParseHandleRequest(absl::string_view name) {
  if (name == "auto") return HandleRequest::kAuto;
  const std::optional<HandleType> type = ParseHandleType(name);
  if (!type) return std::nullopt;
  switch (*type) {
    case HandleType::kNone:
      return HandleRequest::kNone;
    case HandleType::kPosixFd:
      return HandleRequest::kPosixFd;
    case HandleType::kFabric:
      return HandleRequest::kFabric;
  }
  return std::nullopt;
}

absl::Status ProbeHandleType(Driver& driver, int device, size_t granularity, HandleType type) {
  VMM_ASSIGN_OR_RETURN(bool supported, driver.SupportsHandleType(device, type));
  if (!supported) {
    return absl::UnimplementedError(
        absl::StrCat("device ", device, " does not support ", HandleTypeName(type), " handles"));
  }
  VMM_ASSIGN_OR_RETURN(PhysHandle handle,
                       driver.Create(device, granularity, HandleTypeBit(type)));
  return driver.Release(handle);
}

namespace {

// The probe of `type` failed because the device is full: nothing is learnt about the type, so
// nothing is chosen (a pool made now would keep the wrong type for good).
absl::Status DeviceFull(Driver& driver, int device, HandleType type, const absl::Status& probe) {
  return absl::ResourceExhaustedError(absl::StrCat(
      "cannot tell whether ", driver.Name(), " device ", device, " can share memory as ",
      HandleTypeName(type), " handles: it is out of memory for the one-granule probe (",
      probe.message(), "); free memory and try again"));
}

// What `auto` says, once, where fabric handles are unavailable and POSIX fds are used. The
// usual cause, a process without an IMEX channel (most machines of one node), is said
// plainly, without the driver's error: nothing failed that the program asked for.
std::string FabricFallbackNote(const absl::Status& fabric) {
  constexpr absl::string_view kFallback =
      "shared GPU memory uses POSIX file descriptors (handle_type=posix_fd chooses them "
      "without this note)";
  if (absl::IsPermissionDenied(fabric)) {
    return absl::StrCat("fabric handles need an IMEX channel "
                        "(/dev/nvidia-caps-imex-channels/channel<N>), which this process has "
                        "no access to: ",
                        kFallback);
  }
  return absl::StrCat("fabric handles are unavailable (", fabric.message(), "): ", kFallback);
}

}  // namespace

absl::StatusOr<HandleType> ResolveHandleType(Driver& driver, int device, size_t granularity,
                                             HandleRequest request) {
  switch (request) {
    case HandleRequest::kNone:
      return HandleType::kNone;
    case HandleRequest::kPosixFd:
    case HandleRequest::kFabric: {
      const HandleType type =
          request == HandleRequest::kFabric ? HandleType::kFabric : HandleType::kPosixFd;
      absl::Status probe = ProbeHandleType(driver, device, granularity, type);
      if (absl::IsResourceExhausted(probe)) return DeviceFull(driver, device, type, probe);
      if (!probe.ok()) {
        return absl::FailedPreconditionError(absl::StrCat(
            HandleTypeName(type), " handles are unavailable on ", driver.Name(), " device ",
            device, ": ", probe.message()));
      }
      return type;
    }
    case HandleRequest::kAuto:
      break;
  }
  absl::Status fabric = ProbeHandleType(driver, device, granularity, HandleType::kFabric);
  if (fabric.ok()) return HandleType::kFabric;
  if (absl::IsResourceExhausted(fabric)) {
    return DeviceFull(driver, device, HandleType::kFabric, fabric);
  }
  absl::Status fd = ProbeHandleType(driver, device, granularity, HandleType::kPosixFd);
  if (absl::IsResourceExhausted(fd)) return DeviceFull(driver, device, HandleType::kPosixFd, fd);
  if (fd.ok()) {
    LogWarningOnce("fabric-fallback", FabricFallbackNote(fabric));
    return HandleType::kPosixFd;
  }
  LogWarningOnce("no-sharing", absl::StrCat("memory is not shareable: fabric: ",
                                            fabric.message(), "; posix_fd: ", fd.message()));
  return HandleType::kNone;
}

}  // namespace vmm
