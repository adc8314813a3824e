// driver_error.h: the driver's own error code, carried inside an absl::Status.
//
// A status made from a failing CUDA driver call (cuda_status.h) carries the call's CUresult
// as a payload beside its absl::StatusCode, so that layers above the pool (the C interface,
// the PyTorch extension) can tell a CUDA error from one of vmm's own and raise what CUDA's
// own callers raise (PyTorch: torch.AcceleratorError with the code) without reading the
// message. The payload survives a status returned unchanged (VMM_RETURN_IF_ERROR); a status
// rebuilt from another's code and message drops it unless built with WithContext.
//
//   absl::Status s = WithDriverError(absl::InternalError("cuMemCreate: ..."), 710);
//   DriverErrorOf(s)  => 710
//   DriverErrorOf(absl::InternalError("vmm's own"))  => 0
#ifndef VMM_ALLOCATOR_DRIVER_ERROR_H_
#define VMM_ALLOCATOR_DRIVER_ERROR_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace vmm {

// `status` with `driver_error` (a CUresult, not 0) attached. An OK status is returned as is.
absl::Status WithDriverError(absl::Status status, int32_t driver_error);

// The driver error `status` carries, or 0 (none: OK, or a failure of vmm's own).
int32_t DriverErrorOf(const absl::Status& status);

// A status of `status`'s code whose message is `context` + ": " + its message, with its
// payloads (the driver error among them).
absl::Status WithContext(const absl::Status& status, absl::string_view context);

}  // namespace vmm

#endif  // VMM_ALLOCATOR_DRIVER_ERROR_H_
