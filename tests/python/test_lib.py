"""vmm_torch._lib through real calls on the host backend: errors mapped by their code,
vmm_torch.parse_size (the C library's byte-size parser), vmm_torch.backend()."""

import gc

import pytest
import torch

import vmm_torch
from vmm_torch import _lib, _signatures

MIB = 1 << 20


def test_stale_descriptor_is_not_found():
    with vmm_torch.Pool("host", handle_type="fabric") as p:
        t = p.empty((MIB,), dtype=torch.uint8, shareable=True)
        data = vmm_torch.export_tensor(t).descriptor.to_bytes()
        del t
        gc.collect()
        p.empty_cache()
        with pytest.raises(vmm_torch.VmmError) as info:
            vmm_torch.import_buffer(data)
    error = info.value
    assert error.code == "NOT_FOUND" and error.code_value == _signatures.NOT_FOUND
    assert not str(error).startswith("NOT_FOUND")  # the message carries no code prefix
    assert "HOST-" in str(error)


@pytest.mark.parametrize("data", [b"", b"VMMD", b"\xff" * 200])
def test_malformed_descriptor_is_a_value_error(data):
    with pytest.raises(ValueError) as info:
        vmm_torch.import_buffer(data)
    assert not isinstance(info.value, vmm_torch.VmmError)
    assert "INVALID_ARGUMENT" not in str(info.value)


def test_pool_options_are_checked_without_making_a_pool():
    _lib.check_pool_options("")
    _lib.check_pool_options("memory_limit=40G,handle_type=posix_fd")
    with pytest.raises(ValueError, match="unknown option 'colour'"):
        _lib.check_pool_options("colour=1")
    with pytest.raises(ValueError, match="memory_limit"):
        _lib.check_pool_options("memory_limit=lots")


def test_out_of_memory_is_mapped_by_code():
    oom = getattr(torch.cuda, "OutOfMemoryError", MemoryError)
    with vmm_torch.Pool("host", memory_limit="2M") as p:
        with pytest.raises(oom) as info:
            p.empty((8 * MIB,), dtype=torch.uint8)
    assert "RESOURCE_EXHAUSTED" not in str(info.value)


def test_failed_precondition_keeps_its_code():
    with vmm_torch.Pool("host", handle_type="none") as p:
        t = p.empty((16,))
        with pytest.raises(vmm_torch.VmmError) as info:
            vmm_torch.export_tensor(t)
    assert info.value.code == "FAILED_PRECONDITION"
    assert info.value.code_value == _signatures.FAILED_PRECONDITION
    assert "not exportable" in str(info.value)


def test_last_error_code_is_per_call():
    with pytest.raises(ValueError):
        vmm_torch.parse_size("lots")
    assert _lib.last_error_code() == _signatures.INVALID_ARGUMENT
    assert "lots" in _lib.last_error()


@pytest.mark.parametrize("text,expected", [
    ("0", 0), ("4096", 4096), ("512M", 512 * MIB), ("2G", 2 << 30), ("1T", 1 << 40),
    ("64k", 64 << 10), ("64MiB", 64 * MIB), ("2KB", 2048), (" 3M ", 3 * MIB),
])
def test_parse_size(text, expected):
    assert vmm_torch.parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "1.5G", "-1", "12Q", "G", "99999999999999999999",
                                 "1\0M", 512, None, b"512M", True])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        vmm_torch.parse_size(bad)


def test_backend_is_a_name():
    assert vmm_torch.backend() in ("cuda", "host")
    assert vmm_torch.backend() == _lib.backend_name(_lib.vmm().vmm_default_backend())
    with pytest.raises(ValueError):
        _lib.backend_name(0)
