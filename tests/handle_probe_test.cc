// Tests of handle_probe.h: which handle type `auto` resolves to where fabric handles fail,
// and what it says about it.
#include "allocator/handle_probe.h"

#include <cstdlib>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "allocator/forwarding_driver.h"
#include "allocator/host_driver.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace vmm {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr size_t kGranule = 2u << 20;

// A host driver whose creations of fabric-exportable memory fail as `refusal` says (the CUDA
// driver's answer without an IMEX channel is PermissionDenied).
class NoFabricDriver : public ForwardingDriver {
 public:
  NoFabricDriver(Driver* inner, absl::Status refusal)
      : ForwardingDriver(inner), refusal_(std::move(refusal)) {}
  absl::StatusOr<PhysHandle> Create(int d, size_t size, uint32_t types) override {
    if ((types & kFabricBit) != 0) return refusal_;
    return ForwardingDriver::Create(d, size, types);
  }

 private:
  absl::Status refusal_;
};

// The one test of what is printed: LogWarningOnce says it once per process.
TEST(HandleProbeTest, AutoWithoutAnImexChannelUsesFdsAndSaysSoWithoutAnError) {
  unsetenv("VMM_LOG_LEVEL");  // read at the first message: quiet would say nothing
  std::unique_ptr<Driver> host = NewHostDriver();
  NoFabricDriver driver(host.get(), absl::PermissionDeniedError(
                                        "cuMemCreate: CUDA_ERROR_NOT_PERMITTED (operation not "
                                        "permitted)"));
  testing::internal::CaptureStderr();
  absl::StatusOr<HandleType> type = ResolveHandleType(driver, 0, kGranule, HandleRequest::kAuto);
  const std::string said = testing::internal::GetCapturedStderr();
  ASSERT_OK(type);
  EXPECT_EQ(*type, HandleType::kPosixFd);
  EXPECT_THAT(said, HasSubstr("IMEX channel"));
  EXPECT_THAT(said, HasSubstr("POSIX file descriptors"));
  EXPECT_THAT(said, HasSubstr("handle_type=posix_fd"));
  EXPECT_THAT(said, Not(HasSubstr("ERROR")));
  EXPECT_THAT(said, Not(HasSubstr("error")));

  // Said once: a second pool's resolution is silent.
  testing::internal::CaptureStderr();
  ASSERT_OK(ResolveHandleType(driver, 0, kGranule, HandleRequest::kAuto));
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
}

TEST(HandleProbeTest, FabricAskedForWithoutAnImexChannelFailsNamingTheCause) {
  std::unique_ptr<Driver> host = NewHostDriver();
  NoFabricDriver driver(host.get(), absl::PermissionDeniedError("no IMEX channel"));
  absl::StatusOr<HandleType> type =
      ResolveHandleType(driver, 0, kGranule, HandleRequest::kFabric);
  EXPECT_EQ(type.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(type.status().message(), HasSubstr("no IMEX channel"));
  ASSERT_OK_AND_ASSIGN(HandleType fd, ResolveHandleType(driver, 0, kGranule,
                                                        HandleRequest::kPosixFd));
  EXPECT_EQ(fd, HandleType::kPosixFd);
}

TEST(HandleProbeTest, AFullDeviceChoosesNothing) {
  std::unique_ptr<Driver> host = NewHostDriver();
  NoFabricDriver driver(host.get(), absl::ResourceExhaustedError("out of memory"));
  absl::StatusOr<HandleType> type = ResolveHandleType(driver, 0, kGranule, HandleRequest::kAuto);
  EXPECT_EQ(type.status().code(), absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace vmm
