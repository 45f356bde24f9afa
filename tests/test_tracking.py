"""`trainer.tracking`: TensorBoard, W&B (offline) and MLflow (local file store) get the records of
metrics.jsonl, read back here with the libraries themselves; a run resumed after a failure continues
the same tracker run with each step once and in order; only rank 0 writes; a missing library is one
error line before anything is written.

The resumed run fails at the start of step 6 (after step 5's record went out) and resumes from its
checkpoint of step 4, so step 5 is redone: TensorBoard purges and rewrites it, W&B and MLflow keep
the first one (equal in every training number, the resume is exact; its timings are the first
launch's).
"""

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _quickstart import CONFIG, overrides, records, run_forked, train, train_and_gather

from d9d.trainer import ConfigError, load_job_config
from d9d.trainer.observe.tracking import STATE_FILE, Trackers, numeric_fields


@pytest.fixture(scope="module", autouse=True)
def _tracker_libraries_imported() -> None:
    """Import the trackers' libraries once here, before the ranks fork: each forked run would import
    them itself, mlflow alone ~4-7 s on a busy 2-core machine. Importing starts no thread."""
    import mlflow  # noqa: F401
    import torch.utils.tensorboard  # noqa: F401
    import wandb  # noqa: F401


ALL = "trainer.tracking={backends: [jsonl, tensorboard, wandb, mlflow], project: tiny, wandb_mode: offline}"
#: Fields that are the same numbers when a step is redone (the others are timings and memory).
EXACT = ("loss", "grad_norm", "lr", "tokens")


def _series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """{field: [(step, value), ...]} of the numeric fields of metrics.jsonl records."""
    found: dict[str, list[tuple[int, float]]] = {}
    for record in rows:
        for key, value in numeric_fields(record).items():
            found.setdefault(key, []).append((record["step"], value))
    return found


def _tensorboard(directory: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, list[str]]]:
    """The scalars ({tag: [(step, value)]}) and texts ({tag: [text, ...]}) TensorBoard reads from a dir."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in tags["scalars"]}
    texts = {
        tag.removesuffix("/text_summary"): [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)]
        for tag in tags["tensors"]
    }
    return scalars, texts


def _wandb_records(path: Path) -> list:
    """The protobuf records of a `.wandb` file (W&B's log of 32 KiB blocks of checksummed chunks)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    position, pending, found = 7, b"", []
    while position + 7 <= len(data):
        room = 32768 - position % 32768
        if room < 7:  # a block's tail too short for a chunk header is padding
            position += room
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk  # full, first | middle, last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            found.append(record)
    return found


def _wandb(run_dir: Path) -> tuple[list[str], list[dict], list]:
    """The W&B offline runs under a run dir: their run ids, history rows (in launch order), run records."""
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))  # named by start time
    ids, history, runs = [], [], []
    for file in files:
        for record in _wandb_records(file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.append(record.run.run_id)
                runs.append(record.run)
            elif kind == "history":
                row = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
                history.append({**row, "step": record.history.step.num})
    return ids, history, runs


def _mlflow_client(run_dir: Path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())


def _check_series(expected: dict, actual: dict, *, exact_only: set[int] = frozenset(), float32: bool = False):
    """Every field of metrics.jsonl is in the tracker with the same steps, once each, in order, and the
    same values (steps in `exact_only`: only the fields that a redone step reproduces)."""
    assert set(expected) <= set(actual), sorted(set(expected) - set(actual))
    for key, points in expected.items():
        assert [s for s, _ in actual[key]] == [s for s, _ in points], key
        for (step, want), (_, got) in zip(points, actual[key], strict=True):
            if step in exact_only and key not in EXACT:
                continue
            want = float(np.float32(want)) if float32 else want
            assert got == want or (math.isnan(got) and math.isnan(want)), (key, step, got, want)


def test_every_backend_gets_the_series_and_a_resume_continues_its_run(tmp_path, monkeypatch):
    args = overrides(tmp_path, "run", 8, ALL, "trainer.checkpointing.period_steps=4")
    fail = {"D9D_TEST_RAISE_AT_STEP": "6", "D9D_TEST_RAISE_ONCE": str(tmp_path / "raised")}
    with pytest.raises(AssertionError, match="injected failure"):
        run_forked(train_and_gather, args, env=fail)
    run_dir = tmp_path / "run"
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3, 4, 5]
    state = json.loads((run_dir / STATE_FILE).read_text())
    run_forked(train_and_gather, args, env=fail)  # resumes from step 4, redoes 5
    rows = records(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 9))
    expected = _series(rows)
    assert {"loss", "grad_norm", "lr", "tokens", "step_time_s"} <= set(expected)
    assert json.loads((run_dir / STATE_FILE).read_text())["wandb"]["id"] == state["wandb"]["id"]

    scalars, texts = _tensorboard(run_dir / "tensorboard")  # purged step 5 and rewrote it
    _check_series(expected, scalars, float32=True)
    assert texts["run"] == ["run", "run"]  # one per launch
    assert json.loads(texts["config"][-1])["trainer"]["schedule"]["total_steps"] == 8

    ids, history, runs = _wandb(run_dir)
    assert ids == [state["wandb"]["id"]] * 2  # the second launch resumed the same run
    assert [run.display_name for run in runs] == ["run", "run"] and runs[0].project == "tiny"
    config = {item.key: json.loads(item.value_json) for item in runs[0].config.update}
    assert config["trainer"]["run"]["name"] == "run"
    wandb_series = _series(history)
    _check_series(expected, wandb_series, exact_only={5})

    client = _mlflow_client(run_dir, monkeypatch)
    experiment = client.get_experiment_by_name("tiny")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == state["mlflow"]["run_id"] and run.info.run_name == "run"
    assert run.info.status == "FINISHED"
    assert run.data.params["trainer.run.name"] == "run"
    assert run.data.params["trainer.schedule.total_steps"] == "8"
    saved = json.loads(
        Path(client.download_artifacts(run.info.run_id, "d9d/config.json", str(tmp_path))).read_text()
    )
    assert saved["trainer"]["tracking"]["project"] == "tiny"
    history = {
        key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)] for key in expected
    }
    _check_series(expected, history, exact_only={5})


