// The shared status assertions and matcher (status_matchers.h) on Status and StatusOr.
#include "tests/status_matchers.h"

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest-spi.h"
#include "gtest/gtest.h"

namespace vmm {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

absl::StatusOr<std::unique_ptr<int>> MakeInt(int value) { return std::make_unique<int>(value); }

TEST(StatusMatchersTest, OkAssertionsAcceptStatusAndStatusOr) {
  EXPECT_OK(absl::OkStatus());
  ASSERT_OK(absl::OkStatus());
  EXPECT_OK(absl::StatusOr<int>(3));
  ASSERT_OK(absl::StatusOr<int>(3));
}

TEST(StatusMatchersTest, OkAssertionsReportTheExpressionAndTheStatus) {
  EXPECT_NONFATAL_FAILURE(EXPECT_OK(absl::NotFoundError("gone")), "NOT_FOUND: gone");
  EXPECT_NONFATAL_FAILURE(EXPECT_OK(absl::StatusOr<int>(absl::InternalError("broken"))),
                          "absl::InternalError(\"broken\")");
  EXPECT_FATAL_FAILURE(ASSERT_OK(absl::AbortedError("stop")), "ABORTED: stop");
}

TEST(StatusMatchersTest, AssignMovesTheValueOut) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<int> p, MakeInt(7));
  EXPECT_EQ(*p, 7);
  int n = 0;
  ASSERT_OK_AND_ASSIGN(n, absl::StatusOr<int>(9));
  EXPECT_EQ(n, 9);
}

void AssignFromError() {
  ASSERT_OK_AND_ASSIGN(int n, absl::StatusOr<int>(absl::UnavailableError("no device")));
  (void)n;
}

TEST(StatusMatchersTest, AssignFailsOnAnError) {
  EXPECT_FATAL_FAILURE(AssignFromError(), "UNAVAILABLE: no device");
}

TEST(StatusMatchersTest, StatusIsMatchesCodeAndMessage) {
  const absl::Status s = absl::NotFoundError("the buffer was released");
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kNotFound, HasSubstr("released")));
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kNotFound, "the buffer was released"));
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(s, Not(StatusIs(absl::StatusCode::kInternal)));
  EXPECT_THAT(s, Not(StatusIs(absl::StatusCode::kNotFound, HasSubstr("mapped"))));
  EXPECT_THAT(absl::OkStatus(), StatusIs(absl::StatusCode::kOk));

  const absl::StatusOr<int> failed = absl::InvalidArgumentError("bad size");
  EXPECT_THAT(failed, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("size")));
  EXPECT_THAT(absl::StatusOr<int>(1), StatusIs(absl::StatusCode::kOk));
  EXPECT_THAT(failed, Not(StatusIs(absl::StatusCode::kOk)));
}

TEST(StatusMatchersTest, StatusIsExplainsAMismatch) {
  EXPECT_NONFATAL_FAILURE(
      EXPECT_THAT(absl::InternalError("x"), StatusIs(absl::StatusCode::kNotFound)),
      "whose status is INTERNAL: x");
}

}  // namespace
}  // namespace vmm
