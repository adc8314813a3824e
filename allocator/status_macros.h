// status_macros.h: early-return helpers for absl::Status / absl::StatusOr.
//
//   VMM_RETURN_IF_ERROR(driver.Map(ptr, size, handle));
//   VMM_ASSIGN_OR_RETURN(DevPtr base, driver.Reserve(size, alignment));
//
// Both return the failing status unchanged from the enclosing function.
#ifndef VMM_ALLOCATOR_STATUS_MACROS_H_
#define VMM_ALLOCATOR_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define VMM_RETURN_IF_ERROR(expr)                  \
  do {                                             \
    ::absl::Status vmm_status_ = (expr);           \
    if (!vmm_status_.ok()) return vmm_status_;     \
  } while (0)

#define VMM_CONCAT_INNER_(a, b) a##b
#define VMM_CONCAT_(a, b) VMM_CONCAT_INNER_(a, b)

#define VMM_ASSIGN_OR_RETURN(lhs, rexpr) \
  VMM_ASSIGN_OR_RETURN_IMPL_(VMM_CONCAT_(vmm_statusor_, __LINE__), lhs, rexpr)

#define VMM_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                               \
  if (!statusor.ok()) return statusor.status();          \
  lhs = std::move(statusor).value()

#endif  // VMM_ALLOCATOR_STATUS_MACROS_H_
