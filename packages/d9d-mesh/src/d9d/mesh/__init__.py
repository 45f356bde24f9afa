"""d9d.mesh: parallelism degrees, the distributed context and its device meshes, rank-tagged logs.

    from d9d.mesh import DistributedContext, MeshConfig, configure_logging

    with DistributedContext.from_env(MeshConfig(data_parallel_shard=2)) as ctx:
        configure_logging(ctx)
        mesh = None if ctx.is_local else ctx.mesh("dense")

The names below load on first use (PEP 562): the config, its errors, the layout arithmetic, the launch
check and logging import no torch, so a command that only reads a config or a run directory stays
fast; `DistributedContext`, the device helpers and the collective bandwidth checks (`measure_axes`,
`slow_groups`, `suspect_ranks`: what `d9d preflight` measures per mesh axis) import it. The multi-process test harness lives in
`d9d.mesh.testing` (kept out of this namespace so that importing d9d.mesh never pulls in test
machinery).
"""

from typing import TYPE_CHECKING

from d9d.mesh.lazy import lazy_exports
from d9d.mesh.quiet import quiet_library_notices

quiet_library_notices()

if TYPE_CHECKING:  # what type checkers see; at run time `__getattr__` imports these on first use
    from d9d.mesh.bandwidth import (
        COLLECTIVES,
        CollectiveTiming,
        SlowGroup,
        measure_axes,
        slow_groups,
        suspect_ranks,
    )
    from d9d.mesh.config import AUTO, DEGREE_KEYS, MeshConfig, resolve_auto_degree
    from d9d.mesh.context import DistributedContext, Mode
    from d9d.mesh.device import DEVICE_CHOICES, DeviceChoice, cuda_problem, device_name, resolve_device
    from d9d.mesh.errors import D9dError, LaunchError, MeshConfigError, RendezvousError
    from d9d.mesh.launch import check_launch
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
    from d9d.mesh.text import first_line, format_size

#: Module → the public names it defines (the run-time twin of the imports above; a test keeps them equal).
_EXPORTS: dict[str, tuple[str, ...]] = {
    "bandwidth": (
        "COLLECTIVES",
        "CollectiveTiming",
        "SlowGroup",
        "measure_axes",
        "slow_groups",
        "suspect_ranks",
    ),
    "config": ("AUTO", "DEGREE_KEYS", "MeshConfig", "resolve_auto_degree"),
    "context": ("DistributedContext", "Mode"),
    "device": ("DEVICE_CHOICES", "DeviceChoice", "cuda_problem", "device_name", "resolve_device"),
    "errors": ("D9dError", "LaunchError", "MeshConfigError", "RendezvousError"),
    "launch": ("check_launch",),
    "layout": (
        "DOMAINS",
        "DomainLayout",
        "axis_groups",
        "domain_layout",
        "format_layout",
        "rank_coordinates",
        "rank_tag",
    ),
    "log": ("LogFormat", "configure_logging", "get_logger", "rank_log_path"),
    "text": ("first_line", "format_size"),
}
_MODULE_OF, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())  # PEP 562

__all__ = [
    "AUTO",
    "COLLECTIVES",
    "DEGREE_KEYS",
    "DEVICE_CHOICES",
    "DOMAINS",
    "CollectiveTiming",
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
    "SlowGroup",
    "axis_groups",
    "check_launch",
    "configure_logging",
    "cuda_problem",
    "device_name",
    "domain_layout",
    "first_line",
    "format_layout",
    "format_size",
    "get_logger",
    "measure_axes",
    "rank_coordinates",
    "rank_log_path",
    "rank_tag",
    "resolve_auto_degree",
    "resolve_device",
    "slow_groups",
    "suspect_ranks",
]
