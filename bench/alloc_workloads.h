// alloc_workloads.h: allocator-neutral workloads for comparing vmm with its peers.
//
// Header only, standard library only, so that it builds with Bazel against vmm and with a
// plain g++ against LibTorch (bench/torch_peer_bench.cpp). A workload is a function template
// over an adapter, a small class of the allocator under test:
//
//   class MyAdapter {
//    public:
//     std::string Name() const;   // label in the results: "vmm", "torch_native", ...
//     void* Alloc(size_t bytes);  // nullptr on failure (the adapter says why on stderr)
//     void Free(void* ptr);
//     AllocStats Stats();         // what the allocator can tell about itself
//     void Reset();               // release cached memory and reset peaks (before a replay)
//   };
//
// Workloads:
//   - RunPairWorkload: the cached allocate + free pair, with `live` blocks allocated and sizes
//     from a fixed seeded mix (the pattern of BM_CachedAllocFreePair in bench/pool_bench.cc).
//     Median over repetitions of the mean time per pair.
//   - RunReplayWorkload: replays an allocation trace (bench/training_trace.py's format: lines
//     "a ID BYTES" and "f ID"), from an empty cache and then warm, and reports peak reserved
//     over peak allocated, the allocator's device call counts and the time per operation.
//
// Results go to stdout, one JSON object per line:
//   {"bench": ..., "name": ..., "allocator": ..., "metric": ..., "value": ..., "unit": ..., ...}
// bench/report.py turns them into tables.
#ifndef VMM_BENCH_ALLOC_WORKLOADS_H_
#define VMM_BENCH_ALLOC_WORKLOADS_H_

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace vmm_bench {

// What an adapter reports about its allocator. -1 means "cannot tell".
struct AllocStats {
  int64_t reserved = -1;       // bytes held from the device now
  int64_t peak_reserved = -1;  // highest `reserved` since the last Reset()
  // Cumulative counts by name. Names shared across allocators: "num_device_alloc" and
  // "num_device_free" (PyTorch's meaning: physical allocations / releases, a map or unmap of
  // expandable segments counting once), "driver_calls" (individual driver calls, where known).
  std::vector<std::pair<std::string, int64_t>> counts;
};

// One JSON object, built field by field and printed as one line.
class JsonLine {
 public:
  JsonLine& Str(const std::string& key, const std::string& value) {
    fields_.emplace_back(key, Quote(value));
    return *this;
  }
  JsonLine& Int(const std::string& key, int64_t value) {
    fields_.emplace_back(key, std::to_string(value));
    return *this;
  }
  JsonLine& Num(const std::string& key, double value) {
    if (!std::isfinite(value)) {
      fields_.emplace_back(key, "null");
      return *this;
    }
    char buf[32];
    // Whole numbers (counts, bytes) in full; others to nine significant digits.
    if (value == std::floor(value) && std::fabs(value) < 9.0e15) {
      std::snprintf(buf, sizeof(buf), "%.0f", value);
    } else {
      std::snprintf(buf, sizeof(buf), "%.9g", value);
    }
    fields_.emplace_back(key, buf);
    return *this;
  }
  // Appends every field of `other`.
  JsonLine& Merge(const JsonLine& other) {
    fields_.insert(fields_.end(), other.fields_.begin(), other.fields_.end());
    return *this;
  }
  std::string ToString() const {
    std::string out = "{";
    for (size_t i = 0; i < fields_.size(); ++i) {
      if (i > 0) out += ", ";
      out += Quote(fields_[i].first) + ": " + fields_[i].second;
    }
    return out + "}";
  }
  // Prints the object and a newline to stdout, flushed so that a crash later loses nothing.
  void Print() const {
    std::printf("%s\n", ToString().c_str());
    std::fflush(stdout);
  }

 private:
  static std::string Quote(const std::string& s) {
    std::string out = "\"";
    for (char c : s) {
      if (c == '"' || c == '\\') {
        out += '\\';
        out += c;
      } else if (static_cast<unsigned char>(c) < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof(buf), "\\u%04x", c);
        out += buf;
      } else {
        out += c;
      }
    }
    return out + "\"";
  }

  std::vector<std::pair<std::string, std::string>> fields_;  // key, JSON text of the value
};

