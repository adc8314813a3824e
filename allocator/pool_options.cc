#include "allocator/pool_options.h"

#include <algorithm>
#include <cstdint>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "allocator/byte_size.h"
#include "allocator/status_macros.h"

namespace vmm {
namespace {

// A size option, and the word besides a size it takes (nullptr: none) with the value it sets.
struct SizeKey {
  const char* name;
  size_t PoolOptions::*field;
  const char* word = nullptr;
  size_t word_value = 0;
  bool bounded = false;  // at most kMaxOptionBytes (the pool rounds it up or adds it up)
};
constexpr SizeKey kSizeKeys[] = {
    {"reserve_size", &PoolOptions::reserve_size, nullptr, 0, true},
    {"memory_limit", &PoolOptions::memory_limit},
    {"release_threshold", &PoolOptions::release_threshold},
    {"small_size", &PoolOptions::small_size, "auto", kAutoSize},
    {"small_chunk", &PoolOptions::small_chunk, nullptr, 0, true},
    {"max_growth_extra", &PoolOptions::max_growth_extra},
    {"max_chunk", &PoolOptions::max_chunk},
    {"large_page", &PoolOptions::large_page, "auto", kAutoSize, true},
    {"growth_page", &PoolOptions::growth_page, "auto", kAutoSize},
    {"growth_page_from", &PoolOptions::growth_page_from, "auto", kAutoSize},
    {"pressure_page", &PoolOptions::pressure_page, "auto", kAutoSize, true},
    {"spare_export_bytes", &PoolOptions::spare_export_bytes, "unlimited", SIZE_MAX},
};

absl::Status Invalid(absl::string_view key, absl::string_view value, absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("option ", key, ": '", value, "' is not ", what));
}

absl::Status Apply(absl::string_view key, absl::string_view value, PoolOptions& o) {
  if (key == "handle_type") {
    const std::optional<HandleRequest> request = ParseHandleRequest(value);
    if (!request) return Invalid(key, value, "one of auto, none, posix_fd, fabric");
    o.handle_type = *request;
    return absl::OkStatus();
  }
  if (key == "growth_fraction") {
    double f;
    if (!absl::SimpleAtod(value, &f) || !(f >= 0 && f <= 1)) {
      return Invalid(key, value, "a number in [0, 1]");
    }
    o.growth_fraction = f;
    return absl::OkStatus();
  }
  if (key == "isolate_sends") {
    if (value == "1" || value == "true") {
      o.isolate_sends = true;
    } else if (value == "0" || value == "false") {
      o.isolate_sends = false;
    } else {
      return Invalid(key, value, "one of 0, 1, false, true");
    }
    return absl::OkStatus();
  }
  if (key == "peer_devices") {
    o.peer_devices.clear();
    for (absl::string_view d : absl::StrSplit(value, ':', absl::SkipEmpty())) {
      int device;
      if (!absl::SimpleAtoi(d, &device) || device < 0) {
        return Invalid(key, d, "a device index");
      }
      o.peer_devices.push_back(device);
    }
    return absl::OkStatus();
  }
  for (const SizeKey& k : kSizeKeys) {
    if (key != k.name) continue;
    if (k.word != nullptr && value == k.word) {
      o.*k.field = k.word_value;
      return absl::OkStatus();
    }
    absl::StatusOr<uint64_t> bytes = ParseByteSize(value);
    if (!bytes.ok()) return Invalid(key, value, "a size in bytes (e.g. 512M)");
    if (k.bounded && *bytes > kMaxOptionBytes) return Invalid(key, value, "at most 256T");
    o.*k.field = static_cast<size_t>(*bytes);
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown option '", key, "'; options are ", PoolOptionKeys()));
}

}  // namespace

PoolOptions ResolveAutoSizes(const PoolOptions& options, bool exportable) {
  PoolOptions out = options;
  if (out.large_page == kAutoSize) out.large_page = exportable ? 0 : size_t{4} << 20;
  if (out.small_size == kAutoSize) {
    out.small_size = out.large_page != 0 ? size_t{256} << 10 : size_t{1} << 20;
  }
  return out;
}

absl::Status CheckPoolOptions(const PoolOptions& options, bool exportable) {
  if (!(options.growth_fraction >= 0 && options.growth_fraction <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("growth_fraction ", options.growth_fraction, " is outside [0, 1]"));
  }
  if (options.small_size == 0 || options.small_chunk == 0 || options.max_chunk == 0) {
    return absl::InvalidArgumentError("small_size, small_chunk and max_chunk must be positive");
  }
  // Sizes the pool rounds up to the granularity or adds up: no range or chunk of more than
  // 2^48 bytes (256 TiB) is possible, and past 2^64 the sums would wrap.
  for (auto [name, value] : {std::pair<const char*, size_t>{"small_chunk", options.small_chunk},
                             {"reserve_size", options.reserve_size}}) {
    if (value > kMaxOptionBytes) {
      return absl::InvalidArgumentError(absl::StrCat(name, " ", value, " is more than ",
                                                     kMaxOptionBytes, " bytes (256 TiB)"));
    }
  }
  const PoolOptions resolved = ResolveAutoSizes(options, exportable);
  if (resolved.large_page > std::min(resolved.max_chunk, kMaxOptionBytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "large_page ", resolved.large_page, " is larger than max_chunk ", resolved.max_chunk,
        ": a page is one physical chunk"));
  }
  // (A pool with pages has none to switch to: pressure_page is not used there.)
  if (resolved.large_page == 0 && resolved.pressure_page != kAutoSize &&
      resolved.pressure_page > std::min(resolved.max_chunk, kMaxOptionBytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pressure_page ", resolved.pressure_page, " is larger than max_chunk ",
        resolved.max_chunk, ": a page is one physical chunk"));
  }
  return absl::OkStatus();
}

absl::string_view PoolOptionKeys() {
  return "handle_type, reserve_size, memory_limit, release_threshold, small_size, small_chunk, "
         "growth_fraction, max_growth_extra, max_chunk, large_page, growth_page, growth_page_from, "
         "pressure_page, peer_devices, spare_export_bytes, isolate_sends";
}

absl::StatusOr<PoolOptions> ParsePoolOptions(absl::string_view text,
                                             const PoolOptions& defaults) {
  PoolOptions options = defaults;
  absl::flat_hash_set<std::string> seen;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    const size_t eq = item.find('=');
    const absl::string_view key = absl::StripAsciiWhitespace(item.substr(0, eq));
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("option '", key, "' has no value (options are key=value)"));
    }
    if (!seen.insert(std::string(key)).second) {
      return absl::InvalidArgumentError(absl::StrCat("option ", key, " is given twice"));
    }
    VMM_RETURN_IF_ERROR(Apply(key, absl::StripAsciiWhitespace(item.substr(eq + 1)), options));
  }
  return options;
}

}  // namespace vmm
