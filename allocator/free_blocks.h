// free_blocks.h: the set of cached (kFree) blocks of an arena, searched best-fit per stream.
//
// Blocks are kept per stream tag in segregated size bins (two-level, as in TLSF): sizes are
// multiples of 512; below 32 KiB each bin holds one size, above that each power of two is cut
// into 32 bins. Bitmaps find the next non-empty bin in constant time, and each bin is an
// intrusive list, so inserting and removing a block take constant time and no memory (but the
// first block of a stream not seen lately: its tag's bins, 13 KiB, made once and dropped once
// the tag is empty and new tags come, on average constant time too). The
// search is best fit within a bounded walk: the smallest fitting block of the request's own
// bin, else the smallest block of the next non-empty bin (every block there is larger), ties
// going to the lower address; where a bin lists more than kMaxWalk blocks, only the first
// kMaxWalk of its list (mostly the latest filed: Replace and Resized keep a block's place) are
// compared. Below 32 KiB a bin holds one size, so there the bound only limits the choice of
// address, and refilling many holes of one size takes constant time a request. In a larger
// bin, where none of the first kMaxWalk fits, up to kMaxRestWalk more are looked at before a
// larger bin is taken, so a close fit filed earlier is still found unless thousands of blocks
// too small for the request were filed after it.
//
// The best fit for stream S is the better of S's own blocks and the blocks every stream may
// use (kAnyStream). A block's tag must not change while it is in the set (Remove() it first);
// its size may, if Resized() follows. Replace() and Resized() keep a block's place in its bin
// when its new size still falls in that bin, which is the common case when a large free
// block is split or grows by coalescing: no bin or bitmap changes then.
//
// The set counts what it holds as statistics (Stat: current, peak, allocated, freed): its
// blocks and their bytes, by the size each block was filed with (a pool's inactive_split and
// inactive_split_bytes of one arena). `allocated` counts what was filed: a block taken out and
// filed again (a retag, a split) counts again. A few adds per change, on the cached path.
#ifndef VMM_ALLOCATOR_FREE_BLOCKS_H_
#define VMM_ALLOCATOR_FREE_BLOCKS_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/attributes.h"
#include "absl/container/flat_hash_map.h"
#include "allocator/block.h"
#include "allocator/stats.h"

namespace vmm {

class FreeBlocks {
 public:
  FreeBlocks();
  ~FreeBlocks();
  FreeBlocks(const FreeBlocks&) = delete;
  FreeBlocks& operator=(const FreeBlocks&) = delete;

  void Insert(Block* block);
  void Remove(Block* block);
  // `block` (not in the set, same tag as `old`) enters the set in place of `old`, which
  // leaves it; `size` is the size `block` has or is about to be given by the caller.
  void Replace(Block* old, Block* block, size_t size);
  // Moves `block` to the bin of its new size, after its size changed while in the set.
  void Resized(Block* block);
  bool Contains(const Block* block) const { return block->free_bins != nullptr; }

  // The blocks and bytes the set holds, as statistics; ResetStatPeaks and
  // ResetStatAccumulated do to them what Stat's resets do.
  Stat block_stat() const { return blocks_.Value(static_cast<int64_t>(count_)); }
  Stat byte_stat() const { return bytes_.Value(bytes_.current); }
  void ResetStatPeaks() {
    blocks_.peak = static_cast<int64_t>(count_);
    bytes_.peak = bytes_.current;
  }
  void ResetStatAccumulated() {
    blocks_.Reset(static_cast<int64_t>(count_));
    bytes_.Reset(bytes_.current);
  }
  // Whether a contained block is listed in the bin of its size and tag (for invariant checks:
  // walks the bin).
  bool Filed(const Block* block) const;
  size_t count() const { return count_; }

  // The smallest block of at least `size` bytes that `stream` may take now: one freed on
  // `stream` itself, or one free for every stream; nullptr when there is none.
  Block* BestFit(Stream stream, size_t size) const;

  // The size of the largest block, 0 when there is none. Looks only at each tag's highest
  // non-empty bin (one block of it where a bin holds one size), not at every block: a pool's
  // statistics ask for it at every allocation while the profiler records memory.
  size_t Largest() const;

  // The blocks tagged with `stream`, and how many there are.
  std::vector<Block*> BlocksOf(Stream stream) const;
  size_t CountOf(Stream stream) const {
    const Bins* bins = Find(stream);
    return bins != nullptr ? bins->count : 0;
  }

  // Calls f(stream) once for each tag that has blocks.
  template <typename F>
  void ForEachStream(F&& f) const {
    for (const auto& bins : tags_) {
      if (bins->count > 0) f(bins->stream);
    }
  }

