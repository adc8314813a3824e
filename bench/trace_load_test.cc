// LoadTrace (alloc_workloads.h): the trace format replay and the peer benchmarks read, and the
// error every malformed trace gets.
#include <fstream>
#include <string>

#include "bench/alloc_workloads.h"
#include "gtest/gtest.h"

namespace {

std::string WriteTrace(const std::string& text) {
  static int n = 0;
  const std::string path =
      std::string(testing::TempDir()) + "/trace_" + std::to_string(n++) + ".txt";
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

// The error LoadTrace gives for `text`, or "" where it loads.
std::string LoadError(const std::string& text) {
  vmm_bench::Trace trace;
  std::string error;
  return vmm_bench::LoadTrace(WriteTrace(text), &trace, &error) ? "" : error;
}

TEST(LoadTrace, ReadsEventsIdsAndPeak) {
  vmm_bench::Trace trace;
  std::string error;
  ASSERT_TRUE(vmm_bench::LoadTrace(WriteTrace("a 7 100\na 3 50\nf 7\na 7 20\nf 3\nf 7\n"),
                                   &trace, &error))
      << error;
  ASSERT_EQ(trace.ops.size(), 6u);
  EXPECT_EQ(trace.allocs, 3u);
  EXPECT_EQ(trace.slots, 2u);
  EXPECT_EQ(trace.peak_live_bytes, 150);
  EXPECT_TRUE(trace.ops[0].alloc);
  EXPECT_EQ(trace.ops[0].bytes, 100u);
  EXPECT_EQ(trace.ops[0].slot, trace.ops[2].slot);  // the same ID, the same slot
  EXPECT_NE(trace.ops[0].slot, trace.ops[1].slot);
  EXPECT_FALSE(trace.ops[2].alloc);
}

TEST(LoadTrace, TakesCommentsBlankLinesCrlfTabsAndIdsThatAreNotNumbers) {
  vmm_bench::Trace trace;
  std::string error;
  ASSERT_TRUE(vmm_bench::LoadTrace(
      WriteTrace("# a header\n\n   \na\t0x7f00a0\t4096\r\n  # indented comment\nf 0x7f00a0\r\n"
                 "a  w.q  1\nf w.q"),
      &trace, &error))
      << error;
  EXPECT_EQ(trace.ops.size(), 4u);
  EXPECT_EQ(trace.slots, 2u);
  EXPECT_EQ(trace.peak_live_bytes, 4096);
}

TEST(LoadTrace, RefusesMalformedLinesNamingTheLine) {
  for (const char* bad : {"x 1 2", "a 1", "a 1 100 7", "f", "f 1 2", "A 1 100", "a 1 -5",
                          "a 1 +5", "a 1 1e6", "a 1 12abc", "a 1 0x10", "a 1 1.5",
                          "a 1 99999999999999999999", "a 1 9223372036854775808", "af 1"}) {
    const std::string error = LoadError(std::string("a 0 8\n") + bad + "\n");
    EXPECT_NE(error.find(":2: "), std::string::npos) << bad << " -> " << error;
  }
  EXPECT_NE(LoadError("a 1 -5\n").find("BYTES must be a whole number"), std::string::npos);
  EXPECT_NE(LoadError("a 1 100 7\n").find("expected 'a ID BYTES' or 'f ID'"), std::string::npos);
}

TEST(LoadTrace, TakesBytesUpTo2To63Minus1AndRefusesLiveBytesPastThem) {
  vmm_bench::Trace trace;
  std::string error;
  ASSERT_TRUE(vmm_bench::LoadTrace(WriteTrace("a 1 9223372036854775807\nf 1\na 2 5\n"), &trace,
                                   &error))
      << error;
  EXPECT_EQ(trace.peak_live_bytes, INT64_MAX);
  EXPECT_EQ(trace.ops[0].bytes, size_t{9223372036854775807u});
  // Two allocations that are each in range but together pass it: refused, not wrapped.
  EXPECT_NE(LoadError("a 1 9223372036854775807\na 2 1\n").find(":2: the live bytes would pass"),
            std::string::npos);
  EXPECT_NE(LoadError("a 1 4611686018427387904\na 2 4611686018427387904\n")
                .find(":2: the live bytes would pass"),
            std::string::npos);
}

TEST(LoadTrace, SplitsOnSpacesAndTabsOnlyAndTakesAByteOrderMark) {
  // A carriage return inside a line is part of a field, not a separator.
  EXPECT_NE(LoadError("a 1\r100\n").find(":1: expected"), std::string::npos);
  EXPECT_NE(LoadError("a 1 100\r\r\n").find(":1: BYTES"), std::string::npos);
  EXPECT_EQ(LoadError("\xEF\xBB\xBF" "a 1 100\nf 1\n"), "");
  // Only at the start of the file.
  EXPECT_NE(LoadError("a 1 100\n\xEF\xBB\xBF" "f 1\n").find(":2: expected"), std::string::npos);
  // IDs are text: "007" and "7" are two IDs.
  vmm_bench::Trace trace;
  std::string error;
  ASSERT_TRUE(vmm_bench::LoadTrace(
      WriteTrace("a 007 10\na 7 20\na 0 1\na 00 2\na -1 4\na 18446744073709551616 8\n"
                 "f 007\nf 7\nf 00\nf 0\nf 18446744073709551616\nf -1\n"),
      &trace, &error))
      << error;
  EXPECT_EQ(trace.slots, 6u);
  EXPECT_EQ(trace.peak_live_bytes, 45);
  EXPECT_NE(LoadError("a 7 1\na 7 2\n").find(":2: ID 7 allocated while live"), std::string::npos);
  EXPECT_NE(LoadError("a 007 1\nf 7\n").find(":2: ID 7 freed while not live"), std::string::npos);
}

TEST(LoadTrace, RefusesEventsOutOfOrder) {
  EXPECT_NE(LoadError("a 1 100\na 1 200\n").find(":2: ID 1 allocated while live"),
            std::string::npos);
  EXPECT_NE(LoadError("a 1 100\nf 2\n").find(":2: ID 2 freed while not live"),
            std::string::npos);
  EXPECT_NE(LoadError("a 1 100\nf 1\nf 1\n").find(":3: ID 1 freed while not live"),
            std::string::npos);
}

TEST(LoadTrace, RefusesTracesWithNothingToMeasure) {
  EXPECT_NE(LoadError("").find("has no events"), std::string::npos);
  EXPECT_NE(LoadError("# only a comment\n\n").find("has no events"), std::string::npos);
  EXPECT_NE(LoadError("a 1 0\nf 1\n").find("allocates no bytes"), std::string::npos);
  // Zero-byte allocations beside others are kept (PyTorch makes them).
  EXPECT_EQ(LoadError("a 1 0\na 2 64\nf 1\nf 2\n"), "");
  vmm_bench::Trace trace;
  std::string error;
  EXPECT_FALSE(vmm_bench::LoadTrace(testing::TempDir() + "/no/such/trace", &trace, &error));
  EXPECT_NE(error.find("cannot open trace"), std::string::npos);
}

}  // namespace
