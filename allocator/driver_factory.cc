#include "allocator/driver_factory.h"

#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "allocator/cuda_driver.h"
#include "allocator/host_driver.h"
#include "allocator/log.h"

namespace vmm {

absl::StatusOr<Driver*> DriverByName(absl::string_view name) {
  if (name == "cuda") return GetCudaDriver();
  if (name == "host") return GetHostDriver();
  return absl::InvalidArgumentError(
      absl::StrCat("unknown driver backend \"", name, "\"; valid names: cuda, host"));
}

absl::StatusOr<Driver*> DriverFor(Backend backend) {
  return backend == Backend::kHost ? GetHostDriver() : GetCudaDriver();
}

namespace {

// DefaultDriver(), or, where `may_load` is false and the CUDA driver has not been asked for
// yet, Unavailable.
absl::StatusOr<Driver*> ChooseDefaultDriver(bool may_load) {
  // Read on every call (not cached), so a process or test may change it between calls.
  const char* forced = std::getenv("VMM_BACKEND");
  const bool forced_any = forced != nullptr && forced[0] != '\0';
  const bool needs_cuda = !forced_any || absl::string_view(forced) == "cuda";
  if (needs_cuda && !may_load && LoadedCudaDriver() == nullptr) {
    return absl::UnavailableError("the CUDA driver is not loaded yet");
  }
  if (forced_any) {
    absl::StatusOr<Driver*> driver = DriverByName(forced);
    if (!driver.ok()) {
      return absl::Status(driver.status().code(),
                          absl::StrCat("VMM_BACKEND=", forced, ": ", driver.status().message()));
    }
    return driver;
  }
  absl::StatusOr<Driver*> cuda = GetCudaDriver();
  if (cuda.ok()) return cuda;
  // No driver or no GPU is the ordinary case on a machine without one and goes unmentioned; a
  // driver that is present but unusable deserves a word, since the memory is then host memory.
  const absl::string_view why = cuda.status().message();
  if (!absl::StartsWith(why, "no CUDA driver: libcuda.so.1 could not be loaded") &&
      !absl::StartsWith(why, "no CUDA device: cuInit: CUDA_ERROR_NO_DEVICE")) {
    LogWarningOnce("vmm-cuda-unavailable",
                   absl::StrCat("CUDA backend unavailable (", why, "); using the host backend"));
  }
  return GetHostDriver();
}

}  // namespace

absl::StatusOr<Driver*> DefaultDriver() { return ChooseDefaultDriver(/*may_load=*/true); }

absl::StatusOr<Driver*> DefaultDriverIfLoaded() { return ChooseDefaultDriver(/*may_load=*/false); }

}  // namespace vmm
