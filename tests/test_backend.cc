#include "tests/test_backend.h"

#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "allocator/driver_factory.h"
#include "allocator/status_macros.h"

namespace vmm {
namespace {

absl::string_view Name(TestBackend backend) {
  return backend == TestBackend::kCuda ? "cuda" : "host";
}

// The selected backend's process-wide driver, and VMM_BACKEND set to its name.
absl::StatusOr<Driver*> SharedDriver(TestBackend backend) {
  absl::StatusOr<Driver*> driver = DriverByName(Name(backend));
  if (!driver.ok()) {
    return absl::Status(driver.status().code(),
                        absl::StrCat(kTestBackendVariable, "=", Name(backend),
                                     " but that backend is unusable here: ",
                                     driver.status().message()));
  }
  ::setenv("VMM_BACKEND", std::string(Name(backend)).c_str(), /*overwrite=*/1);
  return driver;
}

}  // namespace

absl::StatusOr<TestBackend> SelectedTestBackend() {
  const char* value = std::getenv(kTestBackendVariable);
  if (value == nullptr || value[0] == '\0') return TestBackend::kHost;
  const absl::string_view name = value;
  if (name == "host") return TestBackend::kHost;
  if (name == "cuda") return TestBackend::kCuda;
  return absl::InvalidArgumentError(absl::StrCat(kTestBackendVariable, "=\"", name,
                                                 "\" is not a backend; allowed: host (the "
                                                 "default when unset), cuda"));
}

absl::StatusOr<Driver*> TestDriver() {
  VMM_ASSIGN_OR_RETURN(TestBackend backend, SelectedTestBackend());
  return SharedDriver(backend);
}

absl::StatusOr<Driver*> TestDriver(const HostDriverOptions& host_options,
                                   std::unique_ptr<Driver>* owned) {
  VMM_ASSIGN_OR_RETURN(TestBackend backend, SelectedTestBackend());
  if (backend == TestBackend::kCuda) return SharedDriver(backend);
  ::setenv("VMM_BACKEND", "host", /*overwrite=*/1);
  *owned = NewHostDriver(host_options);
  return owned->get();
}

}  // namespace vmm
