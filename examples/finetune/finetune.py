"""Fine-tune a Hugging Face chat model with LoRA on conversations.

    python finetune.py make-demo demo           # a tiny random Qwen3 with a tokenizer + conversations (no download)
    python finetune.py config.yaml              # SFT with LoRA and validation; exports adapter and merged model
    torchrun --nproc-per-node 2 finetune.py config.yaml --set mesh.data_parallel_shard=2

`model.backend` chooses the code that trains the folder: the reference model (qwen3, llama, qwen2,
mistral, qwen3_moe, mixtral; every parallelism) or transformers' own class through `d9d.trainer.hf`
(any causal LM; FSDP/HSDP); "auto" takes the reference model when it holds the folder's config.json
exactly. The model is built on meta, initialized, then (on a run without checkpoints of its own)
filled from the folder's safetensors. The data are JSONL conversations tokenized with the folder's
own tokenizer and chat template (`ChatProvider`)."""

import json
import re
import sys
from pathlib import Path
from typing import Any, Literal

import msgspec
import torch

from d9d.ckpt import SafetensorsIOError, check_safetensors, safetensors_shapes
from d9d.data import SFTDataset, TextDataset
from d9d.mesh import MeshConfig
from d9d.parallel import apply_lora, parallelize_context_parallel, parallelize_decoder
from d9d.trainer import ConfigPath, main
from d9d.trainer.models import (
    HFConversionError,
    ReferenceForCausalLM,
    ReferenceModelConfig,
    SlidingWindowError,
    apply_expert_parallel,
    apply_tensor_parallel,
    check_mesh,
    check_sequence_length,
    decoder_parts,
    hf_checkpoint_keys,
    hf_expert_layout,
    hf_export_mapper,
    hf_import_mapper,
    read_hf_config,
    save_hf_pretrained,
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
    PrepareImportModelStageContext,
    PrepareImportModelStageResult,
)


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
    """

    hf_folder: ConfigPath
    backend: Literal["auto", "reference", "hf"] = "auto"
    fp32_logits: bool = False


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
                self.model_config = read_hf_config(self.folder, fp32_logits=config.fp32_logits)
            except HFConversionError as error:
                if config.backend == "reference" or not (self.folder / "config.json").is_file():
                    raise
                self.reason = str(error)
        if self.model_config is None:
            self.hf = _hf_provider(self.folder, config.fp32_logits, self.reason)

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
            self.hf = _hf_provider(self.folder, self.config.fp32_logits, self.reason)
            if self._mesh is not None:
                self.hf.check_mesh(self._mesh)

    def pipeline_num_layers(self) -> int:
        return self._reference().num_layers

    def initialize_model_stage(self, context: InitializeModelStageContext) -> InitializeModelStageResult:
        if self.hf is not None:
            return self.hf.initialize_model_stage(context)
        model = ReferenceForCausalLM(self._reference())
        if context.stage is not None:  # pipeline parallel: keep this stage's part (on meta: free)
            trim_to_stage(model, context.stage)
        else:  # the whole model: the folder's weights checked against it before anything is written
            self._check_folder_weights(model)
        return InitializeModelStageResult(model=model)

    def _check_folder_weights(self, model: ReferenceForCausalLM) -> None:
        """Refuse weights that config.json does not describe (from the safetensors headers: none read)."""
        safetensors_shapes(self.folder)  # a missing or stray shard: d9d.ckpt's own line names it
        mapper = hf_import_mapper(self._reference(), source_keys=hf_checkpoint_keys(self.folder))
        try:
            check_safetensors(model, self.folder, mapper=mapper)
        except SafetensorsIOError as exc:
            raise HFConversionError(
                f"model.hf_folder: {self.folder / 'config.json'} does not describe the weights beside it "
                f"({exc}); use the config.json they were saved with"
            ) from None

    def parallelize_model_stage(self, context: ParallelizeModelStageContext) -> None:
        if self.hf is not None:
            self.hf.parallelize_model_stage(context)
            return
        model, ctx = context.model, context.context
        apply_tensor_parallel(model, ctx)  # mesh.tensor_parallel > 1
        apply_expert_parallel(model, ctx, context.precision)  # mesh.expert_parallel > 1 (MoE)
        parallelize_context_parallel(model, context.mesh)  # mesh.context_parallel > 1
        if context.lora is not None:  # peft.lora: adapters on the frozen HF weights, before FSDP
            apply_lora(model, context.lora)
        # per layer: activation checkpointing, compile; FSDP units per layer, embedding, [norm, lm_head]
        parallelize_decoder(
            model,
            context.mesh,
            blocks=list(model.model.layers.values()),
            **decoder_parts(model),
            activation_checkpointing=context.activation_checkpointing,
            compile=context.compile,
            precision=context.precision,
        )

    def prepare_import_model_stage(
        self, context: PrepareImportModelStageContext
    ) -> PrepareImportModelStageResult:
        """The trainer loads this once, into the initialized (and parallelized) model, on a fresh run."""
        if self.hf is not None:
            return self.hf.prepare_import_model_stage(context)
        mapper = hf_import_mapper(self._reference(), source_keys=hf_checkpoint_keys(self.folder))
        return PrepareImportModelStageResult(folder=self.folder, mapper=mapper)

    def prepare_export_model_stage(
        self, context: PrepareExportModelStageContext
    ) -> PrepareExportModelStageResult:
        if self.hf is not None:
            return self.hf.prepare_export_model_stage(context)
        config = self._reference()
        # MoE experts are written in the layout the folder had (per expert, or transformers 5's fused)
        layout = hf_expert_layout(hf_checkpoint_keys(self.folder)) if config.moe is not None else "per_expert"
        config_json = json.dumps(to_hf_config(config), indent=2)
        return PrepareExportModelStageResult(
            mapper=hf_export_mapper(config, expert_layout=layout), extra_files={"config.json": config_json}
        )


def _model_type(folder: Path) -> str:
    """config.json's model_type ("?" when it has none; a missing or broken file is refused later)."""
    try:
        model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return "?"
    return str(model_type) if model_type else "?"


def _hf_provider(folder: Path, fp32_logits: bool, reason: str) -> Any:
    """`d9d.trainer.hf.HFCausalLMProvider` for `folder` (transformers is an optional extra)."""
    try:
        from d9d.trainer.hf import HFCausalLMConfig, HFCausalLMProvider
    except ImportError as missing:  # one line: why this folder needs it, and how to install it
        why = f"{reason}; transformers' model would train it, but {missing}" if reason else str(missing)
        raise HFConversionError(why) from None
    return HFCausalLMProvider(HFCausalLMConfig(folder=str(folder), fp32_logits=fp32_logits))


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
