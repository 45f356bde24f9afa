"""`d9d plan` of a LoRA job (the quickstart with `peft.lora`): the parameters and the trainable ones,
gradients and optimizer state of the adapters only (it planned a full fine-tune), what each pattern
matched per layer, and the warning for a pattern that matches nothing."""

from pathlib import Path

from d9d.cli import cli
from d9d.cli.commands._text import format_size
from d9d.parallel import lora_parameters
from d9d.trainer import Trainer

QUICKSTART = Path(__file__).resolve().parents[3] / "examples" / "quickstart" / "config.yaml"
PROJECTIONS = r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
LORA = f"peft.lora={{rank: 8, alpha: 16, target_modules: ['{PROJECTIONS}']}}"


def _line(output: str, prefix: str) -> str:
    (line,) = [line.strip() for line in output.splitlines() if line.strip().startswith(prefix)]
    return line


def test_plan_prints_trainable_parameters_and_counts_state_for_the_adapters_only(runner, tmp_path):
    with Trainer.from_config(
        str(QUICKSTART), [LORA, f"trainer.checkpointing.save_dir={tmp_path}"]
    ) as trainer:
        params = sum(p.numel() for p in trainer.model.parameters())
        adapters = sum(p.numel() for p in lora_parameters(trainer.model))  # float32
    result = runner.invoke(cli, ["plan", str(QUICKSTART), "--set", LORA])
    assert result.exit_code == 0, result.output
    out = result.output
    assert _line(out, "model:") == (
        f"model: {params:,} parameters, {format_size(4 * params)} ({adapters:,} trainable, "
        f"{format_size(4 * adapters)})"
    )
    assert _line(out, "lora:") == (
        f"lora: rank 8, alpha 16; only the adapters train; matched: {PROJECTIONS}: 7 in each of 4 layers"
    )
    assert _line(out, "gradients").split()[1:] == format_size(4 * adapters).split()
    assert _line(out, "optimizer").split()[1:3] == format_size(2 * 4 * adapters).split()  # AdamW: 2 states
    assert "warning:" not in out

    full = runner.invoke(cli, ["plan", str(QUICKSTART)]).output
    base = params - adapters
    assert _line(full, "model:") == f"model: {base:,} parameters, {format_size(4 * base)} (all trainable)"
    assert _line(full, "gradients").split()[1:] == format_size(4 * base).split()


def test_plan_warns_about_a_pattern_that_matches_nothing_in_one_line(runner):
    lora = f"peft.lora={{rank: 8, alpha: 16, target_modules: ['{PROJECTIONS}', '.*\\.qkv']}}"
    result = runner.invoke(cli, ["plan", str(QUICKSTART), "--set", lora])
    assert result.exit_code == 0, result.output
    assert _line(result.output, "warning:") == (
        r"warning: pattern '.*\.qkv' of peft.lora.target_modules matches no nn.Linear"
    )
