"""`HFCausalLMProvider`: any causal LM transformers ships, trained from a local Hugging Face folder.

    providers:
      model: d9d.trainer.hf:HFCausalLMProvider
    model:
      folder: models/my-hf-model        # config.json + *.safetensors, relative to this file

The model is built by `AutoModelForCausalLM.from_config` on the meta device (float32 master
weights), split by tensor parallelism (transformers' tp plan) and context parallelism (d9d's
context-parallel attention as a transformers attention implementation, `hf.context_parallel`),
shaped per decoder layer (LoRA, then d9d's decoder rule: activation checkpointing and compile per
layer, FSDP2/HSDP units per layer, for the embedding and for [final norm, LM head]), then
materialized: each rank allocates its shards, and only what the folder does not hold (rotary tables,
LoRA adapters) is initialized, by transformers' own `_init_weights`; a fresh run then fills the rest
from the folder (each rank reads only its shards), so no rank holds more than its shard of the model
plus one module. Exports are Hugging Face folders again. What the backend cannot do yet is refused
with the reason before anything is built (`check_mesh`).
"""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from d9d.ckpt import safetensors_shapes
from d9d.mesh import MeshConfig, first_line
from d9d.parallel import apply_lora, parallelize_decoder
from d9d.trainer.hf.config import HFCausalLMConfig
from d9d.trainer.hf.context_parallel import apply_context_parallel, context_parallel_problem
from d9d.trainer.hf.conversion import SavedFormat
from d9d.trainer.hf.errors import HFModelError
from d9d.trainer.hf.folder import (
    CONFIG_FILE,
    HFFolder,
    attention_implementation,
    exported_config,
    quiet_transformers,
    read_folder,
)
from d9d.trainer.hf.heads import build_head_model, exported_architecture, head_problem, head_weight
from d9d.trainer.hf.model import HFCausalLM, base_model_path, fuse_head_loss, unwrap
from d9d.trainer.hf.tensor_parallel import (
    TENSOR_PARALLEL_ARCHITECTURES,
    apply_tensor_parallel,
    tensor_parallel_problem,
)
from d9d.trainer.hf.weights import check_folder_weights, export_mapper, fresh_keys, import_mapper
from d9d.trainer.providers.model import (
    InitializeModelStageContext,
    InitializeModelStageResult,
    ParallelizeModelStageContext,
    PrepareExportModelStageContext,
    PrepareExportModelStageResult,
    PrepareImportModelStageContext,
    PrepareImportModelStageResult,
)

__all__ = ["HFCausalLMProvider", "context_parallel_refusal", "mesh_refusal", "tensor_parallel_refusal"]

_SPEC = "d9d.trainer.hf:HFCausalLMProvider"
_DENSE_AND_MOE = "llama, qwen2, qwen3, mistral, mixtral and qwen3_moe"
#: The model types the reference model (`d9d.trainer.models`) also trains, with every parallelism.
_REFERENCE_TYPES = frozenset(("llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe"))
#: Mesh degree → (what the backend lacks, the families whose reference model has it).
_UNSUPPORTED: dict[str, tuple[str, str]] = {
    "pipeline_parallel": (
        "pipeline parallelism: it runs transformers' whole forward, which it does not cut into stages",
        _DENSE_AND_MOE,
    ),
    "expert_parallel": (
        "expert parallelism: transformers' MoE layers have no expert dispatch (FSDP shards experts "
        "like every other weight)",
        "mixtral and qwen3_moe",
    ),
}


def mesh_refusal(mesh: MeshConfig) -> str | None:
    """Why the Hugging Face backend cannot run on `mesh` (the first degree it lacks for every model), or
    None. Tensor parallelism depends on the model: `tensor_parallel_refusal`."""
    for key, (lacks, families) in _UNSUPPORTED.items():
        degree = getattr(mesh, key)
        if degree > 1:
            return (
                f"mesh.{key}={degree}: the Hugging Face backend ({_SPEC}) has no {lacks}; set mesh.{key}: 1, "
                f"or for {families} train the reference model, which has it (model.backend: reference, "
                "d9d.trainer:HFModelProvider)"
            )
    return None


