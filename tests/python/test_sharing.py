"""export_tensor / SharedTensor / import_buffer in one process, on the host backend."""

import gc
import pickle

import pytest
import torch

import vmm_torch
from host_pools import HANDLE_TYPES, filled, next_id, pool  # noqa: F401 (pool: a fixture)
from vmm_torch import FabricBufferDescriptor, PosixFdBufferDescriptor, SharedTensor, sharing

MIB = 1 << 20
DESCRIPTOR_CLASS = {"posix_fd": PosixFdBufferDescriptor, "fabric": FabricBufferDescriptor}


def test_export_describes_the_tensor(pool):
    t = filled(pool, (6, 8))
    shared = vmm_torch.export_tensor(t)
    assert isinstance(shared, SharedTensor)
    assert isinstance(shared.descriptor, DESCRIPTOR_CLASS[pool.handle_type])
    assert shared.descriptor.handle_type == pool.handle_type
    assert shared.dtype == torch.float32
    assert shared.shape == (6, 8) and shared.stride == (8, 1) and shared.storage_offset == 0
    assert shared.device_type == "cpu"
    assert shared.storage_nbytes == 6 * 8 * 4
    assert shared.descriptor.size == shared.storage_nbytes
    assert all(len(h) == 64 for h in shared.descriptor.handles)
    assert shared.descriptor.owner_uuid.startswith("HOST-")
    assert pool.memory_stats()["vmm.num_exports"] >= 1


def test_open_in_the_same_process(pool):
    t = filled(pool, (6, 8))
    opened = vmm_torch.export_tensor(t).open()
    assert opened.dtype == t.dtype and opened.shape == t.shape and opened.stride() == t.stride()
    assert torch.equal(opened, t)
    assert opened.data_ptr() != t.data_ptr()  # a mapping of its own, same memory
    opened[0, 0] = 42.0
    assert float(t[0, 0]) == 42.0
    t[5, 7] = -1.0
    assert float(opened[5, 7]) == -1.0


def test_views_keep_offset_and_strides(pool):
    t = filled(pool, (6, 8))
    view = t[2:, 1::2]  # offset 17, strides (8, 2)
    shared = vmm_torch.export_tensor(view)
    assert shared.storage_offset == view.storage_offset() == 17
    assert shared.stride == (8, 2) and shared.shape == (4, 4)
    opened = pickle.loads(pickle.dumps(shared)).open()
    assert opened.storage_offset() == 17 and opened.stride() == (8, 2)
    assert torch.equal(opened, view)


def math_bit_views(pool):
    """Views of one complex tensor's memory with the conjugate and/or negative bit set."""
    z = pool.zeros((3,), dtype=torch.complex64, shareable=True)
    z.copy_(torch.tensor([1 + 2j, -3j, 4]))
    return {"conj": z.conj(), "neg": torch._neg_view(z), "conj_neg": torch._neg_view(z.conj()),
            "imag_of_conj": z.conj().imag}  # a float32 view with the negative bit


@pytest.mark.parametrize("name", ["conj", "neg", "conj_neg", "imag_of_conj"])
def test_conjugate_and_negative_views_open_with_their_values(pool, name):
    view = math_bit_views(pool)[name]
    shared = vmm_torch.export_tensor(view)
    assert (shared.conj, shared.neg) == (view.is_conj(), view.is_neg())
    assert len(shared.payload) == len(sharing.SEND_PAYLOAD_FIELDS) + 2
    for opened in (shared.open(), pickle.loads(pickle.dumps(shared)).open()):
        assert (opened.is_conj(), opened.is_neg()) == (view.is_conj(), view.is_neg())
        assert torch.equal(opened.resolve_conj().resolve_neg(),
                           view.resolve_conj().resolve_neg())  # was: the values of z
        assert opened.data_ptr() != view.data_ptr()  # a mapping of its own, same memory


def test_payloads_without_math_bits_keep_their_fields_and_bad_bits_are_refused(pool):
    t = filled(pool, (4,))
    assert len(vmm_torch.export_tensor(t).payload) == len(sharing.PAYLOAD_FIELDS)
    state = vmm_torch.export_tensor(math_bit_views(pool)["conj"]).__getstate__()
    for bad, error, match in (((b"x" * 64, True, False), ValueError, "no ticket"),
                              ((None, 1, False), TypeError, "conj"),
                              ((None, True), ValueError, "fields")):
        with pytest.raises(error, match=match):
            SharedTensor.from_payload(state[:8] + bad)
    floats = list(vmm_torch.export_tensor(t).payload) + [None, True, False]
    with pytest.raises(ValueError, match="only complex tensors"):
        SharedTensor.from_payload(floats)
    bools = vmm_torch.export_tensor(pool.zeros((2,), dtype=torch.bool, shareable=True))
    with pytest.raises(ValueError, match="bool"):
        SharedTensor.from_payload(bools.payload + (None, False, True))


