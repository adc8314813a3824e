#include "allocator/driver_error.h"

#include <string>
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/types/optional.h"

namespace vmm {
namespace {

// The payload's type URL and its form: the code's four bytes, little-endian.
constexpr absl::string_view kDriverErrorUrl = "type.vmm/driver_error";

}  // namespace

absl::Status WithDriverError(absl::Status status, int32_t driver_error) {
  if (status.ok() || driver_error == 0) return status;
  const uint32_t value = static_cast<uint32_t>(driver_error);
  char bytes[4];
  for (int i = 0; i < 4; ++i) bytes[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  status.SetPayload(kDriverErrorUrl, absl::Cord(absl::string_view(bytes, sizeof(bytes))));
  return status;
}

int32_t DriverErrorOf(const absl::Status& status) {
  if (status.ok()) return 0;
  const absl::optional<absl::Cord> payload = status.GetPayload(kDriverErrorUrl);
  if (!payload.has_value() || payload->size() != 4) return 0;
  const std::string bytes(*payload);
  uint32_t value = 0;
  for (int i = 0; i < 4; ++i) {
    value |= static_cast<uint32_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
  }
  return static_cast<int32_t>(value);
}

absl::Status WithContext(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  absl::Status out(status.code(), absl::StrCat(context, ": ", status.message()));
  status.ForEachPayload(
      [&out](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

}  // namespace vmm
