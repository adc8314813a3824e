// block.h: the pool's unit of bookkeeping, a contiguous piece of one arena's address range.
//
// Every byte of an arena's reserved range belongs to exactly one Block, and the Blocks of an
// arena form a doubly linked list in address order (prev/next), so neighbours are found in
// constant time and free space coalesces across physical chunk boundaries. A Block is in one
// of these states:
//   kUnmapped     no physical memory behind it (a gap the pool can grow into);
//   kFree         mapped and cached, in the FreeBlocks set, reusable by `stream` (or any
//                 stream when stream == kAnyStream);
//   kAllocated    handed out to a caller;
//   kPendingFree  freed by the caller but still in use by other streams (record_stream):
//                 waiting for `pending_events` events to complete;
//   kRetired      freed inside a chunk that has been exported: never reused, released to the
//                 driver with its chunk (the export invariant).
#ifndef VMM_ALLOCATOR_BLOCK_H_
#define VMM_ALLOCATOR_BLOCK_H_

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "allocator/driver.h"

namespace vmm {

// Tag of a free block that any stream may take: the work that used it has completed.
inline constexpr Stream kAnyStream = std::numeric_limits<Stream>::max();
// Whether `s` is a foreign stream (driver.h, kForeignStreamBit).
inline constexpr bool IsForeignStream(Stream s) {
  return s != kAnyStream && (s & kForeignStreamBit) != 0;
}
// A block's stream as snapshots report it: the stream itself, without the foreign mark.
inline constexpr Stream ReportedStream(Stream s) {
  return s == kAnyStream ? kAnyStream : StreamHandle(s);
}

enum class BlockState : uint8_t { kUnmapped, kFree, kAllocated, kPendingFree, kRetired };

const char* BlockStateName(BlockState state);

struct Block {
  uintptr_t addr = 0;
  size_t size = 0;
  Block* prev = nullptr;  // address order, same arena
  Block* next = nullptr;
  BlockState state = BlockState::kUnmapped;
  // kAllocated/kPendingFree: the stream it was allocated on. kFree: the stream that may reuse
  // it at once (kAnyStream: every stream).
  Stream stream = kAnyStream;
  // kFree: value of the pool's free counter when it was freed (orders frees against events).
  uint64_t free_seq = 0;
  // kAllocated: bytes the caller asked for.
  size_t requested = 0;
  // kAllocated: other streams that used it (record_stream). kPendingFree: events still due.
  std::vector<Stream> stream_uses;
  int pending_events = 0;
  int free_bin = 0;  // kFree: its bin in its FreeBlocks (below)
  // kFree: links in its FreeBlocks bin, the bin, and the bins of its tag (null: not in a set).
  Block* free_prev = nullptr;
  Block* free_next = nullptr;
  void* free_bins = nullptr;
  size_t free_size = 0;  // its size when the set last filed it (the set's byte count)

  uintptr_t end() const { return addr + size; }
};

}  // namespace vmm

#endif  // VMM_ALLOCATOR_BLOCK_H_
