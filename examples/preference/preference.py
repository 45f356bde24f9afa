"""Align a chat model on preference pairs (DPO), or train a reward model on them: the demo maker, and
the job's entry.

    python preference.py make-demo demo         # a tiny random Qwen3 with a tokenizer + preference pairs (no download)
    uv run d9d train config.yaml                # DPO from the folder's weights; exports the aligned model
    torchrun --nproc-per-node 2 preference.py config.yaml --set mesh.data_parallel_shard=2

The job is config.yaml alone (the built-in `d9d.trainer:HFModelProvider`, `PreferenceDatasetProvider`
and `PreferenceTask`); this file only makes the demo folder, and runs a config like `python train.py`.
The pairs are verifiable: the prompt asks for the verse that follows a verse of the corpus; the chosen
answer is that verse, the rejected one another verse of the corpus.
"""

import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "finetune"))
from finetune import demo_conversations, make_demo  # the fine-tune example's demo model

from d9d.trainer import main


def demo_pairs() -> list[dict[str, Any]]:
    """Preference pairs in TRL's conversational format: the true next verse chosen, another rejected."""
    conversations = [c["messages"][-2:] for c in demo_conversations()]
    answers = [assistant["content"] for _, assistant in conversations]
    shuffled = random.Random(0)
    pairs = []
    for i, (user, assistant) in enumerate(conversations):
        other = answers[(i + shuffled.randrange(1, len(answers))) % len(answers)]
        pairs.append(
            {
                "prompt": [user],
                "chosen": [{"role": "assistant", "content": assistant["content"]}],
                "rejected": [{"role": "assistant", "content": other}],
            }
        )
    return pairs


def make_preference_demo(folder: str) -> None:
    """The fine-tune example's demo (`folder/model`, a tiny random Qwen3 with its tokenizer and chat
    template) and `folder/pairs/{train,val}.jsonl`."""
    make_demo(folder)
    pairs = demo_pairs()
    split = len(pairs) * 9 // 10
    out = Path(folder) / "pairs"
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", pairs[:split]), ("val", pairs[split:])):
        lines = "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in part)
        (out / f"{name}.jsonl").write_text(lines, encoding="utf-8")
    print(f"wrote {out} ({split} + {len(pairs) - split} preference pairs)")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make-demo":
        make_preference_demo(sys.argv[2])
    else:
        main()
