"""Reading DeviceMesh axes: which are data-parallel, sizes, sub-meshes, the context-parallel guard."""

from collections.abc import Sequence

from torch.distributed.device_mesh import DeviceMesh

from d9d.parallel.errors import ParallelizeError, UnsupportedParallelismError

#: Axes of d9d's meshes that never carry data parallelism (pipeline stage, context, tensor).
NON_DATA_AXES: tuple[str, ...] = ("pp", "cp", "tp")


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


def check_no_context_parallel(mesh: DeviceMesh, what: str) -> None:
    """Refuse a mesh (or the mesh it was sliced from) whose `cp` axis is larger than 1."""
    meshes = [mesh]
    try:  # a 1-D slice such as dense["dp_shard"] still belongs to the whole job's mesh
        root = mesh._get_root_mesh()
    except AttributeError:  # pragma: no cover - older torch
        root = None
    if root is not None and root is not mesh:
        meshes.append(root)
    for m in meshes:
        names = m.mesh_dim_names or ()
        if "cp" in names and m.size(names.index("cp")) > 1:
            raise UnsupportedParallelismError(
                f"{what}: context parallelism is not supported yet (the mesh has cp="
                f"{m.size(names.index('cp'))}); set mesh.context_parallel to 1"
            )


def data_axes(mesh: DeviceMesh) -> tuple[str, ...]:
    """Axes of `mesh` that may carry data parallelism: all but pp, cp and tp."""
    return tuple(a for a in axis_names(mesh) if a not in NON_DATA_AXES)


def sub_mesh(mesh: DeviceMesh, axes: Sequence[str]) -> DeviceMesh:
    """The sub-mesh over `axes` (in mesh order), flattened to one axis when there are several."""
    axes = tuple(axes)
    if len(axes) == 1:
        return mesh if axis_names(mesh) == axes else mesh[axes[0]]
    name = "_".join(axes)
    sliced = mesh if axis_names(mesh) == axes else mesh[axes]
    return sliced._flatten(name)
