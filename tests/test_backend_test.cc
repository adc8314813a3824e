// The backend selector of the C++ tests (test_backend.h): VMM_TEST_BACKEND's values.
#include "tests/test_backend.h"

#include <cstdlib>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "allocator/driver.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/scoped_env.h"
#include "tests/status_matchers.h"

namespace vmm {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// VMM_TEST_BACKEND set to `value` (unset for nullptr) for the scope.
class ScopedTestBackend : public ScopedEnv {
 public:
  explicit ScopedTestBackend(const char* value)
      : ScopedEnv(kTestBackendVariable,
                  value == nullptr ? std::nullopt : std::optional<std::string>(value)) {}
};

TEST(TestBackendTest, UnsetEmptyOrHostIsTheHostBackend) {
  for (const char* value : {static_cast<const char*>(nullptr), "", "host"}) {
    SCOPED_TRACE(value == nullptr ? "unset" : value);
    ScopedTestBackend env(value);
    ASSERT_OK_AND_ASSIGN(TestBackend backend, SelectedTestBackend());
    EXPECT_EQ(backend, TestBackend::kHost);
    ASSERT_OK_AND_ASSIGN(Driver* driver, TestDriver());
    EXPECT_EQ(driver->Name(), "host");
    EXPECT_STREQ(std::getenv("VMM_BACKEND"), "host") << "helper processes get the same backend";
    std::unique_ptr<Driver> owned;
    HostDriverOptions options;
    options.device_count = 2;
    ASSERT_OK_AND_ASSIGN(Driver* own, TestDriver(options, &owned));
    EXPECT_EQ(own, owned.get());
    EXPECT_EQ(own->DeviceCount(), 2);
  }
}

TEST(TestBackendTest, CudaIsTheCudaBackendOrAClearError) {
  ScopedTestBackend env("cuda");
  ASSERT_OK_AND_ASSIGN(TestBackend backend, SelectedTestBackend());
  EXPECT_EQ(backend, TestBackend::kCuda);
  absl::StatusOr<Driver*> driver = TestDriver();
  if (driver.ok()) {
    EXPECT_EQ((*driver)->Name(), "cuda");
    EXPECT_STREQ(std::getenv("VMM_BACKEND"), "cuda");
  } else {
    EXPECT_THAT(driver, StatusIs(absl::StatusCode::kFailedPrecondition,
                                 HasSubstr("VMM_TEST_BACKEND=cuda but")));
  }
}

TEST(TestBackendTest, AnUnknownValueFailsNamingItAndTheAllowedOnes) {
  for (const char* value : {"bogus", "CUDA", "gpu", " host"}) {
    SCOPED_TRACE(value);
    ScopedTestBackend env(value);
    const auto names_the_choice =
        AllOf(HasSubstr(std::string("VMM_TEST_BACKEND=\"") + value + "\""), HasSubstr("host"),
              HasSubstr("cuda"));
    EXPECT_THAT(SelectedTestBackend(),
                StatusIs(absl::StatusCode::kInvalidArgument, names_the_choice));
    EXPECT_THAT(TestDriver(), StatusIs(absl::StatusCode::kInvalidArgument, names_the_choice));
    std::unique_ptr<Driver> owned;
    EXPECT_THAT(TestDriver(HostDriverOptions{}, &owned),
                StatusIs(absl::StatusCode::kInvalidArgument, names_the_choice));
    EXPECT_EQ(owned, nullptr);
  }
}

}  // namespace
}  // namespace vmm
