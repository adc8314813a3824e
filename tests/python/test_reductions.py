"""The torch.multiprocessing payload of vmm tensors, in one process, on the host backend:
reduce_tensor's compact payload, its rebuild through ForkingPickler, the wrap_import operator,
and hostile payloads (which must fail cleanly and leave no import behind)."""

import contextlib
import ctypes
import gc
import os
import pickle
import time
import sys
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

import vmm_torch
from host_pools import Reduced, eventually, filled, next_id, pool  # noqa: F401 (pool: a fixture)
from vmm_torch import _lib, _tensors, reductions, sharing

MIB = 1 << 20


# Sends here are received at once or never (hostile payloads the receiver refuses): a short
# lease lets the ones never received end soon after the module (tests/python/conftest.py).
LEASE_S = 5


@contextlib.contextmanager
def send_lease(seconds):
    """The lease of sends made inside, then the lease there was."""
    before = vmm_torch.send_stats()["lease_seconds"]
    vmm_torch.set_send_lease(seconds)
    try:
        yield
    finally:
        vmm_torch.set_send_lease(before)


@pytest.fixture(scope="module", autouse=True)
def reducers():
    vmm_torch.install_reducers()
    with send_lease(LEASE_S):
        yield


def settle_earlier_sends():
    """Waits for this module's earlier sends to be acknowledged or to end with their lease, for
    tests that count the process's sends (one ending meanwhile would change the counts)."""
    assert sharing.flush_acks(5) == 0
    assert vmm_torch.wait_for_sends(LEASE_S + 10) == 0


def round_trip(t):
    return pickle.loads(ForkingPickler.dumps(t))


def import_is_open(import_id):
    ptr, size, device = ctypes.c_uint64(), ctypes.c_size_t(), ctypes.c_int()
    return _lib.vmm().vmm_import_info(import_id, ctypes.byref(ptr), ctypes.byref(size),
                                      ctypes.byref(device)) == 0


def test_payload_is_flat(pool):
    t = filled(pool, (6, 8))
    rebuild, args = reductions.reduce_tensor(t[1:, 2:])
    assert rebuild is reductions.rebuild_tensor_from_bytes is sharing.rebuild_tensor
    assert len(args) == len(sharing.SEND_PAYLOAD_FIELDS)
    descriptor, dtype, shape, stride, offset, device, parameter, requires_grad, ticket = args
    assert type(ticket) is bytes and len(ticket) == 64
    assert type(descriptor) is bytes
    parsed = vmm_torch.BufferDescriptor.from_bytes(descriptor)
    assert parsed.handle_type == pool.handle_type and parsed.size == 6 * 8 * 4
    assert type(dtype) is int and _tensors.dtype_from_code(dtype) == torch.float32
    assert type(shape) is tuple and shape == (5, 6)
    assert stride == (8, 1) and offset == 10 and device == "cpu"
    assert parameter is False and requires_grad is False
    # The payload a pickled SharedTensor carries (one format), with its own rebuild name.
    rebuild_shared, shared_payload = vmm_torch.export_tensor(t[1:, 2:]).__reduce__()
    assert rebuild_shared is sharing.rebuild_shared_tensor
    assert shared_payload[1:] == args[1:len(shared_payload)]
    assert len(ForkingPickler.dumps(t)) < 400


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.uint8, torch.int8, torch.int16, torch.int32,
                                   torch.int64, torch.bool, torch.complex64,
                                   torch.complex128])
def test_round_trip_every_dtype(pool, dtype):
    t = filled(pool, (4, 5), dtype)
    again = round_trip(t)
    assert again.dtype == dtype and again.shape == t.shape and again.stride() == t.stride()
    assert torch.equal(again, t)
    assert again.data_ptr() != t.data_ptr()  # a mapping of its own, same memory
    again.view(torch.uint8)[0, 0] ^= 1
    assert torch.equal(again, t)


def test_dtype_outside_the_table_travels_by_name(pool):
    t = pool.empty((8,), dtype=torch.complex32, shareable=True)
    t.view(torch.int32).copy_(torch.arange(8, dtype=torch.int32))
    _, args = reductions.reduce_tensor(t)
    assert args[1] == "complex32"
    again = round_trip(t)
    assert again.dtype == torch.complex32
    assert torch.equal(again.view(torch.int32), torch.arange(8, dtype=torch.int32))


