"""Sharing tensors between the ranks of a torch.distributed job, without copies.

    import torch.distributed as dist
    import vmm_torch
    import vmm_torch.distributed as vdist

    vmm_torch.enable()                      # before CUDA is used
    dist.init_process_group("gloo")         # or "nccl", after torch.cuda.set_device(local_rank)
    t = torch.randn(1 << 20, device="cuda") if dist.get_rank() == 0 else None
    t = vdist.broadcast(t, src=0)           # every rank: a tensor over rank 0's memory
    parts = vdist.all_gather(my_tensor)     # every rank: every rank's tensor, in rank order

The tensors travel as :class:`~vmm_torch.SharedTensor` descriptors through torch.distributed's
object collectives (``broadcast_object_list``, ``all_gather_object``); there is no transport
of this module's own. Each receiving rank maps the exporter's memory: the result *is* the
exporter's tensor, and writes by any rank are seen by all. Nothing orders those writes across
ranks: synchronise the CUDA streams that wrote and use a collective (``dist.barrier()``)
before another rank reads.

Guarantees, on every rank, when a call returns:

- every rank has imported every buffer it was sent, so exporters may free their tensors;
- or, if any rank failed (a tensor outside a vmm pool, a descriptor that cannot cross nodes,
  a driver error on import), every rank raises the same :class:`DistributedSharingError`,
  naming each failing rank and its reason. The group stays usable.

Backends: any that has the object collectives. With ``nccl`` they move the pickled objects
through CUDA tensors on ``torch.cuda.current_device()``: call ``torch.cuda.set_device`` in
every rank before the first call, and give each rank its own GPU (NCCL refuses two ranks on
one GPU; for several ranks sharing a GPU use ``gloo``).

Nodes: each rank sends its node identity (host name and boot id, :func:`node_identity`) with
its descriptor. Descriptors that name memory of the exporting machine — POSIX-fd descriptors
(tokens naming fds held by the exporting process) and everything exported by vmm's host
backend — cannot be imported on another node; that is reported before importing. CUDA fabric
descriptors may cross nodes: the driver supports importing fabric handles anywhere in one
NVLink domain (with an IMEX channel on every node), but that is untested here.
"""

from __future__ import annotations

import collections
import functools
import socket
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .sharing import SharedTensor, export_tensor

DeviceArg = Union[None, int, str, torch.device]
Offer = Dict[str, Any]

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"

FABRIC_HINT = (
    "use fabric handles (an IMEX channel on every node, and "
    "vmm_torch.enable(handle_type=\"fabric\") or Pool(device, handle_type=\"fabric\")), "
    "or share only between ranks of one node")


class DistributedSharingError(RuntimeError):
    """A collective of this module failed on at least one rank.

    Raised on every rank of the group with the same message. ``operation`` is "broadcast" or
    "all_gather"; ``failures`` maps each failing rank (global rank) to its list of reasons.
    """

    def __init__(self, operation: str, failures: Dict[int, Iterable[str]]) -> None:
        self.operation = operation
        self.failures = {rank: list(reasons) for rank, reasons in sorted(failures.items())}
        super().__init__(_failure_message(operation, self.failures))


def _rank_list(ranks: Iterable[int]) -> str:
    ranks = [str(r) for r in ranks]
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(ranks[:-1]) + " and " + ranks[-1]


def _failure_message(operation: str, failures: Dict[int, List[str]]) -> str:
    lines = [f"vmm_torch.distributed.{operation} failed on {_rank_list(failures)}:"]
    for rank, reasons in failures.items():
        lines.extend(f"  rank {rank}: {reason}" for reason in reasons)
    return "\n".join(lines)


