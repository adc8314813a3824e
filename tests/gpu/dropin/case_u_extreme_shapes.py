"""CUDA tensors and storages of unusual sizes, as data loaders, padding code and checkpoint
loaders make them: empty tensors (their data_ptr() is 0 and they count in no statistic;
torch.empty(0), (3, 0), a zero-element slice of a live tensor, torch.cat of empties),
record_stream() of an empty tensor, _share_cuda_() of an empty storage and
ForkingPickler.dumps() of an empty CUDA tensor, torch.empty((-1,)), the legacy constructors
torch.cuda.FloatTensor(5) / () / ([1, 2]) / (-1), a 2 GiB uint8 tensor (its storage's nbytes
and what memory_allocated() grows by), a 1-byte tensor (the same), a pinned CPU tensor and
its non-blocking copy, an UntypedStorage(0) on the GPU resized to 1 byte, back to 0 and to
-1, and a tensor resize_()d from 0 to 10 elements and back.

What each does with PyTorch's allocator is not written here: the same probe runs in a child
with PyTorch's allocator (VMM_TORCH_ENABLE removed from its environment) and in this
process, and the outcomes must agree: returned (pointers summarised as "null" or "pointer",
sizes and byte counts exact) or raised (the exception's type).

Why vmm may differ: vmm hands out no memory for a zero-byte request (its Malloc returns
null), rounds sizes as its pools do, replaces PyTorch's reducer for CUDA tensors and its IPC
handle for storages (a null storage has no vmm block), and answers record_stream for memory
it does not own.
"""
import gc
import warnings

from multiprocessing.reduction import ForkingPickler

from outcome_compare import a_tensor_works, against_native, outcome

MIB = 1 << 20


def kind(p):
    return "null" if p == 0 else "pointer"


def probes():
    import torch
    torch.empty(1, device="cuda")
    res = [["_backend", {"kind": "returned", "value": torch.cuda.get_allocator_backend()}]]

    def rec(name, fn):
        res.append([name, outcome(fn)])

    def grew(make):
        """[what make() summarised, memory_allocated() growth while it lives]."""
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        t, summary = make()
        torch.cuda.synchronize()
        delta = torch.cuda.memory_allocated() - before
        del t
        return [summary, delta]

    rec("empty(0): [data_ptr, nbytes], allocated growth",
        lambda: grew(lambda: (lambda t: (t, [kind(t.data_ptr()), t.untyped_storage().nbytes()]))(
            torch.empty(0, device="cuda"))))
    rec("empty((3, 0)) data_ptr", lambda: kind(torch.empty((3, 0), device="cuda").data_ptr()))
    rec("empty(1)[1:] data_ptr", lambda: kind(torch.empty(1, device="cuda")[1:].data_ptr()))
    rec("cat of two empties: data_ptr",
        lambda: kind(torch.cat([torch.empty(0, device="cuda"),
                                torch.empty(0, device="cuda")]).data_ptr()))
    rec("zeros(0, 5).sum()", lambda: float(torch.zeros(0, 5, device="cuda").sum().item()))
    rec("empty(0).record_stream(side)",
        lambda: torch.empty(0, device="cuda").record_stream(torch.cuda.Stream()))
    rec("empty(5).record_stream(current stream)",
        lambda: torch.empty(5, device="cuda").record_stream(torch.cuda.current_stream()))

    def share_empty():
        out = torch.empty(0, device="cuda").untyped_storage()._share_cuda_()
        return [len(out), out[1] is None or len(out[1]) == 0]
    rec("empty storage _share_cuda_(): [tuple length, no handle]", share_empty)

    def dumps_empty():
        return len(ForkingPickler.dumps(torch.empty(0, device="cuda"))) > 0
    rec("ForkingPickler.dumps(empty(0) cuda) gives bytes", dumps_empty)
    rec("empty((-1,))", lambda: torch.empty((-1,), device="cuda"))

    def legacy(*args):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = torch.cuda.FloatTensor(*args)
        return [t.numel(), t.device.type, str(t.dtype), kind(t.data_ptr()),
                t.tolist() if t.numel() <= 2 else None]
    rec("torch.cuda.FloatTensor(5)", lambda: legacy(5)[:4])
    rec("torch.cuda.FloatTensor()", lambda: legacy())
    rec("torch.cuda.FloatTensor([1, 2])", lambda: legacy([1.0, 2.0]))
    rec("torch.cuda.FloatTensor(-1)", lambda: legacy(-1))

    def huge():
        t = torch.empty(2 ** 31, dtype=torch.uint8, device="cuda")
        t[-1] = 7
        return t, [t.untyped_storage().nbytes(), kind(t.data_ptr()), int(t[-1].item())]
    rec("empty(2**31, uint8): [nbytes, data_ptr, last byte], allocated growth",
        lambda: grew(huge))
    rec("empty(1, uint8): allocated growth",
        lambda: grew(lambda: (torch.empty(1, dtype=torch.uint8, device="cuda"), None)))
    rec("empty(1000, float32): allocated growth",
        lambda: grew(lambda: (torch.empty(1000, device="cuda"), None)))

    def pinned():
        h = torch.arange(1000, dtype=torch.float32, pin_memory=True)
        d = h.cuda(non_blocking=True)
        torch.cuda.synchronize()
        return [h.is_pinned(), float(d.sum(dtype=torch.float64).item())]
    rec("pinned CPU tensor and its non-blocking copy", pinned)

    def storage_resizes():
        s = torch.UntypedStorage(0, device="cuda")
        steps = [[kind(s.data_ptr()), s.nbytes()]]
        s.resize_(1)
        steps.append([kind(s.data_ptr()), s.nbytes()])
        s.resize_(0)
        steps.append([kind(s.data_ptr()), s.nbytes()])
        return steps
    rec("UntypedStorage(0) cuda, resize_(1), resize_(0): [data_ptr, nbytes]", storage_resizes)
    rec("UntypedStorage(0) cuda resize_(-1)",
        lambda: torch.UntypedStorage(0, device="cuda").resize_(-1))

    def tensor_resizes():
        t = torch.empty(0, device="cuda")
        steps = [kind(t.data_ptr())]
        t.resize_(10)
        t.fill_(1.0)
        steps.append([kind(t.data_ptr()), t.untyped_storage().nbytes()])
        t.resize_(0)
        steps.append([kind(t.data_ptr()), t.untyped_storage().nbytes()])
        return steps
    rec("empty(0).resize_(10) then resize_(0): data_ptr, nbytes", tensor_resizes)

    rec("a tensor at the end", a_tensor_works)
    return res


if __name__ == "__main__":
    against_native(probes)
