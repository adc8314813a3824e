"""Sends reuse their chunks, on the host backend: a receiver reports when it has unmapped a send
(after its import is closed on the closing thread), and the sender's pool takes the export
mark off the chunk (sends in place: its space is free memory again) or keeps it spare for its
next send (isolate_sends: chunks of their own) instead of creating one; either counts in
``vmm.num_export_reuses``. A send forwarded on by its receiver (A -> B -> C) is released
instead, never reused while C maps it; send_stats() counts ``awaiting_release`` and
``released``."""

import pickle
import time
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing as mp

import vmm_torch
import vmm_test_workers as workers
from host_pools import eventually, pool  # noqa: F401 (pool: a fixture)
from vmm_torch import sharing

TIMEOUT = 60
SMALL = 1024  # float32 elements: 4 KiB, a small block (with isolate_sends, moved to a chunk
# of its own)
ISOLATE = [False, True]


@pytest.fixture(scope="module", autouse=True)
def reducers():
    vmm_torch.install_reducers()



def _releases_ran():
    """Whether what acknowledgements and reports gave back has run (the ledger's release
    thread is idle: wait_for_sends counts that beside the sends not acknowledged yet, which
    an earlier test that failed may have left)."""
    return vmm_torch.wait_for_sends(0) == vmm_torch.send_stats()["held"]


def _settled(released):
    """Waits until `released` sends in all were reported released and what the reports
    gave back (SettleExport, on the ledger's release thread) has run."""
    assert eventually(lambda: vmm_torch.send_stats()["released"] >= released), \
        vmm_torch.send_stats()
    assert eventually(_releases_ran)


def _counts(p):
    stats = p.memory_stats()
    return {"reuses": stats["vmm.num_export_reuses"], "creates": stats["vmm.driver_calls.create"],
            "releases": stats["vmm.driver_calls.release"],
            "exported": stats["vmm.exported_chunks.current"]}


def _small(p, value):
    return p.empty((SMALL,)).fill_(value)


@pytest.fixture(autouse=True)
def quiet_ledger():
    """Earlier tests' acknowledgements and reports are sent and settled first."""
    assert sharing.flush_acks(10) == 0
    assert eventually(_releases_ran)


# --- In one process (the receiver is this process: same reports, same ledger) -----------------


@pytest.fixture(params=[(handle_type, isolate) for handle_type in ("posix_fd", "fabric")
                        for isolate in ISOLATE],
                ids=lambda param: f"{param[0]}-{'isolated' if param[1] else 'in_place'}")
def sender(request):
    """A host pool per handle type, sending in place or isolating sends; its `isolated`."""
    handle_type, isolate = request.param
    with vmm_torch.Pool("host", handle_type=handle_type, isolate_sends=isolate) as p:
        p.isolated = isolate
        yield p


def test_a_released_send_chunk_is_reused_for_the_next_send(sender):
    """Each send received, dropped and reported released before the next: every send after
    the first takes the first one's chunk (no chunk created), and carries its own bytes. In
    place, the chunk is free small-arena memory again after each release; isolated, it is
    kept spare."""
    pool = sender
    n = 20
    before, stats0 = _counts(pool), vmm_torch.send_stats()
    for i in range(n):
        t = _small(pool, i)
        payload = ForkingPickler.dumps(t)
        del t
        received = pickle.loads(payload)
        assert torch.equal(received, torch.full((SMALL,), float(i))), f"send {i}"
        del received
        assert sharing.flush_acks(10) == 0  # closes the import, sends the report
        _settled(stats0["released"] + i + 1)
    after, stats = _counts(pool), vmm_torch.send_stats()
    if pool.isolated:
        assert after["reuses"] - before["reuses"] == n - 1
        # The first send: its small block's chunk and the chunk it moved to; nothing after.
        assert after["creates"] - before["creates"] <= 2
        assert after["exported"] == 1, "one chunk, kept spare"
    else:
        assert after["reuses"] - before["reuses"] == n, "each release unmarks the chunk"
        assert after["creates"] - before["creates"] <= 1
        assert after["exported"] == 0, "free memory again"
    assert stats["released"] - stats0["released"] == n
    assert stats["awaiting_release"] == 0 and stats["held"] == 0


def test_a_fresh_large_tensor_each_step_reuses_an_earlier_steps_chunk(pool):
    """A producer that allocates and sends a fresh 96 MiB tensor each step while its receiver
    keeps the previous one until the next arrives: the plain allocation takes the chunk of the
    send before last (spare once its receiver dropped it), so after two chunks nothing is
    created or released, and every received tensor holds its own step's bytes."""
    n = 8
    before, stats0 = _counts(pool), vmm_torch.send_stats()
    kept = None
    for i in range(n):
        t = pool.empty((96 << 20,), dtype=torch.uint8).fill_(i)
        received = pickle.loads(ForkingPickler.dumps(t))
        del t
        assert int(received[0]) == i and int(received[-1]) == i, f"step {i}"
        if kept is not None:
            assert int(kept[0]) == i - 1, "the previous step's tensor changed under its receiver"
        kept = received  # the previous one goes: its import is closed, its report sent
        del received
        assert sharing.flush_acks(10) == 0
        _settled(stats0["released"] + i)
    del kept
    assert sharing.flush_acks(10) == 0
    _settled(stats0["released"] + n)
    after = _counts(pool)
    assert after["creates"] - before["creates"] == 2, after
    assert after["releases"] == before["releases"], after
    assert after["reuses"] - before["reuses"] == n - 2, after


