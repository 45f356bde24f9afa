"""Align a chat model on preference pairs (DPO), or train a reward model on them: the demo maker, and
the job's entry.

    python preference.py make-demo demo         # a tiny random Qwen3 with a tokenizer + preference pairs (no download)
    python preference.py score export-reward demo/pairs/val.jsonl   # a reward export, scored by transformers
    uv run d9d train config.yaml                # DPO from the folder's weights; exports the aligned model
    torchrun --nproc-per-node 2 preference.py config.yaml --set mesh.data_parallel_shard=2

The job is config.yaml alone (the built-in `d9d.trainer:HFModelProvider`, `PreferenceDatasetProvider`
and `PreferenceTask`); this file only makes the demo folder, and runs a config like `python train.py`.
The pairs teach a style a tiny model can learn from a few hundred of them: the prompt asks for the verse
that follows a verse of the corpus; the chosen answer is that verse as written, the rejected one the
same verse shouted (in capitals). Held-out pairs are scored right once the policy prefers the style,
not the words: `eval_rewards/accuracies` rises towards 1.
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
    """Preference pairs in TRL's conversational format: the next verse as written chosen, shouted rejected."""
    conversations = [c["messages"][-2:] for c in demo_conversations()]
    random.Random(0).shuffle(conversations)
    pairs = []
    for user, assistant in conversations:
        other = assistant["content"].upper()
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


def score(export_dir: str, pairs: str) -> None:
    """Load a reward model's export with transformers (`AutoModelForSequenceClassification`, the tokenizer
    beside it) and print its pairwise accuracy and mean margin on `pairs`."""
    import torch
    import transformers

    from d9d.data import PreferenceDataset, collate_preference

    model = transformers.AutoModelForSequenceClassification.from_pretrained(export_dir, dtype=torch.float32)
    dataset = PreferenceDataset(pairs, 128, tokenizer=export_dir)
    batch = collate_preference([dataset[i] for i in range(len(dataset))])
    with torch.no_grad():
        scores = model(input_ids=batch["input_ids"]).logits.view(-1, 2)
    margins = scores[:, 0] - scores[:, 1]
    print(
        f"{type(model).__name__}: {len(dataset)} pairs, pairwise accuracy {float((margins > 0).float().mean()):.3f}, "
        f"mean margin {float(margins.mean()):.3f}"
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make-demo":
        make_preference_demo(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "score":
        score(sys.argv[2], sys.argv[3])
    else:
        main()
