#include "allocator/growth_policy.h"

#include <algorithm>

namespace vmm {

size_t GrowthExtra(const PoolOptions& options, const GrowthRequest& request) {
  if (request.small_arena) {
    return options.small_chunk > request.needed ? options.small_chunk - request.needed : 0;
  }
  if (request.paged) return 0;
  const double quantum = options.growth_fraction * static_cast<double>(request.reserved);
  const size_t extra = std::min(options.max_growth_extra, static_cast<size_t>(quantum));
  return extra / request.granularity * request.granularity;
}

size_t PlanUnit(size_t large_page, size_t granularity) {
  const size_t half = large_page / 2;
  return half != 0 && half % granularity == 0 ? half : large_page;
}

}  // namespace vmm
