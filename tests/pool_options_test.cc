// Tests of the one option parser (pool_options.h) and the one byte-size parser (byte_size.h).
#include "allocator/pool_options.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "allocator/byte_size.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace vmm {
namespace {

using ::testing::HasSubstr;

TEST(ByteSizeTest, ParsesNumbersWithUnits) {
  EXPECT_EQ(*ParseByteSize("0"), 0u);
  EXPECT_EQ(*ParseByteSize("4096"), 4096u);
  EXPECT_EQ(*ParseByteSize("2K"), 2048u);
  EXPECT_EQ(*ParseByteSize("512m"), 512u << 20);
  EXPECT_EQ(*ParseByteSize(" 3G "), uint64_t{3} << 30);
  EXPECT_EQ(*ParseByteSize("1T"), uint64_t{1} << 40);
  EXPECT_EQ(*ParseByteSize("64MiB"), uint64_t{64} << 20);
  EXPECT_EQ(*ParseByteSize("2KB"), 2048u);
  EXPECT_EQ(*ParseByteSize("100B"), 100u);
  EXPECT_EQ(*ParseByteSize("18446744073709551615"), UINT64_MAX);
}

TEST(ByteSizeTest, RejectsEverythingElseNamingTheText) {
  for (const char* bad : {"", " ", "M", "-1", "+1", "1.5G", "1X", "0x10", "1 G", "iB", "5iB",
                          "16777216T", "18446744073709551616", "1GG"}) {
    absl::StatusOr<uint64_t> n = ParseByteSize(bad);
    EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument) << "'" << bad << "'";
    EXPECT_THAT(n.status().message(), HasSubstr(std::string("'") + bad + "'"));
  }
}

TEST(ByteSizeTest, FormatsForPeople) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(1023), "1023 B");
  EXPECT_EQ(FormatBytes(1024), "1.00 KiB");
  EXPECT_EQ(FormatBytes(int64_t{3} << 29), "1.50 GiB");
  EXPECT_EQ(FormatBytes(-2048), "-2.00 KiB");
}

TEST(PoolOptionsTest, EmptyTextGivesTheDefaults) {
  PoolOptions defaults;
  defaults.growth_fraction = 0.25;
  absl::StatusOr<PoolOptions> o = ParsePoolOptions("", defaults);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->growth_fraction, 0.25);
  EXPECT_EQ(o->handle_type, HandleRequest::kAuto);
}

TEST(PoolOptionsTest, EveryKeyIsApplied) {
  absl::StatusOr<PoolOptions> o = ParsePoolOptions(
      "handle_type=posix_fd, reserve_size=8G, memory_limit=40G, release_threshold=1G,"
      "small_size=512K, small_chunk=4M, growth_fraction=0.1, max_growth_extra=128M,"
      "max_chunk=1G, peer_devices=1:2, spare_export_bytes=16M, isolate_sends=true");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->handle_type, HandleRequest::kPosixFd);
  EXPECT_EQ(o->reserve_size, size_t{8} << 30);
  EXPECT_EQ(o->memory_limit, size_t{40} << 30);
  EXPECT_EQ(o->release_threshold, size_t{1} << 30);
  EXPECT_EQ(o->small_size, size_t{512} << 10);
  EXPECT_EQ(o->small_chunk, size_t{4} << 20);
  EXPECT_DOUBLE_EQ(o->growth_fraction, 0.1);
  EXPECT_EQ(o->max_growth_extra, size_t{128} << 20);
  EXPECT_EQ(o->max_chunk, size_t{1} << 30);
  EXPECT_EQ(o->peer_devices, (std::vector<int>{1, 2}));
  EXPECT_EQ(o->spare_export_bytes, size_t{16} << 20);
  EXPECT_TRUE(o->isolate_sends);
  for (const char* name : {"auto", "none", "fabric"}) {
    EXPECT_TRUE(ParsePoolOptions(std::string("handle_type=") + name).ok()) << name;
  }
}

