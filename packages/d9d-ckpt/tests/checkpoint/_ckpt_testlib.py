"""Tiny model, data and training step shared by the checkpoint tests (no test machinery inside)."""

import multiprocessing
import os
import pickle
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from d9d.mesh import DistributedContext, MeshConfig


def tiny_model(seed: int = 0) -> nn.Module:
    """Rows 8 and 5 do not divide by 3 or 4: uneven and empty FSDP shards get exercised."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5))


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(16, 6, generator=gen), torch.randn(16, 5, generator=gen)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> float:
    x, y = batch(seed)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


@torch.no_grad()
def eval_loss(model: nn.Module) -> float:
    x, y = batch(99)
    return nn.functional.mse_loss(model(x), y).item()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as one full tensor (DTensors gathered)."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def sharded_job(
    config: MeshConfig, seed: int = 0
) -> tuple[DistributedContext, nn.Module, torch.optim.Optimizer]:
    """Context, model (FSDP2 on dp_shard, HSDP when dp_replicate > 1, plain in local mode), AdamW."""
    ctx = DistributedContext.from_env(config)
    model = tiny_model(seed)
    if not ctx.is_local:
        dense = ctx.mesh("dense")
        mesh = dense["dp_replicate", "dp_shard"] if config.data_parallel_replicate > 1 else dense["dp_shard"]
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return ctx, model, adamw(model)


def one_error(results: list[dict[str, Any]]) -> str:
    """The error every rank of `results` (`run_distributed`'s, each with an "error") reported alike."""
    messages = {r["error"] for r in results}
    assert len(messages) == 1, messages
    (message,) = messages
    assert message is not None, results
    return str(message)


def run_forked(fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> Any:
    """Run `fn(*args)` in a forked process (no process group) and return its result or raise its error."""
    ctx = multiprocessing.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_forked_main, args=(fn, args, writer), daemon=True)
    proc.start()
    writer.close()
    try:
        if not reader.poll(timeout):
            raise AssertionError(f"forked {fn.__name__} did not finish within {timeout} s")
        status, value = pickle.loads(reader.recv_bytes())
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
    if status != "ok":
        raise AssertionError(f"forked {fn.__name__} failed:\n{value}")
    return value


def _forked_main(fn: Callable[..., Any], args: tuple[Any, ...], writer: Any) -> None:
    code = 0
    try:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        payload = pickle.dumps(("ok", fn(*args)))
    except BaseException:
        code = 1
        payload = pickle.dumps(("error", traceback.format_exc()))
    writer.send_bytes(payload)
    writer.close()
    os._exit(code)
