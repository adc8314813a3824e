"""The ctypes declaration of vmm's C interface (torch_plugin/vmm_c.h): one list.

Every function of vmm_c.h is declared here, with its restype and argtypes, and so are its
enums and structs (``vmm_descriptor_fields``, ``vmm_send_stats``, the statistics and snapshot
structs). tests/python/test_signatures.py parses the
header and checks this module against it: the same functions, argument counts and compatible
types, the same struct fields, the same enum values. Change both together.

Conventions: a string or buffer the library returns for the caller to release
(vmm_release_buffer) is declared as ``c_void_p`` (so that ctypes does not copy and lose the
pointer); ``const char*`` results the library keeps (vmm_last_error) are ``c_char_p``. Byte
arguments (``const uint8_t*``) are ``c_char_p``: Python passes ``bytes``, NULs included, with
the length beside them.

This module imports nothing of the package (the bottom layer).
"""

import ctypes
from typing import Dict, List, Optional, Tuple, Type

# --- Enums (the header's values) -----------------------------------------------------------

#: enum vmm_status_code: absl::StatusCode by value, as the names the Python errors carry.
STATUS_CODE_NAMES: Dict[int, str] = {
    0: "OK",
    1: "CANCELLED",
    2: "UNKNOWN",
    3: "INVALID_ARGUMENT",
    4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND",
    6: "ALREADY_EXISTS",
    7: "PERMISSION_DENIED",
    8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION",
    10: "ABORTED",
    11: "OUT_OF_RANGE",
    12: "UNIMPLEMENTED",
    13: "INTERNAL",
    14: "UNAVAILABLE",
    15: "DATA_LOSS",
    16: "UNAUTHENTICATED",
}
STATUS_CODES: Dict[str, int] = {name: code for code, name in STATUS_CODE_NAMES.items()}
OK = STATUS_CODES["OK"]
UNKNOWN = STATUS_CODES["UNKNOWN"]
INVALID_ARGUMENT = STATUS_CODES["INVALID_ARGUMENT"]
NOT_FOUND = STATUS_CODES["NOT_FOUND"]
RESOURCE_EXHAUSTED = STATUS_CODES["RESOURCE_EXHAUSTED"]
FAILED_PRECONDITION = STATUS_CODES["FAILED_PRECONDITION"]
UNAVAILABLE = STATUS_CODES["UNAVAILABLE"]

#: enum vmm_backend.
BACKEND_DEFAULT = 0
BACKEND_CUDA = 1
BACKEND_HOST = 2
BACKEND_NAMES: Dict[int, str] = {BACKEND_CUDA: "cuda", BACKEND_HOST: "host"}
BACKENDS: Dict[str, int] = {name: code for code, name in BACKEND_NAMES.items()}

#: enum vmm_handle_type.
HANDLE_NONE = 0
HANDLE_POSIX_FD = 1
HANDLE_FABRIC = 2
HANDLE_TYPE_NAMES: Dict[int, str] = {
    HANDLE_NONE: "none",
    HANDLE_POSIX_FD: "posix_fd",
    HANDLE_FABRIC: "fabric",
}

#: VMM_HANDLE_BYTES: bytes of one descriptor handle.
HANDLE_BYTES = 64

# The enums as the header names them, for the test that compares the two.
ENUMS: Dict[str, Dict[str, int]] = {
    "vmm_status_code": {f"VMM_{name}": code for code, name in STATUS_CODE_NAMES.items()},
    "vmm_backend": {
        "VMM_BACKEND_DEFAULT": BACKEND_DEFAULT,
        "VMM_BACKEND_CUDA": BACKEND_CUDA,
        "VMM_BACKEND_HOST": BACKEND_HOST,
    },
    "vmm_handle_type": {
        "VMM_HANDLE_NONE": HANDLE_NONE,
        "VMM_HANDLE_POSIX_FD": HANDLE_POSIX_FD,
        "VMM_HANDLE_FABRIC": HANDLE_FABRIC,
    },
}
#: enum vmm_send_kind.
SEND_NOT_VMM = 0
SEND_IN_PLACE = 1
SEND_RELOCATE = 2
SEND_IMPORT = 3
SEND_NOT_EXPORTABLE = 4
ENUMS["vmm_send_kind"] = {
    "VMM_SEND_NOT_VMM": SEND_NOT_VMM,
    "VMM_SEND_IN_PLACE": SEND_IN_PLACE,
    "VMM_SEND_RELOCATE": SEND_RELOCATE,
    "VMM_SEND_IMPORT": SEND_IMPORT,
    "VMM_SEND_NOT_EXPORTABLE": SEND_NOT_EXPORTABLE,
}