// Pages of the large arena that a miss may move (reclaim_policy.h) and the small arena's limit
// are left to the pool unless told ("auto"): 8 MiB pages and 256 KiB for a pool that does not
// export, no pages and 1 MiB for one made to export; explicit values are kept.
TEST(PoolOptionsTest, LargePageAndSmallSizeAreLeftToThePoolUnlessTold) {
  EXPECT_EQ(PoolOptions().large_page, kAutoSize);
  EXPECT_EQ(PoolOptions().small_size, kAutoSize);
  const PoolOptions plain = ResolveAutoSizes(PoolOptions(), /*exportable=*/false);
  EXPECT_EQ(plain.large_page, size_t{4} << 20);
  EXPECT_EQ(plain.small_size, size_t{256} << 10);
  const PoolOptions exportable = ResolveAutoSizes(PoolOptions(), /*exportable=*/true);
  EXPECT_EQ(exportable.large_page, 0u);
  EXPECT_EQ(exportable.small_size, size_t{1} << 20);
  absl::StatusOr<PoolOptions> o = ParsePoolOptions("large_page=32M");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->large_page, size_t{32} << 20);
  EXPECT_EQ(ResolveAutoSizes(*o, /*exportable=*/true).large_page, size_t{32} << 20);
  EXPECT_EQ(ResolveAutoSizes(*o, /*exportable=*/true).small_size, size_t{256} << 10);
  o = ParsePoolOptions("large_page=0,small_size=64K");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(ResolveAutoSizes(*o, /*exportable=*/false).large_page, 0u);
  EXPECT_EQ(ResolveAutoSizes(*o, /*exportable=*/false).small_size, size_t{64} << 10);
  o = ParsePoolOptions("large_page=8M,small_size=auto");
  ASSERT_TRUE(o.ok()) << o.status();
  o = ParsePoolOptions("large_page=auto", *o);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->large_page, kAutoSize);
  EXPECT_EQ(o->small_size, kAutoSize);
  EXPECT_FALSE(ParsePoolOptions("large_page=big").ok());
  EXPECT_FALSE(ParsePoolOptions("max_chunk=auto").ok());
}

// The chunks of a pool's growths before it first moves memory (pool_options.h growth_page):
// left to the pool unless told (it is four of the pool's pages, once their size is rounded to
// the granularity: tests/reclaim_test.cc); "auto" gives it back to the pool, a malformed size
// is refused naming the option.
TEST(PoolOptionsTest, GrowthPageIsLeftToThePoolUnlessTold) {
  EXPECT_EQ(PoolOptions().growth_page, kAutoSize);
  EXPECT_EQ(ResolveAutoSizes(PoolOptions(), /*exportable=*/false).growth_page, kAutoSize);
  absl::StatusOr<PoolOptions> o = ParsePoolOptions("large_page=4M,growth_page=64M");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(ResolveAutoSizes(*o, /*exportable=*/false).growth_page, size_t{64} << 20);
  o = ParsePoolOptions("growth_page=auto", *o);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->growth_page, kAutoSize);
  o = ParsePoolOptions("growth_page_from=0");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->growth_page_from, 0u);
  o = ParsePoolOptions("growth_page_from=auto", *o);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->growth_page_from, kAutoSize);
  EXPECT_FALSE(ParsePoolOptions("growth_page_from=-1").ok());
  // pressure_page: auto (the pool decides: 4 MiB without pages), 0 (never), a size.
  EXPECT_EQ(PoolOptions().pressure_page, kAutoSize);
  o = ParsePoolOptions("pressure_page=8M");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->pressure_page, size_t{8} << 20);
  o = ParsePoolOptions("pressure_page=0", *o);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->pressure_page, 0u);
  o = ParsePoolOptions("pressure_page=auto", *o);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->pressure_page, kAutoSize);
  EXPECT_FALSE(ParsePoolOptions("pressure_page=-1").ok());
  o = ParsePoolOptions("growth_page=lots");
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(o.status().message(), HasSubstr("growth_page"));
}

// Sends in place with their neighbours unless told to isolate (pool_options.h).
TEST(PoolOptionsTest, IsolateSendsIsOffUnlessToldAndTakesOnlyBooleans) {
  EXPECT_FALSE(PoolOptions().isolate_sends);
  for (const auto& [text, want] : std::vector<std::pair<const char*, bool>>{
           {"isolate_sends=1", true}, {"isolate_sends=true", true},
           {"isolate_sends=0", false}, {"isolate_sends = false", false}}) {
    absl::StatusOr<PoolOptions> o = ParsePoolOptions(text);
    ASSERT_TRUE(o.ok()) << text << ": " << o.status();
    EXPECT_EQ(o->isolate_sends, want) << text;
  }
  for (const char* bad : {"isolate_sends=yes", "isolate_sends=2", "isolate_sends=",
                          "isolate_sends=True"}) {
    absl::StatusOr<PoolOptions> o = ParsePoolOptions(bad);
    EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(o.status().message(), HasSubstr("isolate_sends")) << bad;
  }
}

