"""A program that ends with CUDA state still alive: the interpreter's exit must be clean
(exit status 0, nothing on stderr) whatever the allocator still holds.

The case runs a small program twice in a child interpreter (the same environment, so with
VMM_TORCH_ENABLE set the child uses vmm too), then checks what it printed. The program keeps
to the end, in module globals: a 256 MiB tensor and 200 small ones, a view of a dropped base,
a raw block of torch.cuda.caching_allocator_alloc never deleted, a torch.cuda.MemPool with
tensors made in it, a captured CUDA graph with its static input and output (replayed once),
and a tensor dropped while a side stream it was recorded on still sleeps on the GPU (its
block pending at exit). An atexit handler allocates and checks a 64 MiB tensor, reads
memory_stats() and calls empty_cache(); a weakref.finalize callback drops CUDA tensors at
exit. The first run leaves through the end of the script, the second through sys.exit(0)
while the side stream still runs.

With PyTorch's allocator both runs exit with status 0 within 25 s, print "main ok" and
"atexit ok" on stdout and write nothing on stderr that says error, failed, exception,
traceback, abort or fatal (the caching allocator never frees at exit; graphs and pools go with
the module's globals, before CUDA does).

Why vmm may differ: vmm runs threads of its own and has exit hooks (the exit wait for
receivers, the flush of acknowledgements), static state in libvmm and a private pool per
graph and MemPool whose last release synchronizes the device and releases memory; any of
them running after CUDA or Python is torn down (or destroying a pool with blocks still
live) fails, hangs or crashes at exit.
"""
import os
import subprocess
import sys
import textwrap

from dropin_report import report

PROGRAM = textwrap.dedent("""
    import atexit, sys, weakref
    import torch

    MIB = 1 << 20
    big = torch.full((64 * MIB,), 1.0, device="cuda")
    small = [torch.full((i + 1,), float(i), device="cuda") for i in range(200)]
    base = torch.arange(4 * MIB, dtype=torch.float32, device="cuda")
    view = base[MIB:MIB + 1000]
    del base
    raw = torch.cuda.caching_allocator_alloc(3 * MIB)
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        in_pool = [torch.ones(n, device="cuda") for n in (1000, MIB, 8 * MIB)]
    static_in = torch.ones(MIB, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (static_in * 2 + 1).sum()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = static_in * 2 + 1
    static_in.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    assert float(static_out[0].item()) == 7.0, static_out[0].item()
    assert float(view[0].item()) == float(MIB)


    class Holder:
        pass


    holder = Holder()
    holder.tensors = [torch.ones(MIB, device="cuda") for _ in range(4)]
    weakref.finalize(holder, holder.tensors.clear)


    def at_exit():
        t = torch.full((16 * MIB,), 2.0, device="cuda")
        ok = float(t.sum().item()) == 32.0 * MIB
        stats = torch.cuda.memory_stats()
        del t
        torch.cuda.empty_cache()
        print("atexit ok" if ok and stats.get("allocation.all.current", 0) > 0 else
              "atexit wrong", flush=True)


    atexit.register(at_exit)

    x = torch.ones(8 * MIB, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(400_000_000)
        y = x * 2
    x.record_stream(side)
    del x
    print("main ok", flush=True)
    if sys.argv[1] == "exit":
        sys.exit(0)
""")


def main():
    errors = []
    for how in ("end", "exit"):
        try:
            done = subprocess.run([sys.executable, "-c", PROGRAM, how], capture_output=True,
                                  text=True, timeout=25, env=dict(os.environ))
        except subprocess.TimeoutExpired:
            errors.append(f"leaving by {how}: the program did not exit within 25 s")
            continue
        out, err = done.stdout, done.stderr
        if done.returncode != 0:
            errors.append(f"leaving by {how}: exit status {done.returncode}; stderr: "
                          f"{err.strip()[-600:]}")
        if "main ok" not in out or "atexit ok" not in out:
            errors.append(f"leaving by {how}: stdout {out.strip()[-300:]!r}, expected 'main ok' "
                          f"and 'atexit ok'")
        bad = [line for line in err.splitlines()
               if any(w in line.lower() for w in ("error", "failed", "traceback", "exception",
                                                  "abort", "terminate", "segmentation",
                                                  "fatal", "core dumped"))]
        if bad:
            errors.append(f"leaving by {how}: stderr says {bad[:4]}")
    report(errors)


if __name__ == "__main__":
    main()
