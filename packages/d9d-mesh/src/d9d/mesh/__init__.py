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

from d9d.mesh.lazy import lazy_face
from d9d.mesh.quiet import quiet_library_notices

quiet_library_notices()

if TYPE_CHECKING:  # the public names, listed once: `lazy_face` reads this block
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
        format_ranks,
        rank_coordinates,
        rank_tag,
    )
    from d9d.mesh.log import LogFormat, configure_logging, get_logger, rank_log_path
    from d9d.mesh.text import first_line, format_size, one_line

__all__, __getattr__, __dir__ = lazy_face(__name__, globals())
