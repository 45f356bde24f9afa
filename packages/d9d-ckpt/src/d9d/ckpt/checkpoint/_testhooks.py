"""Environment hooks that hold a save at one exact point, so that crash tests can kill it there."""

import os
import time

__all__ = ["PAUSE_BEFORE_COMMIT_ENV", "PAUSE_IN_PRUNE_ENV", "pause_for_test"]

#: Seconds rank 0 sleeps between "every rank finished writing" and the commit, so that crash tests
#: can kill a job in exactly that window. `SECONDS@STEP` pauses only the save of STEP.
PAUSE_BEFORE_COMMIT_ENV = "D9D_CKPT_TEST_PAUSE_BEFORE_COMMIT"
#: Seconds the pruning thread sleeps after an old checkpoint was renamed aside and before it is
#: deleted (the crash window of retention). `SECONDS@STEP` pauses only the prune after saving STEP.
PAUSE_IN_PRUNE_ENV = "D9D_CKPT_TEST_PAUSE_IN_PRUNE"


def pause_for_test(env: str, step: int) -> None:
    """Sleep as the test hook `env` (`SECONDS` or `SECONDS@STEP`) says; a no-op when it is unset."""
    value = os.environ.get(env)
    if not value:
        return
    seconds, _, only_step = value.partition("@")
    if not only_step or int(only_step) == step:
        time.sleep(float(seconds))
