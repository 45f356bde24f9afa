"""d9d.trainer.planning: the one owner of what a job will build: `plan_job` decides, `Trainer` builds
from the plan, `d9d plan` prints it.

    plan = plan_job(job, context)                          # a real rank's context, or
    with DistributedContext.for_planning(job.config.mesh) as ctx:
        plan = plan_job(job, ctx, device="cuda", memory=True)   # any world size, in one process

A `JobPlan` holds the mesh, the precision, the declared batching, the pipeline layout (this rank's
stages and the schedule's bubble), the sequence length and where it came from with its
context-parallel split, the vocabulary size, the optimizer state per parameter and, when asked for,
the memory estimate per rank with one microbatch's activations (under pipeline parallelism every
pp rank's, `RankMemory`; `MemoryPlan.total` is the rank that needs the most). `plan_config` plans a
job config as `d9d plan` does (rank 0, on a context of the mesh's size), and `plan_fit` says whether
a plan fits in a device's memory and which config changes (levers) would make it fit, each re-planned. `d9d preflight`
checks the nodes of a launch against the plan (`d9d.trainer.planning.preflight`).
"""

from typing import TYPE_CHECKING

from d9d.mesh.lazy import lazy_face

if TYPE_CHECKING:  # the public names, listed once: `lazy_face` reads this block
    from d9d.trainer.planning.activations import estimate_activations
    from d9d.trainer.planning.fit import FIT_HEADROOM, FitPlan, Lever, plan_fit
    from d9d.trainer.planning.job_plan import plan_config, plan_job
    from d9d.trainer.planning.memory import estimate_memory
    from d9d.trainer.planning.plan import (
        ActivationEstimate,
        JobPlan,
        MemoryEstimate,
        MemoryPlan,
        PipelinePlan,
        RankMemory,
        SequencePlan,
    )

__all__, __getattr__, __dir__ = lazy_face(__name__, globals())
