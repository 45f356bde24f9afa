"""A tiny causal LM job for trainer tests: model provider, dataset provider, config builder."""

import os
from typing import Any

import msgspec
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from d9d.parallel import apply_activation_checkpointing, apply_lora, compile_blocks, parallelize_hsdp
from d9d.trainer.providers import (
    BuildDatasetResult,
    InitializeModelStageResult,
    PrepareExportModelStageResult,
    PrepareImportModelStageResult,
)


class TinyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    vocab: int = 64
    hidden: int = 32
    layers: int = 2
    import_dir: str | None = None


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.blocks = nn.ModuleList(Block(config.hidden) for _ in range(config.layers))
        self.head = nn.Linear(config.hidden, config.vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        # causal mixing: cumulative mean over positions
        x = x.cumsum(1) / torch.arange(1, x.shape[1] + 1, device=x.device).view(1, -1, 1)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TinyModelProvider:
    config_type = TinyConfig

    def __init__(self, config: TinyConfig) -> None:
        self.config = config

    def initialize_model_stage(self, context: Any) -> InitializeModelStageResult:
        return InitializeModelStageResult(model=TinyLM(self.config))

    def parallelize_model_stage(self, context: Any) -> None:
        blocks = list(context.model.blocks)
        apply_activation_checkpointing(blocks, context.activation_checkpointing)
        compile_blocks(blocks, context.compile)
        parallelize_hsdp(context.model, context.mesh, blocks=blocks, precision=context.precision)

    def prepare_export_model_stage(self, context: Any) -> PrepareExportModelStageResult:
        return PrepareExportModelStageResult(mapper=None)

    def prepare_import_model_stage(self, context: Any) -> PrepareImportModelStageResult:
        return PrepareImportModelStageResult(folder=self.config.import_dir)


class LoraModelProvider(TinyModelProvider):
    """The tiny model with `peft.lora`'s adapters, applied as the contract says: before data parallelism."""

    def parallelize_model_stage(self, context: Any) -> None:
        if context.lora is not None:
            apply_lora(context.model, context.lora)
        super().parallelize_model_stage(context)


class RandomTokensConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    samples: int = 64
    seq_len: int = 8
    vocab: int = 64
    seed: int = 0


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, config: RandomTokensConfig) -> None:
        g = torch.Generator().manual_seed(config.seed)
        # a learnable pattern: next token = (token + 1) mod vocab, with noise at the start
        start = torch.randint(0, config.vocab, (config.samples, 1), generator=g)
        self.tokens = (start + torch.arange(config.seq_len + 1)) % config.vocab

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


class RandomTokensProvider:
    config_type = RandomTokensConfig

    def __init__(self, config: RandomTokensConfig) -> None:
        self.config = config

    def build_dataset(self, context: Any) -> BuildDatasetResult:
        return BuildDatasetResult(dataset=RandomTokens(self.config))


def job_config(
    save_dir: str, *, name: str = "tiny", total_steps: int = 4, mesh: dict | None = None, **extra: Any
) -> dict:
    config = {
        "providers": {
            "model": f"{__name__}:TinyModelProvider",
            "dataset": f"{__name__}:RandomTokensProvider",
        },
        "mesh": mesh or {},
        "data": {"global_batch_size": 8, "microbatch_size": 2, "seed": 1},
        "trainer": {
            "run": {"name": name},
            "schedule": {"total_steps": total_steps},
            "checkpointing": {"save_dir": save_dir, "period_steps": 2, "num_to_keep": 2},
            "logging": {"period_steps": 1},
            "gradient_clipping": {"max_norm": 1.0},
        },
        "optimizer": {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1},
        "lr_scheduler": {"name": "cosine", "warmup_steps": 1},
    }
    for key, value in extra.items():
        config[key] = value
    return config


def record_states(trainer: Any) -> list[dict[str, torch.Tensor]]:
    """Wrap the trainer's step: the list fills with this rank's weights and optimizer state (its local
    shards) after each step."""
    after: list[dict[str, torch.Tensor]] = []
    run = trainer.train_step.run

    def local(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    def recording(microbatches: Any, step: int) -> Any:
        output = run(microbatches, step)
        state = {k: local(v) for k, v in trainer.model.state_dict().items()}
        for i, s in enumerate(trainer.optimizer.state.values()):
            state |= {f"opt{i}.{k}": local(v) for k, v in s.items() if isinstance(v, torch.Tensor)}
        after.append(state)
        return output

    trainer.train_step.run = recording
    return after


class NaNAtStepTask:
    """Causal-LM loss that turns NaN on its 3rd step (its 9th microbatch: 4 per step on one process)."""

    config_type = None
    at_call = 9  # the first microbatch of step 3

    def __init__(self, config: Any = None) -> None:
        from d9d.trainer import CausalLMTask

        self._inner = CausalLMTask()
        self._calls = 0

    def batch_weight(self, batch: Any) -> float:
        return self._inner.batch_weight(batch)

    def compute_loss(self, context: Any) -> Any:
        self._calls += 1
        result = self._inner.compute_loss(context)
        return self.fault(result) if self._calls == self.at_call else result

    def fault(self, result: Any) -> Any:
        """The microbatch's result, spoiled."""
        from d9d.trainer.providers import LossResult

        return LossResult(loss_sum=result.loss_sum * float("nan"), weight=result.weight)


class InfGradAtStepTask(NaNAtStepTask):
    """The loss stays finite on step 3, but the gradient flowing back from its first microbatch's loss
    is multiplied by `value` (inf: every gradient becomes ±inf, or nan where it was 0)."""

    value = float("inf")

    def fault(self, result: Any) -> Any:
        result.loss_sum.register_hook(lambda grad: grad * self.value)
        return result


class NaNGradAtStepTask(InfGradAtStepTask):
    """A finite loss with NaN gradients on step 3."""

    value = float("nan")


class InfGradOnRank1Task(InfGradAtStepTask):
    """A finite loss with inf gradients on step 3 of rank 1 alone (2 microbatches per step on 2 ranks)."""

    at_call = 5

    def fault(self, result: Any) -> Any:
        return super().fault(result) if os.environ.get("RANK") == "1" else result
