// unique_fd.h: an owned POSIX file descriptor, closed when the owner goes away.
//
//   UniqueFd fd(memfd_create("x", MFD_CLOEXEC));
//   if (!fd.valid()) return ErrnoStatus("memfd_create");
//   int raw = fd.release();  // caller now owns `raw`
#ifndef VMM_ALLOCATOR_UNIQUE_FD_H_
#define VMM_ALLOCATOR_UNIQUE_FD_H_

#include <unistd.h>

#include <utility>

namespace vmm {

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Gives up ownership; the caller must close the returned descriptor.
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

}  // namespace vmm

#endif  // VMM_ALLOCATOR_UNIQUE_FD_H_
