"""A d9d project (written by `d9d init`): a small Llama-style language model trained on corpus.txt.

    python train.py config.yaml                          # one process (CPU or one GPU)
    d9d train config.yaml                                # the same job through the CLI
    torchrun --nproc-per-node 2 -m d9d.cli train config.yaml --set mesh.data_parallel_shard=2

The job is described by config.yaml; this file holds the two providers it names, yours to edit. The
model is d9d's Llama/Qwen-family decoder (`d9d.trainer.models`, configured by the `model:` section):
its export is a Hugging Face folder that transformers loads with the same logits. To train your own
`nn.Module` instead, build it in `initialize_model_stage` and shard it in `parallelize_model_stage`.
"""

import json

import msgspec

from d9d.data import TextDataset
from d9d.mesh import MeshConfig
from d9d.parallel import apply_lora, parallelize_context_parallel, parallelize_decoder
from d9d.trainer import ConfigPath, main
from d9d.trainer.models import (
    ReferenceForCausalLM,
    ReferenceModelConfig,
    apply_expert_parallel,
    apply_tensor_parallel,
    check_mesh,
    decoder_parts,
    hf_export_mapper,
    to_hf_config,
    trim_to_stage,
)
from d9d.trainer.providers import (
    BuildDatasetContext,
    BuildDatasetResult,
    InitializeModelStageContext,
    InitializeModelStageResult,
    ParallelizeModelStageContext,
    PrepareExportModelStageContext,
    PrepareExportModelStageResult,
)


class ModelProvider:
    """Builds the model on the meta device, then distributes it as the mesh says."""

    config_type = ReferenceModelConfig

    def __init__(self, config: ReferenceModelConfig) -> None:
        self.config = config

    def initialize_model_stage(self, context: InitializeModelStageContext) -> InitializeModelStageResult:
        model = ReferenceForCausalLM(self.config)
        if context.stage is not None:  # mesh.pipeline_parallel > 1: keep this stage's layers
            trim_to_stage(model, context.stage)
        return InitializeModelStageResult(model=model)

    def pipeline_num_layers(self) -> int:
        return self.config.num_layers

    def check_mesh(self, mesh: MeshConfig) -> None:
        """Refuse degrees the model cannot be split by (heads by tp, experts by ep, layers by pp)."""
        check_mesh(self.config, mesh)

    def parallelize_model_stage(self, context: ParallelizeModelStageContext) -> None:
        """Called on every mesh (one process too: then context.mesh is None and sharding is a no-op)."""
        model, ctx = context.model, context.context
        apply_tensor_parallel(model, ctx)  # mesh.tensor_parallel: heads and MLP columns split
        apply_expert_parallel(model, ctx, context.precision)  # mesh.expert_parallel (model.moe)
        parallelize_context_parallel(model, context.mesh)  # mesh.context_parallel: long sequences
        if context.lora is not None:  # peft.lora: adapters on the frozen weights
            apply_lora(model, context.lora)
        # Per layer: activation checkpointing, then compile. Then one FSDP unit per layer, one for the
        # embedding, one for [norm, lm_head]: only one unit's full weights live at a time.
        parallelize_decoder(
            model,
            context.mesh,
            blocks=list(model.model.layers.values()),
            **decoder_parts(model),
            activation_checkpointing=context.activation_checkpointing,  # trainer.activation_checkpointing
            compile=context.compile,  # trainer.compile
            precision=context.precision,  # trainer.precision: FSDP gathers in the compute dtype
            cpu_offload=context.cpu_offload,  # trainer.memory.cpu_offload
        )

    def prepare_export_model_stage(
        self, context: PrepareExportModelStageContext
    ) -> PrepareExportModelStageResult:
        """A Hugging Face folder: the weights under transformers' names, and its config.json."""
        config_json = json.dumps(to_hf_config(self.config), indent=2)
        return PrepareExportModelStageResult(
            mapper=hf_export_mapper(self.config), extra_files={"config.json": config_json}
        )


class CorpusConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The `dataset:` section (a `ConfigPath` arrives absolute: relative paths are taken from the
    config file's directory, wherever the job is started from)."""

    path: ConfigPath = ConfigPath("corpus.txt")
    seq_len: int = 128


class CorpusProvider:
    """A text file, byte-tokenized and packed into samples of seq_len tokens."""

    config_type = CorpusConfig

    def __init__(self, config: CorpusConfig) -> None:
        self.config = config

    def build_dataset(self, context: BuildDatasetContext) -> BuildDatasetResult:
        return BuildDatasetResult(dataset=TextDataset(self.config.path, self.config.seq_len))


if __name__ == "__main__":
    main()