def test_pickle_round_trip(pool):
    t = filled(pool, (4, 4), torch.int16)
    shared = vmm_torch.export_tensor(t)
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        again = pickle.loads(pickle.dumps(shared, protocol=protocol))
        assert again == shared
        assert again.dtype == torch.int16 and again.descriptor == shared.descriptor
        assert torch.equal(again.open(), t)
    assert "SharedTensor(" in repr(shared)


def test_mapping_outlives_the_original_and_lives_with_any_view(pool):
    t = filled(pool, (1024,))
    expected = t.clone()
    opened = vmm_torch.export_tensor(t).open()
    del t
    gc.collect()
    pool.empty_cache()
    assert torch.equal(opened, expected)  # the importer holds its own references
    tail = opened[512:]
    del opened
    gc.collect()
    vmm_torch.empty_cache()
    assert torch.equal(tail, expected[512:])  # a view keeps the mapping alive
    tail += 1
    assert float(tail[-1]) == float(expected[-1]) + 1


def test_import_buffer(pool):
    t = filled(pool, (256,), torch.uint8)
    descriptor = vmm_torch.export_tensor(t).descriptor
    with vmm_torch.import_buffer(descriptor) as buf:
        assert buf.ptr != 0 and buf.size == 256 and not buf.closed
        as_bytes = buf.as_tensor()
        assert torch.equal(as_bytes, t)
    assert buf.closed
    buf.close()  # idempotent
    assert torch.equal(as_bytes, t)  # the tensor kept its own reference
    with vmm_torch.import_buffer(descriptor.to_bytes()) as buf2:
        assert buf2.size == 256
    with pytest.raises(ValueError, match="closed"):
        buf2.as_tensor()


def _import_is_open(import_id):
    try:
        sharing.import_info(import_id)
        return True
    except ValueError:  # "no import N"
        return False


def test_imported_buffer_from_an_id_takes_a_reference_of_its_own(pool, capfd):
    """ImportedBuffer(import_id) (public) must never release a reference it did not take: it
    used to adopt one, so closing it unmapped the memory of another live tensor (a crash at
    its next read)."""
    t = filled(pool, (1024,))
    import_id = next_id()
    received = vmm_torch.export_tensor(t).open()  # holds import `import_id`
    assert _import_is_open(import_id)
    for _ in range(3):
        with vmm_torch.ImportedBuffer(import_id) as buf:
            assert buf.size == 1024 * 4 and buf.backend == "host"
            assert torch.equal(buf.as_tensor(torch.float32), t)
        del buf
        gc.collect()
        assert _import_is_open(import_id), "closing the buffer released the tensor's import"
    assert torch.equal(received, t)
    del received
    gc.collect()
    assert not _import_is_open(import_id)  # the tensor's reference was the last
    for bad in (None, "1", 1.5, b"1", True, [import_id]):
        with pytest.raises(TypeError, match="import id"):
            vmm_torch.ImportedBuffer(bad)
    for bad in (0, -1, 2**63, 2**80, import_id, next_id() + 100):
        with pytest.raises(ValueError, match="no import"):
            vmm_torch.ImportedBuffer(bad)
    with pytest.raises(ValueError, match="backend"):
        vmm_torch.ImportedBuffer(next_id(), backend="tpu")
    gc.collect()
    assert "[vmm] error" not in capfd.readouterr().err  # nothing released that was not held


def test_export_of_memory_outside_vmm_is_refused():
    plain = torch.arange(10.0)
    assert not vmm_torch.in_vmm_pool(plain)
    with pytest.raises(ValueError, match="does not belong to a vmm pool"):
        vmm_torch.export_tensor(plain)
    with pytest.raises(TypeError):
        vmm_torch.export_tensor([1, 2, 3])


def test_export_from_a_pool_without_handles_is_refused():
    with vmm_torch.Pool("host", handle_type="none") as p:
        t = p.empty((10,))
        with pytest.raises((vmm_torch.VmmError, ValueError)):
            vmm_torch.export_tensor(t)


@pytest.mark.parametrize("handle_type", HANDLE_TYPES)
def test_stale_descriptor_gives_a_clean_error(handle_type):
    with vmm_torch.Pool("host", handle_type=handle_type) as p:
        t = p.empty((MIB,), dtype=torch.uint8, shareable=True)
        shared = vmm_torch.export_tensor(t)
        del t
        gc.collect()
        p.empty_cache()
        with pytest.raises(vmm_torch.VmmError) as info:
            shared.open()
        assert info.value.code == "NOT_FOUND"
        assert "HOST-" in str(info.value)  # names the owner


