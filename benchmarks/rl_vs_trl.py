"""GRPO in d9d (`d9d.trainer:GRPOTask`) against TRL's `GRPOTrainer`: the reward curves of the RL example
(examples/rl: repeat two digits) from the same random tiny Qwen3 folder, the same prompts and the same
reward function (rewards.py, TRL's signature), the same steps, group size, learning rate, optimizer
(AdamW, betas 0.9/0.999, no weight decay), clipping (1.0), temperature, epsilon and loss (TRL's default
`dapo`: the mean over the batch's completion tokens), on one CPU process each.

    OMP_NUM_THREADS=1 uv run python benchmarks/rl_vs_trl.py [--steps 120] [--json rows.json]

Prints both curves every 10 steps and the means of the first 5 and last 10 steps. They are not
expected to be equal: the two draw different samples (d9d seeds each prompt's completions from (seed,
step, prompt index); TRL draws from one generator in transformers' `generate`), and TRL shuffles the
prompts in its own order. What should agree is how fast the reward rises.
"""

import argparse
import contextlib
import importlib.util
import io
import json
import sys
import tempfile
from pathlib import Path

import torch
from _common import row, write_rows

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "rl"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def d9d_curve(demo: Path, steps: int) -> list[float]:
    """d9d's mean reward per step (the example's config, the matched settings)."""
    from d9d.trainer import Trainer

    args = [f"model.hf_folder={demo / 'model'}", f"dataset.path={demo / 'prompts' / 'train.jsonl'}",
            f"dataset.tokenizer={demo / 'model'}", f"rl.reward={EXAMPLE / 'rewards.py'}:copy_digits",
            f"trainer.schedule.total_steps={steps}", "trainer.logging.period_steps=1",
            "trainer.logging.progress_bar=false", f"trainer.checkpointing.save_dir={demo / 'runs'}",
            "trainer.checkpointing.period_steps=100000", "trainer.gradient_clipping.max_norm=1.0",
            "optimizer={name: adamw, lr: 1.5e-3, betas: [0.9, 0.999], weight_decay: 0.0}", "export.dir=null"]  # fmt: skip
    with (
        contextlib.redirect_stdout(io.StringIO()),
        Trainer.from_config(EXAMPLE / "config.yaml", args) as trainer,
    ):
        trainer.train()
    lines = (demo / "runs" / "grpo" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["reward"] for line in lines if '"reward"' in line]


def trl_curve(demo: Path, steps: int) -> list[float]:
    """TRL's mean reward per step: GRPOTrainer with the example's settings, on CPU in float32."""
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    rewards = _load("rl_rewards", EXAMPLE / "rewards.py")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(demo / "model", dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(demo / "model")
    prompts = datasets.load_dataset("json", data_files=str(demo / "prompts" / "train.jsonl"), split="train")
    args = GRPOConfig(
        output_dir=str(demo / "trl"), per_device_train_batch_size=128, num_generations=8, max_completion_length=3,
        learning_rate=1.5e-3, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.999,
        weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2, temperature=1.0, loss_type="dapo",
        max_steps=steps, logging_steps=1, bf16=False, fp16=False, use_cpu=True, report_to=[], save_strategy="no",
        seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=[rewards.copy_digits], args=args, train_dataset=prompts,
                          processing_class=tokenizer)  # fmt: skip
    trainer.train()
    return [float(e["reward"]) for e in trainer.state.log_history if "reward" in e]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--json", default=None)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        demo = Path(tmp) / "demo"
        _load("rl_example", EXAMPLE / "rl.py").make_demo(str(demo))
        ours = d9d_curve(demo, options.steps)
        theirs = trl_curve(demo, options.steps)
    print(f"{'step':>5} {'d9d':>7} {'TRL':>7}")
    for step in [1, *range(10, options.steps + 1, 10)]:
        if step <= min(len(ours), len(theirs)):
            print(f"{step:>5} {ours[step - 1]:>7.3f} {theirs[step - 1]:>7.3f}")
    first = min(5, len(ours))
    last = min(10, len(ours))
    mean = lambda values, part: sum(part(values)) / len(part(values))  # noqa: E731
    d9d_first, trl_first = mean(ours, lambda v: v[:first]), mean(theirs, lambda v: v[:first])
    d9d_last, trl_last = mean(ours, lambda v: v[-last:]), mean(theirs, lambda v: v[-last:])
    print(
        f"first {first} steps: d9d {d9d_first:.3f}, TRL {trl_first:.3f}; last {last}: d9d {d9d_last:.3f}, TRL {trl_last:.3f}"
    )
    write_rows(options.json, [
        row("grpo reward, last steps: d9d / TRL", d9d_last / max(trl_last, 1e-9), "~1",
            f"d9d {d9d_first:.3f} -> {d9d_last:.3f}, TRL {trl_first:.3f} -> {trl_last:.3f} over {options.steps} steps"),
    ])  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
