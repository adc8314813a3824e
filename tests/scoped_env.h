// scoped_env.h: sets (or unsets) an environment variable for a scope, then restores it.
//
//   ScopedEnv env("VMM_BACKEND", "host");     // std::nullopt unsets it
#ifndef VMM_TESTS_SCOPED_ENV_H_
#define VMM_TESTS_SCOPED_ENV_H_

#include <cstdlib>
#include <optional>
#include <string>

namespace vmm {

class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    Set(value);
  }
  ~ScopedEnv() { Set(old_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  void Set(const std::optional<std::string>& value) {
    if (value.has_value()) {
      ::setenv(name_.c_str(), value->c_str(), /*overwrite=*/1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }
  std::string name_;
  std::optional<std::string> old_;
};

}  // namespace vmm

#endif  // VMM_TESTS_SCOPED_ENV_H_