#: enum vmm_stat_type: the index into a vmm_torch_stats array (PyTorch's StatType).
STAT_ALL = 0
STAT_SMALL = 1
STAT_LARGE = 2
STAT_TYPES = 3
ENUMS["vmm_stat_type"] = {
    "VMM_STAT_ALL": STAT_ALL,
    "VMM_STAT_SMALL": STAT_SMALL,
    "VMM_STAT_LARGE": STAT_LARGE,
    "VMM_STAT_TYPES": STAT_TYPES,
}
#: enum vmm_block_state, and the names torch.cuda.memory._snapshot() gives the states.
BLOCK_INACTIVE = 0
BLOCK_ACTIVE_ALLOCATED = 1
BLOCK_ACTIVE_PENDING_FREE = 2
BLOCK_STATE_NAMES: Dict[int, str] = {
    BLOCK_INACTIVE: "inactive",
    BLOCK_ACTIVE_ALLOCATED: "active_allocated",
    BLOCK_ACTIVE_PENDING_FREE: "active_pending_free",
}
ENUMS["vmm_block_state"] = {
    "VMM_BLOCK_INACTIVE": BLOCK_INACTIVE,
    "VMM_BLOCK_ACTIVE_ALLOCATED": BLOCK_ACTIVE_ALLOCATED,
    "VMM_BLOCK_ACTIVE_PENDING_FREE": BLOCK_ACTIVE_PENDING_FREE,
}

#: VMM_TICKET_BYTES: bytes of a send's ticket.
TICKET_BYTES = 64

DEFINES: Dict[str, int] = {"VMM_HANDLE_BYTES": HANDLE_BYTES, "VMM_TICKET_BYTES": TICKET_BYTES}


# --- Struct ----------------------------------------------------------------------------------


