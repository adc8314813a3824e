// free_blocks.h: the set of cached (kFree) blocks of a pool, searched best-fit per stream.
//
// Blocks are ordered by (stream, size, address), so the best fit for `size` on stream S is the
// first block at or after (S, size, 0), and the smallest fit among blocks every stream may use
// is the first at or after (kAnyStream, size, 0). Ties go to the lowest address, which keeps
// memory packed towards the start of the range. A block's key fields must not change while it
// is in the set: Remove() it first.
#ifndef VMM_ALLOCATOR_FREE_BLOCKS_H_
#define VMM_ALLOCATOR_FREE_BLOCKS_H_

#include <cstddef>
#include <vector>

#include "absl/container/btree_set.h"
#include "allocator/block.h"

namespace vmm {

class FreeBlocks {
 public:
  void Insert(Block* block) { set_.insert(block); }
  void Remove(Block* block) { set_.erase(block); }

  // The smallest block of at least `size` bytes that `stream` may take now: one freed on
  // `stream` itself, or one free for every stream; nullptr when there is none.
  Block* BestFit(Stream stream, size_t size) const {
    Block* own = FirstAtLeast(stream, size);
    if (stream == kAnyStream) return own;
    Block* any = FirstAtLeast(kAnyStream, size);
    if (own == nullptr) return any;
    if (any == nullptr) return own;
    return any->size < own->size ? any : own;
  }

  // The blocks tagged with `stream` (to retag them once the stream's work has completed).
  std::vector<Block*> BlocksOf(Stream stream) const {
    std::vector<Block*> out;
    Key lo{stream, 0, 0};
    for (auto it = set_.lower_bound(lo); it != set_.end() && (*it)->stream == stream; ++it) {
      out.push_back(*it);
    }
    return out;
  }

  // The largest cached block (0 when empty).
  size_t LargestSize() const {
    size_t largest = 0;
    // The largest of each stream's run is the last block before the next stream's first.
    for (auto it = set_.begin(); it != set_.end();) {
      Key next{(*it)->stream + 1, 0, 0};
      auto stop = (*it)->stream == kAnyStream ? set_.end() : set_.lower_bound(next);
      auto last = std::prev(stop);
      if ((*last)->size > largest) largest = (*last)->size;
      it = stop;
    }
    return largest;
  }

  // Calls f(stream) once for each tag present (kAnyStream last).
  template <typename F>
  void ForEachStream(F&& f) const {
    for (auto it = set_.begin(); it != set_.end();) {
      const Stream s = (*it)->stream;
      f(s);
      if (s == kAnyStream) break;
      it = set_.lower_bound(Key{s + 1, 0, 0});
    }
  }

  bool Contains(Block* block) const { return set_.count(block) != 0; }
  size_t count() const { return set_.size(); }
  template <typename F>
  void ForEach(F&& f) const {
    for (Block* b : set_) f(b);
  }

 private:
  struct Key {
    Stream stream;
    size_t size;
    uintptr_t addr;
  };
  struct Order {
    using is_transparent = void;
    static Key KeyOf(const Block* b) { return Key{b->stream, b->size, b->addr}; }
    static const Key& KeyOf(const Key& k) { return k; }
    template <typename A, typename B>
    bool operator()(const A& a, const B& b) const {
      const Key ka = KeyOf(a);
      const Key kb = KeyOf(b);
      if (ka.stream != kb.stream) return ka.stream < kb.stream;
      if (ka.size != kb.size) return ka.size < kb.size;
      return ka.addr < kb.addr;
    }
  };

  Block* FirstAtLeast(Stream stream, size_t size) const {
    auto it = set_.lower_bound(Key{stream, size, 0});
    if (it == set_.end() || (*it)->stream != stream) return nullptr;
    return *it;
  }

  absl::btree_set<Block*, Order> set_;
};

}  // namespace vmm

#endif  // VMM_ALLOCATOR_FREE_BLOCKS_H_
