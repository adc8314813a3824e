#!/usr/bin/env python3
"""Many small tensors through a chain of three processes: vmm sends against PyTorch's sharing.

    python3 bench/mp_chain.py [--modes native,vmm-fabric,vmm-fd] [--count 100000] [--size 4K]
        [--dtype float32] [--timeout 600] [--json FILE] [--markdown FILE] [--profile DIR]

Process S creates --count tensors of --size bytes in a loop, tensor i filled with i (modulo the
largest integer the dtype holds exactly), and puts each on queue 1, dropping it at once
(``q1.put(t); del t``). Process M takes each tensor, clones it, puts the clone on queue 2 and
drops both. Process R takes each tensor and adds up its elements; its final sum is checked
against the closed form. The three are spawned (torch.multiprocessing, "spawn"), set CUDA (and
vmm) up and report ready before S starts; they stay alive until R has its sum, then report
their statistics on a result queue and exit.

Modes, each run in a fresh subprocess of this script (a clean process tree per mode):

- ``native``: PyTorch's CUDA allocator and its CUDA IPC.
- ``vmm-fabric``, ``vmm-fd``: vmm in every process through ``VMM_TORCH_ENABLE=handle_type=
  fabric`` (``posix_fd``) in the environment of the mode's processes; CUDA tensors travel as
  vmm sends. Where the package's .pth file is not on a site path (a ``pip install --target``
  folder on PYTHONPATH), each process applies the variable itself before using CUDA
  (``vmm_torch.autoenable.run()``, what the .pth file would do); the row says which.
- ``native-cpu``: CPU tensors through PyTorch's own sharing (file_descriptor strategy).
- ``vmm-host``: CPU tensors of vmm host pools (S allocates from its pool, M clones into its
  own), sent as vmm sends; each process installs vmm's reducers itself.

Without --modes: the three CUDA modes where CUDA is available, else the two CPU modes (a quick
check of this script on a machine without a GPU).

Reported per mode: seconds from S's first put to R's final sum, tensors per second, the peak of
the used memory of the GPU above its level before the mode's processes started (sampled every
--sample-ms by this process, with NVML where pynvml imports, else with
torch.cuda.mem_get_info, whose context the baseline includes), and each process's peaks:
``torch.cuda.max_memory_reserved()`` in native; vmm's ``reserved_bytes.all.peak`` (the device
pool, or the host pool of S and M) and the sends' ``peak_held_bytes`` in vmm modes; the
maximum resident set size everywhere. A mode that fails (no IMEX channel for fabric, out of
memory, a wrong sum) or runs past --timeout (its processes are then killed) is reported as
such; the others still run. JSON to --json, a Markdown table on stdout and to --markdown.
Exits 1 if any mode did not finish with the right sum.
"""
import argparse
import json
import math
import os
import queue
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import torch

CUDA_MODES = ("native", "vmm-fabric", "vmm-fd")
CPU_MODES = ("native-cpu", "vmm-host")
MODES = CUDA_MODES + CPU_MODES
HANDLE_TYPES = {"vmm-fabric": "fabric", "vmm-fd": "posix_fd"}
ENABLE_VARIABLE = "VMM_TORCH_ENABLE"
IMEX_CHANNEL = "/dev/nvidia-caps-imex-channels/channel0"
SETUP_TIMEOUT_S = 300  # for the three processes to report ready
STATS_TIMEOUT_S = 120  # for their statistics once R has its sum


def parse_bytes(text):
    """Bytes of "4096", "4K", "2M", "1G" (binary units)."""
    text = text.strip()
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    scale = units.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale > 1 else text
    if not digits.isdigit() or int(digits) <= 0:
        raise ValueError(f"{text!r} is not a positive size in bytes (e.g. 4096, 4K, 2M)")
    return int(digits) * scale


def parse_dtype(name):
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or dtype.is_complex or dtype == torch.bool:
        raise ValueError(f"{name!r} is not a real floating-point or integer torch dtype")
    exact_limit(dtype)  # dtypes without finfo / iinfo (quantized ones) fail here
    return dtype


def exact_limit(dtype):
    """Values 0 .. limit-1 are exact in `dtype`: tensor i holds i % limit."""
    if dtype.is_floating_point:
        mantissa_bits = round(-math.log2(torch.finfo(dtype).eps))
        return 1 << (mantissa_bits + 1)
    return torch.iinfo(dtype).max + 1