// The common fields of one result.
inline JsonLine Result(const std::string& bench, const std::string& name,
                       const std::string& allocator, const std::string& metric, double value,
                       const std::string& unit) {
  JsonLine line;
  line.Str("bench", bench).Str("name", name).Str("allocator", allocator).Str("metric", metric);
  line.Num("value", value).Str("unit", unit);
  return line;
}

inline double Median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

inline double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Keeps the compiler from discarding `p` (and the call that produced it).
inline void Escape(void* p) { asm volatile("" : : "g"(p) : "memory"); }

// Counts in `after` minus the same counts in `before` (counts missing from `before` as is).
inline std::vector<std::pair<std::string, int64_t>> CountDeltas(const AllocStats& before,
                                                                const AllocStats& after) {
  std::vector<std::pair<std::string, int64_t>> out;
  for (const auto& [name, value] : after.counts) {
    int64_t base = 0;
    for (const auto& [n, v] : before.counts) {
      if (n == name) base = v;
    }
    out.emplace_back(name, value - base);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// (a) The cached allocate + free pair.

// A mix of sizes a training step allocates: 60% small (512 B..64 KiB), 30% medium
// (1..9 MiB), 10% large (16..64 MiB). bench/pool_bench.cc uses it too.
inline std::vector<size_t> MixedSizes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<size_t> sizes(n);
  for (size_t& s : sizes) {
    const uint32_t r = rng() % 100;
    if (r < 60) {
      s = 512 + rng() % (64 << 10);
    } else if (r < 90) {
      s = (1 << 20) + rng() % (8 << 20);
    } else {
      s = (16 << 20) + rng() % (48 << 20);
    }
  }
  return sizes;
}

struct PairOptions {
  size_t live = 64;             // blocks kept allocated; each pair replaces one of them
  size_t iterations = 100000;   // pairs per repetition
  int repetitions = 7;          // the median of these is reported
  size_t num_sizes = 1024;      // length of the size sequence (cycled; at least 1)
  uint32_t seed = 1;
};

// Times `iterations` pairs `repetitions` times: free the block in slot i % live, allocate
// sizes[i % num_sizes] into it. Before timing, every size is allocated and freed once and one
// untimed repetition runs, so that a caching allocator has reached its steady state. Prints
// one result; false on an allocation failure.
template <typename Adapter>
bool RunPairWorkload(Adapter& adapter, const PairOptions& options, const JsonLine& extra = {}) {
  const std::vector<size_t> sizes =
      MixedSizes(std::max<size_t>(1, options.num_sizes), options.seed);
  const size_t live = std::max<size_t>(1, options.live);
  std::vector<void*> blocks(live, nullptr);
  auto release_all = [&] {
    for (void*& p : blocks) {
      if (p != nullptr) adapter.Free(p);
      p = nullptr;
    }
  };
  for (size_t i = 0; i < live; ++i) {
    blocks[i] = adapter.Alloc(sizes[i % sizes.size()]);
    if (blocks[i] == nullptr) {
      release_all();
      return false;
    }
  }
  for (size_t s : sizes) {
    void* p = adapter.Alloc(s);
    if (p == nullptr) {
      release_all();
      return false;
    }
    adapter.Free(p);
  }
  const int repetitions = std::max(1, options.repetitions);
  AllocStats before;
  std::vector<double> ns_per_pair;
  // Pair i uses slot i % live and size i % num_sizes, kept as wrapping counters (a division
  // per pair would cost a noticeable part of a cached pair).
  size_t slot = 0;
  size_t next_size = 0;
  // Repetition -1 is a warm-up: the live set drifts through the whole size sequence, so the
  // cache reaches its steady state before timing starts.
  for (int rep = -1; rep < repetitions; ++rep) {
    if (rep == 0) before = adapter.Stats();
    const auto start = std::chrono::steady_clock::now();
    for (size_t k = 0; k < options.iterations; ++k) {
      adapter.Free(blocks[slot]);
      void* p = adapter.Alloc(sizes[next_size]);
      Escape(p);
      blocks[slot] = p;
      if (p == nullptr) {
        release_all();
        return false;
      }
      if (++slot == live) slot = 0;
      if (++next_size == sizes.size()) next_size = 0;
    }
    const double seconds = SecondsSince(start);
    if (rep >= 0) ns_per_pair.push_back(seconds * 1e9 / static_cast<double>(options.iterations));
  }
  const AllocStats after = adapter.Stats();
  release_all();

  JsonLine line = Result("alloc_free_pair", "alloc_free_pair/live=" + std::to_string(live),
                         adapter.Name(), "ns_per_pair", Median(ns_per_pair), "ns");
  line.Int("live", static_cast<int64_t>(live))
      .Int("iterations", static_cast<int64_t>(options.iterations))
      .Int("repetitions", repetitions)
      .Num("min", *std::min_element(ns_per_pair.begin(), ns_per_pair.end()))
      .Num("max", *std::max_element(ns_per_pair.begin(), ns_per_pair.end()));
  // Reserved bytes before and after timing, and device calls made while timing: no change
  // and 0 when every pair was served from the cache.
  line.Int("reserved_before", before.reserved).Int("reserved_after", after.reserved);
  for (const auto& [name, delta] : CountDeltas(before, after)) line.Int("timed_" + name, delta);
  line.Merge(extra).Print();
  return true;
}

// ---------------------------------------------------------------------------------------------
// (b) Trace replay.

struct TraceOp {
  uint32_t slot = 0;  // dense index of the trace's ID
  bool alloc = false;
  size_t bytes = 0;   // alloc only
};

struct Trace {
  std::string path;
  std::vector<TraceOp> ops;
  size_t slots = 0;                // distinct IDs
  size_t allocs = 0;
  int64_t peak_live_bytes = 0;     // highest sum of live requested bytes
};

// Parses a trace file: one event a line, "a ID BYTES" (an allocation of BYTES bytes, a decimal
// integer below 2^63) or "f ID" (its free). ID is any token and is compared as text ("007" and
// "7" are two IDs). Fields are separated by spaces or tabs; blank lines and lines whose first
// field starts with '#' are skipped; a line may end in "\r" and the file may start with a
// UTF-8 byte-order mark. False with `error` set (file and line) on a malformed line (an unknown
// event, a missing or extra field, BYTES that is not such a number), an allocation of a live
// ID, a free of an ID that is not live, live bytes that would pass 2^63 - 1, or a trace that
// allocates no bytes at all (its peak reserved / peak allocated would be undefined).
inline bool LoadTrace(const std::string& path, Trace* trace, std::string* error) {
  std::ifstream in(path);
  if (!in) {
    *error = "cannot open trace " + path;
    return false;
  }
  trace->path = path;
  // Trace ID -> slot. IDs written as decimal numbers (no sign, no leading zero), what the
  // project's traces use, are keyed by their value (faster on a trace of millions of lines);
  // every other ID by its text. The two sets of IDs cannot meet ("7" and "007" stay two).
  std::unordered_map<uint64_t, uint32_t> slot_of_number;
  std::unordered_map<std::string, uint32_t> slot_of_text;
  size_t slots = 0;
  std::vector<char> is_live;
  int64_t live_bytes = 0;
  std::vector<size_t> slot_bytes;
  std::string line;
  std::string id;  // a text ID looked up, its buffer reused from line to line
  constexpr int64_t kMaxBytes = std::numeric_limits<int64_t>::max();
  for (size_t lineno = 1; std::getline(in, line); ++lineno) {
    std::string_view rest(line);
    if (lineno == 1 && rest.substr(0, 3) == "\xEF\xBB\xBF") rest.remove_prefix(3);
    if (!rest.empty() && rest.back() == '\r') rest.remove_suffix(1);
    const auto where = [&] { return path + ":" + std::to_string(lineno) + ": "; };
    std::string_view fields[4];
    size_t count = 0;
    while (count < 4) {
      const size_t begin = rest.find_first_not_of(" \t");
      if (begin == std::string_view::npos) break;
      rest.remove_prefix(begin);
      const size_t len = std::min(rest.find_first_of(" \t"), rest.size());
      fields[count++] = rest.substr(0, len);
      rest.remove_prefix(len);
    }
    if (count == 0 || fields[0][0] == '#') continue;
    TraceOp t;
    t.alloc = fields[0] == "a";
    const bool well_formed = t.alloc ? count == 3 : fields[0] == "f" && count == 2;
    if (!well_formed) {
      *error = where() + "expected 'a ID BYTES' or 'f ID': " + line;
      return false;
    }
    if (t.alloc) {
      uint64_t bytes = 0;
      const std::string_view text = fields[2];
      const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), bytes);
      if (ec != std::errc() || end != text.data() + text.size() ||
          bytes > static_cast<uint64_t>(kMaxBytes)) {
        *error = where() + "BYTES must be a whole number of bytes below 2^63: " + line;
        return false;
      }
      if (static_cast<int64_t>(bytes) > kMaxBytes - live_bytes) {
        *error = where() + "the live bytes would pass 2^63 - 1: " + line;
        return false;
      }
      t.bytes = static_cast<size_t>(bytes);
    }
    const std::string_view id_text = fields[1];
    uint64_t number = 0;
    const auto [id_end, id_ec] =
        std::from_chars(id_text.data(), id_text.data() + id_text.size(), number);
    const bool numeric = id_ec == std::errc() && id_end == id_text.data() + id_text.size() &&
                         (id_text.size() == 1 || id_text[0] != '0');
    bool inserted = false;
    if (numeric) {
      auto [it, added] = slot_of_number.try_emplace(number, static_cast<uint32_t>(slots));
      t.slot = it->second;
      inserted = added;
    } else {
      id.assign(id_text);
      auto [it, added] = slot_of_text.try_emplace(id, static_cast<uint32_t>(slots));
      t.slot = it->second;
      inserted = added;
    }
    if (inserted) {
      ++slots;
      is_live.push_back(0);
      slot_bytes.push_back(0);
    }
    if (t.alloc == static_cast<bool>(is_live[t.slot])) {
      *error = where() + "ID " + std::string(id_text) +
               (t.alloc ? " allocated while live" : " freed while not live");
      return false;
    }
    is_live[t.slot] = t.alloc;
    if (t.alloc) {
      slot_bytes[t.slot] = t.bytes;
      live_bytes += static_cast<int64_t>(t.bytes);
      trace->peak_live_bytes = std::max(trace->peak_live_bytes, live_bytes);
      ++trace->allocs;
    } else {
      live_bytes -= static_cast<int64_t>(slot_bytes[t.slot]);
    }
    trace->ops.push_back(t);
  }
  trace->slots = slots;
  if (trace->ops.empty()) {
    *error = "trace " + path + " has no events";
    return false;
  }
  if (trace->peak_live_bytes == 0) {
    *error = "trace " + path + " allocates no bytes: peak reserved / peak allocated is undefined";
    return false;
  }
  return true;
}