def test_only_rank_0_writes_the_trackers_under_fsdp_2(tmp_path, monkeypatch):
    train(2, overrides(tmp_path, "fsdp", 2, ALL, "mesh.data_parallel_shard=2"))
    run_dir = tmp_path / "fsdp"
    expected = _series(records(run_dir))
    assert len(list((run_dir / "tensorboard").iterdir())) == 1  # one event file: one writer
    _check_series(expected, _tensorboard(run_dir / "tensorboard")[0], float32=True)
    ids, history, _ = _wandb(run_dir)
    assert len(ids) == 1
    _check_series(expected, _series(history))
    client = _mlflow_client(run_dir, monkeypatch)
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2]


def test_a_missing_tracker_library_is_one_line_before_anything_is_written(tmp_path):
    run_dir = tmp_path / "missing"
    args = overrides(tmp_path, "missing", 2, "trainer.tracking.backends=[wandb]")
    code = (
        "import sys; sys.modules['wandb'] = None\n"  # as if wandb were not installed
        "from d9d.trainer import main\n"
        f"main({[CONFIG, *args]!r})\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-2000:]
    assert (
        "trainer.tracking.backends: wandb needs wandb (the `wandb` module), which is not installed"
        in errors[0]
    )
    assert "`uv sync --all-packages --extra wandb`" in errors[0]
    assert "pip install 'd9d-trainer[wandb]'" in errors[0]
    assert "Traceback" not in done.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("[jsonl, neptune]", "trainer.tracking.backends"),
        ("[tensorboard, tensorboard]", "tensorboard more than once"),
    ],
)
def test_the_config_refuses_unknown_or_repeated_backends(tmp_path, value, message):
    with pytest.raises(ConfigError, match=message):
        load_job_config(CONFIG, overrides(tmp_path, "bad", 2, f"trainer.tracking.backends={value}"))
    assert not (tmp_path / "bad").exists()


def test_numeric_fields_takes_every_number_but_the_step_and_flags():
    record = {"step": 3, "loss": 1.5, "tokens": 512, "mfu": 0.4, "time_data_s": 0.01, "skipped": False,
              "launch": "2026-01-01T00:00:00+00:00", "memory": {"peak_gib": 2.0}}  # fmt: skip
    assert numeric_fields(record) == {
        "loss": 1.5, "tokens": 512.0, "mfu": 0.4, "time_data_s": 0.01, "memory/peak_gib": 2.0,
    }  # fmt: skip


class _Recorder:
    def __init__(self, name: str, fail: bool = False) -> None:
        self.name, self.fail, self.rows, self.closed = name, fail, [], []
        self.last_step = 0

    def log(self, rows) -> None:
        if self.fail:
            raise OSError("disk full")
        self.rows += rows

    def close(self, *, failed: bool) -> None:
        self.closed.append(failed)


def test_a_failing_tracker_is_left_out_and_the_others_go_on():
    broken, fine = _Recorder("broken", fail=True), _Recorder("fine")
    trackers = Trackers([broken, fine])
    trackers.log([{"step": 1, "loss": 2.0}])
    trackers.log([{"step": 2, "loss": 1.0}])
    assert trackers.names == ["fine"] and broken.closed == [True]
    assert fine.rows == [(1, {"loss": 2.0}), (2, {"loss": 1.0})]
    trackers.close()
    trackers.close()  # once only
    assert fine.closed == [False]


def test_a_tracker_that_cannot_start_on_rank_0_stops_every_rank_with_its_error(tmp_path):
    import time

    from d9d.mesh.testing import DistributedTestError

    bogus = "trainer.tracking={backends: [mlflow], mlflow_tracking_uri: 'bogus-scheme://nowhere'}"
    began = time.monotonic()
    with pytest.raises(DistributedTestError, match="the mlflow tracker could not start") as caught:
        train(2, overrides(tmp_path, "bogus", 2, "mesh.data_parallel_shard=2", bogus), timeout=120)
    assert time.monotonic() - began < 60, "the other rank waited for a step timeout"
    assert "another rank failed first" in str(caught.value) or "ranks [1] failed too" in str(caught.value)
    assert not (tmp_path / "bogus").exists()  # a job that did not start leaves no run directory, no lock
