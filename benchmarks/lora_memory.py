"""LoRA memory: gradients and optimizer state only for the adapters, counted exactly from the tensors.

    OMP_NUM_THREADS=1 uv run python benchmarks/lora_memory.py [--targets all|attention] [--rank 8]
    OMP_NUM_THREADS=1 uv run python benchmarks/lora_memory.py --hidden 1024 --intermediate 3072 \\
        --layers 16 --heads 16 --kv-heads 8                  # bigger: 0.2 B parameters, ~40 s

Builds the quickstart job (the reference model, a Llama/Qwen3-style decoder; default 8 layers,
hidden 512, SwiGLU 1536, 8 query / 4 kv heads, byte vocabulary: 25 M parameters) twice through
`d9d.trainer.Trainer`, one CPU process: full fine-tuning, then `peft.lora` (rank 8, alpha 16, on
q/k/v/o and gate/up/down by default, `--targets attention` for q/k/v/o only). Runs a few optimizer
steps of AdamW (`Trainer.train()`, which saves one checkpoint at its end) and counts, from the tensors the process
holds: gradient bytes (every `p.grad`, local shards), optimizer state bytes (every tensor in
`optimizer.state`: exp_avg, exp_avg_sq and the step counters), trainable and total parameters, and
parameter bytes, and the bytes of the checkpoint's files (a LoRA checkpoint holds the adapters and
their state, not the frozen base). The ratios LoRA / full of gradients and optimizer state are compared with the
ratio expected from the parameter counts (adapter parameters / all parameters of the full model).
Activations are not counted. The script asserts that with LoRA only adapter parameters
(`*.lora_A.weight`, `*.lora_B.weight`) have gradients and optimizer state, and all of them do.
"""

import argparse
import tempfile
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[1]

from _common import MB, row, write_rows  # noqa: E402

from d9d.trainer import Trainer  # noqa: E402

CONFIG = ROOT / "examples" / "quickstart" / "config.yaml"
TARGETS = {
    "all": r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
    "attention": r".*\.(q_proj|k_proj|v_proj|o_proj)",
}
ADAPTER_SUFFIXES = ("lora_A.weight", "lora_B.weight")


