"""Step time of every pipeline schedule against its theoretical bubble fraction, same stages and microbatches;
and (`--saved`) what each stage still holds after a step.

    uv run python benchmarks/pipeline_schedules.py [--pp 2] [--microbatches 8] [--layers 8] [--dim 256]
        [--through runtime|trainer|both|none] [--saved]

Each schedule trains an MLP-block language model for a few steps on `--pp` forked CPU ranks (gloo)
through the bare `d9d.parallel.pipeline.Pipeline`, and (`--through trainer`) the quickstart job through the
d9d Trainer's whole step (`Trainer.train_step.run`: forward, backward, clipping, optimizer).
"theory" is the idle fraction of the schedule's own action order (torch's for the multi-stage
schedules, torch's warm-up rule for gpipe/1f1b) replayed with unit costs F = 1, I = W = 1 (B = 2) and
free communication. "measured" is 1 - (one-process step time / pp) / pipelined step time: bubble plus
communication and runtime overhead; the one-process run is repeated just before each schedule, so
both see the same load on a shared machine. CPU timings are noisy (±15%), and with more ranks than cores the
measured column is meaningless: keep --pp at the core count.

`--saved` trains the quickstart as shipped (4 layers, hidden 128, seq 128, 8 microbatches of 2) for
2 steps at `--pp` with every schedule and counts, on each rank after each step: the receive buffers
torch kept for the next step that `Pipeline` releases (torch 2.11 keeps one per microbatch and
direction; 2.15 none), the bytes of every storage the step made still alive (`d9d.mesh.testing.
StorageCensus`, no autograd hook: what the step holds), and the bytes a saved-tensor hook that keeps
the tensor itself reports, the count a leak was once reported with (its own reference cycle keeps
the graph of a forward no backward runs over: torch 2.15's metadata-inference forward on stage 0).
"""

import argparse
import gc
import statistics
import tempfile
import time
import weakref
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import Row, row, write_rows
from torch import nn

from d9d.mesh import DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel.pipeline import PIPELINE_SCHEDULES, Pipeline, PipelineConfig, StageSpec, plan_pipeline

COST = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}


class Model(nn.Module):
    """Embedding, residual MLP blocks, norm and head; built whole (`spec=None`) or as one stage."""

    def __init__(self, args: argparse.Namespace, spec: StageSpec | None = None) -> None:
        super().__init__()
        layers = range(args.layers) if spec is None else spec.layers
        first, last = spec is None or spec.is_first, spec is None or spec.is_last
        self.embed = nn.Embedding(args.vocab, args.dim) if first else None
        self.layers = nn.ModuleDict(
            {
                str(i): nn.Sequential(nn.LayerNorm(args.dim), nn.Linear(args.dim, 4 * args.dim), nn.GELU(),
                                      nn.Linear(4 * args.dim, args.dim))
                for i in layers
            }
        )  # fmt: skip
        self.head = nn.Sequential(nn.LayerNorm(args.dim), nn.Linear(args.dim, args.vocab)) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x) if self.embed is not None else x
        for layer in self.layers.values():
            x = x + layer(x)
        return self.head(x) if self.head is not None else x


def _loss(tokens: int):
    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum") / tokens

    return loss_fn


def _batch(args: argparse.Namespace) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(
        0, args.vocab, (args.microbatches * args.microbatch_size, args.seq + 1), generator=gen
    )


def _time(step, args: argparse.Namespace) -> float:
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def one_process(args: argparse.Namespace) -> float:
    torch.manual_seed(0)
    model = Model(args)
    tokens = _batch(args)
    loss_fn = _loss(tokens[:, 1:].numel())

    def step() -> None:
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        model.zero_grad()

    return _time(step, args)


def pipelined(args: argparse.Namespace, name: str) -> tuple[float, dict[int, list[tuple]]]:
    with DistributedContext.from_env(MeshConfig(pipeline_parallel=args.pp)) as ctx:
        layout = plan_pipeline(args.layers, args.pp, PipelineConfig(name), n_microbatches=args.microbatches)
        torch.manual_seed(0)
        modules = [Model(args, spec) for spec in layout.stages_of_rank(ctx.coordinate("pp"))]
        tokens = _batch(args)
        micro = list(tokens.chunk(args.microbatches))
        pipe = Pipeline(
            layout,
            modules,
            pp_group=ctx.mesh("dense")["pp"],
            n_microbatches=args.microbatches,
            loss_fn=_loss(tokens[:, 1:].numel()),
        )

        def step() -> None:
            pipe.step([m[:, :-1] for m in micro], [m[:, 1:] for m in micro])
            for m in modules:
                m.zero_grad()

        seconds = _time(step, args)
        order = {}
        if PIPELINE_SCHEDULES[name].multi_stage:  # single-stage schedules run their own loop, not this order
            order = {
                r: [_plain(a) for a in acts if a is not None]
                for r, acts in pipe.schedule.pipeline_order.items()
            }
        return seconds, order


