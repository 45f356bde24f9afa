"""Quickstart: train a small Llama/Qwen3-style model on the corpus in examples/data.

    python train.py config.yaml                              # one device, no process group
    torchrun --nproc-per-node 2 train.py config.yaml --set mesh.data_parallel_shard=2
    uv run d9d train config.yaml                             # the same job through the CLI

The job is described by config.yaml; this file holds the two providers it names.
"""

import json
from pathlib import Path

import msgspec

from d9d.data import TextDataset
from d9d.mesh import MeshConfig
from d9d.parallel import apply_lora, parallelize_context_parallel, parallelize_decoder
from d9d.trainer import main
from d9d.trainer.models import (
    ReferenceForCausalLM,
    ReferenceModelConfig,
    apply_expert_parallel,
    apply_tensor_parallel,
    check_mesh,
    check_sequence_length,
    decoder_parts,
    hf_export_mapper,
    to_hf_config,
    trim_to_stage,
)
from d9d.trainer.providers import (
    BuildDatasetContext,
    BuildDatasetResult,
    CheckSequenceLengthContext,
    InitializeModelStageContext,
    InitializeModelStageResult,
    ParallelizeModelStageContext,
    PrepareExportModelStageContext,
    PrepareExportModelStageResult,
)


class QuickstartModelProvider:
    """Builds the reference model; tensor and expert parallel when the mesh asks, then HSDP.

    `parallelize_decoder` gives DDP, FSDP or both, depending on which data-parallel degrees are > 1.
    """

    config_type = ReferenceModelConfig

    def __init__(self, config: ReferenceModelConfig) -> None:
        self.config = config

    def initialize_model_stage(self, context: InitializeModelStageContext) -> InitializeModelStageResult:
        model = ReferenceForCausalLM(self.config)
        if context.stage is not None:  # pipeline parallel: keep this stage's part (on meta: free)
            trim_to_stage(model, context.stage)
        return InitializeModelStageResult(model=model)

    def pipeline_num_layers(self) -> int:
        return self.config.num_layers

    def check_mesh(self, mesh: MeshConfig) -> None:
        """Refuse degrees the model cannot be split by (heads by tp, experts by ep, layers by pp)."""
        check_mesh(self.config, mesh)

    def check_sequence_length(self, context: CheckSequenceLengthContext) -> None:
        """Refuse sequences longer than model.sliding_window (the model attends to the whole sequence)."""
        check_sequence_length(self.config, context.seq_len)

    def parallelize_model_stage(self, context: ParallelizeModelStageContext) -> None:
        """Called on every mesh, one process too (there context.mesh is None and HSDP does nothing)."""
        model, ctx = context.model, context.context
        apply_tensor_parallel(model, ctx)
        apply_expert_parallel(model, ctx, context.precision)
        parallelize_context_parallel(model, context.mesh)  # mesh.context_parallel: attention over cp ranks
        if context.lora is not None:  # peft.lora: adapters follow the TP layout, FSDP shards them below
            apply_lora(model, context.lora)
        # per layer: activation checkpointing, then compile; then one FSDP unit per layer, one for the
        # embedding and one for [norm, lm_head] (DDP, FSDP or HSDP as the mesh says)
        parallelize_decoder(
            model,
            context.mesh,
            blocks=list(model.model.layers.values()),
            **decoder_parts(model),  # the embedding, final norm and head this stage holds
            activation_checkpointing=context.activation_checkpointing,  # trainer.activation_checkpointing
            compile=context.compile,  # trainer.compile
            precision=context.precision,  # trainer.precision: FSDP gathers in the compute dtype
            cpu_offload=context.cpu_offload,  # trainer.memory.cpu_offload: FSDP2 keeps the state on the host
        )

    def prepare_export_model_stage(
        self, context: PrepareExportModelStageContext
    ) -> PrepareExportModelStageResult:
        # A Hugging Face folder (the architecture hf_model_type names: qwen3, llama, qwen2, mistral, ...)
        config_json = json.dumps(to_hf_config(self.config), indent=2)
        return PrepareExportModelStageResult(
            mapper=hf_export_mapper(self.config), extra_files={"config.json": config_json}
        )


class CorpusConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: str = "../data/corpus.txt"
    seq_len: int = 128


class CorpusProvider:
    """The public-domain corpus, byte-tokenized and packed into seq_len samples."""

    config_type = CorpusConfig

    def __init__(self, config: CorpusConfig) -> None:
        self.config = config

    def build_dataset(self, context: BuildDatasetContext) -> BuildDatasetResult:
        return BuildDatasetResult(
            dataset=TextDataset(Path(context.base_dir) / self.config.path, self.config.seq_len)
        )


if __name__ == "__main__":
    main()
