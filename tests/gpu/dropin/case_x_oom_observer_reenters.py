"""Out-of-memory observers that use the allocator (torch._C._cuda_attach_out_of_memory_observer,
what training frameworks attach to dump state and free caches of their own when the GPU runs
out): the observer reads the statistics, drops a cache of tensors the program kept, empties
the allocator's cache and makes and reads a small marker tensor, before the exception
reaches the program; and an out of memory raised in the autograd engine's thread (a
gradient that does not fit under a cap), which runs the observer in that thread.

With PyTorch's allocator observers run after the allocator released its lock, in the thread
whose request failed (DeviceCachingAllocator::malloc unlocks before calling them, since
they may take the GIL), so such an observer runs to its end, without deadlock or error,
and the request still raises torch.cuda.OutOfMemoryError: for a 1 TiB request in the main
thread, and for a 256 MiB weight gradient in backward() under a cap of what the process
holds plus 64 MiB (the observer then runs in the autograd thread and backward() raises the
out of memory in the caller); the cached tensors are gone afterwards, the markers hold their
values, and with the cap lifted the same step computes the gradient; memory_allocated() is
back at its baseline at the end.

Why vmm may differ: vmm's out-of-memory path (VmmAllocator::OutOfMemory) calls the
observers itself, after its retries and its release of cached memory; an observer that
allocates, frees or empties the cache re-enters vmm there, and from the autograd thread
(no Python thread state of its own) it also takes the GIL there.
"""
import threading

import torch
from dropin_report import baseline, memory_back, report, settle

MIB = 1 << 20


class Observer:
    def __init__(self):
        self.on = False
        self.calls = []  # (thread name, device, cache dropped, marker sum)
        self.errors = []
        self.cache = []

    def __call__(self, device, alloc, device_total, device_free):
        if not self.on:
            return
        try:
            st = torch.cuda.memory_stats()
            allocated = torch.cuda.memory_allocated()
            if st["allocated_bytes.all.current"] != allocated:
                self.errors.append("memory_stats() and memory_allocated() disagree in the "
                                   "observer")
            dropped = len(self.cache)
            self.cache.clear()
            torch.cuda.empty_cache()
            marker = torch.full((MIB // 4,), 5.0, device="cuda")
            self.calls.append((threading.current_thread().name, device, dropped,
                               float(marker.sum().item())))
            del marker
        except Exception as e:  # noqa: BLE001
            self.errors.append(f"observer: {type(e).__name__}: {str(e)[:300]}")


def main():
    errors = []
    if not hasattr(torch._C, "_cuda_attach_out_of_memory_observer"):
        print("this torch cannot attach out-of-memory observers; nothing checked")
        report(errors)
        return
    torch.empty(1, device="cuda")
    obs = Observer()
    torch._C._cuda_attach_out_of_memory_observer(obs)
    base, res0, _ = baseline()

    # 1. A request larger than the GPU, in the main thread.
    obs.cache = [torch.full((16 * MIB // 4,), 1.0, device="cuda") for _ in range(4)]
    obs.on = True
    try:
        torch.empty(1 << 40, dtype=torch.uint8, device="cuda")
        errors.append("a 1 TiB tensor did not raise")
    except torch.cuda.OutOfMemoryError:
        pass
    except Exception as e:  # noqa: BLE001
        errors.append(f"a 1 TiB tensor raised {type(e).__name__}, not OutOfMemoryError: "
                      f"{str(e)[:200]}")
    obs.on = False
    main_calls = list(obs.calls)
    if not main_calls:
        errors.append("the observer was not called for a 1 TiB request")
    elif main_calls[0][2] != 4 or main_calls[0][3] != 5.0 * (MIB // 4):
        errors.append(f"the observer in the main thread dropped {main_calls[0][2]} cached "
                      f"tensors (of 4) and read {main_calls[0][3]} from its marker")
    if obs.cache:
        errors.append("the tensors the observer dropped are still there")

    # 2. A gradient that does not fit, in the autograd thread.
    w = torch.zeros(64 * MIB, device="cuda", requires_grad=True)  # 256 MiB
    obs.cache = [torch.full((8 * MIB // 4,), 1.0, device="cuda") for _ in range(2)]
    out = (w * 2.0).sum()  # w * 2 is freed after the sum; its gradient needs 256 MiB again
    settle()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 64 * MIB) / total)
    obs.calls.clear()
    obs.on = True
    try:
        out.backward()
        errors.append("backward() did not raise with its 256 MiB gradient past the cap")
    except RuntimeError as e:
        if "out of memory" not in str(e).lower():
            errors.append(f"backward() raised {type(e).__name__} without 'out of memory': "
                          f"{str(e)[:200]}")
    obs.on = False
    torch.cuda.set_per_process_memory_fraction(1.0)
    if not obs.calls:
        errors.append("the observer was not called for the gradient that did not fit")
    else:
        name, _, dropped, msum = obs.calls[0]
        if name == threading.current_thread().name:
            print(f"note: the observer ran in the main thread ({name})")
        if dropped != 2 or msum != 5.0 * (MIB // 4):
            errors.append(f"the observer in backward dropped {dropped} cached tensors (of 2) "
                          f"and read {msum} from its marker")
    del out
    w.grad = None
    out = (w * 2.0).sum()
    out.backward()
    if w.grad is None or float(w.grad.min().item()) != 2.0 or float(w.grad.max().item()) != 2.0:
        errors.append("with the cap lifted the gradient is not 2 everywhere")
    del out, w

    # The program goes on.
    t = torch.full((64 * MIB // 4,), 3.0, device="cuda")
    if float(t.sum().item()) != 3.0 * t.numel():
        errors.append("a tensor made after the out-of-memory errors is wrong")
    del t
    errors.extend(obs.errors[:5])
    obs.cache.clear()
    settle()
    memory_back(errors, base, res0, "after the out-of-memory errors")
    report(errors)


if __name__ == "__main__":
    main()
