// subprocess.h: runs a helper program with pipes on its stdin and stdout (tests, the demo and
// the benchmarks).
//
//   Subprocess peer({HelperProgramPath("tools/vmm_peer"), "import", "--descriptor=..."});
//   std::string line = peer.ReadLine();   // "" at end of output
//   peer.WriteLine("check");
//   int code = peer.Wait();                // exit code, or 128 + signal
// posix_spawn starts a fresh program, which is safe after CUDA is initialised (no plain fork).
// The child gets this process's environment, with the "NAME=value" entries of `env` added or
// replacing those of the same name (e.g. {"VMM_HOST_DEVICES=2"}), and inherits the
// descriptors that lack FD_CLOEXEC. With Output::kWithStderr its stderr goes to the same pipe
// as its stdout (ReadAll() then collects both).
#ifndef VMM_TESTS_SUBPROCESS_H_
#define VMM_TESTS_SUBPROCESS_H_

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

extern char** environ;

namespace vmm {

// This process's environment with the "NAME=value" entries of `overrides` added, each
// replacing any entry of the same name.
inline std::vector<std::string> EnvironmentWith(const std::vector<std::string>& overrides) {
  auto same_name = [](const char* entry, const std::string& other) {
    const size_t eq = other.find('=');
    return eq != std::string::npos && std::strncmp(entry, other.c_str(), eq + 1) == 0;
  };
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    bool replaced = false;
    for (const std::string& o : overrides) replaced = replaced || same_name(*e, o);
    if (!replaced) env.emplace_back(*e);
  }
  env.insert(env.end(), overrides.begin(), overrides.end());
  return env;
}

// The argv/envp form of `strings`: pointers into them, then nullptr.
inline std::vector<char*> NullTerminated(const std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (const std::string& s : strings) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

// The path of a program of this workspace, given as its path in the workspace (e.g.
// "tools/vmm_peer"), built as a `data` dependency of the caller: under $TEST_SRCDIR/vmm/ (a
// test, or any program run with TEST_SRCDIR set), under $RUNFILES_DIR/vmm/, under this
// program's own runfiles (bazel run), else beside this program. The first that is an
// executable file; the last candidate when none is (starting it then fails).
inline std::string HelperProgramPath(const std::string& workspace_path) {
  std::vector<std::string> candidates;
  for (const char* variable : {"TEST_SRCDIR", "RUNFILES_DIR"}) {
    const char* dir = std::getenv(variable);
    if (dir != nullptr && dir[0] != '\0') {
      candidates.push_back(std::string(dir) + "/vmm/" + workspace_path);
    }
  }
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n > 0) {
    const std::string exe(self, static_cast<size_t>(n));
    candidates.push_back(exe + ".runfiles/vmm/" + workspace_path);
    const std::string name = workspace_path.substr(workspace_path.rfind('/') + 1);
    candidates.push_back(exe.substr(0, exe.rfind('/') + 1) + name);
  }
  if (candidates.empty()) return workspace_path;
  for (const std::string& path : candidates) {
    if (access(path.c_str(), X_OK) == 0) return path;
  }
  return candidates.back();
}

class Subprocess {
 public:
  // Where the child's stderr goes: this process's stderr, or the pipe of its stdout.
  enum class Output { kStdout, kWithStderr };

  explicit Subprocess(const std::vector<std::string>& argv,
                      const std::vector<std::string>& env = {},
                      Output output = Output::kStdout) {
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) std::abort();
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, in[0], 0);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
    if (output == Output::kWithStderr) posix_spawn_file_actions_adddup2(&actions, out[1], 2);
    std::vector<char*> args = NullTerminated(argv);
    const std::vector<std::string> env_strings = EnvironmentWith(env);
    std::vector<char*> envp = NullTerminated(env_strings);
    if (posix_spawn(&pid_, args[0], &actions, nullptr, args.data(), envp.data()) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&actions);
    close(in[0]);
    close(out[1]);
    to_child_ = in[1];
    from_child_ = fdopen(out[0], "r");
  }
  ~Subprocess() {
    if (to_child_ >= 0) close(to_child_);
    if (from_child_ != nullptr) fclose(from_child_);
    if (pid_ > 0 && !waited_) {
      kill(pid_, SIGKILL);
      Wait();
    }
  }

  bool started() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }

  // The next line of the child's output without its newline; "" at the end.
  std::string ReadLine() {
    std::string line;
    int c;
    while ((c = fgetc(from_child_)) != EOF && c != '\n') line.push_back(static_cast<char>(c));
    return line;
  }
  // The rest of the child's output, to its end.
  std::string ReadAll() {
    std::string text;
    int c;
    while ((c = fgetc(from_child_)) != EOF) text.push_back(static_cast<char>(c));
    return text;
  }
  void WriteLine(const std::string& line) {
    const std::string text = line + "\n";
    if (write(to_child_, text.data(), text.size()) < 0) perror("write to child");
  }
  void CloseInput() {
    close(to_child_);
    to_child_ = -1;
  }
  // Waits for the child; its exit code, or 128 + the signal that ended it.
  int Wait() {
    int status = 0;
    if (waitpid(pid_, &status, 0) < 0) return -1;
    waited_ = true;
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    return 128 + WTERMSIG(status);
  }

 private:
  pid_t pid_ = -1;
  int to_child_ = -1;
  FILE* from_child_ = nullptr;
  bool waited_ = false;
};

// Runs `child` (returning an int) in a forked process and returns its exit code, or 128 +
// signal. The child reports a failed check by its exit code, since gtest's state is the
// parent's; it must not start threads where the parent has many (the fork copies one).
template <typename F>
int InForkedChild(F child) {
  const pid_t pid = fork();
  if (pid == 0) _exit(child());
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace vmm

#endif  // VMM_TESTS_SUBPROCESS_H_
