"""Run code on several real processes for tests: forked ranks over gloo, or a real torchrun launch.

`run_distributed(fn, world_size)` forks `world_size` processes from the calling process, joins them
into one gloo process group through a `FileStore` in a temporary directory, runs `fn` on each and
returns the per-rank results. Forking reuses the parent's imported torch, so a launch costs well under
a second instead of the ten-plus seconds of a fresh interpreter. Fork before the parent creates any
process group or compiles anything.

`run_torchrun(...)` runs a real `torchrun` (one node, or several "nodes" on loopback) for the few
end-to-end tests that must go through the launcher itself.

Two dispatch modes prove on CPU what a GPU run would do: `HostSyncCounter` (host syncs) and
`StorageCensus` (which storages made inside a block are still alive after it).
"""

import concurrent.futures
import contextlib
import dataclasses
import datetime
import faulthandler
import gc
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = [
    "SYNCING_OPS",
    "DistributedTestError",
    "HostSyncCounter",
    "StorageCensus",
    "TorchrunResult",
    "free_port",
    "run_distributed",
    "run_torchrun",
    "wait_for_child",
]

_GRACE_AFTER_FAILURE_S = 3.0

#: Aten ops that wait for the device on the host under CUDA: `_local_scalar_dense` (every `.item()`,
#: `float(t)`, `bool(t)`) and ops whose output size depends on the values (CUDA's `bincount` reads its
#: largest id back, `nonzero` its count, ...).
SYNCING_OPS = frozenset(
    ("_local_scalar_dense", "bincount", "nonzero", "_unique2", "unique_consecutive", "masked_select")
)


