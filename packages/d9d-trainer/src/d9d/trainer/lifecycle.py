"""A run's lifecycle around the loop: resume from its latest checkpoint (or import starting weights),
save checkpoints, export. The checkpoint mechanics themselves are d9d.ckpt's."""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch import nn

from d9d.ckpt import (
    CheckpointManager,
    MappingError,
    Parallel,
    StateMapper,
    capture_rng_state,
    load_safetensors,
    restore_rng_state,
    safetensors_fingerprint,
    save_safetensors,
)
from d9d.mesh import DistributedContext, get_logger
from d9d.parallel import (
    lora_parameter_names,
    lora_state_dict,
    merged_state_dict,
    peft_adapter_config,
    peft_key,
)
from d9d.trainer.config import OptimizerConfig, ProvidersConfig
from d9d.trainer.errors import TrainingError
from d9d.trainer.job import ResolvedJob
from d9d.trainer.providers import (
    PrepareExportModelStageContext,
    PrepareImportModelStageContext,
    PrepareImportModelStageResult,
)

__all__ = ["RunLifecycle", "config_changes", "optimizer_change"]

_log = get_logger("d9d.trainer")


@dataclass
class RunLifecycle:
    """Resume, save and export for one run; the trainer owns the step count and passes it in."""

    job: ResolvedJob
    context: DistributedContext
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    data: Any
    checkpoints: CheckpointManager
    pipelined: bool = False
    _import: PrepareImportModelStageResult | None = None
    _base: dict[str, Any] | None = None

    @property
    def run_dir(self) -> Path:
        """`save_dir/run.name`."""
        return self.checkpoints.run_dir

    def resume(self, step: int | None = None) -> int | None:
        """Load the latest (or the given step's) committed checkpoint; the step it holds, or None.

        A run without a checkpoint starts from the model provider's import folder when it names one.

        Raises:
            TrainingError: `step` is given but the run has no committed checkpoint of that step.
        """
        self.checkpoints.check_uncommitted()
        found = self.checkpoints.checkpoints()
        if step is not None:
            matching = [c for c in found if c.step == step]
            if not matching:
                steps = [c.step for c in found]
                raise TrainingError(
                    f"run {self.run_dir} has no committed checkpoint of step {step}; it has {steps}"
                )
            found = matching
        latest = found[-1] if found else None
        if latest is None:
            self._import_source_weights()
            return None
        saved = self.checkpoints.read_extra_state(latest)
        saved_config = saved.get("config")
        if latest.meta.trainable_only:  # a LoRA checkpoint: the frozen base comes from where it came
            self._check_base(latest.path, saved.get("lora_base"))
            self._import_source_weights()
        changed = optimizer_change(saved_config, self.job.loaded.raw)
        reset = changed is not None
        if reset and not self.job.config.trainer.resume.reset_optimizer:
            raise TrainingError(
                f"the optimizer changed since checkpoint {latest.path} ({changed}): its state cannot be carried "
                "over; set trainer.resume.reset_optimizer=true to start the new optimizer fresh from the "
                "checkpoint's weights, or start a new run (another trainer.run.name)"
            )
        loaded = self.checkpoints.load(latest, self.model, None if reset else self.optimizer)
        if reset:
            _log.warning("optimizer state reset: the optimizer changed since the checkpoint", change=changed)
        extra = loaded.extra_state
        self.data.load_state_dict(extra["data"])
        self.scheduler.load_state_dict(extra["lr_scheduler"])
        # One base lr per parameter group of *this* rank's optimizer: the checkpoint's scheduler state
        # came from rank 0, whose stage may have had other groups (another pipeline layout).
        self.scheduler.base_lrs = [
            group.get("initial_lr", group["lr"]) for group in self.optimizer.param_groups
        ]
        self._reapply_schedule()
        if loaded.rank_state is not None:
            restore_rng_state(loaded.rank_state)
        resumed = int(extra["step"])
        _log.info("resumed", step=resumed, checkpoint=str(latest.path))
        for key, (before, now) in config_changes(extra.get("config"), self.job.loaded.raw).items():
            _log.warning("resumed with a changed setting", key=key, checkpoint=before, now=now)
        return resumed

    def _reapply_schedule(self) -> None:
        """Set the learning rate of the resumed step from the schedule as configured now.

        The optimizer's checkpoint holds the learning rate the old schedule gave; with a changed
        total_steps (or schedule) the next step must use the new schedule's value, not the old one's
        (which was 0 at the end of a finished cosine run).
        """
        lambdas = getattr(self.scheduler, "lr_lambdas", None)
        if lambdas is None:  # not a LambdaLR: its own state is all it has
            return
        step = self.scheduler.last_epoch
        old = [group["lr"] for group in self.optimizer.param_groups]
        new = [base * fn(step) for base, fn in zip(self.scheduler.base_lrs, lambdas, strict=True)]
        for group, lr in zip(self.optimizer.param_groups, new, strict=True):
            group["lr"] = lr
        self.scheduler._last_lr = list(new)  # what get_last_lr() reports for this step
        if any(abs(a - b) > 1e-12 * max(abs(a), abs(b), 1e-30) for a, b in zip(old, new, strict=True)):
            _log.warning(
                "learning rate follows the schedule as configured now",
                step=step + 1,
                checkpoint=old[0],
                now=new[0],
            )

    def _import_source(self) -> PrepareImportModelStageResult | None:
        """The provider's import folder and mapper (asked once), or None when it names none."""
        if self._import is None:
            prepare = getattr(self.job.model_provider, "prepare_import_model_stage", None)
            if prepare is None:
                return None
            self._import = prepare(
                PrepareImportModelStageContext(
                    context=self.context, model=self.model, base_dir=self.job.loaded.base_dir
                )
            )
        return self._import if self._import.folder is not None else None

    def _base_reference(self) -> dict[str, Any]:
        """What a LoRA checkpoint records of its frozen base: the import folder and
        `safetensors_fingerprint` of it (headers and samples of the data of the files the import
        reads), taken when the base is imported; or, without a folder, the seed and `model:` section
        that initialize it."""
        if self._base is None:
            source = self._import_source()
            if source is None:
                raw = self.job.loaded.raw
                self._base = {
                    "folder": None,
                    "seed": self.job.config.trainer.determinism.seed,
                    "model": raw.get("model") if isinstance(raw, dict) else None,
                }
            else:
                folder = Path(source.folder)
                self._base = {"folder": str(folder.resolve()), "fingerprint": safetensors_fingerprint(folder)}
        return self._base

    def _check_base(self, checkpoint: Path, saved: Any) -> None:
        """Refuse to put a LoRA checkpoint's adapters on another base than the one they were trained on."""
        if self.job.config.peft.lora is None:
            raise TrainingError(
                f"checkpoint {checkpoint} holds only LoRA adapters (its run had peft.lora) but this config has "
                "no peft.lora; restore the peft section, or start a new run (another trainer.run.name)"
            )
        if saved == {}:  # its extra state is unreadable: loading it reports the damage and the way out
            return
        now = self._base_reference()
        if not isinstance(saved, dict):
            raise TrainingError(f"LoRA checkpoint {checkpoint} records no base model; start a new run")
        if saved.get("folder") is None or now["folder"] is None:
            if saved != now:
                raise TrainingError(
                    f"the base of LoRA checkpoint {checkpoint} was {_describe_base(saved)}, this run's is "
                    f"{_describe_base(now)}; its adapters only fit that base: restore it, or start a new run"
                )
            return
        if saved.get("fingerprint") != now["fingerprint"]:
            raise TrainingError(
                f"the base folder of LoRA checkpoint {checkpoint} changed: it was {saved['folder']}, and "
                f"{now['folder']} now holds other weights; its adapters only fit the base they were "
                "trained on: restore that folder, or start a new run"
            )
        if saved["folder"] != now["folder"]:
            _log.warning(
                "LoRA base folder moved (same tensors)", checkpoint=saved["folder"], now=now["folder"]
            )

    def _import_source_weights(self) -> None:
        result = self._import_source()
        if result is None:
            return
        if self.job.config.peft.lora is not None:
            self._base_reference()  # the base as it is read now is what the checkpoints will name
        target: nn.Module | dict[str, torch.Tensor] = self.model
        if self.job.config.peft.lora is not None:  # the folder is the base: adapters keep their init
            adapters = set(lora_parameter_names(self.model))
            state = self.model.state_dict(keep_vars=True)
            target = {name: t for name, t in state.items() if name not in adapters}
        load_safetensors(target, result.folder, mapper=result.mapper)
        _log.info("loaded starting weights", folder=str(result.folder))

    def save(self, step: int) -> None:
        """Save model, optimizer, data position, LR schedule, RNG and config as `save-<step>`."""
        lora = self.job.config.peft.lora is not None
        extra = {
            "step": step,
            "data": self.data.state_dict(),
            "lr_scheduler": _plain(self.scheduler.state_dict()),
            "config": self.job.loaded.raw,
            "config_dir": str(self.job.loaded.base_dir.resolve()),
            **({"lora_base": self._base_reference()} if lora else {}),
        }
        # A LoRA run's checkpoint holds the adapters (and their optimizer state), not the frozen base.
        self.checkpoints.save(
            step,
            self.model,
            self.optimizer,
            extra_state=extra,
            rank_state=capture_rng_state(),
            trainable_only=lora,
        )
        _log.info("checkpoint saved", step=step, run_dir=str(self.run_dir))

    def export(self, out_dir: str | Path | None = None) -> Path:
        """Write the model as safetensors through the model provider's export mapper.

        `out_dir` (a caller's path) is taken as given; `export.dir` of the config is relative to the
        config file's directory, like every path of the config.

        On a pipeline-parallel mesh each rank passes only its own stages (`self.model`'s state dict,
        whole-model names) and `save_safetensors` assembles the whole model on global rank 0, which
        writes: the files are byte-identical to a one-process export of the same weights. Nothing is
        gathered a stage at a time or all at once: tensor by tensor in file order, every piece (a
        stage's plain tensor, or each dp/tp/ep shard of a DTensor) goes point to point from the one
        rank chosen to send it to rank 0. Rank 0 holds at most one file's tensors
        (`export.shard_size_mb`) plus one mapper group; the other ranks never more than one of their
        own shards (a whole tensor only for a partial sum they reduce). When the pp ranks' mappers
        differ (each built from its own stage), their union is used, stage by stage.

        A LoRA run (`peft.lora` set) exports as `export.lora` says: its adapters in PEFT's layout
        (`_export_lora`), the merged model (`merged_state_dict` through the provider's mapper), or both
        in `adapter/` and `merged/`.
        """
        configured = self.job.config.export.dir
        target = out_dir if out_dir is not None else configured and self.job.loaded.resolve_path(configured)
        if target is None:
            raise TrainingError("no export directory: pass one or set export.dir in the config")
        target = Path(target)
        if self.job.config.peft.lora is None:
            return self._export_model(target, self.model)
        mode = self.job.config.export.lora
        if mode == "adapter":
            return self._export_lora(target)
        if mode == "merged":
            return self._export_model(target, merged_state_dict(self.model))
        self._export_lora(target / "adapter")
        self._export_model(target / "merged", merged_state_dict(self.model))
        return target

    def _export_model(self, target: Path, source: nn.Module | dict[str, torch.Tensor]) -> Path:
        """`source` (the model, or a state dict under its names) through the provider's export mapper."""
        result = self.job.model_provider.prepare_export_model_stage(
            PrepareExportModelStageContext(
                context=self.context, model=self.model, base_dir=self.job.loaded.base_dir
            )
        )
        mapper = result.mapper
        if self.pipelined and mapper is not None:
            mapper = _whole_model_mapper(mapper, self.context.mesh("dense")["pp"].get_group())
        save_safetensors(
            source,
            target,
            mapper=mapper,
            max_shard_size=self.job.config.export.shard_size_mb * 2**20,
        )
        if self.context.is_main_process:
            for name, text in result.extra_files.items():
                path = Path(target) / name
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text(text, encoding="utf-8")
                tmp.replace(path)
        self.context.barrier()
        _log.info("exported", dir=str(target), files=sorted(result.extra_files))
        return Path(target)

    def _export_lora(self, target: Path) -> Path:
        """Write `adapter_config.json` and `adapter_model.safetensors`, as `peft.PeftModel` loads them.

        Every rank passes its adapters (its shards, its pipeline stages) to `save_safetensors` under
        PEFT's keys, which assembles them on rank 0 (all ranks call it). The base weights are frozen, so
        the base is the run's starting point: `base_model_name_or_path` is the provider's import folder
        when it names one, else "." (the initial weights, which a run without `peft.lora` exports).
        The reference model's module paths are Hugging Face's, so adapter keys need no renaming.
        """
        lora = self.job.config.peft.lora
        assert lora is not None
        state = {peft_key(name): tensor for name, tensor in lora_state_dict(self.model).items()}
        staging = target / ".adapter-export"
        save_safetensors(state, staging, max_shard_size=2**62)  # one file, whatever its size
        if self.context.is_main_process:
            (staging / "model.safetensors").replace(target / "adapter_model.safetensors")
            shutil.rmtree(staging)
            config = peft_adapter_config(lora, base_model_name_or_path=self._lora_base())
            tmp = target / "adapter_config.json.tmp"
            tmp.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
            tmp.replace(target / "adapter_config.json")
        self.context.barrier()
        _log.info("exported LoRA adapters", dir=str(target), tensors=len(state))
        return target

    def _lora_base(self) -> str:
        source = self._import_source()
        return str(source.folder) if source is not None else "."


