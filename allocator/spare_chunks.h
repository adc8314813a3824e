// spare_chunks.h: the exported chunks a pool keeps for reuse once every receiver is gone
// (pool.h, "Reusing exported chunks"), by size and by age (internal to the pool).
//
// A miss of the large arena and every shareable allocation ask for the smallest spare chunk
// that fits; a trim releases the oldest first. Both were scans of a list: a program that sent
// 10,000 tensors in chunks of their own, all received and dropped, paid 387 µs at each such
// allocation afterwards. Here a fit is a lookup in a size-ordered map, and taking the oldest
// is the front of an age-ordered one. Not thread safe: the pool's mutex guards it.
#ifndef VMM_ALLOCATOR_SPARE_CHUNKS_H_
#define VMM_ALLOCATOR_SPARE_CHUNKS_H_

#include <cstddef>
#include <cstdint>
#include <utility>

#include "absl/container/btree_map.h"
#include "absl/container/flat_hash_map.h"

namespace vmm {

class SpareChunks {
 public:
  // Files the chunk at `addr` of `size` bytes. Returns false (filing nothing) if it is filed
  // already.
  bool Add(uintptr_t addr, size_t size) {
    const uint64_t seq = next_seq_++;
    if (!seq_of_.emplace(addr, seq).second) return false;
    by_size_.emplace(std::make_pair(size, ~seq), addr);  // of equal sizes, the newest first
    by_age_.emplace(seq, std::make_pair(addr, size));
    bytes_ += size;
    return true;
  }

  // Takes out the smallest chunk of at least `n` and at most `n + max_slack` bytes (of equal
  // sizes, the one filed last): its address, or 0 when none fits so.
  uintptr_t TakeFit(size_t n, size_t max_slack) {
    const auto it = by_size_.lower_bound(std::make_pair(n, uint64_t{0}));
    if (it == by_size_.end() || it->first.first - n > max_slack) return 0;
    const uintptr_t addr = it->second;
    Erase(addr, ~it->first.second, it->first.first);
    return addr;
  }

  // Takes out the chunk filed first: its address and size, or {0, 0} when there is none.
  std::pair<uintptr_t, size_t> TakeOldest() {
    if (by_age_.empty()) return {0, 0};
    const auto [seq, chunk] = *by_age_.begin();
    Erase(chunk.first, seq, chunk.second);
    return chunk;
  }

  bool Contains(uintptr_t addr) const { return seq_of_.contains(addr); }
  bool empty() const { return seq_of_.empty(); }
  size_t count() const { return seq_of_.size(); }
  size_t bytes() const { return bytes_; }

 private:
  void Erase(uintptr_t addr, uint64_t seq, size_t size) {
    by_size_.erase(std::make_pair(size, ~seq));
    by_age_.erase(seq);
    seq_of_.erase(addr);
    bytes_ -= size;
  }

  absl::btree_map<std::pair<size_t, uint64_t>, uintptr_t> by_size_;  // (size, ~seq) -> addr
  absl::btree_map<uint64_t, std::pair<uintptr_t, size_t>> by_age_;   // seq -> (addr, size)
  absl::flat_hash_map<uintptr_t, uint64_t> seq_of_;                  // addr -> seq
  uint64_t next_seq_ = 0;
  size_t bytes_ = 0;
};

}  // namespace vmm

#endif  // VMM_ALLOCATOR_SPARE_CHUNKS_H_
