// byte_pattern.h: the bytes the demo fills its buffer with and `vmm_peer import
// --expect=pattern` checks. Byte i is (31 i + 7) mod 256, so that a mapping at the wrong
// offset, or pieces in the wrong order, show as wrong bytes.
#ifndef VMM_TOOLS_BYTE_PATTERN_H_
#define VMM_TOOLS_BYTE_PATTERN_H_

#include <cstddef>
#include <cstdint>

namespace vmm {

inline uint8_t PatternByte(size_t i) { return static_cast<uint8_t>(i * 31 + 7); }

}  // namespace vmm

#endif  // VMM_TOOLS_BYTE_PATTERN_H_