class NodeIdentity(collections.namedtuple("NodeIdentity", "hostname boot_id")):
    """Where a rank runs: its host name and the kernel's boot id (None if unreadable).

    Two ranks are on the same machine when their boot ids match (the kernel is what POSIX
    fds and vmm's tokens are bound to; containers of one machine share it even when their
    host names differ); without boot ids, when their host names match.
    """

    __slots__ = ()

    def same_machine(self, other: "NodeIdentity") -> bool:
        if self.boot_id and other.boot_id:
            return self.boot_id == other.boot_id
        return self.hostname == other.hostname

    def describe(self) -> str:
        boot = f" (boot id {self.boot_id[:8]})" if self.boot_id else ""
        return f"host {self.hostname}{boot}"


@functools.lru_cache(maxsize=None)
def _read_node_identity() -> NodeIdentity:
    try:
        with open(BOOT_ID_PATH) as f:
            boot_id = f.read().strip() or None
    except OSError:
        boot_id = None
    return NodeIdentity(socket.gethostname(), boot_id)


def node_identity() -> NodeIdentity:
    """This process's :class:`NodeIdentity` (read once)."""
    return _read_node_identity()


def _machine_bound_kind(shared: SharedTensor) -> Optional[str]:
    """What ties `shared` to the exporting machine (text for errors), or None for a
    descriptor that can cross nodes (CUDA fabric handles)."""
    if shared.descriptor.handle_type == "posix_fd":
        return "POSIX fd descriptors"
    if shared.device_type != "cuda":
        return "host-backend descriptors (CPU tensors of vmm's host pools)"
    return None


def crossing_error(shared: SharedTensor, exporter_rank: int, exporter_node: NodeIdentity,
                   importer_rank: int, importer_node: NodeIdentity) -> Optional[str]:
    """Why rank `importer_rank` cannot import `shared` from rank `exporter_rank` because
    they are on different nodes, or None when it may try."""
    if exporter_node.same_machine(importer_node):
        return None
    kind = _machine_bound_kind(shared)
    if kind is None:
        return None
    return (f"{kind} cannot cross nodes: rank {exporter_rank} is on "
            f"{exporter_node.describe()}, rank {importer_rank} on {importer_node.describe()}; "
            f"{FABRIC_HINT}")


def _describe_exception(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _require_initialized() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "vmm_torch.distributed needs torch.distributed: call "
            "torch.distributed.init_process_group() first")


def _ranks(group: Any) -> Tuple[int, int]:
    """(global rank, rank in `group`) of this process; ValueError if it is not a member."""
    _require_initialized()
    group_rank = dist.get_rank(group)
    if group_rank < 0:
        raise ValueError("this process is not a member of the given process group")
    return dist.get_rank(), group_rank


def _offer(tensor: Optional[torch.Tensor], what: str) -> Offer:
    """The object this rank sends: its global rank, node and SharedTensor, or the error that
    prevented exporting `tensor` (`what` names the tensor in that error)."""
    offer = {"rank": dist.get_rank(), "node": node_identity(), "shared": None, "error": None}
    if tensor is None:
        offer["error"] = f"{what} is None"
        return offer
    try:
        if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
            # Work queued before the call must have written the memory others will read.
            torch.cuda.synchronize(tensor.device)
        offer["shared"] = export_tensor(tensor)
    except Exception as e:  # sent to the other ranks, raised there and here alike
        offer["error"] = f"cannot export {what}: {_describe_exception(e)}"
    return offer


def _import_device(shared: SharedTensor, device: DeviceArg) -> DeviceArg:
    """The device to map `shared` on: `device` if given; for CUDA tensors this rank's current
    GPU (as torch.distributed's collectives deliver on each rank's own device; the memory
    stays on the exporting GPU and is reached over NVLink when that is another one)."""
    if device is not None or shared.device_type != "cuda":
        return device
    return torch.cuda.current_device()


def _open_offer(offer: Offer, my_rank: int,
                device: DeviceArg) -> Tuple[Optional[torch.Tensor], Optional[str]]:
    """(tensor, None) with `offer`'s tensor imported here, or (None, reason)."""
    shared = offer["shared"]
    here = node_identity()
    reason = crossing_error(shared, offer["rank"], offer["node"], my_rank, here)
    if reason is not None:
        return None, reason
    try:
        return shared.open(_import_device(shared, device)), None
    except Exception as e:
        return None, f"cannot import the tensor of rank {offer['rank']}: {_describe_exception(e)}"


