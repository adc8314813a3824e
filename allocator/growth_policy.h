// growth_policy.h: how much a pool maps when a request misses the cache (internal to the pool).
//
// The pool first plans the fewest new bytes that give the request a contiguous fit
// (Arena::PlanGrowth: a free block at the edge of a gap is extended rather than left beside a
// new chunk). The policy then says how many bytes to map beyond that, trading a little memory
// for fewer driver calls. If mapping the larger range fails, the pool retries with exactly
// what the request needs, so a policy can never cause an out-of-memory error.
//
// Policy today:
//   - small arena: `small_chunk` at a time (where the large arena grows in pages, the free
//     chunks a miss moves into it count towards it: reclaim_policy.h);
//   - large arena: `growth_fraction` of the bytes already reserved, capped at
//     `max_growth_extra`, rounded down to granularity (growth_fraction 0: exact growth);
//   - large arena in pages (large_page set): exact growth. Extra pages would only be free
//     memory that the next misses take by moving anyway (reclaim_policy.h), and they would
//     show in peak reserved; the chunks they would come in cost their driver calls either way.
//     The exact amount is planned in half pages (PlanUnit; the page itself where half a page
//     is not whole granules): a growth's last chunk, what is left after its pages (or
//     chunks of several pages, growth_page), may end in half a page. The free rest of a
//     request's last chunk shares it with the request and can move only when the request is
//     gone: at most half a page instead of a page strands less (host replay of the trace suite,
//     seeds 0-27, 8 MiB pages: peak reserved / peak allocated over 1.02 in 2 of 168 replays
//     instead of 9, worst 1.0203 instead of 1.0225; mean driver calls per trace -17% to +10%).
//     Quarter pages (2 MiB) did worse on rl_phases and inference_varying. Where the plan in
//     half pages would create more than a memory limit or a fraction leaves, the pool plans
//     the request to granularity instead (Pool::Grow), so the rounding fails no request.
// A new policy is a new implementation of GrowthExtra (and PlanUnit) in this file.
#ifndef VMM_ALLOCATOR_GROWTH_POLICY_H_
#define VMM_ALLOCATOR_GROWTH_POLICY_H_

#include <cstddef>

#include "allocator/pool_options.h"

namespace vmm {

struct GrowthRequest {
  bool small_arena = false;  // growing the small arena
  size_t needed = 0;         // bytes the plan covers at least, the chunks moved into it
                             // included (multiple of granularity)
  size_t reserved = 0;       // bytes the pool holds now
  size_t granularity = 0;
  bool paged = false;        // the large arena grows in large_page chunks (reclaim_policy.h)
};

// GrowthExtra returns the bytes to map beyond `request.needed` (a multiple of granularity).
size_t GrowthExtra(const PoolOptions& options, const GrowthRequest& request);

// The unit a growth of the large arena in pages of `large_page` bytes (a multiple of
// `granularity`, not 0) is planned in: half a page where that is a whole number of granules,
// else the page (one granule, or an odd number of them). It always divides the page.
size_t PlanUnit(size_t large_page, size_t granularity);

}  // namespace vmm

#endif  // VMM_ALLOCATOR_GROWTH_POLICY_H_
