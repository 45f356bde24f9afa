"""CPU offload (`trainer.memory.cpu_offload`): per-rank state bytes on the device and on the host with
each memory lever, and what offload costs in step time on a CPU-only run, through `d9d.trainer.Trainer`.

    OMP_NUM_THREADS=1 uv run python benchmarks/cpu_offload.py [--steps 12] [--rounds 2] [--layers 4 --hidden 256] [--json rows.json]

The quickstart job (its reference model cut to `--layers` layers of hidden `--hidden`, seq 128,
global batch 16 in microbatches of 2, AdamW) runs `--steps` steps as one process, as FSDP 2 and as
FSDP 2 with `cpu_offload` (forked CPU ranks, gloo). After the last step, rank 0's parameters,
gradients and optimizer-state tensors are counted exactly (local shards' bytes) and split by FSDP2's
own account of each unit (`d9d.parallel.fsdp_parameters(offloaded=...)`) into what stays on the
device and what lives on the host. `d9d plan`'s estimate (`MemoryPlan.device_state / host_state`) is
printed beside it. Step time: the median step of FSDP 2 with offload over FSDP 2 without, the two
alternated `--rounds` times (same load on a shared machine). A CPU run has nothing to offload to:
the ratio is the cost of FSDP2's offload code paths (no foreach copy before the all-gather, host
gradients), not the cost of the host-device copies a GPU pays (the GPU check measures that).
"""

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # imported once here, not in every forked rank (seconds each)
import torch.distributed.fsdp
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[1]

from _common import row, write_rows  # noqa: E402

from d9d.mesh.testing import run_distributed  # noqa: E402
from d9d.parallel import fsdp_parameters  # noqa: E402
from d9d.trainer import Trainer, load_job_config  # noqa: E402

CONFIG = ROOT / "examples" / "quickstart" / "config.yaml"
LEVERS = {"1 process": [], "FSDP 2": ["mesh.data_parallel_shard=2"],
          "FSDP 2 + cpu_offload": ["mesh.data_parallel_shard=2", "trainer.memory.cpu_offload=true"]}  # fmt: skip


def _sets(args: argparse.Namespace, save_dir: str, extra: list[str]) -> list[str]:
    return [
        f"model.hidden_size={args.hidden}",
        f"model.intermediate_size={3 * args.hidden}",
        f"model.num_layers={args.layers}",
        "model.num_attention_heads=4",
        "model.num_key_value_heads=2",
        f"trainer.schedule.total_steps={args.steps}",
        "trainer.checkpointing.period_steps=0",
        f"trainer.checkpointing.save_dir={save_dir}",
        "trainer.logging.progress_bar=false",
        "trainer.device=cpu",
        *extra,
    ]


def _nbytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _measure(sets: list[str]) -> dict[str, Any]:
    """This rank's state bytes on the device and on the host after the run, and its step times."""
    with Trainer.from_config(CONFIG, sets) as t:
        t.train()
        host = {id(p) for p in fsdp_parameters(t.model, offloaded=True)}
        split = {"device": 0, "host": 0}
        parts = {"params": 0, "grads": 0, "optimizer": 0}
        for p in t.model.parameters():
            state = sum(_nbytes(v) for v in t.optimizer.state.get(p, {}).values() if torch.is_tensor(v))
            split["host" if id(p) in host else "device"] += _nbytes(p) + _nbytes(p.grad) + state
            parts["params"] += _nbytes(p)
            parts["grads"] += _nbytes(p.grad)
            parts["optimizer"] += state
        times: list[float] = []
        if t.context.rank == 0:  # rank 0 writes the metrics file
            lines = (Path(t.run_dir) / "metrics.jsonl").read_text().splitlines()
            times = [json.loads(line)["step_time_s"] for line in lines if line]
            assert len(times) == t.step, "the run must train every step itself (a fresh run name)"
        return {**split, "parts": parts, "times": times}


def _plan(sets: list[str]) -> tuple[int, int]:
    """`d9d plan`'s per-rank state estimate: (device, host) bytes, planned as `d9d plan` plans."""
    from d9d.trainer.planning import plan_config

    memory = plan_config(load_job_config(CONFIG, sets), device="cpu").memory
    assert memory is not None
    return memory.device_state, memory.host_state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: dict[str, dict[str, Any]] = {}
    medians: dict[str, list[float]] = {"FSDP 2": [], "FSDP 2 + cpu_offload": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):  # alternated, so both see the same load
            for name in medians:
                sets = _sets(
                    args,
                    tmp,
                    [
                        *LEVERS[name],
                        f"trainer.run.name=round{r}_{'offload' if 'offload' in name else 'plain'}",
                    ],
                )
                got = run_distributed(_measure, 2, sets, timeout=600)[0]
                results[name] = got
                medians[name].append(statistics.median(got["times"][2:]))
        results["1 process"] = run_distributed(
            _measure, 1, _sets(args, tmp, ["trainer.run.name=one"]), timeout=600
        )[0]
        planned = {name: _plan(_sets(args, tmp, LEVERS[name])) for name in LEVERS}
    one = results["1 process"]["device"] + results["1 process"]["host"]
    rows = []
    print(f"{'lever':<22} {'device bytes':>14} {'host bytes':>14}   d9d plan: device / host")
    for name in LEVERS:
        got, (plan_device, plan_host) = results[name], planned[name]
        parts = ", ".join(f"{k} {v:,}" for k, v in got["parts"].items())
        print(
            f"{name:<22} {got['device']:>14,} {got['host']:>14,}   {plan_device:,} / {plan_host:,}   ({parts})"
        )
        rows += [
            row(f"cpu offload: {name}, device state bytes/rank / 1 process", got["device"] / one,
                {"1 process": "1", "FSDP 2": "0.5", "FSDP 2 + cpu_offload": "0"}[name], f"{got['device']:,} B"),
            row(f"cpu offload: {name}, host state bytes/rank / 1 process", got["host"] / one,
                "0.5" if "offload" in name else "0", f"{got['host']:,} B"),
        ]  # fmt: skip
    ratio = statistics.median(medians["FSDP 2 + cpu_offload"]) / statistics.median(medians["FSDP 2"])
    spread = ", ".join(  # per round: with / without
        f"{b * 1e3:.0f}/{a * 1e3:.0f} ms" for a, b in zip(*medians.values(), strict=True)
    )
    print(f"step time, FSDP 2 with / without offload (CPU: nothing to offload to): {ratio:.3f} ({spread})")
    rows.append(row("cpu offload: FSDP 2 step time with / without (CPU)", ratio, "~1 on CPU", spread))
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
