"""What every program of the drop-in suite does at its end: each difference from PyTorch's
behaviour on stderr and exit status 1, or "ok" and exit status 0 (run.sh reads both); and
the helpers several programs share."""
import re
import sys


# The core statistics of torch.cuda.memory_stats(): "<stat>.<pool>.<field>".
CORE_STAT = re.compile(r"^(allocation|allocated_bytes|segment|reserved_bytes|active|active_bytes|"
                       r"inactive_split|inactive_split_bytes|requested_bytes)\.(all|large_pool|"
                       r"small_pool)\.(current|peak|allocated|freed)$")


def core_stats():
    """torch.cuda.memory_stats()'s core statistics as {"<stat>.<pool>": {field: value}}."""
    import torch
    out = {}
    for k, v in torch.cuda.memory_stats().items():
        m = CORE_STAT.match(k)
        if m:
            out.setdefault(f"{m[1]}.{m[2]}", {})[m[3]] = v
    return out


def report(errors):
    if errors:
        for e in errors:
            print("FAIL:", e, file=sys.stderr)
        sys.exit(1)
    print("ok")


def level():
    """memory_allocated() once garbage is collected and the GPU is idle: what a round of the
    programs that use check_level() records at its end."""
    import gc
    import torch
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def check_level(after, errors):
    """For programs that run the same work in three rounds: `after` holds memory_allocated()
    after each round (fewer where a round failed); the third round must end where the second
    did (the first may make workspaces and caches that stay)."""
    if len(after) == 3 and after[2] != after[1]:
        errors.append(f"memory_allocated() after rounds 1-3: {after} (the third round left "
                      f"{after[2] - after[1]} bytes more than the second)")


def compile_ready(net, x, y):
    """For the torch.compile programs: False, with "ok" printed (nothing checked), where triton,
    which torch.compile needs for GPU kernels, is missing; else True, once `net` has run forward
    and backward on (x, y) so that cuBLAS's workspaces of the main and autograd threads exist
    before the program takes its baseline."""
    import torch
    try:
        import triton  # noqa: F401
    except ImportError:
        print("triton is not installed; torch.compile cannot build GPU kernels; nothing checked")
        report([])
        return False
    torch.nn.functional.mse_loss(net(x), y).backward()
    return True


def compile_unavailable(e):
    """Whether the exception `e` of a torch.compile program says this machine cannot build
    kernels (no C compiler, no Python headers); if so, prints so and "ok" (nothing checked)."""
    import subprocess
    text = str(e)
    if not (isinstance(e, subprocess.CalledProcessError) or "C compiler" in text
            or "Python.h" in text):
        return False
    print(f"torch.compile cannot build kernels here ({text[:200]}); nothing checked")
    report([])
    return True


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


def free_bytes():
    """The GPU's free memory (torch.cuda.mem_get_info) once queued work is done."""
    import torch
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def freed_memory_goes_back(errors, slack):
    """With caching off: a 2 GiB tensor takes 2 GiB of the GPU's free memory and gives it back
    once deleted (no empty_cache), and so do 200 tensors of 1 KiB to 8 MiB, each holding what
    was written (within `slack` bytes). Appends what differs to `errors`; returns the free
    memory at the end."""
    import torch
    gib = 1 << 30
    free0 = free_bytes()
    t = torch.empty(2 * gib, dtype=torch.uint8, device="cuda")
    t.fill_(7)
    free1 = free_bytes()
    if free0 - free1 < 2 * gib:
        errors.append(f"a 2 GiB tensor took {free0 - free1} bytes of the GPU's free memory")
    if int(t[0].item()) != 7 or int(t[-1].item()) != 7:
        errors.append("the 2 GiB tensor does not hold what was written")
    del t
    free2 = free_bytes()
    if free2 < free0 - slack:
        errors.append(f"a 2 GiB tensor deleted did not go back to the GPU: free memory {free2} "
                      f"after, {free0} before it (no empty_cache)")
    sizes = [1024 * (1 + (i * 37) % 8192) for i in range(200)]
    ts = [torch.full((n,), i % 251, dtype=torch.uint8, device="cuda")
          for i, n in enumerate(sizes)]
    bad = [i for i, x in enumerate(ts) if int(x[-1].item()) != i % 251]
    if bad:
        errors.append(f"{len(bad)} of 200 small tensors lost their values")
    del ts
    free3 = free_bytes()
    if free3 < free2 - slack:
        errors.append(f"200 tensors of 1 KiB to 8 MiB ({sum(sizes)} bytes) deleted left the "
                      f"GPU's free memory at {free3}, was {free2}")
    return free3