def expected_sum(count, numel, limit):
    """numel * sum(i % limit for i in range(count))."""
    whole, rest = divmod(count, limit)
    return numel * (whole * limit * (limit - 1) // 2 + rest * (rest - 1) // 2)


def size_name(n):
    if n is None:
        return ""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


# --- The chain's processes -------------------------------------------------------------------


class Setup:
    """What a process of the chain needs for its mode: where tensors live, how S makes one and
    M clones one, and the process's statistics."""

    def __init__(self, mode, role):
        self.mode, self.role = mode, role
        self.device = torch.device("cpu" if mode in CPU_MODES else "cuda")
        self.pool = None
        self.vmm_setup = None
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:  # PyTorch's CPU sharing holds an fd per tensor in flight
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        if mode in HANDLE_TYPES:
            self.vmm_setup = self._enable_vmm()
        elif mode == "vmm-host":
            import vmm_torch

            vmm_torch.install_reducers()
            self.vmm_setup = "install_reducers()"
            if role in ("S", "M"):
                self.pool = vmm_torch.Pool("host")
        if self.device.type == "cuda":
            torch.cuda.init()
            torch.empty(1, device=self.device)  # the context, and the allocator's first pool
            torch.cuda.synchronize()

    @staticmethod
    def _enable_vmm():
        """vmm as this process's CUDA allocator, with its reducers, from VMM_TORCH_ENABLE."""
        import vmm_torch
        from vmm_torch import autoenable, reductions

        if vmm_torch.is_enabled() and reductions.reducers_installed():
            how = f"{ENABLE_VARIABLE} at import torch"
        else:  # the .pth file did not run here: what it does, now
            autoenable.run()
            how = f"{ENABLE_VARIABLE} applied by the process"
        if not vmm_torch.is_enabled():
            raise RuntimeError(f"vmm is not this process's CUDA allocator ({ENABLE_VARIABLE}="
                               f"{os.environ.get(ENABLE_VARIABLE)!r})")
        return how

    def make(self, numel, dtype, value):
        if self.pool is not None:
            return self.pool.empty((numel,), dtype).fill_(value)
        return torch.full((numel,), value, dtype=dtype, device=self.device)

    def clone(self, t):
        if self.pool is not None:
            return self.pool.empty(tuple(t.shape), t.dtype).copy_(t)
        return t.clone()

    def stats(self):
        out = {"max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "vmm_setup": self.vmm_setup}
        if self.mode == "native":
            out["reserved_peak_bytes"] = torch.cuda.max_memory_reserved()
            out["allocated_peak_bytes"] = torch.cuda.max_memory_allocated()
        elif self.mode in HANDLE_TYPES or self.mode == "vmm-host":
            import vmm_torch
            from vmm_torch import sharing

            if self.mode == "vmm-host":
                stats = self.pool.memory_stats() if self.pool is not None else {}
            else:
                stats = vmm_torch.memory_stats()
            out["reserved_peak_bytes"] = stats.get("reserved_bytes.all.peak")
            out["allocated_peak_bytes"] = stats.get("allocated_bytes.all.peak")
            sends = sharing.send_stats()
            out["sends"] = sends
            out["peak_held_bytes"] = sends.get("peak_held_bytes")
            out["pool_driver_calls"] = {key.rsplit(".", 1)[1]: value for key, value in stats.items()
                                        if key.startswith("vmm.driver_calls.")}
            out["export_reuses"] = stats.get("vmm.num_export_reuses")
        return out


#: Each role writes how far it got to its progress file every this many tensors, so that a
#: mode stopped at its timeout still says which stage kept up and how fast it went.
PROGRESS_EVERY = 1000


class Progress:
    """Where a role's time goes (seconds in each phase of its loop, timed with perf_counter_ns
    around each call) and how far it got, written to its progress file every PROGRESS_EVERY
    tensors (atomically: write, then rename) when the mode has a progress folder."""

    def __init__(self, folder, role):
        self.folder, self.role = folder, role
        self.began = time.perf_counter_ns()
        self.ns = {}

    def add(self, phase, begin_ns):
        now = time.perf_counter_ns()
        self.ns[phase] = self.ns.get(phase, 0) + now - begin_ns
        return now

    def seconds(self):
        return {phase: ns / 1e9 for phase, ns in self.ns.items()}

    def done(self, count):
        if not self.folder or count % PROGRESS_EVERY:
            return
        path = os.path.join(self.folder, f"progress-{self.role}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"done": count, "seconds": (time.perf_counter_ns() - self.began) / 1e9,
                       "phases": self.seconds()}, f)
        os.replace(path + ".tmp", path)


def read_progress(folder):
    """{role: {"done", "seconds"}} of what the roles recorded."""
    found = {}
    for role in ("S", "M", "R"):
        try:
            with open(os.path.join(folder, f"progress-{role}.json")) as f:
                found[role] = json.load(f)
        except (OSError, ValueError):
            pass
    return found


class Profile:
    """With a profile folder: cProfile around the role's loop (its text summary, the 30
    functions with the most time of their own, to profile-MODE-ROLE.txt) and the time the
    queue's feeder thread spends pickling (ForkingPickler.dumps: where sends are exported) as
    the phase "feeder pickle"."""

    def __init__(self, folder, mode, role, progress):
        self.path = os.path.join(folder, f"profile-{mode}-{role}.txt") if folder else None
        self.profiler = None
        if self.path is None:
            return
        import cProfile
        from multiprocessing.reduction import ForkingPickler

        dumps = ForkingPickler.dumps.__func__
        lock = threading.Lock()

        def timed_dumps(cls, obj, protocol=None):
            at = time.perf_counter_ns()
            try:
                return dumps(cls, obj, protocol)
            finally:
                with lock:
                    progress.add("feeder pickle", at)

        ForkingPickler.dumps = classmethod(timed_dumps)
        self.profiler = cProfile.Profile()
        self.profiler.enable()

    def write(self):
        if self.profiler is None:
            return
        import io
        import pstats

        self.profiler.disable()
        text = io.StringIO()
        pstats.Stats(self.profiler, stream=text).sort_stats("tottime").print_stats(30)
        with open(self.path, "w") as f:
            f.write(text.getvalue())


def worker(role, config, q_in, q_out, results, start, done):
    """One process of the chain; every message on `results` is (kind, role, data)."""
    try:
        setup = Setup(config["mode"], role)
        results.put(("ready", role, None))
        start.wait()
        count, numel, limit = config["count"], config["numel"], config["limit"]
        dtype = getattr(torch, config["dtype"])
        progress = Progress(config.get("progress"), role)
        profile = Profile(config.get("profile"), config["mode"], role, progress)
        if role == "S":
            for i in range(count):
                at = time.perf_counter_ns()
                t = setup.make(numel, dtype, i % limit)
                at = progress.add("make", at)
                q_out.put(t)
                del t
                progress.add("put", at)
                progress.done(i + 1)
            results.put(("sent", role, {"t0_ns": progress.began}))
        elif role == "M":
            for i in range(count):
                at = time.perf_counter_ns()
                t = q_in.get()
                at = progress.add("get", at)
                c = setup.clone(t)
                del t
                at = progress.add("clone+release", at)
                q_out.put(c)
                del c
                progress.add("put", at)
                progress.done(i + 1)
        else:
            acc = torch.zeros((), dtype=torch.float64, device=setup.device)
            for i in range(count):
                at = time.perf_counter_ns()
                t = q_in.get()
                at = progress.add("get", at)
                acc += t.sum(dtype=torch.float64)
                del t
                progress.add("sum+release", at)
                progress.done(i + 1)
            total = acc.item()
            results.put(("finished", role, {"t1_ns": time.perf_counter_ns(), "sum": total}))
        profile.write()
        done.wait()
        results.put(("stats", role, {**setup.stats(), "phase_seconds": progress.seconds()}))
    except BaseException:  # noqa: B036 (reported to the runner, which stops the others)
        results.put(("error", role, traceback.format_exc()))


def run_mode(config):
    """The chain of one mode in this process's children: the result row (without the device
    monitor's figures)."""
    import torch.multiprocessing as mp

    mode = config["mode"]
    if mode in HANDLE_TYPES:
        options = [f"handle_type={HANDLE_TYPES[mode]}"] + (
            [config["vmm_options"]] if config["vmm_options"] else [])
        os.environ[ENABLE_VARIABLE] = ",".join(options)
    elif mode in ("native", "native-cpu"):
        os.environ[ENABLE_VARIABLE] = "0"  # PyTorch's allocator, even with the .pth installed
    else:
        os.environ.pop(ENABLE_VARIABLE, None)
    row = {"mode": mode, "env": {ENABLE_VARIABLE: os.environ.get(ENABLE_VARIABLE)}}
    ctx = mp.get_context("spawn")
    q1, q2 = ctx.Queue(config["depth"]), ctx.Queue(config["depth"])
    results = ctx.Queue()
    start, done = ctx.Event(), ctx.Event()
    queues = {"S": (None, q1), "M": (q1, q2), "R": (q2, None)}
    procs = {role: ctx.Process(target=worker, name=f"chain-{role}",
                               args=(role, config, q_in, q_out, results, start, done))
             for role, (q_in, q_out) in queues.items()}
    for proc in procs.values():
        proc.start()
    messages = {}

    def wait_for(kind, roles, timeout):
        """Waits for a `kind` message of each role; raises on an error message, a process
        that exited, or the timeout."""
        deadline = time.monotonic() + timeout if timeout else None
        exited = False
        while not all((kind, role) in messages for role in roles):
            try:
                got, role, data = results.get(timeout=1.0)
            except queue.Empty:
                gone = [name for name, proc in procs.items()
                        if proc.exitcode is not None and (kind, name) not in messages]
                if gone and not exited:
                    exited = True  # what it wrote before it exited may still be in transit
                    continue
                if gone:
                    raise RuntimeError(f"{gone[0]} exited with code {procs[gone[0]].exitcode} "
                                       f"before its {kind} message")
                if deadline is not None and time.monotonic() > deadline:
                    raise RuntimeError(f"no {kind} message after {timeout} s")
                continue
            if got == "error":
                raise RuntimeError(f"{role} failed:\n{data}")
            messages[(got, role)] = data

    try:
        wait_for("ready", procs, SETUP_TIMEOUT_S)
        start.set()
        wait_for("finished", ["R"], None)  # the caller's --timeout bounds this
        wait_for("sent", ["S"], 60)
        done.set()
        wait_for("stats", procs, STATS_TIMEOUT_S)
    except Exception as error:
        row["error"] = str(error)
    finally:
        done.set()
        for proc in procs.values():
            proc.join(15)
        for proc in procs.values():
            if proc.exitcode is None:
                proc.kill()
                proc.join()
    row["processes"] = {role: messages.get(("stats", role)) for role in procs}
    if ("finished", "R") in messages and ("sent", "S") in messages:
        seconds = (messages[("finished", "R")]["t1_ns"] - messages[("sent", "S")]["t0_ns"]) / 1e9
        total = messages[("finished", "R")]["sum"]
        expected = expected_sum(config["count"], config["numel"], config["limit"])
        row.update(seconds=seconds, tensors_per_s=config["count"] / seconds if seconds else None,
                   sum=total, expected_sum=expected, sum_ok=total == expected)
        if total != expected and "error" not in row:
            row["error"] = f"wrong sum: {total!r}, expected {expected}"
    if mode.startswith("vmm") and "error" not in row:
        # Every tensor S and M sent must have gone as a vmm send, not through PyTorch's reducer.
        for role in ("S", "M"):
            holds = ((row["processes"].get(role) or {}).get("sends") or {}).get("holds", 0)
            if holds < config["count"]:
                row["error"] = (f"{role} made {holds} vmm sends for {config['count']} tensors: "
                                f"the others went through PyTorch's sharing")
    return row


# --- The top level: one subprocess per mode, the device monitor, the report ------------------


class DeviceMonitor:
    """Samples the used memory of the GPU every `interval` seconds in a thread; `peak()` is the
    highest sample since `reset()`."""

    def __init__(self, interval):
        self.interval = interval
        self.source, self._read = self._reader()
        self._lock = threading.Lock()
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    @staticmethod
    def _reader():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible in (None, "0"):  # else NVML's index 0 may not be CUDA's device 0
            try:
                import pynvml

                pynvml.nvmlInit()
                handle = pynvml.nvmlDeviceGetHandleByIndex(0)
                pynvml.nvmlDeviceGetMemoryInfo(handle)
                return "nvml", lambda: int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
            except Exception:  # not installed, or no NVML: the CUDA runtime's figure
                pass

        def used():
            free, total = torch.cuda.mem_get_info(0)
            return int(total - free)

        used()
        return "torch.cuda.mem_get_info", used

    def sample(self):
        return self._read()

    def baseline(self, samples=5):
        """The lowest of a few samples (memory of an ended process may still be going)."""
        values = []
        for _ in range(samples):
            values.append(self.sample())
            time.sleep(self.interval)
        return min(values)

    def reset(self):
        with self._lock:
            self._peak = self.sample()

    def peak(self):
        with self._lock:
            return self._peak

    def _loop(self):
        while not self._stop.wait(self.interval):
            try:
                value = self.sample()
            except Exception:
                continue
            with self._lock:
                self._peak = max(self._peak, value)

    def close(self):
        self._stop.set()
        self._thread.join(1)


def kill_tree(proc):
    """SIGKILL to the process group that `proc` leads: the mode's runner and its
    spawned processes."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def measure(mode, args, monitor):
    """Runs `mode` in a fresh subprocess of this script; its result row."""
    row = {"mode": mode}
    baseline = None
    if monitor is not None and mode in CUDA_MODES:
        baseline = monitor.baseline()
        monitor.reset()
    with tempfile.TemporaryDirectory(prefix="mp_chain_") as tmp:
        result = os.path.join(tmp, "row.json")
        command = [sys.executable, os.path.abspath(__file__), "--run-mode", mode,
                   "--result", result, "--count", str(args.count), "--size", args.size,
                   "--dtype", args.dtype, "--depth", str(args.depth),
                   "--vmm-options", args.vmm_options, "--progress", tmp,
                   "--profile", os.path.abspath(args.profile) if args.profile else ""]
        begin = time.monotonic()
        proc = subprocess.Popen(command, stdout=sys.stderr, start_new_session=True)
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            row["error"] = f"did not finish in {args.timeout} s (its processes were killed)"
            row["timed_out"] = True
            row["progress"] = read_progress(tmp)
        kill_tree(proc)
        proc.wait()
        row["runner_seconds"] = time.monotonic() - begin
        if os.path.exists(result):
            with open(result) as f:
                found = json.load(f)
            found.update((k, v) for k, v in row.items() if k == "error" or k not in found)
            row = found
        elif "error" not in row:
            row["error"] = f"the mode's runner exited with code {proc.returncode} and no result"
    if baseline is not None:
        row["device_baseline_bytes"] = baseline
        row["peak_device_used_bytes"] = max(0, monitor.peak() - baseline)
        row["device_monitor"] = monitor.source
    row["ok"] = "error" not in row and bool(row.get("sum_ok"))
    return row


def per_process_text(row):
    parts = []
    for role, stats in (row.get("processes") or {}).items():
        if not stats:
            continue
        fields = []
        if stats.get("reserved_peak_bytes") is not None:
            fields.append(f"res {size_name(stats['reserved_peak_bytes'])}")
        if stats.get("peak_held_bytes"):
            fields.append(f"held {size_name(stats['peak_held_bytes'])}")
        fields.append(f"rss {size_name(stats.get('max_rss_bytes'))}")
        parts.append(f"{role}: " + ", ".join(fields))
    return "; ".join(parts)


def markdown(rows, args):
    lines = [f"Chain S -> M -> R, {args.count} tensors of {args.size} ({args.dtype}), queue "
             f"depth {args.depth or 'unbounded'}.", "",
             "| mode | N | seconds | tensors/s | peak device used | per-process peaks | "
             "time / native |", "|---|---:|---:|---:|---:|---|---:|"]
    native = {}
    for row in rows:
        if row["ok"] and row["mode"] in ("native", "native-cpu"):
            native[row["mode"] in CPU_MODES] = row["seconds"]
    for row in rows:
        peak = row.get("peak_device_used_bytes")
        peak_text = size_name(peak) if peak is not None else "n/a"
        if row["ok"]:
            base = native.get(row["mode"] in CPU_MODES)
            ratio = f"{row['seconds'] / base:.2f}" if base else ""
            lines.append(f"| {row['mode']} | {args.count} | {row['seconds']:.2f} | "
                         f"{row['tensors_per_s']:.0f} | {peak_text} | {per_process_text(row)} "
                         f"| {ratio} |")
        else:
            if row.get("timed_out"):
                state = f"did not finish in {args.timeout:g} s"
                got = row.get("progress") or {}
                if got:
                    state += " (" + ", ".join(
                        f"{role} {p['done']} in {p['seconds']:.0f} s"
                        for role, p in sorted(got.items())) + ")"
            else:
                error = (row.get("error") or "no result").strip().splitlines()
                reason = error[0] if len(error) == 1 else f"{error[0]} {error[-1]}"
                state = "failed: " + reason.replace("|", "\\|")
            lines.append(f"| {row['mode']} | {args.count} | {state} | | {peak_text} "
                         f"| {per_process_text(row)} | |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="",
                   help=f"comma-separated, of {', '.join(MODES)} (default: the CUDA modes "
                        "where CUDA is available, else the CPU modes)")
    p.add_argument("--count", type=int, default=100000, help="tensors sent through the chain")
    p.add_argument("--size", default="4K", help="bytes of each tensor (4096, 4K, 1M)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--depth", type=int, default=0,
                   help="most tensors waiting on each queue (0: unbounded)")
    p.add_argument("--timeout", type=float, default=600,
                   help="seconds per mode before it is reported as not finished")
    p.add_argument("--vmm-options", default="",
                   help="more vmm options for the CUDA vmm modes, e.g. memory_limit=40G")
    p.add_argument("--sample-ms", type=float, default=20, help="device memory sampling period")
    p.add_argument("--json", default="", help="write the results here as JSON")
    p.add_argument("--markdown", default="", help="write the table here too")
    p.add_argument("--profile", default="",
                   help="folder for each process's cProfile summary (profile-MODE-ROLE.txt); "
                        "the feeder threads' pickling time is then a phase of its own")
    p.add_argument("--run-mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--progress", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        dtype = parse_dtype(args.dtype)
        nbytes = parse_bytes(args.size)
    except ValueError as error:
        p.error(str(error))
    element = torch.empty((), dtype=dtype).element_size()
    if nbytes % element:
        p.error(f"--size {args.size} is not a whole number of {args.dtype} elements")
    if args.count <= 0 or args.depth < 0 or args.timeout <= 0 or args.sample_ms <= 0:
        p.error("--count, --timeout and --sample-ms must be positive, --depth not negative")
    args.numel = nbytes // element
    args.limit = exact_limit(dtype)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    args.mode_list = modes
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.run_mode:  # one mode, in a subprocess of the top level
        config = {"mode": args.run_mode, "count": args.count, "numel": args.numel,
                  "limit": args.limit, "dtype": args.dtype, "depth": args.depth,
                  "vmm_options": args.vmm_options, "progress": args.progress,
                  "profile": args.profile}
        row = run_mode(config)
        with open(args.result, "w") as f:
            json.dump(row, f)
        return 0
    modes = args.mode_list or list(CUDA_MODES if torch.cuda.is_available() else CPU_MODES)
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    monitor = None
    monitor_error = None
    if any(m in CUDA_MODES for m in modes):
        try:
            monitor = DeviceMonitor(args.sample_ms / 1000)
        except Exception as error:
            monitor_error = f"{type(error).__name__}: {error}"
    rows = []
    for mode in modes:
        row = measure(mode, args, monitor)
        rows.append(row)
        state = f"{row['seconds']:.2f} s" if row["ok"] else f"failed: {row.get('error')}"
        print(f"mp_chain: {mode}: {state}", file=sys.stderr, flush=True)
    if monitor is not None:
        monitor.close()
    document = {"bench": "mp_chain", "count": args.count, "size_bytes": args.numel *
                torch.empty((), dtype=getattr(torch, args.dtype)).element_size(),
                "numel": args.numel, "dtype": args.dtype, "depth": args.depth,
                "timeout_s": args.timeout, "torch_version": torch.__version__,
                "imex_channel": os.path.exists(IMEX_CHANNEL),
                "device_monitor": monitor.source if monitor else monitor_error,
                "rows": rows}
    table = markdown(rows, args)
    sys.stdout.write(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1)
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
