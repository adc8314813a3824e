"""The explicit pools open in this process, for the statistics dump.

``vmm_torch.pool.Pool`` registers itself here when created and unregisters when closed;
``vmm_torch.allocator.collect_stats`` reads :func:`open_pool_stats`. Both depend on this
module, neither on the other. Pools are held weakly: a pool nobody references any more
drops out. Imports nothing of the package.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, List, Tuple

try:  # typing.Protocol: Python 3.8+
    from typing import Protocol
except ImportError:  # pragma: no cover
    Protocol = object  # type: ignore[assignment,misc]


class RegisteredPool(Protocol):
    """What the registry needs of a pool."""

    @property
    def closed(self) -> bool: ...

    def describe(self) -> Dict[str, Any]: ...


_open_pools: "weakref.WeakValueDictionary[int, RegisteredPool]" = weakref.WeakValueDictionary()
_lock = threading.Lock()


def register(pool_id: int, pool: RegisteredPool) -> None:
    """Records `pool` (open, with id `pool_id`)."""
    with _lock:
        _open_pools[pool_id] = pool


def unregister(pool_id: int) -> None:
    """Forgets the pool with id `pool_id` (closed); no error if unknown."""
    with _lock:
        _open_pools.pop(pool_id, None)


def open_pools() -> List[Tuple[int, RegisteredPool]]:
    """(id, pool) of the registered pools that are still open, by id."""
    with _lock:
        pools = list(_open_pools.items())
    return sorted(((i, p) for i, p in pools if not p.closed), key=lambda item: item[0])


def open_pool_stats() -> Dict[str, Dict[str, Any]]:
    """{pool id: pool.describe()} ({"device", "handle_type", "stats"}) of the open pools."""
    return {str(pool_id): pool.describe() for pool_id, pool in open_pools()}
