"""UntypedStorage._new_shared_cuda with handles it cannot open, as a receiver meets them: a
handle cut short, one byte longer, its first byte changed, all zeros, empty, 64 bytes of
another kind, and the handle of a storage whose process has exited (the sender died before
the receiver opened it). Not a byte changed inside: a vmm descriptor's fabric handle is the
driver's, whose unused bytes it may not check, and its owner UUID only names the owner in
messages, so such a handle of the program's own storage may open (vmm opens its own
storages, which PyTorch's allocator refuses in the process that made them). Each is the
program's own storage's _share_cuda_() tuple with only the handle replaced (and no event to
wait for), so the reference counter part is valid. Both the program and the sender exit
with a shared storage no receiver released, which PyTorch frees (with a warning) at exit.

What each call does with PyTorch's allocator is not written here: the same probe runs in a
child with PyTorch's allocator (VMM_TORCH_ENABLE removed from its environment) and in this
process, and the outcomes must agree: opened, or raised RuntimeError (a subclass counted as
RuntimeError: PyTorch's allocator raises torch.AcceleratorError where cudaIpcOpenMemHandle
refuses the bytes, and programs catch RuntimeError), or raised some other type, which is
compared by name. Then a tensor must still work.

Why vmm may differ: its handles are vmm descriptors, which libvmm parses and imports; a
descriptor it refuses was a ValueError, which `except RuntimeError` does not catch.
"""
import subprocess
import sys

from outcome_compare import a_tensor_works, against_native, outcome

STALE_SENDER = "--stale-sender"


def stale_sender():
    """Shares a storage, prints its handle (hex), and exits: the storage dies with it."""
    import torch
    t = torch.full((1 << 20,), 7.0, device="cuda")
    torch.cuda.synchronize()
    print("HANDLE " + t.untyped_storage()._share_cuda_()[1].hex(), flush=True)


def probes():
    import torch
    torch.empty(1, device="cuda")
    res = [["_backend", {"kind": "returned", "value": torch.cuda.get_allocator_backend()}]]
    mine = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    (device, handle, size, offset, ref_handle, ref_offset, event_handle,
     _) = mine.untyped_storage()._share_cuda_()
    # No event to open: this process's own event handle does not open in it (PyTorch opens
    # the event first and its error would hide the handle's).
    event_sync = False

    def open_with(junk):
        def run():
            try:
                s = torch.UntypedStorage._new_shared_cuda(device, junk, size, offset, ref_handle,
                                                          ref_offset, event_handle, event_sync)
            except RuntimeError as e:
                if isinstance(e, torch.cuda.OutOfMemoryError):
                    raise
                print(f"  {type(e).__name__}: {str(e).strip().splitlines()[0][:160]}")
                return "raised RuntimeError (or a subclass)"
            del s
            return "opened"
        return run

    def rec(name, fn):
        res.append([name, outcome(fn)])

    for name, junk in (("empty", b""),
                       ("one byte short", handle[:-1]),
                       ("half of it", handle[:len(handle) // 2]),
                       ("one byte longer", handle + b"\x00"),
                       ("zeros of its length", bytes(len(handle))),
                       ("64 bytes of 0x01", b"\x01" * 64),
                       ("'VMMD' and 60 zeros", b"VMMD" + bytes(60)),
                       ("its first byte changed", bytes([handle[0] ^ 0xFF]) + handle[1:])):
        rec(f"_new_shared_cuda(handle: {name})", open_with(junk))

    sender = subprocess.run([sys.executable, sys.argv[0], STALE_SENDER], capture_output=True,
                            text=True, timeout=60)
    lines = [x for x in sender.stdout.splitlines() if x.startswith("HANDLE ")]
    if sender.returncode == 0 and lines:
        stale = bytes.fromhex(lines[-1][len("HANDLE "):])
        rec("_new_shared_cuda(handle of an exited process's storage)", open_with(stale))
    else:
        tail = " | ".join(sender.stderr.strip().splitlines()[-3:])
        res.append(["the stale sender", {"kind": "raised", "type": "SenderFailed",
                                         "phrases": [], "text": tail}])
    del mine
    rec("a tensor afterwards", a_tensor_works)
    return res


if __name__ == "__main__":
    if STALE_SENDER in sys.argv:
        stale_sender()
    else:
        against_native(probes)