def test_forged_descriptor_gives_a_clean_error():
    forged = FabricBufferDescriptor.from_handles([b"\x01" * 64], [2 * MIB],
                                                 owner_uuid="HOST-forged")
    with pytest.raises((vmm_torch.VmmError, ValueError)) as info:
        vmm_torch.import_buffer(forged)
    assert "HOST-forged" in str(info.value)


def test_malformed_shared_tensor_state_is_refused(pool):
    t = filled(pool, (4,))
    state = list(vmm_torch.export_tensor(t).__getstate__())
    for field, value, match in ((1, "not_a_dtype", "dtype"), (1, "__class__", "dtype"),
                                (1, 1000, "dtype"), (5, "meta", "device type"),
                                (5, "cuda:-1", "device type")):
        bad = list(state)
        bad[field] = value
        shared = SharedTensor.__new__(SharedTensor)
        with pytest.raises(ValueError, match=match):
            shared.__setstate__(tuple(bad))
    with pytest.raises(ValueError, match="fields"):
        SharedTensor.from_payload(state[:5])
    with pytest.raises(TypeError, match="descriptor"):
        SharedTensor.from_payload([None] + state[1:])


def test_shared_tensor_pickles_as_the_payload(pool):
    """One payload format: a pickled SharedTensor carries what reduce_tensor sends."""
    from vmm_torch import reductions, sharing

    t = filled(pool, (6, 8))[1:, 2:]
    shared = vmm_torch.export_tensor(t)
    rebuild, payload = shared.__reduce__()
    assert rebuild is sharing.rebuild_shared_tensor and payload == shared.payload
    assert len(payload) == len(sharing.PAYLOAD_FIELDS)
    rebuild_sent, reduced = reductions.reduce_tensor(t)
    # All but the (separately exported) descriptor bytes; a send adds its ticket.
    assert len(reduced) == len(sharing.SEND_PAYLOAD_FIELDS)
    assert payload[1:] == reduced[1:len(payload)]
    assert type(payload[0]) is bytes and payload[0][:4] == b"VMMD"
    opened = sharing.rebuild_tensor(*payload)  # what torch.multiprocessing's receiver runs
    assert torch.equal(opened, t) and opened.stride() == t.stride()
    assert torch.equal(rebuild_sent(*reduced), t)  # the send received, so it ends


def test_no_python_decode_on_the_data_path(pool, monkeypatch):
    """Exporting, pickling, unpickling and opening decode nothing in Python (vmm_import
    decodes once, in C++); reading a descriptor field decodes once."""
    from multiprocessing.reduction import ForkingPickler

    from vmm_torch import descriptors, reductions

    decoded = []
    real = descriptors.decode
    monkeypatch.setattr(descriptors, "decode", lambda data: decoded.append(data) or real(data))
    t = filled(pool, (4,))
    shared = vmm_torch.export_tensor(t)
    again = pickle.loads(pickle.dumps(shared))
    assert torch.equal(again.open(), t)
    rebuild, payload = reductions.reduce_tensor(t)
    assert torch.equal(pickle.loads(ForkingPickler.dumps(Reduced(rebuild, payload))), t)
    assert decoded == []
    assert shared.descriptor.size == 16 and shared.descriptor.backend == "host"
    assert again.storage_nbytes == 16  # from the descriptor
    assert len(decoded) == 2  # once per SharedTensor, kept
    d = FabricBufferDescriptor.from_handles([b"\x01" * 64], [MIB])  # built by C: trusted
    assert len(decoded) == 2 and d.size == MIB and len(decoded) == 3


class Reduced:
    def __init__(self, rebuild, args):
        self.reduced = (rebuild, args)

    def __reduce__(self):
        return self.reduced


def test_legacy_dict_state_still_unpickles(pool):
    t = filled(pool, (2, 2), torch.int16)
    shared = vmm_torch.export_tensor(t)
    state = {"descriptor": shared.descriptor.to_bytes(), "dtype": "int16", "shape": (2, 2),
             "stride": (2, 1), "storage_offset": 0, "device_type": "cpu",
             "storage_nbytes": 8, "device_index": None}
    old = SharedTensor.__new__(SharedTensor)
    old.__setstate__(state)
    assert old == shared and torch.equal(old.open(), t)


