"""Processes that exit in awkward states, on the host backend: each exits cleanly.

Every scenario runs in fresh interpreters (scripts written to the test's tmp_path) that use
vmm_torch's own API: host pools, export_tensor / SharedTensor / import_buffer, the
torch.multiprocessing reducers and sends. A process passes when its exit code is the one its
way of exiting gives, and its stderr holds nothing but what that way of exiting prints (the
traceback of an exception raised on purpose, the documented warning of a sender whose sends
were not all received): no crash text ("double free", "corrupted", "terminate called", "pure
virtual", "Segmentation", "Aborted", sanitizer reports, faulthandler's), no "[vmm]" line and
no other "vmm_torch:" line. A watchdog (faulthandler.dump_traceback_later) ends a process that
hangs with its threads' stacks on stderr, and every child is bounded by a timeout here.

The states (the GPU crashed at exit in the first class: a storage shared and never released,
freed by PyTorch's static destructors after vmm's objects were gone):

- an exporter that exits (returning, sys.exit, os._exit, an uncaught exception, SIGTERM with
  and without a handler, its pools closed first) while an importer maps its memory; the
  importer then reads and writes it, forwards it within itself, and exits with the imports
  live;
- a sender that exits while its queue's feeder thread is still exporting a burst of sends;
- an importer that exits with live imports and a forwarded send its receiver has not read
  (read during its exit wait, or only after it is gone);
- a process that exits while other threads are inside vmm's C calls (allocating, exporting,
  importing, freeing, failing);
- a process whose last vmm call failed (a message on the heap), exiting with live pools,
  imports and sends;
- forked children that exit (returning, sys.exit, os._exit, an exception) without touching
  vmm, or after reading and freeing their parent's memory, while a parent thread is in vmm;
- interpreter finalization with pools, imports and received tensors in module globals and in
  reference cycles, and objects whose __del__ calls vmm;
- atexit handlers (registered before vmm_torch is imported, so running after its own and
  multiprocessing's exit handlers, and after) that export, import, send, receive from another
  process, free, and read statistics;
- queues whose join was cancelled (Queue.cancel_join_thread: the program gives up what they
  hold): beside a queue whose receiver reads late, mid-burst with and without a reader,
  cancelled at creation (multiprocessing's Queue and JoinableQueue, torch.multiprocessing's
  Queue), with a message still being pickled (a nested pickle inside it, an exit wait of 0),
  dropped by the program before exit, and in a forked child (multiprocessing's fork, and
  os.fork()) that inherits a parent's cancelled queue;
- a sender in its exit wait whose SIGTERM handler calls sys.exit.

Daemon threads that run PyTorch operators while the interpreter finalizes are left out:
torch 1.13 with Python 3.11 aborts there without vmm ("terminate called without an active
exception": a finalizing interpreter ends such a thread with pthread_exit inside PyTorch's
GIL release in THPVariable_subclass_dealloc), so the threads here call libvmm.so directly.
Receiving by unpickling during the finalization is left out too: pickle imports the rebuild
function's module, and the finalization has emptied sys.modules (any pickle's limit).
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

# Each child process (they import torch: a few seconds each on a loaded two-core machine).
TIMEOUT = 150
# The watchdog inside each script: shorter, so that a hang shows its stacks.
WATCHDOG_S = 120

CRASH_MARKERS = ("double free", "corrupted", "terminate called", "pure virtual",
                 "Segmentation", "Aborted", "AddressSanitizer", "LeakSanitizer",
                 "ThreadSanitizer", "Fatal Python error", "core dumped", "free(): ",
                 "malloc(): ", "Timeout (")

# What a script may print on stderr when it exits that way on purpose.
EXPECTED_TRACEBACK = (r"(?:Process \w+-\d+:\n)?Traceback \(most recent call last\):\n"
                      r"(?:[ \t][^\n]*\n)*RuntimeError: [^\n]*on purpose\n")
# multiprocessing's, when a process with queues ends by os._exit (their semaphores).
LEAKED_SEMAPHORES = (r"[^\n]*resource_tracker: There appear to be \d+ leaked semaphore "
                     r"objects[^\n]*\n(?:[ \t][^\n]*\n)*")
EXIT_WAIT_WARNING = (r"vmm_torch: exiting with \d+ sent tensor\(s\) that no receiver has "
                     r"imported[^\n]*\n")

PRELUDE = textwrap.dedent(f"""\
    import faulthandler
    import os
    import sys
    import time
    import warnings

    # Python 3.12 warns at every os.fork() of a process with threads; forking with a thread
    # inside vmm is what some scenarios here test.
    warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
    WATCHDOG_S = {WATCHDOG_S}
    faulthandler.enable()
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)


    def wait_for(condition, what, timeout=60.0):
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError("waited too long for " + what)
            time.sleep(0.01)


    def result(value):
        import json
        print("RESULT " + json.dumps(value), flush=True)


    # Ends the process as `how` names: sys_exit / os_exit with codes[how] (0 if not given),
    # an exception, SIGTERM without a handler, or SIGTERM with a handler that exits with
    # codes["sigterm_handler"]. Returns for any other way: the caller takes it.
    def leave(how, who, codes):
        import signal
        code = codes.get(how, 0)
        if how == "sys_exit":
            sys.exit(code)
        if how == "os_exit":
            os._exit(code)
        if how == "exception":
            raise RuntimeError(who + " exits on purpose")
        if how == "sigterm_handler":
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(code))
        if how in ("sigterm", "sigterm_handler"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)
    """)


def _script(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(PRELUDE + textwrap.dedent(body))
    return str(path)


def _env(**extra):
    env = dict(os.environ)
    env.pop("VMM_TORCH_ENABLE", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _results(stdout):
    return [json.loads(line[len("RESULT "):]) for line in stdout.splitlines()
            if line.startswith("RESULT ")]


def _problems(name, returncode, stderr, expected_rc, allowed=()):
    """What is wrong with a process that exited with `returncode` and printed `stderr`."""
    problems = []
    if returncode != expected_rc:
        problems.append(f"{name}: exit code {returncode}, expected {expected_rc}")
    crash = [m for m in CRASH_MARKERS if m in stderr]
    if crash:
        problems.append(f"{name}: stderr shows {crash}")
    rest = stderr
    for pattern in allowed:
        rest = re.sub(pattern, "", rest)
    if rest.strip():
        problems.append(f"{name}: unexpected stderr")
    if problems:
        problems.append(f"--- {name}'s stderr ---\n{stderr[-6000:]}")
    return problems


def _check(name, done, expected_rc=0, allowed=()):
    problems = _problems(name, done.returncode, done.stderr, expected_rc, allowed)
    assert not problems, "\n".join(problems + [f"--- {name}'s stdout ---\n{done.stdout[-3000:]}"])


def _run(script, *args, env=None, timeout=TIMEOUT):
    return subprocess.run([sys.executable, script, *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env or _env())


def _allowed_for(how):
    return (EXPECTED_TRACEBACK,) if how == "exception" else ()


# --- An exporter that exits while an importer maps its memory ------------------------------

EXPORTER = """
    import pickle

    import torch
    import vmm_torch

    how, d = sys.argv[1], sys.argv[2]
    pools = [vmm_torch.Pool("host", handle_type=h) for h in ("fabric", "posix_fd")]
    tensors = []
    for i, pool in enumerate(pools):
        t = pool.empty((1 << 16,), dtype=torch.int64, shareable=True)
        t.copy_(torch.arange(1 << 16) * (i + 1))
        tensors += [t, pool.zeros((1000,))]  # and another block of the pool
    payload = pickle.dumps([vmm_torch.export_tensor(t) for t in tensors[::2]])
    with open(d + "/payload.tmp", "wb") as f:
        f.write(payload)
    os.rename(d + "/payload.tmp", d + "/payload")
    wait_for(lambda: os.path.exists(d + "/imported"), "the importer")
    leave(how, "the exporter", {})
    if how == "closed_pools":
        for pool in pools:
            pool.close()
        del tensors, t
    # "return": the script ends with its pools and tensors alive
    """

IMPORTER = """
    import pickle

    import torch
    import vmm_torch

    d = sys.argv[1]
    wait_for(lambda: os.path.exists(d + "/payload"), "the payload")
    with open(d + "/payload", "rb") as f:
        shared = pickle.load(f)
    OPENED = [s.open() for s in shared]
    BUFFERS = [vmm_torch.import_buffer(s.descriptor) for s in shared]
    VIEWS = [b.as_tensor(torch.int64)[: 1 << 16] for b in BUFFERS]
    open(d + "/imported", "w").close()
    wait_for(lambda: os.path.exists(d + "/exporter_gone"), "the exporter's exit")
    expected = [torch.arange(1 << 16) * (i + 1) for i in range(len(shared))]
    out = {"read": [bool(torch.equal(t, e)) for t, e in zip(OPENED, expected)],
           "buffers": [bool(torch.equal(v, e)) for v, e in zip(VIEWS, expected)]}
    for t, v in zip(OPENED, VIEWS):  # two imports of the same memory
        t[7] = -7
    out["written"] = [int(v[7]) for v in VIEWS]
    # Forwarded within this process: the exporter is gone, this process's handles remain.
    AGAIN = [vmm_torch.export_tensor(t).open() for t in OPENED]
    out["forwarded"] = [int(a[7]) == -7 and int(a[9]) == int(e[9])
                        for a, e in zip(AGAIN, expected)]
    result(out)
    # Exits with every import live (module globals).
    """

EXPORTER_EXITS = {"return": 0, "sys_exit": 0, "os_exit": 0, "exception": 1,
                  "sigterm": -signal.SIGTERM, "sigterm_handler": 0, "closed_pools": 0}


@pytest.mark.parametrize("how", sorted(EXPORTER_EXITS))
def test_an_exporter_that_exits_leaves_its_importer_reading(tmp_path, how):
    exporter_py = _script(tmp_path, "exporter.py", EXPORTER)
    importer_py = _script(tmp_path, "importer.py", IMPORTER)
    d = tmp_path / "exchange"
    d.mkdir()
    procs = []
    try:
        exporter = subprocess.Popen([sys.executable, exporter_py, how, str(d)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=_env())
        procs.append(exporter)
        importer = subprocess.Popen([sys.executable, importer_py, str(d)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=_env())
        procs.append(importer)
        e_out, e_err = exporter.communicate(timeout=TIMEOUT)
        (d / "exporter_gone").touch()
        i_out, i_err = importer.communicate(timeout=TIMEOUT)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    problems = (_problems("exporter", exporter.returncode, e_err, EXPORTER_EXITS[how],
                          _allowed_for(how))
                + _problems("importer", importer.returncode, i_err, 0))
    assert not problems, "\n".join(problems + [f"importer's stdout: {i_out}"])
    results = _results(i_out)
    assert results == [{"read": [True, True], "buffers": [True, True], "written": [-7, -7],
                         "forwarded": [True, True]}], i_out


# --- A sender that exits while its feeder thread is still exporting --------------------------

BURST = """
    import torch
    import torch.multiprocessing as mp
    import vmm_torch


    def receiver(q, n, path, delay):
        vmm_torch.install_reducers()
        time.sleep(delay)
        ok, wrong, errors = 0, 0, {}
        for i in range(n):
            try:
                item = q.get(timeout=15)
            except Exception as e:  # what a receiver of a dead sender may see
                key = type(e).__name__ + ":" + getattr(e, "code", "")
                errors[key] = errors.get(key, 0) + 1
                if type(e).__name__ == "Empty":
                    break
                continue
            if isinstance(item, tuple):
                item = item[0]
            right = float(item.sum()) == item.numel() * (i % 7) and item.numel() == 1000 + i
            ok += int(right)
            wrong += int(not right)
            del item
        with open(path, "w") as f:
            f.write(repr((ok, wrong, errors)))


    if __name__ == "__main__":
        how, n, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
        # With padding, each message carries that many bytes more and the receiver starts
        # reading 3 s late: the feeder is blocked on a full pipe when the process exits.
        pad = int(sys.argv[4]) if len(sys.argv) > 4 else 0
        vmm_torch.install_reducers()
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        proc = ctx.Process(target=receiver, args=(q, n, path, 3.0 if pad else 0.0))
        proc.start()
        pools = [vmm_torch.Pool("host", handle_type=h) for h in ("fabric", "posix_fd")]
        for i in range(n):
            t = pools[i % 2].empty((1000 + i,)).fill_(i % 7)
            q.put((t, b"x" * pad) if pad else t)
            del t
        # The feeder thread is still exporting most of them.
        leave(how, "the sender", {"sys_exit": 3, "os_exit": 5, "sigterm_handler": 4})
    """

BURST_EXITS = {"return": 0, "sys_exit": 3, "exception": 1, "sigterm_handler": 4, "os_exit": 5}


@pytest.mark.parametrize("how", sorted(BURST_EXITS))
def test_a_sender_that_exits_mid_burst(tmp_path, how):
    """The exit wait covers every send the feeder thread had still to export (the receiver
    gets them all); after os._exit, which waits for nothing, the receiver gets what was sent
    and clean errors (UNAVAILABLE, NOT_FOUND; Empty once nothing more comes), never a crash."""
    n = 120
    path = tmp_path / "received"
    done = _run(_script(tmp_path, "burst.py", BURST), how, n, path,
                env=_env(VMM_SEND_EXIT_WAIT_S=60))
    # The receiver shares the sender's stderr, and run() waits for it too (its end of the pipe).
    allowed = _allowed_for(how) + ((LEAKED_SEMAPHORES,) if how == "os_exit" else ())
    _check("sender and receiver", done, BURST_EXITS[how], allowed)
    ok, wrong, errors = eval(path.read_text())  # noqa: S307 (our own file)
    assert wrong == 0, (ok, wrong, errors)
    if how == "os_exit":
        assert set(errors) <= {"VmmError:UNAVAILABLE", "VmmError:NOT_FOUND", "Empty:"}, errors
    else:
        assert (ok, errors) == (n, {})


def test_an_unbounded_exit_wait_flushes_a_feeder_blocked_on_a_full_pipe(tmp_path):
    """VMM_SEND_EXIT_WAIT_S=inf (no bound): the exit wait joins a feeder still blocked writing
    to a pipe the receiver has not begun to read, for as long as it takes, then waits for the
    receiver: it gets every send (the join once raised OverflowError there and the wait was
    skipped)."""
    n = 60  # 60 messages of 4 KiB and more: past a pipe's 64 KiB
    path = tmp_path / "received"
    done = _run(_script(tmp_path, "burst.py", BURST), "return", n, path, 4096,
                env=_env(VMM_SEND_EXIT_WAIT_S="inf"))
    _check("sender and receiver", done, 0)
    assert eval(path.read_text()) == (n, 0, {})  # noqa: S307 (our own file)


# --- An importer that exits with live imports and a forwarded send not yet read ---------------

FORWARD = """
    import torch
    import torch.multiprocessing as mp
    import vmm_torch

    KEPT = []


    def b(inbox, outbox, report, how):
        vmm_torch.install_reducers()
        received = [inbox.get(timeout=60) for _ in range(2)]
        KEPT.extend(received)  # live imports in a module global at exit
        KEPT.extend(t[10:20] for t in received)
        KEPT.extend(vmm_torch.export_tensor(t).open() for t in received)
        outbox.put(received)  # forwarded; C has not read it yet
        report.put([float(t.sum()) for t in received])
        if how == "os_exit":
            time.sleep(0.5)  # the feeder has written it
            os._exit(0)
        if how == "exception":
            raise RuntimeError("the importer exits on purpose")


    def c(outbox, go, path):
        vmm_torch.install_reducers()
        go.get(timeout=60)
        try:
            got = outbox.get(timeout=60)
            value = ["tensors", [float(t.sum()) for t in got]]
        except Exception as e:
            value = ["error", type(e).__name__, getattr(e, "code", "")]
        with open(path, "w") as f:
            f.write(repr(value))


    if __name__ == "__main__":
        how, when, path = sys.argv[1], sys.argv[2], sys.argv[3]
        vmm_torch.install_reducers()
        ctx = mp.get_context("spawn")
        inbox, outbox, report, go = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
        pb = ctx.Process(target=b, args=(inbox, outbox, report, how))
        pc = ctx.Process(target=c, args=(outbox, go, path))
        pb.start()
        pc.start()
        pools = [vmm_torch.Pool("host", handle_type=h) for h in ("fabric", "posix_fd")]
        for i, pool in enumerate(pools):
            inbox.put(pool.empty((1000,)).fill_(i + 1))
        assert report.get(timeout=60) == [1000.0, 2000.0]
        if when == "during":  # C reads while B waits at exit for its receiver
            go.put(1)
        pb.join(60)
        result({"b": pb.exitcode})
        if when == "after":  # B is gone
            go.put(1)
        pc.join(60)
        result({"c": pc.exitcode})
    """

FORWARD_CASES = [("return", "during", 0), ("exception", "during", 1), ("return", "after", 0),
                 ("exception", "after", 1), ("os_exit", "after", 0)]


@pytest.mark.parametrize("how,when,b_exit", FORWARD_CASES)
def test_an_importer_that_exits_with_live_imports_and_an_unread_forward(tmp_path, how, when,
                                                                        b_exit):
    """A -> B -> C: B keeps what it received in module globals and forwards it; C reads while
    B waits at exit for it (C gets the memory, B says nothing), or only once B is gone (a
    clean UNAVAILABLE: B's handles went with it; B, if it waited, says what it left)."""
    path = tmp_path / "c_result"
    done = _run(_script(tmp_path, "forward.py", FORWARD), how, when, path,
                env=_env(VMM_SEND_EXIT_WAIT_S=60 if when == "during" else 1))
    allowed = _allowed_for(how)
    if when == "after" and how != "os_exit":
        allowed += (EXIT_WAIT_WARNING,)
    _check("A, B and C", done, 0, allowed)
    assert _results(done.stdout) == [{"b": b_exit}, {"c": 0}], done.stdout
    got = eval(path.read_text())  # noqa: S307 (our own file)
    if when == "during":
        assert got == ["tensors", [1000.0, 2000.0]]
    else:
        assert got == ["error", "VmmError", "UNAVAILABLE"]


# --- Threads inside vmm's C calls while the process exits -------------------------------------

THREADS = """
    import threading

    import torch
    import vmm_torch
    from vmm_torch import _lib, sharing

    how = sys.argv[1]
    pools = [vmm_torch.Pool("host", handle_type=h) for h in ("fabric", "posix_fd")]
    live = [p.empty((1 << 16,)).fill_(1) for p in pools]
    lib = _lib.vmm()
    counts = [0] * 4
    closing = threading.Event()


    def churn(k):
        # libvmm.so's calls only (see the module docstring of the test): allocate, export,
        # import, release, free, statistics, empty_cache, and a failing import every round,
        # so that each thread's last failure holds a message.
        pool = pools[k % 2]
        while True:
            try:
                p = lib.vmm_pool_alloc(pool.id, 65536 * (k + 1), None, k % 2)
                if not p:
                    raise RuntimeError(_lib.last_error())
                iid = sharing.import_descriptor(sharing.export_bytes(p))
                sharing.release_import(iid)
                lib.vmm_block_free(p)
                _lib.take_json(lib.vmm_pool_stats_json(pool.id))
                if k == 3:
                    lib.vmm_pool_empty_cache(pool.id)
                if lib.vmm_import(b"x" * 200, 200, -1, 0, 0) >= 0:
                    raise RuntimeError("a garbage descriptor was imported")
            except Exception as e:
                if not closing.is_set():
                    os.write(2, f"thread {k}: {type(e).__name__}: {e}\\n".encode())
                return
            counts[k] += 1


    threads = [threading.Thread(target=churn, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: min(counts) >= 10, "the threads' first rounds")
    leave(how, "the main thread", {"sys_exit": 3, "os_exit": 5, "sigterm_handler": 4})
    if how == "close_pools":
        closing.set()
        for p in pools:
            p.close()
        del live
    elif how == "os_exit_in_a_thread":
        threading.Thread(target=os._exit, args=(6,)).start()
        time.sleep(60)
    """

THREAD_EXITS = {"return": 0, "sys_exit": 3, "os_exit": 5, "exception": 1, "close_pools": 0,
                "sigterm": -signal.SIGTERM, "sigterm_handler": 4, "os_exit_in_a_thread": 6}


@pytest.mark.parametrize("how", sorted(THREAD_EXITS))
def test_a_process_exits_while_threads_are_inside_vmm(tmp_path, how):
    done = _run(_script(tmp_path, "threads.py", THREADS), how)
    _check("process", done, THREAD_EXITS[how], _allowed_for(how))


# --- The last vmm call failed, then the process exits ----------------------------------------

FAILED = """
    import pickle
    import threading

    import torch
    import vmm_torch
    from multiprocessing.reduction import ForkingPickler

    how = sys.argv[1]
    vmm_torch.install_reducers()
    pools = [vmm_torch.Pool("host", handle_type=h) for h in ("fabric", "posix_fd")]
    tensors = [p.empty((4096,)).fill_(2) for p in pools]
    RECEIVED = [pickle.loads(ForkingPickler.dumps(t)) for t in tensors]  # acknowledged sends
    OPENED = [vmm_torch.export_tensor(t).open() for t in tensors]
    BUFFER = vmm_torch.import_buffer(vmm_torch.export_tensor(tensors[1]).descriptor)


    def fail():
        # Long messages (beyond a string's inline buffer), one from libvmm's parser and one
        # from its import.
        for call in (lambda: vmm_torch.import_buffer(b"\\0" * 512),
                     lambda: vmm_torch.set_send_lease(-1.0),
                     lambda: vmm_torch.Pool("host", handle_type="fabric",
                                            memory_limit="not a size")):
            try:
                call()
            except (ValueError, vmm_torch.VmmError):
                pass
        assert vmm_torch._lib.last_error()


    waiting = threading.Event()


    def failed_then_waits():
        fail()
        waiting.set()
        time.sleep(600)  # alive at exit with its record of the failure


    finished = threading.Thread(target=fail)
    finished.start()
    finished.join()  # its records were destroyed when it ended
    threading.Thread(target=failed_then_waits, daemon=True).start()
    waiting.wait(60)
    fail()  # the main thread's last vmm call failed
    leave(how, "the process", {"sys_exit": 3})
    """

FAILED_EXITS = {"return": 0, "sys_exit": 3, "exception": 1}


@pytest.mark.parametrize("how", sorted(FAILED_EXITS))
def test_a_process_whose_last_call_failed_exits_with_live_pools(tmp_path, how):
    done = _run(_script(tmp_path, "failed.py", FAILED), how)
    _check("process", done, FAILED_EXITS[how], _allowed_for(how))


# --- Forked children that exit ------------------------------------------------------------------

FORK = """
    import pickle
    import threading

    import torch

    torch.set_num_threads(1)  # PyTorch's OpenMP runtime is not fork-safe (test_fork.py)
    import vmm_torch
    from multiprocessing.reduction import ForkingPickler
    from vmm_torch import _lib

    d = sys.argv[1]
    vmm_torch.install_reducers()
    pools = [vmm_torch.Pool("host", handle_type=h) for h in ("fabric", "posix_fd")]
    mine = [p.empty((1000,)).fill_(i + 1) for i, p in enumerate(pools)]
    received = [pickle.loads(ForkingPickler.dumps(t)) for t in mine]  # ack queued, sent
    held = ForkingPickler.dumps(pools[0].empty((500,)).fill_(3))  # a send not received yet
    opened = [vmm_torch.export_tensor(t).open() for t in mine]
    buffer = vmm_torch.import_buffer(vmm_torch.export_tensor(mine[1]).descriptor)
    try:
        vmm_torch.import_buffer(b"\\0" * 512)  # the last call failed
    except ValueError:
        pass
    stop = threading.Event()
    rounds = [0]


    def churn():
        lib = _lib.vmm()
        while not stop.is_set():
            for pool in pools:
                ptr = lib.vmm_pool_alloc(pool.id, 1 << 16, None, 1)
                lib.vmm_block_free(ptr)
            rounds[0] += 1


    churner = threading.Thread(target=churn, daemon=True)
    churner.start()
    wait_for(lambda: rounds[0] > 10, "the parent's thread")

    MODES = {"return": 0, "sys_exit": 7, "os_exit": 8, "exception": 1, "read_and_free": 0}
    child_mode = None
    statuses = {}
    for mode in MODES:
        # The watchdog's thread does not survive fork(), and a child that still has it armed
        # hangs at exit waiting for it (CPython's faulthandler, with or without vmm): the
        # child is bounded by the parent's deadline below instead.
        faulthandler.cancel_dump_traceback_later()
        pid = os.fork()
        if pid == 0:
            child_mode = mode
            break
        faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
        deadline = time.monotonic() + 60
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                statuses[mode] = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                statuses[mode] = "hung"
                break
            time.sleep(0.02)

    if child_mode is not None:
        fd = os.open(f"{d}/child_{child_mode}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        leave(child_mode, "the child", {"sys_exit": 7, "os_exit": 8})
        if child_mode == "read_and_free":
            assert [float(t.sum()) for t in opened] == [1000.0, 2000.0]
            assert [float(t.sum()) for t in received] == [1000.0, 2000.0]
            del opened, received, mine
            buffer.close()
        # "return" and "read_and_free": the script ends here in the child
    else:
        stop.set()
        churner.join(10)
        late = pickle.loads(held)  # the parent goes on: receives its own send
        again = pools[1].empty((100,)).fill_(4)
        result({"statuses": statuses, "expected": MODES,
                "parent": [float(late.sum()), float(vmm_torch.export_tensor(again).open().sum()),
                           [float(t.sum()) for t in opened], float(buffer.as_tensor(
                               torch.float32)[:1000].sum())]})
    """


def test_forked_children_exit_cleanly_while_a_parent_thread_is_in_vmm(tmp_path):
    done = _run(_script(tmp_path, "fork.py", FORK), tmp_path)
    _check("parent", done, 0)
    (out,) = _results(done.stdout)
    assert out["parent"] == [1500.0, 400.0, [1000.0, 2000.0], 2000.0]
    problems = []
    for mode, expected in out["expected"].items():
        stderr = (tmp_path / f"child_{mode}.err").read_text()
        problems += _problems(f"child ({mode})", out["statuses"][mode], stderr, expected,
                              _allowed_for(mode))
    assert not problems, "\n".join(problems)


# --- Interpreter finalization -----------------------------------------------------------------

FINALIZE = """
    import gc
    import pickle

    import torch
    import vmm_torch
    from multiprocessing.reduction import ForkingPickler

    where = sys.argv[1]
    vmm_torch.install_reducers()


    class State:
        # A pool of each handle type, blocks, exports opened, buffers imported and their
        # views, received sends: what a process may hold at exit.
        def __init__(self, n):
            self.pools = [vmm_torch.Pool("host", handle_type=h) for h in ("fabric", "posix_fd")]
            self.tensors = [p.empty((n,), shareable=bool(i)).fill_(n)
                            for i, p in enumerate(self.pools)]
            self.shared = [vmm_torch.export_tensor(t) for t in self.tensors]
            self.opened = [s.open() for s in self.shared]
            self.buffers = [vmm_torch.import_buffer(s.descriptor) for s in self.shared]
            self.views = [b.as_tensor(torch.float32)[:n] for b in self.buffers]
            self.received = [pickle.loads(ForkingPickler.dumps(t)) for t in self.tensors]
            assert all(float(t.sum()) == n * n
                       for t in self.opened + self.views + self.received)


    class Probe:
        # Calls vmm in __del__ (run by the interpreter's finalization): each call's outcome
        # goes to stdout. Its own pool may be closed by then (the finalization collects the
        # module's objects as one garbage cycle, whose finalizers run in any order: Pool's
        # closes it), so __del__ makes a pool too.
        def __init__(self, pool):
            self.pool = pool
            self.t = pool.empty((64,), shareable=True).fill_(7)

        def __del__(self, vmm_torch=vmm_torch, torch=torch, os=os, type=type, str=str,
                    float=float, ValueError=ValueError, BaseException=BaseException):
            outcomes = []

            def attempt(name, call):
                try:
                    call()
                    outcomes.append(name + ":ok")
                except BaseException as e:
                    outcomes.append(f"{name}:{type(e).__name__}:{str(e)[:120]}")

            def refused():
                try:
                    vmm_torch.import_buffer(b"\\0" * 512)
                except ValueError:
                    return
                raise AssertionError("a garbage descriptor was imported")

            def import_and_close():
                b = vmm_torch.import_buffer(vmm_torch.export_tensor(self.t).descriptor)
                assert float(b.as_tensor(torch.float32)[:64].sum()) == 448.0
                b.close()

            pools = []
            attempt("pool", lambda: pools.append(vmm_torch.Pool("host")))
            attempt("empty", lambda: pools[0].empty((8,)).fill_(1))
            attempt("export", lambda: vmm_torch.export_tensor(self.t))
            attempt("import_buffer", import_and_close)
            attempt("failing_import", refused)
            attempt("stats", lambda: (vmm_torch.memory_stats(), pools[0].memory_stats(),
                                      vmm_torch.send_stats()))
            attempt("free", lambda: delattr(self, "t"))
            attempt("empty_cache", lambda: pools[0].empty_cache())
            attempt("close", lambda: (pools[0].close(), self.pool.close()))
            os.write(1, ("DEL " + " ".join(outcomes) + "\\n").encode())


    if where == "globals":
        STATE = State(100)
        STATE_POOLS = STATE.pools
        OPENED, RECEIVED = STATE.opened, STATE.received
    elif where == "cycles":
        s = State(200)
        s.me = s
        s.opened[0].owner = s  # a tensor's Python object in the cycle too
        del s
    elif where == "globals_in_cycles":
        A, B = State(300), State(400)
        A.other, B.other = B, A
    elif where == "del_in_globals":
        PROBE_POOL = vmm_torch.Pool("host")
        PROBE = Probe(PROBE_POOL)
    elif where == "del_in_a_cycle":
        PROBE_POOL = vmm_torch.Pool("host", handle_type="posix_fd")
        p = Probe(PROBE_POOL)
        p.me = p
        del p
    print("ready", flush=True)
    """


@pytest.mark.parametrize("where", ["globals", "cycles", "globals_in_cycles", "del_in_globals",
                                   "del_in_a_cycle"])
def test_interpreter_finalization_with_vmm_state(tmp_path, where):
    done = _run(_script(tmp_path, "finalize.py", FINALIZE), where)
    _check("process", done, 0)
    if where.startswith("del"):
        lines = [line for line in done.stdout.splitlines() if line.startswith("DEL ")]
        assert lines == ["DEL pool:ok empty:ok export:ok import_buffer:ok failing_import:ok "
                         "stats:ok free:ok empty_cache:ok close:ok"], done.stdout


OPEN_IN_DEL = """
    import torch
    import vmm_torch


    class Opener:
        # Opens a SharedTensor in __del__, during the interpreter's finalization (its
        # descriptor imported again, as import_buffer does there without fail).
        def __init__(self):
            self.pool = vmm_torch.Pool("host")
            self.t = self.pool.empty((64,), shareable=True).fill_(7)
            self.shared = vmm_torch.export_tensor(self.t)

        def __del__(self, vmm_torch=vmm_torch, torch=torch, os=os, float=float, type=type,
                    str=str, BaseException=BaseException):
            outcomes = []
            for name, call in (
                    ("import_buffer", lambda: vmm_torch.import_buffer(
                        self.shared.descriptor).as_tensor(torch.float32)[:64]),
                    ("open", lambda: self.shared.open())):
                try:
                    outcomes.append(f"{name}:{float(call().sum())}")
                except BaseException as e:
                    outcomes.append(f"{name}:{type(e).__name__}:{str(e)[:120]}")
            os.write(1, ("DEL " + " ".join(outcomes) + "\\n").encode())


    OPENER = Opener()
    print("ready", flush=True)
    """


def test_opening_a_shared_tensor_in_del_during_finalization(tmp_path):
    """(Unpickling a send there fails too, in pickle's own import of the rebuild function's
    module: that is any pickle's, not vmm's, so it is not asked here.)"""
    done = _run(_script(tmp_path, "open_in_del.py", OPEN_IN_DEL))
    _check("process", done, 0)
    lines = [line for line in done.stdout.splitlines() if line.startswith("DEL ")]
    assert lines == ["DEL import_buffer:448.0 open:448.0"], done.stdout


# --- atexit handlers that call vmm ------------------------------------------------------------

ATEXIT = """
    import atexit
    import pickle
    import subprocess

    order, sender_py = sys.argv[1], sys.argv[2]
    OUTCOMES = []


    def handler():
        import torch
        import vmm_torch
        from multiprocessing.reduction import ForkingPickler

        def attempt(name, call):
            try:
                call()
                OUTCOMES.append(name + ":ok")
            except BaseException as e:
                OUTCOMES.append(f"{name}:{type(e).__name__}:{str(e)[:160]}")

        pool = vmm_torch.Pool("host", handle_type="posix_fd")
        t = pool.empty((1000,)).fill_(3)
        kept = []

        def export_and_import():
            shared = vmm_torch.export_tensor(t)
            u = pickle.loads(pickle.dumps(shared)).open()
            b = vmm_torch.import_buffer(shared.descriptor)
            assert float(u.sum()) == 3000 and float(b.as_tensor(torch.float32)[:1000].sum()) == 3000
            kept.extend([u, b])  # live until the interpreter's teardown

        def send_to_self():
            vmm_torch.install_reducers()
            r = pickle.loads(ForkingPickler.dumps(t))
            assert float(r.sum()) == 3000
            kept.append(r)

        def receive_from_another_process():
            # The sender child prints ForkingPickler payloads of its sends, then waits for a
            # line and exits 0 only if every send was acknowledged.
            sender = subprocess.Popen([sys.executable, sender_py], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
            got = [pickle.loads(bytes.fromhex(sender.stdout.readline())) for _ in range(3)]
            assert [float(g.sum()) for g in got] == [10.0, 20.0, 30.0]
            kept.extend(got)
            sender.stdin.write("done\\n")
            sender.stdin.flush()
            assert sender.wait(60) == 0, "the sender's sends were not all acknowledged"

        def failing_calls():
            try:
                vmm_torch.import_buffer(b"\\0" * 512)
            except ValueError:
                pass
            try:
                vmm_torch.set_send_lease(-1)
            except ValueError:
                pass

        def stats():
            vmm_torch.memory_stats()
            pool.memory_stats()
            vmm_torch.send_stats()
            vmm_torch.memory_snapshot()

        def free_and_close():
            other = pool.empty((1 << 20,))
            del other
            pool.empty_cache()
            pool.close()

        attempt("export_and_import", export_and_import)
        attempt("send_to_self", send_to_self)
        attempt("receive_from_another_process", receive_from_another_process)
        attempt("failing_calls", failing_calls)
        attempt("stats", stats)
        attempt("free_and_close", free_and_close)
        os.write(1, ("ATEXIT " + " ".join(OUTCOMES) + "\\n").encode())
        KEPT_AT_EXIT.extend(kept)


    KEPT_AT_EXIT = []
    if order == "before_import":  # runs after vmm_torch's and multiprocessing's handlers
        atexit.register(handler)
    import torch
    import vmm_torch
    from multiprocessing.reduction import ForkingPickler

    vmm_torch.install_reducers()
    POOL = vmm_torch.Pool("host")
    T = POOL.empty((100,)).fill_(1)
    R = pickle.loads(ForkingPickler.dumps(T))  # a received send, live at exit
    if order == "after_import":  # runs before them
        atexit.register(handler)
    print("ready", flush=True)
    """

ATEXIT_SENDER = """
    import torch
    import vmm_torch
    from multiprocessing.reduction import ForkingPickler

    vmm_torch.install_reducers()
    pool = vmm_torch.Pool("host", handle_type="fabric")
    for value in (1, 2, 3):
        t = pool.empty((10,)).fill_(value)
        print(bytes(ForkingPickler.dumps(t)).hex(), flush=True)
        del t
    sys.stdin.readline()
    sys.exit(0 if vmm_torch.wait_for_sends(30) == 0 else 1)
    """


@pytest.mark.parametrize("order", ["before_import", "after_import"])
def test_atexit_handlers_that_call_vmm(tmp_path, order):
    sender_py = _script(tmp_path, "atexit_sender.py", ATEXIT_SENDER)
    done = _run(_script(tmp_path, "atexit_calls.py", ATEXIT), order, sender_py)
    _check("process", done, 0)
    lines = [line for line in done.stdout.splitlines() if line.startswith("ATEXIT ")]
    assert lines == ["ATEXIT export_and_import:ok send_to_self:ok "
                     "receive_from_another_process:ok failing_calls:ok stats:ok "
                     "free_and_close:ok"], done.stdout


# --- Queues whose join was cancelled -----------------------------------------------------------
#
# At exit a sender waits (VMM_SEND_EXIT_WAIT_S) for the receivers of its sends, but not for
# those of a queue whose join was cancelled: once multiprocessing has joined the children,
# that queue's feeder thread finishes the message it is pickling (at least 2 s), pickles no
# other, and every send it made that no receiver acknowledged is withdrawn, those already in
# the pipe included. The scripts stamp the exit wait from both sides (multiprocessing
# finalizers of priority 6 and -20 around vmm_torch's, 5 and -10; the queues' close
# finalizers, 10, run first) and count what their receivers get.

CANCEL_HELPERS = """
    import json
    import multiprocessing.util


    def write_json(path, value):
        with open(path + ".tmp", "w") as f:
            json.dump(value, f)
        os.rename(path + ".tmp", path)


    # Stamps this process's exit wait into directory d: PREFIXwait_start when it begins and
    # PREFIXwait_end when it is over ("t", the monotonic clock, which is system-wide; "held",
    # the sends still held; and what extra() adds).
    def stamp_exit_wait(d, prefix="", extra=dict):
        def start():
            write_json(os.path.join(d, prefix + "wait_start"), time.monotonic())

        def stamp(name, more=dict):
            import vmm_torch
            value = {"t": time.monotonic(), "held": vmm_torch.send_stats()["held"]}
            value.update(more())
            write_json(os.path.join(d, prefix + name), value)

        multiprocessing.util.Finalize(None, start, exitpriority=6)
        multiprocessing.util.Finalize(None, stamp, args=("wait_end",), exitpriority=4)
        # After the children are joined and the cancelled queues given up (-10).
        multiprocessing.util.Finalize(None, stamp, args=("gave_up", extra), exitpriority=-20)


    # Reads q until `limit` items came or none comes for `idle` s; counts what each item was:
    # "ok" where check(item) holds, else "wrong", or the error its get raised
    # ("VmmError:NOT_FOUND"). Sleeps `pause` s after each item (a slow reader).
    def drain(q, check, limit, idle, pause=0.0):
        import queue
        counts = {}
        for _ in range(limit):
            try:
                item = q.get(timeout=idle)
            except queue.Empty:
                break
            except Exception as e:
                key = type(e).__name__ + ":" + str(getattr(e, "code", ""))
            else:
                key = "ok" if check(item) else "wrong"
                del item
                time.sleep(pause)
            counts[key] = counts.get(key, 0) + 1
        return counts
    """


def _assert_gave_up_within(d, seconds):
    """The exit wait of the script that wrote its stamps into `d` ended within `seconds`,
    holding no send (it withdrew those of its cancelled queues)."""
    took, end = _exit_wait(d)
    assert took < seconds, f"the exit wait took {took:.1f} s ({end})"
    assert end["held"] == 0, end


def _cancel_script(tmp_path, name, body):
    return _script(tmp_path, name, textwrap.dedent(CANCEL_HELPERS) + textwrap.dedent(body))


def _exit_wait(d, prefix=""):
    """(seconds from the exit wait's start until the cancelled queues were given up, what the
    stamp then says, with "wait_end_t": when the wait for receivers ended) from a script's
    stamps."""
    start = json.loads((d / f"{prefix}wait_start").read_text())
    end = json.loads((d / f"{prefix}gave_up").read_text())
    end["wait_end_t"] = json.loads((d / f"{prefix}wait_end").read_text())["t"]
    return end["t"] - start, end


TWO_QUEUES = """
    import signal

    import torch
    import torch.multiprocessing as mp
    import vmm_torch

    N = 24


    def right(base):
        # Item i: (i, a tensor of 500 + i elements, each base + i).
        return lambda item: (item[1].numel() == 500 + item[0]
                             and float(item[1].sum()) == (500 + item[0]) * (base + item[0]))


    def receiver(kept, dropped, ready, d, kill):
        vmm_torch.install_reducers()
        ready.set()
        wait_for(lambda: os.path.exists(d + "/wait_start"), "the sender's exit wait")
        out = {}
        if kill:  # SIGTERM (no handler) while the sender waits for this receiver
            time.sleep(1)
            os.kill(os.getppid(), signal.SIGTERM)
            out["kept"] = drain(kept, right(0), N, 2)
            out["dropped"] = drain(dropped, right(1000), N, 1)
        else:
            time.sleep(2)  # reads late: the sender is in its exit wait (40 s)
            kept_counts = drain(kept, right(0), N - 1, 30)
            out["before_last"] = time.monotonic()  # the last import: before the wait ends
            for key, count in drain(kept, right(0), 1, 30).items():
                kept_counts[key] = kept_counts.get(key, 0) + count
            out["kept"] = kept_counts
            # The cancelled queue, read once the sender no longer waits for receivers: it
            # joins this process (not a daemon), and its feeder still flushes meanwhile.
            wait_for(lambda: os.path.exists(d + "/wait_end"), "the end of the sender's exit wait",
                     90)
            out["dropped"] = drain(dropped, right(1000), N, 5)
        write_json(d + "/received", out)


    if __name__ == "__main__":
        how, d = sys.argv[1], sys.argv[2]
        vmm_torch.install_reducers()
        ctx = mp.get_context("spawn")
        kept, dropped, ready = ctx.Queue(), ctx.Queue(), ctx.Event()
        dropped.cancel_join_thread()
        proc = ctx.Process(target=receiver,
                           args=(kept, dropped, ready, d, how == "sigterm_in_the_wait"))
        proc.start()
        assert ready.wait(60)
        pools = [vmm_torch.Pool("host", handle_type=h) for h in ("posix_fd", "fabric")]
        for i in range(N):
            # The two queues' tensors side by side in the same chunks; the cancelled queue's
            # of the POSIX-fd pool only (a withdrawn send of a fabric one: below).
            for q, pool, base in ((kept, pools[i % 2], 0), (dropped, pools[0], 1000)):
                t = pool.empty((500 + i,)).fill_(base + i)
                q.put((i, t))
                del t
        stamp_exit_wait(d)
        # The script ends here; "sigterm_in_the_wait": the receiver kills it in its exit wait.
    """

TWO_QUEUES_EXITS = {"return": 0, "sigterm_in_the_wait": -signal.SIGTERM}


# (sys.exit, an exception and SIGTERM with a handler: the mid-burst cases below.)
@pytest.mark.parametrize("how", ["return", "sigterm_in_the_wait"])
def test_a_cancelled_queue_is_given_up_while_another_queue_is_still_waited_for(tmp_path, how):
    """A sender with two queues to one receiver (a child it joins), one of them cancelled,
    exits: its wait for receivers lasts until the receiver has read the other queue, late
    (all its tensors arrive, with their values), and no longer; the cancelled queue's feeder
    still flushes while the sender joins its child, as without vmm, and the receiver, reading
    it then, gets every tensor; none is held at the end. Killed in the wait, the sender leaves
    clean errors (the memory went with it), never a wrong value or a crash."""
    n = 24
    done = _run(_cancel_script(tmp_path, "two_queues.py", TWO_QUEUES), how, tmp_path,
                env=_env(VMM_SEND_EXIT_WAIT_S=40))
    # The receiver shares the sender's stderr, and run() waits for it too (its end of the pipe).
    allowed = _allowed_for(how)
    if how == "sigterm_in_the_wait":
        allowed += (LEAKED_SEMAPHORES,)  # multiprocessing's, in a process killed
    _check("sender and receiver", done, TWO_QUEUES_EXITS[how], allowed)
    got = json.loads((tmp_path / "received").read_text())
    if how == "sigterm_in_the_wait":
        for name in ("kept", "dropped"):
            assert set(got[name]) <= {"ok", "VmmError:UNAVAILABLE", "VmmError:NOT_FOUND"}, got
        return
    took, end = _exit_wait(tmp_path)
    assert got["kept"] == {"ok": n}, got
    assert got["dropped"] == {"ok": n}, got
    assert end["wait_end_t"] > got["before_last"], "the exit wait did not wait for the receiver"
    waited = end["wait_end_t"] - (end["t"] - took)
    assert waited < 15, f"the exit wait took {waited:.1f} s (VMM_SEND_EXIT_WAIT_S=40)"
    assert end["held"] == 0, end


CANCELLED_BURST = """
    import torch
    import torch.multiprocessing as mp
    import vmm_torch

    N = 300  # more than the pipe holds (about 300 bytes each)


    def right(item):
        return item[1].numel() == 1000 + item[0] and float(item[1].sum()) == (
            item[1].numel() * (item[0] % 7))


    def reader(q, ready, d):
        vmm_torch.install_reducers()
        ready.set()
        # Slower than the sender: most of the burst is still to be pickled, or in the pipe,
        # when it exits.
        write_json(d + "/received", drain(q, right, N, 1, pause=0.03))


    if __name__ == "__main__":
        how, with_reader, d = sys.argv[1], sys.argv[2] == "reader", sys.argv[3]
        vmm_torch.install_reducers()
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        q.cancel_join_thread()
        if with_reader:
            ready = ctx.Event()
            ctx.Process(target=reader, args=(q, ready, d)).start()
            assert ready.wait(60)
        pools = [vmm_torch.Pool("host", handle_type=h) for h in ("posix_fd", "fabric")]
        for i in range(N):
            # For a reader, of the POSIX-fd pool only (a withdrawn send of a fabric one: below).
            t = pools[0 if with_reader else i % 2].empty((1000 + i,)).fill_(i % 7)
            q.put((i, t))
            del t
        stamp_exit_wait(d)
        leave(how, "the sender", {"sys_exit": 3, "sigterm_handler": 4})
    """

CANCELLED_BURST_CASES = [("return", "none"), ("sigterm_handler", "none"), ("sys_exit", "reader"),
                         ("exception", "reader")]


@pytest.mark.parametrize("how,reader", CANCELLED_BURST_CASES)
def test_a_cancelled_queue_mid_burst_does_not_hold_the_exit(tmp_path, how, reader):
    """Hundreds of puts on a cancelled queue just before exit, its feeder blocked on a full
    pipe (no reader) or pickling for a slow reader: the wait for receivers ends at once, none
    held at the end, the exit code is the way of exiting's; a slow reader that is a child the
    sender joins gets every tensor, since the feeder flushes meanwhile, as without vmm."""
    n = 300
    done = _run(_cancel_script(tmp_path, "cancelled_burst.py", CANCELLED_BURST), how, reader,
                tmp_path, env=_env(VMM_SEND_EXIT_WAIT_S=60))
    _check("sender" + (" and reader" if reader == "reader" else ""), done,
           {"return": 0, "sys_exit": 3, "exception": 1, "sigterm_handler": 4}[how],
           _allowed_for(how))
    if reader == "reader":
        took, end = _exit_wait(tmp_path)
        waited = end["wait_end_t"] - (end["t"] - took)
        assert waited < 5, f"the exit wait took {waited:.1f} s ({end})"
        assert end["held"] == 0, end
        got = json.loads((tmp_path / "received").read_text())
        assert got == {"ok": n}, got
    else:
        _assert_gave_up_within(tmp_path, 5)


CANCELLED_AT_CREATION = """
    import torch
    import torch.multiprocessing as mp
    import torch.multiprocessing.queue
    import vmm_torch

    d = sys.argv[1]
    vmm_torch.install_reducers()
    ctx = mp.get_context("spawn")
    queues = [ctx.Queue(), ctx.JoinableQueue(), torch.multiprocessing.queue.Queue(ctx=ctx)]
    for q in queues:
        q.cancel_join_thread()  # before any put: no feeder thread yet
    pool = vmm_torch.Pool("host", handle_type="posix_fd")
    for i in range(40):
        for q in queues:
            q.put(pool.empty((256,)).fill_(i))
    wait_for(lambda: vmm_torch.send_stats()["held"] == 120, "the feeders' sends")
    stamp_exit_wait(d)
    # No process reads them: they stay in the pipes (held) as the script ends.
    """


def test_queues_cancelled_at_creation_are_not_waited_for(tmp_path):
    """multiprocessing's Queue and JoinableQueue and torch.multiprocessing's Queue, each
    cancelled before its first put, their 120 sends in their pipes at exit, no reader: the
    exit wait withdraws them all at once."""
    done = _run(_cancel_script(tmp_path, "at_creation.py", CANCELLED_AT_CREATION), tmp_path,
                env=_env(VMM_SEND_EXIT_WAIT_S=60))
    _check("process", done, 0)
    _assert_gave_up_within(tmp_path, 5)


PICKLING_AT_EXIT = """
    import pickle
    import threading

    import torch
    import torch.multiprocessing as mp
    import vmm_torch
    from multiprocessing.reduction import ForkingPickler

    kind, d = sys.argv[1], sys.argv[2]
    vmm_torch.install_reducers()
    A = torch.rand(256, 256)
    in_feeder = threading.Event()
    PICKLED = {}


    def busy(seconds):
        # PyTorch operators, which release the GIL: the interpreter's finalization stopping a
        # thread inside one aborts the process ("terminate called without an active
        # exception").
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            torch.mm(A, A)


    def rebuild(inner, t):
        return [pickle.loads(inner) if inner else None, t]


    class Slow:
        # Slow to pickle in the feeder thread; "nested": its __reduce__ first pickles a message
        # of its own with a send (ForkingPickler.dumps, in the feeder thread too).
        def __init__(self, t):
            self.t = t

        def __reduce__(self):
            if threading.current_thread().name != "QueueFeederThread":
                return (rebuild, (b"", self.t))  # Queue.put's dry run
            in_feeder.set()
            inner = ForkingPickler.dumps(self.t[:100]) if kind == "nested" else b""
            busy(0.8)
            PICKLED["at"] = time.monotonic()  # what is left: self.t, a send
            return (rebuild, (bytes(inner), self.t))


    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    q.cancel_join_thread()
    pool = vmm_torch.Pool("host")
    q.put(Slow(pool.empty((4096,)).fill_(5)))
    assert in_feeder.wait(60)
    stamp_exit_wait(d, extra=lambda: {"pickled": PICKLED.get("at")})
    # Ends while the feeder pickles the message (VMM_SEND_EXIT_WAIT_S as the test sets it).
    """


@pytest.mark.parametrize("kind,exit_wait", [("plain", 0), ("nested", 0), ("nested", 30)])
def test_a_cancelled_queue_s_message_being_pickled_at_exit_is_finished(tmp_path, kind,
                                                                         exit_wait):
    """The exit comes while a cancelled queue's feeder pickles a message (inside PyTorch's
    operators for most of a second; "nested": after a ForkingPickler.dumps of a send of its
    own): the exit wait lets it finish, even with VMM_SEND_EXIT_WAIT_S=0 (at least 2 s), then
    withdraws its sends (none held, no warning); no abort. (Without the wait, or with a nested
    pickle taken for the end of the message, the process aborted.)"""
    done = _run(_cancel_script(tmp_path, "pickling_at_exit.py", PICKLING_AT_EXIT), kind, tmp_path,
                env=_env(VMM_SEND_EXIT_WAIT_S=exit_wait))
    _check("process", done, 0)
    took, end = _exit_wait(tmp_path)
    assert end["pickled"] is not None and end["t"] >= end["pickled"], \
        f"the exit wait ended before the message was pickled: {end}"
    assert took < 8, f"the exit wait took {took:.1f} s"
    assert end["held"] == 0, end


FORKED_CHILD = """
    import torch

    torch.set_num_threads(1)  # PyTorch's OpenMP runtime is not fork-safe (test_fork.py)
    import torch.multiprocessing as mp
    import vmm_torch

    N = 12
    BASES = {"own": 0, "child": 100, "parent": 200}


    def right(item):
        who, i, t = item
        return float(t.sum()) == t.numel() * (BASES[who] + i)


    def child(shared, own, d):
        # Forked with the parent's bookkeeping: `shared`, cancelled there, among the queues it
        # put vmm tensors in, and its feeder among the feeders (not alive here). multiprocessing
        # made `shared` new in this process, its join not cancelled: its sends here are waited
        # for, as those on `own` are.
        pool = vmm_torch.Pool("host", handle_type="posix_fd")
        for i in range(N):
            own.put(("own", i, pool.empty((500,)).fill_(BASES["own"] + i)))
            shared.put(("child", i, pool.empty((500,)).fill_(BASES["child"] + i)))
        stamp_exit_wait(d, "child_")


    if __name__ == "__main__":
        d = sys.argv[1]
        vmm_torch.install_reducers()
        ctx = mp.get_context("fork")
        shared, own = ctx.Queue(), ctx.Queue()
        shared.cancel_join_thread()
        pool = vmm_torch.Pool("host")
        for i in range(N):
            shared.put(("parent", i, pool.empty((500,)).fill_(BASES["parent"] + i)))
        wait_for(lambda: vmm_torch.send_stats()["held"] == N, "the parent's feeder")
        proc = ctx.Process(target=child, args=(shared, own, d))
        proc.start()
        wait_for(lambda: os.path.exists(d + "/child_wait_start"), "the child's exit wait")
        time.sleep(2)  # reads late: the child is in its exit wait
        got = {"own": drain(own, right, N - 1, 30)}
        before_last = time.monotonic()  # the last import of the child's: before its wait ends
        for key, count in drain(own, right, 1, 30).items():
            got["own"][key] = got["own"].get(key, 0) + count
        got["shared"] = drain(shared, right, 2 * N, 30)
        proc.join(60)
        result({"got": got, "exitcode": proc.exitcode, "before_last": before_last})
    """


def test_a_forked_child_of_a_process_with_a_cancelled_queue_still_waits_for_its_receivers(
        tmp_path):
    """A parent cancels a queue it sent vmm tensors on, then forks a child (multiprocessing's
    fork context) that sends on that queue and on another, and exits: its exit wait lasts until
    the parent has read both, late; every tensor arrives with its value (the parent's too)."""
    n = 12
    done = _run(_cancel_script(tmp_path, "forked_child.py", FORKED_CHILD), tmp_path,
                env=_env(VMM_SEND_EXIT_WAIT_S=40))
    _check("parent and child", done, 0)
    (out,) = _results(done.stdout)
    assert out["exitcode"] == 0, out
    assert out["got"] == {"own": {"ok": n}, "shared": {"ok": 2 * n}}, out
    took, end = _exit_wait(tmp_path, "child_")
    assert end["held"] == 0, end
    assert end["t"] > out["before_last"], "the child's exit wait did not wait for the parent"
    assert took < 20, f"the child's exit wait took {took:.1f} s (VMM_SEND_EXIT_WAIT_S=40)"


WITHDRAWN_THEN_REUSED = """
    import torch
    import torch.multiprocessing as mp
    import vmm_torch

    N = 8
    REUSED = []


    def sender(q, handle, d):
        vmm_torch.install_reducers()
        q.cancel_join_thread()
        pool = vmm_torch.Pool("host", handle_type=handle)
        for i in range(N):
            t = pool.empty((1000,)).fill_(7)
            q.put(t)
            del t
        wait_for(lambda: vmm_torch.send_stats()["held"] == N, "the feeder's sends")
        stamp_exit_wait(d)
        multiprocessing.util.Finalize(None, allocate_again, args=(pool, d), exitpriority=-15)


    def allocate_again(pool, d):
        # What runs after the exit wait gave the cancelled queue up (another exit handler, a
        # daemon thread): allocations of the same pool, filled with -1; then the sender stays
        # alive until its parent has read the pipe.
        REUSED.extend(pool.empty((1000,)).fill_(-1) for _ in range(2 * N))
        write_json(d + "/reallocated", True)
        wait_for(lambda: os.path.exists(d + "/read"), "the reader", 90)


    if __name__ == "__main__":
        handle, d = sys.argv[1], sys.argv[2]
        vmm_torch.install_reducers()
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        child = ctx.Process(target=sender, args=(q, handle, d))
        child.start()
        # Reads once the sender's exit has withdrawn what is in the pipe and it has allocated
        # again (as a DataLoader's main process reads a worker's queue).
        wait_for(lambda: os.path.exists(d + "/reallocated"), "the sender's allocations", 90)
        write_json(d + "/received", drain(q, lambda t: float(t.sum()) == 7 * t.numel(), N, 1))
        write_json(d + "/read", True)
        child.join(60)
        assert child.exitcode == 0, child.exitcode
    """


@pytest.mark.parametrize("handle", ["posix_fd", "fabric"])
def test_a_withdrawn_send_in_a_cancelled_queue_s_pipe_never_maps_reused_memory(tmp_path,
                                                                                handle):
    """The exit withdraws the sends of a cancelled queue that are still in its pipe; the
    sender then allocates again in the same pool before it is gone. A reader of the pipe that
    comes now (its parent) gets an error for each (NOT_FOUND; a POSIX-fd send) or the values
    sent (a fabric handle still imports while the sender lives), never the new tensors' bytes:
    the withdrawn sends' chunks are not reused. (Once they were: a fabric reader got the new
    -1s.)"""
    done = _run(_cancel_script(tmp_path, "withdrawn_then_reused.py", WITHDRAWN_THEN_REUSED),
                handle, tmp_path, env=_env(VMM_SEND_EXIT_WAIT_S=30))
    _check("sender and reader", done, 0)
    _assert_gave_up_within(tmp_path, 10)
    got = json.loads((tmp_path / "received").read_text())
    assert "wrong" not in got, got
    if handle == "posix_fd":
        assert "ok" not in got, got


DROPPED_CANCELLED_QUEUE = """
    import gc

    import torch
    import torch.multiprocessing as mp
    import vmm_torch


    def holder(q):
        time.sleep(120)  # keeps the queue's pipe open, and never reads


    if __name__ == "__main__":
        import threading

        d, n = sys.argv[1], int(sys.argv[2])
        vmm_torch.install_reducers()
        q = mp.get_context("spawn").Queue()
        q.cancel_join_thread()
        mp.get_context("fork").Process(target=holder, args=(q,), daemon=True).start()
        pool = vmm_torch.Pool("host", handle_type="posix_fd")
        for i in range(n):
            q.put(pool.empty((256,)).fill_(i))
        wait_for(lambda: vmm_torch.send_stats()["held"] == n, "the feeder's sends")
        del q  # the program is done with it: its join stays cancelled
        gc.collect()
        if n < 3:  # all in the pipe: the feeder ends at the queue's close
            wait_for(lambda: not any(t.name == "QueueFeederThread" for t in threading.enumerate()),
                     "the feeder's end")
        stamp_exit_wait(d)
    """


@pytest.mark.parametrize("n", [20, 2])
def test_a_cancelled_queue_the_program_dropped_is_not_waited_for(tmp_path, n):
    """A cancelled queue's sends in its pipe (a child holds it and never reads), the queue
    object dropped before exit, its feeder still writing (20) or ended (2): multiprocessing
    does not join its feeder, and vmm's exit wait does not wait for those sends either."""
    done = _run(_cancel_script(tmp_path, "dropped_queue.py", DROPPED_CANCELLED_QUEUE), tmp_path,
                n, env=_env(VMM_SEND_EXIT_WAIT_S=4))
    _check("process", done, 0)
    _assert_gave_up_within(tmp_path, 2)


MANY_DROPPED_CANCELLED_QUEUES = """
    import gc
    import threading

    import torch
    import torch.multiprocessing as mp
    import vmm_torch
    from vmm_torch import reductions

    d, n = sys.argv[1], int(sys.argv[2])
    vmm_torch.install_reducers()
    pool = vmm_torch.Pool("host", handle_type="posix_fd")
    ctx = mp.get_context("spawn")
    for i in range(n):
        q = ctx.Queue()
        q.cancel_join_thread()
        q.put(pool.empty((64,)).fill_(i))  # into the pipe (no one reads it); the feeder ends
        q.close()
        q.join_thread()
        del q
    gc.collect()
    wait_for(lambda: not any(t.name == "QueueFeederThread" for t in threading.enumerate()),
             "the feeders' end")
    assert vmm_torch.send_stats()["held"] == n, vmm_torch.send_stats()
    result({"threads": len(reductions._cancelled_feeders),
            "tokens": len(reductions._cancelled_tokens)})
    stamp_exit_wait(d)
    """


def test_many_cancelled_queues_dropped_keep_no_thread_and_are_not_waited_for(tmp_path):
    """Queues of vmm sends, each cancelled, sent one tensor no one reads, closed and dropped,
    one after another: the exit wait keeps the token of each feeder that sent (a number), not
    its ended thread, and still gives every send up at exit."""
    n = 40
    done = _run(_cancel_script(tmp_path, "many_dropped.py", MANY_DROPPED_CANCELLED_QUEUES),
                tmp_path, n, env=_env(VMM_SEND_EXIT_WAIT_S=30))
    _check("process", done, 0)
    assert _results(done.stdout) == [{"threads": 0, "tokens": n}]
    _assert_gave_up_within(tmp_path, 2)


POOL_LEFT_EARLY = """
    import torch
    import torch.multiprocessing as mp
    import vmm_torch


    def work(t):
        time.sleep(0.05)
        return float(t.sum())


    if __name__ == "__main__":
        vmm_torch.install_reducers()
        pool = vmm_torch.Pool("host", handle_type="posix_fd")
        with mp.get_context("spawn").Pool(2) as p:  # a pool that finishes its work
            assert p.map(work, [pool.empty((256,)).fill_(i) for i in range(8)]) == [
                256.0 * i for i in range(8)]
        with mp.get_context("spawn").Pool(2) as p:  # left early: terminated with tasks unread
            for k, r in enumerate(p.imap(work, (pool.empty((256,)).fill_(i)
                                                for i in range(200)))):
                assert r == 256.0 * k
                if k == 3:
                    break
        result({"held": vmm_torch.send_stats()["held"], "t": time.monotonic()})
    """


def test_a_terminated_pool_s_unread_tasks_are_not_waited_for(tmp_path):
    """A loop over Pool.imap left early inside `with Pool()`: the pool is terminated with
    tasks in its pipe that no worker will read; the exit does not wait for them (it waited
    the whole exit wait, 10 s, where without vmm the process exits at once)."""
    done = _run(_script(tmp_path, "pool_left_early.py", POOL_LEFT_EARLY),
                env=_env(VMM_SEND_EXIT_WAIT_S=30))
    ended = time.monotonic()  # the clock the script stamps its end with
    _check("process", done, 0)
    [out] = _results(done.stdout)
    assert out["held"] > 0, out  # the tasks still in the pipe when the pool was terminated
    took = ended - out["t"]
    assert took < 10, f"the exit took {took:.1f} s (VMM_SEND_EXIT_WAIT_S=30)"


RAW_FORK = """
    import torch

    torch.set_num_threads(1)  # PyTorch's OpenMP runtime is not fork-safe (test_fork.py)
    import torch.multiprocessing as mp
    import vmm_torch

    d = sys.argv[1]
    vmm_torch.install_reducers()
    ctx = mp.get_context("spawn")
    cancelled, q = ctx.Queue(), ctx.Queue()
    cancelled.cancel_join_thread()
    pool = vmm_torch.Pool("host")
    cancelled.put(pool.empty((100,)).fill_(1))
    wait_for(lambda: vmm_torch.send_stats()["held"] == 1, "the parent's feeder")
    faulthandler.cancel_dump_traceback_later()  # its thread does not survive fork() (FORK)
    pid = os.fork()
    if pid == 0:
        # os.fork(), not multiprocessing: no after-fork hooks run; the parent's cancelled queue
        # stays cancelled here (and its feeder is not alive). The child sends from a pool of its
        # own on another queue, and exits.
        child_pool = vmm_torch.Pool("host", handle_type="posix_fd")
        q.put(child_pool.empty((500,)).fill_(3))
        stamp_exit_wait(d, "child_")
        sys.exit(0)
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    wait_for(lambda: os.path.exists(d + "/child_wait_start"), "the child's exit")
    time.sleep(2)  # reads late, within the child's exit wait (if it waits)
    before = time.monotonic()
    try:
        t = q.get(timeout=30)
        got = "ok" if float(t.sum()) == 1500.0 else "wrong"
        del t
    except Exception as e:
        got = type(e).__name__ + ":" + str(getattr(e, "code", ""))
    deadline = time.monotonic() + 60
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            break
        time.sleep(0.02)
    result({"got": got, "before": before})
    """


def test_a_child_forked_by_os_fork_still_waits_for_its_receivers(tmp_path):
    """A parent with a cancelled queue forks a child with os.fork(): the child, which inherits
    that bookkeeping as it is, sends on another queue and exits; it waits for the parent, who
    reads late, and the tensor arrives."""
    done = _run(_cancel_script(tmp_path, "raw_fork.py", RAW_FORK), tmp_path,
                env=_env(VMM_SEND_EXIT_WAIT_S=30))
    _check("parent and child", done, 0)
    (out,) = _results(done.stdout)
    assert out["got"] == "ok", out
    took, end = _exit_wait(tmp_path, "child_")
    assert end["t"] > out["before"] and end["held"] == 0, (out, end)


SIGTERM_IN_THE_WAIT = """
    import signal

    import torch
    import torch.multiprocessing as mp
    import vmm_torch


    def sender(q, d):
        # Its handler exits with 5; its one send is never read, so it would wait the whole
        # exit wait (60 s).
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(5))
        vmm_torch.install_reducers()
        pool = vmm_torch.Pool("host", handle_type="posix_fd")
        q.put(pool.empty((1000,)).fill_(1))
        wait_for(lambda: vmm_torch.send_stats()["held"] == 1, "the feeder's send")
        stamp_exit_wait(d)


    if __name__ == "__main__":
        d = sys.argv[1]
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        proc = ctx.Process(target=sender, args=(q, d))
        proc.start()
        wait_for(lambda: os.path.exists(d + "/wait_start"), "the sender's exit wait")
        time.sleep(0.5)
        killed = time.monotonic()
        proc.terminate()  # SIGTERM
        proc.join(30)
        result({"exitcode": proc.exitcode, "took": time.monotonic() - killed})
    """


MAIN_SIGTERM_IN_THE_WAIT = """
    import signal

    import torch
    import torch.multiprocessing as mp
    import vmm_torch


    def idle(q):
        time.sleep(120)  # holds the queue and never reads; a daemon: terminated at the exit


    if __name__ == "__main__":
        d = sys.argv[1]
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(5))
        vmm_torch.install_reducers()
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        child = ctx.Process(target=idle, args=(q,), daemon=True)
        child.start()
        write_json(d + "/child", child.pid)
        pool = vmm_torch.Pool("host", handle_type="posix_fd")
        q.put(pool.empty((1000,)).fill_(1))
        wait_for(lambda: vmm_torch.send_stats()["held"] == 1, "the feeder's send")
        stamp_exit_wait(d)
    """


def test_a_sigterm_handler_ends_the_exit_wait_at_once(tmp_path):
    """A sender in its exit wait for a send no one reads gets SIGTERM, whose Python handler
    calls sys.exit(5): the handler runs at once (the wait is no single long C call) and the
    process exits with 5, as its handler says."""
    done = _run(_cancel_script(tmp_path, "sigterm_in_the_wait.py", SIGTERM_IN_THE_WAIT),
                tmp_path, env=_env(VMM_SEND_EXIT_WAIT_S=60))
    _check("parent", done, 0)
    (out,) = _results(done.stdout)
    assert out["exitcode"] == 5 and out["took"] < 5, out


def test_a_sigterm_handler_in_the_main_process_ends_the_exit_wait_and_the_exit_goes_on(tmp_path):
    """The same in a main process: the handler ends the wait at once, and multiprocessing's
    exit goes on (its daemon child terminated); the exit code stays the script's (0), with no
    traceback printed."""
    script = _cancel_script(tmp_path, "main_sigterm.py", MAIN_SIGTERM_IN_THE_WAIT)
    proc = subprocess.Popen([sys.executable, script, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(VMM_SEND_EXIT_WAIT_S=60))
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (tmp_path / "wait_start").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        time.sleep(0.5)
        killed = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    _check("process", subprocess.CompletedProcess(proc.args, proc.returncode, out, err), 0)
    assert took < 5, f"the exit took {took:.1f} s after SIGTERM"
    child = json.loads((tmp_path / "child").read_text())
    gone = False
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            gone = True
            break
        time.sleep(0.05)
    assert gone, "the daemon child was left running"