def _agree(operation: str, my_rank: int, reasons: List[str], group: Any) -> None:
    """Collects every rank's failure reasons (the barrier that ends each call) and raises
    DistributedSharingError on all ranks if any rank has one."""
    statuses = [None] * dist.get_world_size(group)
    dist.all_gather_object(statuses, (my_rank, list(reasons)), group=group)
    failures = {rank: rank_reasons for rank, rank_reasons in statuses if rank_reasons}
    if failures:
        raise DistributedSharingError(operation, failures)


def broadcast(tensor: Optional[torch.Tensor] = None, src: int = 0, group: Any = None,
              device: DeviceArg = None) -> Optional[torch.Tensor]:
    """Shares rank `src`'s tensor with every rank of `group`, without copying it.

    On `src`, `tensor` must live in a vmm pool (a CUDA tensor of the enabled allocator, or a
    tensor of a ``vmm_torch.Pool``, CPU tensors of ``Pool("host")`` included); it is
    exported and `src` gets `tensor` itself back. On the other ranks `tensor` is ignored
    (pass None) and the result is a tensor over the same memory with `src`'s dtype, shape,
    strides and storage offset.

    Args:
        tensor: the tensor to share (on `src`).
        src: global rank of the exporter, as in ``torch.distributed.broadcast``.
        group: the process group (default: the world).
        device: CUDA device to map on (ignored for CPU tensors). By default the exporting
            GPU when this rank is on the exporter's machine, else this rank's current GPU.

    Returns when every rank has imported, so `src` may free `tensor` afterwards (importers
    keep their own mappings). Raises DistributedSharingError on every rank if any rank
    failed to export or import. Ranks on another node than `src` may import CUDA fabric
    descriptors (the driver supports it within one NVLink domain; untested here); POSIX-fd
    and host-backend descriptors are refused there before importing.
    """
    my_rank, _ = _ranks(group)
    offers = [_offer(tensor, f"the tensor of rank {src}") if my_rank == src else None]
    dist.broadcast_object_list(offers, src=src, group=group)
    offer = offers[0]
    result, reasons = None, []
    if my_rank == src:
        result = tensor
        if offer["error"]:
            reasons.append(offer["error"])
    elif not offer["error"]:
        result, reason = _open_offer(offer, my_rank, device)
        if reason:
            reasons.append(reason)
    _agree("broadcast", my_rank, reasons, group)
    return result


def all_gather(tensor: torch.Tensor, group: Any = None,
               device: DeviceArg = None) -> List[Optional[torch.Tensor]]:
    """Shares every rank's tensor with every rank of `group`, without copying.

    Each rank's `tensor` must live in a vmm pool; shapes and dtypes may differ between ranks.
    Returns a list in group-rank order: this rank's own `tensor` at its own index, and at
    every other index a tensor over that rank's memory.

    Args:
        tensor: this rank's tensor.
        group: the process group (default: the world).
        device: CUDA device to map on, as in :func:`broadcast`.

    Returns when every rank has imported every buffer, so each rank may free its `tensor`
    afterwards. Raises DistributedSharingError on every rank if any rank failed.
    """
    my_rank, my_index = _ranks(group)
    offers = [None] * dist.get_world_size(group)
    dist.all_gather_object(offers, _offer(tensor, f"the tensor of rank {my_rank}"), group=group)
    results, reasons = [], []
    for index, offer in enumerate(offers):
        if index == my_index:
            results.append(tensor)
            if offer["error"]:
                reasons.append(offer["error"])
            continue
        if offer["error"]:
            results.append(None)
            continue
        imported, reason = _open_offer(offer, my_rank, device)
        results.append(imported)
        if reason:
            reasons.append(reason)
    _agree("all_gather", my_rank, reasons, group)
    return results
