"""Many CUDA tensors sent one per message and all kept by the receiver, measured in open file
descriptors: a data-collection worker sending each sample to a learner that keeps them all,
each send answered before the next sample is made (request and reply), on machines whose
soft RLIMIT_NOFILE is the common default of 1024.

1,600 times the sender makes a 16 KiB tensor, puts it on a torch.multiprocessing Queue, drops
it and waits for the receiver's answer (it reads the tensor and keeps it); then 100 times the
same with 3 MiB tensors. Both processes count their open files (/proc/self/fd) as they go.
The whole exchange runs twice at once, in a child with PyTorch's allocator (VMM_TORCH_ENABLE
removed from its environment) and in a child with this program's environment, each with its
own receiver.

With PyTorch's allocator a send is a CUDA IPC handle of the block's segment with an IPC event,
and its reference-counter file is mapped and closed: what a kept send costs in descriptors is
whatever the driver keeps for the handles, which does not depend on the allocator. So here,
in each process, the most files open during the exchange may exceed what PyTorch's run had
open by at most 256 (a quarter of the common limit); and, as with PyTorch's allocator, every
send arrives with its values, the receiver holds all of them, and after it drops them the
sender's memory_allocated() comes back (ipc_collect() polled, sender_memory.py).

Why vmm may differ: a vmm send exports the physical chunks of the block; with POSIX file
descriptor handles (handle_type=posix_fd) every exported chunk is an open descriptor in the
sender's fd server and every imported one stays open in the receiver while mapped; when each
send is exported before the next tensor is made, each kept send can be a chunk of its own,
so 1,700 kept sends can need about as many descriptors in each process, past a limit of 1024
(EMFILE) where PyTorch's allocator needs none. With fabric handles none are used.
"""
import gc
import json
import os
import subprocess
import sys
import time

from dropin_report import report
from outcome_compare import child_env

MIB = 1 << 20
SIZES = [4096] * 1600 + [3 * MIB // 4] * 100  # float32 elements: 16 KiB, then 3 MiB
TIMEOUT = 45
MORE_FILES_ALLOWED = 256


def open_fds():
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def receiver(q, reply, drop):
    import torch
    try:
        kept = []
        start = most = open_fds()
        while True:
            msg = q.get(timeout=TIMEOUT)
            if msg is None:
                break
            i, t = msg
            good = (t.numel() == SIZES[i] and float(t[0].item()) == float(i)
                    and float(t[-1].item()) == float(i))
            kept.append((i, t))
            if i % 50 == 0:
                most = max(most, open_fds())
            reply.put((i, good))
            del msg, t
        most = max(most, open_fds())
        bad = [i for i, t in kept if not bool((t == float(i)).all().item())]
        reply.put(("kept", len(kept), bad[:5], most - start))
        drop.wait(TIMEOUT)
        del kept
        gc.collect()
        torch.cuda.synchronize()
        reply.put(("dropped",))
    except Exception as e:  # noqa: BLE001
        reply.put(("error", f"{type(e).__name__}: {str(e)[:400]}"))


def exchange():
    """The whole exchange in this process; returns its report (a dict)."""
    import torch
    import torch.multiprocessing as mp
    from sender_memory import memory_back_error
    result = {"backend": torch.cuda.get_allocator_backend(), "errors": []}
    errs = result["errors"]
    ctx = mp.get_context("spawn")
    q, reply, drop = ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=receiver, args=(q, reply, drop), daemon=True)
    p.start()
    torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    start = most = open_fds()

    def answer(what):
        try:
            return reply.get(timeout=TIMEOUT)
        except Exception:  # noqa: BLE001
            return ("error", f"no answer ({what}; the receiver is "
                             f"{'alive' if p.is_alive() else 'gone'})")

    sent = 0
    for i, numel in enumerate(SIZES):
        try:
            t = torch.full((numel,), float(i), device="cuda")
            q.put((i, t))
            del t
        except Exception as e:  # noqa: BLE001
            errs.append(f"send {i}: {type(e).__name__}: {str(e).splitlines()[0][:300]} "
                        f"({open_fds()} files open, {start} before the sends)")
            break
        got = answer(f"send {i}")
        if got[0] == "error":
            errs.append(f"the receiver failed at send {i}: {got[1]}")
            break
        sent += 1
        if got != (i, True):
            errs.append(f"send {i}: the receiver read it wrong ({got})")
            break
        if i % 50 == 0:
            most = max(most, open_fds())
    q.put(None)
    result.update(sent=sent, sender_more_files=max(most, open_fds()) - start)
    got = answer("the kept tensors")
    if got[0] == "error":
        errs.append(f"the receiver failed: {got[1]}")
    else:
        result["receiver_more_files"] = got[3]
        if got[1] != sent or got[2]:
            errs.append(f"the receiver kept {got[1]} of {sent} tensors; wrong values in "
                        f"{got[2]}")
    drop.set()
    got = answer("the drop")
    if got[0] != "dropped":
        errs.append(f"the receiver failed dropping what it kept: {got}")
    err = memory_back_error(base, "receiver")
    if err:
        errs.append(err)
    p.join(30)
    return result


def run(env):
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--exchange"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def collect(proc, label, deadline, errors):
    try:
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        errors.append(f"{label}: the exchange did not finish; stderr: "
                      f"{' | '.join(err.strip().splitlines()[-4:])}")
        return None
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        errors.append(f"{label}: exited {proc.returncode} without a result; stderr: "
                      f"{' | '.join(err.strip().splitlines()[-5:])}")
        return None
    return json.loads(lines[-1][len("RESULT "):])


def main():
    errors = []
    deadline = time.monotonic() + 52
    theirs, ours = run(child_env()), run(dict(os.environ))
    native = collect(theirs, "PyTorch's allocator", deadline, errors)
    mine = collect(ours, "this program's environment", deadline, errors)
    if native is not None:
        if native["backend"] != "native":
            errors.append(f"the run meant to use PyTorch's allocator has backend "
                          f"{native['backend']!r}")
        errors += [f"with PyTorch's allocator: {e}" for e in native["errors"]]
    if mine is not None:
        errors += mine["errors"]
    if native is not None and mine is not None:
        for key, who in (("sender_more_files", "sender"), ("receiver_more_files", "receiver")):
            a, b = native.get(key), mine.get(key)
            print(f"{who}: at most {a} more open files with PyTorch's allocator, {b} here "
                  f"({native['sent']} and {mine['sent']} sends kept)")
            if a is not None and b is not None and b > a + MORE_FILES_ALLOWED:
                errors.append(f"the {who} kept {b} more files open during {mine['sent']} kept "
                              f"sends, {a} with PyTorch's allocator: past the common limit of "
                              f"1024 such a program fails (EMFILE) where PyTorch's does not")
    report(errors)


if __name__ == "__main__":
    if "--exchange" in sys.argv:
        print("RESULT " + json.dumps(exchange()), flush=True)
    else:
        main()
