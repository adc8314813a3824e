"""Offline stand-in for rules_cc's defs.bzl: Bazel 4.2.3's native C++ rules."""

cc_binary = native.cc_binary
cc_import = native.cc_import
cc_library = native.cc_library
cc_test = native.cc_test
cc_toolchain = native.cc_toolchain
cc_toolchain_suite = native.cc_toolchain_suite
fdo_prefetch_hints = native.fdo_prefetch_hints
fdo_profile = native.fdo_profile
objc_import = native.objc_import
objc_library = native.objc_library
