"""The stream of an allocation as vmm's pools take it (the Python side of
``torch_plugin/csrc/pool_stream.h``).

A block keeps the stream it was allocated on while it is cached, and a stream PyTorch does
not own (a ``torch.cuda.ExternalStream``: another library's stream) may be destroyed by its
owner meanwhile. Such a stream goes to vmm with ``VMM_FOREIGN_STREAM_BIT`` (``vmm_c.h``) set,
and vmm then makes no CUDA call on it after the allocation returns.
"""

from __future__ import annotations

from typing import Any

#: VMM_FOREIGN_STREAM_BIT of vmm_c.h.
FOREIGN_STREAM_BIT = 1 << 62


def pool_stream(stream: Any) -> int:
    """The handle of `stream` (a ``torch.cuda.Stream``), marked foreign when it is an
    ExternalStream: c10 gives one its handle as its id (even and not 0), and its own streams
    odd ids (the default stream 0)."""
    handle = int(stream.cuda_stream)
    stream_id = int(getattr(stream, "stream_id", 0))
    if handle > 2 and stream_id != 0 and stream_id % 2 == 0:
        return handle | FOREIGN_STREAM_BIT
    return handle
