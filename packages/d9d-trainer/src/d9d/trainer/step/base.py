"""What every step strategy shares: the global token weight, clipping, the non-finite rule, the update."""

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch import nn

from d9d.mesh import get_logger
from d9d.parallel import (
    AttentionKernel,
    ContextParallel,
    MixedPrecision,
    clip_grad_norm_,
    float8_gathered_weights,
    grad_norm,
    precompute_float8_scales,
    reduce_partial_grads,
    weights_cast_once,
)
from d9d.parallel.expert import (
    expert_load_summary,
    expert_loads,
    moe_layers,
    set_replayed_routing,
    set_statistics_group,
    update_expert_biases,
)
from d9d.trainer.errors import TrainingError
from d9d.trainer.observe.timing import StepTimer
from d9d.trainer.providers.task import Task, metric_names
from d9d.trainer.step.documents import attention_balance, reorder_documents
from d9d.trainer.step.randomness import TrainingRandomness

__all__ = ["StepOutput", "StepSettings", "TrainStep", "token_group"]

_log = get_logger("d9d.trainer")


@dataclass(frozen=True)
class StepOutput:
    """One optimizer step's results, as device tensors (reading them syncs the host).

    Attributes:
        loss: the global batch's mean loss (float64), the same on every rank.
        grad_norm: the global gradient norm before clipping, the same on every rank.
        weight: the global batch's weight (e.g. labelled tokens), float64.
        applied: False when the step was skipped (non-finite loss or norm, `on_nonfinite: skip`).
        stop: some rank got a stop signal (SIGTERM, Ctrl-C): every rank stops after this step, to be
            resumed.
        finish: some rank's callback asked the run to stop (`RunControl.request_stop`): every rank
            ends the run after this step, as finished.
        save: some rank's callback asked for a checkpoint: every rank saves after this step.
        expert_load: for a model with MoE layers, [min / mean, max / mean, std / mean] of the
            step's tokens per expert, worst layer each (`d9d.parallel.expert.expert_load_summary`); None
            without MoE.
        cp_attention_balance: packed rows under context parallelism: the step's attention pairs on
            the most loaded cp rank over the mean (`d9d.trainer.step.documents`, counted on the host);
            None otherwise.
        rank_busy: every rank's busy time of the step up to its sync (`StepSettings.busy_time`;
            index: global rank), float64 on the device, gathered in the step's sync; None on one
            process or without a busy clock.
        metrics: the global sums of the task's metrics (`ReportsMetrics.metric_names`, in that order),
            float64 on the device, the same on every rank; None when the task reports none.
    """

    loss: torch.Tensor
    grad_norm: torch.Tensor
    weight: torch.Tensor
    applied: bool
    stop: bool = False
    expert_load: torch.Tensor | None = None
    save: bool = False
    rank_busy: torch.Tensor | None = None
    finish: bool = False
    cp_attention_balance: float | None = None
    metrics: torch.Tensor | None = None


@dataclass(frozen=True)
class StepSettings:
    """What a step needs besides the model: where it runs and the job's step options."""

    device: torch.device
    precision: MixedPrecision
    max_norm: float | None
    on_nonfinite: Literal["stop", "skip"]
    dp_group: dist.ProcessGroup | None = None
    """The ranks whose tokens make up the global batch: data parallel × context parallel."""
    pp_group: Any = None
    stop_requested: Callable[[], bool] | None = None
    """Whether a signal asks this rank to stop (read once a step, agreed over all ranks in its sync)."""
    finish_requested: Callable[[], bool] | None = None
    """Whether a callback of this rank asks the run to end, finished (read and agreed like `stop_requested`)."""
    save_requested: Callable[[], bool] | None = None
    """Whether this rank asks for a checkpoint after the step (read and agreed like `stop_requested`)."""
    context_parallel: ContextParallel = field(default_factory=ContextParallel)
    """The cp group: each microbatch's sequences are split over it before the forward (disabled: none)."""
    timer: StepTimer | None = None
    """Where the step marks the end of its forward+backward and optimizer phases (None: nowhere)."""
    busy_time: Callable[[], float] | None = None
    """This rank's seconds of the step so far not spent waiting in collectives (`d9d.trainer.observe.stragglers`),
    read at the sync and gathered there with the requests."""
    randomness: TrainingRandomness | None = None
    """This rank's random streams: the step seeds torch's generator from them before each microbatch's
    forward (a pipeline: each stage's); None leaves the generator alone."""
    attention: AttentionKernel | None = None
    """The plan's attention kernel: forward and backward run with SDPA restricted to it (`attention_kernels`)."""
    balance_documents: bool = False
    """Reorder whole documents of packed rows before the cp sharding (`trainer.attention.balance_documents`)."""

    def attention_kernels(self) -> contextlib.AbstractContextManager[None]:
        """SDPA restricted to the plan's kernel(s) inside the block (`AttentionKernel.sdpa`): wrap forward
        AND backward, so an activation-checkpointing recompute runs the same kernel."""
        return self.attention.sdpa() if self.attention is not None else contextlib.nullcontext()

    def local_batch(self, batch: Any) -> Any:
        """This rank's part of a microbatch: its share of every sequence under context parallelism
        (the batch itself without); the training step and the eval cut their microbatches here."""
        return self.context_parallel.shard_batch(self.ordered(batch))

    def ordered(self, batch: Any) -> Any:
        """The microbatch with its packed documents reordered when `balance_documents` is on under
        context parallelism (`d9d.trainer.step.documents`); else the microbatch itself."""
        cp = self.context_parallel
        return reorder_documents(batch, cp.size) if self.balance_documents and cp.enabled else batch