#: The quickstart job, small: 8 layers so that 2 ranks × 2 chunks each get layers.
_QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart" / "config.yaml"


def _trainer_overrides(args: argparse.Namespace, save_dir: str, pp: int, name: str) -> list[str]:
    return [
        f"model.num_layers={args.layers}",
        f"model.hidden_size={args.trainer_hidden}",
        f"model.intermediate_size={4 * args.trainer_hidden}",
        "model.num_attention_heads=4",
        "model.num_key_value_heads=2",
        f"dataset.seq_len={args.seq}",
        f"data.microbatch_size={args.microbatch_size}",
        f"data.global_batch_size={args.microbatches * args.microbatch_size}",
        f"mesh.pipeline_parallel={pp}",
        f"pipelining.schedule={name}",
        f"trainer.checkpointing.save_dir={save_dir}",
        "trainer.logging.level=WARNING",
        "trainer.logging.progress_bar=false",
    ]


def through_trainer(args: argparse.Namespace, pp: int, name: str) -> float:
    """Median seconds of `Trainer.train_step.run` (forward, backward, clip, optimizer) of the quickstart."""
    from d9d.trainer import Trainer

    with (
        tempfile.TemporaryDirectory() as tmp,
        Trainer.from_config(_QUICKSTART, _trainer_overrides(args, tmp, pp, name)) as trainer,
    ):
        batches = iter(trainer.data)
        count = 0

        def step() -> None:
            nonlocal count
            count += 1
            float(trainer.train_step.run(next(batches), count).loss)  # wait for the step

        return _time(step, args)


def saved_after_steps(pp: int, name: str, keeping_hook: bool) -> list[tuple[int, int]]:
    """Per step of the quickstart at `pp` with schedule `name`, on this rank: (bytes of the receive
    buffers `Pipeline` released, bytes held after the step): with `keeping_hook`, what a pack hook
    keeping the saved tensors themselves reports alive; else every storage the step made that anyone
    still holds (`StorageCensus`, no hook). Separate runs: the hook's own cycles would keep storages."""
    import d9d.parallel.pipeline.runtime as runtime
    from d9d.mesh.testing import StorageCensus
    from d9d.trainer import Trainer

    released: list[int] = []
    release = runtime.release_receive_buffers

    def counted_release(stage: object) -> int:
        released[-1] += release(stage)  # type: ignore[arg-type]
        return 0

    runtime.release_receive_buffers = counted_release  # this forked rank only
    sets = [f"mesh.pipeline_parallel={pp}", f"pipelining.schedule={name}", "trainer.logging.level=WARNING",
            "trainer.logging.progress_bar=false", "trainer.schedule.total_steps=2"]  # fmt: skip
    rows = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        Trainer.from_config(_QUICKSTART, [*sets, f"trainer.checkpointing.save_dir={tmp}"]) as trainer,
    ):
        step, batches = trainer.train_step, iter(trainer.data)
        for number in (1, 2):
            released.append(0)
            census, boxes = StorageCensus(), weakref.WeakSet()  # type: ignore[var-annotated]

            def pack(tensor: torch.Tensor, boxes: weakref.WeakSet = boxes) -> _Box:
                box = _Box(tensor)  # the tensor itself, as the reporter's hook kept it
                boxes.add(box)
                return box

            microbatches = next(batches)
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.tensor)
            with hooks if keeping_hook else census:
                output = step.run(microbatches, number)
            if keeping_hook:
                gc.collect()
                storages = {
                    b.tensor.untyped_storage()._cdata: b.tensor.untyped_storage().nbytes() for b in boxes
                }
                rows.append((released[-1], sum(storages.values())))
                continue
            kept = [step.model.state_dict(keep_vars=True), [p.grad for p in step.model.parameters()],
                    step.optimizer.state, step._scale, output, microbatches]  # fmt: skip
            rows.append((released[-1], census.alive(kept)[0]))
    return rows