def context_parallel_refusal(folder: HFFolder, cp: int) -> str | None:
    """Why the folder's model cannot be trained at `mesh.context_parallel=cp`, or None (from its config.json)."""
    problem = context_parallel_problem(folder.model_class, folder.config)
    if problem is None:
        return None
    reference = (
        ", or train it with the reference model, which splits its sequences (model.backend: reference, "
        "d9d.trainer:HFModelProvider)"
        if folder.model_type in _REFERENCE_TYPES
        else ""
    )
    return (
        f"mesh.context_parallel={cp}: the Hugging Face backend ({_SPEC}) cannot split the sequence of "
        f"{folder.path / CONFIG_FILE}'s model: {problem}; set mesh.context_parallel: 1{reference}"
    )


def tensor_parallel_refusal(folder: HFFolder, tp: int) -> str | None:
    """Why the folder's model cannot be trained at `mesh.tensor_parallel=tp`, or None (from its
    config.json and safetensors headers: nothing is built)."""
    problem = tensor_parallel_problem(
        folder.config, tp, prefix=base_model_path(folder.model_class), shapes=safetensors_shapes(folder.path)
    )
    if problem is None:
        return None
    reference = (
        f", or for {_DENSE_AND_MOE} train the reference model (model.backend: reference, d9d.trainer:HFModelProvider)"
        if folder.model_type not in TENSOR_PARALLEL_ARCHITECTURES
        else ""
    )
    return (
        f"mesh.tensor_parallel={tp}: the Hugging Face backend ({_SPEC}) cannot split {folder.path / CONFIG_FILE}'s "
        f"model: {problem}; set mesh.tensor_parallel: 1{reference}"
    )


