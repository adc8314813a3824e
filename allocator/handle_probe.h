// handle_probe.h: which shareable handle type memory of a device can really be created with.
//
// A device may report fabric handles as supported and still refuse to create memory
// exportable as fabric (no IMEX channel): the only reliable test is to create one granule and
// release it. Pools resolve their handle type here once, at creation; the benchmarks use the
// same probe.
//
//   VMM_ASSIGN_OR_RETURN(HandleType type,
//                        ResolveHandleType(driver, device, granularity, HandleRequest::kAuto));
#ifndef VMM_ALLOCATOR_HANDLE_PROBE_H_
#define VMM_ALLOCATOR_HANDLE_PROBE_H_

#include <cstddef>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "allocator/driver.h"

namespace vmm {

// Which handle type a pool's memory is asked to be exportable as.
enum class HandleRequest {
  kAuto,     // fabric if the device can create it (probed), else POSIX fd, else none
  kNone,     // not exportable
  kPosixFd,  // POSIX file descriptors
  kFabric,   // fabric handles; fails when unavailable
};

// "auto", or a handle type name (ParseHandleType); nullopt for any other text.
std::optional<HandleRequest> ParseHandleRequest(absl::string_view name);

// ProbeHandleType creates and releases one granule of `device` exportable as `type`.
// Unimplemented when the device does not support the type at all; otherwise the driver's
// error for the creation (PermissionDenied without an IMEX channel, ResourceExhausted when the
// device is full: such a failure says nothing lasting about the device, so callers that
// remember a result must not remember a failure of that kind).
absl::Status ProbeHandleType(Driver& driver, int device, size_t granularity, HandleType type);

// ResolveHandleType turns a request into the type to create memory with: kNone → kNone; kFabric
// or kPosixFd → that type if the probe passes, else FailedPrecondition naming the cause;
// kAuto → fabric, else POSIX fd (warning once that sharing falls back to fds), else kNone
// (warning once that memory is not shareable). A probe that fails for lack of memory
// (ResourceExhausted) decides nothing: the result is then ResourceExhausted, for every request
// but kNone, rather than a fallback that a pool would keep for good (a pool created while an
// import or another pool fills the device would silently become unshareable). Pool creation
// therefore fails on a full device; creating the pool again once memory is free works.
absl::StatusOr<HandleType> ResolveHandleType(Driver& driver, int device, size_t granularity,
                                             HandleRequest request);

}  // namespace vmm

#endif  // VMM_ALLOCATOR_HANDLE_PROBE_H_
