"""What a sender checks once its receivers dropped everything: that memory_allocated() comes
back to where it was before the sends (PyTorch's CUDA IPC needs ipc_collect() for that; vmm
needs nothing, but the call is harmless). For the drop-in programs that send."""
import gc
import time

import torch


def memory_back_error(base, who, seconds=15):
    """None once memory_allocated() is `base` again within `seconds`, else what differs."""
    deadline = time.monotonic() + seconds
    now = None
    while time.monotonic() < deadline:
        torch.cuda.ipc_collect()
        gc.collect()
        torch.cuda.synchronize()
        now = torch.cuda.memory_allocated()
        if now == base:
            return None
        time.sleep(0.1)
    return (f"{seconds} s after the {who} dropped everything, memory_allocated is {now}, "
            f"{base} before the sends ({now - base} bytes still held)")
