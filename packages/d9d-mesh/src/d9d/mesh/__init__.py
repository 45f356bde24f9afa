"""d9d.mesh: parallelism degrees, the distributed context and its device meshes, rank-tagged logs.

    from d9d.mesh import DistributedContext, MeshConfig, configure_logging

    with DistributedContext.from_env(MeshConfig(data_parallel_shard=2)) as ctx:
        configure_logging(ctx)
        mesh = None if ctx.is_local else ctx.mesh("dense")

The multi-process test harness lives in `d9d.mesh.testing` (kept out of this namespace so that
importing d9d.mesh never pulls in test machinery).
"""

from d9d.mesh.config import DEGREE_KEYS, MeshConfig
from d9d.mesh.context import DistributedContext, Mode
from d9d.mesh.device import DEVICE_CHOICES, DeviceChoice, cuda_problem, device_name, resolve_device
from d9d.mesh.errors import D9dError, LaunchError, MeshConfigError, RendezvousError
from d9d.mesh.layout import (
    DOMAINS,
    DomainLayout,
    axis_groups,
    domain_layout,
    format_layout,
    rank_coordinates,
    rank_tag,
)
from d9d.mesh.log import LogFormat, configure_logging, get_logger, rank_log_path

__all__ = [
    "DEGREE_KEYS",
    "DEVICE_CHOICES",
    "DOMAINS",
    "D9dError",
    "DeviceChoice",
    "DistributedContext",
    "DomainLayout",
    "LaunchError",
    "LogFormat",
    "MeshConfig",
    "MeshConfigError",
    "Mode",
    "RendezvousError",
    "axis_groups",
    "configure_logging",
    "cuda_problem",
    "device_name",
    "domain_layout",
    "format_layout",
    "get_logger",
    "rank_coordinates",
    "rank_log_path",
    "rank_tag",
    "resolve_device",
]
