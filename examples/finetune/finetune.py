"""Fine-tune the reference model from a Hugging Face folder (Qwen3, Llama or Qwen3-MoE layout).

    python finetune.py make-demo hf_demo        # a tiny random Qwen3 folder to try it on (no download)
    python finetune.py config.yaml              # fine-tune it; export.dir gets the result in the HF layout
    torchrun --nproc-per-node 2 finetune.py config.yaml --set mesh.data_parallel_shard=2

The model is built from the folder's config.json, initialized, then (on a run without checkpoints
of its own) filled from the folder's safetensors through `hf_import_mapper`.
"""

import json
import sys
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the reference model lives in examples/

from reference_model import (
    ReferenceForCausalLM,
    ReferenceModelConfig,
    hf_checkpoint_keys,
    hf_export_mapper,
    hf_import_mapper,
    read_hf_config,
    save_hf_pretrained,
    to_hf_config,
)

from d9d.data import TextDataset
from d9d.parallel import (
    apply_activation_checkpointing,
    apply_lora,
    compile_blocks,
    parallelize_context_parallel,
    parallelize_hsdp,
)
from d9d.trainer import (
    BuildDatasetContext,
    BuildDatasetResult,
    InitializeModelStageContext,
    InitializeModelStageResult,
    ParallelizeModelStageContext,
    PrepareExportModelStageContext,
    PrepareExportModelStageResult,
    PrepareImportModelStageContext,
    PrepareImportModelStageResult,
    main,
)


class HFModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The `model:` section: which Hugging Face folder to start from.

    Attributes:
        hf_folder: config.json plus model.safetensors (or shards + index), relative to the config file.
        fp32_logits: return float32 logits whatever the parameter dtype.
    """

    hf_folder: str
    fp32_logits: bool = False


class HFModelProvider:
    """The reference model shaped by an HF config.json, started from that folder's weights."""

    config_type = HFModelConfig

    def __init__(self, config: HFModelConfig) -> None:
        self.config = config
        self.folder = Path(config.hf_folder)
        self._model_config: ReferenceModelConfig | None = None

    @property
    def model_config(self) -> ReferenceModelConfig:
        """The folder's config.json as the reference model's config (read by `initialize_model_stage`)."""
        if self._model_config is None:
            raise RuntimeError("HFModelProvider.initialize_model_stage has not run yet")
        return self._model_config

    def initialize_model_stage(self, context: InitializeModelStageContext) -> InitializeModelStageResult:
        # Like every path of the config, hf_folder is relative to the config file's directory.
        self.folder = Path(context.base_dir) / self.config.hf_folder
        self._model_config = read_hf_config(self.folder, fp32_logits=self.config.fp32_logits)
        return InitializeModelStageResult(model=ReferenceForCausalLM(self.model_config))

    def parallelize_model_stage(self, context: ParallelizeModelStageContext) -> None:
        model = context.model
        blocks = list(model.model.layers.values())
        parallelize_context_parallel(model, context.mesh)  # mesh.context_parallel > 1
        if context.lora is not None:  # peft.lora: adapters on the frozen HF weights, before FSDP
            apply_lora(model, context.lora)
        apply_activation_checkpointing(blocks, context.activation_checkpointing)
        compile_blocks(blocks, context.compile)
        parallelize_hsdp(model, context.mesh, blocks=blocks, precision=context.precision)

    def prepare_import_model_stage(
        self, context: PrepareImportModelStageContext
    ) -> PrepareImportModelStageResult:
        """The trainer loads this once, into the initialized (and parallelized) model, on a fresh run."""
        mapper = hf_import_mapper(self.model_config, source_keys=hf_checkpoint_keys(self.folder))
        return PrepareImportModelStageResult(folder=self.folder, mapper=mapper)

    def prepare_export_model_stage(
        self, context: PrepareExportModelStageContext
    ) -> PrepareExportModelStageResult:
        config_json = json.dumps(to_hf_config(self.model_config), indent=2)
        return PrepareExportModelStageResult(
            mapper=hf_export_mapper(self.model_config), extra_files={"config.json": config_json}
        )


class CorpusConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: str = "../data/corpus.txt"
    seq_len: int = 128


class CorpusProvider:
    """The repository's corpus, byte-tokenized (a real model needs data in its own tokenizer's ids)."""

    config_type = CorpusConfig

    def __init__(self, config: CorpusConfig) -> None:
        self.config = config

    def build_dataset(self, context: BuildDatasetContext) -> BuildDatasetResult:
        return BuildDatasetResult(
            dataset=TextDataset(Path(context.base_dir) / self.config.path, self.config.seq_len)
        )


DEMO = ReferenceModelConfig(
    vocab_size=257,  # the byte tokenizer of TextDataset: 256 bytes + end of document
    hidden_size=128,
    intermediate_size=384,
    num_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)


def make_demo(folder: str) -> None:
    """Write a tiny random Qwen3 folder: with transformers' `save_pretrained` when it is installed."""
    torch.manual_seed(0)
    try:
        import transformers
    except ModuleNotFoundError:
        save_hf_pretrained(ReferenceForCausalLM(DEMO), folder)
        print(f"wrote {folder} (reference model, HF layout)")
        return
    hf_config = transformers.AutoConfig.for_model(**to_hf_config(DEMO))
    transformers.AutoModelForCausalLM.from_config(hf_config).save_pretrained(folder)
    print(f"wrote {folder} (transformers {transformers.__version__})")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make-demo":
        make_demo(sys.argv[2])
    else:
        main()
