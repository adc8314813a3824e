#include "torch_plugin/block_holds.h"

namespace vmm {

void BlockHolds::Moved(const void* ptr, uint64_t bytes) {
  MutexLock lock(&mu_);
  auto [it, added] = entries_.try_emplace(ptr);
  if (added) tracked_.fetch_add(1, std::memory_order_relaxed);
  moved_bytes_.fetch_add(bytes - it->second.moved, std::memory_order_relaxed);
  it->second.moved = bytes;
}

void BlockHolds::Hold(const void* ptr) {
  MutexLock lock(&mu_);
  auto [it, added] = entries_.try_emplace(ptr);
  if (added) tracked_.fetch_add(1, std::memory_order_relaxed);
  moved_bytes_.fetch_sub(it->second.moved, std::memory_order_relaxed);
  it->second.moved = 0;
  ++it->second.holds;
}

HeldFree BlockHolds::DeferFree(const void* ptr) {
  MutexLock lock(&mu_);
  auto it = entries_.find(ptr);
  if (it == entries_.end()) return HeldFree::kNotHeld;
  if (it->second.holds == 0) {  // moved only: goes now
    Forget(it);
    return HeldFree::kNotHeld;
  }
  if (it->second.freed) return HeldFree::kFreedTwice;
  it->second.freed = true;
  return HeldFree::kDeferred;
}

bool BlockHolds::Release(const void* ptr) {
  MutexLock lock(&mu_);
  auto it = entries_.find(ptr);
  if (it == entries_.end() || it->second.holds == 0) return false;
  if (--it->second.holds != 0) return false;
  const bool freed = it->second.freed;
  Forget(it);
  return freed;
}

void BlockHolds::Forget(std::unordered_map<const void*, Entry>::iterator it) {
  moved_bytes_.fetch_sub(it->second.moved, std::memory_order_relaxed);
  entries_.erase(it);
  tracked_.fetch_sub(1, std::memory_order_relaxed);
}

size_t BlockHolds::held() {
  MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [ptr, entry] : entries_) n += entry.holds != 0 ? 1 : 0;
  return n;
}

size_t BlockHolds::deferred() {
  MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [ptr, entry] : entries_) n += entry.freed ? 1 : 0;
  return n;
}

}  // namespace vmm
