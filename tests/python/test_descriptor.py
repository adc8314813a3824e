"""FabricBufferDescriptor / PosixFdBufferDescriptor: the seed's rules, attributes, encoding."""

import pickle

import pytest

import vmm_torch
from vmm_torch import BufferDescriptor, FabricBufferDescriptor, PosixFdBufferDescriptor

H0 = bytes(range(64))
H1 = bytes(range(64, 128))
H2 = b"\xff" * 64
MIB = 1 << 20

BOTH = [FabricBufferDescriptor, PosixFdBufferDescriptor]


@pytest.mark.parametrize("cls", BOTH)
def test_defaults_and_attributes(cls):
    d = cls.from_handles([H0, H1], [2 * MIB, 4 * MIB])
    assert d.handle_type == ("fabric" if cls is FabricBufferDescriptor else "posix_fd")
    assert d.handles == (H0, H1)
    assert isinstance(d.handles, tuple) and all(isinstance(h, bytes) for h in d.handles)
    assert d.sizes == (2 * MIB, 4 * MIB)
    assert isinstance(d.sizes, tuple)
    assert d.size == 6 * MIB  # defaults to the sum
    assert d.owner_uuid is None
    assert d.offset == 0
    assert d.mapped_size == 6 * MIB
    assert isinstance(d, BufferDescriptor)


def test_fabric_handle_type_is_always_fabric():
    d = FabricBufferDescriptor.from_handles([H0], [MIB], size=10, owner_uuid="GPU-1234")
    assert d.handle_type == "fabric"
    assert FabricBufferDescriptor.handle_type == "fabric"
    assert d.size == 10
    assert d.owner_uuid == "GPU-1234"


def test_explicit_size_bounds_are_inclusive():
    assert FabricBufferDescriptor.from_handles([H0], [MIB], size=0).size == 0
    assert FabricBufferDescriptor.from_handles([H0], [MIB], size=MIB).size == MIB


def test_offset():
    d = FabricBufferDescriptor.from_handles([H0, H1], [MIB, MIB], offset=512)
    assert d.offset == 512
    assert d.size == 2 * MIB - 512
    d = FabricBufferDescriptor.from_handles([H0, H1], [MIB, MIB], size=100, offset=512)
    assert (d.offset, d.size) == (512, 100)


def test_empty_descriptor_is_allowed():
    d = FabricBufferDescriptor.from_handles([], [])
    assert d.handles == () and d.sizes == () and d.size == 0


def test_iterables_are_accepted():
    d = FabricBufferDescriptor.from_handles(iter([bytearray(H0), memoryview(H1)]),
                                            (s for s in [MIB, MIB]))
    assert d.handles == (H0, H1)


# --- The seed's errors -------------------------------------------------------------------------


def check_error(match, *args, **kwargs):
    with pytest.raises(ValueError, match=match):
        FabricBufferDescriptor.from_handles(*args, **kwargs)


def test_counts_differ():
    check_error(r"^2 handles but 1 size$", [H0, H1], [MIB])
    check_error(r"^1 handle but 2 sizes$", [H0], [MIB, MIB])
    check_error(r"^0 handles but 1 size$", [], [MIB])


def test_handle_not_64_bytes():
    check_error(r"^handle 1 is 63 bytes, expected 64$", [H0, H1[:63]], [MIB, MIB])
    check_error(r"^handle 0 is 65 bytes, expected 64$", [H0 + b"x"], [MIB])
    check_error(r"^handle 0 is 0 bytes, expected 64$", [b""], [MIB])


def test_handle_not_bytes():
    check_error(r"^handle 0 is a str, expected 64 bytes$", ["x" * 64], [MIB])
    check_error(r"^handle 1 is a int, expected 64 bytes$", [H0, 7], [MIB, MIB])


def test_size_not_positive():
    check_error(r"^allocation size 0 is 0, expected a positive integer$", [H0], [0])
    check_error(r"^allocation size 1 is -4096, expected a positive integer$", [H0, H1],
                [MIB, -4096])


@pytest.mark.parametrize("bad", [True, 1.0, 2.5, "4096", None])
def test_size_not_an_integer(bad):
    check_error(r"^allocation size 0 is .*expected a positive integer$", [H0], [bad])


def test_size_beyond_int64():
    check_error(r"^allocation size 0 is 9223372036854775808", [H0], [2**63])
    check_error(r"^allocation size 0 is -9223372036854775809, expected a positive integer$",
                [H0], [-(2**63) - 1])


def test_buffer_size_outside_allocations():
    check_error(r"^size 3145729 is outside \[0, 3145728\]$", [H0, H1], [MIB, 2 * MIB],
                size=3 * MIB + 1)
    check_error(r"^size -1 is outside \[0, 1048576\]$", [H0], [MIB], size=-1)
    check_error(r"^size -5 is outside \[0, 1048576\]$", [H0], [MIB], size=-5)
    check_error(r"^size 9223372036854775808 is outside \[0, 1048576\]$", [H0], [MIB],
                size=2**63)


@pytest.mark.parametrize("bad", [True, 1.5, "10"])
def test_buffer_size_not_an_integer(bad):
    check_error(r"^size is .*expected an integer$", [H0], [MIB], size=bad)


def test_offset_errors():
    check_error(r"^offset 1048577 is outside \[0, 1048576\]$", [H0], [MIB], offset=MIB + 1)
    check_error(r"^offset 512 \+ size 1048576 is beyond the 1048576 bytes", [H0], [MIB],
                size=MIB, offset=512)


