"""Functions the multi-process tests run in spawned processes (importable by module name)."""

import torch
import torch.utils.data


def pattern(n, seed, dtype=torch.float32, device="cpu"):
    """A recognisable sequence of `n` values for producer/consumer checks."""
    return ((torch.arange(n, dtype=torch.float64) * 7 + seed) % 1009).to(dtype).to(device)


def consumer(index, jobs, replies):
    """Receives (name, seed, tensor) items until None; checks each tensor against the pattern,
    writes `index + 1` into element 0 of its own row of the tensor, and replies."""
    import vmm_torch

    vmm_torch.install_reducers()  # so that anything sent back travels the same way
    while True:
        item = jobs.get(timeout=60)
        if item is None:
            replies.put(("done", index))
            return
        name, seed, tensor = item
        expected = pattern(tensor.numel(), seed, tensor.dtype, tensor.device).view(tensor.shape)
        # Each consumer owns column `index` of the last row: write there, others read it.
        ok = bool(torch.equal(tensor[:-1], expected[:-1]))
        tensor[-1, index] = index + 1
        if tensor.is_cuda:
            torch.cuda.synchronize()  # the write is visible before the reply
        replies.put((name, index, ok, tuple(tensor.shape), str(tensor.dtype)))
        del tensor, item


def describe_received(jobs, results):
    """Receives items until None and replies, for each, what arrived: ("tensor", type name,
    shape, stride, storage offset, dtype, requires_grad, sum) or, when unpickling failed,
    ("error", exception type, text). The process must survive hostile payloads."""
    import faulthandler

    import vmm_torch  # noqa: F401  (nothing installed: the rebuild needs no setup)

    # A crash or a hang shows where it happened (on stderr, which the test run keeps).
    faulthandler.enable()
    faulthandler.dump_traceback_later(50, exit=True)
    while True:
        try:
            item = jobs.get(timeout=60)
        except Exception as e:  # reported to the parent, which checks the type
            results.put(("error", type(e).__name__, str(e)))
            continue
        if item is None:
            results.put(("done",))
            return
        results.put(("tensor", type(item).__name__, tuple(item.shape), item.stride(),
                     item.storage_offset(), str(item.dtype), item.requires_grad,
                     float(item.detach().double().sum())))
        del item


def open_and_sum(payload, results):
    """Unpickles a SharedTensor sent as bytes, opens it and replies with its sum."""
    import pickle

    shared = pickle.loads(payload)
    tensor = shared.open()
    results.put(float(tensor.double().sum()))


def try_import(payload, results):
    """Tries to open a pickled SharedTensor; replies ("ok", sum) or (exception type, text)."""
    import pickle

    shared = pickle.loads(payload)
    try:
        tensor = shared.open()
        results.put(("ok", float(tensor.double().sum())))
    except Exception as e:  # reported to the parent, which checks the type
        results.put((type(e).__name__, str(e)))


def gpu_enabled_worker(results, handle_type):
    """In a fresh process: enable vmm, train a little, report stats (GPU tests)."""
    import vmm_torch

    vmm_torch.enable(handle_type=handle_type)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(20):
        x = torch.randn(128, 64, device="cuda")
        y = torch.randint(10, (128,), device="cuda")
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.cuda.synchronize()
    stats = vmm_torch.memory_stats()
    in_pool = vmm_torch.in_vmm_pool(next(model.parameters()))
    torch.cuda.empty_cache()  # reaches vmm through the reset hook
    results.put({"losses": losses, "stats": stats, "in_pool": in_pool,
                 "hooks": list(vmm_torch.enabled_hooks()),
                 "reserved_after_empty": vmm_torch.memory_reserved()})


def gpu_producer(results, handle_type, n):
    """In a fresh process: enable vmm and reducers, send a CUDA tensor to a spawned consumer,
    report what it saw (GPU tests)."""
    import torch.multiprocessing as mp

    import vmm_torch

    vmm_torch.enable(handle_type=handle_type)
    vmm_torch.install_reducers()
    try:
        torch.empty(1, device="cuda")  # creates the device pool with this handle type
    except RuntimeError as e:
        results.put(f"handle type {handle_type} unavailable: {e}")
        return
    ctx = mp.get_context("spawn")
    jobs, replies = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=consumer, args=(0, jobs, replies))
    proc.start()
    t = pattern(n * 4, 3, torch.float32, "cuda").view(n, 4)
    torch.cuda.synchronize()
    jobs.put(("t", 3, t))
    reply = replies.get(timeout=120)
    torch.cuda.synchronize()
    written = float(t[-1, 0])
    jobs.put(None)
    replies.get(timeout=60)
    proc.join(60)
    results.put({"reply": reply, "written": written, "exitcode": proc.exitcode})