def _nbytes(t: torch.Tensor) -> int:
    """Bytes this process holds for `t` (its local shard when it is a DTensor)."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _numel(t: torch.Tensor) -> int:
    return (t.to_local() if isinstance(t, DTensor) else t).numel()


def _overrides(args: argparse.Namespace, save_dir: str, lora: bool) -> list[str]:
    model = (
        [
            "model.hidden_size=64",
            "model.intermediate_size=128",
            "model.num_layers=2",
            "model.num_attention_heads=4",
            "model.num_key_value_heads=2",
        ]
        if args.tiny
        else [
            f"model.hidden_size={args.hidden}",
            f"model.intermediate_size={args.intermediate}",
            f"model.num_layers={args.layers}",
            f"model.num_attention_heads={args.heads}",
            f"model.num_key_value_heads={args.kv_heads}",
        ]
    )
    out = [
        *model,
        f"dataset.seq_len={32 if args.tiny else args.seq}",
        # the batch changes activations only: gradients and optimizer state have the parameters' shapes
        "data.global_batch_size=4",
        "data.microbatch_size=2",
        "lr_scheduler.name=constant",
        "lr_scheduler.warmup_steps=0",  # a nonzero learning rate from step 1: the adapters do train
        f"trainer.schedule.total_steps={args.steps}",
        f"trainer.checkpointing.save_dir={save_dir}",
        "trainer.checkpointing.period_steps=0",
        "trainer.logging.level=WARNING",
        "trainer.logging.progress_bar=false",
    ]
    if lora:
        target = TARGETS[args.targets]
        out.append(f"peft.lora={{rank: {args.rank}, alpha: {2 * args.rank}, target_modules: ['{target}']}}")
    return out


def measure(args: argparse.Namespace, lora: bool) -> dict[str, object]:
    """Train `args.steps` steps; the exact byte and parameter counts, and which parameters hold what."""
    with (
        tempfile.TemporaryDirectory() as tmp,
        Trainer.from_config(CONFIG, _overrides(args, tmp, lora)) as trainer,
    ):
        trainer.train()  # its last step saves the run's one checkpoint; the gradients stay until the next step
        checkpoint = trainer.run_dir / f"save-{args.steps}"
        model, optimizer = trainer.model, trainer.optimizer
        named = list(model.named_parameters())
        names = {id(p): n for n, p in named}
        state = [(names[id(p)], v) for p, s in optimizer.state.items() for v in s.values()]
        tensors = [(n, v) for n, v in state if isinstance(v, torch.Tensor)]
        in_optimizer = sorted(names[id(p)] for g in optimizer.param_groups for p in g["params"])
        return {
            "params": sum(_numel(p) for _, p in named),
            "trainable": sum(_numel(p) for _, p in named if p.requires_grad),
            "adapter_params": sum(_numel(p) for n, p in named if n.endswith(ADAPTER_SUFFIXES)),
            "param_bytes": sum(_nbytes(p) for _, p in named),
            "grad_bytes": sum(_nbytes(p.grad) for _, p in named if p.grad is not None),
            "state_bytes": sum(_nbytes(v) for _, v in tensors),
            "moment_bytes": sum(_nbytes(v) for _, v in tensors if v.dim() > 0),
            "checkpoint_bytes": sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file()),
            "with_grad": sorted(n for n, p in named if p.grad is not None),
            "with_state": sorted({n for n, _ in tensors}),
            "in_optimizer": in_optimizer,
            "names": sorted(n for n, _ in named),
            "adapters": sorted(n for n, _ in named if n.endswith(ADAPTER_SUFFIXES)),
        }


def _check(full: dict, lora: dict) -> None:
    """Full: every parameter has a gradient and state; LoRA: exactly the adapters do."""
    assert full["with_grad"] == full["names"] == full["with_state"] == full["in_optimizer"], "full run"
    adapters = lora["adapters"]
    assert adapters, "peft.lora applied no adapters"
    assert lora["with_grad"] == adapters, (
        f"gradients outside the adapters: {set(lora['with_grad']) - set(adapters)}"
    )
    assert lora["with_state"] == adapters, (
        f"state outside the adapters: {set(lora['with_state']) - set(adapters)}"
    )
    assert lora["in_optimizer"] == adapters
    assert lora["trainable"] == lora["adapter_params"]
    assert set(full["names"]) == set(lora["names"]) - set(adapters), "LoRA changed the base parameters"
    # AdamW's moments are two fp32 copies of each trained parameter: exactly the parameter ratio
    assert lora["moment_bytes"] * full["params"] == full["moment_bytes"] * lora["adapter_params"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps before counting")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = 2 x rank)")
    parser.add_argument("--targets", choices=sorted(TARGETS), default="all", help="LoRA target modules")
    parser.add_argument("--tiny", action="store_true", help="hidden 64, 2 layers, seq 32 (a smoke test)")
    parser.add_argument("--json", help="also write the ratios here (for run_all.py)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    full, lora = measure(args, lora=False), measure(args, lora=True)
    _check(full, lora)
    expected = lora["adapter_params"] / full["params"]
    where = "q/k/v/o + gate/up/down" if args.targets == "all" else "q/k/v/o"
    print(
        f"model: {full['params'] / 1e6:.2f} M parameters; LoRA rank {args.rank} on {where} "
        f"({len(lora['adapters']) // 2} Linears): {lora['adapter_params'] / 1e6:.3f} M adapter parameters; "
        f"AdamW, {args.steps} steps, fp32"
    )
    print(f"{'':<22} {'full':>14} {'LoRA':>14} {'LoRA / full':>12}")
    lines = [
        ("parameters", full["params"], lora["params"], ""),
        ("trainable parameters", full["trainable"], lora["trainable"], ""),
        ("parameter bytes", full["param_bytes"], lora["param_bytes"], "MiB"),
        ("gradient bytes", full["grad_bytes"], lora["grad_bytes"], "MiB"),
        ("optimizer state bytes", full["state_bytes"], lora["state_bytes"], "MiB"),
        ("  of which moments", full["moment_bytes"], lora["moment_bytes"], "MiB"),
        ("checkpoint bytes", full["checkpoint_bytes"], lora["checkpoint_bytes"], "MiB"),
    ]
    for label, a, b, unit in lines:
        fmt = (lambda x: f"{x / MB:10.3f} MiB") if unit else (lambda x: f"{x:>14,}")
        print(f"{label:<22} {fmt(a):>14} {fmt(b):>14} {b / a:>12.5f}")
    print(f"expected (adapter params / all params of the full model): {expected:.5f}")
    grads, states = lora["grad_bytes"] / full["grad_bytes"], lora["state_bytes"] / full["state_bytes"]
    counters = [
        f"{len(r['with_state'])} x {(r['state_bytes'] - r['moment_bytes']) // len(r['with_state'])} B"
        for r in (full, lora)
    ]
    steps_note = f"incl. step counters (full {counters[0]}, LoRA {counters[1]}); moments alone = expected"
    config = f"rank {args.rank}, {where}; {full['params'] / 1e6:.1f} M params"
    write_rows(
        args.json,
        [
            row("LoRA / full: gradient bytes", grads, f"{expected:.4f} (adapter/all params)", config),
            row("LoRA / full: optimizer state bytes", states, f"{expected:.4f} (adapter/all params)", steps_note),
            row("LoRA / full: parameter bytes", lora["param_bytes"] / full["param_bytes"], f"{1 + expected:.4f}",
                "base unchanged + adapters"),
            row("LoRA / full: checkpoint bytes", lora["checkpoint_bytes"] / full["checkpoint_bytes"],
                f"{expected:.4f} (adapters + their state)", "files of save-<step>: adapters, state, metadata"),
        ],
    )  # fmt: skip


if __name__ == "__main__":
    main()