class HostSyncCounter(TorchDispatchMode):
    """Counts, on CPU, the host syncs a CUDA run would make: the `SYNCING_OPS` and `Tensor.tolist()`
    (which reads a CPU tensor's memory without dispatching any op, so it is counted where it is
    called). `names` lists them in order; subclasses extend `__torch_dispatch__` and call super."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    @property
    def count(self) -> int:
        """Host syncs seen so far."""
        return len(self.names)

    def __enter__(self) -> "HostSyncCounter":
        self._tolist = torch.Tensor.tolist
        names, original = self.names, self._tolist

        def tolist(tensor: torch.Tensor) -> Any:
            names.append("tolist")
            return original(tensor)

        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """Count `func` when it syncs, then run it."""
        name = func._overloadpacket.__name__
        if name in SYNCING_OPS:
            self.names.append(name)
        return func(*args, **(kwargs or {}))


class StorageCensus(TorchDispatchMode):
    """Which storages made under the mode are still alive afterwards, with no autograd hook.

    Every aten op run under it (forward, backward, communication) has each new output storage (not a
    view of an input's) remembered by a weak reference, with its size, the op, shape and dtype. After
    the block, `alive(exclude)` lists those still referenced by anyone, but the storages of `exclude`
    (what the block keeps on purpose: parameters, gradients, its outputs). Unlike a saved-tensor hook
    it changes nothing autograd keeps (a pack hook keeping `tensor` makes a reference cycle that
    outlives the graph), so what it finds alive is held by the code under test: saved activations,
    communication buffers, cached outputs alike.
    """

    def __init__(self) -> None:
        super().__init__()
        self._born: dict[int, tuple[StorageWeakRef, int, str]] = {}

    @property
    def seen(self) -> int:
        """Storages made under the mode so far (proof that it watched the work)."""
        return len(self._born)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """Run `func`; remember the storages of its outputs that none of its inputs had."""
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                key = _storage_key(tensor)
                if key not in self._born and key not in inputs:
                    what = f"{func} {tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"
                    self._born[key] = (
                        StorageWeakRef(tensor.untyped_storage()),
                        tensor.untyped_storage().nbytes(),
                        what,
                    )
        return out

    def alive(self, exclude: Iterable[Any] = ()) -> tuple[int, list[str]]:
        """(bytes, descriptions) of the storages made under the mode and still alive after a full garbage
        collection, but those of the tensors in `exclude` (lists, tuples, dicts and dataclasses are
        walked: a step's output, a module's `state_dict(keep_vars=True)`, an optimizer's `state`)."""
        gc.collect()
        skip = {_storage_key(t) for t in _tensors_in(list(exclude))}
        found = [
            (size, what)
            for key, (ref, size, what) in self._born.items()
            if key not in skip and not ref.expired()
        ]
        return sum(size for size, _ in found), [what for _, what in found]


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in `value`, walking lists, tuples, dicts and dataclass fields."""
    if isinstance(value, torch.Tensor):
        yield value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _tensors_in(getattr(value, field.name))
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors_in(item)
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors_in(item)


def _storage_key(tensor: torch.Tensor) -> int | None:
    """The identity of a tensor's storage (a DTensor's local one); None on the meta device."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return None if local.device.type == "meta" else local.untyped_storage()._cdata


class DistributedTestError(AssertionError):
    """A rank of a multi-process test failed, died or did not finish in time."""


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` forked processes joined in a gloo process group.

    Each rank sees the torchrun environment variables (RANK, WORLD_SIZE, LOCAL_RANK, ...), so code
    under test builds its `DistributedContext` exactly as under torchrun; the process group already
    exists when `fn` starts. Returns the list of return values, indexed by rank (they must pickle).

    Raises:
        DistributedTestError: with the traceback of the first failing rank when any rank raises or
            dies, or naming the ranks still running after `timeout` seconds (their Python stacks are
            dumped to stderr first). Every rank is killed before it is raised.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = multiprocessing.get_context("fork")
    tmp = tempfile.mkdtemp(prefix="d9d-dist-")
    store_path = os.path.join(tmp, "store")
    procs: list[multiprocessing.process.BaseProcess] = []
    readers: dict[Any, int] = {}
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child_main,
                args=(fn, args, kwargs, rank, world_size, store_path, timeout, dict(env or {}), writer),
                name=f"d9d-rank-{rank}",
                daemon=True,
            )
            proc.start()
            writer.close()
            procs.append(proc)
            readers[reader] = rank
        return _collect(procs, readers, timeout)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        shutil.rmtree(tmp, ignore_errors=True)


def _child_main(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    rank: int,
    world_size: int,
    store_path: str,
    timeout: float,
    env: dict[str, str],
    writer: multiprocessing.connection.Connection,
) -> None:
    code = 0
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        os.environ.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size),
                "GROUP_RANK": "0",
                "OMP_NUM_THREADS": "1",
                **env,
            }
        )
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            # stamp the failure before tearing down the group: peers fail *because* of the teardown
            exc.__dict__["_d9d_failed_at"] = time.time()
            raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        payload = pickle.dumps(("ok", result))
    except BaseException as exc:  # report everything, including SystemExit, to the parent
        code = 1
        text = "".join(traceback.format_exception(exc))
        failed_at = getattr(exc, "__dict__", {}).get("_d9d_failed_at", time.time())
        payload = pickle.dumps(("error", f"{type(exc).__name__}: {exc}", text, failed_at))
    try:
        writer.send_bytes(payload)
        writer.close()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip the parent's (pytest's) atexit handlers and finalizers


def _collect(
    procs: list[multiprocessing.process.BaseProcess], readers: dict[Any, int], timeout: float
) -> list[Any]:
    results: dict[int, Any] = {}
    failures: dict[int, tuple[str, str, float]] = {}
    pending = dict(readers)
    deadline = time.monotonic() + timeout
    first_failure_at: float | None = None
    while pending:
        now = time.monotonic()
        limit = (
            deadline if first_failure_at is None else min(deadline, first_failure_at + _GRACE_AFTER_FAILURE_S)
        )
        if now >= limit:
            break
        ready = multiprocessing.connection.wait(list(pending), timeout=limit - now)
        for reader in ready:
            rank = pending.pop(reader)
            try:
                message = pickle.loads(reader.recv_bytes())
            except (EOFError, OSError):
                procs[rank].join(timeout=5)
                message = (
                    "error",
                    f"rank {rank} died with exit code {procs[rank].exitcode}",
                    "",
                    time.time(),
                )
            if message[0] == "ok":
                results[rank] = message[1]
            else:
                failures[rank] = (message[1], message[2], message[3])
                first_failure_at = first_failure_at or time.monotonic()
    if failures:
        rank = min(failures, key=lambda r: failures[r][2])  # the first to fail is the likely cause
        summary, text, _ = failures[rank]
        others = sorted(set(failures) - {rank})
        also = f"; ranks {others} failed too" if others else ""
        stuck = f"; ranks {sorted(pending.values())} were killed" if pending else ""
        raise DistributedTestError(f"rank {rank} of {len(procs)} failed: {summary}{also}{stuck}\n{text}")
    if pending:
        stuck_ranks = sorted(pending.values())
        for rank in stuck_ranks:  # ask for Python stacks before killing, to show where they hang
            with contextlib.suppress(ProcessLookupError):
                os.kill(procs[rank].pid or 0, signal.SIGUSR1)
        time.sleep(0.5)
        raise DistributedTestError(
            f"ranks {stuck_ranks} of {len(procs)} did not finish within {timeout:.0f} s "
            "(their stacks are on stderr); a collective is probably waiting for a rank that skipped it"
        )
    return [results[r] for r in range(len(procs))]


def wait_for_child(pid: int, timeout: float, *, group: bool = False) -> int:
    """The exit status of forked child `pid`; past `timeout` seconds it is killed (with its process
    group when `group`: a child that called `os.setsid()`) and an AssertionError names the timeout, so a
    child that hangs (e.g. on a lock some thread of the parent held when it forked) fails its test
    instead of the whole run."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            if group:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the forked child did not finish within {timeout} s")
        time.sleep(0.02)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for rendezvous endpoints in tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class TorchrunResult:
    """What a torchrun launch left: exit status and output, one entry per (simulated) node."""

    returncodes: list[int]
    stdouts: list[str]
    stderrs: list[str]

    @property
    def returncode(self) -> int:
        """0 when every node's agent exited 0, else the first non-zero status."""
        return next((rc for rc in self.returncodes if rc != 0), 0)

    @property
    def stdout(self) -> str:
        """Standard output of every node, concatenated."""
        return "".join(self.stdouts)

    @property
    def stderr(self) -> str:
        """Standard error of every node, concatenated."""
        return "".join(self.stderrs)

    @property
    def output(self) -> str:
        """Standard output and standard error of every node."""
        return self.stdout + self.stderr


def run_torchrun(
    command: Sequence[str],
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> TorchrunResult:
    """Run `torchrun ... command` and wait for it; never uses a fixed port.

    `command` is what follows torchrun's own flags: a script and its arguments, or `["-m", module,
    ...]`. With `nnodes > 1`, one torchrun agent per node is started on this machine, all meeting at a
    c10d rendezvous on a free loopback port: a real multi-node launch on one host.

    Raises:
        subprocess.TimeoutExpired: after killing every agent and its workers, if they run longer than
            `timeout` seconds.
    """
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if nnodes == 1:
        node_args = [["--standalone"]]
    else:
        endpoint = f"127.0.0.1:{free_port()}"
        run_id = uuid.uuid4().hex[:12]
        node_args = [
            [
                "--nnodes", str(nnodes),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
            ]
            for _ in range(nnodes)
        ]  # fmt: skip
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                *args,
                "--nproc-per-node",
                str(nproc_per_node),
                *command,
            ],
            env=full_env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # own process group: a timeout kills the workers too
        )
        for args in node_args
    ]
    # Read every agent's pipes concurrently: a node blocked on a full pipe would stall the others.
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(procs)) as pool:
        futures = [pool.submit(proc.communicate, timeout=timeout) for proc in procs]
        try:
            outputs = [f.result() for f in futures]
        except subprocess.TimeoutExpired:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            for proc in procs:
                proc.wait()
            raise
    return TorchrunResult(
        returncodes=[p.returncode for p in procs],
        stdouts=[o for o, _ in outputs],
        stderrs=[e for _, e in outputs],
    )
