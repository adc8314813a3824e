"""The ctypes declaration of vmm's C interface (torch_plugin/vmm_c.h): one list.

Every function of vmm_c.h is declared here, with its restype and argtypes, and so are its
enums and the struct ``vmm_descriptor_fields``. tests/python/test_signatures.py parses the
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


#: C struct name -> its ctypes.Structure.
STRUCTS: Dict[str, Type[ctypes.Structure]] = {"vmm_descriptor_fields": DescriptorFields,
                                              "vmm_send_stats": SendStats}


# --- Functions -------------------------------------------------------------------------------

_int = ctypes.c_int
_int64 = ctypes.c_int64
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
    "vmm_last_error": (_char_p, []),
    "vmm_default_backend": (_int, []),
    "vmm_release_buffer": (None, [_void_p]),
    "vmm_parse_byte_size": (_int, [_char_p, _P(ctypes.c_uint64)]),
    # Device pools.
    "vmm_configure": (_int, [_char_p]),
    "vmm_alloc": (_void_p, [_size_t, _int, _void_p]),
    "vmm_free": (_int, [_void_p, _int]),
    "vmm_record_stream": (_int, [_void_p, _void_p]),
    "vmm_empty_cache": (_int, [_int]),
    "vmm_set_memory_fraction": (_int, [ctypes.c_double, _int]),
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
    "vmm_pool_device": (_int, [_int64]),
    "vmm_block_free": (None, [_void_p]),
    "vmm_owns": (_int, [_void_p]),
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
    "vmm_send_received": (_int, [_int64, _char_p, _size_t]),
    "vmm_send_check": (_int, [_char_p, _size_t]),
    "vmm_send_set_budget": (_int, [_int64]),
    "vmm_send_over_budget": (_int, []),
    "vmm_send_wait_for_room": (_int, [ctypes.c_double]),
    "vmm_send_ack_flush": (_int64, [ctypes.c_double]),
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
