// LoadTrace (alloc_workloads.h): the trace format replay and the peer benchmarks read, and the
// error every malformed trace gets.
#include <cstdio>
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
