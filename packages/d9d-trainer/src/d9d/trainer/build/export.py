"""`Trainer.export()`: the model as safetensors (Hugging Face's sharded layout) through the model
provider's export mapper, with the run's tokenizer files beside it; a LoRA run's adapters in PEFT's
layout and/or the merged model; on a pipeline-parallel mesh one mapper over the whole model from the
stages' own."""

import json
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from d9d.ckpt import MappingError, Parallel, StateMapper, StreamDestination, save_safetensors, stream_weights
from d9d.data import copy_tokenizer_files
from d9d.mesh import DistributedContext, get_logger
from d9d.parallel import (
    lazily_merged_state,
    lora_state_dict,
    merged_state_dict,
    peft_adapter_config,
    peft_key,
)
from d9d.trainer.build.starting_weights import StartingWeights
from d9d.trainer.errors import TrainingError
from d9d.trainer.job.resolve import ResolvedJob
from d9d.trainer.providers.model import PrepareExportModelStageContext, PrepareExportModelStageResult

__all__ = ["Exporter"]

_log = get_logger("d9d.trainer")


class Exporter:
    """Writes one run's model (or its LoRA adapters) as `export:` says."""

    def __init__(
        self,
        job: ResolvedJob,
        context: DistributedContext,
        model: nn.Module,
        starting: StartingWeights,
        *,
        pipelined: bool = False,
        tokenizer_files: Callable[[], Mapping[str, Path]] = dict,
    ) -> None:
        """`starting`: the run's starting weights, the base a LoRA adapter export names.
        `tokenizer_files`: the run's tokenizer files (`RunTokenizer.files`), which a model export carries."""
        self._job = job
        self._context = context
        self._model = model
        self._starting = starting
        self._pipelined = pipelined
        self._tokenizer_files = tokenizer_files

    def export(self, out_dir: str | Path | None = None) -> Path:
        """Write the model as safetensors through the model provider's export mapper.

        `out_dir` (a caller's path) is taken as given; `export.dir` of the config is relative to the
        config file's directory, like every path of the config.

        On a pipeline-parallel mesh each rank passes only its own stages (the model's state dict,
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
        in `adapter/` and `merged/`. The model (whole or merged) goes with the run's tokenizer files
        (tokenizer.json, tokenizer_config.json, ...; none for the byte tokenizer), so the folder is
        complete for transformers; adapters name their base, whose tokenizer they use.
        """
        target = out_dir if out_dir is not None else self._job.loaded.paths.export_dir
        if target is None:
            raise TrainingError("no export directory: pass one or set export.dir in the config")
        target = Path(target)
        if self._job.config.peft.lora is None:
            return self._export_model(target, self._model)
        mode = self._job.config.export.lora
        if mode == "adapter":
            return self._export_lora(target)
        if mode == "merged":
            return self._export_model(target, merged_state_dict(self._model))
        self._export_lora(target / "adapter")
        self._export_model(target / "merged", merged_state_dict(self._model))
        return target

    def _export_model(self, target: Path, source: nn.Module | dict[str, torch.Tensor]) -> Path:
        """`source` (the model, or a state dict under its names) through the provider's export mapper."""
        result = self._export_stage()
        weights = save_safetensors(
            source,
            target,
            mapper=self._whole_mapper(result.mapper),
            max_shard_size=self._job.config.export.shard_size_mb * 2**20,
        )
        files = sorted(result.extra_files)
        if self._context.is_main_process:
            tokenizer = {n: p for n, p in self._tokenizer_files().items() if n not in result.extra_files}
            files += copy_tokenizer_files(tokenizer, target) if tokenizer else []  # the provider's own win
            for name, text in result.extra_files.items():
                path = Path(target) / name
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text(text, encoding="utf-8")
                tmp.replace(path)
        self._context.barrier()
        if self._context.is_main_process:  # one line for the job (every rank's would be the same)
            _log.info("exported", dir=str(target), weights=sorted(set(weights.values())), files=sorted(files))
        return Path(target)

    def stream(
        self, dtype: torch.dtype | None, bucket_bytes: int, destination: StreamDestination
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The tensors a model export writes (a LoRA run's merged model), in buckets: `stream_weights`.

        Parameters are cast to `dtype`, buffers keep theirs. Every rank calls it and iterates it to the
        end (the buckets are collectives); a LoRA run's weights are merged with their adapters one at a
        time, as each is gathered.
        """
        mapper = self._whole_mapper(self._export_stage().mapper)
        state, merge = dict(self._model.state_dict()), None
        if self._job.config.peft.lora is not None:
            state, merge = lazily_merged_state(self._model)  # merged one weight at a time
        params = {name for name, _ in self._model.named_parameters(remove_duplicate=False)}
        buffers = [key for key in state if key not in params]
        return stream_weights(
            state, mapper=mapper, dtype=dtype, bucket_bytes=bucket_bytes, destination=destination,
            keep_dtype=buffers, resolve=merge,
        )  # fmt: skip

    def _export_stage(self) -> PrepareExportModelStageResult:
        """The model provider's export mapper and extra files."""
        return self._job.model_provider.prepare_export_model_stage(
            PrepareExportModelStageContext(
                context=self._context, model=self._model, base_dir=self._job.loaded.base_dir
            )
        )

    def _whole_mapper(self, mapper: StateMapper | None) -> StateMapper | None:
        """The stage's export mapper, over the whole model on a pipeline-parallel mesh."""
        if self._pipelined and mapper is not None:
            return _whole_model_mapper(mapper, self._context.mesh("dense")["pp"].get_group())
        return mapper

    def _export_lora(self, target: Path) -> Path:
        """Write `adapter_config.json` and `adapter_model.safetensors`, as `peft.PeftModel` loads them.

        Every rank passes its adapters (its shards, its pipeline stages) to `save_safetensors` under
        PEFT's keys, which assembles them on rank 0 (all ranks call it). The base weights are frozen, so
        the base is the run's starting point: `base_model_name_or_path` is the provider's import folder
        when it names one, else "." (the initial weights, which a run without `peft.lora` exports).
        The reference model's module paths are Hugging Face's, so adapter keys need no renaming.
        """
        lora = self._job.config.peft.lora
        assert lora is not None
        state = {peft_key(name): tensor for name, tensor in lora_state_dict(self._model).items()}
        staging = target / ".adapter-export"
        save_safetensors(state, staging, max_shard_size=2**62)  # one file, whatever its size
        if self._context.is_main_process:
            (staging / "model.safetensors").replace(target / "adapter_model.safetensors")
            shutil.rmtree(staging)
            config = peft_adapter_config(lora, base_model_name_or_path=self._lora_base())
            tmp = target / "adapter_config.json.tmp"
            tmp.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
            tmp.replace(target / "adapter_config.json")
        self._context.barrier()
        if self._context.is_main_process:  # one line for the job; `tensors`: the file's (every stage's)
            from safetensors import safe_open

            with safe_open(str(target / "adapter_model.safetensors"), "pt") as written:
                count = len(list(written.keys()))
            _log.info("exported LoRA adapters", dir=str(target), tensors=count)
        return target

    def _lora_base(self) -> str:
        """The adapters' `base_model_name_or_path`: the import folder, or "." for the initial weights."""
        source = self._starting.source()
        return str(source.folder) if source is not None else "."


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
