"""Reinforcement learning with rollouts (GRPO) on a task a tiny model learns on CPU in a minute: repeat
the digits of the prompt. The demo maker, and the job's entry.

    python rl.py make-demo demo                 # a tiny random Qwen3 (13-token vocabulary) + prompts
    uv run d9d train config.yaml                # GRPO: the mean reward rises from ~0.07 to over 0.6
    torchrun --nproc-per-node 2 rl.py config.yaml --set mesh.data_parallel_shard=2

The job is config.yaml alone (the built-in `d9d.trainer:HFModelProvider`, `PromptDatasetProvider`
and `GRPOTask`, and `rewards.py`'s function); this file only makes the demo folder: a word-level
tokenizer of the ten digits, `>` and the end and padding tokens, a randomly initialised tiny Qwen3 in
the Hugging Face layout (so TRL can start from the very same weights, benchmarks/rl_vs_trl.py), and
prompts `d d >` whose answer is the same two digits.
"""

import json
import random
import sys
from pathlib import Path

import torch

from d9d.trainer import main
from d9d.trainer.models import ReferenceForCausalLM, ReferenceModelConfig, save_hf_pretrained

DEMO = ReferenceModelConfig(vocab_size=13, hidden_size=64, intermediate_size=128, num_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
VOCAB = {**{str(i): i for i in range(10)}, ">": 10, "<eos>": 11, "<pad>": 12}


def write_tokenizer(folder: Path) -> None:
    """A word-level Hugging Face tokenizer of the digits, `>`, end and padding (needs `tokenizers`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "pad_token": "<pad>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def make_demo(folder: str, prompts: int = 512, digits: int = 2) -> None:
    """`folder/model` (the random model and its tokenizer) and `folder/prompts/{train,val}.jsonl`."""
    out = Path(folder)
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    save_hf_pretrained(ReferenceForCausalLM(DEMO), model_dir)
    write_tokenizer(model_dir)
    draw = random.Random(0)
    lines = []
    for _ in range(prompts):
        number = [draw.choice("0123456789") for _ in range(digits)]
        lines.append(json.dumps({"prompt": " ".join(number) + " >", "answer": "".join(number)}))
    (out / "prompts").mkdir(parents=True, exist_ok=True)
    (out / "prompts" / "train.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(
        f"wrote {model_dir} (a random tiny Qwen3, vocabulary {DEMO.vocab_size}) and {out / 'prompts'} ({prompts} prompts)"
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make-demo":
        make_demo(sys.argv[2])
    else:
        main()
