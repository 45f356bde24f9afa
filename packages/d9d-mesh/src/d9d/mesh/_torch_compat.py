"""The torch calls of d9d.mesh that differ between the supported torch versions (2.11 to 2.15).

One function per difference; each docstring says which versions differ and how. Code elsewhere in
d9d.mesh calls these instead of checking versions itself.
"""

import datetime

import torch.distributed as dist


def set_group_timeout(timeout: datetime.timedelta, group: dist.ProcessGroup) -> None:
    """Give every backend of `group` (gloo and NCCL alike) `timeout` for the collectives issued next.

    torch 2.14 made it public as `dist.set_timeout`; 2.10 to 2.13 have only the private
    `distributed_c10d._set_pg_timeout` (same arguments), which 2.14 and later deprecate with a warning.
    """
    public = getattr(dist, "set_timeout", None)
    if public is not None:
        public(timeout, group)
    else:
        dist.distributed_c10d._set_pg_timeout(timeout, group)
