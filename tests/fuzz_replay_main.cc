// A main() for fuzz targets built without libFuzzer: runs LLVMFuzzerTestOneInput once on each
// file named on the command line, and on each regular file directly inside each directory
// named there (not recursively). Prints how many inputs it ran and exits 0; a target that
// finds a bug aborts. An argument that cannot be read exits 1.
//
//   bazel-bin/tests/descriptor_fuzzer tests/descriptor_corpus crash-1234
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

namespace fs = std::filesystem;

// Reads `path` whole; false when it cannot be read.
bool ReadFile(const fs::path& path, std::string* contents) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  contents->assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return !in.bad();
}

// The files an argument names: itself, or a directory's regular files in name order (so that
// runs are repeatable). False, with a message, when it names neither.
bool ListInputs(const fs::path& arg, std::vector<fs::path>* inputs) {
  std::error_code error;
  if (!fs::is_directory(arg, error)) {
    if (!fs::is_regular_file(arg, error)) {
      std::fprintf(stderr, "fuzz_replay: %s is not a file or directory\n", arg.c_str());
      return false;
    }
    inputs->push_back(arg);
    return true;
  }
  std::vector<fs::path> files;
  for (fs::directory_iterator it(arg, error), end; !error && it != end; it.increment(error)) {
    if (it->is_regular_file(error)) files.push_back(it->path());
  }
  if (error) {
    std::fprintf(stderr, "fuzz_replay: cannot list %s: %s\n", arg.c_str(),
                 error.message().c_str());
    return false;
  }
  std::sort(files.begin(), files.end());
  inputs->insert(inputs->end(), files.begin(), files.end());
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<fs::path> inputs;
  for (int i = 1; i < argc; ++i) {
    if (!ListInputs(argv[i], &inputs)) return 1;
  }
  std::string contents;
  for (const fs::path& input : inputs) {
    if (!ReadFile(input, &contents)) {
      std::fprintf(stderr, "fuzz_replay: cannot read %s\n", input.c_str());
      return 1;
    }
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(contents.data()), contents.size());
  }
  std::printf("fuzz_replay: ran %zu inputs\n", inputs.size());
  return 0;
}