class HFCausalLMProvider:
    """The model provider of any transformers causal LM (`AutoModelForCausalLM`) in a local folder.

    Declares `ChecksMesh` (refusing what it cannot split) and `ImportsModelWeights` (the folder's
    safetensors on a fresh run). The model is an `HFCausalLM`, so checkpoint, export and LoRA keys
    are Hugging Face's module paths.
    """

    config_type = HFCausalLMConfig

    def __init__(self, config: HFCausalLMConfig) -> None:
        self.config = config
        self._folder: HFFolder | None = None
        self._saved: SavedFormat | None = None  # the folder's checkpoint layout, when not the model's own

    def check_mesh(self, mesh: MeshConfig) -> None:
        """Refuse pipeline and expert parallelism, and tensor or context parallelism of a model the
        backend cannot split exactly (reading the folder's config.json and safetensors headers).

        Raises:
            HFModelError: one line naming the mesh key, the reason and the reference path where there
                is one (or the folder's problem, when tensor parallelism has to read it).
        """
        problem = mesh_refusal(mesh)
        if problem is None and self.config.head is not None:
            problem = head_problem(read_folder(Path(self.config.folder).resolve()), self.config.head)
        if problem is None and self.config.head is not None and mesh.tensor_parallel > 1:
            problem = (
                f"mesh.tensor_parallel={mesh.tensor_parallel} with model.head: the Hugging Face backend "
                f"({_SPEC}) has no tensor-parallel plan for the head; set mesh.tensor_parallel: 1, or for "
                f"{_DENSE_AND_MOE} train the reference model (model.backend: reference, d9d.trainer:HFModelProvider)"
            )
        if problem is None and mesh.tensor_parallel > 1:
            problem = tensor_parallel_refusal(
                read_folder(Path(self.config.folder).resolve()), mesh.tensor_parallel
            )
        if problem is None and mesh.context_parallel > 1:
            problem = context_parallel_refusal(
                read_folder(Path(self.config.folder).resolve()), mesh.context_parallel
            )
        if problem is not None:
            raise HFModelError(problem)

    def initialize_model_stage(self, context: InitializeModelStageContext) -> InitializeModelStageResult:
        """The folder's architecture built on the meta device, in float32, after its weights are checked
        against it (from the safetensors headers: nothing is read, allocated or written before)."""
        if context.stage is not None:
            raise HFModelError(mesh_refusal(MeshConfig(pipeline_parallel=context.num_stages)) or "")
        folder = read_folder((Path(context.base_dir) / self.config.folder).resolve())
        kernel = context.attention.configured if context.attention is not None else "auto"
        attention = attention_implementation(folder, self.config.attention, kernel)
        head = self.config.head
        try:
            if (
                head is not None
            ):  # transformers' classifier of the architecture (score dropped for embeddings)
                hf_model = build_head_model(folder, head, attention)
            else:
                with quiet_transformers():
                    hf_model = AutoModelForCausalLM.from_config(
                        folder.config, dtype=torch.float32, attn_implementation=attention
                    )
        except (ValueError, TypeError, KeyError, AssertionError) as exc:
            raise HFModelError(
                f"{folder.path / CONFIG_FILE}: transformers cannot build {folder.model_class.__name__} "
                f"from it ({type(exc).__name__}: {first_line(exc)}); fix config.json"
            ) from None
        model = HFCausalLM(hf_model, fp32_logits=self.config.fp32_logits, head=head)
        self._saved = check_folder_weights(model, folder.path)
        self._folder = folder
        return InitializeModelStageResult(model=model)

    def parallelize_model_stage(self, context: ParallelizeModelStageContext) -> None:
        """LoRA, then `parallelize_decoder`: activation checkpointing and compile per decoder layer, FSDP2
        units per decoder layer, for the embedding and for [final norm, LM head] (DDP/FSDP/HSDP by the mesh)."""
        model = unwrap(context.model)
        blocks = model.decoder_layers()
        if not blocks:
            raise HFModelError(
                f"{type(model.hf_model).__name__} names no decoder-layer class (_no_split_modules), so "
                "it cannot be sharded per layer; train it with a model provider of its own"
            )
        tp = context.context.axis_size("tp")
        if tp > 1:
            shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
            problem = tensor_parallel_problem(model.config, tp, prefix=model.base_model_path, shapes=shapes)
            if problem is not None:  # check_mesh refuses it first; a caller that skipped it gets the reason
                raise HFModelError(f"mesh.tensor_parallel={tp}: {problem}")
            apply_tensor_parallel(model, model.config, model.base_model_path, context.context)
        if context.context.axis_size("cp") > 1:
            problem = context_parallel_problem(type(model.hf_model), model.config)
            if problem is not None:  # check_mesh refuses it first
                raise HFModelError(f"mesh.context_parallel: {problem}")
            apply_context_parallel(model, model.hf_model, context.mesh)
        if context.lora is not None:
            apply_lora(model, context.lora)
        if model.head is None:
            fuse_head_loss(model, context.loss)  # trainer.loss: where the architecture's head is plain
        parallelize_decoder(
            model,
            context.mesh,
            blocks=blocks,
            embedding=model.get_input_embeddings(),
            final_norm=model.final_norm(),
            head=model.get_output_embeddings() if model.head is None else head_weight(model.hf_model),
            activation_checkpointing=context.activation_checkpointing,
            compile=context.compile,
            precision=context.precision,
            cpu_offload=context.cpu_offload,
        )

    def prepare_import_model_stage(
        self, context: PrepareImportModelStageContext
    ) -> PrepareImportModelStageResult:
        """The folder, read into the model under Hugging Face's names (tied tensors read once)."""
        folder = self._built_folder()
        layout, shapes = unwrap(context.model).layout, safetensors_shapes(folder.path)
        mapper = import_mapper(layout, shapes, self._saved)
        return PrepareImportModelStageResult(
            folder=folder.path, mapper=mapper, fresh=fresh_keys(layout, shapes)
        )

    def prepare_export_model_stage(
        self, context: PrepareExportModelStageContext
    ) -> PrepareExportModelStageResult:
        """A folder `AutoModelForCausalLM.from_pretrained` loads: safetensors under Hugging Face's
        names (in the folder's layout: one weight per MoE expert if it had that), config.json (float32),
        and the folder's generation_config.json when it has one."""
        folder = self._built_folder()
        model = unwrap(context.model)
        config_json = exported_config(model.config, exported_architecture(model))
        return PrepareExportModelStageResult(
            mapper=export_mapper(model.layout, self._saved),
            extra_files={CONFIG_FILE: config_json, **folder.copied_files()},
        )

    def _built_folder(self) -> HFFolder:
        if self._folder is None:
            raise HFModelError(f"{_SPEC}: initialize_model_stage has not run yet")
        return self._folder
