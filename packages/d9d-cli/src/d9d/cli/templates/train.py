"""A d9d quickstart: a small GPT-style language model trained on corpus.txt (written by `d9d init`).

    python train.py config.yaml                          # one process (CPU or one GPU)
    d9d train config.yaml                                # the same job through the CLI
    torchrun --nproc-per-node 2 -m d9d.cli train config.yaml --set mesh.data_parallel_shard=2

The job is described by config.yaml; this file holds the model and the dataset it names.
"""

from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from d9d.data import TextDataset
from d9d.parallel import parallelize_context_parallel, parallelize_decoder, to_autocast_dtype
from d9d.trainer import main
from d9d.trainer.providers import (
    BuildDatasetContext,
    BuildDatasetResult,
    InitializeModelStageContext,
    InitializeModelStageResult,
    ParallelizeModelStageContext,
    PrepareExportModelStageContext,
    PrepareExportModelStageResult,
)


class ModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The `model:` section."""

    vocab_size: int = 257  # the built-in byte tokenizer: 256 bytes + end of document
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    max_seq_len: int = 256


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_heads
        self.attn_norm = nn.RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden, bias=False)
        self.context_parallel: Any = None  # set under mesh.context_parallel > 1 (see parallelize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(b, t, 3, self.num_heads, h // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [batch, heads, seq, head_dim]
        if self.context_parallel is not None:  # this rank holds part of the sequence: attend to all of it
            y = self.context_parallel.attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, h))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class QuickstartLM(nn.Module):
    """Token + learned position embeddings, a stack of blocks, a final norm and the output head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pos = nn.Embedding(config.max_seq_len, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.context_parallel: Any = None  # as in Block: the global positions of this rank's tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        cp, seq = self.context_parallel, input_ids.shape[1]
        if cp is not None:
            positions = cp.position_ids(seq * cp.size, input_ids.device)
        else:
            positions = torch.arange(seq, device=input_ids.device)
        # the compute dtype under autocast (a lookup stays float32): the residual stream is bf16 on GPUs
        x = to_autocast_dtype(self.embed(input_ids) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def initialize_module(self, path: str, module: nn.Module) -> None:
        """d9d calls this for every module that owns weights (on any mesh, with the same result)."""
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        else:
            module.reset_parameters()


class QuickstartModelProvider:
    """Builds the model and shards it with HSDP (DDP, FSDP or both, as the mesh says)."""

    config_type = ModelConfig

    def __init__(self, config: ModelConfig) -> None:
        self.config = config

    def initialize_model_stage(self, context: InitializeModelStageContext) -> InitializeModelStageResult:
        return InitializeModelStageResult(model=QuickstartLM(self.config))

    def parallelize_model_stage(self, context: ParallelizeModelStageContext) -> None:
        """Called on every mesh (one process too: then context.mesh is None and HSDP is a no-op).

        The order matters: context parallelism, then `parallelize_decoder` (activation checkpointing,
        compile, then data parallelism).
        """
        model = context.model
        parallelize_context_parallel(model, context.mesh)  # mesh.context_parallel: long sequences
        # Per block: activation checkpointing, then compile. Then one FSDP unit per block, one for the
        # embeddings, one for [norm, head]: only one unit's full weights live at a time, and each
        # unit's gradients are reduced early.
        parallelize_decoder(
            model,
            context.mesh,
            blocks=list(model.blocks),
            embedding=[model.embed, model.pos],
            final_norm=model.norm,
            head=model.head,
            activation_checkpointing=context.activation_checkpointing,  # trainer.activation_checkpointing
            compile=context.compile,  # trainer.compile
            precision=context.precision,  # trainer.precision: FSDP gathers in the compute dtype
            cpu_offload=context.cpu_offload,  # trainer.memory.cpu_offload
        )

    def prepare_export_model_stage(
        self, context: PrepareExportModelStageContext
    ) -> PrepareExportModelStageResult:
        return PrepareExportModelStageResult(mapper=None)  # save the module's own parameter names


class CorpusConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The `dataset:` section; `path` is relative to the config file."""

    path: str = "corpus.txt"
    seq_len: int = 128


class CorpusProvider:
    """A text file, byte-tokenized and packed into samples of seq_len tokens."""

    config_type = CorpusConfig

    def __init__(self, config: CorpusConfig) -> None:
        self.config = config

    def build_dataset(self, context: BuildDatasetContext) -> BuildDatasetResult:
        path = Path(context.base_dir) / self.config.path
        return BuildDatasetResult(dataset=TextDataset(path, self.config.seq_len))


if __name__ == "__main__":
    main()
