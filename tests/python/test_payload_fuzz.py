"""Property-based fuzzing of the payload a receiver unpickles (hypothesis, bounded and
derandomised): random and mutated payload tuples through vmm_torch.sharing.rebuild_tensor
(what unpickling a torch.multiprocessing payload calls) and through unpickling a
SharedTensor and opening it.

Each payload either gives a tensor whose storage is the imported buffer and whose view lies
inside it, or raises ValueError, TypeError, VmmError or OverflowError: never another
exception, never a crash; and no import is left open afterwards (imports are counted by
probing the ids the library handed out meanwhile with vmm_import_info: the C interface has
no import count).
"""

import ctypes
import gc
import pickle
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import vmm_torch
from host_pools import Reduced, next_id
from vmm_torch import _lib, _tensors, sharing

ALLOWED = (ValueError, TypeError, vmm_torch.VmmError, OverflowError)
FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


def open_imports(first, last):
    """{import id: (ptr, size)} of the imports among ids [first, last) that are open."""
    found = {}
    for import_id in range(first, last):
        ptr, size, device = ctypes.c_uint64(), ctypes.c_size_t(), ctypes.c_int()
        if _lib.vmm().vmm_import_info(import_id, ctypes.byref(ptr), ctypes.byref(size),
                                      ctypes.byref(device)) == 0:
            found[import_id] = (ptr.value, size.value)
    return found


@pytest.fixture(scope="module")
def exported():
    """Real payloads of live tensors of a posix_fd and a fabric host pool (kept alive)."""
    pools = [vmm_torch.Pool("host", handle_type=h) for h in ("posix_fd", "fabric")]
    tensors = []
    payloads = []
    for pool in pools:
        t = pool.empty((6, 8), dtype=torch.float32, shareable=True)
        t.copy_(torch.arange(48, dtype=torch.float32).view(6, 8))
        z = pool.zeros((4, 3), dtype=torch.complex64, shareable=True)
        tensors += [t, z]
        # With the conjugate and negative bits, the payloads have their trailing fields.
        for view in (t, t[1:, 2::2], z.conj(), torch._neg_view(t[2:])):
            payloads.append(tuple(vmm_torch.export_tensor(view).payload))
    yield payloads
    del tensors
    for pool in pools:
        pool.close()


# --- Strategies ------------------------------------------------------------------------------

INTERESTING = [0, 1, 2, 3, 4, 7, 8, 31, 32, 63, 64, 65, 255, 4096, 2**20, 2**21, 2**31 - 1,
               2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -1, -2**63,
               -2**63 - 1, 10**30, -10**30]
WRONG_TYPES = st.sampled_from([None, 1.5, float("nan"), float("inf"), "12", b"12", True,
                               False, [], {}, {"a": 1}, object.__name__, (1, (2,)),
                               bytearray(b"x")])
INTS = st.one_of(st.integers(-4, 64), st.sampled_from(INTERESTING),
                 st.integers(-2**70, 2**70))


