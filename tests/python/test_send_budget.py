"""The send budget on the host backend (set_send_budget, VMM_SEND_BUDGET): Queue.put waits
while this process's sends hold more than the budget and receivers keep giving memory back,
which bounds what a producer ahead of its consumer holds; a queue nobody reads never stops a
producer for long; the argument and the variable are checked."""

import os
import pickle
import subprocess
import sys
import time
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing as mp

import vmm_torch
from host_pools import eventually
import vmm_test_workers as workers
from vmm_torch import _lib, sharing

TIMEOUT = 60
MIB = 1 << 20
SMALL = 1024  # float32 elements: 4 KiB; a send that exports its 2 MiB chunk first holds it
DEFAULT_BUDGET = 1 << 30


@pytest.fixture(scope="module", autouse=True)
def reducers():
    vmm_torch.install_reducers()


@pytest.fixture
def budget():
    """Sets this process's send budget for one test, then restores the default."""
    yield vmm_torch.set_send_budget
    vmm_torch.set_send_budget(DEFAULT_BUDGET)



def _over_budget():
    return bool(_lib.quick().vmm_send_over_budget())


def _releases_ran():
    """Whether what acknowledgements and reports gave back has run (see test_send_reuse)."""
    return vmm_torch.wait_for_sends(0) == vmm_torch.send_stats()["held"]


def _settle(released):
    assert sharing.flush_acks(10) == 0
    assert eventually(lambda: vmm_torch.send_stats()["released"] >= released), \
        vmm_torch.send_stats()
    assert eventually(_releases_ran)


def _receive_all(payloads):
    """Receives and drops the sends `payloads` carry, and waits until they are settled."""
    released = vmm_torch.send_stats()["released"]
    received = [pickle.loads(payload) for payload in payloads]
    del received
    _settle(released + len(payloads))


@pytest.mark.parametrize("value", [-1, True, False, 1.5, 2.0 * MIB, "2M", None, 1 << 63,
                                   1 << 64])
def test_set_send_budget_checks_its_argument(budget, value):
    """A whole number of bytes >= 0 that the C call's int64_t holds; anything else is a
    TypeError (2**64 once wrapped to 0: no budget at all)."""
    budget(4 * MIB)
    with pytest.raises(TypeError, match="send budget"):
        vmm_torch.set_send_budget(value)
    # Unchanged: two sends out (4 MiB of chunks) are not over 4 MiB, three are.
    with vmm_torch.Pool("host") as p:
        payloads = []
        for expected_over in (False, False, True):
            payloads.append(ForkingPickler.dumps(p.empty((SMALL,))))
            assert _over_budget() == expected_over, len(payloads)
        _receive_all(payloads)


def test_a_budget_of_zero_is_none(budget):
    budget(0)
    with vmm_torch.Pool("host") as p:
        payloads = [ForkingPickler.dumps(p.empty((SMALL,))) for _ in range(4)]
        assert not _over_budget()
        assert not sharing.wait_for_send_room()
        _receive_all(payloads)


def test_put_to_a_queue_nobody_reads_does_not_wait_on_the_budget(budget):
    """100 puts of 4 KiB tensors with a 2 MiB budget and no reader: over budget from the
    second put on, yet the puts wait for the budget once (SEND_STALL_S, no acknowledgement
    comes) and never again (100 waits would take 10 s). A reader that comes afterwards gets
    every tensor."""
    n = 100
    budget(2 * MIB)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with vmm_torch.Pool("host") as p:
        stats0 = vmm_torch.send_stats()
        started = time.monotonic()
        for i in range(n):
            q.put(p.empty((SMALL,)).fill_(i))
        elapsed = time.monotonic() - started
        assert eventually(lambda: vmm_torch.send_stats()["holds"] == stats0["holds"] + n)
        assert _over_budget()
        assert elapsed < 4.0, f"{n} puts took {elapsed:.1f} s"
        # The reader, late (this process: the same sends, the same acknowledgements).
        for i in range(n):
            t = q.get(timeout=TIMEOUT)
            assert torch.equal(t, torch.full((SMALL,), float(i))), f"tensor {i}"
            del t
        _settle(stats0["released"] + n)
        assert not _over_budget()


def _round(p, jobs, replies, n):
    """Puts n small tensors (value i) as fast as put lets it; returns the consumer's summary."""
    for i in range(n):
        jobs.put(p.empty((SMALL,)).fill_(i))
    jobs.put(None)
    return replies.get(timeout=TIMEOUT)


