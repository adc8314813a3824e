#include "allocator/byte_size.h"

#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace vmm {

absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text) {
  absl::string_view value = absl::StripAsciiWhitespace(text);
  auto invalid = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", text, "' is not a size in bytes (a whole number with an optional K, M, G or T "
        "suffix, e.g. 512M)"));
  };
  // Optional "B" or "iB" after a unit letter; a bare trailing "B" means bytes.
  if (absl::EndsWithIgnoreCase(value, "ib")) {
    value.remove_suffix(2);
    if (value.empty() || absl::ascii_isdigit(value.back())) return invalid();
  } else if (absl::EndsWithIgnoreCase(value, "b")) {
    value.remove_suffix(1);
  }
  int shift = 0;
  if (!value.empty()) {
    switch (absl::ascii_toupper(value.back())) {
      case 'K': shift = 10; break;
      case 'M': shift = 20; break;
      case 'G': shift = 30; break;
      case 'T': shift = 40; break;
      default: break;
    }
    if (shift != 0) value.remove_suffix(1);
  }
  if (value.empty() || !absl::ascii_isdigit(value.front())) return invalid();
  for (char c : value) {
    if (!absl::ascii_isdigit(c)) return invalid();
  }
  uint64_t n = 0;
  if (!absl::SimpleAtoi(value, &n)) return invalid();
  if (shift != 0 && n > (UINT64_MAX >> shift)) return invalid();
  return n << shift;
}

std::string FormatBytes(int64_t n) {
  const uint64_t magnitude = n < 0 ? 0 - static_cast<uint64_t>(n) : static_cast<uint64_t>(n);
  const char* sign = n < 0 ? "-" : "";
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  if (magnitude < 1024) return absl::StrCat(sign, magnitude, " B");
  int unit = 0;
  double value = static_cast<double>(magnitude) / 1024;
  while (unit < 4 && value >= 1024) {
    value /= 1024;
    ++unit;
  }
  return absl::StrFormat("%s%.2f %s", sign, value, kUnits[unit]);
}

}  // namespace vmm