  // Calls f(block) for every block tagged `stream` that may hold at least `size` bytes: all
  // of them, and the smaller blocks that share their first bin (callers filter by size), in
  // no particular order. Visits only the non-empty bins from `size`'s up (the bitmaps), so a
  // search for large free blocks does not walk the many small ones. `f` must not change the
  // set.
  template <typename F>
  void ForEachAtLeast(Stream stream, size_t size, F&& f) const {
    if (const Bins* bins = Find(stream)) ForEachIn(*bins, size, f);
  }

  // Calls f(block) for every block.
  template <typename F>
  void ForEach(F&& f) const {
    for (const auto& bins : tags_) ForEachIn(*bins, 0, f);
  }

  // How many stream tags the set keeps, empty ones included (for tests: tags of streams
  // with nothing cached are dropped as new ones come).
  size_t tag_count() const { return tags_.size(); }

 private:
  static constexpr int kSecondBits = 5;
  static constexpr int kSecond = 1 << kSecondBits;  // bins per power of two
  static constexpr int kFirst = 64 - 9 - kSecondBits + 1;
  static constexpr int kBins = kFirst * kSecond;

  // The blocks of one stream tag.
  struct Bins {
    Stream stream = 0;
    size_t count = 0;
    uint64_t first_map = 0;            // bit f: some bin of class f is non-empty
    uint32_t second_map[kFirst] = {};  // bit s of class f: bin (f, s) is non-empty
    Block* heads[kBins] = {};
  };

  // ForEachAtLeast within one tag's bins.
  template <typename F>
  static void ForEachIn(const Bins& in, size_t size, F&& f) {
    const Bins* bins = &in;
    if (bins->count == 0) return;
    const int bin = BinOf(size);
    int first = bin >> kSecondBits;
    uint32_t seconds = bins->second_map[first] & (~0u << (bin & (kSecond - 1)));
    while (true) {
      for (; seconds != 0; seconds &= seconds - 1) {
        const int at = first * kSecond + __builtin_ctz(seconds);
        for (Block* b = bins->heads[at]; b != nullptr; b = b->free_next) f(b);
      }
      const uint64_t higher = bins->first_map & ((~uint64_t{0} << first) << 1);
      if (higher == 0) return;
      first = __builtin_ctzll(higher);
      seconds = bins->second_map[first];
    }
  }

  static int BinOf(size_t size);
  // Counts `block` in (+1) or out (-1) of the statistics, by its filed size.
  void Tally(const Block* block, int sign);
  // Counts the change of a filed block's size to `size`, and files it with that size.
  void TallyResize(Block* block, size_t size);
  // The smallest block of at least `at_least` bytes among the first `walk` blocks of a bin's
  // list (ties to the lower address), or nullptr; `*stopped` (if given): the first block not
  // looked at, nullptr when the whole list was.
  static Block* SmallestIn(Block* head, size_t at_least, size_t walk = kMaxWalk,
                           Block** stopped = nullptr);
  // How far a search walks one bin. A bin can hold many thousand blocks (the holes left by
  // 150,000 tiny tensors, every other one freed, are all in the 512-byte bin): a whole walk per
  // request made refilling them quadratic (95 µs a request in a host replay; 0.18 with this
  // bound). 32 changed the choices where a bin holds a few hundred blocks (rl_phases with
  // 4 layers: 9% more driver calls, from addresses no longer the lowest); 256 changed none on
  // the suite and its variants.
  static constexpr size_t kMaxWalk = 256;
  // How much further a search walks a bin of several sizes where none of the first kMaxWalk
  // fits, before it takes a larger bin's block: a bound again, since a bin of many blocks too
  // small for a steady request (holes of 64 KiB, requests of 65 KiB) cost each request a walk
  // of all of them (1.6 ms with 100,000).
  static constexpr size_t kMaxRestWalk = 4096;
  Bins* Find(Stream stream) const;
  Bins& FindOrAdd(Stream stream);
  // A new tag's bins; first drops the tags that hold nothing (but kAnyStream's) once there
  // are sweep_at_ of them. A program that makes and destroys streams (a stream per request
  // or per thread) left a tag of 13 KiB for each, and every search that missed the last tag
  // used walked them all (a cached pair cost 168 µs with 10,000 such streams).
  Bins& AddTag(Stream stream);
  // Files `block` in `bins` at `bin`, or takes it out of its bin, counting blocks per bin and
  // in count_ but not in the statistics (Tally).
  void InsertIn(Bins& bins, Block* block, int bin);
  void Unlink(Block* block);
  static Block* BestFitIn(const Bins& bins, size_t size);

