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


def in_pool(pool, tensor):
    """Whether `tensor`'s memory lies in a segment of torch.cuda.MemPool `pool`."""
    address = tensor.data_ptr()
    for segment in pool.snapshot():
        if segment["address"] <= address < segment["address"] + segment["total_size"]:
            return True
    return False


def capture_doubling(pool, x):
    """A CUDA graph captured into `pool` (a MemPool) that computes x * 2 (warmed up on a side
    stream first, as PyTorch asks); returns the graph and its output tensor."""
    import torch
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x * 2  # warm up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph, pool=pool.id):
        y = x * 2
    return graph, y
