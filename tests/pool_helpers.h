// pool_helpers.h: creating pools and allocating from them in tests, failing the test (not
// crashing it) on an error: a null pool or pointer comes back instead.
#ifndef VMM_TESTS_POOL_HELPERS_H_
#define VMM_TESTS_POOL_HELPERS_H_

#include <cstddef>
#include <memory>
#include <utility>

#include "allocator/driver.h"
#include "allocator/export_observer.h"
#include "allocator/pool.h"
#include "gtest/gtest.h"

namespace vmm {

// Options for tests that predict where blocks go and what the pool maps: growth in single
// chunks for good (large_page off and no switch to pages near capacity, pressure_page: no
// pages moved, reclaim_test covers those) and a small arena of requests up to 1 MiB.
inline PoolOptions SingleChunkOptions() {
  PoolOptions options;
  options.large_page = 0;
  options.pressure_page = 0;
  options.small_size = size_t{1} << 20;
  return options;
}

// Pool::Create, or null (the test failed).
inline std::unique_ptr<Pool> CreatePoolOrFail(Driver* driver, const PoolOptions& options,
                                              ExportObserver* observer = nullptr) {
  auto pool = Pool::Create(driver, options, observer);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? std::move(*pool) : nullptr;
}

// Pool::Allocate, or null (the test failed).
inline void* AllocateOrFail(Pool& pool, size_t size, Stream stream = 0) {
  auto p = pool.Allocate(size, stream);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *p : nullptr;
}

}  // namespace vmm

#endif  // VMM_TESTS_POOL_HELPERS_H_