def gpu_out_of_memory(results):
    """enable() with a 1 GiB limit, then 2 GiB asked for: replies with the error's type and
    text, and whether the process still allocates and computes afterwards."""
    import vmm_torch

    vmm_torch.enable(memory_limit="1G")
    try:
        torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
        results.put({"error": None})
        return
    except Exception as e:  # the allocator hook's error, thrown through PyTorch
        error = (type(e).__name__, str(e))
    t = torch.ones(1 << 20, device="cuda")
    results.put({"error": error, "after": float(t.sum()),
                 "allocated": vmm_torch.memory_stats()["allocated_bytes.all.current"]})


def gpu_workspaces_near_the_limit(results, options, seeds):
    """enable(**options) (a memory limit), then for each seed workspaces of 8-56 MiB replaced
    at random, at most five live (280 MiB), 600 allocations, each written once: replies with
    the seeds that ran out of memory and the pool's statistics."""
    import random

    import vmm_torch

    vmm_torch.enable(**options)
    failed = []
    for seed in seeds:
        rng = random.Random(seed)
        live = []
        try:
            for _ in range(600):
                if len(live) == 5:
                    live.pop(rng.randrange(len(live)))
                size = rng.randint(8 << 20, 56 << 20)
                live.append(torch.empty(size, dtype=torch.uint8, device="cuda").fill_(1))
        except torch.cuda.OutOfMemoryError:
            failed.append(seed)
        live.clear()
        torch.cuda.synchronize()
    stats = vmm_torch.memory_stats()
    results.put({"failed": failed, "switches": stats["vmm.num_page_switches"],
                 "reserved_peak": stats["reserved_bytes.all.peak"]})


def gpu_enable_too_late(results):
    """enable() after CUDA is initialised: replies with the error text."""
    import vmm_torch

    torch.zeros(1, device="cuda")
    try:
        vmm_torch.enable()
        results.put("enabled")
    except RuntimeError as e:
        results.put(str(e))


def gpu_enable_twice(results):
    """enable() twice with the same options, then with others: replies with the error."""
    import vmm_torch

    vmm_torch.enable(handle_type="posix_fd", memory_limit="8G")
    vmm_torch.enable(memory_limit="8G", handle_type="posix_fd")  # same options: no-op
    try:
        vmm_torch.enable(handle_type="none")
        results.put("reconfigured")
    except RuntimeError as e:
        results.put(str(e))


def read_after_done(q, results):
    """Receives a tensor, then waits for "done" (its sender finished writing to it), and
    replies what the tensor holds then (test_sends.py)."""
    import vmm_torch

    vmm_torch.install_reducers()
    t = q.get(timeout=60)
    assert q.get(timeout=60) == "done"
    results.put(t.tolist())


def storages_of_received(q, results):
    """Receives a dict of tensors and replies, per pair of names, whether the two share one
    storage here (the same StorageImpl), with their values (test_sends.py)."""
    import vmm_torch
    from vmm_torch import sharing

    vmm_torch.install_reducers()
    received = q.get(timeout=60)
    names = sorted(received)
    impls = {name: sharing._untyped_storage(received[name])._cdata for name in names}
    shared = {(a, b): impls[a] == impls[b] for a in names for b in names if a < b}
    results.put((shared, {name: received[name].tolist() for name in names}))


def put_and_exit(q, handle_type):
    """In a forked or spawned child: puts a host-pool tensor holding 5s, drops it and returns
    at once (the process exits); the parent reads it afterwards (test_sends.py)."""
    import vmm_torch

    vmm_torch.install_reducers()
    with vmm_torch.Pool("host", handle_type=handle_type) as pool:
        t = pool.empty((1024,))
        other = pool.empty((1024,))  # shares t's chunk: t is sent with it beside
        t.fill_(5)
        q.put(t)
        del t, other