def test_views_keep_offset_and_strides(pool):
    t = filled(pool, (6, 8))
    for view in (t[2:, 1::2], t.t(), t[5], t[3:3], t.view(48)[7:]):
        again = round_trip(view)
        assert again.shape == view.shape and again.stride() == view.stride()
        assert again.storage_offset() == view.storage_offset()
        assert torch.equal(again, view)
        assert sharing.storage_base(again)[1] == sharing.storage_base(t)[1]


@pytest.mark.skipif(not hasattr(__import__("torch.multiprocessing.reductions").multiprocessing
                            .reductions, "reduce_sparse_tensor"),
                    reason="this PyTorch's reducer sends no sparse tensor")
def test_sparse_tensors_travel_as_their_parts(pool):
    """A sparse tensor goes as PyTorch sends it, its indices and values each through vmm's
    reducer: over vmm memory, they arrive as imports of the sender's blocks."""
    indices = pool.empty((2, 4), dtype=torch.int64, shareable=True)
    indices.copy_(torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]]))
    values = filled(pool, (4,))
    coo = torch.sparse_coo_tensor(indices, values, (4, 4))
    for sent in (coo, coo.to_sparse_csr()):
        again = round_trip(sent)
        assert again.layout == sent.layout
        assert torch.equal(again.to_dense(), sent.to_dense())
    again = round_trip(coo)
    assert sharing.storage_base(again._values())[1] == sharing.storage_base(values)[1]
    assert reductions.prepare_send([coo]), "the dry run reaches the parts"


def test_empty_tensors_travel(pool):
    t = pool.empty((0, 3), shareable=True)
    again = round_trip(t)
    assert again.shape == (0, 3) and again.dtype == t.dtype


def test_mapping_lives_while_any_view_lives(pool):
    t = filled(pool, (1024,))
    expected = t.clone()
    again = round_trip(t)
    del t
    gc.collect()
    pool.empty_cache()
    tail = again[512:]
    del again
    gc.collect()
    vmm_torch.empty_cache()
    assert torch.equal(tail, expected[512:])
    tail += 1
    assert float(tail[-1]) == float(expected[-1]) + 1


def test_parameters_and_requires_grad(pool):
    weight = torch.nn.Parameter(pool.zeros((3, 3)))
    again = round_trip(weight)
    assert isinstance(again, torch.nn.Parameter) and again.requires_grad
    frozen = round_trip(torch.nn.Parameter(pool.zeros((2,)), requires_grad=False))
    assert isinstance(frozen, torch.nn.Parameter) and not frozen.requires_grad
    leaf = pool.zeros((4,)).requires_grad_()
    again = round_trip(leaf)
    assert type(again) is torch.Tensor and again.requires_grad and again.is_leaf
    with pytest.raises(RuntimeError) as error:
        ForkingPickler.dumps(leaf * 2)
    # PyTorch's reducer's words, which programs match.
    assert str(error.value).startswith(
        "Cowardly refusing to serialize non-leaf tensor which requires_grad")


def test_conjugate_and_negative_views_arrive_with_their_values(pool):
    z = pool.zeros((3,), dtype=torch.complex64)
    z.copy_(torch.tensor([1 + 2j, -3j, 4]))
    for view in (z.conj(), torch._neg_view(z), torch._neg_view(z.conj()), z.conj().imag,
                 torch.nn.Parameter(z.conj())):
        rebuild, args = reductions.reduce_tensor(view)
        assert rebuild is sharing.rebuild_tensor
        assert args[len(sharing.PAYLOAD_FIELDS)] is not None  # the ticket, then the bits
        assert args[len(sharing.SEND_PAYLOAD_FIELDS):] == (view.is_conj(), view.is_neg())
        again = rebuild(*args)
        assert (again.is_conj(), again.is_neg()) == (view.is_conj(), view.is_neg())
        assert type(again) is type(view) and again.requires_grad == view.requires_grad
        assert torch.equal(again.resolve_conj().resolve_neg(),
                           view.resolve_conj().resolve_neg())  # was: the values of z
        again = round_trip(view)
        assert torch.equal(again.resolve_conj().resolve_neg(),
                           view.resolve_conj().resolve_neg())
    assert len(reductions.reduce_tensor(z)[1]) == len(sharing.SEND_PAYLOAD_FIELDS)


