#include "allocator/free_blocks.h"

namespace vmm {

FreeBlocks::FreeBlocks() = default;
FreeBlocks::~FreeBlocks() = default;

int FreeBlocks::BinOf(size_t size) {
  const uint64_t units = size >> 9;  // sizes are multiples of 512
  if (units < kSecond) return static_cast<int>(units);
  const int top = 63 - __builtin_clzll(units);  // >= kSecondBits
  const int first = top - kSecondBits + 1;
  const int second = static_cast<int>((units >> (top - kSecondBits)) & (kSecond - 1));
  return first * kSecond + second;
}

FreeBlocks::Bins* FreeBlocks::Find(Stream stream) const {
  if (last_ != nullptr && last_->stream == stream) return last_;
  for (const auto& bins : tags_) {
    if (bins->stream == stream) return bins.get();
  }
  return nullptr;
}

FreeBlocks::Bins& FreeBlocks::FindOrAdd(Stream stream) {
  Bins* bins = Find(stream);
  if (bins == nullptr) {
    tags_.push_back(std::make_unique<Bins>());
    bins = tags_.back().get();
    bins->stream = stream;
  }
  last_ = bins;
  return *bins;
}

void FreeBlocks::Insert(Block* block) {
  Bins& bins = FindOrAdd(block->stream);
  const int bin = BinOf(block->size);
  block->free_prev = nullptr;
  block->free_next = bins.heads[bin];
  if (block->free_next != nullptr) block->free_next->free_prev = block;
  bins.heads[bin] = block;
  bins.first_map |= uint64_t{1} << (bin / kSecond);
  bins.second_map[bin / kSecond] |= 1u << (bin % kSecond);
  block->free_bins = &bins;
  block->free_bin = bin;
  ++bins.count;
  ++count_;
}

void FreeBlocks::Remove(Block* block) {
  Bins& bins = *static_cast<Bins*>(block->free_bins);
  const int bin = block->free_bin;
  if (block->free_prev != nullptr) {
    block->free_prev->free_next = block->free_next;
  } else {
    bins.heads[bin] = block->free_next;
  }
  if (block->free_next != nullptr) block->free_next->free_prev = block->free_prev;
  if (bins.heads[bin] == nullptr) {
    bins.second_map[bin / kSecond] &= ~(1u << (bin % kSecond));
    if (bins.second_map[bin / kSecond] == 0) bins.first_map &= ~(uint64_t{1} << (bin / kSecond));
  }
  block->free_prev = block->free_next = nullptr;
  block->free_bins = nullptr;
  --bins.count;
  --count_;
}

Block* FreeBlocks::SmallestIn(Block* head, size_t at_least) {
  Block* best = nullptr;
  for (Block* b = head; b != nullptr; b = b->free_next) {
    if (b->size < at_least) continue;
    if (b->size == at_least) {
      if (best == nullptr || best->size != at_least || b->addr < best->addr) best = b;
      continue;
    }
    if (best == nullptr || b->size < best->size || (b->size == best->size && b->addr < best->addr)) {
      best = b;
    }
  }
  return best;
}

Block* FreeBlocks::BestFitIn(const Bins& bins, size_t size) {
  if (bins.count == 0) return nullptr;
  const int bin = BinOf(size);
  if (Block* b = SmallestIn(bins.heads[bin], size)) return b;
  // The next non-empty bin: every block in it is larger than `size`.
  int first = bin / kSecond;
  const int second = bin % kSecond;
  uint32_t rest = second + 1 < kSecond ? bins.second_map[first] & (~0u << (second + 1)) : 0;
  if (rest == 0) {
    const uint64_t higher =
        first + 1 < kFirst ? bins.first_map & (~uint64_t{0} << (first + 1)) : 0;
    if (higher == 0) return nullptr;
    first = __builtin_ctzll(higher);
    rest = bins.second_map[first];
  }
  const int next = first * kSecond + __builtin_ctz(rest);
  return SmallestIn(bins.heads[next], 0);
}

Block* FreeBlocks::BestFit(Stream stream, size_t size) const {
  const Bins* own = Find(stream);
  Block* mine = own != nullptr ? BestFitIn(*own, size) : nullptr;
  if (stream == kAnyStream) return mine;
  const Bins* shared = Find(kAnyStream);
  Block* any = shared != nullptr ? BestFitIn(*shared, size) : nullptr;
  if (mine == nullptr) return any;
  if (any == nullptr) return mine;
  return any->size < mine->size ? any : mine;
}

std::vector<Block*> FreeBlocks::BlocksOf(Stream stream) const {
  std::vector<Block*> out;
  if (const Bins* bins = Find(stream)) {
    for (Block* head : bins->heads) {
      for (Block* b = head; b != nullptr; b = b->free_next) out.push_back(b);
    }
  }
  return out;
}

}  // namespace vmm
