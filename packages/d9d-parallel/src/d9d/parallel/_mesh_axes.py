"""Reading DeviceMesh axes: which carry gradient synchronization, sizes, sub-meshes."""

from collections.abc import Sequence

from torch.distributed.device_mesh import DeviceMesh

from d9d.parallel.errors import ParallelizeError

#: Axes of d9d's meshes over which parameters are never replicated or sharded by data parallelism
#: (pipeline stages, tensor slices). Context parallelism (`cp`) is a data axis for gradients: its
#: ranks hold different tokens of the same samples, so their gradients are summed like dp's.
NON_DATA_AXES: tuple[str, ...] = ("pp", "tp")


def axis_names(mesh: DeviceMesh) -> tuple[str, ...]:
    """The mesh's axis names; a mesh without names is refused (we address axes by name)."""
    names = mesh.mesh_dim_names
    if names is None:
        raise ParallelizeError(
            "the device mesh has no axis names; build it with init_device_mesh(..., mesh_dim_names=...)"
        )
    return tuple(names)


def axis_size(mesh: DeviceMesh, axis: str) -> int:
    """Size of a named axis of `mesh`."""
    names = axis_names(mesh)
    if axis not in names:
        raise ParallelizeError(f"the device mesh has no axis {axis!r}; its axes are {names}")
    return int(mesh.size(names.index(axis)))


def data_axes(mesh: DeviceMesh) -> tuple[str, ...]:
    """Axes of `mesh` whose ranks sum their gradients (data and context parallel): all but pp and tp."""
    return tuple(a for a in axis_names(mesh) if a not in NON_DATA_AXES)


def sub_mesh(mesh: DeviceMesh, axes: Sequence[str]) -> DeviceMesh:
    """The sub-mesh over `axes` (in mesh order), flattened to one axis when there are several."""
    axes = tuple(axes)
    if len(axes) == 1:
        return mesh if axis_names(mesh) == axes else mesh[axes[0]]
    name = "_".join(axes)
    sliced = mesh if axis_names(mesh) == axes else mesh[axes]
    return sliced._flatten(name)
