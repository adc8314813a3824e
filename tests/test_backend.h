// test_backend.h: the one choice of driver backend for the C++ tests.
//
// VMM_TEST_BACKEND names it: unset, empty or "host" is the host backend, "cuda" the CUDA
// backend (the GPU machine's runs; then the CUDA backend must work, it is never skipped).
// Any other value is an error naming the value and the allowed ones, so that a typo fails
// the tests instead of quietly testing the host backend.
//
//   ASSERT_OK_AND_ASSIGN(Driver* driver, TestDriver());
//   ASSERT_OK_AND_ASSIGN(Driver* driver, TestDriver(HostDriverOptions{...}, &owned_));
//   ASSERT_OK_AND_ASSIGN(TestBackend backend, SelectedTestBackend());
#ifndef VMM_TESTS_TEST_BACKEND_H_
#define VMM_TESTS_TEST_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "allocator/driver.h"
#include "allocator/host_driver.h"

namespace vmm {

// The environment variable that selects the backend.
inline constexpr char kTestBackendVariable[] = "VMM_TEST_BACKEND";

enum class TestBackend { kHost, kCuda };

// The backend VMM_TEST_BACKEND selects (read on every call); InvalidArgument for a value
// other than "host" or "cuda".
absl::StatusOr<TestBackend> SelectedTestBackend();

// The selected backend's process-wide driver: GetHostDriver() or the CUDA backend
// (FailedPrecondition, saying VMM_TEST_BACKEND=cuda asked for it, where CUDA is unusable).
// It also sets VMM_BACKEND to that backend's name in this process's environment, so that
// DefaultDriver() and the helper processes a test starts (which inherit the environment and
// use DefaultDriver()) work on the same backend as the test.
absl::StatusOr<Driver*> TestDriver();

// As TestDriver(), but on the host backend a fresh host driver made with `host_options`,
// owned by `*owned`, for tests that need their own capacity or devices (on CUDA the options
// are ignored and `*owned` is left empty).
absl::StatusOr<Driver*> TestDriver(const HostDriverOptions& host_options,
                                   std::unique_ptr<Driver>* owned);

}  // namespace vmm

#endif  // VMM_TESTS_TEST_BACKEND_H_
