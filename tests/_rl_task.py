"""A digit-copying task for the RL tests: a word-level tokenizer of 13 tokens (digits, `>`, end,
padding), prompts `d d >` whose answer is the digits again, and a reward of the share of digits right."""

import json
import random
from pathlib import Path


def copy_match(prompts: list[str], completions: list[str], answer: list[str], **_: object) -> list[float]:
    """Share of the answer's digits the completion has at their places (its non-digits skipped)."""
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        digits = "".join(ch for ch in completion if ch.isdigit())
        rewards.append(sum(a == b for a, b in zip(digits, expected, strict=False)) / len(expected))
    return rewards


def wrong_length(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    return [0.0] * (len(completions) - 1)


def make_task(folder: Path, prompts: int = 256, digits: int | tuple[int, int] = 2, seed: int = 0) -> Path:
    """`folder/tokenizer` and `folder/prompts.jsonl` (`digits` per prompt, or a range of counts);
    returns `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {str(i): i for i in range(10)} | {">": 10, "<eos>": 11, "<pad>": 12}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    (folder / "tokenizer").mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer" / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "pad_token": "<pad>"}
    (folder / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(config))
    draw = random.Random(seed)
    lines = []
    for _ in range(prompts):
        count = digits if isinstance(digits, int) else draw.randint(*digits)
        number = [draw.choice("0123456789") for _ in range(count)]
        lines.append(json.dumps({"prompt": " ".join(number) + " >", "answer": "".join(number)}))
    (folder / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return folder