class DescriptorFields(ctypes.Structure):
    """struct vmm_descriptor_fields, as vmm_descriptor_decode fills it (release it with
    vmm_descriptor_fields_release). ``owner_uuid`` is read with its length (it may hold
    NULs), hence a plain pointer."""

    _fields_ = [
        ("handle_type", ctypes.c_int32),
        ("backend", ctypes.c_int32),
        ("count", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("offset", ctypes.c_uint64),
        ("handles", ctypes.POINTER(ctypes.c_uint8)),
        ("sizes", ctypes.POINTER(ctypes.c_uint64)),
        ("owner_uuid", ctypes.c_void_p),
        ("owner_uuid_len", ctypes.c_uint64),
    ]


class SendStats(ctypes.Structure):
    """struct vmm_send_stats, as vmm_send_stats_get fills it."""

    _fields_ = [
        ("held", ctypes.c_uint64),
        ("held_bytes", ctypes.c_uint64),
        ("peak_held_bytes", ctypes.c_uint64),
        ("holds", ctypes.c_uint64),
        ("acked", ctypes.c_uint64),
        ("expired", ctypes.c_uint64),
        ("lease_seconds", ctypes.c_double),
        ("awaiting_release", ctypes.c_uint64),
        ("released", ctypes.c_uint64),
    ]


class Stat(ctypes.Structure):
    """struct vmm_stat: one statistic as PyTorch counts it."""

    _fields_ = [
        ("current", ctypes.c_int64),
        ("peak", ctypes.c_int64),
        ("allocated", ctypes.c_int64),
        ("freed", ctypes.c_int64),
    ]


_StatTypes = Stat * STAT_TYPES

#: The vmm_stat arrays of vmm_torch_stats (indexed by STAT_ALL, STAT_SMALL, STAT_LARGE), in the
#: struct's order; their names are torch.cuda.memory_stats()' keys.
TORCH_STAT_NAMES = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
                    "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
#: Its counters, in the struct's order.
TORCH_COUNTER_NAMES = ("num_alloc_retries", "num_ooms", "num_sync_all_streams",
                       "num_device_alloc", "num_device_free")


class TorchStats(ctypes.Structure):
    """struct vmm_torch_stats: PyTorch's DeviceStats, as vmm_device_torch_stats and
    vmm_pool_torch_stats fill it."""

    _fields_ = (
        [(name, _StatTypes) for name in TORCH_STAT_NAMES]
        + [(name, ctypes.c_int64) for name in TORCH_COUNTER_NAMES]
        + [("oversize_allocations", Stat), ("oversize_segments", Stat),
           ("max_split_size", ctypes.c_int64)]
    )


class BlockEntry(ctypes.Structure):
    """struct vmm_block_entry: one block of a snapshot or of vmm_pool_live_blocks."""

    _fields_ = [
        ("address", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("requested_size", ctypes.c_uint64),
        ("stream", ctypes.c_uint64),
        ("state", ctypes.c_int),
    ]


class SegmentEntry(ctypes.Structure):
    """struct vmm_segment_entry: one segment of vmm_snapshot_get, with its blocks."""

    _fields_ = [
        ("device", ctypes.c_int),
        ("pool", ctypes.c_int64),
        ("address", ctypes.c_uint64),
        ("total_size", ctypes.c_uint64),
        ("allocated_size", ctypes.c_uint64),
        ("active_size", ctypes.c_uint64),
        ("requested_size", ctypes.c_uint64),
        ("stream", ctypes.c_uint64),
        ("is_large", ctypes.c_int),
        ("num_blocks", ctypes.c_size_t),
        ("blocks", ctypes.POINTER(BlockEntry)),
        ("mempool_id", ctypes.c_uint64 * 2),
    ]


class SnapshotEntries(ctypes.Structure):
    """struct vmm_snapshot_entries: what vmm_snapshot_get returns (release it with
    vmm_snapshot_entries_release)."""

    _fields_ = [
        ("num_segments", ctypes.c_size_t),
        ("segments", ctypes.POINTER(SegmentEntry)),
    ]


class MappingEvent(ctypes.Structure):
    """struct vmm_mapping_event: a range a pool mapped or unmapped (vmm_set_mapping_callback's
    callback gets one; a C callback: one in Python would take the GIL under a pool's lock)."""

    _fields_ = [
        ("device", ctypes.c_int),
        ("mempool_id", ctypes.c_uint64 * 2),
        ("address", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("mapped", ctypes.c_int),
    ]


#: vmm_mapping_fn.
MappingFn = ctypes.CFUNCTYPE(None, ctypes.POINTER(MappingEvent), ctypes.c_void_p)


#: C struct name -> its ctypes.Structure.
STRUCTS: Dict[str, Type[ctypes.Structure]] = {
    "vmm_descriptor_fields": DescriptorFields,
    "vmm_send_stats": SendStats,
    "vmm_stat": Stat,
    "vmm_torch_stats": TorchStats,
    "vmm_block_entry": BlockEntry,
    "vmm_segment_entry": SegmentEntry,
    "vmm_snapshot_entries": SnapshotEntries,
    "vmm_mapping_event": MappingEvent,
}


# --- Functions -------------------------------------------------------------------------------

_int = ctypes.c_int
_int64 = ctypes.c_int64
_uint64 = ctypes.c_uint64
_size_t = ctypes.c_size_t
_void_p = ctypes.c_void_p
_char_p = ctypes.c_char_p
_P = ctypes.POINTER

CType = Optional[type]
Signature = Tuple[CType, List[type]]

#: name: (restype, argtypes) of every function of vmm_c.h, in the header's order.
SIGNATURES: Dict[str, Signature] = {
    # Errors, backend, buffers, sizes.
    "vmm_last_error_code": (_int, []),
    "vmm_last_driver_error": (_int, []),
    "vmm_last_error": (_char_p, []),
    "vmm_default_backend": (_int, []),
    "vmm_release_buffer": (None, [_void_p]),
    "vmm_parse_byte_size": (_int, [_char_p, _P(ctypes.c_uint64)]),
    "vmm_check_pool_options": (_int, [_char_p]),
    # Device pools.
    "vmm_configure": (_int, [_char_p]),
    "vmm_alloc": (_void_p, [_size_t, _int, _void_p]),
    "vmm_free": (_int, [_void_p, _int]),
    "vmm_record_stream": (_int, [_void_p, _void_p]),
    "vmm_empty_cache": (_int, [_int]),
    "vmm_set_memory_fraction": (_int, [ctypes.c_double, _int]),
    "vmm_device_hold": (_int, [_int, _int64]),
    "vmm_device_hold_allocated": (_int, [_int, _int64]),
    "vmm_stats_json": (_void_p, [_int]),
    "vmm_reset_peak_stats": (_int, [_int]),
    "vmm_reset_accumulated_stats": (_int, [_int]),
    "vmm_snapshot_json": (_void_p, []),
    # Explicit pools.
    "vmm_pool_create": (_int64, [_int, _int, _char_p]),
    "vmm_pool_destroy": (_int, [_int64]),
    "vmm_pool_alloc": (_void_p, [_int64, _size_t, _void_p, _int]),
    "vmm_pool_empty_cache": (_int, [_int64]),
    "vmm_pool_stats_json": (_void_p, [_int64]),
    "vmm_pool_handle_type": (_int, [_int64]),
    "vmm_pool_set_no_split": (_int, [_int64]),
    "vmm_pool_device": (_int, [_int64]),
    "vmm_block_free": (None, [_void_p]),
    "vmm_owns": (_int, [_void_p]),
    # Statistics and snapshots as structs.
    "vmm_device_torch_stats": (_int, [_int, _P(TorchStats)]),
    "vmm_device_usage": (_int, [_int, _P(_int64), _P(_int64)]),
    "vmm_thread_growths": (_uint64, []),
    "vmm_set_mapping_callback": (_int, [_void_p, _void_p]),
    "vmm_pool_torch_stats": (_int, [_int64, _P(TorchStats)]),
    "vmm_device_largest_free_block": (_int, [_int, _P(_uint64)]),
    "vmm_snapshot_get": (_int, [_P(_P(SnapshotEntries))]),
    "vmm_snapshot_entries_release": (None, [_P(SnapshotEntries)]),
    # Private pools.
    "vmm_private_pool_use": (_int64, [_int, _int, _uint64, _uint64, _char_p]),
    "vmm_private_pool_release": (_int, [_int, _uint64, _uint64]),
    "vmm_private_pool_use_count": (_int, [_int, _uint64, _uint64]),
    "vmm_private_pool_find": (_int64, [_int, _uint64, _uint64]),
    "vmm_pool_live_blocks": (_int64, [_int64, _P(BlockEntry), _size_t]),
    "vmm_pool_alloc_at": (_void_p, [_int64, _uint64, _size_t, _void_p]),
    # Sharing.
    "vmm_export": (_int, [_void_p, _P(_void_p), _P(_size_t)]),
    "vmm_import": (_int64, [_char_p, _size_t, _int, _int, _int]),
    "vmm_import_info": (_int, [_int64, _P(ctypes.c_uint64), _P(_size_t), _P(_int)]),
    "vmm_import_retain": (_int, [_int64]),
    "vmm_import_release": (None, [_void_p]),
    "vmm_send_kind": (_int, [_void_p]),
    "vmm_send_prepare": (_int, [_void_p]),
    "vmm_alloc_beside": (_void_p, [_void_p, _size_t, _void_p]),
    "vmm_export_send": (_int, [_void_p, _P(_void_p), _P(_size_t), _char_p]),
    "vmm_send_ack": (_int, [_char_p, _size_t]),
    "vmm_send_ack_later": (_int, [_char_p, _size_t]),
    "vmm_send_cancel": (_int, [_char_p, _size_t]),
    "vmm_send_thread_token": (_int64, []),
    "vmm_send_withdraw_token": (_int64, [_int64]),
    "vmm_send_held_except": (_int64, [_P(_int64), _size_t]),
    "vmm_send_received": (_int, [_int64, _char_p, _size_t]),
    "vmm_send_check": (_int, [_char_p, _size_t]),
    "vmm_send_set_budget": (_int, [_int64]),
    "vmm_send_over_budget": (_int, []),
    "vmm_send_wait_for_room": (_int, [ctypes.c_double]),
    "vmm_send_ack_flush": (_int64, [ctypes.c_double]),
    "vmm_imports_hold_closing": (_int, []),
    "vmm_imports_release_closing": (_int, []),
    "vmm_send_set_lease": (_int, [ctypes.c_double]),
    "vmm_send_stats_get": (_int, [_P(SendStats)]),
    "vmm_send_wait": (_int64, [ctypes.c_double]),
    "vmm_descriptor_decode": (_int, [_char_p, _size_t, _P(DescriptorFields)]),
    "vmm_descriptor_fields_release": (None, [_P(DescriptorFields)]),
    "vmm_descriptor_from_handles": (
        _int,
        [_int, _P(_char_p), _P(_size_t), _P(_int64), _size_t, _int64, _char_p, _int64,
         _P(_void_p), _P(_size_t)],
    ),
}


def declare(library: ctypes.CDLL) -> None:
    """Sets restype and argtypes of every function of SIGNATURES on `library` (a ctypes
    handle of libvmm.so). A missing symbol raises AttributeError naming it."""
    for name, (restype, argtypes) in SIGNATURES.items():
        function = getattr(library, name)
        function.restype = restype
        function.argtypes = argtypes
