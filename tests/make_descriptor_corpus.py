#!/usr/bin/env python3
"""Writes the seed corpus of descriptor_fuzzer into tests/descriptor_corpus/.

The encoding is written here independently of descriptor.cc, from the layout in
allocator/descriptor.h, so the corpus also checks that the two agree: every `valid_*` seed must
decode and re-encode to itself (descriptor_fuzzer traps otherwise), and every `bad_*` seed must
be rejected.

    python3 tests/make_descriptor_corpus.py [OUTPUT_DIR]
"""

import os
import struct
import sys

POSIX_FD = 1
FABRIC = 2
MIB = 1 << 20


def handle(seed):
    """A distinct 64-byte handle."""
    return bytes((seed * 37 + i) & 0xFF for i in range(64))


def encode(handle_type, sizes, size=None, offset=0, owner=None, version=1, magic=b"VMMD"):
    """The version 1 encoding (see allocator/descriptor.h); size defaults to the rest."""
    total = sum(sizes)
    if size is None:
        size = total - offset
    owner_bytes = b"" if owner is None else owner
    flags = 0 if owner is None else 1
    out = magic + struct.pack(
        "<HBBIIQQ", version, handle_type, flags, len(sizes), len(owner_bytes), size, offset)
    out += b"".join(struct.pack("<Q", s) for s in sizes)
    out += b"".join(handle(i) for i in range(len(sizes)))
    out += owner_bytes
    return out + b"\0" * (-len(out) % 8)


UUID = b"GPU-6c1b9a5e-8d2f-4b3a-9e7c-0123456789ab"

SEEDS = {
    "valid_fabric_empty": encode(FABRIC, []),
    "valid_posix_fd_empty_owner": encode(POSIX_FD, [], owner=b""),
    "valid_fabric_one": encode(FABRIC, [2 * MIB]),
    "valid_posix_fd_one": encode(POSIX_FD, [2 * MIB]),
    "valid_fabric_one_owner": encode(FABRIC, [2 * MIB], owner=UUID),
    "valid_posix_fd_one_offset_owner": encode(
        POSIX_FD, [4 * MIB], size=MIB, offset=4096, owner=UUID),
    "valid_fabric_three": encode(FABRIC, [2 * MIB, 4 * MIB, 2 * MIB]),
    "valid_fabric_three_offset_owner": encode(
        FABRIC, [2 * MIB, 4 * MIB, 2 * MIB], size=5 * MIB, offset=2 * MIB + 512, owner=b"GPU-abc"),
    "valid_posix_fd_three_small": encode(POSIX_FD, [1, 2, 3], size=2, offset=3),
    "valid_posix_fd_three_owner": encode(POSIX_FD, [2 * MIB] * 3, owner=UUID),
    "bad_truncated_header": encode(FABRIC, [2 * MIB])[:20],
    "bad_truncated_body": encode(FABRIC, [2 * MIB, 2 * MIB], owner=UUID)[:150],
    "bad_magic": encode(FABRIC, [2 * MIB], magic=b"VMMX"),
    "bad_version": encode(FABRIC, [2 * MIB], version=2),
    "bad_handle_type": encode(3, [2 * MIB]),
    "bad_size_beyond_allocations": encode(FABRIC, [2 * MIB], size=2 * MIB + 1),
    "bad_nonzero_padding": encode(FABRIC, [2 * MIB], owner=b"abc")[:-1] + b"\x01",
}


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "descriptor_corpus")
    os.makedirs(out_dir, exist_ok=True)
    for name, data in sorted(SEEDS.items()):
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(data)
    print(f"wrote {len(SEEDS)} seeds to {out_dir}")


if __name__ == "__main__":
    main()