def test_other_tensors_use_torch_reducers():
    rebuild, _ = reductions.reduce_tensor(torch.arange(4.0))
    assert rebuild.__module__.startswith("torch.")
    # PyTorch's reducer, called by name, is vmm's once installed: its own would ask a
    # pluggable allocator for CUDA IPC handles it cannot give.
    from torch.multiprocessing import reductions as torch_reductions
    assert torch_reductions.reduce_tensor is reductions.reduce_tensor
    rebuild, _ = torch_reductions.reduce_tensor(torch.arange(4.0))
    assert rebuild.__module__.startswith("torch.")
    assert torch.equal(round_trip(torch.arange(4.0)), torch.arange(4.0))
    assert not vmm_torch.in_vmm_pool(torch.eye(3).to_sparse())


def test_a_direct_call_of_torchs_reducer_sends_vmm_memory(pool):
    from torch.multiprocessing import reductions as torch_reductions
    original = filled(pool, (4, 8))
    rebuild, args = torch_reductions.reduce_tensor(original)
    assert rebuild is sharing.rebuild_tensor
    received = rebuild(*args)
    assert torch.equal(received, original)
    assert sharing.flush_acks(5) == 0


def test_imported_tensors_are_forwarded_as_vmm_sends(pool):
    original = filled(pool, (4,))
    again = round_trip(original)
    assert not vmm_torch.in_vmm_pool(again)  # an import, not a pool block
    rebuild, args = reductions.reduce_tensor(again)
    assert rebuild is reductions.rebuild_tensor_from_bytes
    third = rebuild(*args)
    third.add_(1)
    assert torch.equal(original, third) and torch.equal(again, third)


def _payload_args(t):
    """The payload's arguments, as a list to tamper with (keep `t` alive meanwhile)."""
    return list(reductions.reduce_tensor(t)[1])


