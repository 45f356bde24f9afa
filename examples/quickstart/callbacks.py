"""Callbacks for the quickstart job (docs/extending.md): the trainer's events, in plain Python.

uv run d9d train config.yaml --set 'trainer.callbacks=[{target: callbacks.py:LossTarget, config: {loss: 4.0}}]'
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from d9d.trainer import Callback, RunControl, TrainResult


@dataclass(frozen=True)
class LossTargetConfig:
    """The callback's own config section: `trainer.callbacks[i].config`."""

    loss: float = 2.0  # stop once a step's training loss is below this
    file: str = "loss-target.json"  # what it writes into the run directory at the end


class LossTarget(Callback):
    """Stops the run (saving it) at the first logged step whose loss is below `config.loss`, and writes
    the steps it saw and why the run ended to `<run_dir>/<config.file>`. Rank 0 only (the default)."""

    config_type = LossTargetConfig

    def __init__(self, config: LossTargetConfig) -> None:
        super().__init__(config)
        self.losses: dict[int, float] = {}

    def on_step(self, run: RunControl, record: Any) -> None:
        self.losses[record["step"]] = record["loss"]
        if record["loss"] < self.config.loss:
            run.request_stop(f"loss {record['loss']:.3f} below {self.config.loss} at step {record['step']}")

    def on_train_end(self, run: RunControl, result: TrainResult) -> None:
        summary = {"final_step": result.final_step, "stopped_by": result.stopped_by, "losses": self.losses}
        Path(run.run_dir, self.config.file).write_text(json.dumps(summary, indent=1) + "\n")