def test_owner_uuid_errors():
    check_error(r"owner_uuid is a bytes", [H0], [MIB], owner_uuid=b"GPU-1")
    check_error(r"NUL", [H0], [MIB], owner_uuid="GPU\0x")
    check_error(r"owner UUID is 257 bytes", [H0], [MIB], owner_uuid="x" * 257)


def test_count_check_comes_first():
    # Counts are compared before handle lengths and sizes are looked at.
    check_error(r"^2 handles but 1 size$", [b"short", H1], [0])


def test_base_class_cannot_build_from_handles():
    with pytest.raises(TypeError):
        BufferDescriptor.from_handles([H0], [MIB])
    with pytest.raises(TypeError):
        FabricBufferDescriptor()


# --- Equality, encoding, pickle ----------------------------------------------------------------


def test_equality_and_hash():
    a = FabricBufferDescriptor.from_handles([H0, H1], [MIB, MIB], owner_uuid="GPU-a")
    b = FabricBufferDescriptor.from_handles([H0, H1], [MIB, MIB], owner_uuid="GPU-a")
    assert a == b and hash(a) == hash(b)
    assert a != FabricBufferDescriptor.from_handles([H0, H2], [MIB, MIB], owner_uuid="GPU-a")
    assert a != FabricBufferDescriptor.from_handles([H0, H1], [MIB, MIB], owner_uuid="GPU-b")
    assert a != FabricBufferDescriptor.from_handles([H0, H1], [MIB, MIB], size=5,
                                                    owner_uuid="GPU-a")
    assert a != PosixFdBufferDescriptor.from_handles([H0, H1], [MIB, MIB], owner_uuid="GPU-a")
    assert a != "not a descriptor"


@pytest.mark.parametrize("cls", BOTH)
def test_bytes_round_trip(cls):
    d = cls.from_handles([H0, H1, H2], [MIB, 2 * MIB, MIB], size=3 * MIB, offset=4096,
                         owner_uuid="GPU-5e1f")
    data = d.to_bytes()
    assert isinstance(data, bytes) and data[:4] == b"VMMD"
    again = BufferDescriptor.from_bytes(data)
    assert type(again) is cls and again == d and again.to_bytes() == data
    assert cls.from_bytes(data) == d
    assert (again.handles, again.sizes, again.size, again.offset, again.owner_uuid) == (
        d.handles, d.sizes, d.size, d.offset, d.owner_uuid)


def test_from_bytes_checks_the_class():
    data = PosixFdBufferDescriptor.from_handles([H0], [MIB]).to_bytes()
    with pytest.raises(ValueError, match="posix_fd"):
        FabricBufferDescriptor.from_bytes(data)


@pytest.mark.parametrize("data", [b"", b"VMMD", b"junk" * 20, b"\0" * 64])
def test_from_bytes_rejects_garbage(data):
    with pytest.raises(ValueError):
        BufferDescriptor.from_bytes(data)


def test_from_bytes_rejects_tampering():
    data = bytearray(FabricBufferDescriptor.from_handles([H0], [MIB]).to_bytes())
    data[4] = 99  # version
    with pytest.raises(ValueError, match="version"):
        BufferDescriptor.from_bytes(bytes(data))
    with pytest.raises(ValueError):
        BufferDescriptor.from_bytes(bytes(data[:-8]))


def test_hostile_owner_bytes_do_not_crash():
    # An owner UUID that is not UTF-8 still parses (as replacement characters).
    good = FabricBufferDescriptor.from_handles([H0], [MIB], owner_uuid="GPU-" + "a" * 4)
    data = bytearray(good.to_bytes())
    start = data.find(b"GPU-aaaa")
    data[start + 4:start + 8] = b"\xff\xfe\xc3\x28"
    d = BufferDescriptor.from_bytes(bytes(data))
    assert d.owner_uuid.startswith("GPU-")


@pytest.mark.parametrize("cls", BOTH)
def test_pickle_round_trip(cls):
    d = cls.from_handles([H0, H1], [MIB, MIB], size=MIB + 7, owner_uuid="GPU-77")
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        again = pickle.loads(pickle.dumps(d, protocol=protocol))
        assert type(again) is cls and again == d


def test_repr_is_readable():
    d = FabricBufferDescriptor.from_handles([H0, H1], [MIB, MIB], owner_uuid="GPU-1")
    text = repr(d)
    assert text.startswith("FabricBufferDescriptor(")
    assert "2 x 64 bytes" in text and "owner_uuid='GPU-1'" in text and "1048576" in text


def test_exports_are_module_level():
    assert vmm_torch.FabricBufferDescriptor is FabricBufferDescriptor
    assert vmm_torch.PosixFdBufferDescriptor is PosixFdBufferDescriptor


def test_offset_none_is_the_default():
    # Every optional argument of from_handles takes None for its default (as size does).
    for cls in (FabricBufferDescriptor, PosixFdBufferDescriptor):
        d = cls.from_handles([H0], [MIB], offset=None)
        assert d.offset == 0 and d == cls.from_handles([H0], [MIB])
        assert d == cls.from_handles([H0], [MIB], size=None, owner_uuid=None, offset=None)


@pytest.mark.parametrize("bad", [True, 1.5, "10", b"1", [0]])
def test_offset_not_an_integer(bad):
    check_error(r"^offset is .*expected an integer$", [H0], [MIB], offset=bad)


def test_offset_beyond_int64():
    check_error(r"^offset 9223372036854775808 is outside", [H0], [MIB], offset=2**63)
    check_error(r"^offset -1 is outside", [H0], [MIB], offset=-1)