def _describe_base(reference: dict[str, Any]) -> str:
    if reference.get("folder") is not None:
        return f"folder {reference['folder']}"
    return f"the initialization of seed {reference.get('seed')} and model {reference.get('model')}"


def _whole_model_mapper(mapper: StateMapper, pp_group: dist.ProcessGroup) -> StateMapper:
    """The export mapper over every stage's keys, the same on every rank of the pp group.

    The provider's own when every pp rank returned the same groups (a mapper built from the model
    config covers every stage already); else the stages' mappers (each over its own keys, sent to
    every pp rank) side by side in stage order.

    Raises:
        TrainingError: the stages' mappers overlap (two map one key).
    """
    size = dist.get_world_size(pp_group)
    groups: list[Any] = [None] * size
    dist.all_gather_object(groups, mapper.groups(), group=pp_group)
    if all(g == groups[0] for g in groups):
        return mapper
    mappers: list[Any] = [None] * size
    dist.all_gather_object(mappers, mapper, group=pp_group)
    distinct: list[StateMapper] = []
    for stage_mapper, stage_groups in zip(mappers, groups, strict=True):
        if stage_groups not in [m.groups() for m in distinct]:  # replicas of one stage: once
            distinct.append(stage_mapper)
    try:
        return Parallel(distinct)
    except MappingError as exc:
        raise TrainingError(
            f"the pipeline stages' export mappers overlap ({exc}); have prepare_export_model_stage map "
            "only its own stage's keys, or return one mapper over the whole model on every stage"
        ) from exc


