"""What a model does to be pipelined: the stage module's contract, and trimming a model to one stage."""

from typing import Any, Protocol, runtime_checkable

from torch import nn

from d9d.parallel.pipeline.errors import PipelineError
from d9d.parallel.pipeline.layout import StageSpec

__all__ = ["PipelineStageModule", "keep_stage_layers"]


@runtime_checkable
class PipelineStageModule(Protocol):
    """What a model's stage module must do to be pipelined (an `nn.Module` with this `forward`).

    `forward(inputs, **kwargs)`:

    - `inputs`: on the first stage, the microbatch's model inputs (token ids `[batch, seq]`); on any
      other stage, the previous stage's output (hidden states `[batch, seq, hidden]`). A tuple output
      of the previous stage arrives as several positional arguments.
    - `kwargs`: the microbatch's extra keyword inputs (e.g. position ids), given to EVERY stage.
    - returns: on all but the last stage, the tensor(s) the next stage receives (floating tensors that
      carry gradient); on the last stage, what `loss_fn(output, target)` takes (e.g. logits).

    Build a stage with the embedding only when `StageSpec.is_first`, the layers in `StageSpec.layers`
    (keeping their whole-model names, so checkpoints stay stage-agnostic), and the final norm and head
    only when `StageSpec.is_last`.

    Optionally `tied_parameters() -> [("model.embed_tokens.weight", "lm_head.weight")]`: whole-model
    names that are one parameter (a tied head). A stage holding any of them keeps it under the first
    name too (as one process names it), and `Pipeline` keeps the stages' copies one parameter (see
    `d9d.parallel.pipeline.tied`).
    """

    def forward(self, inputs: Any, /, **kwargs: Any) -> Any:
        """Run this stage on one microbatch."""
        ...


def keep_stage_layers(layers: nn.ModuleDict, spec: StageSpec) -> nn.ModuleDict:
    """Delete from `layers` (keyed "0".."N-1" by whole-model index) every layer the stage does not hold.

    The kept layers keep their keys, so parameter names (`layers.5.mlp...`) are the whole model's.
    Works on the meta device: build the whole model there, trim it, then materialize only the stage.

    Raises:
        PipelineError: when a layer of the stage is missing from `layers`.
    """
    wanted = {str(i) for i in spec.layers}
    missing = sorted(wanted - set(layers.keys()), key=int)
    if missing:
        raise PipelineError(
            f"stage {spec.index} holds layers {missing} that the model's layer dict lacks "
            f"(it has {len(layers)}); plan the pipeline with the model's num_layers"
        )
    for key in [k for k in layers if k not in wanted]:
        del layers[key]
    return layers
