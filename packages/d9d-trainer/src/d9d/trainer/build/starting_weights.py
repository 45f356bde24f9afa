"""Where a run's weights start: the model provider's import folder (asked once) loaded into the model,
and, for a LoRA run, the identity of that frozen base, which its checkpoints record and a resume checks.

`imported_keys` tells the build, before the model is allocated, which tensors that import fills, so
they are not initialized first only to be overwritten (`materialize_and_initialize(loaded=...)`)."""

from pathlib import Path
from typing import Any

import torch
from torch import nn

from d9d.ckpt import (
    SelectOutputs,
    identity_map,
    load_safetensors,
    safetensors_fingerprint,
    safetensors_shapes,
)
from d9d.mesh import DistributedContext, get_logger
from d9d.parallel import lora_parameter_names
from d9d.parallel.expert import moe_score_bias_names
from d9d.trainer.errors import TrainingError
from d9d.trainer.job.resolve import ResolvedJob
from d9d.trainer.providers.model import (
    ImportsModelWeights,
    PrepareImportModelStageContext,
    PrepareImportModelStageResult,
)

__all__ = ["StartingWeights", "imported_keys"]

_log = get_logger("d9d.trainer")


class StartingWeights:
    """The model provider's import source for one run, and what a LoRA run's frozen base is."""

    def __init__(self, job: ResolvedJob, context: DistributedContext, model: nn.Module) -> None:
        self._job = job
        self._context = context
        self._model = model
        self._import: PrepareImportModelStageResult | None = None
        self._base: dict[str, Any] | None = None

    def source(self) -> PrepareImportModelStageResult | None:
        """The provider's import folder and mapper (asked once), or None when it names none."""
        if self._import is None:
            provider = self._job.model_provider
            if not isinstance(provider, ImportsModelWeights):
                return None
            self._import = provider.prepare_import_model_stage(
                PrepareImportModelStageContext(
                    context=self._context, model=self._model, base_dir=self._job.loaded.base_dir
                )
            )
        return self._import if self._import.folder is not None else None

    def load(self) -> None:
        """Load the import folder, if any, into the model (under peft.lora: all but the adapters)."""
        result = self.source()
        if result is None:
            return
        if self._job.config.peft.lora is not None:
            self.base_reference()  # the base as it is read now is what the checkpoints will name
        target: nn.Module | dict[str, torch.Tensor] = self._model
        fresh = _not_imported(self._job, self._model) | result.fresh
        if fresh:
            state = self._model.state_dict(keep_vars=True)
            target = {name: t for name, t in state.items() if name not in fresh}
        mapper = result.mapper
        if self._context.config.pipeline_parallel > 1:
            # A stage holds part of the model; the mapper may cover all of it (as an export mapper may):
            # the folder is still checked whole, and the stage reads only the groups of keys it holds.
            whole = mapper if mapper is not None else identity_map(list(safetensors_shapes(result.folder)))
            keys = target.state_dict(keep_vars=True) if isinstance(target, nn.Module) else target
            mapper = SelectOutputs(whole, keys)
        load_safetensors(target, result.folder, mapper=mapper)
        _log.info("loaded starting weights", folder=str(result.folder))

    def base_reference(self) -> dict[str, Any]:
        """What a LoRA checkpoint records of its frozen base: the import folder and
        `safetensors_fingerprint` of it (headers and samples of the data of the files the import
        reads), taken when the base is imported; or, without a folder, the seed and `model:` section
        that initialize it."""
        if self._base is None:
            source = self.source()
            if source is None:
                raw = self._job.loaded.raw
                self._base = {
                    "folder": None,
                    "seed": self._job.config.trainer.determinism.seed,
                    "model": raw.get("model") if isinstance(raw, dict) else None,
                }
            else:
                folder = Path(source.folder)
                self._base = {"folder": str(folder.resolve()), "fingerprint": safetensors_fingerprint(folder)}
        return self._base

    def check_base(self, checkpoint: Path, saved: Any) -> None:
        """Refuse to put a LoRA checkpoint's adapters on another base than the one they were trained on.

        Args:
            checkpoint: the checkpoint's directory (for the messages).
            saved: its extra state's `lora_base` (`base_reference()` when it was saved).
        """
        if self._job.config.peft.lora is None:
            raise TrainingError(
                f"checkpoint {checkpoint} holds only LoRA adapters (its run had peft.lora) but this config has "
                "no peft.lora; restore the peft section, or start a new run (another trainer.run.name)"
            )
        if saved == {}:  # its extra state is unreadable: loading it reports the damage and the way out
            return
        now = self.base_reference()
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


def imported_keys(job: ResolvedJob, context: DistributedContext, model: nn.Module) -> frozenset[str]:
    """The state-dict keys of `model` (a pipeline stage, or the whole model; on the meta device) that
    its starting weights fill: on a fresh run the import folder's load (`StartingWeights.load`), which
    writes every key but the training state no folder holds, or else a checkpoint, which holds them
    all. Empty when the provider names no import folder.

    It asks the provider's `prepare_import_model_stage` with this (not yet allocated) model; the
    trainer's `StartingWeights` asks again, once, with the model it loads into.
    """
    provider = job.model_provider
    if not isinstance(provider, ImportsModelWeights):
        return frozenset()
    result = provider.prepare_import_model_stage(
        PrepareImportModelStageContext(context=context, model=model, base_dir=job.loaded.base_dir)
    )
    if result.folder is None:
        return frozenset()
    return frozenset(model.state_dict(keep_vars=True)) - _not_imported(job, model) - result.fresh


def _not_imported(job: ResolvedJob, model: nn.Module) -> set[str]:
    """Training state no pretrained folder holds, which keeps its init: LoRA adapters (the folder is
    the base) and MoE routers' score biases (auxiliary-loss-free balancing starts at zero); the
    provider's own (`PrepareImportModelStageResult.fresh`) come on top."""
    fresh = set(moe_score_bias_names(model))
    if job.config.peft.lora is not None:
        fresh |= set(lora_parameter_names(model))
    return fresh


def _describe_base(reference: dict[str, Any]) -> str:
    """A base reference in words, for the messages of a mismatch."""
    if reference.get("folder") is not None:
        return f"folder {reference['folder']}"
    return f"the initialization of seed {reference.get('seed')} and model {reference.get('model')}"