#: Config sections whose change on resume is worth a line each (what the run now does differently).
_WATCHED = (
    "mesh",
    "data",
    "optimizer",
    "lr_scheduler",
    "trainer.schedule",
    "trainer.precision",
    "model",
    "peft",
)


def config_changes(saved: Any, current: Any) -> dict[str, tuple[Any, Any]]:
    """{key path: (value in the checkpoint's config, value now)} for the watched sections' leaves."""
    changes: dict[str, tuple[Any, Any]] = {}
    if not isinstance(saved, dict) or not isinstance(current, dict):
        return changes

    def section(config: dict[str, Any], path: str) -> Any:
        node: Any = config
        for part in path.split("."):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        return node

    def walk(path: str, before: Any, now: Any) -> None:
        if isinstance(before, dict) and isinstance(now, dict):
            for key in sorted(set(before) | set(now)):
                walk(f"{path}.{key}", before.get(key), now.get(key))
        elif before != now:
            changes[path] = (before, now)

    for path in _WATCHED:
        walk(path, section(saved, path), section(current, path))
    return changes


def optimizer_change(saved: Any, current: Any) -> str | None:
    """ "optimizer.name adamw → sgd" when the checkpoint's config picked another optimizer; else None.

    The optimizer is picked by `providers.optimizer` and, for the built-in provider, `optimizer.name`
    (a key left out counts as its default); its hyperparameters (lr, betas, ...) keep the state valid.
    """
    if not isinstance(saved, dict) or not isinstance(current, dict):
        return None
    builtin, default_name = ProvidersConfig(model="").optimizer, OptimizerConfig().name

    def picked(config: dict[str, Any]) -> tuple[Any, Any]:
        provider = _get(config, "providers", "optimizer", builtin)
        name = _get(config, "optimizer", "name", default_name) if provider == builtin else None
        return provider, name

    (provider_before, name_before), (provider_now, name_now) = picked(saved), picked(current)
    if provider_before != provider_now:
        return f"providers.optimizer {provider_before} → {provider_now}"
    if name_before != name_now:
        return f"optimizer.name {name_before} → {name_now}"
    return None


def _get(config: dict[str, Any], section: str, key: str, default: Any) -> Any:
    node = config.get(section)
    return node.get(key, default) if isinstance(node, dict) else default


def _plain(state: Any) -> Any:
    """Round-trip through msgspec so only plain data (no tensors or callables) is checkpointed."""
    return msgspec.json.decode(msgspec.json.encode(state, enc_hook=lambda o: None))
