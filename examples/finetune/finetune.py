"""Fine-tune a Hugging Face chat model (Qwen3, Llama or Qwen3-MoE layout) with LoRA on conversations.

    python finetune.py make-demo demo           # a tiny random Qwen3 with a tokenizer + conversations (no download)
    python finetune.py config.yaml              # SFT with LoRA and validation; exports adapter and merged model
    torchrun --nproc-per-node 2 finetune.py config.yaml --set mesh.data_parallel_shard=2

The model is built from the folder's config.json, initialized, then (on a run without checkpoints
of its own) filled from the folder's safetensors through `hf_import_mapper`. The data are JSONL
conversations tokenized with the folder's own tokenizer and chat template (`ChatProvider`).
"""

import json
import re
import sys
from pathlib import Path
from typing import Any, Literal

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

from d9d.data import SFTDataset, TextDataset
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


class ChatConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The `dataset:` (and `eval_dataset:`) section: conversations for supervised fine-tuning.

    Attributes:
        path: a .jsonl file or a folder of them (`{"messages": [...]}` or `{"prompt", "completion"}`).
        tokenizer: a Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json with the
            chat template); usually the model's folder.
        seq_len: tokens per row.
        pack: several conversations per row, never attending to each other (position and document ids).
        train_on: "assistant" (loss on the assistant's tokens only) or "all".
        overflow: "truncate" or "drop" conversations longer than seq_len.
        roles: the message roles the conversations may use (another is refused with its file:line).
    """

    path: str
    tokenizer: str
    seq_len: int = 256
    pack: bool = True
    train_on: Literal["assistant", "all"] = "assistant"
    overflow: Literal["truncate", "drop"] = "truncate"
    roles: tuple[str, ...] = ("system", "user", "assistant", "tool")


class ChatProvider:
    """`SFTDataset` over the configured JSONL, with the model's tokenizer and chat template."""

    config_type = ChatConfig

    def __init__(self, config: ChatConfig) -> None:
        self.config = config

    def build_dataset(self, context: BuildDatasetContext) -> BuildDatasetResult:
        base = Path(context.base_dir)  # like every path of the config: relative to the config file
        dataset = SFTDataset(
            base / self.config.path,
            self.config.seq_len,
            tokenizer=base / self.config.tokenizer,
            train_on=self.config.train_on,
            overflow=self.config.overflow,
            pack=self.config.pack,
            roles=self.config.roles,
        )
        return BuildDatasetResult(dataset=dataset)


class CorpusConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: str = "../data/corpus.txt"
    seq_len: int = 128
    tokenizer: str | None = None  # a tokenizer folder or tokenizer.json; null: bytes (vocabulary 257)


class CorpusProvider:
    """Plain text for continued pre-training: the repository's corpus, in the given tokenizer's ids."""

    config_type = CorpusConfig

    def __init__(self, config: CorpusConfig) -> None:
        self.config = config

    def build_dataset(self, context: BuildDatasetContext) -> BuildDatasetResult:
        base = Path(context.base_dir)
        tokenizer = base / self.config.tokenizer if self.config.tokenizer is not None else None
        return BuildDatasetResult(
            dataset=TextDataset(base / self.config.path, self.config.seq_len, tokenizer=tokenizer)
        )


DEMO = ReferenceModelConfig(
    vocab_size=512,  # the demo tokenizer's vocabulary (make-demo trains it on the repository's corpus)
    hidden_size=128,
    intermediate_size=384,
    num_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)

#: Qwen's chat format (ChatML): each turn `<|im_start|>role\ncontent<|im_end|>\n`.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus.txt"


def write_demo_tokenizer(folder: Path, vocab_size: int) -> int:
    """Train a byte-level BPE on the repository's corpus and save it as a Hugging Face tokenizer folder."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ModuleNotFoundError:
        raise SystemExit(
            "make-demo needs the tokenizers package: uv sync --all-packages --extra chat (or pip install tokenizers)"
        ) from None
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(CORPUS)], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 4096,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return tokenizer.get_vocab_size()


def demo_conversations() -> list[dict[str, Any]]:
    """Conversations made from the corpus: the user gives a verse, the assistant answers with the next."""
    text = CORPUS.read_text(encoding="utf-8")
    pieces = (" ".join(s.split()) for s in re.split(r"(?<=[.;:?!])\s+", text))
    sentences = [s for s in pieces if 20 <= len(s) <= 160]
    records = []
    for i in range(0, min(len(sentences) - 1, 1200), 2):
        messages = [
            {"role": "user", "content": f"What comes after: {sentences[i]}"},
            {"role": "assistant", "content": sentences[i + 1]},
        ]
        if i % 6 == 0:
            messages.insert(0, {"role": "system", "content": "You recite the King James Version."})
        records.append({"messages": messages})
    return records


def make_demo(folder: str) -> None:
    """Write `folder/model` (a tiny random Qwen3 with a tokenizer and chat template) and
    `folder/chat/{train,val}.jsonl`; with transformers' `save_pretrained` when it is installed."""
    out = Path(folder)
    model_dir = out / "model"
    vocab = write_demo_tokenizer(model_dir, DEMO.vocab_size)
    config = msgspec.structs.replace(DEMO, vocab_size=vocab)
    torch.manual_seed(0)
    try:
        import transformers
    except ModuleNotFoundError:
        save_hf_pretrained(ReferenceForCausalLM(config), model_dir)
        made_by = "reference model, HF layout"
    else:
        hf_config = transformers.AutoConfig.for_model(**to_hf_config(config))
        transformers.AutoModelForCausalLM.from_config(hf_config).save_pretrained(model_dir)
        made_by = f"transformers {transformers.__version__}"
    records = demo_conversations()
    split = len(records) * 9 // 10
    (out / "chat").mkdir(parents=True, exist_ok=True)
    for name, part in (("train", records[:split]), ("val", records[split:])):
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part)
        (out / "chat" / f"{name}.jsonl").write_text(lines, encoding="utf-8")
    print(
        f"wrote {model_dir} ({made_by}, vocabulary {vocab}) and {out / 'chat'} ({split} + {len(records) - split} conversations)"
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make-demo":
        make_demo(sys.argv[2])
    else:
        main()
