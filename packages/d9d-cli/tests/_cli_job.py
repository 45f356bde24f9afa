"""A tiny job for CLI tests: writes a provider file and a config.yaml into a directory.

The provider file is imported by path (`tiny_job.py:TinyModelProvider`), like a user's train.py, so
the tests also cover provider paths that are relative to the config file.
"""

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

PROVIDERS = '''
"""Tiny causal LM and random-token dataset (written by d9d-cli tests)."""

from typing import Any

import msgspec
import torch
from torch import nn

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel

from d9d.parallel import parallelize_hsdp, parallelize_tensor_parallel
from d9d.trainer.providers import BuildDatasetResult, InitializeModelStageResult, PrepareExportModelStageResult


class TinyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    vocab: int = 32
    hidden: int = 16
    layers: int = 2


class TinyLM(nn.Module):
    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.blocks = nn.ModuleList(nn.Linear(config.hidden, config.hidden) for _ in range(config.layers))
        self.head = nn.Linear(config.hidden, config.vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        x = x.cumsum(1) / torch.arange(1, x.shape[1] + 1, device=x.device).view(1, -1, 1)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)


class TinyModelProvider:
    config_type = TinyConfig

    def __init__(self, config: TinyConfig) -> None:
        self.config = config

    def initialize_model_stage(self, context: Any) -> InitializeModelStageResult:
        return InitializeModelStageResult(model=TinyLM(self.config))

    def parallelize_model_stage(self, context: Any) -> None:
        if context.mesh is not None:  # tensor parallel: each block's output gathered whole
            plan = {f"blocks.{i}": ColwiseParallel(output_layouts=Replicate()) for i in range(len(context.model.blocks))}
            parallelize_tensor_parallel(context.model, context.mesh, plan)
        parallelize_hsdp(context.model, context.mesh, blocks=list(context.model.blocks), precision=context.precision)

    def prepare_export_model_stage(self, context: Any) -> PrepareExportModelStageResult:
        return PrepareExportModelStageResult(mapper=None)


class TokensConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    samples: int = 64
    seq_len: int = 8
    vocab: int = 32


class Tokens(torch.utils.data.Dataset):
    def __init__(self, config: TokensConfig) -> None:
        start = torch.randint(0, config.vocab, (config.samples, 1), generator=torch.Generator().manual_seed(0))
        self.tokens = (start + torch.arange(config.seq_len + 1)) % config.vocab

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


class TokensProvider:
    config_type = TokensConfig

    def __init__(self, config: TokensConfig) -> None:
        self.config = config

    def build_dataset(self, context: Any) -> BuildDatasetResult:
        return BuildDatasetResult(dataset=Tokens(self.config))
'''


def job_config(**changes: Any) -> dict[str, Any]:
    """The tiny job as a dict; `changes` replace top-level sections."""
    config: dict[str, Any] = {
        "providers": {"model": "tiny_job.py:TinyModelProvider", "dataset": "tiny_job.py:TokensProvider"},
        "mesh": {},
        "data": {"global_batch_size": 8, "microbatch_size": 2},
        "trainer": {
            "run": {"name": "tiny"},
            "schedule": {"total_steps": 4},
            "checkpointing": {"save_dir": "runs", "period_steps": 2, "num_to_keep": 3},
            "logging": {"period_steps": 1, "progress_bar": False},
        },
        "optimizer": {"name": "adamw", "lr": 1e-2},
        "lr_scheduler": {"name": "cosine", "warmup_steps": 1},
    }
    config.update(changes)
    return config


def write_job(directory: Path, **changes: Any) -> Path:
    """Write tiny_job.py and config.yaml into `directory`; return the config path."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tiny_job.py").write_text(PROVIDERS, encoding="utf-8")
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(job_config(**changes)), encoding="utf-8")
    return path


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    return env


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """`python -m d9d.cli ARGS` in a real subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "d9d.cli", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_cli_concurrently(
    *commands: list[str], timeout: float = 120.0
) -> list[subprocess.CompletedProcess[str]]:
    """Several `python -m d9d.cli ...` subprocesses at once (each pays torch's import time)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "d9d.cli", *args],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in commands
    ]
    results = []
    for args, proc in zip(commands, procs, strict=True):
        out, err = proc.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(args, proc.returncode, out, err))
    return results
