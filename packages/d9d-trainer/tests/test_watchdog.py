"""The step watchdog's hang report: collective counts per rank name the stuck rank, also when the
waiting ranks sit outside any collective as NCCL ranks do (a 3-rank gloo job, forked; no trainer)."""

import datetime
import multiprocessing
import os
import pickle
import sys
import time

import pytest
import torch
import torch.distributed as dist

from d9d.trainer.faults.failures import FailureBoard
from d9d.trainer.faults.watchdog import EXIT_STEP_TIMEOUT, _message, _stuck_ranks


def _nccl_report(where: str, counts: dict[str, int]) -> dict:
    issued = {f"{g}/nccl": [c, f"mesh_{g}"] for g, c in counts.items()}
    return {"waiting": False, "where": where, "issued": issued, "nccl": True}


def test_nccl_rank_behind_on_a_group_is_the_stuck_one() -> None:
    reports = {r: _nccl_report("trainer.py:9 in _train_step", {"dp": 12, "tp": 30}) for r in (0, 2, 3)}
    reports[1] = _nccl_report("data.py:3 in __next__", {"dp": 11, "tp": 30})
    stuck, behind = _stuck_ranks(reports, 4)
    assert stuck == [1]
    text = _message(7, 60.0, reports, stuck, 4, behind=behind, dumps=["/tmp/fr/step-7-nccl"])
    assert (
        "rank 1 is stuck outside any collective at data.py:3 in __next__: it issued 11 collectives on "
        "mesh_dp (nccl) where ranks [0, 2, 3] issued 12; ranks [0, 2, 3] wait for it in a collective"
    ) in text
    assert "flight-recorder traces: /tmp/fr/step-7-nccl (each rank writes its own there" in text
    assert "`python -m torch.distributed.flight_recorder.fr_trace <folder>`" in text


def test_nccl_ranks_with_equal_counts_wait_on_the_gpu() -> None:
    reports = {r: _nccl_report("trainer.py:9 in _train_step", {"dp": 12}) for r in range(4)}
    stuck, behind = _stuck_ranks(reports, 4)
    assert stuck == [] and behind == {}
    text = _message(7, 60.0, reports, stuck, 4, behind=behind)
    assert "every rank issued the same collectives and waits for them to finish" in text
    assert "stuck outside any collective" not in text
    del reports[3]  # a rank that does not answer is named, the others wait for it
    stuck, behind = _stuck_ranks(reports, 4)
    assert stuck == [3] and "rank 3 did not answer" in _message(7, 60.0, reports, stuck, 4, behind=behind)


def test_gloo_without_counts_keeps_the_frame_rule() -> None:
    waiting = {"waiting": True, "where": "distributed_c10d.py:1 in all_reduce"}
    outside = {"waiting": False, "where": "model.py:7 in forward"}
    assert _stuck_ranks({0: waiting, 1: outside}, 3) == ([1, 2], {})
    assert _stuck_ranks({0: waiting, 1: waiting}, 2) == ([], {})
    assert "called different ones" in _message(5, 30.0, {0: waiting, 1: waiting}, [], 2)


def _rank_main(rank: int, world: int, tmp: str, mode: str) -> None:
    out = open(os.path.join(tmp, f"rank{rank}.out"), "w", buffering=1)  # noqa: SIM115 (lives until _exit)
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    sys.stdout = sys.stderr = out
    try:
        from d9d.mesh import configure_logging
        from d9d.trainer.faults.watchdog import StepWatchdog

        configure_logging(stream=out)  # earlier tests in this process may have logged to another stream

        torch.set_num_threads(1)
        store = dist.FileStore(os.path.join(tmp, "store"), world)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30)
        )
        for _ in range(3):  # earlier steps: every rank issued the same
            dist.all_reduce(torch.ones(1))
        board_store = dist.PrefixStore("watchdog-test/", store)
        board = FailureBoard(board_store, rank, world)
        watchdog = StepWatchdog(board_store, board, rank, world, 1.5, dump_dir=os.path.join(tmp, "fr"))
        try:
            with watchdog.step(4):
                if rank == 1:
                    time.sleep(30)  # stuck before its collective
                elif mode == "blocking":
                    dist.all_reduce(torch.ones(1))  # gloo: blocked inside torch.distributed
                else:
                    work = dist.all_reduce(torch.ones(1), async_op=True)  # as NCCL: issued, returns at once
                    work.wait()  # ... and the rank waits outside any torch.distributed frame
        except Exception:
            watchdog.hold_if_exiting()  # as the trainer does: the watchdog's report comes alone
            raise
        os._exit(0)
    except BaseException as exc:
        print(f"rank {rank} raised {exc!r}", flush=True)
        os._exit(1)


@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_three_ranks_one_stuck_is_named_from_its_collective_count(tmp_path, mode) -> None:
    world = 3
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, str(tmp_path), mode), daemon=True)
        for r in range(world)
    ]
    start = time.monotonic()
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=40)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    outputs = [(tmp_path / f"rank{r}.out").read_text() for r in range(world)]
    assert [p.exitcode for p in procs] == [EXIT_STEP_TIMEOUT] * world, outputs
    assert time.monotonic() - start < 25
    errors = [line for line in outputs[0].splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, outputs[0]
    assert errors[0].startswith("error: step 4 did not finish within trainer.timeouts.step_s=1.5 s: ")
    assert (
        "rank 1 is stuck outside any collective at test_watchdog.py:" in errors[0]
        and "it issued 3 collectives on default_pg (gloo) where ranks [0, 2] issued 4" in errors[0]
        and "; ranks [0, 2] wait for it in a collective" in errors[0]
    ), errors[0]
    assert "this rank is stuck here" in outputs[1] and "this rank is stuck here" not in outputs[0]
    # every rank wrote its flight-recorder trace, readable by torch's fr_trace tool
    folder = tmp_path / "fr" / "step-4-gloo"
    assert str(folder) in errors[0]
    traces = {r: pickle.loads((folder / f"rank_{r}").read_bytes()) for r in range(world)}
    assert [len(traces[r]["entries"]) for r in range(world)] == [4, 3, 4]
