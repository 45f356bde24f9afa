"""Where training's randomness comes from: one stream per rank and place, derived from the run seed.

The global generators are re-seeded at fixed points of every step, each seed derived from
`trainer.determinism.seed` and a key (`stream_seed`), so every draw is a function of the run seed and
where it happens, never of what ran before it in this process:

- a step's data (what the training process loads itself, a task's `prepare_step`): torch's, numpy's
  and Python's generators from (step, data-parallel index). Ranks that hold the same data (tensor-,
  context-parallel and pipeline ranks of one data-parallel group) draw alike; data-parallel ranks
  differ.
- each microbatch's forward and backward (dropout): torch's generator from (step, the microbatch's
  place in the global batch, context-parallel index, pipeline stage). The place is dp index ×
  microbatches per rank + i, where d9d.data puts the microbatch, so on any data-parallel degree (at
  the same `microbatch_size`) the masks are those of one process; tensor-parallel ranks draw the same
  masks for the activations they share.
- a pipeline on a torch without per-stage forward contexts (`Pipeline.around_stage_forwards`): one
  stream per (step, data-parallel index, pipeline index, context-parallel index), drawn in the
  schedule's order.

So a resumed run draws exactly what an uninterrupted one draws. docs/checkpointing.md, "Randomness",
states the contract.
"""

import random
from dataclasses import dataclass

import numpy as np
import torch

from d9d.mesh import DistributedContext

__all__ = ["TrainingRandomness", "stream_seed"]

# The first key of each stream: streams of one step never share a seed.
_DATA, _MICROBATCH, _PIPELINE = 0, 1, 2


def stream_seed(seed: int, *key: int) -> int:
    """A 63-bit seed from the run seed and a key of non-negative ints (numpy's `SeedSequence` hash,
    stable across numpy versions): distinct keys give unrelated streams."""
    words = np.random.SeedSequence([seed, *key]).generate_state(2, dtype=np.uint32)
    return (int(words[0]) << 31 | int(words[1]) >> 1) & (2**63 - 1)


@dataclass(frozen=True)
class TrainingRandomness:
    """This rank's random streams: the run seed and the coordinates that key them (no tensor-parallel
    coordinate: a tensor-parallel group computes one logical tensor)."""

    seed: int
    dp_index: int = 0
    pp_index: int = 0
    cp_index: int = 0

    @classmethod
    def of(cls, context: DistributedContext, seed: int) -> "TrainingRandomness":
        """The streams of `context`'s rank (zeros on one process)."""
        return cls(seed, context.coordinate("dp"), context.coordinate("pp"), context.coordinate("cp"))

    def seed_data(self, step: int) -> None:
        """Seed torch, numpy and Python for the data of step `step` (1-based)."""
        value = stream_seed(self.seed, _DATA, step, self.dp_index)
        torch.manual_seed(value)
        np.random.seed(value % 2**32)
        random.seed(value)

    def seed_microbatch(self, step: int, index: int, per_rank: int, *, stage: int = 0) -> None:
        """Seed torch for microbatch `index` of the `per_rank` this rank runs in step `step` (in
        pipeline stage `stage`)."""
        place = self.dp_index * per_rank + index  # its place in the global batch
        torch.manual_seed(stream_seed(self.seed, _MICROBATCH, step, place, self.cp_index, stage))

    def seed_pipeline(self, step: int) -> None:
        """Seed torch for this rank's stages in pipeline step `step` (all its microbatches)."""
        torch.manual_seed(
            stream_seed(self.seed, _PIPELINE, step, self.dp_index, self.pp_index, self.cp_index)
        )
