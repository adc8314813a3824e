#include "allocator/free_blocks.h"

#include <algorithm>

namespace vmm {

FreeBlocks::FreeBlocks() = default;
FreeBlocks::~FreeBlocks() = default;

std::vector<Block*> FreeBlocks::BlocksOf(Stream stream) const {
  std::vector<Block*> out;
  if (const Bins* bins = Find(stream)) {
    out.reserve(bins->count);
    ForEachIn(*bins, 0, [&](Block* b) { out.push_back(b); });
  }
  return out;
}

FreeBlocks::Bins& FreeBlocks::AddTag(Stream stream) {
  if (tags_.size() >= sweep_at_) {
    // Nothing points at an empty tag's bins (a block in the set points at its own).
    const auto empty = [&](const std::unique_ptr<Bins>& bins) {
      return bins->count == 0 && bins.get() != any_;
    };
    for (const auto& bins : tags_) {
      if (empty(bins)) by_stream_.erase(bins->stream);
    }
    if (last_ != nullptr && last_->count == 0 && last_ != any_) last_ = nullptr;
    tags_.erase(std::remove_if(tags_.begin(), tags_.end(), empty), tags_.end());
    sweep_at_ = std::max(kMinSweep, 2 * tags_.size());
  }
  tags_.push_back(std::make_unique<Bins>());
  Bins* bins = tags_.back().get();
  bins->stream = stream;
  by_stream_.emplace(stream, bins);
  if (stream == kAnyStream) any_ = bins;
  return *bins;
}

size_t FreeBlocks::Largest() const {
  size_t largest = 0;
  for (const auto& bins : tags_) {
    if (bins->count == 0) continue;
    const int first = 63 - __builtin_clzll(bins->first_map);
    const int bin = first * kSecond + (31 - __builtin_clz(bins->second_map[first]));
    // Below 2 * kSecond units (32 KiB) a bin holds blocks of one size.
    const bool one_size = bin < 2 * kSecond;
    for (const Block* b = bins->heads[bin]; b != nullptr; b = one_size ? nullptr : b->free_next) {
      largest = std::max(largest, b->size);
    }
  }
  return largest;
}

bool FreeBlocks::Filed(const Block* block) const {
  const Bins* bins = Find(block->stream);
  const int bin = BinOf(block->size);
  if (bins == nullptr || block->free_bins != bins || block->free_bin != bin) return false;
  for (const Block* b = bins->heads[bin]; b != nullptr; b = b->free_next) {
    if (b == block) return true;
  }
  return false;
}

}  // namespace vmm
