// cuda_driver.h: the CUDA backend of the driver interface (driver.h).
//
// libcuda.so.1 is opened at run time (dlopen) and every entry point is looked up once through
// cuGetProcAddress, so vmm builds and runs on machines without a driver. Calls that need a
// context make the primary context of the device current for their duration (the context PyTorch
// and the CUDA runtime use), and restore what was current before.
//
// Every failing CUresult becomes an absl::Status naming the call and the CUDA error name, e.g.
// "cuMemMap: CUDA_ERROR_INVALID_VALUE (invalid argument)", with the code chosen by meaning
// (driver.h). A machine without libcuda gets FailedPrecondition("no CUDA driver: ...").
#ifndef VMM_ALLOCATOR_CUDA_DRIVER_H_
#define VMM_ALLOCATOR_CUDA_DRIVER_H_

#include "absl/status/statusor.h"
#include "allocator/driver.h"

namespace vmm {

// Returns the process-wide CUDA backend, loading and initialising the driver on first use.
// FailedPrecondition when libcuda.so.1 cannot be loaded, cuInit fails, or there is no device.
absl::StatusOr<Driver*> GetCudaDriver();
// What GetCudaDriver() gave, or nullptr where it has not been called yet: asks nothing of
// CUDA (no cuInit), for callers that must not be the first to load the driver.
const absl::StatusOr<Driver*>* LoadedCudaDriver();

}  // namespace vmm

#endif  // VMM_ALLOCATOR_CUDA_DRIVER_H_
