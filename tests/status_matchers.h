// status_matchers.h: GoogleTest assertions and a gMock matcher for absl::Status and
// absl::StatusOr<T>, shared by every C++ test.
//
//   EXPECT_OK(pool->Free(p));                          // Status or StatusOr
//   ASSERT_OK(driver->Granularity(0));
//   ASSERT_OK_AND_ASSIGN(void* p, pool->Allocate(64, 0));
//   EXPECT_THAT(ImportBuffer(driver, d),
//               StatusIs(absl::StatusCode::kNotFound, HasSubstr("freed")));
//   EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument));   // any message
//
// A failure prints the expression and the status. StatusIs' message matcher is any matcher of
// a std::string, or a string (exact match).
#ifndef VMM_TESTS_STATUS_MATCHERS_H_
#define VMM_TESTS_STATUS_MATCHERS_H_

#include <ostream>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace vmm {
namespace status_matchers_internal {

inline const absl::Status& GetStatus(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

// The predicate-formatter of EXPECT_OK / ASSERT_OK: evaluates the expression once.
template <typename T>
::testing::AssertionResult IsOk(const char* expr_text, const T& status_or) {
  const absl::Status& status = GetStatus(status_or);
  if (status.ok()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << expr_text << ": " << status;
}

class StatusIsMatcher {
 public:
  StatusIsMatcher(absl::StatusCode code, ::testing::Matcher<const std::string&> message)
      : code_(code), message_(std::move(message)) {}

  template <typename T>
  bool MatchAndExplain(const T& value, ::testing::MatchResultListener* listener) const {
    const absl::Status& status = GetStatus(value);
    *listener << "whose status is " << status;
    if (status.code() != code_) return false;
    ::testing::StringMatchResultListener message_listener;
    const bool matched = message_.MatchAndExplain(std::string(status.message()), &message_listener);
    if (!matched && !message_listener.str().empty()) {
      *listener << ", and whose message " << message_listener.str();
    }
    return matched;
  }

  void DescribeTo(std::ostream* os) const {
    *os << "has status code " << absl::StatusCodeToString(code_) << " and a message that ";
    message_.DescribeTo(os);
  }

  void DescribeNegationTo(std::ostream* os) const {
    *os << "has a status code other than " << absl::StatusCodeToString(code_)
        << " or a message that ";
    message_.DescribeNegationTo(os);
  }

 private:
  absl::StatusCode code_;
  ::testing::Matcher<const std::string&> message_;
};

}  // namespace status_matchers_internal

// Matches an absl::Status, or an absl::StatusOr<T>'s status, whose code is `code` and whose
// message matches `message` (a matcher of std::string, or a string for an exact match).
template <typename MessageMatcher>
::testing::PolymorphicMatcher<status_matchers_internal::StatusIsMatcher> StatusIs(
    absl::StatusCode code, MessageMatcher message) {
  return ::testing::MakePolymorphicMatcher(status_matchers_internal::StatusIsMatcher(
      code, ::testing::MatcherCast<const std::string&>(std::move(message))));
}

// Matches a status (or StatusOr) whose code is `code`, whatever its message.
inline ::testing::PolymorphicMatcher<status_matchers_internal::StatusIsMatcher> StatusIs(
    absl::StatusCode code) {
  return StatusIs(code, ::testing::A<const std::string&>());
}

}  // namespace vmm

#define EXPECT_OK(expr) EXPECT_PRED_FORMAT1(::vmm::status_matchers_internal::IsOk, expr)
#define ASSERT_OK(expr) ASSERT_PRED_FORMAT1(::vmm::status_matchers_internal::IsOk, expr)

// Evaluates `rexpr` (a StatusOr), fails the test (returning from the function) unless it is OK,
// and else moves its value into `lhs`, which may be a declaration: ASSERT_OK_AND_ASSIGN(auto p,
// ...). As with ASSERT_*, only in functions returning void.
#define ASSERT_OK_AND_ASSIGN(lhs, rexpr)                                                         \
  VMM_ASSERT_OK_AND_ASSIGN_IMPL_(VMM_STATUS_MATCHERS_CONCAT_(vmm_statusor_, __LINE__), lhs, \
                                 rexpr)

#define VMM_STATUS_MATCHERS_CONCAT_INNER_(a, b) a##b
#define VMM_STATUS_MATCHERS_CONCAT_(a, b) VMM_STATUS_MATCHERS_CONCAT_INNER_(a, b)
#define VMM_ASSERT_OK_AND_ASSIGN_IMPL_(statusor, lhs, rexpr)           \
  auto statusor = (rexpr);                                             \
  ASSERT_TRUE(statusor.ok()) << #rexpr << ": " << statusor.status(); \
  lhs = std::move(statusor).value()

#endif  // VMM_TESTS_STATUS_MATCHERS_H_