def test_awaiting_release_counts_acknowledged_sends_still_mapped(pool):
    """``awaiting_release``: acknowledged, its receiver still maps it (the chunk is parked,
    not reused); ``released`` once the receiver dropped it and reported."""
    stats0 = vmm_torch.send_stats()
    t = _small(pool, 3)
    received = pickle.loads(ForkingPickler.dumps(t))
    del t
    assert sharing.flush_acks(10) == 0
    assert eventually(lambda: vmm_torch.send_stats()["acked"] == stats0["acked"] + 1)
    stats = vmm_torch.send_stats()
    assert stats["held"] == stats0["held"], "acknowledged: no longer held"
    assert stats["awaiting_release"] == stats0["awaiting_release"] + 1
    assert stats["released"] == stats0["released"]
    # Parked: the next send does not take the chunk the receiver still maps.
    reuses = _counts(pool)["reuses"]
    other = pickle.loads(ForkingPickler.dumps(_small(pool, 4)))
    assert _counts(pool)["reuses"] == reuses
    assert torch.equal(received, torch.full((SMALL,), 3.0))
    del received, other
    assert sharing.flush_acks(10) == 0
    _settled(stats0["released"] + 2)
    stats = vmm_torch.send_stats()
    assert stats["awaiting_release"] == stats0["awaiting_release"]
    assert stats["released"] == stats0["released"] + 2


@pytest.mark.parametrize("isolate", ISOLATE)
def test_a_stale_payload_of_a_reused_chunk_is_refused(isolate):
    """A chunk reused for a later send gets a fresh id and fds: the earlier send's payload,
    unpickled again, fails as stale (posix_fd) instead of mapping the later send's bytes.
    (Fabric handles name the memory itself: a replayed fabric payload maps the reused chunk.)"""
    with vmm_torch.Pool("host", handle_type="posix_fd", isolate_sends=isolate) as p:
        stats0 = vmm_torch.send_stats()
        t = _small(p, 1)
        first = ForkingPickler.dumps(t)
        del t
        received = pickle.loads(first)
        del received
        assert sharing.flush_acks(10) == 0
        _settled(stats0["released"] + 1)
        reuses = _counts(p)["reuses"]
        t = _small(p, 2)
        second = ForkingPickler.dumps(t)
        # In place the first chunk was unmarked (reused) at the release, and holds t now.
        assert _counts(p)["reuses"] == reuses + (1 if isolate else 0), \
            "the second send took the first's chunk"
        with pytest.raises(vmm_torch.VmmError) as info:
            pickle.loads(first)
        assert info.value.code == "NOT_FOUND" and "stale" in str(info.value)
        received = pickle.loads(second)
        assert torch.equal(received, torch.full((SMALL,), 2.0))
        del received, t
        assert sharing.flush_acks(10) == 0
        _settled(stats0["released"] + 2)


def test_empty_cache_releases_spare_chunks(sender):
    """Spare chunks (isolated sends) and chunks free again (in place) are cache: empty_cache
    releases them (nothing exported, nothing reserved afterwards)."""
    pool = sender
    stats0 = vmm_torch.send_stats()
    # Three sends out at once: three chunks (one, in place), spare or free once all are
    # released.
    tensors = [_small(pool, i) for i in range(3)]
    payloads = [ForkingPickler.dumps(t) for t in tensors]
    del tensors
    received = [pickle.loads(payload) for payload in payloads]
    del received
    assert sharing.flush_acks(10) == 0
    _settled(stats0["released"] + 3)
    assert _counts(pool)["exported"] == (3 if pool.isolated else 0)
    assert pool.memory_stats()["reserved_bytes.all.current"] > 0
    pool.empty_cache()
    assert _counts(pool)["exported"] == 0
    assert pool.memory_stats()["reserved_bytes.all.current"] == 0


def test_spare_export_bytes_zero_turns_the_reuse_off():
    """Pool option spare_export_bytes=0 (with isolated sends: a chunk each): a released send's
    chunk is released, each send creates its chunk."""
    with vmm_torch.Pool("host", spare_export_bytes=0, isolate_sends=True) as p:
        stats0 = vmm_torch.send_stats()
        for i in range(5):
            received = pickle.loads(ForkingPickler.dumps(_small(p, i)))
            assert float(received[0]) == i
            del received
            assert sharing.flush_acks(10) == 0
            _settled(stats0["released"] + i + 1)
        counts = _counts(p)
        assert counts["reuses"] == 0 and counts["exported"] == 0
        assert counts["releases"] >= 5


