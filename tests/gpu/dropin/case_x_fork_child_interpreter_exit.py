"""A process that uses CUDA forks children with os.fork() (not multiprocessing) that do CPU
work only and then end the way a Python program ends: SystemExit out of the main function,
so the interpreter finalizes (atexit handlers, the __main__ module's globals cleared and
collected, then exit() with the C++ static destructors). This is what pre-fork servers do
(gunicorn's workers raise SystemExit when they stop, with a model the master preloaded), and
scripts that fork a helper to compress logs or write a checkpoint file; multiprocessing's own
fork children end with os._exit and run none of it (the DataLoader case covers those).

With PyTorch's allocator the child inherits the parent's CUDA tensors as bookkeeping only:
dropping them, as the child's code and its finalization do, makes no CUDA call (the blocks
have no recorded streams), and nothing torch registered for exit uses CUDA. So each child
(one that deletes the inherited tensors and collects garbage first, one that leaves them to
finalization in module globals and a reference cycle, one that exits with status 3, and one
that ends with os._exit as a control) ends within seconds with its status and writes
nothing on stderr; the parent's tensors keep their values and the parent allocates, frees and
forks again afterwards.

Why vmm may differ: with VMM_TORCH_ENABLE the parent imported vmm_torch, whose exit
handlers (the wait for receivers of sends, the send ledger, its fd server) and C++ statics
were inherited by the child, in which vmm's other threads do not exist and whose pools belong
to the parent (fork_guard.h); a handler that joins a thread that is not there hangs, and one
that calls the driver, or a free that takes an error path, writes on stderr or crashes.
"""
import gc
import os
import sys
import tempfile
import time
import warnings

import torch
from dropin_report import report

MIB = 1 << 20
KEEP = {}  # module globals the children inherit


class Cycle:
    def __init__(self, t):
        self.t = t
        self.me = self


def child_body(mode):
    """Runs in the child; ends by raising SystemExit (or os._exit for the control)."""
    total = sum(i * i for i in range(200_000))  # CPU work
    if mode == "delete":
        KEEP.clear()
        gc.collect()
    elif mode == "cycle":
        Cycle(KEEP.get("big"))  # garbage left to finalization
    if mode == "status3":
        sys.exit(3)
    if mode == "os_exit":
        sys.stdout.flush()
        os._exit(0)
    sys.exit(0 if total > 0 else 9)


def fork_child(mode, errors):
    """Forks a child running child_body(mode); checks its status, time and stderr."""
    want = 3 if mode == "status3" else 0
    with tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12)
            pid = os.fork()
        if pid == 0:
            try:
                os.dup2(err.fileno(), 2)
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
            except BaseException:  # noqa: BLE001
                os._exit(97)
            child_body(mode)  # raises SystemExit: the interpreter exits here
            os._exit(98)  # not reached
        start = time.monotonic()
        status = None
        while time.monotonic() - start < 30:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
                break
            time.sleep(0.05)
        if status is None:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            errors.append(f"child '{mode}': did not exit within 30 s (killed)")
        else:
            if os.WIFSIGNALED(status):
                errors.append(f"child '{mode}': killed by signal {os.WTERMSIG(status)}")
            elif os.WEXITSTATUS(status) != want:
                errors.append(f"child '{mode}': exit status {os.WEXITSTATUS(status)}, "
                              f"expected {want}")
        err.seek(0)
        text = err.read().decode(errors="replace").strip()
        if text:
            tail = " | ".join(text.splitlines()[-6:])
            errors.append(f"child '{mode}' wrote on stderr: {tail[:600]}")


def main():
    errors = []
    KEEP["small"] = [torch.full((1 << (10 + i % 6),), float(i), device="cuda")
                     for i in range(50)]
    KEEP["big"] = torch.full((64 * MIB // 4,), 2.0, device="cuda")
    KEEP["view"] = KEEP["big"][1000:2000]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        KEEP["side"] = torch.full((3 * MIB // 4,), 4.0, device="cuda")
    side.synchronize()
    scratch = [torch.empty(n * MIB, dtype=torch.uint8, device="cuda") for n in (1, 8, 40)]
    del scratch  # cached blocks in the parent's allocator at the fork
    torch.cuda.synchronize()

    for mode in ("delete", "finalize", "cycle", "status3", "os_exit"):
        fork_child(mode, errors)
        # The parent goes on between children: allocations, frees and kernels.
        t = torch.full((16 * MIB // 4,), 1.5, device="cuda")
        if float(t.sum().item()) != 1.5 * t.numel():
            errors.append(f"after child '{mode}': a new tensor in the parent is wrong")
        del t

    torch.cuda.synchronize()
    for i, t in enumerate(KEEP["small"]):
        if float(t.min().item()) != float(i) or float(t.max().item()) != float(i):
            errors.append(f"the parent's small tensor {i} changed")
            break
    if float(KEEP["big"].min().item()) != 2.0 or float(KEEP["side"].max().item()) != 4.0:
        errors.append("the parent's large tensors changed")
    KEEP.clear()
    gc.collect()
    torch.cuda.empty_cache()
    report(errors)


if __name__ == "__main__":
    main()
