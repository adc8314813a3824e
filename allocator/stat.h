// stat.h: one statistic with PyTorch's meanings, {current, peak, allocated, freed}:
// `allocated` and `freed` are the cumulative increases and decreases (current == allocated -
// freed), `peak` the highest `current` since the last reset. Plain C++ with no dependencies,
// so that code built outside this project's build (the LibTorch extension's
// foreign_segments.h) shares it with the pool's statistics (stats.h). Not thread safe.
#ifndef VMM_ALLOCATOR_STAT_H_
#define VMM_ALLOCATOR_STAT_H_

#include <algorithm>
#include <cstdint>

namespace vmm {

struct Stat {
  int64_t current = 0;
  int64_t peak = 0;
  int64_t allocated = 0;
  int64_t freed = 0;

  void Increase(int64_t n) {
    current += n;
    allocated += n;
    peak = std::max(peak, current);
  }
  void Decrease(int64_t n) {
    current -= n;
    freed += n;
  }
  void ResetPeak() { peak = current; }
  void ResetAccumulated() { allocated = freed = 0; }
};

// Holds the peak of `part` (an arena's share, requested bytes) no higher than that of
// `whole`, and no lower than its own current value: a part summed over pools peaks at the sum
// of their peaks, which may pass the whole's joint peak. For vmm::Stat and PyTorch's Stat alike.
template <typename S>
void HoldPeakWithin(S& part, const S& whole) {
  part.peak = std::max(std::min(part.peak, whole.peak), part.current);
}

}  // namespace vmm

#endif  // VMM_ALLOCATOR_STAT_H_
