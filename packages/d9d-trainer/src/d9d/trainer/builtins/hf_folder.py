"""The built-in model provider of a Hugging Face folder (`d9d.trainer:HFModelProvider`): fine-tune it
from a config file alone, trained by the model d9d ships or by transformers' own class.

    providers: {model: d9d.trainer:HFModelProvider}
    model: {hf_folder: path/to/model, backend: auto}   # config.json + safetensors (+ tokenizer)

`model.backend` chooses the code that trains the folder: the reference model (`d9d.trainer.models`:
qwen3, llama, qwen2, mistral, qwen3_moe, mixtral; every parallelism) or transformers' own class
through `d9d.trainer.hf` (any causal LM; FSDP/HSDP, tensor parallel where verified); "auto" takes
the reference model when it holds the folder's config.json exactly. The model is built on meta,
initialized, then (on a run without checkpoints of its own) filled from the folder's safetensors.
"""

import json
from pathlib import Path
from typing import Any, Literal

import msgspec
from torch import nn

from d9d.ckpt import SafetensorsIOError, check_safetensors, safetensors_shapes
from d9d.data import TokenizerError, load_tokenizer
from d9d.mesh import MeshConfig
from d9d.trainer.builtins.reference_model import parallelize_reference_model, reference_export
from d9d.trainer.config.base import ConfigPath
from d9d.trainer.models.config import (
    HeadConfig,
    ReferenceModelConfig,
    SlidingWindowError,
    check_sequence_length,
)
from d9d.trainer.models.heads import build_reference_model, check_head_export
from d9d.trainer.models.hf_config import HFConversionError, read_hf_config
from d9d.trainer.models.hf_weights import (
    head_fresh_keys,
    hf_checkpoint_keys,
    hf_expert_layout,
    hf_import_mapper,
)
from d9d.trainer.models.parallelize import check_mesh, trim_to_stage
from d9d.trainer.providers.model import (
    CheckSequenceLengthContext,
    InitializeModelStageContext,
    InitializeModelStageResult,
    ParallelizeModelStageContext,
    PrepareExportModelStageContext,
    PrepareExportModelStageResult,
    PrepareImportModelStageContext,
    PrepareImportModelStageResult,
)

__all__ = ["HFModelConfig", "HFModelProvider"]


class HFModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The `model:` section: which Hugging Face folder to start from, and which code trains it.

    Attributes:
        hf_folder: config.json plus model.safetensors (or shards + index), relative to the config file.
        backend: "reference" (the reference model: every parallelism d9d has; qwen3, llama, qwen2,
            mistral, qwen3_moe, mixtral), "hf" (transformers' own model class, `d9d.trainer.hf`: any
            causal LM, FSDP/HSDP, tensor parallel where it is verified) or "auto" (the reference
            model when it can hold the folder's config.json exactly and the sequences fit its sliding
            window, else transformers'; the "job built" line says which and why).
        fp32_logits: return float32 logits whatever the parameter dtype.
        head: a classification head or an embedding output instead of the LM head (`kind:
            classification` with `num_labels`, or `embedding` with `pooling` and `normalize`); its
            padding token defaults to config.json's `pad_token_id`. A causal LM's folder gives a fresh
            score head, one saved by `AutoModelForSequenceClassification` its own.
    """

    hf_folder: ConfigPath
    backend: Literal["auto", "reference", "hf"] = "auto"
    fp32_logits: bool = False
    head: HeadConfig | None = None


class HFModelProvider:
    """A Hugging Face folder, trained by the reference model or by transformers' (`model.backend`).

    The choice is made once, here, from the folder's config.json; every stage then goes to the chosen
    path: the reference model (shaped by the config, tensor/expert/pipeline/context parallel, imported
    through `hf_import_mapper`) or `d9d.trainer.hf.HFCausalLMProvider` (which refuses what it cannot split).
    """

    config_type = HFModelConfig

    def __init__(self, config: HFModelConfig) -> None:
        self.config = config
        self.folder = Path(config.hf_folder)
        self.model_type = _model_type(self.folder)
        self.reason = ""  # why "auto" chose transformers' model
        self.model_config: ReferenceModelConfig | None = None
        self.hf: Any = None  # d9d.trainer.hf.HFCausalLMProvider when the backend is "hf"
        self._mesh: MeshConfig | None = None  # the mesh check_mesh saw
        if config.backend != "hf":
            try:
                head = _with_folder_pad(config.head, self.folder)
                self.model_config = read_hf_config(self.folder, fp32_logits=config.fp32_logits, head=head)
            except HFConversionError as error:
                if config.backend == "reference" or not (self.folder / "config.json").is_file():
                    raise
                self.reason = str(error)
        if self.model_config is None:
            self.hf = _hf_provider(self.folder, config, self.reason)

    @property
    def backend(self) -> str:
        return "reference" if self.model_config is not None else "hf"

    def _reference(self) -> ReferenceModelConfig:
        if self.model_config is None:  # only the reference path calls this
            raise HFConversionError(f"{self.folder}: model.backend is hf; {self.reason}")
        return self.model_config

    def describe_model(self) -> dict[str, str]:
        """The "job built" line's account: which code trains the folder, and why when "auto" chose."""
        described = {"backend": self.backend, "model_type": self.model_type}
        if self.reason:
            described["backend_reason"] = self.reason
        return described

    def check_mesh(self, mesh: MeshConfig) -> None:
        self._mesh = mesh  # checked again should "auto" move to transformers' model for the sequences
        if self.hf is not None:
            self.hf.check_mesh(mesh)  # pp/cp/ep, and tp it cannot split: the message names the reference path
        else:
            check_mesh(self._reference(), mesh)

    def check_sequence_length(self, context: CheckSequenceLengthContext) -> None:
        """The reference model attends to the whole sequence: longer than a sliding window is refused
        with `model.backend: reference`; "auto" then trains transformers' model, which applies its
        windows itself (the plan asks before anything is built), after checking the mesh on it."""
        if self.model_config is None:
            return
        try:
            check_sequence_length(self.model_config, context.seq_len)
        except SlidingWindowError as error:
            if self.config.backend == "reference":
                raise
            self.model_config, self.reason = None, str(error)
            self.hf = _hf_provider(self.folder, self.config, self.reason)
            if self._mesh is not None:
                self.hf.check_mesh(self._mesh)

    def pipeline_num_layers(self) -> int:
        return self._reference().num_layers

    def initialize_model_stage(self, context: InitializeModelStageContext) -> InitializeModelStageResult:
        if self.hf is not None:
            return self.hf.initialize_model_stage(context)
        model = build_reference_model(self._reference())
        if context.stage is not None:  # pipeline parallel: keep this stage's part (on meta: free)
            trim_to_stage(model, context.stage)
        else:  # the whole model: the folder's weights checked against it before anything is written
            self._check_folder_weights(model)
        return InitializeModelStageResult(model=model)

    def _check_folder_weights(self, model: nn.Module) -> None:
        """Refuse weights that config.json does not describe (from the safetensors headers: none read)."""
        safetensors_shapes(self.folder)  # a missing or stray shard: d9d.ckpt's own line names it
        keys = hf_checkpoint_keys(self.folder)
        mapper = hf_import_mapper(self._reference(), source_keys=keys)
        fresh = head_fresh_keys(self._reference(), keys)  # a classifier's score on a causal LM's folder
        target = {k: v for k, v in model.state_dict().items() if k not in fresh} if fresh else model
        try:
            check_safetensors(target, self.folder, mapper=mapper)
        except SafetensorsIOError as exc:
            raise HFConversionError(
                f"model.hf_folder: {self.folder / 'config.json'} does not describe the weights beside it "
                f"({exc}); use the config.json they were saved with"
            ) from None

    def parallelize_model_stage(self, context: ParallelizeModelStageContext) -> None:
        if self.hf is not None:
            self.hf.parallelize_model_stage(context)
            return
        parallelize_reference_model(context.model, context)

    def prepare_import_model_stage(
        self, context: PrepareImportModelStageContext
    ) -> PrepareImportModelStageResult:
        """The trainer loads this once, into the initialized (and parallelized) model, on a fresh run."""
        if self.hf is not None:
            return self.hf.prepare_import_model_stage(context)
        keys = hf_checkpoint_keys(self.folder)
        mapper = hf_import_mapper(self._reference(), source_keys=keys)
        fresh = head_fresh_keys(self._reference(), keys)
        return PrepareImportModelStageResult(folder=self.folder, mapper=mapper, fresh=fresh)

    def prepare_export_model_stage(
        self, context: PrepareExportModelStageContext
    ) -> PrepareExportModelStageResult:
        if self.hf is not None:
            return self.hf.prepare_export_model_stage(context)
        config = self._reference()
        check_head_export(context.model, config, whole=context.context.config.pipeline_parallel == 1)
        # MoE experts are written in the layout the folder had (per expert, or transformers 5's fused)
        layout = hf_expert_layout(hf_checkpoint_keys(self.folder)) if config.moe is not None else "per_expert"
        return reference_export(config, layout)


def _model_type(folder: Path) -> str:
    """config.json's model_type ("?" when it has none; a missing or broken file is refused later)."""
    try:
        model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return "?"
    return str(model_type) if model_type else "?"


def _with_folder_pad(head: HeadConfig | None, folder: Path) -> HeadConfig | None:
    """`head` with config.json's `pad_token_id` where the head names none, else the folder's tokenizer's
    pad token (the id d9d's datasets pad rows with): a score or pooled embedding never reads a padding
    token, and the export's config.json names it, as transformers needs for batches."""
    if head is None or head.pad_token_id is not None:
        return head
    try:
        pad = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("pad_token_id")
    except (OSError, ValueError, AttributeError):
        return head  # a missing or broken config.json is refused by read_hf_config
    if not isinstance(pad, int) and (folder / "tokenizer.json").is_file():
        try:
            pad = load_tokenizer(folder).pad_id
        except TokenizerError:  # no tokenizers package, or a tokenizer it cannot read: no padding token known
            pad = None
    return msgspec.structs.replace(head, pad_token_id=pad if isinstance(pad, int) else None)


def _hf_provider(folder: Path, config: HFModelConfig, reason: str) -> Any:
    """`d9d.trainer.hf.HFCausalLMProvider` for `folder` (transformers is an optional extra)."""
    try:
        from d9d.trainer.hf import HFCausalLMConfig, HFCausalLMProvider
    except ImportError as missing:  # one line: why this folder needs it, and how to install it
        why = f"{reason}; transformers' model would train it, but {missing}" if reason else str(missing)
        raise HFConversionError(why) from None
    return HFCausalLMProvider(
        HFCausalLMConfig(folder=str(folder), fp32_logits=config.fp32_logits, head=config.head)
    )