@pytest.mark.parametrize("field,value,error,match", [
    (0, lambda d: d[: len(d) // 2], ValueError, r"is \d+ bytes, expected"),  # truncated
    (0, lambda d: d[:3], ValueError, "shorter than its 32-byte header"),
    (0, lambda d: b"", ValueError, "0 bytes, shorter than"),
    (0, lambda d: b"\xff" * len(d), ValueError, "magic"),           # not a descriptor
    (0, lambda d: "text", TypeError, "descriptor"),
    (0, lambda d: None, TypeError, "descriptor"),
    (1, lambda d: 99, ValueError, "dtype"),
    (1, lambda d: -1, ValueError, "dtype"),
    (1, lambda d: "no_such_dtype", ValueError, "dtype"),
    (1, lambda d: "__class__", ValueError, "dtype"),   # names are looked up, checked
    (1, lambda d: "Tensor", ValueError, "dtype"),
    (1, lambda d: 1.0, ValueError, "dtype"),
    (5, lambda d: "meta", ValueError, "device type"),
    (5, lambda d: "cuda:-1", ValueError, "device type"),
    (5, lambda d: None, ValueError, "device type"),
    # Checked before the import (test_payload_fuzz.py fuzzes all of this).
    (2, lambda s: "abc", TypeError, "shape is a str"),
    (2, lambda s: (2**64,), ValueError, "does not fit in 64 bits"),
    (2, lambda s: (1.5,), TypeError, "expected an int"),
    (3, lambda s: [None], TypeError, "expected an int"),
    (4, lambda o: None, TypeError, "storage_offset"),
    (4, lambda o: 2**64, ValueError, "does not fit in 64 bits"),
    (2, lambda s: (2**40, 2**40), ValueError, "elements"),
    (6, lambda p: torch.ones(3), TypeError, "parameter"),
    (7, lambda r: "yes", TypeError, "requires_grad"),
])
def test_hostile_payloads_fail_cleanly(pool, field, value, error, match):
    t = filled(pool, (4, 4))
    args = _payload_args(t)
    args[field] = value(args[field])
    payload = ForkingPickler.dumps(Reduced(reductions.rebuild_tensor_from_bytes, tuple(args)))
    with pytest.raises(error, match=match):
        pickle.loads(payload)


@pytest.mark.parametrize("field,value", [
    (2, (4, 5)),             # larger than the buffer
    (2, (1 << 62, 1)),       # overflows the element count of the extent
    (3, (1 << 62, 1 << 62)),  # the strides' reach overflows
    (3, (-4, 1)),
    (4, 1 << 40),
    (4, -1),
    (2, (4,)),               # one size, two strides
])
def test_hostile_views_fail_cleanly_and_release_the_import(pool, field, value):
    t = filled(pool, (4, 4))
    args = _payload_args(t)
    args[field] = value
    payload = ForkingPickler.dumps(Reduced(reductions.rebuild_tensor_from_bytes, tuple(args)))
    import_id = next_id()
    with pytest.raises(ValueError) as info:
        pickle.loads(payload)
    assert not isinstance(info.value, vmm_torch.VmmError)  # the import worked, the view not
    assert next_id() > import_id + 1  # the import took an id ...
    assert not import_is_open(import_id)  # ... and was released



def test_a_sent_tensor_outlives_its_sender_until_received():
    """put-then-delete: the send holds the block until the receiver has imported it."""
    with vmm_torch.Pool("host", handle_type="fabric") as p:
        t = p.empty((MIB,), dtype=torch.uint8)
        t.fill_(7)
        settle_earlier_sends()
        with send_lease(600):  # received below, however slow the machine
            payload = ForkingPickler.dumps(t)
        held = vmm_torch.send_stats()
        assert held["held"] >= 1 and held["held_bytes"] >= MIB
        del t
        gc.collect()
        p.empty_cache()
        received = pickle.loads(payload)
        assert int(received.sum()) == 7 * MIB
        assert sharing.flush_acks(5) == 0
        # Acknowledged: the sender let go.
        assert eventually(lambda: vmm_torch.send_stats()["acked"] == held["acked"] + 1)
        assert vmm_torch.send_stats()["held"] == held["held"] - 1, "ours, and only ours"
        del received


def test_a_send_nobody_receives_ends_with_its_lease_and_goes_stale():
    with vmm_torch.Pool("host", handle_type="fabric") as p:
        settle_earlier_sends()
        before = vmm_torch.send_stats()
        with send_lease(0.3):
            t = p.empty((MIB,), dtype=torch.uint8, shareable=True)
            payload = ForkingPickler.dumps(t)
        del t
        gc.collect()
        assert eventually(lambda: vmm_torch.send_stats()["expired"] == before["expired"] + 1)
        assert vmm_torch.send_stats()["held_bytes"] == before["held_bytes"]
        # The release runs on the ledger's release thread right after the lease ends.
        errors = []

        def stale():
            p.empty_cache()
            try:
                received = pickle.loads(payload)
            except vmm_torch.VmmError as error:
                errors.append(error)
                return True
            del received
            return False

        assert eventually(stale)
        assert errors[0].code == "NOT_FOUND" and "HOST-" in str(errors[0])


@pytest.mark.parametrize("seconds", [1e-10, 1.2e-10, 9e-10, 0, -1, float("nan"), float("inf"),
                                     -float("inf"), 10**400, 2e9])
def test_a_lease_the_library_cannot_apply_is_a_value_error(seconds):
    with send_lease(30):
        with pytest.raises(ValueError, match="lease"):  # was: 1e-10 ignored, 10**400 Overflow
            vmm_torch.set_send_lease(seconds)
        assert vmm_torch.send_stats()["lease_seconds"] == 30.0
        vmm_torch.set_send_lease(sharing.MIN_SEND_LEASE_S)
        assert vmm_torch.send_stats()["lease_seconds"] == sharing.MIN_SEND_LEASE_S
    for wrong in ("5", None, True, [5]):
        with pytest.raises(TypeError, match="lease"):
            vmm_torch.set_send_lease(wrong)


def test_import_info_and_wrap_import(pool):
    t = filled(pool, (16,))
    data = vmm_torch.export_tensor(t).descriptor.to_bytes()
    import_id = sharing.import_descriptor(data)
    ptr, size, device = sharing.import_info(import_id)
    assert ptr != 0 and size == 64 and device == -1
    ops = _lib.load()
    # A failed wrap takes nothing over: the reference is still the caller's.
    with pytest.raises(ValueError, match="needs 68 bytes"):  # bad arguments: ValueError
        ops.wrap_import(import_id, (17,), (1,), 0, torch.float32)
    with pytest.raises(ValueError, match="cannot be wrapped"):
        ops.wrap_import(import_id, (4,), (1,), 0, torch.qint8)
    assert import_is_open(import_id)
    wrapped = ops.wrap_import(import_id, (4, 4), (4, 1), 0, torch.float32)  # takes it over
    assert wrapped.data_ptr() == ptr and wrapped.device.type == "cpu"
    assert torch.equal(wrapped, t.view(4, 4))
    del wrapped
    gc.collect()
    assert not import_is_open(import_id)
    with pytest.raises(RuntimeError, match="no import"):
        ops.wrap_import(import_id, (4,), (1,), 0, torch.float32)


def test_overhead_bench_runs():
    # bench/ is on the path under Bazel (//bench:share_overhead_bench_lib); this finds it when
    # pytest runs from a checkout.
    sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
    import share_overhead_bench

    results = share_overhead_bench.main(["--iters", "3", "--shape", "16,16"])
    assert results["payload_bytes"] < 400 and results["wrap_us"] > 0


def test_requires_grad_on_an_integer_dtype_is_refused_before_the_import(pool):
    t = filled(pool, (4,), torch.int32)
    args = _payload_args(t)
    args[7] = True  # requires_grad: torch cannot have it on int32
    import_id = next_id()
    with pytest.raises(ValueError, match="requires_grad"):
        sharing.rebuild_tensor(*args)
    assert next_id() == import_id + 1  # nothing was imported


def test_ready_keys_name_a_storage_not_only_its_address():
    """The events Queue.put records are found by (address, storage): views of one storage share
    a key, and another live storage has another key."""
    from vmm_torch import sharing

    t = torch.arange(8, dtype=torch.float32)
    base = sharing.storage_address(t)
    assert sharing.ready_key(t, base) == sharing.ready_key(t[2:], base)
    other = torch.zeros(8)
    assert sharing.ready_key(other, base)[1] != sharing.ready_key(t, base)[1]


def test_flat_containers_skip_the_pickler_walk():
    from vmm_torch import reductions

    t = torch.zeros(2)
    assert reductions._flat((1, t, None, "x", 2.5))
    assert reductions._flat([t, t])
    assert not reductions._flat((torch.nn.Parameter(t),))  # a subclass pickles its own way
    assert not reductions._flat(((t,),))                    # nested: the pickler walks it
    assert not reductions._flat(tuple(range(17)))
    assert not reductions._flat({"t": t})

    class Tagged(int):  # a scalar subclass may hold tensors the pickler must reach
        pass

    tagged = Tagged(1)
    tagged.t = t
    assert not reductions._flat((tagged,))


def test_external_streams_are_marked_foreign():
    """An ExternalStream (its id is its handle: even, not 0) goes to vmm's pools marked
    foreign, PyTorch's own streams (odd ids) and the default stream (id 0) as they are."""
    from vmm_torch._streams import FOREIGN_STREAM_BIT, pool_stream

    class FakeStream:
        def __init__(self, handle, stream_id):
            self.cuda_stream, self.stream_id = handle, stream_id

    assert pool_stream(FakeStream(0x7F00_1000, 0x7F00_1000)) == 0x7F00_1000 | FOREIGN_STREAM_BIT
    assert pool_stream(FakeStream(0x7F00_2000, 33)) == 0x7F00_2000
    assert pool_stream(FakeStream(0, 0)) == 0


def _untyped(t):
    return t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage().untyped()


STORAGES = {  # how a test takes a storage of tensor t
    "untyped": _untyped,
    "typed": lambda t: t.storage(),
    "legacy": lambda t: torch.FloatStorage(wrap_storage=_untyped(t)),
}


@pytest.mark.parametrize("how", sorted(STORAGES))
def test_storages_of_vmm_memory_travel_as_sends(pool, how):
    """A storage of vmm memory goes as a send of its bytes, as a tensor over it would (held for
    its receiver): the received storage maps the sender's memory. PyTorch's reducer would copy
    it into new shared memory, which the sender never sees."""
    settle_earlier_sends()
    t = filled(pool, (4, 8))
    storage = STORAGES[how](t)
    received = round_trip(storage)
    assert type(received) is type(storage) and len(received) == len(storage)
    assert getattr(received, "dtype", None) == getattr(storage, "dtype", None)
    assert received.data_ptr() != storage.data_ptr()  # a mapping of its own
    view = torch.empty((0,), dtype=torch.float32).set_(
        received if isinstance(received, torch.TypedStorage)
        else torch.TypedStorage(wrap_storage=received, dtype=torch.float32))
    view[5] = -1.0
    assert float(t.view(-1)[5]) == -1.0  # the receiver wrote into the sender's memory
    assert sharing.flush_acks(5) == 0
    assert vmm_torch.send_stats()["held"] == 0  # received, so acknowledged


def test_storage_sends_withdraw_forward_and_leave_other_storages_to_torch(pool):
    settle_earlier_sends()
    t = filled(pool, (16,))
    untyped = _untyped(t)
    rebuild, args = reductions.reduce_storage(untyped)
    assert rebuild is sharing.rebuild_storage
    assert len(args) == len(sharing.SEND_PAYLOAD_FIELDS)
    forwarded = round_trip(rebuild(*args))  # a received storage, sent on
    torch.empty((0,), dtype=torch.uint8).set_(forwarded)[0] = 0xFF
    assert t.view(torch.uint8)[0] == 0xFF
    # A message that fails to pickle withdraws the storage's send with it.
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        ForkingPickler.dumps((untyped, lambda: None))
    assert sharing.flush_acks(5) == 0
    assert vmm_torch.send_stats()["held"] == 0
    # Storages that are not vmm memory, and an empty one of a pool: PyTorch's reducer.
    from torch.multiprocessing import reductions as torch_reductions
    plain = torch.arange(4.0)
    for storage in (_untyped(plain), plain.storage(), _untyped(pool.empty((0,)))):
        rebuild, _ = reductions.reduce_storage(storage)
        assert rebuild.__module__ == torch_reductions.__name__
    assert round_trip(plain.storage()).tolist() == plain.tolist()


def test_queue_put_prepares_storages():
    """Queue.put prepares the storages it reaches as it prepares tensors: in a pool that
    isolates sends, one that shares its chunk moves to memory of its own in the caller."""
    with vmm_torch.Pool("host", isolate_sends=True) as isolating:
        t = isolating.empty((8,)).fill_(3)
        neighbour = isolating.empty((8,)).fill_(4)
        before = t.data_ptr()
        assert reductions.prepare_send({"weights": [t.storage()]})
        assert t.data_ptr() != before and t.tolist() == [3.0] * 8  # moved, values kept
        assert reductions.prepare_send(_untyped(neighbour))
        assert not reductions.prepare_send({"plain": [torch.arange(3.0).storage()]})
        del t, neighbour


class _NoDryRun(reductions._Preparer):
    def __init__(self):
        raise AssertionError("Queue.put pickled plain data in the caller (a dry run)")


def test_plain_data_skips_the_dry_run(monkeypatch):
    """Queue.put runs no pickling in the caller for data that cannot hold a tensor (a dry run
    would run pickling code twice, and in the caller's thread)."""
    monkeypatch.setattr(reductions, "_Preparer", _NoDryRun)
    plain = {"id": 3, "name": "x", "rows": [(1, 2.5, None, True), {b"k": [frozenset({1})]}],
             "set": {1, 2}, 7: bytearray(b"x")}
    assert not reductions.prepare_send(plain)
    assert not reductions.prepare_send([[]] * 100)
    cycle = []
    cycle.append(cycle)
    for not_plain in ({"t": torch.zeros(1), "n": 1}, [{"deep": (torch.zeros(1),)}],
                      {"big": list(range(reductions.PLAIN_ITEMS_CHECKED + 1))}, cycle,
                      [type("Tagged", (int,), {})(1)], {"k": object()}):
        with pytest.raises(AssertionError, match="dry run"):
            reductions.prepare_send(not_plain)