def sum_rounds(jobs, replies, delay=0.0, ack_each=False):
    """A consumer of small tensors that each hold one value (test_send_reuse.py,
    test_send_budget.py). Replies "ready" once it can receive; then, per round, receives
    tensors until None, adds up each one's elements, counts those whose elements differ, and
    drops each at once; with `ack_each`, flushes its acknowledgements and release reports
    (vmm_torch.sharing.flush_acks) and replies the tensor's sum after each; sleeps `delay`
    seconds after each. At None it flushes and replies ("round", count, total, uneven, left);
    "exit" ends it."""
    import time

    import vmm_torch
    from vmm_torch import sharing

    vmm_torch.install_reducers()
    replies.put("ready")
    while True:
        count, total, uneven = 0, 0.0, 0
        while True:
            item = jobs.get(timeout=60)
            if item is None or isinstance(item, str):
                break
            value = float(item.double().sum())
            if item.numel() and not bool((item == item[0]).all()):
                uneven += 1
            count += 1
            total += value
            del item
            if ack_each:
                sharing.flush_acks(10)
                replies.put(value)
            if delay:
                time.sleep(delay)
        left = sharing.flush_acks(10)
        if item == "exit":
            return
        replies.put(("round", count, total, uneven, left))


def forward_first(inbox, outbox, replies):
    """B of A -> B -> C (test_send_reuse.py): sends the first tensor it receives on to
    `outbox` as it is (no copy) and drops it; reads and drops the others. After each, flushes
    its acknowledgements and reports and replies the tensor's sum; None ends it."""
    import vmm_torch
    from vmm_torch import sharing

    vmm_torch.install_reducers()
    first = True
    while True:
        t = inbox.get(timeout=60)
        if t is None:
            sharing.flush_acks(10)
            return
        if first:
            outbox.put(t)
            first = False
        value = float(t.double().sum())
        del t
        sharing.flush_acks(10)
        replies.put(value)


def keep_and_read(inbox, commands, replies):
    """C of A -> B -> C (test_send_reuse.py): receives one tensor and keeps it; replies what
    it holds (a list) at once and at each command until None."""
    import vmm_torch

    vmm_torch.install_reducers()
    t = inbox.get(timeout=60)
    replies.put(t.tolist())
    while commands.get(timeout=60) is not None:
        replies.put(t.tolist())


def min_max_of_received(q, results, count):
    """Says "ready", then receives `count` CUDA tensors and replies (min, max, numel) of each
    (test_gpu.py)."""
    import vmm_torch

    vmm_torch.install_reducers()
    torch.cuda.init()
    results.put("ready")
    for _ in range(count):
        t = q.get(timeout=60)
        results.put((float(t.min()), float(t.max()), t.numel()))
        del t