def token_group(ctx: Any) -> dist.ProcessGroup:
    """The ranks holding different tokens of one global batch (`StepSettings.dp_group`): dp × cp of
    the `DistributedContext`'s batch domain."""
    batch = ctx.mesh("batch")
    if ctx.axis_size("cp") == 1:
        return batch.get_group("dp")
    if ctx.axis_size("dp") == 1:
        return batch.get_group("cp")
    return batch["dp", "cp"]._flatten("dp_cp").get_group()


class TrainStep(Protocol):
    """A strategy that turns one step's microbatches into one optimizer step."""

    def run(self, microbatches: Sequence[Any], step: int) -> StepOutput:
        """Forward, backward, clip and update for step number `step` (1-based)."""
        ...


class StepBase:
    """Shared mechanics of the strategies (the global weight, the update), on top of their forward/backward."""

    def __init__(
        self,
        model: nn.Module,
        task: Task,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        settings: StepSettings,
    ) -> None:
        self.model = model
        self.task = task
        self.metric_names = metric_names(task)  # the task's summed metrics, reduced with the loss
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.settings = settings
        self.moes = moe_layers(model)  # the MoE layers: their load, balancing losses and score biases
        # their statistics over the ranks whose gradients the step sums (dp x cp), expert-parallel or not:
        # each rank's balancing terms are then its share, as its loss is (d9d.parallel.expert.balancing)
        set_statistics_group(self.moes, settings.dp_group)
        self._loads: torch.Tensor | None = None  # this step's tokens per expert, summed over microbatches
        # weights FSDP2 gathers in float8: their scales once per step (after each update), not per gather
        self._float8_gathered = float8_gathered_weights(model) > 0
        self._float8_scaled = False  # the scales are those of the weights as they are now
        self._cp_balance: float | None = None  # this step's attention balance over the cp ranks (local_part)

    def local_part(self, microbatches: Sequence[Any]) -> list[Any]:
        """This rank's part of each microbatch (`StepSettings.local_batch`); the step's attention balance
        over the cp ranks is counted here, on the host, from the rows as they will run."""
        cp = self.settings.context_parallel
        ordered = [self.settings.ordered(mb) for mb in microbatches]
        self._cp_balance = attention_balance(ordered, cp.size) if cp.enabled else None
        return [cp.shard_batch(mb) for mb in ordered]

    def global_weight(self, microbatches: Sequence[Any]) -> torch.Tensor:
        """The summed `task.batch_weight` of the global batch, on the device, without reading it."""
        weights = [torch.as_tensor(self.task.batch_weight(mb), dtype=torch.float64) for mb in microbatches]
        local = torch.stack([w.to(self.settings.device) for w in weights]).sum()
        return self.dp_sum(local)

    def dp_sum(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over the data-parallel ranks (an all-reduce on the device, no host sync)."""
        group = self.settings.dp_group
        if group is None or dist.get_world_size(group) == 1:
            return value
        value = value.to(torch.float64)
        dist.all_reduce(value, group=group)
        return value

    def mark(self, phase: str) -> None:
        """End the step's `phase` (see `d9d.trainer.observe.timing`) on the settings' timer, if any; never syncs."""
        if self.settings.timer is not None:
            self.settings.timer.mark(phase)

    def float8_scales(self, *, updated: bool = False) -> None:
        """The float8 scales of the weights FSDP2 gathers in float8 (`d9d.parallel.
        precompute_float8_scales`): before the first step's forwards, and after every update
        (`updated`), so each step's gathers (and an evaluation after it) use the weights' own."""
        if self._float8_gathered and (updated or not self._float8_scaled):
            precompute_float8_scales(self.model)
            self._float8_scaled = True

    def weights_cast_once(self) -> contextlib.AbstractContextManager[object]:
        """The step's forwards and backwards: inside it each float32 weight is cast to the compute dtype
        once, not per microbatch and recompute (`d9d.parallel.weights_cast_once`; its copies are dropped
        before the optimizer step); nothing for float32 compute."""
        return weights_cast_once(self.settings.precision.enabled)

    def microbatch_range(self, index: int) -> contextlib.AbstractContextManager[None]:
        """The profiler range of microbatch `index`'s forward and backward (`StepTimer.microbatch`)."""
        if self.settings.timer is None:
            return contextlib.nullcontext()
        return self.settings.timer.microbatch(index)

    def add_expert_load(self) -> None:
        """Add the MoE layers' routing of the microbatch just run to the step's load (no host read)."""
        loads = expert_loads(self.moes)
        if loads is not None:
            self._loads = loads if self._loads is None else self._loads + loads

    def finish(
        self, loss: torch.Tensor, weight: torch.Tensor, step: int, metrics: torch.Tensor | None = None
    ) -> StepOutput:
        """Clip (or measure) the global grad norm, then update, unless the loss or norm is not finite.

        The finiteness check is the step's one host sync; a global batch without weight shows here
        too (its loss is 0/0). Marks the end of the "forward_backward" phase on entry and of
        "optimizer" (clip, step, LR step) on return.
        """
        self.mark("forward_backward")
        loads, self._loads = self._loads, None
        for layer in self.moes:  # backward is done: the stats' graph would outlive the step, and a
            set_replayed_routing(layer, None)  # replayed routing (RL's) is this step's forwards' only
            stats = layer.last_stats
            if stats is not None:
                layer.last_stats = dataclasses.replace(
                    stats, aux_loss=stats.aux_loss.detach(), z_loss=stats.z_loss.detach()
                )
        output = self._update(loss, weight, step)
        if loads is not None:
            if output.applied:
                update_expert_biases(self.moes, loads)  # auxiliary-loss-free balancing, on the device
            output = dataclasses.replace(output, expert_load=expert_load_summary(loads))
        if self._cp_balance is not None:
            output = dataclasses.replace(output, cp_attention_balance=self._cp_balance)
        if metrics is not None and self.metric_names:
            output = dataclasses.replace(output, metrics=metrics)
        self.mark("optimizer")
        return output

    def _update(self, loss: torch.Tensor, weight: torch.Tensor, step: int) -> StepOutput:
        settings = self.settings
        params = [p for p in self.model.parameters() if p.grad is not None]
        reduce_partial_grads(params)  # e.g. norm weights under sequence parallelism: replicated state
        if settings.max_norm is not None:
            norm = clip_grad_norm_(params, settings.max_norm, pp_group=settings.pp_group)
        else:
            norm = grad_norm(params, pp_group=settings.pp_group)
        finite, (stop, finish, save), busy = self._read_flags(torch.isfinite(loss) & torch.isfinite(norm))
        if finite:
            self.optimizer.step()
            self.float8_scales(updated=True)
            self.scheduler.step()
            return StepOutput(loss=loss, grad_norm=norm, weight=weight, applied=True, stop=stop, save=save,
                              rank_busy=busy, finish=finish)  # fmt: skip
        if float(weight) <= 0:
            raise TrainingError(f"step {step} has no labelled tokens in the whole global batch")
        if settings.on_nonfinite == "stop":
            raise TrainingError(
                f"step {step}: loss {float(loss)} / grad norm {float(norm)} is not finite; stopping. "
                "The last committed checkpoint stays the latest; lower the learning rate or set "
                "trainer.on_nonfinite: skip"
            )
        _log.warning("skipping step with a non-finite loss or grad norm", step=step, loss=float(loss))
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return StepOutput(loss=loss, grad_norm=norm, weight=weight, applied=False, stop=stop, save=save,
                          rank_busy=busy, finish=finish)  # fmt: skip

    def _read_flags(self, finite: torch.Tensor) -> tuple[bool, tuple[bool, bool, bool], torch.Tensor | None]:
        """(finite, the requests (stop, finish, save), every rank's busy time) in one host sync; with
        several ranks the requests are agreed (MAX over all ranks) and the busy times gathered, in one
        all-gather of [stop, finish, save, busy] from every rank. The busy times stay on the device
        (read when the records flush)."""
        settings = self.settings
        sources = (settings.stop_requested, settings.finish_requested, settings.save_requested)
        if all(source is None for source in sources):
            return bool(finite), (False, False, False), None
        asked = [source is not None and source() for source in sources]
        busy = settings.busy_time() if settings.busy_time is not None else 0.0
        mine = torch.tensor([1.0 if flag else 0.0 for flag in asked] + [busy], dtype=torch.float64)
        mine = mine.to(settings.device)
        rank_busy = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            world = dist.get_world_size()
            every = torch.empty(world * 4, dtype=torch.float64, device=settings.device)
            dist.all_gather_into_tensor(every, mine)
            table = every.view(world, 4)
            requests = table[:, :3].amax(dim=0)
            rank_busy = table[:, 3] if settings.busy_time is not None else None
        else:
            requests = mine[:3]
        flags = finite.reshape(1).to(requests.dtype) + 2 * requests[0] + 4 * requests[1] + 8 * requests[2]
        packed = int(flags.item())  # every flag, one read
        return bool(packed & 1), (bool(packed & 2), bool(packed & 4), bool(packed & 8)), rank_busy
