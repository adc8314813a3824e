"""set_per_process_memory_fraction changed while the program runs: lowered below what the
allocator caches, then below what is live, raised, and lifted (a process that shrinks its
share of a GPU when a second job arrives and takes it back when the job leaves; vLLM's sleep
mode and colocated RL trainers resize their budget this way).

PyTorch's allocator checks the fraction only when it needs new device memory (alloc_block);
memory it has cached serves any request that fits, whatever the fraction; a request that
needs new memory past the fraction first frees the cache and retries. So, with `cap(x)` a
fraction of what the process held at the start plus x: after 8 tensors of 256 MiB are made
and freed (2 GiB cached), under cap(1 GiB) a 256 MiB tensor is made (from the cache) and a
512 MiB one (the cache given back first); after empty_cache() a second 512 MiB one raises
torch.cuda.OutOfMemoryError (768 MiB live); under cap(2 GiB) it fits; under cap(512 MiB),
below the 1280 MiB live, live tensors take in-place writes, a 256 MiB request raises
(after empty_cache()), and once a 512 MiB tensor is freed a 256 MiB and a 128 MiB request
are served from its cached memory while a 512 MiB one raises; with the fraction 1.0 again
the 512 MiB one fits; every tensor holds its values throughout, and at the end
memory_allocated() is back at the baseline and empty_cache() brings memory_reserved() back.

Why vmm may differ: vmm keeps the fraction in its own cap (device_cap.h), checked at each
growth of its pools; a cap set below what is held must not stop cached memory from being
handed out, nor make a free give memory back that a later request under the cap then cannot
get again, and a cap raised must let growth resume.
"""

import torch
from dropin_report import baseline, memory_back, report, settle

MIB = 1 << 20


def make(mib, value):
    """A float32 tensor of `mib` MiB filled with `value`, or None on OutOfMemoryError."""
    try:
        return torch.full((mib * MIB // 4,), float(value), device="cuda")
    except torch.cuda.OutOfMemoryError:
        return None


def holds(t, value):
    n = t.numel()
    return all(float(t[i].item()) == value for i in (0, n // 2, n - 1))


def main():
    errors = []
    keep = torch.full((16 * 1024,), 3.0, device="cuda")
    base, res0, _ = baseline()
    total = torch.cuda.get_device_properties(0).total_memory

    def cap(extra_mib):
        torch.cuda.set_per_process_memory_fraction((res0 + extra_mib * MIB) / total)

    def expect(name, t, value, fits, when):
        if fits and t is None:
            errors.append(f"{when}: the {name} tensor raised OutOfMemoryError")
        elif not fits and t is not None:
            errors.append(f"{when}: the {name} tensor did not raise OutOfMemoryError")
        elif t is not None and not holds(t, value):
            errors.append(f"{when}: the {name} tensor does not hold {value}")

    cached = [make(256, i) for i in range(8)]
    if any(t is None for t in cached):
        errors.append("8 tensors of 256 MiB did not fit without a cap")
    del cached
    cap(1024)  # below the 2 GiB now cached
    when = "cap 1 GiB, 2 GiB cached"
    t1 = make(256, 1)
    expect("256 MiB", t1, 1, True, when)
    t2 = make(512, 2)
    expect("512 MiB", t2, 2, True, when)
    torch.cuda.empty_cache()
    t3 = make(512, 3)
    expect("second 512 MiB (768 MiB live)", t3, 3, False, when)
    del t3
    cap(2048)
    t3 = make(512, 3)
    expect("second 512 MiB", t3, 3, True, "cap raised to 2 GiB")

    cap(512)  # below the 1280 MiB live
    when = "cap 512 MiB, 1280 MiB live"
    if t1 is not None:
        t1.add_(1.0)
        if not holds(t1, 2.0):
            errors.append(f"{when}: an in-place add on a live tensor was lost")
    torch.cuda.empty_cache()
    t4 = make(256, 4)
    expect("new 256 MiB", t4, 4, False, when)
    del t4, t2  # 512 MiB now cached
    t4 = make(256, 4)
    expect("256 MiB (512 MiB just freed)", t4, 4, True, when)
    t5 = make(128, 5)
    expect("128 MiB (the rest of the freed 512 MiB)", t5, 5, True, when)
    t6 = make(512, 6)
    expect("512 MiB", t6, 6, False, when)
    del t6
    torch.cuda.set_per_process_memory_fraction(1.0)
    t6 = make(512, 6)
    expect("512 MiB", t6, 6, True, "fraction 1.0 again")
    for name, t, v in (("first 256 MiB", t1, 2.0), ("second 512 MiB", t3, 3.0),
                       ("256 MiB", t4, 4.0), ("128 MiB", t5, 5.0)):
        if t is not None and not holds(t, v):
            errors.append(f"at the end the {name} tensor no longer holds {v}")
    del t  # the loop's last tensor
    if float(keep.sum().item()) != 3.0 * keep.numel():
        errors.append("a small tensor made at the start changed")
    del t1, t3, t4, t5, t6
    settle()
    memory_back(errors, base, res0, "at the end")
    report(errors)


if __name__ == "__main__":
    main()
