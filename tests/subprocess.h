// subprocess.h: runs a helper program with pipes on its stdin and stdout (tests only).
//
//   Subprocess peer({"/path/share_peer", "import", "--descriptor=..."});
//   std::string line = peer.ReadLine();   // "" at end of output
//   peer.WriteLine("check");
//   int code = peer.Wait();                // exit code, or 128 + signal
// posix_spawn starts a fresh program, which is safe after CUDA is initialised (no plain fork).
// The child gets this process's environment, with the "NAME=value" entries of `env` added or
// replacing those of the same name (e.g. {"VMM_HOST_DEVICES=2"}).
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

class Subprocess {
 public:
  explicit Subprocess(const std::vector<std::string>& argv,
                      const std::vector<std::string>& env = {}) {
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) std::abort();
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, in[0], 0);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
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

  // The next line of the child's output without its newline; "" at the end.
  std::string ReadLine() {
    std::string line;
    int c;
    while ((c = fgetc(from_child_)) != EOF && c != '\n') line.push_back(static_cast<char>(c));
    return line;
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

}  // namespace vmm

#endif  // VMM_TESTS_SUBPROCESS_H_