// What one replay measured, for callers that print their own summaries.
struct ReplaySummary {
  int64_t peak_reserved = 0;
  int64_t peak_allocated = 0;
  double ratio = 0;                                        // peak_reserved / peak_allocated
  std::vector<std::pair<std::string, int64_t>> counts;    // of the cold pass
  double ns_per_op_cold = 0;
  double ns_per_op_warm = NAN;

  int64_t Count(const std::string& name) const {
    for (const auto& [n, v] : counts) {
      if (n == name) return v;
    }
    return -1;
  }
};

struct ReplayOptions {
  int warm_repetitions = 3;  // replays after the first, from a warm cache
  // Reads Stats().reserved after every allocation even if the adapter keeps a peak itself.
  bool poll_reserved = false;
  // Called before each warm replay (e.g. to reset the allocator's peak statistics, as a
  // training loop that logs a peak per step does); the cold pass's figures are read before.
  std::function<void()> before_warm_replay;
};

// The unit of an adapter's count: "bytes" for names ending in "_bytes", "ns" for driver
// times ("driver_ns*"), else "calls".
inline const char* CountUnit(const std::string& count) {
  if (count.size() > 6 && count.compare(count.size() - 6, 6, "_bytes") == 0) return "bytes";
  if (count.compare(0, 9, "driver_ns") == 0) return "ns";
  return "calls";
}

