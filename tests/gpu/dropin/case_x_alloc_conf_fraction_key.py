"""The newer keys of PYTORCH_CUDA_ALLOC_CONF, set in the environment before torch starts, as
launch scripts and cluster job templates ship them: `per_process_memory_fraction` (the cap of
torch.cuda.set_per_process_memory_fraction given as configuration: a job sharing a GPU with
another one, or a test simulating a smaller card), beside other options, and the acceptance
of `graph_capture_record_stream_reuse` and `pinned_reserve_segment_size_mb`. Each setting runs
in a fresh process with the rest of this program's environment. Only keys that this torch's
CUDA allocator configuration knows (the key's text is in libc10_cuda.so) are tried.

With PyTorch's allocator (DeviceCachingAllocator's constructor calls
setMemoryFraction(CUDAAllocatorConfig::per_process_memory_fraction())), with
`per_process_memory_fraction:0.04`: torch.cuda.get_per_process_memory_fraction() is 0.04; a
tensor of half of 4% of the GPU fits and holds what is written; one of 1.5 times 4% raises
torch.cuda.OutOfMemoryError, and so does a second tensor of 0.6 times 4% beside the first;
after set_per_process_memory_fraction(1.0) the 1.5 times tensor fits. The same holds with
expandable_segments and garbage_collection_threshold beside the key. The other two keys are
accepted and a program with pinned copies and a CUDA graph runs right under them.

Why vmm may differ: PyTorch's allocator configuration keeps parsing the variable, but the
fraction it holds is applied by PyTorch's own device allocators, which vmm replaces; vmm takes
its cap from set_per_process_memory_fraction only (docs/DESIGN.md 2g: "Options of newer
PyTorch releases that cap the allocator ... are not read by vmm"), so the job's cap would not
hold and get_per_process_memory_fraction() would say 1.0.
"""
import os
import subprocess
import sys

from dropin_report import report

FRACTION = 0.04
FRACTION_CONFS = [
    f"per_process_memory_fraction:{FRACTION}",
    f"expandable_segments:True,per_process_memory_fraction:{FRACTION},"
    "garbage_collection_threshold:0.6",
]
OTHER_KEYS = ["graph_capture_record_stream_reuse:True", "pinned_reserve_segment_size_mb:64"]


def torch_knows(key):
    """Whether this torch's CUDA allocator configuration parses `key` (its text is in the
    library that holds the parser); read without starting CUDA."""
    import torch
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10_cuda.so")
    try:
        with open(lib, "rb") as f:
            return key.encode() in f.read()
    except OSError:
        return False


def fraction_child():
    import torch
    errors = []
    torch.zeros(1, device="cuda")
    total = torch.cuda.get_device_properties(0).total_memory
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is not None and abs(getter() - FRACTION) > 1e-3:
        errors.append(f"get_per_process_memory_fraction() is {getter()}, the variable says "
                      f"{FRACTION}")
    cap = int(FRACTION * total)

    def fits(nbytes):
        try:
            t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            t.fill_(5)
            return t
        except torch.cuda.OutOfMemoryError:
            return None

    half = fits(cap // 2)
    if half is None:
        errors.append(f"a tensor of half the cap ({cap // 2} bytes) raised OutOfMemoryError")
    elif int(half[-1].item()) != 5 or int(half[0].item()) != 5:
        errors.append("the tensor of half the cap does not hold what was written")
    big = fits(cap + cap // 2)
    if big is not None:
        errors.append(f"a tensor of 1.5 times the cap ({cap + cap // 2} bytes) did not raise "
                      f"OutOfMemoryError under per_process_memory_fraction:{FRACTION}")
    del big
    torch.cuda.empty_cache()
    more = fits(cap * 6 // 10)
    if more is not None:
        errors.append("a second tensor of 0.6 times the cap beside one of half of it did not "
                      "raise OutOfMemoryError")
    del more
    torch.cuda.set_per_process_memory_fraction(1.0)
    big = fits(cap + cap // 2)
    if big is None:
        errors.append("after set_per_process_memory_fraction(1.0) the 1.5 times tensor raised")
    del big, half
    return errors


def other_child():
    import torch
    errors = []
    host = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    dev = host.to("cuda", non_blocking=True)
    back = torch.empty_like(host).pin_memory()
    back.copy_(dev * 2, non_blocking=True)
    torch.cuda.synchronize()
    if not torch.equal(back, host * 2):
        errors.append("pinned copies to the GPU and back gave wrong values")
    x = torch.zeros(4096, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (x * 3 + 1).sum()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = (x * 3 + 1).clone()
    for v in (1.0, 4.0):
        x.fill_(v)
        g.replay()
        torch.cuda.synchronize()
        if not bool((y == v * 3 + 1).all()):
            errors.append(f"a graph replayed with input {v} gave a wrong output")
    return errors


def main():
    if len(sys.argv) > 1 and sys.argv[1].startswith("--child"):
        errors = fraction_child() if sys.argv[1] == "--child-fraction" else other_child()
        for e in errors:
            print(e, file=sys.stderr)
        sys.exit(1 if errors else 0)
    errors = []
    runs = {}
    if torch_knows("per_process_memory_fraction"):
        for conf in FRACTION_CONFS:
            runs[conf] = "--child-fraction"
    else:
        print("this torch's allocator configuration has no per_process_memory_fraction key")
    for conf in OTHER_KEYS:
        if torch_knows(conf.split(":")[0]):
            runs[conf] = "--child-other"
    procs = {conf: subprocess.Popen([sys.executable, os.path.abspath(__file__), mode],
                                    env=dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for conf, mode in runs.items()}
    for conf, proc in procs.items():
        try:
            _, stderr = proc.communicate(timeout=50)
        except subprocess.TimeoutExpired:
            proc.kill()
            errors.append(f"PYTORCH_CUDA_ALLOC_CONF={conf}: the program hung")
            continue
        if proc.returncode != 0:
            lines = [ln for ln in stderr.strip().splitlines() if "deprecated" not in ln]
            errors.append(f"PYTORCH_CUDA_ALLOC_CONF={conf}: exit status {proc.returncode}: "
                          + " | ".join(lines[-5:]))
    report(errors)


if __name__ == "__main__":
    main()