  // One per stream that freed memory and still has (or lately had) blocks here, in the
  // order they were made (which ForEachStream and ForEach follow), and by stream.
  std::vector<std::unique_ptr<Bins>> tags_;
  absl::flat_hash_map<Stream, Bins*> by_stream_;
  static constexpr size_t kMinSweep = 64;
  size_t sweep_at_ = kMinSweep;               // AddTag drops empty tags at this many
  Bins* last_ = nullptr;                      // the tag used last (the common one)
  Bins* any_ = nullptr;                       // kAnyStream's bins, once they exist
  size_t count_ = 0;
  // A statistic kept as what was filed (`filed`) and its high-water mark, beside its current
  // value (count_ for the blocks): one add and one compare per filing, nothing per removal.
  struct Tallied {
    int64_t current = 0;  // bytes only
    int64_t filed = 0;
    int64_t peak = 0;
    int64_t current_at_reset = 0;
    int64_t filed_at_reset = 0;
    void File(int64_t n, int64_t now) {
      filed += n;
      if (now > peak) peak = now;
    }
    Stat Value(int64_t now) const {
      Stat s;
      s.current = now;
      s.peak = peak;
      s.allocated = filed - filed_at_reset;
      s.freed = s.allocated - (now - current_at_reset);
      return s;
    }
    void Reset(int64_t now) {
      current_at_reset = now;
      filed_at_reset = filed;
    }
  };
  Tallied blocks_;
  Tallied bytes_;
};

// The searches and updates below are on the pool's cached path: inline.

inline int FreeBlocks::BinOf(size_t size) {
  // Without a branch (sizes arrive in no predictable order): below 2 * kSecond units the
  // leading-bit position is taken as kSecondBits, which makes the bin the unit count itself.
  const uint64_t units = size >> 9;  // sizes are multiples of 512
  const int top = 63 - __builtin_clzll(units | kSecond);
  const int shift = top - kSecondBits;
  return shift * kSecond + static_cast<int>(units >> shift);
}

inline FreeBlocks::Bins* FreeBlocks::Find(Stream stream) const {
  if (last_ != nullptr && last_->stream == stream) return last_;
  const auto it = by_stream_.find(stream);
  return it != by_stream_.end() ? it->second : nullptr;
}

inline FreeBlocks::Bins& FreeBlocks::FindOrAdd(Stream stream) {
  Bins* bins = Find(stream);
  if (bins == nullptr) bins = &AddTag(stream);
  last_ = bins;
  return *bins;
}

inline void FreeBlocks::Tally(const Block* block, int sign) {
  const auto size = static_cast<int64_t>(block->free_size);
  if (sign > 0) {
    bytes_.current += size;
    bytes_.File(size, bytes_.current);
    blocks_.File(1, static_cast<int64_t>(count_));
  } else {
    bytes_.current -= size;
  }
}

inline void FreeBlocks::TallyResize(Block* block, size_t size) {
  const int64_t change = static_cast<int64_t>(size) - static_cast<int64_t>(block->free_size);
  bytes_.current += change;
  if (change > 0) bytes_.File(change, bytes_.current);
  block->free_size = size;
}

inline void FreeBlocks::Insert(Block* block) {
  InsertIn(FindOrAdd(block->stream), block, BinOf(block->size));
  block->free_size = block->size;
  Tally(block, +1);
}

inline void FreeBlocks::InsertIn(Bins& bins, Block* block, int bin) {
  block->free_prev = nullptr;
  block->free_next = bins.heads[bin];
  if (block->free_next != nullptr) block->free_next->free_prev = block;
  bins.heads[bin] = block;
  bins.first_map |= uint64_t{1} << (bin >> kSecondBits);
  bins.second_map[bin >> kSecondBits] |= 1u << (bin & (kSecond - 1));
  block->free_bins = &bins;
  block->free_bin = bin;
  ++bins.count;
  ++count_;
}

inline void FreeBlocks::Remove(Block* block) {
  Unlink(block);
  Tally(block, -1);
}

inline void FreeBlocks::Unlink(Block* block) {
  Bins& bins = *static_cast<Bins*>(block->free_bins);
  const int bin = block->free_bin;
  if (block->free_prev != nullptr) {
    block->free_prev->free_next = block->free_next;
  } else {
    bins.heads[bin] = block->free_next;
  }
  if (block->free_next != nullptr) block->free_next->free_prev = block->free_prev;
  if (bins.heads[bin] == nullptr) {
    const int first = bin >> kSecondBits;
    bins.second_map[first] &= ~(1u << (bin & (kSecond - 1)));
    // Clears the class bit if the class emptied, without a branch.
    bins.first_map &= ~(uint64_t{bins.second_map[first] == 0} << first);
  }
  block->free_prev = block->free_next = nullptr;
  block->free_bins = nullptr;
  --bins.count;
  --count_;
}

ABSL_ATTRIBUTE_ALWAYS_INLINE inline void FreeBlocks::Replace(Block* old, Block* block,
                                                              size_t size) {
  Bins& bins = *static_cast<Bins*>(old->free_bins);
  const int bin = BinOf(size);
  block->free_size = old->free_size;
  TallyResize(block, size);
  if (bin != old->free_bin) {
    Unlink(old);
    InsertIn(bins, block, bin);
    return;
  }
  block->free_prev = old->free_prev;
  block->free_next = old->free_next;
  if (block->free_prev != nullptr) {
    block->free_prev->free_next = block;
  } else {
    bins.heads[bin] = block;
  }
  if (block->free_next != nullptr) block->free_next->free_prev = block;
  block->free_bins = &bins;
  block->free_bin = bin;
  old->free_prev = old->free_next = nullptr;
  old->free_bins = nullptr;
}

ABSL_ATTRIBUTE_ALWAYS_INLINE inline void FreeBlocks::Resized(Block* block) {
  TallyResize(block, block->size);
  const int bin = BinOf(block->size);
  if (bin == block->free_bin) return;
  Bins& bins = *static_cast<Bins*>(block->free_bins);
  Unlink(block);
  InsertIn(bins, block, bin);
}

inline Block* FreeBlocks::SmallestIn(Block* head, size_t at_least, size_t walk,
                                     Block** stopped) {
  Block* best = nullptr;
  size_t seen = 0;
  Block* b = head;
  for (; b != nullptr && seen < walk; b = b->free_next, ++seen) {
    if (b->size < at_least) continue;
    if (b->size == at_least) {
      if (best == nullptr || best->size != at_least || b->addr < best->addr) best = b;
      continue;
    }
    if (best == nullptr || b->size < best->size ||
        (b->size == best->size && b->addr < best->addr)) {
      best = b;
    }
  }
  if (stopped != nullptr) *stopped = b;
  return best;
}

inline Block* FreeBlocks::BestFitIn(const Bins& bins, size_t size) {
  if (bins.count == 0) return nullptr;
  const int bin = BinOf(size);
  Block* stopped = nullptr;
  if (Block* b = SmallestIn(bins.heads[bin], size, kMaxWalk, &stopped)) return b;
  // None of the first kMaxWalk fits (a bin above 32 KiB holds several sizes): the rest of the
  // bin, whose fitting blocks are closer to the request than any block of a larger bin (taking
  // one of those split a large block, and the next large request then grew the pool).
  if (stopped != nullptr) {
    if (Block* b = SmallestIn(stopped, size, kMaxRestWalk)) return b;
  }
  // The next non-empty bin: every block in it is larger than `size`. Found in this bin's
  // class, else in the next non-empty class; the choice is made without a branch.
  const int first = bin >> kSecondBits;
  const int second = bin & (kSecond - 1);
  const uint32_t same = bins.second_map[first] & ((~0u << second) << 1);
  const uint64_t higher = bins.first_map & ((~uint64_t{0} << first) << 1);
  if ((same | higher) == 0) return nullptr;
  // (Masks rather than ?: , which the compiler turns into a branch here. When `higher` is 0,
  // `same` is not, and the index stays `first`.)
  const int in_same = -static_cast<int>(same != 0);  // all ones or zero
  const int higher_first = __builtin_ctzll(higher | (uint64_t{1} << 63));
  const int next_first = higher_first + ((first - higher_first) & in_same);
  const uint32_t rest = same | (bins.second_map[next_first] & ~static_cast<uint32_t>(in_same));
  const int next = next_first * kSecond + __builtin_ctz(rest);
  return SmallestIn(bins.heads[next], 0);
}

inline Block* FreeBlocks::BestFit(Stream stream, size_t size) const {
  const Bins* own = Find(stream);
  Block* mine = own != nullptr ? BestFitIn(*own, size) : nullptr;
  if (stream == kAnyStream) return mine;
  Block* any = any_ != nullptr ? BestFitIn(*any_, size) : nullptr;
  if (mine == nullptr) return any;
  if (any == nullptr) return mine;
  return any->size < mine->size ? any : mine;
}

}  // namespace vmm

#endif  // VMM_ALLOCATOR_FREE_BLOCKS_H_