def settle():
    """Collects garbage, waits for the GPU and empties the cache."""
    import gc
    import torch
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def baseline():
    """After settle(): (memory_allocated(), memory_reserved(), allocation.all.current), what
    memory_back() compares with at the end."""
    import torch
    settle()
    count = torch.cuda.memory_stats()["allocation.all.current"]
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), count


def memory_back(errors, base_alloc, base_res, when, base_count=None):
    """After settle(): memory_allocated() is `base_alloc` again, memory_reserved() at most
    `base_res` and, if given, memory_stats()'s allocation.all.current `base_count`, else a
    difference is added to `errors` (`when` says at what point)."""
    import torch
    if base_count is not None:
        count = torch.cuda.memory_stats()["allocation.all.current"]
        if count != base_count:
            errors.append(f"{when} allocation.all.current is {count}, was {base_count} before")
    if torch.cuda.memory_allocated() != base_alloc:
        errors.append(f"{when} memory_allocated() is {torch.cuda.memory_allocated()}, was "
                      f"{base_alloc} before")
    if torch.cuda.memory_reserved() > base_res:
        errors.append(f"{when} and the cache emptied memory_reserved() is "
                      f"{torch.cuda.memory_reserved()}, was {base_res} before")


def capture_increments(a, steps):
    """A CUDA graph that clones `a`, then `steps` times clones and adds 1; (graph, output)."""
    import torch
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        b = a.clone()
        for _ in range(steps):
            b = b.clone() + 1
    return g, b


def python_worker(stop, errors, wid):
    """Allocates and frees CUDA tensors in a loop (layer_norm, sort, cumsum, a filled tensor)
    until `stop` is set, at least once; what it raises goes to `errors`."""
    import torch
    try:
        x = torch.randn(256, 1024, device="cuda")
        while True:
            y = torch.nn.functional.layer_norm(x, (1024,))
            flat = y.flatten()
            s, idx = torch.sort(flat)
            c = torch.cumsum(flat, 0)  # noqa: F841
            t = torch.empty(256 * 1024, device="cuda")
            t.fill_(float(wid))
            del y, flat, s, idx, c, t
            if stop.is_set():
                break
    except Exception as e:  # noqa: BLE001
        errors.append(f"worker {wid}: {type(e).__name__}: {str(e)[:300]}")


def threaded_backward(model, x, errors, seconds):
    """Backward passes of `model` on `x` in this thread for `seconds` while two Python threads
    run python_worker (the autograd engine's thread frees beside them); the number of passes,
    once the threads are joined and the GPU synchronized."""
    import threading
    import time
    import torch
    stop = threading.Event()
    workers = [threading.Thread(target=python_worker, args=(stop, errors, w)) for w in (1, 2)]
    for w in workers:
        w.start()
    steps = 0
    start = time.monotonic()
    try:
        while time.monotonic() - start < seconds:
            model(x).square().mean().backward()
            model.zero_grad(set_to_none=True)
            steps += 1
    finally:
        stop.set()
        for w in workers:
            w.join(30)
    torch.cuda.synchronize()
    return steps


def mlp_and_input():
    """(model, x): six Linear(1024, 1024) + GELU layers on the GPU (seed 0) and a batch of 256."""
    import torch
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).cuda(), torch.randn(256, 1024, device="cuda")


def gpu_trace_api():
    """(torch.cuda._gpu_trace, torch._C._activate_gpu_trace) where this torch has the GPU
    trace's memory callbacks, else None (after saying so: the case then checks nothing)."""
    import torch
    try:
        import torch.cuda._gpu_trace as gpu_trace
    except ImportError:
        gpu_trace = None
    activate = getattr(torch._C, "_activate_gpu_trace", None)
    if gpu_trace is None or activate is None or not hasattr(
            gpu_trace, "register_callback_for_memory_allocation"):
        print("this torch has no GPU trace API; nothing checked")
        return None
    return gpu_trace, activate