def test_a_send_forwarded_in_this_process_is_released_not_reused(pool):
    """An import sent on (A -> B -> C, all here): when B drops it, its chunk is released (B
    reported "forwarded"), not kept spare; C still reads A's values after A's next send."""
    stats0 = vmm_torch.send_stats()
    t = _small(pool, 5)
    b = pickle.loads(ForkingPickler.dumps(t))
    del t
    c = pickle.loads(ForkingPickler.dumps(b))  # forwarded, no copy
    del b
    assert sharing.flush_acks(10) == 0
    assert eventually(lambda: vmm_torch.send_stats()["awaiting_release"] ==
                       stats0["awaiting_release"])
    assert eventually(_releases_ran)
    assert vmm_torch.send_stats()["released"] == stats0["released"], "not counted"
    assert _counts(pool)["exported"] == 0, "released, not spare"
    later = pickle.loads(ForkingPickler.dumps(_small(pool, 6)))
    assert torch.equal(c, torch.full((SMALL,), 5.0))
    assert torch.equal(later, torch.full((SMALL,), 6.0))
    del c, later
    assert sharing.flush_acks(10) == 0
    _settled(stats0["released"] + 1)


# --- Across processes -------------------------------------------------------------------------


@pytest.mark.parametrize("isolate", ISOLATE)
def test_small_sends_to_a_consumer_reuse_a_few_chunks(isolate):
    """200 tensors of 4 KiB, one after another, to a consumer that reads, drops and
    acknowledges each (lock-step): most sends reuse a chunk, the pool creates a few, every
    send is reported released, and the consumer sums every value right (each reused chunk
    carries the new tensor's bytes)."""
    n = 200
    ctx = mp.get_context("spawn")
    jobs, replies = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=workers.sum_rounds, args=(jobs, replies, 0.0, True), daemon=True)
    proc.start()
    try:
        assert replies.get(timeout=TIMEOUT) == "ready"
        with vmm_torch.Pool("host", isolate_sends=isolate) as p:
            before, stats0 = _counts(p), vmm_torch.send_stats()
            for i in range(n):
                jobs.put(_small(p, i))
                assert replies.get(timeout=TIMEOUT) == SMALL * i, f"tensor {i}"
            jobs.put(None)
            _, count, total, uneven, left = replies.get(timeout=TIMEOUT)
            assert (count, uneven, left) == (n, 0, 0)
            assert total == SMALL * n * (n - 1) / 2
            _settled(stats0["released"] + n)
            after, stats = _counts(p), vmm_torch.send_stats()
            assert stats["released"] - stats0["released"] == n
            assert stats["awaiting_release"] == stats0["awaiting_release"]
            assert after["reuses"] - before["reuses"] >= n // 2, after
            assert after["creates"] - before["creates"] <= n // 4, after
        jobs.put("exit")
        proc.join(TIMEOUT)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()


@pytest.mark.parametrize("isolate", ISOLATE)
def test_a_forwarded_send_is_not_reused_while_its_last_receiver_maps_it(isolate):
    """A -> B -> C, B sending on the tensor it received: once B dropped it, A releases the
    chunk instead of reusing it (``released`` does not count it); A's later sends through B
    reuse chunks, and C, keeping its tensor, still reads A's first values."""
    ctx = mp.get_context("spawn")
    ab, bc, from_b, to_c, from_c = (ctx.Queue() for _ in range(5))
    b = ctx.Process(target=workers.forward_first, args=(ab, bc, from_b), daemon=True)
    c = ctx.Process(target=workers.keep_and_read, args=(bc, to_c, from_c), daemon=True)
    b.start()
    c.start()
    try:
        with vmm_torch.Pool("host", isolate_sends=isolate) as p:
            before, stats0 = _counts(p), vmm_torch.send_stats()
            ab.put(_small(p, 7))
            assert from_b.get(timeout=TIMEOUT) == 7 * SMALL
            assert from_c.get(timeout=TIMEOUT) == [7.0] * SMALL
            # B's import closes once C acknowledged; B reports "forwarded", A releases.
            assert eventually(lambda: vmm_torch.send_stats()["awaiting_release"] ==
                               stats0["awaiting_release"]), vmm_torch.send_stats()
            assert eventually(_releases_ran)
            assert vmm_torch.send_stats()["released"] == stats0["released"]
            counts = _counts(p)
            assert counts["exported"] == 0 and counts["releases"] > before["releases"], \
                "the forwarded chunk was released, not kept spare"
            for i in range(10):
                ab.put(_small(p, 100 + i))
                assert from_b.get(timeout=TIMEOUT) == (100 + i) * SMALL
                _settled(stats0["released"] + i + 1)
            to_c.put("read")
            assert from_c.get(timeout=TIMEOUT) == [7.0] * SMALL
            after = _counts(p)
            # Isolated: the first takes a new chunk, the others it once spare; in place,
            # every release takes the mark off the chunk the sends share.
            assert after["reuses"] - before["reuses"] == (9 if isolate else 10), after
            assert vmm_torch.send_stats()["released"] - stats0["released"] == 10
        ab.put(None)
        to_c.put(None)
        b.join(TIMEOUT)
        c.join(TIMEOUT)
        assert (b.exitcode, c.exitcode) == (0, 0)
    finally:
        for proc in (b, c):
            if proc.is_alive():
                proc.kill()