namespace internal {

// One pass over the trace. Blocks still live at the end are freed. Returns the seconds taken
// (frees of leftovers excluded) or a negative value on failure; `polled_peak` gets the highest
// reserved seen when `poll` is set.
template <typename Adapter>
double ReplayOnce(Adapter& adapter, const Trace& trace, bool poll, int64_t* polled_peak) {
  std::vector<void*> ptrs(trace.slots, nullptr);
  bool failed = false;
  const auto start = std::chrono::steady_clock::now();
  for (const TraceOp& op : trace.ops) {
    if (op.alloc) {
      void* p = adapter.Alloc(op.bytes);
      if (p == nullptr) {
        failed = true;
        break;
      }
      ptrs[op.slot] = p;
      if (poll) *polled_peak = std::max(*polled_peak, adapter.Stats().reserved);
    } else {
      adapter.Free(ptrs[op.slot]);
      ptrs[op.slot] = nullptr;
    }
  }
  const double seconds = SecondsSince(start);
  for (void* p : ptrs) {
    if (p != nullptr) adapter.Free(p);
  }
  return failed ? -1 : seconds;
}

}  // namespace internal

// Replays `trace` once from a reset allocator (cold: growth included) and then
// `warm_repetitions` more times. Prints one result per metric: the ratio of peak reserved to
// peak allocated (cold pass), each device call count of the cold pass, and ns per operation
// cold and warm (median). False on an allocation failure.
template <typename Adapter>
bool RunReplayWorkload(Adapter& adapter, const Trace& trace, const ReplayOptions& options,
                       const JsonLine& extra = {}, ReplaySummary* summary = nullptr) {
  adapter.Reset();
  const AllocStats before = adapter.Stats();
  const bool poll = options.poll_reserved || before.peak_reserved < 0;
  int64_t polled_peak = std::max<int64_t>(0, before.reserved);
  const double cold = internal::ReplayOnce(adapter, trace, poll, &polled_peak);
  if (cold < 0) return false;
  const AllocStats after = adapter.Stats();
  const int64_t peak_reserved = poll ? polled_peak : after.peak_reserved;
  const auto counts = CountDeltas(before, after);

  std::vector<double> warm_ns;
  for (int rep = 0; rep < options.warm_repetitions; ++rep) {
    if (options.before_warm_replay) options.before_warm_replay();
    const double s = internal::ReplayOnce(adapter, trace, poll, &polled_peak);
    if (s < 0) return false;
    warm_ns.push_back(s * 1e9 / static_cast<double>(trace.ops.size()));
  }
  const AllocStats end = adapter.Stats();

  const std::string name = "trace_replay";
  const std::string bench = "trace_replay";
  const double peak_alloc = static_cast<double>(trace.peak_live_bytes);
  JsonLine common;
  common.Str("trace", trace.path).Int("ops", static_cast<int64_t>(trace.ops.size()));
  common.Merge(extra);

  JsonLine ratio = Result(bench, name, adapter.Name(), "peak_reserved_over_peak_allocated",
                          static_cast<double>(peak_reserved) / peak_alloc, "x");
  ratio.Int("peak_reserved_bytes", peak_reserved)
      .Int("peak_allocated_bytes", trace.peak_live_bytes)
      .Str("peak_source", poll ? "polled" : "allocator");
  if (!warm_ns.empty()) {
    ratio.Int("peak_reserved_bytes_after_warm", poll ? polled_peak : end.peak_reserved);
  }
  for (const auto& [count, delta] : counts) ratio.Int(count, delta);
  ratio.Merge(common).Print();

  int64_t device_alloc = -1, device_free = -1;
  for (const auto& [count, delta] : counts) {
    Result(bench, name, adapter.Name(), count, static_cast<double>(delta), CountUnit(count))
        .Merge(common)
        .Print();
    if (count == "num_device_alloc") device_alloc = delta;
    if (count == "num_device_free") device_free = delta;
    if (count == "driver_ns") {
      // The part of ns_per_op_cold spent in the driver's calls.
      Result(bench, name, adapter.Name(), "driver_ns_per_op_cold",
             static_cast<double>(delta) / static_cast<double>(trace.ops.size()), "ns")
          .Merge(common)
          .Print();
    }
  }
  if (device_alloc >= 0 && device_free >= 0) {
    // docs/DESIGN.md §5 compares this sum (maps + unmaps) with PyTorch's expandable segments.
    Result(bench, name, adapter.Name(), "num_device_alloc_plus_free",
           static_cast<double>(device_alloc + device_free), "calls")
        .Merge(common)
        .Print();
  }
  Result(bench, name, adapter.Name(), "ns_per_op_cold",
         cold * 1e9 / static_cast<double>(trace.ops.size()), "ns")
      .Merge(common)
      .Print();
  if (!warm_ns.empty()) {
    Result(bench, name, adapter.Name(), "ns_per_op_warm", Median(warm_ns), "ns")
        .Int("repetitions", options.warm_repetitions)
        .Merge(common)
        .Print();
    // What a warm replay still asks of the driver (moves on the misses it has), on average.
    for (const auto& [count, delta] : CountDeltas(after, end)) {
      if (count != "driver_calls" && count != "moved_bytes" && count != "driver_ns") continue;
      const double per_replay = static_cast<double>(delta) / options.warm_repetitions;
      Result(bench, name, adapter.Name(), count + "_warm", per_replay, CountUnit(count))
          .Int("repetitions", options.warm_repetitions)
          .Merge(common)
          .Print();
      if (count == "driver_ns") {
        Result(bench, name, adapter.Name(), "driver_ns_per_op_warm",
               per_replay / static_cast<double>(trace.ops.size()), "ns")
            .Int("repetitions", options.warm_repetitions)
            .Merge(common)
            .Print();
      }
    }
  }
  if (summary != nullptr) {
    summary->peak_reserved = peak_reserved;
    summary->peak_allocated = trace.peak_live_bytes;
    summary->ratio = static_cast<double>(peak_reserved) / peak_alloc;
    summary->counts = counts;
    summary->ns_per_op_cold = cold * 1e9 / static_cast<double>(trace.ops.size());
    summary->ns_per_op_warm = Median(warm_ns);
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Command line: --name=value arguments, for the programs that cannot use a flags library.

// Returns the value of --`name`=VALUE in argv, or `fallback`.
inline std::string FlagValue(int argc, char** argv, const std::string& name,
                             const std::string& fallback) {
  const std::string prefix = "--" + name + "=";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.compare(0, prefix.size(), prefix) == 0) return arg.substr(prefix.size());
  }
  return fallback;
}

// Splits "64,1024" into {"64", "1024"}.
inline std::vector<std::string> SplitList(const std::string& s) {
  std::vector<std::string> out;
  std::string item;
  std::istringstream in(s);
  while (std::getline(in, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

}  // namespace vmm_bench

#endif  // VMM_BENCH_ALLOC_WORKLOADS_H_
