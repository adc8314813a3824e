// driver_factory.h: chooses the driver backend.
//
// VMM_BACKEND=cuda or VMM_BACKEND=host forces a backend; otherwise the CUDA backend is used
// when libcuda loads and reports at least one device, and the host backend when not.
#ifndef VMM_ALLOCATOR_DRIVER_FACTORY_H_
#define VMM_ALLOCATOR_DRIVER_FACTORY_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "allocator/driver.h"

namespace vmm {

// "cuda" or "host". InvalidArgument for any other name; FailedPrecondition when "cuda" is asked
// for and no CUDA driver or device is present.
absl::StatusOr<Driver*> DriverByName(absl::string_view name);

// The driver of `backend`. FailedPrecondition for kCuda when no CUDA driver or device is present.
absl::StatusOr<Driver*> DriverFor(Backend backend);

// The best available backend (see the file comment). Never fails for lack of a GPU.
absl::StatusOr<Driver*> DefaultDriver();

// DefaultDriver()'s answer where giving it loads nothing: Unavailable where the CUDA driver
// would have to be loaded first (cuInit, which a program may mean to run only after a fork or
// once CUDA_VISIBLE_DEVICES is set). For checks that can wait until the driver is in use.
absl::StatusOr<Driver*> DefaultDriverIfLoaded();

}  // namespace vmm

#endif  // VMM_ALLOCATOR_DRIVER_FACTORY_H_
