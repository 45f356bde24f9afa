"""Which device a rank computes on: `auto`, `cuda` or `cpu`, checked before anything starts.

`resolve_device` turns the requested kind into this rank's `torch.device`. Asking for `cuda` where
torch cannot use a GPU (no GPU, a driver that does not match the wheel, `CUDA_VISIBLE_DEVICES=""`)
is one `LaunchError`, never a silent CPU run; so is a local rank with no GPU of its own.
"""

import warnings
from collections.abc import Mapping
from typing import Literal, get_args

import torch

from d9d.mesh.errors import LaunchError

__all__ = ["DEVICE_CHOICES", "DeviceChoice", "cuda_problem", "device_name", "resolve_device"]

DeviceChoice = Literal["auto", "cuda", "cpu"]
#: The values `trainer.device` (and `DistributedContext.from_env(device=...)`) accepts.
DEVICE_CHOICES: tuple[str, ...] = get_args(DeviceChoice)


def resolve_device(
    requested: str, *, local_rank: int = 0, torchrun: bool = False, environ: Mapping[str, str]
) -> torch.device:
    """This rank's device for `requested` ("auto": cuda when usable, else cpu).

    Args:
        local_rank: the rank within its node; it picks the GPU (`cuda:<local_rank>`).
        torchrun: whether the job was launched by torchrun (names `--nproc-per-node` in errors).
        environ: the environment to read (`CUDA_VISIBLE_DEVICES`).

    Raises:
        LaunchError: an unknown choice, `cuda` without a usable GPU, or a local rank without a GPU.
    """
    if requested not in DEVICE_CHOICES:
        raise LaunchError(
            f"device {requested!r} is not one of {list(DEVICE_CHOICES)}; set trainer.device to one of them"
        )
    if requested == "cpu":
        return torch.device("cpu")
    if requested == "auto":
        if not _cuda_available():
            return torch.device("cpu")
    else:
        problem = cuda_problem(environ)
        if problem is not None:
            raise LaunchError(
                f"the job asks for device 'cuda' but torch cannot use a GPU here: {problem}; "
                "set `trainer.device: cpu` to run on the CPU, or fix the GPU setup "
                "(driver, CUDA_VISIBLE_DEVICES) until `torch.cuda.is_available()` is True"
            )
    count = torch.cuda.device_count()
    if local_rank >= count:
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        shown = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        launch = f"`torchrun --nproc-per-node {count}`" if torchrun else f"{count} process(es) per node"
        raise LaunchError(
            f"local rank {local_rank} has no GPU: this node shows {count} GPU(s){shown}; start at most "
            f"{count} process(es) per node ({launch}, with --nnodes and the mesh to match) "
            "or set `trainer.device: cpu`"
        )
    return torch.device("cuda", local_rank)


def cuda_problem(environ: Mapping[str, str]) -> str | None:
    """Why torch cannot use a GPU in this process (one line), or None when it can."""
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    if _cuda_available():
        return None
    try:  # is_available() only says no; initializing says why (no driver, driver too old, ...)
        torch.cuda.init()
    except Exception as exc:  # RuntimeError from the driver, AssertionError from a CPU build
        reason = _first_line(str(exc))
        return reason or type(exc).__name__
    return "torch sees no GPU"


def device_name(device: torch.device) -> str:
    """A name for logs: the GPU model on CUDA (e.g. "NVIDIA H100 80GB HBM3"), else the device type."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def _cuda_available() -> bool:
    """torch.cuda.is_available() without its multi-line driver warning (cuda_problem says it in one)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
        except RuntimeError:
            return False


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0].rstrip(".") if lines else ""
