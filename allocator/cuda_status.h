// cuda_status.h: how the CUDA backend turns a CUresult into an absl::Status.
//
// Internal to the CUDA backend (cuda_driver.cc), exposed so that the mapping can be unit-tested
// on machines without a driver. The error's name and description come from the driver
// (cuGetErrorName / cuGetErrorString) and are passed in, so nothing here calls CUDA.
//
//   CudaErrorStatus(CUDA_ERROR_OUT_OF_MEMORY, "cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY",
//                   "out of memory", "device 0, 2097152 bytes")
//   => ResourceExhausted("cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY (out of memory); device 0, ...")
//      carrying the CUresult (2) as its driver error (driver_error.h)
#ifndef VMM_ALLOCATOR_CUDA_STATUS_H_
#define VMM_ALLOCATOR_CUDA_STATUS_H_

#include <cuda.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace vmm {

// The status code that a failing CUresult stands for (the meanings of driver.h):
//   CUDA_ERROR_OUT_OF_MEMORY                                   -> kResourceExhausted
//   CUDA_ERROR_INVALID_VALUE, _INVALID_HANDLE, _INVALID_DEVICE,
//   CUDA_ERROR_NOT_FOUND                                       -> kInvalidArgument
//   CUDA_ERROR_NOT_PERMITTED                                   -> kPermissionDenied
//   CUDA_ERROR_NOT_SUPPORTED                                   -> kUnimplemented
//   CUDA_ERROR_NOT_INITIALIZED, _DEINITIALIZED, _NO_DEVICE     -> kFailedPrecondition
//   CUDA_ERROR_CAPTURED_EVENT, _STREAM_CAPTURE_* (not now: a
//   stream captures a CUDA graph)                              -> kUnavailable
//   anything else                                              -> kInternal
// CUDA_SUCCESS gives kOk.
absl::StatusCode CudaErrorCode(CUresult result);

// The status for `result` returned by `call` (a driver function name such as "cuMemMap"):
// "<call>: <error_name> (<description>)", followed by "; <context>" when `context` is not empty.
// It carries `result` as its driver error (DriverErrorOf). OkStatus() for CUDA_SUCCESS.
absl::Status CudaErrorStatus(CUresult result, absl::string_view call, absl::string_view error_name,
                             absl::string_view description, absl::string_view context = {});

}  // namespace vmm

#endif  // VMM_ALLOCATOR_CUDA_STATUS_H_
