"""What every program of the drop-in suite does at its end: each difference from PyTorch's
behaviour on stderr and exit status 1, or "ok" and exit status 0 (run.sh reads both); and
the helpers several programs share."""
import sys


def report(errors):
    if errors:
        for e in errors:
            print("FAIL:", e, file=sys.stderr)
        sys.exit(1)
    print("ok")


def oom(nbytes):
    """Whether a CUDA tensor of `nbytes` (written, then freed) raises
    torch.cuda.OutOfMemoryError; in the pool a use_mem_pool context routes to, if any."""
    import torch
    try:
        t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        t.fill_(1)
        del t
        return False
    except torch.cuda.OutOfMemoryError:
        return True