@st.composite
def mutated_descriptor(draw, data):
    """Descriptor bytes mutated from real ones: bit flips, bytes and little-endian integers
    written at random offsets (counts, sizes, lengths), truncation, extension, splicing."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "byte", "u32", "u64", "truncate", "extend",
                                   "splice"]))
        if not out:
            out = bytearray(data)
        pos = draw(st.integers(0, len(out) - 1))
        if op == "flip":
            out[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "byte":
            out[pos] = draw(st.integers(0, 255))
        elif op in ("u32", "u64"):
            width = 4 if op == "u32" else 8
            value = draw(st.sampled_from(INTERESTING)) % (1 << (8 * width))
            out[pos:pos + width] = struct.pack("<I" if width == 4 else "<Q", value)
        elif op == "truncate":
            del out[pos:]
        elif op == "extend":
            out += draw(st.binary(min_size=1, max_size=80))
        else:
            out[pos:pos + draw(st.integers(0, 16))] = draw(st.binary(max_size=16))
    return bytes(out)


def descriptors(data):
    return st.one_of(
        st.just(data),
        mutated_descriptor(data),
        mutated_descriptor(data),
        mutated_descriptor(data),
        st.binary(max_size=300),
        st.just(bytearray(data)),
        st.just(memoryview(data)),
        st.sampled_from([None, "VMMD", 0, [1, 2], b""]),
    )


DTYPES = st.one_of(
    st.integers(0, len(_tensors.DTYPE_NAMES) - 1),
    st.integers(-3, 40),
    st.sampled_from(["float32", "complex32", "qint8", "quint4x2", "float", "half", "bool",
                     "Tensor", "__class__", "_C", "dtype", "no_such", "", "float32 ",
                     "bits8"]),
    WRONG_TYPES,
)


def view_list(base):
    return st.one_of(
        st.just(base),
        st.lists(INTS, max_size=5).map(tuple),
        st.lists(st.integers(0, 9), min_size=len(base), max_size=len(base)).map(tuple),
        st.lists(st.one_of(INTS, WRONG_TYPES), max_size=4),
        st.lists(st.just(1), min_size=65, max_size=70),
        WRONG_TYPES,
    )


DEVICES = st.one_of(
    st.sampled_from(["cpu", "cuda", "cuda:0", "cuda:1", "cuda:-1", "cuda:99999999999", "meta",
                     "", "CPU", "host", " cpu", "cpu:0"]),
    st.text(max_size=8),
    WRONG_TYPES,
    st.integers(-2, 3),
)
FLAGS = st.one_of(st.booleans(), st.booleans(), WRONG_TYPES, st.integers(-1, 2),
                  st.just(torch.ones(3)))


TICKETS = st.one_of(st.none(), st.binary(min_size=64, max_size=64), st.binary(max_size=70),
                    WRONG_TYPES)


@st.composite
def payloads(draw, real):
    base = list(draw(st.sampled_from(real)))
    # Trailing fields (ticket, conj, neg) dropped or added: lengths 6 to 12.
    length = draw(st.one_of(st.just(len(base)), st.integers(6, 12)))
    while len(base) < length:
        base.append(draw(TICKETS if len(base) == 8 else FLAGS))
    del base[length:]
    fields = draw(st.sets(st.integers(0, len(base) - 1), max_size=len(base)))
    strategies = {
        0: descriptors(base[0]),
        1: DTYPES,
        2: view_list(base[2]),
        3: view_list(base[3]),
        4: st.one_of(INTS, WRONG_TYPES),
        5: DEVICES,
        6: FLAGS,
        7: FLAGS,
        8: TICKETS,
    }
    for field in sorted(fields):
        base[field] = draw(strategies.get(field, FLAGS))
    return tuple(base)


# --- Properties ------------------------------------------------------------------------------


def check_tensor(tensor, imports):
    """`tensor`'s storage is the one import made for it, and its view lies inside."""
    assert len(imports) == 1, imports
    ((ptr, size),) = imports.values()
    base, nbytes = sharing.storage_base(tensor)
    assert (base, nbytes) == (ptr, size)
    if tensor.numel():
        last = tensor.storage_offset() + sum((n - 1) * s for n, s in
                                             zip(tensor.shape, tensor.stride()))
        assert 0 <= tensor.storage_offset() and (last + 1) * tensor.element_size() <= size
        tensor.view(-1) if tensor.is_contiguous() else tensor.clone()  # readable


def run_payload(rebuild):
    first = next_id()
    tensor = None
    try:
        tensor = rebuild()
    except ALLOWED:
        pass
    if tensor is not None:
        check_tensor(tensor, open_imports(first, next_id()))
        del tensor
    if open_imports(first, next_id()):  # a cycle may hold it still (a full collection is slow)
        gc.collect()
    assert open_imports(first, next_id()) == {}, "an import was left open"


@FUZZ
@given(data=st.data())
def test_rebuild_tensor_takes_any_payload(exported, data):
    payload = data.draw(payloads(exported))
    try:
        message = pickle.dumps(Reduced(sharing.rebuild_tensor, payload))
    except (pickle.PicklingError, TypeError):  # memoryview: the call directly
        run_payload(lambda: sharing.rebuild_tensor(*payload))
        return
    run_payload(lambda: pickle.loads(message))


@FUZZ
@given(data=st.data())
def test_unpickling_and_opening_a_shared_tensor_takes_any_payload(exported, data):
    payload = data.draw(payloads(exported))
    try:
        message = pickle.dumps(Reduced(sharing.rebuild_shared_tensor, payload))
    except (pickle.PicklingError, TypeError):
        return

    def load_and_open():
        shared = pickle.loads(message)
        assert isinstance(shared, vmm_torch.SharedTensor)
        repr(shared)  # decodes the descriptor: its errors are allowed ones too
        return shared.open()

    run_payload(load_and_open)


def test_real_payloads_rebuild(exported):
    """The unmutated payloads give tensors (the fuzz's baseline works)."""
    for payload in exported:
        run_payload(lambda: sharing.rebuild_tensor(*payload))
        assert sharing.rebuild_tensor(*payload).shape == payload[2]


@pytest.mark.parametrize("drop", ["descriptor", "dtype", "shape", "stride", "storage_offset",
                                  "device_type"])
def test_legacy_state_without_a_key_is_a_value_error(exported, drop):
    data, code, shape, stride, offset, device = exported[0][:6]
    state = {"descriptor": data, "dtype": "float32", "shape": shape, "stride": stride,
             "storage_offset": offset, "device_type": device}
    del state[drop]
    with pytest.raises(ValueError, match=drop):
        vmm_torch.SharedTensor.__new__(vmm_torch.SharedTensor).__setstate__(state)
