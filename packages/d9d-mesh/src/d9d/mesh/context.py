"""`DistributedContext`: the process group, the device meshes and this process's place in them.

One object answers every "where am I" question of a job: local mode (one plain process, no process
group), a real distributed run under torchrun, or planning mode (any world size simulated in one
process on a fake process group, to validate and print a layout without GPUs).
"""

import datetime
import os
from collections.abc import Mapping
from types import TracebackType
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from d9d.mesh._process_group import init_process_group, set_timeouts
from d9d.mesh.config import MeshConfig
from d9d.mesh.device import device_name, resolve_device
from d9d.mesh.errors import D9dError, LaunchError
from d9d.mesh.launch import check_launch, mismatch_message
from d9d.mesh.layout import DOMAINS, domain_layout, format_layout, rank_coordinates, rank_tag

__all__ = ["DistributedContext", "Mode"]

Mode = Literal["local", "distributed", "planning"]

_DEFAULT_INIT_TIMEOUT = datetime.timedelta(minutes=10)
_DEFAULT_STEP_TIMEOUT = datetime.timedelta(minutes=10)


class DistributedContext:
    """Where this process sits in the job: ranks, device, process group and device meshes.

    Build it with `DistributedContext.from_env(config)` (local or torchrun) or
    `DistributedContext.for_planning(config)`. The meshes are named domains (see `d9d.mesh.DOMAINS`):
    `dense` (pp, dp_replicate, dp_shard, cp, tp), `expert` (pp, ep_replicate, ep_shard),
    `batch` (pp, dp, cp, tp) and `world`. In local mode there is no mesh; ranks read 0 and sizes 1.
    Use it as a context manager (or call `close()`) so the process group is destroyed on exit.
    """

    def __init__(
        self,
        config: MeshConfig,
        *,
        mode: Mode,
        rank: int,
        local_rank: int,
        local_world_size: int,
        device: torch.device,
        meshes: Mapping[str, DeviceMesh] | None,
        owns_process_group: bool,
        step_timeout: datetime.timedelta,
    ) -> None:
        self._config = config
        self._mode: Mode = mode
        self._rank = rank
        self._local_rank = local_rank
        self._local_world_size = local_world_size
        self._device = device
        self._meshes = dict(meshes) if meshes is not None else None
        self._owns_process_group = owns_process_group
        self._step_timeout = step_timeout
        self._coords = rank_coordinates(config, rank)
        self._device_name = device_name(device)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_env(
        cls,
        config: MeshConfig | None = None,
        *,
        device: str = "auto",
        init_timeout: datetime.timedelta = _DEFAULT_INIT_TIMEOUT,
        step_timeout: datetime.timedelta = _DEFAULT_STEP_TIMEOUT,
        device_type: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> "DistributedContext":
        """Build the context for this process from `config` and the torchrun environment.

        The launch is checked against the mesh before anything is initialized or written: the number
        of processes must equal `config.world_size`, and the device must be usable. All degrees 1
        (and one process) gives local mode. If a process group already exists (e.g. created by
        `d9d.mesh.testing`), it is used.

        Args:
            device: "auto" (cuda when usable, else cpu), "cuda" (an error where no GPU is usable)
                or "cpu". Rank `LOCAL_RANK` computes on `cuda:<LOCAL_RANK>`.
            init_timeout: process-group timeout while the job starts (rendezvous, loading).
            step_timeout: timeout that `use_step_timeout()` switches to once training runs.
            device_type: deprecated alias of `device`.
            environ: environment to read (default `os.environ`).

        Raises:
            LaunchError: the launch does not match the mesh, or the device cannot be used.
        """
        config = config if config is not None else MeshConfig()
        env = os.environ if environ is None else environ
        device = _merge_device_alias(device, device_type)
        launched_world, launched_by = check_launch(config, env)
        torchrun = launched_by == "torchrun"
        if config.is_local:
            chosen = resolve_device(device, local_rank=0, torchrun=torchrun, environ=env)
            _select(chosen)
            return cls(
                config,
                mode="local",
                rank=0,
                local_rank=0,
                local_world_size=1,
                device=chosen,
                meshes=None,
                owns_process_group=False,
                step_timeout=step_timeout,
            )
        return cls._join_process_group(
            config,
            device,
            env=env,
            launched_world=launched_world,
            torchrun=torchrun,
            init_timeout=init_timeout,
            step_timeout=step_timeout,
        )

    @classmethod
    def _join_process_group(
        cls,
        config: MeshConfig,
        device: str,
        *,
        env: Mapping[str, str],
        launched_world: int,
        torchrun: bool,
        init_timeout: datetime.timedelta,
        step_timeout: datetime.timedelta,
    ) -> "DistributedContext":
        """The distributed half of `from_env`: pick the device, create or adopt the group, build meshes."""
        local_rank = int(env.get("LOCAL_RANK", "0"))
        local_world_size = int(env.get("LOCAL_WORLD_SIZE", str(launched_world)))
        owns = not dist.is_initialized()
        if device == "auto" and not owns and "nccl" not in str(dist.get_backend()):
            device = "cpu"  # a group made for CPU tensors (e.g. the test harness's gloo): stay with it
        chosen = resolve_device(device, local_rank=local_rank, torchrun=torchrun, environ=env)
        _select(chosen)
        if owns:
            init_process_group(chosen, env, init_timeout)
        elif dist.get_world_size() != config.world_size:
            raise LaunchError(
                f"the existing process group has {dist.get_world_size()} ranks but the mesh "
                f"({config.describe_degrees()}) needs {config.world_size}"
            )
        meshes = _build_meshes(config, chosen.type)
        set_timeouts(meshes, init_timeout, include_default=False)
        return cls(
            config,
            mode="distributed",
            rank=dist.get_rank(),
            local_rank=local_rank,
            local_world_size=local_world_size,
            device=chosen,
            meshes=meshes,
            owns_process_group=owns,
            step_timeout=step_timeout,
        )

    @classmethod
    def for_planning(
        cls, config: MeshConfig, *, world_size: int | None = None, rank: int = 0
    ) -> "DistributedContext":
        """Simulate `rank` of a job with `config` in this one process, on a fake process group.

        Meshes, domains and coordinates are those of the real job; collectives return garbage, so use
        it to validate a config and inspect its layout, never to compute. Close it when done.
        """
        if world_size is not None and world_size != config.world_size:
            raise LaunchError(mismatch_message(config, world_size, "the plan", {}))
        if not 0 <= rank < config.world_size:
            raise LaunchError(f"rank {rank} does not exist in a mesh of {config.world_size} ranks")
        if dist.is_initialized():
            raise D9dError("planning mode needs a process without a process group; close the other first")
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=config.world_size)
        return cls(
            config,
            mode="planning",
            rank=rank,
            local_rank=rank,
            local_world_size=config.world_size,
            device=torch.device("cpu"),
            meshes=_build_meshes(config, "cpu"),
            owns_process_group=True,
            step_timeout=_DEFAULT_STEP_TIMEOUT,
        )

    @classmethod
    def single_process(cls, device: str | torch.device = "cpu") -> "DistributedContext":
        """A local-mode context (one process, every degree 1) that neither reads the launch nor touches
        any process group: to build a model as one plain process would, from a rank of a larger job
        (e.g. `d9d plan` and `d9d preflight` count one microbatch's activations on it)."""
        return cls(
            MeshConfig(),
            mode="local",
            rank=0,
            local_rank=0,
            local_world_size=1,
            device=torch.device(device),
            meshes=None,
            owns_process_group=False,
            step_timeout=_DEFAULT_STEP_TIMEOUT,
        )

    def tensor_parallel_view(self) -> "DistributedContext":
        """Planning mode only: this rank on a mesh of its own tensor-parallel group.

        Every other degree is 1, so a model shaped on the view is split as the job's tensor
        parallelism splits it but is neither sharded (FSDP needs real memory) nor pipelined; `d9d
        plan` runs a forward on such a meta-device model to count activations.
        The view's meshes are built over the real global ranks of the group in this process's fake
        process group; closing the view leaves that group alone.
        """
        if self._mode != "planning":
            raise D9dError(
                "tensor_parallel_view() is for planning contexts (DistributedContext.for_planning)"
            )
        full = self._config
        sub = MeshConfig(tensor_parallel=full.tensor_parallel)
        dense = self._coords["dense"]
        group = (
            domain_layout(full, "dense")
            .grid[dense["pp"], dense["dp_replicate"], dense["dp_shard"], dense["cp"]]
            .reshape(-1)
        )
        meshes = {
            domain: DeviceMesh(
                "cpu",
                torch.as_tensor(group[domain_layout(sub, domain).grid]),
                mesh_dim_names=domain_layout(sub, domain).axes,
            )
            for domain in DOMAINS
        }
        return DistributedContext(
            sub,
            mode="planning",
            rank=int(list(group).index(self._rank)),
            local_rank=0,
            local_world_size=sub.world_size,
            device=torch.device("cpu"),
            meshes=meshes,
            owns_process_group=False,
            step_timeout=self._step_timeout,
        )

    # ------------------------------------------------------------------ where am I

    @property
    def config(self) -> MeshConfig:
        """The mesh degrees this context was built from."""
        return self._config

    @property
    def mode(self) -> Mode:
        """ "local", "distributed" or "planning"."""
        return self._mode

    @property
    def is_local(self) -> bool:
        """True for a plain single process: no process group, no mesh."""
        return self._mode == "local"

    @property
    def rank(self) -> int:
        """Global rank (0 in local mode)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of processes (1 in local mode)."""
        return self._config.world_size

    @property
    def local_rank(self) -> int:
        """Rank within this node."""
        return self._local_rank

    @property
    def local_world_size(self) -> int:
        """Processes on this node."""
        return self._local_world_size

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0: the process that logs metrics and writes shared files."""
        return self._rank == 0

    @property
    def is_local_main_process(self) -> bool:
        """True on local rank 0 of each node."""
        return self._local_rank == 0

    @property
    def device(self) -> torch.device:
        """The device this rank computes on."""
        return self._device

    @property
    def device_name(self) -> str:
        """The device for logs: the GPU model on CUDA (e.g. "NVIDIA H100 80GB HBM3"), else "cpu"."""
        return self._device_name

    @property
    def coordinates(self) -> dict[str, dict[str, int]]:
        """{domain: {axis: coordinate}} of this rank (all zeros in local mode)."""
        return {domain: dict(axes) for domain, axes in self._coords.items()}

    def coordinate(self, axis: str) -> int:
        """This rank's coordinate on a named axis of any domain (e.g. "dp_shard", "ep_shard", "dp")."""
        return self._coords[_domain_of(axis)][axis]

    def axis_size(self, axis: str) -> int:
        """Size of a named axis of any domain (1 for a switched-off parallelism)."""
        return domain_layout(self._config, _domain_of(axis)).size(axis)

    def mesh(self, domain: str = "dense") -> DeviceMesh:
        """The device mesh of a domain: "dense", "expert", "batch" or "world"."""
        if self._meshes is None:
            raise D9dError(
                "there is no device mesh in local mode (all mesh degrees are 1); "
                "check `context.is_local` before asking for one"
            )
        if domain not in self._meshes:
            raise KeyError(f"unknown mesh domain {domain!r}; the domains are {list(DOMAINS)}")
        return self._meshes[domain]

    @property
    def log_tag(self) -> str:
        """Short tag for log lines: `local`, or the rank and its coordinates on axes larger than 1."""
        if self.is_local:
            return "local"
        return rank_tag(self._config, self._rank)

    def describe(self) -> str:
        """The mesh layout as a table: every domain, axis and the ranks that share it."""
        return format_layout(self._config)

    # ------------------------------------------------------------------ synchronisation

    def barrier(self) -> None:
        """Wait for every rank (a no-op in local mode)."""
        if self._mode != "distributed":
            return
        if self._device.type == "cuda":
            dist.barrier(device_ids=[self._device.index])
        else:
            dist.barrier()

    @property
    def step_timeout(self) -> datetime.timedelta:
        """The collective timeout used once training runs (see `use_step_timeout`)."""
        return self._step_timeout

    def use_step_timeout(self) -> None:
        """Switch every process group of this job from the start-up timeout to the step timeout.

        Start-up (rendezvous, loading a checkpoint) may legitimately take long; a training step
        should not, and a rank that hangs in one should fail the job quickly.
        """
        if self._mode != "distributed":
            return
        set_timeouts(self._meshes or {}, self._step_timeout, include_default=True)

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Destroy the process group if this context created it. Safe to call twice.

        A planning context also empties torch's DTensor dispatch cache: its meshes compare equal to a
        real job's meshes of the same shape (equality ignores the rank), so specs cached while planning
        (rank 0's coordinates) would be handed to DTensors built later in this process or in processes
        forked from it, e.g. FSDP2 shards that all claim offset 0.
        """
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_process_group = False
        if self._mode == "planning":
            _clear_dtensor_caches()
        self._meshes = None if self._mode != "local" else self._meshes

    def __enter__(self) -> "DistributedContext":
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DistributedContext(mode={self._mode}, {self.log_tag}, world_size={self.world_size})"


def _clear_dtensor_caches() -> None:
    """Empty torch's DTensor sharding-propagation caches (Python and C++ fast path), see `close`."""
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # a torch without the debug helper: clear the Python cache it keeps
        from torch.distributed.tensor import DTensor

        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache.cache_clear()  # type: ignore[attr-defined]
        return
    _clear_sharding_prop_cache()


def _select(device: torch.device) -> None:
    """Make `device` this process's current CUDA device (nothing on CPU)."""
    if device.type != "cuda":
        return
    try:
        torch.cuda.set_device(device)
    except RuntimeError as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LaunchError(
            f"cannot use {device}: {reason}; fix the GPU setup or set `trainer.device: cpu`"
        ) from None


def _merge_device_alias(device: str, device_type: str | None) -> str:
    """The device `from_env` should use, given its deprecated `device_type` alias."""
    if device_type is None:
        return device
    if device not in ("auto", device_type):
        raise LaunchError(f"device={device!r} and device_type={device_type!r} disagree; pass device only")
    return device_type


def _domain_of(axis: str) -> str:
    for domain, axes in DOMAINS.items():
        if axis in axes:
            return domain
    known = sorted({a for axes in DOMAINS.values() for a in axes})
    raise KeyError(f"unknown mesh axis {axis!r}; the axes are {known}")


def _build_meshes(config: MeshConfig, device_type: str) -> dict[str, DeviceMesh]:
    """Build one DeviceMesh per domain, all over the same row-major rank order.

    Every rank must call this with the same config, in the same order: creating a mesh creates its
    process groups collectively.
    """
    meshes: dict[str, DeviceMesh] = {}
    for domain in DOMAINS:
        layout = domain_layout(config, domain)
        meshes[domain] = DeviceMesh(device_type, torch.as_tensor(layout.grid), mesh_dim_names=layout.axes)
    return meshes
