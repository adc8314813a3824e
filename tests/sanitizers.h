// sanitizers.h: which sanitizer a test binary is built with, for tests that must do less
// under one (ThreadSanitizer cannot follow a thread started in a child forked from a process
// with threads, and slows timing-bound loops; both reserve shadow memory that a limit on the
// process's address space would bound too).
#ifndef VMM_TESTS_SANITIZERS_H_
#define VMM_TESTS_SANITIZERS_H_

#if defined(__SANITIZE_THREAD__)
#define VMM_UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define VMM_UNDER_TSAN 1
#endif
#endif
#ifndef VMM_UNDER_TSAN
#define VMM_UNDER_TSAN 0
#endif

#if defined(__SANITIZE_ADDRESS__)
#define VMM_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define VMM_UNDER_ASAN 1
#endif
#endif
#ifndef VMM_UNDER_ASAN
#define VMM_UNDER_ASAN 0
#endif

#endif  // VMM_TESTS_SANITIZERS_H_
