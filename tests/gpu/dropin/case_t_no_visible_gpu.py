"""A program run where no GPU is visible: CUDA_VISIBLE_DEVICES="" (a CPU-only job on a GPU
node, a CI step, a DataLoader or evaluation process started with the GPUs hidden) or "-1", with
the same environment otherwise (so with VMM_TORCH_ENABLE set, vmm is enabled in it); and a
process started that way that is handed a CUDA tensor by one that has the GPU.

Such a program checks torch.cuda.is_available() and device_count(), logs the memory API
(memory_allocated(), memory_stats(), memory_summary(), memory_snapshot(),
torch.cuda.memory._snapshot() and _dump_snapshot(), _record_memory_history(), an out-of-memory
observer, caching_allocator_enable(), _set_allocator_settings()), makes a graph pool handle and
a MemPool, tries CUDA tensors, pinned memory and raw allocations and catches what is raised,
trains on the CPU, runs a DataLoader with forked workers (pin_memory=True, which PyTorch turns
off without a GPU) and exchanges CPU tensors with a spawned child through a
torch.multiprocessing queue. The receiving process (CUDA_VISIBLE_DEVICES="", spawned by a
process that uses the GPU) gets a CPU tensor, then a CUDA tensor (unpickling it needs a GPU),
then a CPU tensor again.

What PyTorch's allocator does is not written here: each group runs in a probe process with
PyTorch's allocator (VMM_TORCH_ENABLE removed) and in one with this program's environment, and
they must agree on each call: returned (and the summary of the value) or raised (RuntimeError
and its subclasses, torch.AcceleratorError included, count as one kind; other exceptions by
type); both probe processes must exit with status 0, and the one in this program's environment
may not write a line to stderr that says error, failed, exception, traceback or fatal unless
PyTorch's wrote the same line (numbers aside).

Why vmm may differ: VMM_TORCH_ENABLE enables vmm at `import torch` whatever the GPUs, and
vmm's allocator then answers the calls that reach the current allocator without initialising
CUDA (the snapshot, the history, the OOM observer, the settings, MemPool's pool), where libvmm
finds no device; and vmm's receiver imports a CUDA tensor through libvmm where PyTorch first
initialises CUDA (a RuntimeError): a ValueError would escape `except RuntimeError`.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from dropin_report import report
from outcome_compare import child_env, compare

GROUPS = [("hidden", ""), ("hidden", "-1"), ("receiver", None)]
PROBE_TIMEOUT = 45
STDERR_WORDS = ("error", "failed", "exception", "traceback", "fatal")


def fam(fn):
    """What fn() did, with RuntimeError and its subclasses as one kind (the key phrases that
    outcome_compare.same compares are left empty)."""
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001  (what is raised is the outcome)
        text = str(e).strip().splitlines()
        return {"kind": "raised",
                "type": "RuntimeError" if isinstance(e, RuntimeError) else type(e).__name__,
                "phrases": [], "text": f"{type(e).__name__}: {text[0][:160] if text else ''}"}
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        value = f"<{type(value).__name__}>"
    return {"kind": "returned", "value": value}


# --- In the probe processes ------------------------------------------------------------------


def _raise(error):
    raise error


def cpu_echo(q_in, q_out):
    """A spawned child of a process without GPUs: doubles the CPU tensors it gets (t * 2 + 1),
    then waits for None (its parent must open the last answer's shared memory before it
    exits)."""
    import torch
    while True:
        t = q_in.get(timeout=60)
        if t is None:
            return
        q_out.put(t * 2 + torch.ones_like(t))


def gpuless_receiver(q, back):
    """Spawned with CUDA_VISIBLE_DEVICES="": what it does with what it is sent."""
    import torch
    out = [["receiver: torch.cuda.is_available()", fam(torch.cuda.is_available)]]
    out.append(["receiver: a CPU tensor", fam(lambda: float(q.get(timeout=60).sum()))])
    out.append(["receiver: then the CUDA tensor",
                fam(lambda: str(q.get(timeout=60).device))])
    out.append(["receiver: then a CPU tensor", fam(lambda: float(q.get(timeout=60).sum()))])
    out.append(["receiver: torch.cuda.is_initialized() after",
                fam(torch.cuda.is_initialized)])
    back.put(out)


class Squares:
    def __len__(self):
        return 32

    def __getitem__(self, i):
        import torch
        return torch.full((8,), float(i))


def snapshot_summary(snap):
    traces = snap.get("device_traces", [])
    return [sorted(k for k in snap if k in ("segments", "device_traces")),
            len(snap.get("segments", [])), sum(len(t) for t in traces)]


def hidden_probes(with_child):
    import torch
    import torch.multiprocessing as mp
    out = []

    def rec(name, fn):
        out.append([name, fam(fn)])

    rec("_backend", torch.cuda.get_allocator_backend)
    rec("torch.cuda.is_available()", torch.cuda.is_available)
    rec("torch.cuda.device_count()", torch.cuda.device_count)
    rec("torch.cuda.is_initialized() at start", torch.cuda.is_initialized)
    rec("memory_allocated()", torch.cuda.memory_allocated)
    rec("memory_reserved()", torch.cuda.memory_reserved)
    rec("max_memory_allocated()", torch.cuda.max_memory_allocated)
    rec("memory_stats(): number of keys", lambda: len(torch.cuda.memory_stats()))
    rec("memory_summary() is text", lambda: isinstance(torch.cuda.memory_summary(), str))
    rec("empty_cache()", torch.cuda.empty_cache)
    rec("memory_snapshot(): segments", lambda: len(torch.cuda.memory_snapshot()))
    rec("memory._snapshot(): keys, segments, trace entries",
        lambda: snapshot_summary(torch.cuda.memory._snapshot()))
    rec("_record_memory_history('all', stacks='python')",
        lambda: torch.cuda.memory._record_memory_history(enabled="all", stacks="python",
                                                         max_entries=1000))
    rec("memory._snapshot() while recording",
        lambda: snapshot_summary(torch.cuda.memory._snapshot()))

    def dump():
        import pickle
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "snap.pickle")
            torch.cuda.memory._dump_snapshot(path)
            with open(path, "rb") as f:
                return snapshot_summary(pickle.load(f))
    rec("_dump_snapshot(file), loaded back", dump)
    rec("_record_memory_history(None)",
        lambda: torch.cuda.memory._record_memory_history(enabled=None))
    rec("attach an out-of-memory observer",
        lambda: torch._C._cuda_attach_out_of_memory_observer(lambda *args: None))

    def caching_switch():
        torch.cuda.memory.caching_allocator_enable(False)
        torch.cuda.memory.caching_allocator_enable(True)
    rec("caching_allocator_enable(False), then (True)", caching_switch)
    rec("_set_allocator_settings('expandable_segments:False')",
        lambda: torch.cuda.memory._set_allocator_settings("expandable_segments:False"))
    rec("graph_pool_handle() is a pair", lambda: len(torch.cuda.graph_pool_handle()))
    rec("torch.cuda.MemPool()", lambda: type(torch.cuda.MemPool()).__name__)
    rec("caching_allocator_alloc(1024)", lambda: torch.cuda.caching_allocator_alloc(1024) != 0)
    rec("caching_allocator_delete(0)", lambda: torch.cuda.caching_allocator_delete(0))
    rec("set_per_process_memory_fraction(0.5)",
        lambda: torch.cuda.set_per_process_memory_fraction(0.5))
    if hasattr(torch.cuda, "get_per_process_memory_fraction"):
        rec("get_per_process_memory_fraction()", torch.cuda.get_per_process_memory_fraction)
    rec("reset_peak_memory_stats()", torch.cuda.reset_peak_memory_stats)
    rec("mem_get_info()", lambda: len(torch.cuda.mem_get_info()))
    rec("ipc_collect()", torch.cuda.ipc_collect)
    rec("torch.empty(4, device='cuda')", lambda: torch.empty(4, device="cuda").numel())
    rec("torch.ones(4).pin_memory()", lambda: bool(torch.ones(4).pin_memory().is_pinned()))
    rec("torch.cuda.init()", torch.cuda.init)

    def train_cpu():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x, y = torch.randn(64, 16), torch.randn(64, 1)
        for _ in range(5):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
        return round(float(loss), 5)
    rec("CPU training, 5 SGD steps: the last loss", train_cpu)

    def loader_sum():
        from torch.utils.data import DataLoader
        ctx = mp.get_context("fork")
        loader = DataLoader(Squares(), batch_size=4, num_workers=2, pin_memory=True,
                            multiprocessing_context=ctx)
        return float(sum(b.sum() for b in loader))
    rec("DataLoader, 2 forked workers, pin_memory=True: the sum", loader_sum)

    if with_child:
        def spawn_echo():
            ctx = mp.get_context("spawn")
            q_in, q_out = ctx.Queue(), ctx.Queue()
            p = ctx.Process(target=cpu_echo, args=(q_in, q_out), daemon=True)
            p.start()
            got = []
            for k in range(2):
                q_in.put(torch.full((1000,), float(k)))
                got.append(float(q_out.get(timeout=60).sum()))
            q_in.put(None)
            p.join(30)
            return [got, p.exitcode]
        rec("a spawned child doubles two CPU tensors: [sums, exit status]", spawn_echo)
    rec("torch.cuda.is_initialized() at the end", torch.cuda.is_initialized)
    return out


def receiver_probes():
    import torch
    import torch.multiprocessing as mp
    out = [["_backend", fam(torch.cuda.get_allocator_backend)]]
    torch.cuda.init()  # this process's CUDA first: the variable changed below is the child's
    ctx = mp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the child sees no GPU; this process keeps its own
    try:
        p = ctx.Process(target=gpuless_receiver, args=(q, back), daemon=True)
        p.start()
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    t = torch.arange(1000, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    q.put(torch.arange(10, dtype=torch.float32))
    q.put(t)
    q.put(torch.arange(5, dtype=torch.float32))
    try:
        out += back.get(timeout=40)
    except Exception as e:  # noqa: BLE001  (no report: recorded as what get() raised)
        out.append(["receiver: its report", fam(lambda err=e: _raise(err))])
    p.join(30)
    out.append(["the receiver's exit status", fam(lambda: p.exitcode)])
    out.append(["the sent tensor in the sender afterwards",
                fam(lambda: float(t.sum().item()))])
    return out


def probe(kind):
    if kind == "receiver":
        return receiver_probes()
    return hidden_probes(with_child=os.environ.get("CUDA_VISIBLE_DEVICES") == "")


# --- The program -----------------------------------------------------------------------------


def start(kind, visible, env):
    env = dict(env)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--probe", kind],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, label, deadline, errors):
    """(outcomes or None, stderr lines)."""
    try:
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        errors.append(f"{label}: the probe process hung; stderr: "
                      f"{' | '.join(err.strip().splitlines()[-4:])}")
        return None, []
    lines = [line for line in out.splitlines() if line.startswith("OUTCOMES ")]
    if proc.returncode != 0 or not lines:
        errors.append(f"{label}: the probe process exited {proc.returncode} without outcomes: "
                      f"{' | '.join(err.strip().splitlines()[-5:])}")
        return None, err.splitlines()
    return json.loads(lines[-1][len("OUTCOMES "):]), err.splitlines()


def shape(line):
    """A stderr line with its numbers and addresses blanked, for comparison."""
    return re.sub(r"0x[0-9a-fA-F]+|\d+", "#", line).strip()


def main():
    errors = []
    deadline = time.monotonic() + PROBE_TIMEOUT
    runs = [(kind, visible, start(kind, visible, child_env()), start(kind, visible, os.environ))
            for kind, visible in GROUPS]
    native, mine = [], []
    for kind, visible, theirs, ours in runs:
        label = (f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else
                 "a GPU-less receiver")
        a, a_err = finish(theirs, f"{label} with PyTorch's allocator", deadline, errors)
        b, b_err = finish(ours, f"{label} in this program's environment", deadline, errors)
        if a is None or b is None:
            continue
        backend = dict(a).get("_backend", {}).get("value")
        if backend is not None and backend != "native":
            errors.append(f"{label}: the probe meant to use PyTorch's allocator has backend "
                          f"{backend!r}")
        native += [[f"{label}: {name}", o] for name, o in a if name != "_backend"]
        mine += [[f"{label}: {name}", o] for name, o in b if name != "_backend"]
        theirs_err = {shape(line) for line in a_err}
        extra = [line for line in b_err if shape(line) not in theirs_err and
                 any(w in line.lower() for w in STDERR_WORDS)]
        if extra:
            errors.append(f"{label}: stderr in this program's environment says {extra[:3]}")
    compare(native, mine, errors)
    report(errors)


if __name__ == "__main__":
    if "--probe" in sys.argv:
        print("OUTCOMES " + json.dumps(probe(sys.argv[sys.argv.index("--probe") + 1])),
              flush=True)
    else:
        main()
