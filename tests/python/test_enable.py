"""vmm_torch.enable() where it can be checked without a GPU, option text, import hygiene."""

import subprocess
import sys

import pytest
import torch

import vmm_torch
from vmm_torch._lib import VmmError, error_for
from vmm_torch._options import format_options

HAS_PLUGGABLE = hasattr(torch.cuda.memory, "CUDAPluggableAllocator")


def test_parse_size_reads_the_byte_size_grammar():
    assert vmm_torch.parse_size("512") == 512
    assert vmm_torch.parse_size("64M") == 64 << 20
    assert vmm_torch.parse_size(" 64MiB ") == 64 << 20
    assert vmm_torch.parse_size("2kb") == 2048
    assert vmm_torch.parse_size("512B") == 512
    assert vmm_torch.parse_size("8T") == 8 << 40
    for bad in ("", "M", "1.5G", "-1", "64X", "5iB", "1 M", "99999999999T", None, 64):
        with pytest.raises(ValueError):
            vmm_torch.parse_size(bad)


def test_option_text():
    assert format_options({}) == ""
    assert format_options({"memory_limit": "40G", "handle_type": "posix_fd"}) == \
        "handle_type=posix_fd,memory_limit=40G"
    assert format_options({"reserve_size": 1 << 30, "growth_fraction": 0.5}) == \
        "growth_fraction=0.5,reserve_size=1073741824"
    assert format_options({"peer_devices": [1, 2]}) == "peer_devices=1:2"
    assert format_options({"peer_devices": 3}) == "peer_devices=3"
    assert format_options({"max_chunk": None}) == ""
    assert format_options({"isolate_sends": True}) == "isolate_sends=1"
    assert format_options({"isolate_sends": False}) == "isolate_sends=0"
    for bad in ({"memory_limit": True}, {"memory_limit": "1G,handle_type=none"},
                {"memory_limit": [1]}, {"bad key": 1}):
        with pytest.raises(ValueError):
            format_options(bad)


def test_error_mapping():
    # By code (vmm_c.h's vmm_status_code), never by parsing the message.
    bad = error_for(3, "bad")
    assert type(bad) is ValueError and str(bad) == "bad"
    oom = error_for(8, "out of memory")
    assert isinstance(oom, getattr(torch.cuda, "OutOfMemoryError", MemoryError))
    stale = error_for(5, "stale handle of the owner GPU-1")
    assert isinstance(stale, VmmError) and isinstance(stale, RuntimeError)
    assert stale.code == "NOT_FOUND" and stale.code_value == 5
    assert str(stale) == "stale handle of the owner GPU-1"
    gone = error_for(14, "exporter exited")
    assert isinstance(gone, VmmError) and gone.code == "UNAVAILABLE"
    state = error_for(9, "INVALID_ARGUMENT: looks like a code")  # the text is not read
    assert isinstance(state, VmmError) and state.code == "FAILED_PRECONDITION"
    for odd in (0, 99, -1):
        error = error_for(odd, "odd")
        assert isinstance(error, VmmError) and error.code == "UNKNOWN" and error.code_value == 2
    assert VmmError("x").code == "UNKNOWN"
    assert VmmError("x", "NOT_FOUND").code_value == 5


def test_unknown_options_are_rejected():
    with pytest.raises(ValueError, match="unknown option 'colour'"):
        vmm_torch.enable(colour="blue")
    with pytest.raises(ValueError, match="reserve_size"):
        vmm_torch.enable(reserve_size="a lot")
    assert not vmm_torch.is_enabled()


@pytest.mark.skipif(HAS_PLUGGABLE, reason="this torch has CUDAPluggableAllocator")
def test_enable_explains_what_this_torch_lacks():
    with pytest.raises(RuntimeError, match="CUDAPluggableAllocator"):
        vmm_torch.enable()
    assert not vmm_torch.is_enabled() and vmm_torch.enabled_hooks() == ()


@pytest.mark.skipif(HAS_PLUGGABLE, reason="this torch has CUDAPluggableAllocator")
def test_enable_says_what_this_torch_lacks_even_once_vmm_allocates():
    """What the torch lacks outranks configure's refusal once a device pool exists: the
    latter would send the user to call enable() earlier, which would not help."""
    code = (
        "import vmm_torch\n"
        "from vmm_torch import _lib\n"
        "vmm = _lib.load().vmm\n"
        "a = vmm.vmm_alloc(4096, 0, None)\n"
        "assert a, _lib.last_error()\n"
        "try:\n"
        "    vmm_torch.enable()\n"
        "except RuntimeError as e:\n"
        "    print('lacks' if 'CUDAPluggableAllocator' in str(e) else e)\n"
        "assert vmm.vmm_free(a, 0) == 0\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env=_env(VMM_BACKEND="host"))
    assert result.returncode == 0 and result.stdout.strip() == "lacks", \
        result.stdout + result.stderr


def test_importing_and_host_pools_leave_cuda_alone():
    code = (
        "import torch, vmm_torch\n"
        "with vmm_torch.Pool('host') as p:\n"
        "    t = p.empty((4,))\n"
        "    vmm_torch.memory_stats(); vmm_torch.memory_snapshot()\n"
        "assert not torch.cuda.is_initialized()\n"
        "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env=_env())
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_library_dir_override(tmp_path, monkeypatch):
    monkeypatch.setenv("VMM_LIB_DIR", str(tmp_path))
    assert vmm_torch.library_dir() == str(tmp_path)
    code = "import vmm_torch\ntry:\n    vmm_torch.backend()\nexcept ImportError as e:\n" \
           "    print('missing' if 'libvmm.so is missing' in str(e) else e)\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env=_env(VMM_LIB_DIR=str(tmp_path)))
    assert result.stdout.strip() == "missing", result.stderr


def _env(**extra):
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.update(extra)
    return env


def test_a_cuda_module_that_cannot_load_falls_back(tmp_path, monkeypatch, caplog):
    """A _cuda_allocator.so built against another torch (here: not a library at all) is said
    once and ignored: enable() and sends then use CUDAPluggableAllocator and torch's events."""
    import types

    from vmm_torch import _cuda

    (tmp_path / _cuda.MODULE_FILE).write_bytes(b"not an ELF file")
    libs = types.SimpleNamespace(extension_path=str(tmp_path / "_C.so"),
                                 libvmm_path=str(tmp_path / "libvmm.so"))
    monkeypatch.setattr(_cuda, "_module", None)
    monkeypatch.setattr(_cuda, "_looked", False)
    with caplog.at_level("WARNING", logger="vmm_torch"):
        assert _cuda.module(libs) is None
        assert _cuda.module(libs) is None  # looked once
    assert sum("cannot be used" in r.getMessage() for r in caplog.records) == 1