def test_the_budget_bounds_what_a_producer_ahead_of_its_consumer_holds(budget):
    """A producer puts 60 small tensors as fast as it can to a consumer that takes 20 ms over
    each. Isolating sends, with no budget its pool reserves a chunk per tensor queued (most
    of 60 x 2 MiB); with a 4 MiB budget put waits for the consumer, and the pool stays within
    the budget and a few chunks. In place the same budget bounds it alike: a fresh tensor
    whose chunk an earlier send exported lands in another chunk, and the send that exports a
    chunk first counts all of it (how many share one depends on how far the queue's feeder
    thread lags, so without a budget the peak is anywhere from a chunk to one per tensor).
    Every value arrives each way."""
    n = 60
    ctx = mp.get_context("spawn")
    jobs, replies = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=workers.sum_rounds, args=(jobs, replies, 0.02), daemon=True)
    proc.start()
    try:
        assert replies.get(timeout=TIMEOUT) == "ready"
        peaks = {}
        for isolate, limit in ((True, 0), (True, 4 * MIB), (False, 4 * MIB)):
            budget(limit)
            with vmm_torch.Pool("host", isolate_sends=isolate) as p:
                released = vmm_torch.send_stats()["released"]
                _, count, total, uneven, left = _round(p, jobs, replies, n)
                assert (count, uneven, left) == (n, 0, 0)
                assert total == SMALL * n * (n - 1) / 2
                peaks[isolate, limit] = p.memory_stats()["reserved_bytes.all.peak"]
                _settle(released + n)  # nothing of this round counts in the next
        assert peaks[True, 0] >= 30 * 2 * MIB, peaks
        assert peaks[True, 4 * MIB] <= 4 * MIB + 10 * 2 * MIB, peaks
        assert peaks[False, 4 * MIB] <= 4 * MIB + 10 * 2 * MIB, peaks
        jobs.put("exit")
        proc.join(TIMEOUT)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()


def test_a_tensor_its_sender_keeps_after_the_send_ended_holds_no_budget(budget):
    """A 4 MiB tensor sent in place, received, dropped and reported released by its receiver,
    and kept by its sender: no send holds anything now, so the process is not over a 1 MiB
    budget (else every later put waits while acknowledgements come)."""
    budget(1 * MIB)
    with vmm_torch.Pool("host") as p:
        released = vmm_torch.send_stats()["released"]
        big = p.empty((MIB,)).fill_(1)
        received = pickle.loads(ForkingPickler.dumps(big))
        assert float(received.sum()) == MIB
        del received
        _settle(released + 1)
        stats = vmm_torch.send_stats()
        assert stats["held"] == 0 and stats["awaiting_release"] == 0
        try:
            assert not _over_budget()
        finally:
            del big


_ENV_CHECK = """
import pickle
from multiprocessing.reduction import ForkingPickler
import vmm_torch
from vmm_torch import _lib
vmm_torch.install_reducers()
over = []
with vmm_torch.Pool("host") as p:
    payloads = []
    for _ in range(3):
        payloads.append(ForkingPickler.dumps(p.empty((1024,))))
        over.append(int(_lib.quick().vmm_send_over_budget()))
    received = [pickle.loads(payload) for payload in payloads]
    del received
print(over)
"""


@pytest.mark.parametrize("value,over,warned", [
    ("3M", [0, 1, 1], False),      # two 2 MiB chunks out are over 3 MiB
    ("5000000", [0, 0, 1], False),  # bytes
    ("0", [0, 0, 0], False),       # no budget
    ("lots", [0, 0, 0], True),     # malformed: said, and the default (1 GiB)
])
def test_vmm_send_budget_sets_the_budget(value, over, warned):
    """VMM_SEND_BUDGET, read when the process's state is made: sizes with suffixes, 0 for none;
    a malformed value is said on stderr, naming the variable, and the default is used."""
    env = dict(os.environ, VMM_SEND_BUDGET=value)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(vmm_torch.__file__)))] +
        [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path])
    result = subprocess.run([sys.executable, "-c", _ENV_CHECK], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(over), result.stderr
    assert ("VMM_SEND_BUDGET" in result.stderr) == warned, result.stderr


def test_what_a_receiver_keeps_holds_no_budget(budget):
    """Three 4 KiB tensors of one 2 MiB chunk sent in place and received, and kept by their
    receiver: the first send holds the chunk it exported, the others their blocks; once
    acknowledged they are the receiver's, so the sender is not over a 2 MiB budget (a
    consumer that keeps what it gets must not slow its producer)."""
    budget(2 * MIB)
    with vmm_torch.Pool("host") as p:
        sent = [p.empty((SMALL,)).fill_(i) for i in range(3)]
        payloads = [ForkingPickler.dumps(t) for t in sent]
        assert _over_budget(), "a chunk and two blocks unacknowledged"
        received = [pickle.loads(payload) for payload in payloads]
        assert sharing.flush_acks(10) == 0
        assert eventually(lambda: vmm_torch.send_stats()["held"] == 0)
        assert vmm_torch.send_stats()["awaiting_release"] >= 3
        assert not _over_budget()
        assert [float(t[0]) for t in received] == [0.0, 1.0, 2.0]
        del received, sent
