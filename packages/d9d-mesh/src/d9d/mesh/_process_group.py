"""The process groups of a distributed `DistributedContext`: the default one and their timeouts.

Creating the default group (with a fresh store namespace per `torchrun --max-restarts` attempt) and
switching every group of the job's meshes between the start-up and the step timeout.
"""

import datetime
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from d9d.mesh._torch_compat import set_group_timeout
from d9d.mesh.errors import RendezvousError

__all__ = ["init_process_group", "set_timeouts"]


def init_process_group(device: torch.device, env: Mapping[str, str], timeout: datetime.timedelta) -> None:
    """Create the default process group for `device`; a rendezvous that fails is a `RendezvousError`."""
    cuda = device.type == "cuda"
    try:
        dist.init_process_group(
            backend="cpu:gloo,cuda:nccl" if cuda else "gloo",
            timeout=timeout,
            # bound to its GPU, NCCL initializes at once and the mesh splits its communicator
            device_id=device if cuda else None,
            **_attempt_store(env, timeout),
        )
    except (dist.DistStoreError, dist.DistNetworkError) as exc:
        where = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
        raise RendezvousError(
            f"rank {env.get('RANK', '?')} could not reach the rendezvous store at {where} within "
            f"{timeout.total_seconds():g} s ({str(exc).splitlines()[0][:160]}); launch every rank "
            "with torchrun (which hosts the store), or check MASTER_ADDR/MASTER_PORT and that rank 0 "
            "is running and reachable from this node"
        ) from None


def set_timeouts(
    meshes: Mapping[str, DeviceMesh], timeout: datetime.timedelta, *, include_default: bool
) -> None:
    """Give every process group of the meshes (flattened ones too) and optionally the default one `timeout`.

    The timeout applies to every backend of a group (gloo and NCCL alike) for the collectives issued
    from now on.
    """
    groups: dict[str, dist.ProcessGroup] = {}
    if include_default:
        default = dist.group.WORLD
        if isinstance(default, dist.ProcessGroup):
            groups[default.group_name] = default
    for mesh in meshes.values():
        # flattened meshes (`mesh[...]._flatten(name)`, as d9d.parallel makes) hang off the root mesh
        flattened = list(getattr(mesh, "_flatten_mapping", {}).values())
        for each in (mesh, *flattened):
            for group in each.get_all_groups():
                groups.setdefault(group.group_name, group)
    for group in groups.values():
        set_group_timeout(timeout, group)


def _attempt_store(env: Mapping[str, str], timeout: datetime.timedelta) -> dict[str, Any]:
    """Under `torchrun --max-restarts`, a store namespace per attempt (else {}: env:// as usual).

    The launcher's store outlives a restart, and process groups created after the default one would
    find the dead attempt's addresses there (gloo: "connectFullMesh failed ... Connection refused").
    """
    attempt = env.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        return {}
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    is_host = env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_host, timeout=timeout)
    return {"store": dist.PrefixStore(f"d9d-attempt-{attempt}/", store), "rank": rank, "world_size": world}