// Exported chunks kept for reuse (pool.h): no cap unless told; 0 turns the reuse off.
TEST(PoolOptionsTest, SpareExportBytesDefaultsToNoCapAndMayBeZero) {
  EXPECT_EQ(PoolOptions().spare_export_bytes, SIZE_MAX);
  absl::StatusOr<PoolOptions> o = ParsePoolOptions("");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->spare_export_bytes, SIZE_MAX);
  o = ParsePoolOptions("spare_export_bytes=64M");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->spare_export_bytes, size_t{64} << 20);
  o = ParsePoolOptions("spare_export_bytes=unlimited");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->spare_export_bytes, SIZE_MAX);
  o = ParsePoolOptions("spare_export_bytes=0");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->spare_export_bytes, 0u);
  o = ParsePoolOptions("spare_export_bytes=1G");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->spare_export_bytes, size_t{1} << 30);
  for (const char* bad : {"spare_export_bytes=-1", "spare_export_bytes=lots",
                          "spare_export_bytes=auto",
                          "spare_export_bytes=1.5G", "spare_export_bytes"}) {
    o = ParsePoolOptions(bad);
    EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(o.status().message(), HasSubstr("spare_export_bytes")) << bad;
  }
  EXPECT_THAT(ParsePoolOptions("large_page=unlimited").status().message(),
              HasSubstr("option large_page: 'unlimited' is not a size"));
  EXPECT_THAT(ParsePoolOptions("spare_export_bytes=1M,spare_export_bytes=2M").status().message(),
              HasSubstr("spare_export_bytes is given twice"));
  // An unknown key's message lists it among the options.
  EXPECT_THAT(ParsePoolOptions("spare=1").status().message(), HasSubstr("spare_export_bytes"));
}

TEST(PoolOptionsTest, MalformedTextIsAnErrorNamingIt) {
  struct Case {
    const char* text;
    const char* names;
  };
  for (const Case& c : {Case{"bogus=1", "unknown option 'bogus'"},
                        Case{"memory_limit", "'memory_limit' has no value"},
                        Case{"memory_limit=lots", "option memory_limit: 'lots'"},
                        Case{"memory_limit=-1", "option memory_limit: '-1'"},
                        Case{"growth_fraction=2", "option growth_fraction: '2'"},
                        Case{"growth_fraction=nan", "option growth_fraction: 'nan'"},
                        Case{"handle_type=ipc", "option handle_type: 'ipc'"},
                        Case{"peer_devices=1:x", "option peer_devices: 'x'"},
                        Case{"peer_devices=-1", "option peer_devices: '-1'"},
                        Case{"max_chunk=1G,max_chunk=2G", "max_chunk is given twice"},
                        // Sizes the pool rounds up: past 256 TiB at parse time, so that a
                        // process-wide configuration fails where it is given.
                        Case{"small_chunk=257T", "option small_chunk: '257T' is not at most 256T"},
                        Case{"reserve_size=18446744073709551615", "option reserve_size"},
                        Case{"large_page=18446744073709551615", "option large_page"},
                        Case{"pressure_page=257T", "option pressure_page: '257T'"}}) {
    absl::StatusOr<PoolOptions> o = ParsePoolOptions(c.text);
    EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(o.status().message(), HasSubstr(c.names)) << c.text;
  }
}

TEST(PoolOptionsTest, HandleRequestsParse) {
  EXPECT_EQ(ParseHandleRequest("auto"), HandleRequest::kAuto);
  EXPECT_EQ(ParseHandleRequest("none"), HandleRequest::kNone);
  EXPECT_EQ(ParseHandleRequest("posix_fd"), HandleRequest::kPosixFd);
  EXPECT_EQ(ParseHandleRequest("fabric"), HandleRequest::kFabric);
  EXPECT_EQ(ParseHandleRequest("Fabric"), std::nullopt);
}

}  // namespace
}  // namespace vmm
