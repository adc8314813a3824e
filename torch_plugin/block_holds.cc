#include "torch_plugin/block_holds.h"

namespace vmm {

void BlockHolds::Hold(const void* ptr) {
  MutexLock lock(&mu_);
  Entry& entry = entries_[ptr];
  if (entry.holds++ == 0) held_.fetch_add(1, std::memory_order_relaxed);
}

bool BlockHolds::DeferFree(const void* ptr) {
  MutexLock lock(&mu_);
  auto it = entries_.find(ptr);
  if (it == entries_.end()) return false;
  it->second.freed = true;
  return true;
}

bool BlockHolds::Release(const void* ptr) {
  MutexLock lock(&mu_);
  auto it = entries_.find(ptr);
  if (it == entries_.end()) return false;
  if (--it->second.holds != 0) return false;
  const bool freed = it->second.freed;
  entries_.erase(it);
  held_.fetch_sub(1, std::memory_order_relaxed);
  return freed;
}

size_t BlockHolds::held() {
  MutexLock lock(&mu_);
  return entries_.size();
}

size_t BlockHolds::deferred() {
  MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [ptr, entry] : entries_) n += entry.freed ? 1 : 0;
  return n;
}

}  // namespace vmm
