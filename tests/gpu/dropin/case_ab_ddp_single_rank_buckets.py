"""DistributedDataParallel in one process (world size 1 over NCCL: a multi-GPU training script
run on one GPU): gradients kept in DDP's buckets, which the parameters' .grad view
(gradient_as_bucket_view=True, bucket_cap_mb=1 so that there are several), no_sync()
gradient accumulation, the fp16_compress_hook communication hook, a model built, trained and
dropped eight times (plain and hooked in turn); then asynchronous collectives whose input
the program drops right after the call, while the default stream allocates and overwrites
tensors of the same size.

With PyTorch's allocator: after 8 steps (every other one accumulating under no_sync) the DDP
model's weights equal those of the same steps run without DDP (within 1e-5; 1e-3 with the
fp16 hook); from the fourth build-train-drop cycle to the eighth, memory_allocated() grows by
no more than two models' parameters (64 KiB spare) or, if more, than it does with PyTorch's
allocator in a child process running the same cycles (waiting up to 10 s for NCCL's watchdog
to let go of finished work). torch 2.11 itself keeps a varying amount from process to process
after a few cycles, up to two models' parameters: from the second cycle to the fourth it grew
by 1,610,752 bytes in run FK, by 805,376 in one process and 0 in its child in run FL, by
3,220,480 and -805,376 in a second FL run, all with PyTorch's allocator; a leak of a model's
parameters per cycle (four models over four cycles) exceeds that bound; and
all_gather_into_tensor / reduce_scatter_tensor(async_op=True) whose input is deleted at once,
with the NCCL stream waiting behind a GPU sleep, deliver the input's values (ProcessGroupNCCL
keeps the input's memory until the work is done: record_stream on its stream, or a stash).

Why vmm may differ: buckets, gradients and the optimizer's state come from vmm; the NCCL
stream is a PyTorch pool stream that the collectives' inputs are recorded on
(CUDAPluggableAllocator's recordStream into vmm), and NCCL reads and writes vmm's mappings.
"""
import contextlib
import gc
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dropin_report import report
from outcome_compare import child_env, emit, finish_probe, start_probe


def make():
    torch.manual_seed(0)
    L = torch.nn.Linear
    return torch.nn.Sequential(L(256, 512), torch.nn.GELU(), L(512, 512), torch.nn.GELU(),
                               L(512, 16)).cuda()


def train(model, data, ddp=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for i, (x, y) in enumerate(data):
        ctx = ddp.no_sync() if ddp is not None and i % 2 == 0 else contextlib.nullcontext()
        with ctx:
            F.mse_loss((model if ddp is None else ddp)(x), y).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    return [p.detach().cpu() for p in model.parameters()]


def cycle(data, hook):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    model = make()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=1,
                                                    gradient_as_bucket_view=True)
    if hook:
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    weights = train(model, data, ddp)
    del ddp, model
    return weights


def allocated(at_most=None, seconds=10.0):
    """memory_allocated() once NCCL's watchdog has let go of finished work (it holds a
    collective's tensors until it sees the work done): with `at_most`, the first reading at or
    below it, or the last after `seconds`; without, the lowest reading over 2 s, so that
    tensors the watchdog had not yet let go of do not raise the reference."""
    deadline = time.monotonic() + (seconds if at_most is not None else 2.0)
    low = None
    while True:
        gc.collect()
        torch.cuda.synchronize()
        now = torch.cuda.memory_allocated()
        low = now if low is None else min(low, now)
        if at_most is not None and now <= at_most:
            return now
        if time.monotonic() > deadline:
            return now if at_most is not None else low
        time.sleep(0.1)


def async_input_dropped(errors, n=1 << 22):
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        inp = torch.arange(n, dtype=torch.float32, device="cuda")
        out = torch.empty(n, device="cuda")
        torch.cuda._sleep(50_000_000)  # the NCCL stream waits for this stream
        work = getattr(dist, name)(out, inp, async_op=True)
        del inp
        junk = [torch.full((n,), -1.0, device="cuda") for _ in range(3)]
        work.wait()
        torch.cuda.synchronize()
        del junk
        bad = int((out != torch.arange(n, dtype=torch.float32, device="cuda")).sum().item())
        if bad:
            errors.append(f"{name}(async_op=True) with its input deleted at once: {bad} of {n} "
                          f"output values are not the input's")


def native_growth(child, errors):
    """The growth the child's cycles made with PyTorch's allocator (outcome_compare's probe
    process: this program with "--probe"); None (and an error) if it failed."""
    outcomes = finish_probe(child, "PyTorch's allocator", errors, timeout=45)
    return None if outcomes is None else dict(outcomes)["growth"]["value"]


def main():
    errors = []
    if not dist.is_available() or not dist.is_nccl_available():
        print("no NCCL in this torch: nothing checked")
        report(errors)
        return
    growth_only = "--probe" in sys.argv
    child = None if growth_only else start_probe([], child_env())
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    g = torch.Generator(device="cuda").manual_seed(1)
    data = [(torch.randn(64, 256, device="cuda", generator=g),
             torch.randn(64, 16, device="cuda", generator=g)) for _ in range(8)]
    ref = train(make(), data)
    for rnd, hook in enumerate((False, True) * 4):
        got = cycle(data, hook)
        tol = 1e-3 if hook else 1e-5
        worst = max(float((a - b).abs().max()) for a, b in zip(got, ref))
        if worst > tol:
            errors.append(f"cycle {rnd} ({'fp16 hook' if hook else 'plain'}): DDP's weights "
                          f"differ from training without DDP by {worst:.3g} (tolerance {tol})")
        if rnd == 3:
            first = allocated()
    last = allocated(at_most=first)
    if growth_only:
        emit([["growth", {"kind": "returned", "value": last - first}]])
        dist.destroy_process_group()
        return
    native = native_growth(child, errors)
    model_bytes = sum((p.numel() * p.element_size() + 511) // 512 * 512
                      for p in make().parameters())
    allowed = None if native is None else max(native, 2 * model_bytes + (64 << 10))
    if allowed is not None and last - first > allowed:
        errors.append(f"from the fourth DDP cycle to the eighth memory_allocated() grew by "
                      f"{last - first} bytes ({first} to {last}), more than two models' "
                      f"parameters (2 x {model_bytes}) and than with PyTorch's allocator "
                      f"({native})")
    async_input_dropped(errors)
    dist.destroy_process_group()
    report(errors)


if __name__ == "__main__":
    main()
