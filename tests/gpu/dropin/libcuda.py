"""The CUDA driver API (libcuda) through ctypes, for the drop-in programs that share memory by
legacy CUDA IPC by hand (cuIpcGetMemHandle of an allocation's base, opened in another
process), as vLLM's and SGLang's custom all-reduce do: the constants they use, the handle
struct, and driver(), the functions by short name."""
import ctypes

CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11
CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12
CU_MEMORYTYPE_DEVICE = 2
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def driver():
    cu = ctypes.CDLL("libcuda.so.1")

    def fn(names, argtypes):
        for name in names:
            f = getattr(cu, name, None)
            if f is not None:
                f.argtypes = argtypes
                f.restype = ctypes.c_int
                return f
        raise RuntimeError(f"libcuda has none of {names}")

    u64 = ctypes.c_uint64
    return {
        "attr": fn(["cuPointerGetAttribute"], [ctypes.c_void_p, ctypes.c_int, u64]),
        "range": fn(["cuMemGetAddressRange_v2", "cuMemGetAddressRange"],
                    [ctypes.POINTER(u64), ctypes.POINTER(ctypes.c_size_t), u64]),
        "get": fn(["cuIpcGetMemHandle"], [ctypes.POINTER(IpcMemHandle), u64]),
        "open": fn(["cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"],
                   [ctypes.POINTER(u64), IpcMemHandle, ctypes.c_uint]),
        "close": fn(["cuIpcCloseMemHandle"], [u64]),
        "dtoh": fn(["cuMemcpyDtoH_v2", "cuMemcpyDtoH"], [ctypes.c_void_p, u64, ctypes.c_size_t]),
        "htod": fn(["cuMemcpyHtoD_v2", "cuMemcpyHtoD"], [u64, ctypes.c_void_p, ctypes.c_size_t]),
    }


def read_and_mark(cu, at, numel, expected, mark):
    """Through memory opened from an IPC handle, at device address `at` (float32 values):
    checks the first and last 16 of `numel` values against expected(i), then writes
    mark + 0..15 over the first 16. Returns what differed, as messages."""
    errs = []
    buf = (ctypes.c_float * 16)()
    for where, first in (("first", 0), ("last", numel - 16)):
        rc = cu["dtoh"](ctypes.addressof(buf), at + 4 * first, 64)
        want = [expected(first + i) for i in range(16)]
        if rc != 0:
            errs.append(f"cuMemcpyDtoH of its {where} values: CUresult {rc}")
        elif list(buf) != want:
            errs.append(f"its {where} 16 values read through the IPC handle are "
                        f"{list(buf)[:4]}..., expected {want[:4]}...")
    values = (ctypes.c_float * 16)(*[mark + i for i in range(16)])
    rc = cu["htod"](at, ctypes.addressof(values), 64)
    if rc != 0:
        errs.append(f"cuMemcpyHtoD through the IPC handle: CUresult {rc}")
    return errs