def test_import_buffer_backend_argument(pool):
    t = filled(pool, (8,), torch.uint8)
    descriptor = vmm_torch.export_tensor(t).descriptor
    with vmm_torch.import_buffer(descriptor, backend="host") as buf:
        assert buf.backend == "host" and buf.device == -1
    with vmm_torch.import_buffer(descriptor) as buf:  # the descriptor's own backend
        assert buf.backend == "host"
    with pytest.raises(ValueError, match="backend"):
        vmm_torch.import_buffer(descriptor, backend="tpu")
    with pytest.raises(TypeError):
        vmm_torch.import_buffer("not bytes")


# Device arguments that are not devices: ValueError from every function that takes one (torch's
# RuntimeError from torch.device() must not leak out).
BAD_DEVICES = ["tpu", -1, 1.5, "cuda:x", True, False, "cuda:-1", "host:99", "host:0",
               "cuda:1:2", "", 2**31, 2**40, [0], torch.device("meta"), torch.device("cpu", 1),
               "cpu:3", b"cuda", "cuda:99999999999", "meta", "cuda:0 junk", object()]


def _open_with(t, device):
    return vmm_torch.export_tensor(t).open(device=device)


def _import_with(t, device):
    return vmm_torch.import_buffer(vmm_torch.export_tensor(t).descriptor, device=device)


def _import_bytes_with(t, device):
    data = vmm_torch.export_tensor(t).descriptor.to_bytes()
    return vmm_torch.import_buffer(data, device=device)


DEVICE_TAKERS = {  # each called with a shareable tensor of a host pool (kept alive) and device
    "Pool": lambda t, device: vmm_torch.Pool(device),
    "import_buffer": _import_with,
    "import_buffer(bytes)": _import_bytes_with,
    "SharedTensor.open": _open_with,
    "memory_stats": lambda t, device: vmm_torch.memory_stats(device),
    "reset_peak_memory_stats": lambda t, device: vmm_torch.reset_peak_memory_stats(device),
}


@pytest.mark.parametrize("taker", sorted(DEVICE_TAKERS))
@pytest.mark.parametrize("bad", BAD_DEVICES, ids=repr)
def test_bad_device_arguments_are_value_errors(pool, taker, bad):
    t = filled(pool, (4,))
    with pytest.raises(ValueError, match="device"):
        DEVICE_TAKERS[taker](t, bad)


@pytest.mark.parametrize("device", [None, "host", "cpu", " CPU ", torch.device("cpu"),
                                    torch.device("cpu", 0)], ids=repr)
def test_host_device_arguments_of_imports(pool, device):
    t = filled(pool, (4,))
    assert torch.equal(vmm_torch.export_tensor(t).open(device=device), t)
    with _import_with(t, device) as buf:
        assert buf.device == -1


def test_as_tensor_shapes_are_checked(pool):
    t = filled(pool, (16,), torch.uint8)
    with vmm_torch.import_buffer(vmm_torch.export_tensor(t).descriptor) as buf:
        for shape, error in (((10**30,), ValueError), ((2**62, 2**62), ValueError),
                             ((2.5,), TypeError), ((-1,), ValueError), ((17,), ValueError)):
            with pytest.raises(error):
                buf.as_tensor(shape=shape)
        with pytest.raises(TypeError, match="dtype"):
            buf.as_tensor(dtype="uint8")
        assert torch.equal(buf.as_tensor(shape=(4, 4)).view(16), t)


def test_share_memory_leaves_vmm_cpu_memory_in_place(pool):
    """share_memory_() is a no-op for memory that is shared already (PyTorch's rule): for a
    tensor of a shareable host pool and a received (imported) one it must not copy the bytes
    into new shared memory, which would detach the tensor from the processes that map it."""
    t = filled(pool, (64,))
    received = vmm_torch.export_tensor(t).open()
    module = torch.nn.Linear(2, 2, bias=False)
    module.weight.data = pool.empty((2, 2)).fill_(1)
    for tensor in (t, received, t[5:], module.weight):
        where = tensor.data_ptr()
        assert tensor.share_memory_() is tensor
        assert tensor.storage().share_memory_() is not None
        assert tensor.data_ptr() == where
    module.share_memory()
    assert vmm_torch.in_vmm_pool(t) and vmm_torch.in_vmm_pool(module.weight)
    received[0] = -5.0
    assert float(t[0]) == -5.0  # still the same memory


def test_share_memory_moves_what_vmm_cannot_share():
    """Memory vmm cannot send (a pool without handles) and memory outside vmm move to shared
    memory as PyTorch moves them."""
    with vmm_torch.Pool("host", handle_type="none") as private:
        t = private.empty((16,)).fill_(2)
        t.share_memory_()
        assert t.is_shared() and not vmm_torch.in_vmm_pool(t) and t.tolist() == [2.0] * 16
    plain = torch.ones(4)
    plain.share_memory_()
    assert plain.is_shared()
