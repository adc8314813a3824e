"""PYTORCH_CUDA_ALLOC_CONF set in the environment, as training and serving scripts ship it
(`expandable_segments:True`, tuning options, `backend:cudaMallocAsync`), each in a fresh
process started with that variable and the rest of this program's environment: matrix
products, tensors of 1 KiB to 256 MiB written and read back, memory_allocated() back to where
it was once they are deleted, empty_cache(), raw blocks of caching_allocator_alloc, and a
CUDA graph captured and replayed with new inputs.

With PyTorch's allocator: every setting is accepted and the program runs right under each
(the variable picks the allocator's backend and tunes it; none changes what a program sees).

Why vmm may differ: the variable is parsed by PyTorch's allocator configuration at CUDA's
first use, while vmm's allocator is made current instead; a backend other than the native one
(cudaMallocAsync) is chosen before vmm is, and an option vmm does not know could make its
enabling refuse, or leave PyTorch's and vmm's allocators both in use.
"""
import os
import subprocess
import sys

from dropin_report import report

CONFS = [
    "expandable_segments:True",
    "max_split_size_mb:64,roundup_power2_divisions:4,garbage_collection_threshold:0.8",
    "backend:cudaMallocAsync",
    "backend:native,expandable_segments:False,release_lock_on_cudamalloc:True",
    "pinned_use_cuda_host_register:True,pinned_num_register_threads:4",
]
MIB = 1 << 20


def workload():
    """What each child runs: a list of what differed from a right run."""
    import torch
    errors = []
    torch.manual_seed(0)
    a = torch.randn(512, 512, device="cuda")
    want = (a.double() @ a.double()).float().cpu()
    got = (a @ a).cpu()
    if not torch.allclose(got, want, rtol=1e-3, atol=1e-3):
        errors.append("a matrix product differs from its float64 reference")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    sizes = [1024 * (1 + (i * 97) % 4096) for i in range(64)] + [64 * MIB, 256 * MIB]
    ts = [torch.full((n,), i % 251, dtype=torch.uint8, device="cuda") for i, n in enumerate(sizes)]
    del ts[::2]
    more = [torch.full((n,), 7, dtype=torch.uint8, device="cuda") for n in sizes[::3]]
    kept = list(enumerate(sizes))[1::2]
    for (i, n), t in zip(kept, ts):
        if t.numel() != n or int(t.min().item()) != i % 251 or int(t.max().item()) != i % 251:
            errors.append(f"tensor {i} of {n} bytes does not hold what was written")
    if any(int(m.min().item()) != 7 for m in more):
        errors.append("a tensor allocated after frees does not hold what was written")
    del t  # the loop's last tensor
    if torch.cuda.memory_reserved() < torch.cuda.memory_allocated():
        errors.append("memory_reserved() is below memory_allocated()")
    del ts, more
    torch.cuda.synchronize()
    if torch.cuda.memory_allocated() != base:
        errors.append(f"memory_allocated() is {torch.cuda.memory_allocated()} after the tensors "
                      f"were deleted, {base} before them")
    torch.cuda.empty_cache()
    ptrs = [torch.cuda.caching_allocator_alloc(n) for n in (512, 3 * MIB, 40 * MIB)]
    if any(p == 0 for p in ptrs):
        errors.append(f"caching_allocator_alloc returned a null pointer: {ptrs}")
    for p in ptrs:
        torch.cuda.caching_allocator_delete(p)

    x = torch.zeros(1 << 20, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x * 2 + 1  # warm up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2 + 1
    for v in (1.0, 5.0):
        x.fill_(v)
        graph.replay()
        torch.cuda.synchronize()
        if not bool((y == 2 * v + 1).all()):
            errors.append(f"the graph's replay with input {v} gave a wrong output")
    del graph, y
    return errors


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        errors = workload()
        for e in errors:
            print(e, file=sys.stderr)
        sys.exit(1 if errors else 0)
    errors = []
    # All at once: each process pays torch's import and CUDA's start-up.
    runs = {conf: subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child"],
                                   env=dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for conf in CONFS}
    for conf, run in runs.items():
        try:
            _, stderr = run.communicate(timeout=45)
        except subprocess.TimeoutExpired:
            run.kill()
            errors.append(f"PYTORCH_CUDA_ALLOC_CONF={conf}: the program hung")
            continue
        if run.returncode != 0:
            tail = " | ".join(stderr.strip().splitlines()[-4:])
            errors.append(f"PYTORCH_CUDA_ALLOC_CONF={conf}: exit status {run.returncode}: {tail}")
    report(errors)


if __name__ == "__main__":
    main()
