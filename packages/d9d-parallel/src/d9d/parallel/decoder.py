"""The standard parallelization of a decoder-only transformer, in one call: activation checkpointing and
`torch.compile` per block, then FSDP2 units (`parallelize_hsdp`), in that order, by one unit rule.

Every d9d decoder (the reference model, the `d9d init` template, the Hugging Face backend) calls
`parallelize_decoder` after its tensor, expert and context parallelism and LoRA, so the rule that
decides what is gathered together lives here only (`decoder_units`).
"""

from collections.abc import Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from d9d.parallel.activation_checkpointing import apply_activation_checkpointing
from d9d.parallel.compile import compile_blocks
from d9d.parallel.config import ActivationCheckpointingConfig, CompileConfig
from d9d.parallel.data_parallel import ShardUnit, parallelize_hsdp
from d9d.parallel.precision import MixedPrecision

__all__ = ["decoder_units", "parallelize_decoder"]

_NO_CHECKPOINTING = ActivationCheckpointingConfig()
_NO_COMPILE = CompileConfig()


def decoder_units(
    blocks: Sequence[nn.Module],
    *,
    embedding: ShardUnit | None = None,
    final_norm: nn.Module | None = None,
    head: nn.Module | None = None,
) -> list[ShardUnit]:
    """The FSDP units of a decoder, in forward order: the embedding, each block, then `[final_norm, head]`.

    Why: only one unit's gathered weights are alive at a time, so neither the vocabulary table nor the
    head stays gathered for the whole step, and each unit's gradients are reduced as soon as backward
    leaves it. The unit that runs last in forward comes last: `parallelize_hsdp` keeps it gathered into
    backward, which starts with it. A tied embedding and head share one weight, so they are one unit,
    gathered from the embedding's forward to the head's: it comes last then, after `[final_norm]`.

    Args:
        blocks: the decoder blocks (layers), in forward order.
        embedding: the input embedding (a module, or several gathered together, e.g. token and
            position embeddings); None on a pipeline stage that does not embed.
        final_norm: the norm before the head; None where the stage has none.
        head: the LM head; None on a pipeline stage without it. When it shares a parameter with
            `embedding`, the two are one unit.
    """
    embeds = [] if embedding is None else [embedding] if isinstance(embedding, nn.Module) else list(embedding)
    table = {id(p) for module in embeds for p in module.parameters()}
    tied = head is not None and any(id(p) in table for p in head.parameters())
    units: list[ShardUnit] = []
    if embeds and not tied:
        units.append(embeds[0] if len(embeds) == 1 else embeds)
    units.extend(blocks)
    if tied:
        if final_norm is not None:
            units.append([final_norm])
        units.append([*embeds, head])
    else:
        last = [m for m in (final_norm, head) if m is not None]
        if last:
            units.append(last)
    return units


def parallelize_decoder(
    model: nn.Module,
    mesh: DeviceMesh | None,
    *,
    blocks: Sequence[nn.Module],
    embedding: ShardUnit | None = None,
    final_norm: nn.Module | None = None,
    head: nn.Module | None = None,
    activation_checkpointing: ActivationCheckpointingConfig = _NO_CHECKPOINTING,
    compile: CompileConfig = _NO_COMPILE,
    precision: MixedPrecision | None = None,
    cpu_offload: bool = False,
) -> nn.Module:
    """Checkpoint and compile each block, then shard `model` in the FSDP units of `decoder_units`.

    The order is fixed: checkpointing wraps a block's forward, compile then traces the wrapped forward
    (the recompute included), and FSDP2's hooks stay outside the compiled graph. Call it after tensor,
    expert and context parallelism and `apply_lora`, on the meta device; parameter names never change.
    On a pipeline stage pass what the stage holds (None for the rest). `mesh` None (one process)
    checkpoints and compiles but shards nothing; the mesh's data axes give DDP, FSDP or HSDP as in
    `parallelize_hsdp`.

    Args:
        model: the model (or one pipeline stage): the root unit, holding whatever no unit names.
        blocks, embedding, final_norm, head: as in `decoder_units`; only `blocks` are checkpointed
            and compiled.
        activation_checkpointing: which blocks recompute in backward (e.g. the job's
            `trainer.activation_checkpointing`); the default checkpoints none.
        compile: whether to compile each block in place (`trainer.compile`); the default does not.
        precision: the dtypes FSDP2 gathers and reduces in (`trainer.precision`).
        cpu_offload: keep every unit's sharded state on the host (`trainer.memory.cpu_offload`).
    """
    blocks = list(blocks)
    apply_activation_checkpointing(blocks, activation_checkpointing)
    compile_blocks(blocks, compile)
    units = decoder_units(blocks, embedding=embedding, final_norm=final_norm, head=head)
    return parallelize_hsdp(model, mesh, blocks=units, precision=precision, cpu_offload=cpu_offload)
