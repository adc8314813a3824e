// byte_size.h: the one parser and printer of byte counts ("64M", "1.5G" is not one).
//
//   VMM_ASSIGN_OR_RETURN(uint64_t n, ParseByteSize("512M"));   // 536870912
//   FormatBytes(3 << 20);                                       // "3.00 MiB"
//
// Used by pool options, the demo, the benchmarks and (through the C interface) the Python
// scripts, so that every tool reads sizes the same way.
#ifndef VMM_ALLOCATOR_BYTE_SIZE_H_
#define VMM_ALLOCATOR_BYTE_SIZE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace vmm {

// ParseByteSize reads a non-negative whole number of bytes with an optional suffix K, M, G or
// T (powers of 1024, either case; a trailing "B" or "iB" is accepted: "64MiB", "2KB").
// Surrounding whitespace is ignored. InvalidArgument, naming the text, for anything else:
// empty text, signs, fractions, unknown suffixes, or a value that does not fit in 64 bits.
[[nodiscard]] absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text);

// FormatBytes prints `n` for people: "512 B", "4.00 KiB", "1.50 GiB" (two decimals from KiB
// on, the largest unit not above n). Negative counts keep their sign.
std::string FormatBytes(int64_t n);

}  // namespace vmm

#endif  // VMM_ALLOCATOR_BYTE_SIZE_H_
