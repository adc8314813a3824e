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
  process, free, and read statistics.

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


    def receiver(q, n, path):
        vmm_torch.install_reducers()
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
            right = float(item.sum()) == item.numel() * (i % 7) and item.numel() == 1000 + i
            ok += int(right)
            wrong += int(not right)
            del item
        with open(path, "w") as f:
            f.write(repr((ok, wrong, errors)))


    if __name__ == "__main__":
        how, n, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
        vmm_torch.install_reducers()
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        proc = ctx.Process(target=receiver, args=(q, n, path))
        proc.start()
        pools = [vmm_torch.Pool("host", handle_type=h) for h in ("fabric", "posix_fd")]
        for i in range(n):
            t = pools[i % 2].empty((1000 + i,)).fill_(i % 7)
            q.put(t)
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
