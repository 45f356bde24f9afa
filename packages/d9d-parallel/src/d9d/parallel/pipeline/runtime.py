"""Running this rank's stages under a pipeline schedule: one call per training step.

torch's pipelining runtime (`torch.distributed.pipelining`) moves activations and gradients between
ranks and orders the work; d9d adds the stage contract, the checks at start, the gradient contract
(summed, never divided by the microbatch count) and the FSDP guard for the zero-bubble schedules.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import ReplicateModule
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage

from d9d.parallel._torch_compat import (
    StageForwardContext,
    around_stage_forward,
    release_receive_buffers,
    restore_receive_buffers,
    schedule_step,
    skip_warmup_to_own_rank,
)
from d9d.parallel.pipeline.config import PipelineConfig, check_pipeline_microbatches
from d9d.parallel.pipeline.errors import PipelineError
from d9d.parallel.pipeline.forward_only import forward_only
from d9d.parallel.pipeline.layout import PipelineLayout
from d9d.parallel.pipeline.tied import TiedParameters

__all__ = [
    "Pipeline",
    "PipelineLossFn",
    "fsdp_reshard_after_forward",
    "prepare_fsdp_for_schedule",
]

#: `loss_fn(output, target)`: the last stage's output and the microbatch's target → this microbatch's
#: loss, already divided by the GLOBAL batch's weight (e.g. its token count), so that the sum over
#: microbatches, stages and data-parallel ranks is the global-batch mean loss.
PipelineLossFn = Callable[[Any, Any], torch.Tensor]


def fsdp_reshard_after_forward(config: PipelineConfig) -> bool | None:
    """The `reshard_after_forward` to give FSDP for stages run by `config`'s schedule.

    False for the zero-bubble schedules (their deferred weight-gradient pass gives wrong gradients
    when FSDP frees parameters after forward, on torch 2.15); None (FSDP's default) otherwise.
    """
    return False if config.info.zero_bubble else None


def prepare_fsdp_for_schedule(module: nn.Module, config: PipelineConfig) -> int:
    """Make an FSDP-parallelized stage safe for `config`'s schedule; returns how many FSDP modules changed.

    For the zero-bubble schedules, turns `reshard_after_forward` off on every FSDP module in `module`
    (parameters then stay gathered from a microbatch's forward to its weight-gradient pass: more
    memory, right gradients). `Pipeline` calls it on each stage; call it yourself only when you drive
    torch's schedules directly.
    """
    if not config.info.zero_bubble:
        return 0
    changed = 0
    for sub in module.modules():
        # FSDP-based replicate keeps whole parameters: nothing to reshard (and torch refuses the call)
        if isinstance(sub, FSDPModule) and not isinstance(sub, ReplicateModule):
            sub.set_reshard_after_forward(False, recurse=False)
            changed += 1
    return changed


class Pipeline:
    """This pipeline rank's stages, wired into the schedule named by the layout's config.

    Gradients follow the d9d sum contract: `loss_fn` returns each microbatch's loss divided by the
    global batch weight, and the pipeline never rescales gradients by the number of microbatches.
    Stages parallelized with FSDP/HSDP (`parallelize_fsdp`/`parallelize_hsdp`, whole stage as the root)
    get their gradients reduced once, after the last microbatch.

    Args:
        layout: the plan from `plan_pipeline` (the same on every rank).
        modules: this rank's stage modules, one per `layout.stages_of_rank(pp_rank)`, in that order.
        pp_group: the pipeline axis: a process group or a 1-D mesh (e.g. `ctx.mesh("dense")["pp"]`).
        n_microbatches: microbatches per step on this rank.
        loss_fn: see `PipelineLossFn`.
        device: where the stages run (default: the device of the first module's parameters).
        tied: names of parameters that are one parameter of the whole model although several stages
            hold a copy (tied embeddings); None reads the stage modules' `tied_parameters()`. Their
            copies are made equal here and their gradients summed after every step (see
            `d9d.parallel.pipeline.tied`).
    """

    def __init__(
        self,
        layout: PipelineLayout,
        modules: Sequence[nn.Module],
        *,
        pp_group: dist.ProcessGroup | DeviceMesh,
        n_microbatches: int,
        loss_fn: PipelineLossFn,
        device: torch.device | str | None = None,
        tied: Sequence[Sequence[str]] | None = None,
    ) -> None:
        group = pp_group.get_group() if isinstance(pp_group, DeviceMesh) else pp_group
        size = dist.get_world_size(group)
        if size != layout.pp_size:
            raise PipelineError(
                f"the pipeline layout was planned for {layout.pp_size} pipeline ranks but the pp group "
                f"has {size}; plan it with pp_size={size}"
            )
        self.layout = layout
        self.pp_rank = dist.get_rank(group)
        self.specs = layout.stages_of_rank(self.pp_rank)
        modules = list(modules)
        if len(modules) != len(self.specs):
            raise PipelineError(
                f"pipeline rank {self.pp_rank} runs stages {[s.index for s in self.specs]} but got "
                f"{len(modules)} module(s); build one module per stage of layout.stages_of_rank(pp_rank)"
            )
        config = layout.config
        check_pipeline_microbatches(config, layout.pp_size, n_microbatches)
        self.modules = modules
        self.n_microbatches = n_microbatches
        self._input_shapes: list[tuple[tuple[int, ...] | None, ...]] | None = None
        for module in modules:
            prepare_fsdp_for_schedule(module, config)
        if device is None:
            first = next((p for m in modules for p in m.parameters()), None)
            device = first.device if first is not None else torch.device("cpu")
        self.tied = TiedParameters(modules, [s.index for s in self.specs], group, ties=tied)
        mapping = {s.index: s.rank for s in layout.stages}
        self.stages: list[PipelineStage] = []
        for spec, module in zip(self.specs, modules, strict=True):
            stage = PipelineStage(module, spec.index, layout.num_stages, torch.device(device), group=group)
            stage.stage_index_to_group_rank = dict(mapping)
            skip_warmup_to_own_rank(stage)
            self.stages.append(stage)
        info = config.info
        try:
            self.schedule = info.torch_class(
                self.stages if info.multi_stage else self.stages[0],
                n_microbatches=n_microbatches,
                loss_fn=loss_fn,
                scale_grads=False,
            )
        except ValueError as exc:
            raise PipelineError(
                f"pipeline schedule {config.schedule!r} refused {layout.num_stages} stages on "
                f"{layout.pp_size} ranks with {n_microbatches} microbatches: {exc}"
            ) from exc

    @property
    def has_first_stage(self) -> bool:
        """This rank runs stage 0 (it needs the microbatches' inputs)."""
        return any(s.is_first for s in self.specs)

    @property
    def has_last_stage(self) -> bool:
        """This rank runs the last stage (it needs the targets and computes the loss)."""
        return any(s.is_last for s in self.specs)

    def step(
        self,
        inputs: Sequence[Any] | None,
        targets: Sequence[Any] | None,
        *,
        kwargs: Sequence[Mapping[str, Any]] | None = None,
        broadcast_loss: bool = False,
    ) -> torch.Tensor | None:
        """Run forward and backward of one training step over all microbatches; gradients accumulate.

        The gradients of tied parameters' copies are summed over their holders at the end of every
        call, so zero the gradients between calls (as an optimizer step does).

        Nothing the step made outlives the call, on any stage of any schedule: no tensor saved for
        backward (the first call's metadata-inference forward included), and no receive buffer
        (torch 2.11 keeps one per microbatch and direction for the stage's life: they are freed
        after the call and allocated again at the next; d9d-parallel's
        tests/pipeline/test_saved_tensors.py counts both). A `saved_tensors_hooks` pack hook around
        the call must keep `tensor.detach()`, not `tensor`: a kept saved output refers back to the
        node that saved it, a cycle gc cannot free when no backward runs over that node (torch 2.15
        runs stage 0's inference forward and no backward over it: its inputs are token ids).

        Args:
            inputs: per microbatch, the first stage's input (a tensor, or a tuple of positional
                tensors), of the same shapes every step; read only on the rank with the first stage
                (others may pass None).
            targets: per microbatch, the `target` given to `loss_fn`; read only on the rank with the
                last stage (others may pass None).
            kwargs: per microbatch, keyword inputs given to every stage's forward.
            broadcast_loss: return the loss on every pipeline rank (one broadcast over the pp group).

        Returns:
            The summed loss of all microbatches (detached) on the rank with the last stage (on every
            pipeline rank with `broadcast_loss`), else None. Summing over data-parallel ranks is the
            caller's business.
        """
        if not torch.is_grad_enabled():
            raise PipelineError(
                "pipeline step: it runs forward and backward, so it needs gradients enabled; call it "
                "outside torch.no_grad()/torch.inference_mode()"
            )
        n = self.n_microbatches
        arg_mbs = kwarg_mbs = target_mbs = None
        if self.has_first_stage:
            arg_mbs = [tuple(x) if isinstance(x, tuple) else (x,) for x in self._checked(inputs, "inputs")]
            self._check_shapes(arg_mbs)
        if self.has_last_stage:
            target_mbs = list(self._checked(targets, "targets"))
        if kwargs is not None:
            kwarg_mbs = [dict(k) for k in self._checked(kwargs, "kwargs")]
        elif arg_mbs is not None or target_mbs is not None:
            kwarg_mbs = [{} for _ in range(n)]
        if arg_mbs is None and (kwarg_mbs is not None or target_mbs is not None):
            arg_mbs = [() for _ in range(n)]
        losses: list[torch.Tensor] = []
        self.tied.copy_values()  # a later chunk's copy of a tied parameter: the updated (or loaded) value
        for stage in self.stages:  # what the previous step released (torch 2.11's kept receive buffers)
            restore_receive_buffers(stage)
        schedule_step(self.schedule, arg_mbs, kwarg_mbs, target_mbs, losses)
        for stage in self.stages:  # nothing of the step outlives it, whatever the torch version
            release_receive_buffers(stage)
        self.tied.sum_grads()  # before any clipping or update: every copy gets the whole gradient
        total = torch.stack([loss.detach() for loss in losses]).sum() if self.has_last_stage else None
        if broadcast_loss:
            if total is None:
                total = torch.zeros((), dtype=torch.float32, device=self.stages[0].device)
            total = self.from_last_stage(total.to(torch.float32))
        return total

    def forward_only(
        self, inputs: Sequence[Any], *, kwargs: Sequence[Mapping[str, Any]] | None = None
    ) -> list[Any] | None:
        """Run every microbatch forward through all stages, no backward (evaluation; call it in the
        stages' eval mode). Works whatever the schedule, for any number and shape of microbatches,
        and keeps nothing after the call (`d9d.parallel.pipeline.forward_only`).

        Args:
            inputs: per microbatch, the first stage's input (a tensor, or a tuple of positional
                tensors), given on every rank (their count is the microbatch count; their values are
                read on the rank with the first stage only).
            kwargs: per microbatch, keyword inputs given to every stage's forward.

        Returns:
            The last stage's output per microbatch on the rank with the last stage, else None.
        """
        if kwargs is not None and len(kwargs) != len(inputs):
            raise PipelineError(
                f"pipeline forward_only: {len(inputs)} microbatch inputs but {len(kwargs)} kwargs; give one each"
            )
        self.tied.copy_values()  # a later chunk's copy of a tied parameter: the updated (or loaded) value
        stage = self.stages[0]
        mbs_kwargs = list(kwargs) if kwargs is not None else [{} for _ in inputs]
        return forward_only(self.layout, self.modules, stage.group, inputs, mbs_kwargs, stage.device)

    def from_last_stage(self, value: torch.Tensor) -> torch.Tensor:
        """`value` as the rank with the last stage holds it, on every pipeline rank (one broadcast,
        in place: the same shape and dtype on every rank)."""
        dist.broadcast(value, group_src=self.layout.stages[-1].rank, group=self.stages[0].group)
        return value

    def around_stage_forwards(self, context: StageForwardContext) -> bool:
        """Run every stage forward of this rank inside `context(stage_index, microbatch_index, probe)`
        (e.g. to seed each microbatch's dropout); `probe` marks torch's metadata-inference forward of
        the first step, which is no microbatch. False, and nothing registered, where this torch's
        stages have no such hook (torch 2.15 has it). One context per pipeline."""
        return all([around_stage_forward(stage, context) for stage in self.stages])

    def _check_shapes(self, arg_mbs: list[tuple[Any, ...]]) -> None:
        # torch sizes the activation buffers between stages at the first step; other shapes would
        # fail later with an obscure error on another rank (or a hang), so refuse them here.
        shapes = [
            tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in mb) for mb in arg_mbs
        ]
        if self._input_shapes is None:
            self._input_shapes = shapes
        elif shapes != self._input_shapes:
            raise PipelineError(
                f"pipeline step: microbatch input shapes {shapes} differ from the first step's "
                f"{self._input_shapes}; a pipeline needs the same shapes every step (pad sequences to "
                "a fixed length, drop or pad a short last batch)"
            )

    def _checked(self, items: Sequence[Any] | None, what: str) -> Sequence[Any]:
        if items is None or len(items) != self.n_microbatches:
            got = "None" if items is None else f"{len(items)}"
            raise PipelineError(
                f"pipeline step on rank {self.pp_rank}: expected {self.n_microbatches} microbatch "
                f"{what}, got {got}"
            )
        return items