class _Box:
    """A saved tensor as a pack hook keeping the tensor itself (with its grad_fn) holds it."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _plain(action) -> tuple:
    """(kind, stage, microbatch, sub-actions) of a torch schedule action, picklable."""
    subs = tuple(_plain(a) for a in (action.sub_actions or ()))
    return (str(action.computation_type.value), action.stage_index, action.microbatch_index, subs)


def single_stage_order(name: str, pp: int, n: int) -> dict[int, list[tuple]]:
    """gpipe: all forwards, then all backwards; 1f1b: torch's warm-up of (pp - rank) forwards, then 1B1F."""
    order = {}
    for rank in range(pp):
        if name == "gpipe":
            acts = [("F", rank, m, ()) for m in range(n)] + [("B", rank, m, ()) for m in range(n)]
        else:
            warm = min(n, pp - rank)
            acts = [("F", rank, m, ()) for m in range(warm)]
            for m in range(n):
                acts.append(("B", rank, m, ()))
                if warm + m < n:
                    acts.append(("F", rank, warm + m, ()))
        order[rank] = acts
    return order


def bubble_fraction(order: dict[int, list[tuple]], num_stages: int) -> float:
    """Idle share of rank-time when each rank runs its actions in order, as soon as their inputs exist."""
    done: dict[tuple[str, int, int], float] = {}
    clock = dict.fromkeys(order, 0.0)
    pos = dict.fromkeys(order, 0)
    busy = 0.0

    def compute(acts: Iterable[tuple]) -> list[tuple]:
        return [a for a in acts if a[0] in COST or a[0] == "OVERLAP_F_B"]

    todo = {r: compute(acts) for r, acts in order.items()}

    def ready_at(kind: str, stage: int, mb: int) -> float | None:
        deps = []
        if kind == "F" and stage > 0:
            deps.append(("F", stage - 1, mb))
        if kind in ("B", "I"):
            deps.append(("F", stage, mb))
            if stage < num_stages - 1:
                deps.append(("grad", stage + 1, mb))
        if kind == "W":
            deps.append(("I", stage, mb))
        times = [done.get(d) for d in deps]
        return None if any(t is None for t in times) else max(times, default=0.0)

    progress = True
    while progress:
        progress = False
        for rank, acts in todo.items():
            while pos[rank] < len(acts):
                kind, stage, mb, subs = acts[pos[rank]]
                parts = [(k, s, m) for k, s, m, _ in subs] if kind == "OVERLAP_F_B" else [(kind, stage, mb)]
                ready = [ready_at(*p) for p in parts]
                if any(t is None for t in ready):
                    break
                cost = sum(COST[k] for k, _, _ in parts)
                end = max(clock[rank], *ready) + cost
                clock[rank], busy, pos[rank], progress = end, busy + cost, pos[rank] + 1, True
                for k, s, m in parts:
                    done[(k, s, m)] = end
                    if k in ("B", "I"):
                        done[("grad", s, m)] = end
    if any(pos[r] < len(todo[r]) for r in todo):
        raise RuntimeError("the schedule's order deadlocks under the unit-cost replay")
    makespan = max(clock.values())
    return 1.0 - busy / (len(order) * makespan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--schedules", nargs="+", default=list(PIPELINE_SCHEDULES))
    parser.add_argument(
        "--through",
        choices=["runtime", "trainer", "both", "none"],
        default="both",
        help="time the bare d9d.parallel.pipeline.Pipeline on an MLP model, the d9d Trainer's step on the quickstart, "
        "both, or none (with --saved: only what the stages hold)",
    )
    parser.add_argument(
        "--trainer-hidden", type=int, default=128, help="the quickstart's hidden size (--through trainer)"
    )
    parser.add_argument(
        "--saved", action="store_true", help="also count what each stage holds after a step (the quickstart)"
    )
    parser.add_argument("--json", help="also write the ratios here (for run_all.py)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    print(
        f"pp={args.pp} microbatches={args.microbatches}x{args.microbatch_size} seq={args.seq} "
        f"layers={args.layers} dim={args.dim}; ideal pipelined step = one-process step / {args.pp}"
    )
    print(
        f"{'schedule':<24}{'stages':>7}{'ms/step':>10}{'1 proc ms':>10}{'vs ideal':>10}{'measured':>10}{'theory':>9}"
    )
    rows: list[Row] = []
    for name in args.schedules if args.through in ("runtime", "both") else []:
        # re-measured next to each schedule, so both see the same load on a shared machine
        single = run_distributed(one_process, 1, args, timeout=600)[0]
        ideal = single / args.pp
        results = run_distributed(pipelined, args.pp, args, name, timeout=600)
        seconds = max(r[0] for r in results)
        num_stages = args.pp * PipelineConfig(name).resolved_stages_per_rank
        order = results[0][1] or single_stage_order(name, args.pp, args.microbatches)
        theory = bubble_fraction(order, num_stages)
        print(
            f"{name:<24}{num_stages:>7}{seconds * 1e3:>10.1f}{single * 1e3:>10.1f}{seconds / ideal:>10.2f}"
            f"{1 - ideal / seconds:>10.1%}{theory:>9.1%}"
        )
        rows.append(
            row(
                f"pipeline {name}: step / (1 process / pp)",
                seconds / ideal,
                f"{1 / (1 - theory):.2f} (bubble only)",
                f"pp {args.pp}, {num_stages} stages",
            )
        )
    if args.through in ("trainer", "both"):
        print(
            f"\nthrough the trainer (quickstart, hidden {args.trainer_hidden}, the whole step: forward, backward, "
            "clipping, optimizer); one process = the same job with pipeline_parallel 1"
        )
        print(f"{'schedule':<24}{'stages':>7}{'ms/step':>10}{'1 proc ms':>10}{'vs ideal':>10}{'theory':>9}")
        for name in args.schedules:
            single = run_distributed(through_trainer, 1, args, 1, "1f1b", timeout=600)[0]
            ideal = single / args.pp
            seconds = max(run_distributed(through_trainer, args.pp, args, args.pp, name, timeout=600))
            num_stages = args.pp * PipelineConfig(name).resolved_stages_per_rank
            theory = bubble_fraction(_order(args, name), num_stages)
            print(
                f"{name:<24}{num_stages:>7}{seconds * 1e3:>10.1f}{single * 1e3:>10.1f}{seconds / ideal:>10.2f}"
                f"{theory:>9.1%}"
            )
            rows.append(
                row(
                    f"trainer pipeline {name}: step / (1 process / pp)",
                    seconds / ideal,
                    f"{1 / (1 - theory):.2f} (bubble only)",
                    f"pp {args.pp}, {num_stages} stages, quickstart",
                )
            )
    if args.saved:
        rows += saved_table(args)
    write_rows(args.json, rows)


def saved_table(args: argparse.Namespace) -> list[Row]:
    """Print what each rank holds after steps 1 and 2 of every schedule; a row per schedule."""
    print(
        f"\nheld after a step (the quickstart at pp {args.pp}, torch {torch.__version__}), bytes per rank, "
        "steps 1 / 2:\n  released: receive buffers torch kept for the next step, freed by Pipeline; "
        "alive: what the step made that anyone still holds (no hook); hook: what a pack hook keeping the "
        "saved tensors reports (another run)"
    )
    print(f"{'schedule':<24}{'rank':>5}{'released':>22}{'alive':>12}{'hook':>24}")
    rows = []
    for name in args.schedules:
        plain = run_distributed(saved_after_steps, args.pp, args.pp, name, False, timeout=600)
        hooked = run_distributed(saved_after_steps, args.pp, args.pp, name, True, timeout=600)
        for rank, (steps, hook_steps) in enumerate(zip(plain, hooked, strict=True)):
            released = " / ".join(f"{r:,}" for r, _ in steps)
            alive = " / ".join(f"{a:,}" for _, a in steps)
            hook = " / ".join(f"{h:,}" for _, h in hook_steps)
            print(f"{name:<24}{rank:>5}{released:>22}{alive:>12}{hook:>24}")
        alive_max = max(a for steps in plain for _, a in steps)
        released_max = max(r for steps in plain for r, _ in steps)
        rows.append(row(f"pipeline {name}: bytes alive after a step (max over ranks and steps)", alive_max, "0",
                        f"receive buffers released {released_max:,} B (torch {torch.__version__})"))  # fmt: skip
    return rows


def _order(args: argparse.Namespace, name: str) -> dict[int, list[tuple]]:
    """The schedule's action order (for the theoretical bubble), from a bare pipeline run when multi-stage."""
    if not PIPELINE_SCHEDULES[name].multi_stage:
        return single_stage_order(name, args.pp, args.microbatches)
    quick = argparse.Namespace(**{**vars(args), "warmup": 0, "steps": 1})
    return run_distributed(pipelined, args.pp, quick, name, timeout=600)[0][1]


if __name__ == "__main__":
    main()
