"""A CUDA graph's output used after the graph is deleted (a serving engine that drops the
graph of a batch size it no longer needs but keeps its last result), and the graph's memory
coming back.

PyTorch's own test_graph_memory_stats_and_use_result_after_destroy_graph (test_cuda.py) does
this: a graph captures b = a.clone(), then five times b = b.clone() + 1. With PyTorch's
allocator the capture's temporaries stay reserved in the graph's private pool while the graph
lives (empty_cache() keeps them: here at least two 64 MiB blocks); replay gives b == a + 5;
after `del g` and empty_cache() b is still the graph's last result and still usable in eager
code, while the temporaries' memory is released (memory_reserved() falls by at least one
block) and memory_allocated() counts b alone; new tensors written over the freed space leave b
alone; once b is dropped, memory_allocated() and memory_reserved() are back where they were
before the capture.

Why vmm may differ: the graph's private pool is a vmm pool whose last use ends at `del g`
(releasePool); its chunks that still hold a live block (b's) must stay mapped for b, the others
must be released, and b's block must become an ordinary allocation of the device that a later
free returns.
"""

import torch
from dropin_report import capture_increments, memory_back, report, settle

NUMEL = 16 << 20  # float32: 64 MiB
T = NUMEL * 4


def main():
    errors = []
    a = torch.ones(NUMEL, device="cuda")
    b = a.clone()
    for _ in range(5):
        b = b.clone() + 1  # kernels loaded eagerly first
    g, b = capture_increments(a, 5)  # one capture and release first: per-capture state settles
    g.replay()
    del g, b
    settle()
    base_alloc, base_res = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()

    g, b = capture_increments(a, 5)
    settle()
    held = torch.cuda.memory_reserved() - base_res
    if held < 2 * T:
        errors.append(f"while the graph lives its pool holds {held} bytes after empty_cache(); "
                      f"its capture needed at least {2 * T} at once")
    g.replay()
    torch.cuda.synchronize()
    if not bool((b == 6).all().item()):
        errors.append("the replay did not compute a + 5")

    del g
    settle()
    if not bool((b == 6).all().item()):
        errors.append("the graph's output changed when the graph was deleted")
    held_after = torch.cuda.memory_reserved() - base_res
    if held_after > held - T:
        errors.append(f"deleting the graph gave back {held - held_after} bytes of the "
                      f"{held} its pool held (its temporaries take at least {T})")
    live = torch.cuda.memory_allocated() - base_alloc
    if not T <= live <= T + (1 << 20):
        errors.append(f"after the graph is deleted memory_allocated() counts {live} bytes "
                      f"above the baseline; the output alone is {T}")

    c = b * 2
    others = [torch.full((NUMEL,), 9.0, device="cuda") for _ in range(4)]
    torch.cuda.synchronize()
    if not bool((b == 6).all().item()) or not bool((c == 12).all().item()):
        errors.append("new tensors made after the graph was deleted overwrote its output")
    del b, c, others
    settle()
    memory_back(errors, base_alloc, base_res, "once the output is dropped")
    del a
    report(errors)


if __name__ == "__main__":
    main()
