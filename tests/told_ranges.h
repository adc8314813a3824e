// told_ranges.h: a MappingListener (allocator/mapping_listener.h) for tests: it keeps the
// ranges it was told are mapped, merged, and notes every call that contradicts them (a range
// mapped twice, one unmapped that was not mapped, a source other than the one expected).
#ifndef VMM_TESTS_TOLD_RANGES_H_
#define VMM_TESTS_TOLD_RANGES_H_

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "allocator/mapping_listener.h"

namespace vmm {

class ToldRanges : public MappingListener {
 public:
  explicit ToldRanges(MappingSource expected = {}) : expected_(expected) {}

  void RangeMapped(const MappingSource& source, uintptr_t addr, size_t size,
                   bool mapped) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++calls_;
    if (source.device != expected_.device || source.owner[0] != expected_.owner[0] ||
        source.owner[1] != expected_.owner[1]) {
      errors_.push_back(absl::StrCat("a range of device ", source.device, " owner ",
                                     source.owner[0], "/", source.owner[1]));
    }
    const uintptr_t end = addr + size;
    if (size == 0) {
      errors_.push_back(absl::StrCat("an empty range at ", absl::Hex(addr)));
      return;
    }
    if (mapped) {
      auto next = ranges_.lower_bound(addr);
      if ((next != ranges_.end() && next->first < end) ||
          (next != ranges_.begin() && std::prev(next)->second > addr)) {
        errors_.push_back(absl::StrCat("mapped twice: ", absl::Hex(addr), "+", size));
        return;
      }
      uintptr_t lo = addr, hi = end;
      if (next != ranges_.begin() && std::prev(next)->second == addr) {
        lo = std::prev(next)->first;
        ranges_.erase(std::prev(next));
      }
      if (next != ranges_.end() && next->first == end) {
        hi = next->second;
        ranges_.erase(next);
      }
      ranges_[lo] = hi;
      bytes_ += size;
      return;
    }
    auto it = ranges_.upper_bound(addr);
    if (it == ranges_.begin() || std::prev(it)->second < end) {
      errors_.push_back(absl::StrCat("unmapped but not mapped: ", absl::Hex(addr), "+", size));
      return;
    }
    --it;
    const uintptr_t lo = it->first, hi = it->second;
    ranges_.erase(it);
    if (lo < addr) ranges_[lo] = addr;
    if (end < hi) ranges_[end] = hi;
    bytes_ -= size;
  }

  // Takes [addr, addr + size) as mapped without being told (what a pool held before).
  void Seed(uintptr_t addr, size_t size) {
    RangeMapped(expected_, addr, size, /*mapped=*/true);
    std::lock_guard<std::mutex> lock(mu_);
    --calls_;
  }

  // The ranges told mapped and not unmapped since, merged: start -> end.
  std::map<uintptr_t, uintptr_t> ranges() const {
    std::lock_guard<std::mutex> lock(mu_);
    return ranges_;
  }
  size_t bytes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return bytes_;
  }
  int64_t calls() const {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }
  std::vector<std::string> errors() const {
    std::lock_guard<std::mutex> lock(mu_);
    return errors_;
  }

  // `chunks` (start -> size, by address) merged as ranges() merges.
  static std::map<uintptr_t, uintptr_t> Merge(const std::map<uintptr_t, size_t>& chunks) {
    std::map<uintptr_t, uintptr_t> out;
    for (const auto& [addr, size] : chunks) {
      if (!out.empty() && std::prev(out.end())->second == addr) {
        std::prev(out.end())->second = addr + size;
      } else {
        out[addr] = addr + size;
      }
    }
    return out;
  }

 private:
  const MappingSource expected_;
  mutable std::mutex mu_;
  std::map<uintptr_t, uintptr_t> ranges_;
  size_t bytes_ = 0;
  int64_t calls_ = 0;
  std::vector<std::string> errors_;
};

}  // namespace vmm

#endif  // VMM_TESTS_TOLD_RANGES_H_
