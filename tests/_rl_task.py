"""The RL example's digit task for the RL tests (examples/rl: its 13-token tokenizer and its reward),
with prompts made here: `d d >` (or 1 to 3 digits) whose answer is the digits again."""

import importlib.util
import json
import random
from pathlib import Path
from types import ModuleType

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rl"


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_d9d_tests_rl_{name}", EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: The example's reward: the share of the answer's digits the completion repeats in place.
copy_match = _example("rewards").copy_digits


def wrong_length(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    return [0.0] * (len(completions) - 1)


def make_task(folder: Path, prompts: int = 256, digits: int | tuple[int, int] = 2, seed: int = 0) -> Path:
    """`folder/tokenizer` (the example's) and `folder/prompts.jsonl` (`digits` per prompt, or a range
    of counts); returns `folder`."""
    (folder / "tokenizer").mkdir(parents=True, exist_ok=True)
    _example("rl").write_tokenizer(folder / "tokenizer")
    draw = random.Random(seed)
    lines = []
    for _ in range(prompts):
        count = digits if isinstance(digits, int) else draw.randint(*digits)
        number = [draw.choice("0123456789") for _ in range(count)]
        lines.append(json.dumps({"prompt": " ".join(number) + " >", "answer": "".join(number)}))
    (folder / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return folder