def gpu_send_steps(results):
    """In a fresh process with vmm enabled: the steps of a send as vmm's CUDA module takes them
    (one call each), and sends whose writes are still running on a side stream at the put,
    dropped at once, read by a spawned consumer (test_gpu.py)."""
    import threading

    import torch.multiprocessing as mp
    import vmm_torch
    from vmm_torch import _signatures, reductions, sharing

    vmm_torch.enable()
    vmm_torch.install_reducers()
    module = sharing.cuda_module()
    out = {"module": module is not None}
    if module is None:
        results.put(out)
        return
    alone = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
    kind, base = module.prepare_send(alone)
    out["alone"] = (kind == _signatures.SEND_IN_PLACE, base == alone.data_ptr())
    out["waited"] = (module.wait_ready(alone), module.wait_ready(alone))  # (True, False)
    leaf = torch.ones(4, device="cuda", requires_grad=True)
    out["non_leaf"] = module.prepare_send(leaf * 2)[0]
    try:
        reductions.prepare_send([leaf * 2])
        out["non_leaf_put"] = None
    except RuntimeError as error:
        out["non_leaf_put"] = "non-leaf" in str(error)
    # A tensor beside another in its chunk goes where it lies (its address kept)...
    small, beside = torch.full((256,), 3.0, device="cuda"), torch.zeros(256, device="cuda")
    out["shared_chunk"] = module.prepare_send(small)[0] == _signatures.SEND_IN_PLACE
    before = small.data_ptr()
    assert reductions.prepare_send(small)  # records its event
    exported = []
    feeder = threading.Thread(target=lambda: exported.append(module.export_send(small)),
                              name=sharing.FEEDER_THREAD)
    feeder.start()
    feeder.join()
    kind, data, ticket = exported[0]
    out["in_place_exported"] = (small.data_ptr() == before, kind == _signatures.SEND_IN_PLACE,
                                isinstance(data, bytes) and len(ticket) == 64)
    sharing.ack_send(ticket, wait=True)
    # ...unless its pool isolates sends: then put moves it to memory of its own.
    with vmm_torch.Pool(0, isolate_sends=True) as isolating:
        small, beside = isolating.zeros((256,)), isolating.zeros((256,))
        small.fill_(3.0)
        out["isolated_kind"] = module.prepare_send(small)[0] == _signatures.SEND_RELOCATE
        before = small.data_ptr()
        assert reductions.prepare_send(small)  # moves it, then records its event
        feeder = threading.Thread(target=lambda: exported.append(module.export_send(small)),
                                  name=sharing.FEEDER_THREAD)
        feeder.start()
        feeder.join()
        kind, data, ticket = exported[-1]
        out["moved_and_exported"] = (small.data_ptr() != before,
                                     kind == _signatures.SEND_IN_PLACE,
                                     isinstance(data, bytes) and len(ticket) == 64,
                                     float(small.sum()), float(beside.sum()))
        sharing.ack_send(ticket, wait=True)
        del small, beside
    # Writes still queued on a side stream when put returns: the export waits for them.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t = torch.empty(16 << 20, device="cuda")
        torch.cuda._sleep(50_000_000)  # tens of milliseconds before the fill runs
        t.fill_(4.0)
        assert reductions.prepare_send(t)
        busy_at_put = not side.query()
    feeder = threading.Thread(target=lambda t=t: exported.append(module.export_send(t)),
                              name=sharing.FEEDER_THREAD)
    feeder.start()
    feeder.join()
    out["export_waited"] = (busy_at_put, side.query())  # (True, True)
    sharing.ack_send(exported[-1][2], wait=True)
    del t
    # And through a queue, the tensor dropped at once: the receiver sees every write.
    ctx = mp.get_context("spawn")
    q, replies = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=min_max_of_received, args=(q, replies, 3))
    proc.start()
    out["consumer"] = replies.get(timeout=120)  # ready before the puts
    with torch.cuda.stream(side):
        for value in (1.0, 2.0, 3.0):
            t = torch.empty(16 << 20, device="cuda")
            torch.cuda._sleep(50_000_000)  # tens of milliseconds before the fill runs
            t.fill_(value)
            q.put(t)
            del t
    out["received"] = [replies.get(timeout=120) for _ in range(3)]
    proc.join(120)
    out["exitcode"] = proc.exitcode
    results.put(out)


def write_into_received(q, results):
    """Receives (how, item) items until None and writes into each, replying "written" after
    each (test_multiprocess.py): ("share_memory_", tensor): calls tensor.share_memory_()
    (PyTorch: a no-op for memory that is shared already) and adds 1 to every element;
    ("storage", storage): sets element 1 of an untyped or typed storage of float32 to 100
    (bytes 4-7 of an untyped one)."""
    import vmm_torch

    vmm_torch.install_reducers()
    while True:
        item = q.get(timeout=60)
        if item is None:
            return
        how, received = item
        if how == "share_memory_":
            received.share_memory_()
            received.add_(1)
        elif isinstance(received, torch.UntypedStorage):
            view = torch.empty((0,), dtype=torch.uint8).set_(received)
            view.view(torch.float32)[1] = 100
        else:
            received[1] = 100.0
        results.put(("written", type(received).__name__))
        del received, item


class HostPoolItems(torch.utils.data.Dataset):
    """A dataset whose items are tensors of a host pool (one per worker process), each filled
    with its index: a DataLoader's workers send them as vmm sends (test_sends.py)."""

    pool = None

    def __len__(self):
        return 64

    def __getitem__(self, index):
        import vmm_torch

        if HostPoolItems.pool is None:
            vmm_torch.install_reducers()
            HostPoolItems.pool = vmm_torch.Pool("host")
        return HostPoolItems.pool.empty((256,)).fill_(index)


def as_list(batch):
    """A DataLoader collate_fn that keeps the items (default_collate would copy them)."""
    return batch
