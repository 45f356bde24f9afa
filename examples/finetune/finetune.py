"""Fine-tune a Hugging Face chat model with LoRA on conversations: the demo maker, and the job's entry.

    python finetune.py make-demo demo           # a tiny random Qwen3 with a tokenizer + conversations (no download)
    uv run d9d train config.yaml                # SFT with LoRA and validation; exports adapter and merged model
    torchrun --nproc-per-node 2 finetune.py config.yaml --set mesh.data_parallel_shard=2

The job is config.yaml alone: it names the built-in providers `d9d.trainer:HFModelProvider` (the
folder to start from, and the code that trains it: `model.backend`) and `d9d.trainer:ChatDatasetProvider`
(conversations with the folder's tokenizer and chat template). This file only makes the demo folder,
and runs a config like `python train.py` does.
"""

import json
import re
import sys
from pathlib import Path
from typing import Any

import msgspec
import torch

from d9d.trainer import ChatDatasetProvider, HFModelConfig, HFModelProvider, TextDatasetProvider, main
from d9d.trainer.models import ReferenceForCausalLM, ReferenceModelConfig, save_hf_pretrained, to_hf_config

#: The names earlier configs gave the built-in providers (`finetune.py:HFModelProvider`, ...).
ChatProvider = ChatDatasetProvider
CorpusProvider = TextDatasetProvider
__all__ = ["ChatProvider", "CorpusProvider", "HFModelConfig", "HFModelProvider", "make_demo"]

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
